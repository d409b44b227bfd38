#!/usr/bin/env bash
# GEAR in TRL on two CPU processes: torchrun, gloo backend on 127.0.0.1, a tiny random Llama,
# 2 steps, under DDP (default), DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 (scripts/distributed_run.py).
# Each rank writes OUTPUT_DIR/gear_rank<r>.json; rank 0 checks that both ranks hold identical
# (gathered) weights and teacher, ran the same number of GEAR forward passes, that the policy
# moved and the teacher holds what it should, writes OUTPUT_DIR/gear_ok.json and prints
# `GEAR_OK {...}` (exit 1 if not).
#   scripts/two_process.sh [OUTPUT_DIR] [scripts/distributed_run.py arguments]
#   e.g. scripts/two_process.sh /tmp/z3 --backend zero3 --teacher frozen
#        scripts/two_process.sh /tmp/f2 --backend fsdp2 --teacher ema
# Environment: PORT (default 29533), STEPS (default 2), PYTHON (default .venv/bin/python).
# The first DeepSpeed run on a machine JIT-compiles DeepSpeed's shared-memory comm op (minutes;
# cached in ~/.cache/torch_extensions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-$(mktemp -d -t gear-2proc-XXXXXX)}
shift || true
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "${PORT:-29533}" \
  scripts/distributed_run.py --output-dir "$OUT" --steps "${STEPS:-2}" "$@"

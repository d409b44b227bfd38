#!/usr/bin/env bash
# Every measurement quoted in BENCHMARKS.md, one after another (they would fight for the cores).
# Usage: bash benchmarks/run_all.sh [RUN_DIR_OF_A_DEFAULT_RUN]   (logs in benchmarks/results/*.log)
# Resumable: the learning study (gear compare) skips finished runs and resumes checkpoints.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
GEAR=.venv/bin/gear
R=benchmarks/results
mkdir -p "$R"
DEFAULT_RUN=${1:-}
DATA=../shared/data

step() { echo "== $(date -u +%H:%M:%S) $1"; }

step "step benchmark";    $PY -m benchmarks.step --steps 4 --repeats 3 > $R/step.log 2>&1
step "learning study";    $GEAR compare --config study --methods grpo --methods gear --methods gear_token \
                            --methods rlsd --seeds 0 --seeds 1 --seeds 2 --out runs/study > $R/study.log 2>&1
step "signals benchmark"; $PY -m benchmarks.signals --vocab 49152 151936 --T 512 2048 8192 \
                            --methods hidden chunked_logits trl --chunk-size 256 1024 --repeats 2 > $R/signals.log 2>&1
step "signals naive";     $PY -m benchmarks.signals --vocab 49152 151936 --T 512 2048 8192 --methods naive \
                            --repeats 2 --name signals_naive > $R/signals_naive.log 2>&1
step "signals, small chunks"; $PY -m benchmarks.signals --vocab 49152 151936 --T 512 --methods hidden \
                            --chunk-size 64 128 --repeats 2 --name signals_small_chunks > $R/signals_small_chunks.log 2>&1
step "signals, GEMMs alone"; $PY -m benchmarks.signals --vocab 49152 151936 --T 2048 --methods gemm_only hidden \
                            --chunk-size 256 --repeats 2 --name signals_gemm > $R/signals_gemm.log 2>&1
step "student states"; $PY -m benchmarks.student_states > $R/student_states.log 2>&1
step "credit benchmark";  $PY -m benchmarks.credit --repeats 2 > $R/credit.log 2>&1
for target in smollm2 ${DEFAULT_RUN:+"$DEFAULT_RUN"}; do
  out=$R/eval_$(basename "$target"); mkdir -p "$out"
  step "eval $target gsm8k"; $GEAR eval "$target" --task gsm8k --task-option "path=$DATA/gsm8k" --n 200 \
                               --max-new-tokens 256 --batch-size 32 --out "$out" > "$out/gsm8k.log" 2>&1
  for split in test train; do  # gear's 80/20 split of simple_python; neither model trained on it
    step "eval $target bfcl $split"; $GEAR eval "$target" --task bfcl --split $split \
                               --task-option "data_dir=$DATA/bfcl" --task-option "categories=simple_python" \
                               --n 400 --max-new-tokens 128 --batch-size 32 --out "$out" > "$out/bfcl_$split.log" 2>&1
  done
done
step "done"

#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS (issue 48), in one call on a machine with a CUDA torch.
#   bash benchmarks/gpu.sh signals   # signal kernels: chunk, fold, TRL's, the GEMM floors
#   bash benchmarks/gpu.sh step      # a training step: GRPO vs GEAR, the teacher skip, LoRA
# Results go to $OUT (default benchmarks/results) with the GPU's name. Wheels that the machine
# lacks (trl and what it imports) may be carried in .cache/wheels: they are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
if ! python -c "import trl" 2>/dev/null && ls .cache/wheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps .cache/wheels/*.whl
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
case "${1:-signals}" in
  signals)
    python benchmarks/signals.py --device cuda --dtype bfloat16 --hidden 2048 --T 16384 \
      --vocab 151936 49152 --methods hidden fold trl gemm_only gemm_tiles \
      --chunk-size 256 4096 --repeats 5 --name "$(realpath "$OUT")/signals_gpu"
    ;;
  step)
    python benchmarks/step.py --device cuda "${@:2}" --out "$(realpath "$OUT")/step_gpu.json"
    ;;
esac

#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS (issue 48), in one call on a machine with a CUDA torch.
#   bash benchmarks/gpu.sh signals [args]   # signal kernels: chunk, fold, TRL's, the GEMM floors
#   bash benchmarks/gpu.sh step [args]      # a training step: GRPO vs GEAR (benchmarks/step.py)
# Results go to $OUT (default benchmarks/results) with the GPU's name. Wheels the machine lacks
# (trl and what it imports) may be carried in .cache/wheels: the missing ones are installed.
# The step benchmark's 1.7B shape (SmolLM2-1.7B's config, SmolLM2's tokenizer, random weights):
#   .cache/smollm2-1.7b-shape, written by `python benchmarks/gpu.sh shape` on a machine with gear.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath "${OUT:-benchmarks/results}")
mode=${1:-signals}
shift || true
if [ "$mode" = shape ]; then
  python - <<'PY'
import json, shutil
from pathlib import Path
from gear.models import smollm2_dir, smollm2_tokenizer
target = Path(".cache/smollm2-1.7b-shape")
target.mkdir(parents=True, exist_ok=True)
config = json.loads((smollm2_dir() / "config.json").read_text())
config |= dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
               num_attention_heads=32, num_key_value_heads=32, rope_theta=130000,
               max_position_embeddings=8192)  # SmolLM2-1.7B's
(target / "config.json").write_text(json.dumps(config, indent=1))
smollm2_tokenizer().save_pretrained(target)
print(f"wrote {target}")
PY
  exit 0
fi
missing=""
for spec in trl:trl datasets:datasets dill:dill multiprocess:multiprocess; do
  python -c "import ${spec%%:*}" 2>/dev/null || missing="$missing ${spec#*:}"
done
if [ -n "$missing" ]; then
  python -m pip install -q --no-deps --no-index --find-links .cache/wheels $missing
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
case "$mode" in
  signals)
    python -m benchmarks.signals --device cuda --dtype bfloat16 --hidden 2048 --T 16384 \
      --repeats 5 --name "$OUT/signals_gpu" "$@"
    ;;
  step)
    python -m benchmarks.step --name "$OUT/step_gpu" "$@"
    ;;
esac

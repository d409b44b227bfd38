#!/usr/bin/env bash
# CPU venv with verl 0.9.1 on its OWN dependency pins: creates .venv-verl in the repo root.
#
# The main venv (scripts/setup.sh) runs transformers 5.23 and installs verl with --no-deps, past
# its `transformers>=5.5.3,<5.11,!=5.6.0` pin. This venv is the other half: verl's resolver picks
# everything (transformers 5.10.x), then gear goes on top without moving any of it, so CI runs
# gear's verl tests on the stack a verl user gets.
#   bash scripts/setup_verl.sh                      # create / update (cheap when up to date)
#   .venv-verl/bin/python -m pytest -q tests/integrations/verl/test_verl*.py
#
# What is installed, and what is not:
#   - torch 2.13.0+cpu, first (as setup.sh does), and pinned in every later resolve: verl itself
#     does not require torch, but peft / accelerate / torchdata do, and a resolve that picked
#     torch on its own would fetch a multi-GB CUDA build.
#   - verl==0.9.1 with its base requirements, resolved by pip from verl's metadata (transformers,
#     ray[default], tensordict, hydra-core, peft, torchdata, datasets, wandb, tensorboard, ...).
#     All of them install on CPU.
#   - from verl's `verl-core` extra, only what its CPU-testable modules import: TransferQueue
#     (its own requirement >=0.1.10; 0.1.11 as gear's `verl` extra), pyzmq, msgspec, fastapi,
#     uvicorn, cachetools. Left out: torchcodec (its PyPI wheel breaks imports beside CPU torch;
#     video only), qwen_vl_utils (multimodal), mathruler, nvtx (GPU profiling ranges) and verl's
#     test plugins. None of verl's other extras: `fsdp` / `vllm` / `sglang` / `megatron` pin
#     torch 2.11 (a CUDA wheel on PyPI) and GPU packages (flash-attn, cupy-cuda13x, vllm, sglang,
#     megatron), and `cpu`, despite its name, pins that torch 2.11 and transformers 5.9.0 too.
#   - gear (editable) with its own requirements and the test tools, under a constraints file that
#     pins the step above's whole dependency closure: nothing verl resolved may change (pip fails
#     instead), gear's other packages (trl, math-verify, ...) are only added. Not gear's whole dev
#     extra: deepspeed (an sdist build) and bitsandbytes are for the main venv's distributed/QLoRA
#     tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-verl
VERL=verl==0.9.1
TORCH=torch==2.13.0

# Re-running is cheap: skip everything when this script and pyproject.toml are unchanged since
# the last complete install and the key packages are still there.
STAMP="$VENV/.gear-setup-stamp"
want=$(cat "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "
import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(m) for m in ('verl', 'transfer_queue', 'trl', 'gear')))"
then
  echo "gear: $VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  $PIP install -q "$TORCH"
fi
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(not torch.__version__.endswith('+cpu'))"
then
  echo "gear: $VENV has a non-CPU torch; remove $VENV and run again" >&2
  exit 1
fi

# 1. verl and the verl-core modules its CPU-testable code imports, in one resolve of verl's own.
ROOTS=("$VERL" "TransferQueue==0.1.11" pyzmq msgspec fastapi uvicorn cachetools)
$PIP install -q "${ROOTS[@]}" "$TORCH"

# 2. gear on top, with every package of step 1's dependency closure pinned to the version it
# resolved (transformers among them): gear's install may add packages, never move one of verl's.
# The closure rather than a plain `pip freeze`, so that a re-run after a change to gear's own
# requirements does not pin gear's other dependencies to their old versions.
CONSTRAINTS="$VENV/verl-resolved.txt"
"$VENV/bin/python" - "${ROOTS[@]}" >"$CONSTRAINTS" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pins, seen, todo = {}, set(), [Requirement(a) for a in sys.argv[1:]]
while todo:
    req = todo.pop()
    name = canonicalize_name(req.name)
    for extra in ["", *sorted(req.extras)]:
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement whose marker left it out (another platform or Python)
        pins[name] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                todo.append(sub)
print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))
PYEOF
$PIP install -q -c "$CONSTRAINTS" -e . "pytest>=8" "hypothesis>=6.100"

# pip check must be clean: this venv has no deliberate conflicts.
$PIP check
"$VENV/bin/python" -c "
import transformers, trl, torch, verl, gear.integrations.verl.plugin
print('gear: verl', verl.__version__, 'transformers', transformers.__version__, 'trl',
      trl.__version__, 'torch', torch.__version__)"
echo "$want" >"$STAMP"
echo "gear: setup complete ($VENV)"

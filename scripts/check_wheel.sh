#!/usr/bin/env bash
# The wheel check (CI): build gear's wheel, install it in a fresh venv and, from outside the
# checkout, check that `gear train` finds its shipped default recipe and resolves it.
#
# The fresh venv gets gear from the wheel only; its dependencies (torch, transformers, trl, ...)
# come from the repo's .venv through a .pth path entry, so nothing is downloaded but the build
# backend. A .pth path entry does not run .venv's own .pth files, so .venv's editable gear (which
# points at src/) stays invisible: `import gear` can only find the wheel's copy.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Build from a copy of what the wheel is made of (tracked and new files), so that no build/
# directory is left in the checkout and no stale build/lib file can slip into the wheel.
mkdir -p "$WORK/tree"
git ls-files -co --exclude-standard -z -- pyproject.toml README.md src \
  | xargs -0 cp --parents -t "$WORK/tree"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/tree" 2>&1 | grep -v "is ignored" || true
WHEEL=$(ls "$WORK"/dist/gear_rl-*.whl)
"$PY" -m venv --without-pip "$WORK/venv"
SITE=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' >"$SITE/gear-deps.pth"
"$PY" -m pip --python "$WORK/venv/bin/python" install -q --no-deps "$WHEEL" 2>&1 \
  | grep -v "is ignored" || true

cd "$WORK"  # outside the checkout: no src/, no configs/ next to us
"$WORK/venv/bin/gear" train --help >/dev/null
"$WORK/venv/bin/gear" train --dry-run --output-dir "$WORK/run" >"$WORK/dry-run.txt"
grep -q "^precision: " "$WORK/dry-run.txt"
[ ! -e "$WORK/run" ]
"$WORK/venv/bin/python" - "$ROOT" "$SITE" <<'EOF'
import sys
from pathlib import Path

import gear
from gear.app.config import config_path, recipe_names, resolve_config

root, site = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
here = Path(gear.__file__).resolve()
assert site in here.parents and root not in here.parents, f"gear imported from {here}"
assert {"default", "study"} <= set(recipe_names()), recipe_names()
for name in recipe_names():
    assert site in config_path(name).resolve().parents, config_path(name)
    resolve_config(name)
cfg = resolve_config()
print(f"wheel check: gear from {here.parent}; default recipe: {cfg.model} on {cfg.task}, "
      f"{cfg.trainer['max_steps']} steps")
EOF
echo "wheel check: $(basename "$WHEEL") installs and resolves its recipes outside the checkout"

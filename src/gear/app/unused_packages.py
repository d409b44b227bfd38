"""Optional packages that transformers, accelerate, TRL and PEFT import merely because they are
installed, for features `gear train` and `gear compare` do not have, hidden from those commands
(`hide_unused_packages`, called by the `gear` program as it starts): bitsandbytes (PEFT and
TRL's vLLM module; on an AVX512-BF16 CPU its import warns "Failed to load CPU
gemm_4bit_forward from kernels-community"; LoRA runs do not need it) and DeepSpeed
(accelerate imports it to unwrap models; its accelerator probe warns "Setting accelerator to
CPU"). Those commands run without them: seconds of imports and two warnings about features the
run does not use spared. DeepSpeed stays
importable when a run may use it (the word in the command line or its config files, or
`accelerate launch --use_deepspeed`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

UNUSED_PACKAGES = ("bitsandbytes", "deepspeed")
TRAINING_COMMANDS = ("train", "compare")


def _mentions(argv: list[str], word: str) -> bool:
    """Whether `word` occurs in the arguments, or in a file or run directory's config.yaml
    they name (a config recipe, `--resume RUN_DIR`)."""
    for arg in argv:
        if word in arg:
            return True
        path = Path(arg)
        for candidate in (path, path / "config.yaml"):
            try:
                if candidate.is_file() and word in candidate.read_text(errors="replace"):
                    return True
            except OSError:
                continue
    return False


def hide_unused_packages(argv: list[str]) -> list[str]:
    """Make `UNUSED_PACKAGES` unavailable to this process (`sys.modules[name] = None`: the
    availability checks of transformers, accelerate, TRL and PEFT then find nothing, an import
    raises ImportError) when the command is a training one; returns the names hidden. Only for
    the `gear` program itself, before anything imports transformers: a package already imported
    is left alone."""
    argv = [arg for arg in argv if arg != "--debug"]  # the one option before the command
    if not argv or argv[0] not in TRAINING_COMMANDS:
        return []
    hidden = []
    for name in UNUSED_PACKAGES:
        if name in sys.modules:
            continue
        if name == "deepspeed" and (
            os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
            or _mentions(argv[1:], "deepspeed")
        ):
            continue
        sys.modules[name] = None  # type: ignore[assignment]
        hidden.append(name)
    return hidden

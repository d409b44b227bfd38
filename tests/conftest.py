"""Suite-wide isolation. Accelerate keeps its state (mixed precision, device) in process-wide
singletons: a `gear train` run inside a test (CliRunner) on a CPU with native bf16 left
`mixed_precision="bf16"` behind, and a later test's `Accelerator(cpu=True)` then ran under bf16
autocast (tests/integrations/trl/test_loss_prefix.py's gradients failed after
tests/credit/test_first_error.py's `gear compare` on AVX512-BF16 only). Every test module starts
from a fresh state (per module, not per test: a module-scoped trainer fixture keeps the state it
was built with).

Hypothesis: `HYPOTHESIS_PROFILE=ci` (set by .ci/run) draws the same examples on every run, so CI
checks what the last local run with that profile checked; without it each run draws anew, which
is how the suite keeps finding cases (two CI failures came from fresh draws)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="module")
def _fresh_accelerate_state():
    yield
    try:  # the verl venv runs some test modules without accelerate
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)

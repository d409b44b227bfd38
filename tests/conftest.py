"""Suite-wide isolation. Accelerate keeps its state (mixed precision, device) in process-wide
singletons: a `gear train` run inside a test (CliRunner) on a CPU with native bf16 left
`mixed_precision="bf16"` behind, and a later test's `Accelerator(cpu=True)` then ran under bf16
autocast (tests/integrations/trl/test_loss_prefix.py's gradients failed after tests/credit/test_first_error.py's
`gear compare` on AVX512-BF16 only). Every test module starts from a fresh state (per module,
not per test: a module-scoped trainer fixture keeps the state it was built with)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_accelerate_state():
    yield
    try:  # the verl venv runs some test modules without accelerate
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)

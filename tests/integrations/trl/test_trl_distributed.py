"""Two CPU processes under DDP (torchrun, gloo): scripts/two_process.sh trains 2 GEAR steps with
an EMA teacher; the ranks end with identical weights and EMA teacher after running the same
number of GEAR forwards. DeepSpeed and FSDP: tests/integrations/trl/test_trl_deepspeed.py, tests/integrations/trl/test_trl_fsdp.py."""

from __future__ import annotations

import pytest

from _two_process import SKIP_ALL, assert_lockstep, run_two_processes


@pytest.mark.skipif(SKIP_ALL, reason="GEAR_SKIP_DISTRIBUTED=1")
def test_two_processes_train_in_lockstep(tmp_path):
    verdict = run_two_processes(tmp_path, "--backend", "ddp", "--teacher", "ema", timeout=300)
    assert_lockstep(verdict, "ddp", "ema")
    assert verdict["ranks"][0]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert (tmp_path / "credit" / "step_000001.jsonl").is_file()

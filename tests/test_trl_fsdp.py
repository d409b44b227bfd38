"""GEARTrainer under FSDP2 (accelerate's `fully_shard`, via `fsdp="full_shard"` and
`fsdp_config={"version": 2}`) on two CPU processes (gloo), with the current, frozen and EMA
teachers (scripts/two_process.sh -> scripts/distributed_run.py). The frozen / EMA teacher is
sharded like TRL's reference model (`prepare_fsdp`); the EMA updates each rank's shard.

accelerate 1.15 does not enable FSDP on CPU: with `use_cpu` the process type is MULTI_CPU and
the FSDP plugin is dropped (the model gets DDP, without a warning). The harness forces the FSDP
state (`scripts/distributed_run.py: allow_fsdp_on_cpu`); the checks below assert that the
weights really are DTensor shards."""

from __future__ import annotations

import pytest

from _two_process import SKIP_ALL, assert_lockstep, run_teachers


@pytest.mark.distributed
@pytest.mark.skipif(SKIP_ALL, reason="GEAR_SKIP_DISTRIBUTED=1")
def test_fsdp2_two_processes_with_each_teacher(tmp_path):
    """current, frozen and EMA teachers, trained in turn in one launch."""
    verdicts = run_teachers(tmp_path, "fsdp2", ("current", "frozen", "ema"), timeout=600)
    for teacher, verdict in verdicts.items():
        assert_lockstep(verdict, "fsdp2", teacher)
        assert all(r["distributed_type"] == "DistributedType.FSDP" for r in verdict["ranks"])


@pytest.mark.distributed
@pytest.mark.skipif(SKIP_ALL, reason="GEAR_SKIP_DISTRIBUTED=1")
def test_fsdp2_peft_two_processes_with_each_teacher(tmp_path):
    """LoRA under FSDP2: the teachers use the sharded policy itself (adapter disabled, or the
    float32 EMA of the adapter written into the DTensor shards for the teacher pass)."""
    verdicts = run_teachers(tmp_path, "fsdp2", ("current", "frozen", "ema"), "--peft", timeout=600)
    for teacher, verdict in verdicts.items():
        assert_lockstep(verdict, "fsdp2", teacher, peft=True)

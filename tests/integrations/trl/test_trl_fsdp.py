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
import torch

from _two_process import SKIP_ALL, assert_lockstep, run_teachers, run_two_processes


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


@pytest.mark.distributed
@pytest.mark.skipif(SKIP_ALL, reason="GEAR_SKIP_DISTRIBUTED=1")
def test_fsdp2_bf16_ema_checkpoint_holds_full_float32_masters_and_resumes_them(tmp_path):
    """A bf16 policy (TRL's dtype="auto") under bf16 mixed precision: the bf16 EMA teacher keeps
    float32 masters, which FSDP2 holds as each rank's shard. The checkpoint must hold them whole
    (every parameter at its full shape, float32), a resumed run must restore them bit for bit,
    and the continued run must end with the uninterrupted run's masters and teacher."""
    from safetensors.torch import load_file

    from _trl_helpers import byte_tokenizer, tiny_model
    from gear.integrations.trl import TEACHER_FILE

    bf16 = ("--backend", "fsdp2", "--teacher", "ema", "--dtype", "bfloat16", "--bf16")
    full = run_two_processes(tmp_path / "a", *bf16, "--save", timeout=420)
    assert_lockstep(full, "fsdp2", "ema")  # the float32 masters follow the EMA recursion
    assert full["ranks"][0]["teacher_dtypes"] == ["torch.bfloat16"]
    shapes = {
        k: tuple(v.shape)
        for k, v in tiny_model(byte_tokenizer(), hidden=32, layers=2).named_parameters()
    }
    for step in (1, 2):
        saved = load_file(tmp_path / "a" / f"checkpoint-{step}" / TEACHER_FILE)
        assert {k: tuple(v.shape) for k, v in saved.items() if k in shapes} == shapes
        assert all(saved[k].dtype == torch.float32 for k in shapes)  # the masters
    resumed = run_two_processes(
        tmp_path / "b", *bf16, "--resume", str(tmp_path / "a" / "checkpoint-1"), timeout=420
    )
    assert resumed["ok"]
    for r in resumed["ranks"]:
        assert r["restored_teacher"]["ok"] and r["restored_teacher"]["tensors"] >= len(shapes), r
    for key in ("param_checksum", "teacher_checksum", "teacher_state_checksum"):
        assert resumed["ranks"][0][key] == pytest.approx(full["ranks"][0][key], abs=1e-5), key

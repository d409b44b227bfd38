"""GEARTrainer under DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo), with the current,
frozen and EMA teachers (scripts/two_process.sh -> scripts/distributed_run.py), plus the
ZeRO-3-specific teacher code on one process.

ZeRO-3 partitions every parameter of the tiny model (`stage3_param_persistence_threshold: 0`):
the frozen teacher is built from the config under `zero.Init` and filled from the gathered
policy (as TRL builds its reference model), the EMA update gathers both models, a frozen
teacher given by path is loaded partitioned and its vocabulary checked on full shapes.
"""

from __future__ import annotations

import pytest
import torch

from _trl_helpers import byte_tokenizer, make_trainer, tiny_model
from _two_process import SKIP_ALL, assert_lockstep, run_teachers, run_two_processes
from gear.integrations.trl.teacher_model import check_teacher_vocabulary, full_shape

deepspeed = pytest.importorskip("deepspeed")

two_processes = pytest.mark.skipif(SKIP_ALL, reason="GEAR_SKIP_DISTRIBUTED=1")


def _partitioned_like_zero3(model: torch.nn.Module) -> None:
    """What a model loaded under `zero.Init` looks like from outside a gather: size-0 data,
    the full shape in `ds_shape`."""
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0, dtype=p.dtype)


def test_deepspeed_vocabulary_check_reads_full_shapes_of_partitioned_heads(tmp_path):
    tok = byte_tokenizer()
    trainer = make_trainer(tmp_path, tok)
    teacher = tiny_model(tok, seed=1)
    _partitioned_like_zero3(teacher)
    assert teacher.get_output_embeddings().weight.shape[0] == 0
    assert full_shape(teacher.get_output_embeddings().weight) == (259, 16)
    check_teacher_vocabulary(trainer.model, tok, teacher, None)  # not "its LM head has 0 rows"

    bigger = byte_tokenizer()
    bigger.add_tokens(["<extra>"])
    other = tiny_model(bigger)
    _partitioned_like_zero3(other)
    with pytest.raises(ValueError, match="LM head has 260 rows"):
        check_teacher_vocabulary(trainer.model, tok, other, None)


@pytest.mark.distributed
@two_processes
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_processes_with_each_teacher(tmp_path, stage):
    """current, frozen and EMA teachers, trained in turn in one launch."""
    backend = f"zero{stage}"
    verdicts = run_teachers(tmp_path, backend, ("current", "frozen", "ema"), timeout=600)
    for teacher, verdict in verdicts.items():
        assert_lockstep(verdict, backend, teacher)
        assert all(r["distributed_type"] == "DistributedType.DEEPSPEED" for r in verdict["ranks"])
    # ZeRO partitions optimizer states (and at stage 3 the weights), not the arithmetic: the
    # current teacher's signals match across stages and DDP (tests/integrations/trl/test_trl_distributed.py)
    assert verdicts["ema"]["ranks"][0]["teacher_check"]["max_moved"] > 1e-4
    if stage == 3:
        # the EMA update gathers one module's parameters (teacher's and policy's) at a time:
        # at most the largest module of both models is whole at once, never both models; the
        # result is the recursion above (max error 1e-5), i.e. the all-at-once update's
        for r in verdicts["ema"]["ranks"]:
            g = r["ema_gathers"]
            assert g["gathers"] > 0 and g["peak_available"] <= 2 * g["largest_module"], g
            assert g["peak_available"] < g["both_models"], g


@pytest.mark.distributed
@two_processes
def test_deepspeed_zero3_frozen_teacher_from_a_path(tmp_path):
    """The teacher is loaded under zero.Init (size-0 shards) by `create_model_from_path`."""
    verdict = run_two_processes(
        tmp_path, "--backend", "zero3", "--teacher", "frozen", "--teacher-path", timeout=420
    )
    assert_lockstep(verdict, "zero3", "frozen")


@pytest.mark.distributed
@two_processes
def test_deepspeed_zero3_peft_two_processes_with_each_teacher(tmp_path):
    """LoRA under ZeRO-3: the frozen teacher disables the partitioned policy's adapter, the EMA
    swaps its gathered adapter weights for the float32 average."""
    verdicts = run_teachers(tmp_path, "zero3", ("current", "frozen", "ema"), "--peft", timeout=600)
    for teacher, verdict in verdicts.items():
        assert_lockstep(verdict, "zero3", teacher, peft=True)


@pytest.mark.distributed
@two_processes
def test_deepspeed_zero3_ema_checkpoint_resumes_the_same_teacher(tmp_path):
    """The EMA teacher, partitioned, is gathered into the checkpoint by every rank (full shapes)
    and restored on resume: the continued run ends where the uninterrupted one did."""
    from safetensors.torch import load_file

    from gear.integrations.trl import TEACHER_FILE

    full = run_two_processes(
        tmp_path / "a", "--backend", "zero3", "--teacher", "ema", "--save", timeout=420
    )
    assert_lockstep(full, "zero3", "ema")
    checkpoint = tmp_path / "a" / "checkpoint-1"
    saved = load_file(checkpoint / TEACHER_FILE)
    assert saved["model.embed_tokens.weight"].shape == (259, 32)  # not a size-0 shard
    resumed = run_two_processes(
        tmp_path / "b",
        *("--backend", "zero3", "--teacher", "ema", "--resume", str(checkpoint)),
        timeout=420,
    )
    assert resumed["ok"]
    for key in ("param_checksum", "teacher_checksum"):
        assert resumed["ranks"][0][key] == pytest.approx(full["ranks"][0][key], abs=1e-5)

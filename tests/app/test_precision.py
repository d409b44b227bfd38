"""bf16: auto picks bf16 autocast only where the hardware runs it natively, and the trainer that
`gear train` builds (training, generation, GEAR's teacher pass) follows that one choice."""

from __future__ import annotations

import pytest
import torch

from gear.app import precision as P
from gear.app.config import RunConfig, trainer_args
from gear.app.precision import choose_precision, cpu_flags, native_cpu_bf16
from gear.app.train import build_trainer
from gear.tasks import get_task
from gear.testing import byte_tokenizer, tiny_model

AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma"}  # the flags of this project's EPYC
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        (AVX2_ONLY, False),
        (AVX512_NO_BF16, False),  # AVX512 without its BF16 extension still emulates bf16
        (AVX512_NO_BF16 | {"avx512_bf16"}, True),
        (AVX2_ONLY | {"amx_bf16", "amx_tile"}, True),
        ({"fp", "asimd", "bf16"}, True),  # ARM
    ],
    ids=["avx2", "avx512", "avx512_bf16", "amx", "arm-bf16"],
)
def test_auto_picks_bf16_exactly_where_the_cpu_has_native_bf16(flags, native, cpu_only):
    choice = choose_precision("auto", flags=flags)
    assert choice.bf16 is native and choice.device == "cpu" and choice.asked == "auto"
    assert ("bf16 autocast" if native else "float32") in choice.reason


def test_explicit_settings_are_honoured_and_emulated_bf16_is_flagged(cpu_only):
    forced = choose_precision(True, flags=AVX2_ONLY)
    assert forced.bf16 and "slower" in forced.reason
    off = choose_precision(False, flags=AVX2_ONLY | {"amx_bf16"})
    assert not off.bf16 and "slower" not in off.reason
    assert choose_precision(None, flags=AVX2_ONLY).asked == "auto"
    with pytest.raises(ValueError, match="bf16: got 'maybe'; expected true, false or auto"):
        choose_precision("maybe")


def test_cuda_follows_the_gpu_bf16_support_unless_use_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    t4 = choose_precision("auto", flags=AVX2_ONLY | {"avx512_bf16"})
    assert (t4.bf16, t4.device, t4.capability) == (False, "cuda", "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_precision("auto").bf16
    on_cpu = choose_precision("auto", use_cpu=True, flags=AVX2_ONLY)
    assert (on_cpu.bf16, on_cpu.device) == (False, "cpu")


def test_cpu_flags_are_read_from_x86_flags_and_arm_features(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "absent") is None


def test_without_cpuinfo_onednn_decides(monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda *a: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert native_cpu_bf16() == (True, "no /proc/cpuinfo; oneDNN reports bf16 supported")


@pytest.mark.parametrize("native", [False, True], ids=["float32", "bf16"])
def test_the_run_trainer_follows_the_choice_in_training_generation_and_teacher_pass(
    native, monkeypatch, tmp_path, cpu_only
):
    """`bf16` reaches GEARConfig as a bool and accelerate's mixed precision follows it; in one
    training step every forward (generation, GEAR's teacher pass, the loss) runs its matmuls in
    the chosen dtype."""
    flags = AVX2_ONLY | ({"amx_bf16"} if native else set())
    monkeypatch.setattr(P, "cpu_flags", lambda *a: flags)
    cfg = RunConfig(trainer={"max_steps": 1, "per_device_train_batch_size": 2,
                             "num_generations": 2, "max_completion_length": 4,
                             "save_strategy": "no"})  # fmt: skip
    args = trainer_args(cfg, tmp_path, hint_kind="math")
    assert args.bf16 is native and args.activation_checkpointing is False
    tok = byte_tokenizer()
    task = get_task("arithmetic")
    data = task.dataset("train", n=4, seed=0)
    trainer = build_trainer(args, tiny_model(tok), tok, task, data, callbacks=[])
    assert trainer.accelerator.mixed_precision == ("bf16" if native else "no")
    seen: list[tuple[bool, torch.dtype]] = []
    trainer.model.model.layers[-1].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.append((torch.is_grad_enabled(), o.dtype))
    )
    trainer.train()
    assert {grad for grad, _ in seen} == {False, True}  # no-grad passes and the loss forward
    assert {dtype for _, dtype in seen} == {torch.bfloat16 if native else torch.float32}


def test_the_deprecated_gradient_checkpointing_name_still_takes_effect(tmp_path, cpu_only):
    cfg = RunConfig(trainer={"gradient_checkpointing": True})
    args = trainer_args(cfg, tmp_path, precision=choose_precision(False))
    assert args.activation_checkpointing is True

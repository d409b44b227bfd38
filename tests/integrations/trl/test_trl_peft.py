"""GEARTrainer with PEFT LoRA adapters (and QLoRA on a 4-bit bitsandbytes model): the three
teachers on the tiny model, resume included, and the EMA arithmetic (float32, float tensors only).

- `current`: the policy with its adapter; `frozen`: the same model with the adapter disabled
  (the teacher owns no weights: no copy of the base); `ema`: a float32 moving average of the
  trainable adapter weights only, swapped in for the teacher pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from _trl_helpers import byte_tokenizer, make_trainer, parameters, tiny_model
from gear.integrations.trl import TEACHER_FILE
from gear.integrations.trl.teacher_model import AdapterTeacher, update_ema

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def frozen_base(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}


IDS = torch.tensor([[5, 70, 71, 72, 73, 74, 101, 102], [9, 80, 81, 82, 83, 84, 85, 86]])


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


class _AfterStep:
    """Adapter weights and EMA values after every optimizer step (after the EMA update)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        snaps = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                snaps.policy.append(adapter(trainer.model))
                values = trainer.teacher_model.values
                snaps.teacher.append({k: v.clone() for k, v in values.items()})

        self.policy: list[dict] = []
        self.teacher: list[dict] = []
        trainer.add_callback(Callback())


def test_peft_current_teacher_trains_the_adapter_only(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, teacher="current", peft_config=lora(), max_steps=2)
    trained, base = adapter(trainer.model), frozen_base(trainer.model)
    trainer.train()
    assert trainer.teacher_model is None
    assert trained and all(".lora_" in k for k in trained)
    assert any(not torch.equal(v, adapter(trainer.model)[k]) for k, v in trained.items())
    assert all(torch.equal(v, frozen_base(trainer.model)[k]) for k, v in base.items())
    assert all(h["gear/kl_mean"] > 0 for h in trainer.state.log_history if "gear/kl_mean" in h)


def test_peft_frozen_teacher_is_the_policy_with_its_adapter_disabled(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, teacher="frozen", peft_config=lora(), max_steps=2)
    trainer.train()
    teacher, policy = trainer.teacher_model, trainer.model
    # no copy of the base model: the teacher owns no tensor at all
    assert list(teacher.parameters()) == [] and list(teacher.buffers()) == []
    assert teacher.values is None
    initial = tiny_model(tok)  # the base weights the run started from
    torch.testing.assert_close(logits(teacher), logits(initial), rtol=0, atol=1e-5)
    # the adapter moved and is back on after the teacher pass
    assert (logits(policy) - logits(initial)).abs().max() > 1e-3
    # step 2 is scored against the base model, not the trained adapter
    assert trainer.state.log_history[1]["gear/kl_mean"] > 0


def test_peft_frozen_teacher_of_a_pretrained_adapter_keeps_its_initial_values(tmp_path, tok):
    """A `PeftModel` whose adapter is not the identity (here random B): disabling it would give
    the base model, not the initial policy, so the teacher swaps in the initial adapter."""
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(tiny_model(tok), config)
    initial = logits(model)
    assert (initial - logits(tiny_model(tok))).abs().max() > 1e-3  # not the base model
    trainer = make_trainer(tmp_path, tok, model=model, teacher="frozen", max_steps=2)
    trainer.train()
    teacher = trainer.teacher_model
    assert list(teacher.parameters()) == [] and teacher.values is not None
    assert (logits(trainer.model) - initial).abs().max() > 1e-3  # the adapter trained
    torch.testing.assert_close(logits(teacher), initial, rtol=0, atol=1e-5)


def test_peft_ema_teacher_averages_the_adapter_weights_in_float32(tmp_path, tok):
    decay = 0.5
    trainer = make_trainer(
        tmp_path, tok, teacher="ema", ema_decay=decay, peft_config=lora(), max_steps=2
    )
    previous = adapter(trainer.model)
    snaps = _AfterStep(trainer)
    trainer.train()
    teacher = trainer.teacher_model
    assert list(teacher.parameters()) == []  # no copy of the base
    assert set(teacher.values) == set(previous) and all(".lora_" in k for k in previous)
    assert all(v.dtype == torch.float32 for v in teacher.values.values())
    for policy, ema in zip(snaps.policy, snaps.teacher, strict=True):
        for k, v in ema.items():
            torch.testing.assert_close(v, decay * previous[k] + (1 - decay) * policy[k])
        previous = ema
    # the teacher computes the policy with the EMA adapter swapped in, and swaps it back
    after = adapter(trainer.model)
    expected = _with_adapter(trainer.model, teacher.values)
    torch.testing.assert_close(logits(teacher), expected)
    assert all(torch.equal(v, adapter(trainer.model)[k]) for k, v in after.items())


def _with_adapter(model: nn.Module, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits with its trainable parameters set to `values` (then restored)."""
    params = dict(model.named_parameters())
    saved = {k: params[k].detach().clone() for k in values}
    with torch.no_grad():
        for k, v in values.items():
            params[k].copy_(v)
        out = logits(model)
        for k, v in saved.items():
            params[k].copy_(v)
    return out


@pytest.mark.parametrize("teacher", ["frozen", "ema"])
def test_peft_resumed_run_continues_with_the_same_teacher(tmp_path, tok, teacher):
    options = dict(teacher=teacher, ema_decay=0.5, max_steps=2, save_strategy="steps", save_steps=1)
    first = make_trainer(tmp_path / "a", tok, peft_config=lora(), **options)
    first.train()
    checkpoint = tmp_path / "a" / "checkpoint-1"
    # a disabled adapter has no weights of its own to save; the EMA writes its float32 values
    assert (checkpoint / TEACHER_FILE).is_file() == (teacher == "ema")

    second = make_trainer(tmp_path / "b", tok, model=tiny_model(tok), peft_config=lora(), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "gear_teacher.safetensors not found"
        warnings.filterwarnings("ignore", message=".*(deprecat|Trainer|checkpoint).*")
        second.train(resume_from_checkpoint=str(checkpoint))
    final_a, final_b = adapter(first.model), adapter(second.model)
    for k in final_a:
        torch.testing.assert_close(final_b[k], final_a[k])
    if teacher == "ema":
        for k, v in first.teacher_model.values.items():
            torch.testing.assert_close(second.teacher_model.values[k], v)
    else:
        torch.testing.assert_close(logits(second.teacher_model), logits(tiny_model(tok)))


def test_peft_ema_keeps_updates_below_bfloat16_resolution(tok):
    """A bfloat16 adapter: (1 - decay) * (theta - theta_T) is below half a bf16 ulp, so a
    lerp in bf16 would never move; the float32 EMA follows the exact average."""
    model = peft.get_peft_model(tiny_model(tok), lora()).to(torch.bfloat16)
    teacher = AdapterTeacher.for_policy(lambda: model, "ema")
    start = {k: v.clone() for k, v in teacher.values.items()}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in start:
            params[k].add_(1.0 / 64)  # the policy moved: 2 bf16 ulps at ~1, more below
    decay, steps = 0.999, 20
    for _ in range(steps):
        update_ema(teacher, model, decay)
    for k, v in teacher.values.items():
        target = params[k].double()
        exact = target + (start[k].double() - target) * decay**steps
        torch.testing.assert_close(v.double(), exact, rtol=0, atol=1e-6)
        assert (v.double() - start[k].double()).abs().max() > 1e-4  # it moved
    one = torch.ones((), dtype=torch.bfloat16)  # what a lerp_ in bf16 does: nothing
    assert torch.equal(one.lerp(one + 1.0 / 64, 1 - decay), one)


def test_ema_of_a_bfloat16_model_keeps_a_float32_master(tok):
    """Full-model EMA (no PEFT) of a bfloat16 teacher: same float32 arithmetic via a master."""
    policy = tiny_model(tok).to(torch.bfloat16)
    teacher = tiny_model(tok).to(torch.bfloat16)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0 / 64)
    decay, steps = 0.999, 20
    for _ in range(steps):
        update_ema(teacher, policy, decay)
    initial = dict(tiny_model(tok).to(torch.bfloat16).named_parameters())
    for k, v in teacher.named_parameters():
        target = dict(policy.named_parameters())[k].double()
        exact = target + (initial[k].double() - target) * decay**steps
        torch.testing.assert_close(v.double(), exact.to(torch.bfloat16).double())
    assert any(not torch.equal(v, initial[k]) for k, v in teacher.named_parameters())  # it moved


class _WithIntegerTensors(nn.Module):
    """Holds a frozen int8 parameter (like a quantized weight) and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.codes = nn.Parameter(torch.arange(-4, 4, dtype=torch.int8), requires_grad=False)
        self.register_buffer("counts", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("teacher", ["frozen", "ema"])
def test_teachers_of_a_model_with_non_float_tensors(tmp_path, tok, teacher):
    """The QLoRA situation without bitsandbytes: the EMA moves float weights only and never
    `lerp_`s an integer tensor (which raises), and checkpoints keep the integer tensors."""
    model = tiny_model(tok)
    model.model.extra = _WithIntegerTensors()
    options = dict(teacher=teacher, ema_decay=0.5, max_steps=2)
    trainer = make_trainer(
        tmp_path, tok, model=model, save_strategy="steps", save_steps=1, **options
    )
    trainer.train()
    extra = trainer.teacher_model.model.extra
    assert torch.equal(extra.codes, torch.arange(-4, 4, dtype=torch.int8))
    assert torch.equal(extra.counts, torch.arange(3))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "checkpoint-2" / TEACHER_FILE)
    assert saved["model.extra.codes"].dtype == torch.int8
    if teacher == "ema":
        policy, ema = parameters(trainer.model), parameters(trainer.teacher_model)
        assert any(not torch.equal(policy[k], ema[k]) for k in ema if ema[k].is_floating_point())


def _qlora_model(tok, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    tiny_model(tok, hidden=64).save_pretrained(tmp_path / "tiny")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = LlamaForCausalLM.from_pretrained(
        tmp_path / "tiny", quantization_config=quantization, device_map="cpu"
    )
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    return model


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weight each bitsandbytes 4-bit layer computes with (its dequantized codes), read
    through the layer's own forward on the identity. In training mode with an input that requires
    grad, the one call bitsandbytes never repacks on, so reading changes nothing; it works in
    either layout: the standard one and the CPU inference one that an eval-mode no-grad forward
    switches to on an AVX512-BF16 CPU (there a (2048, 1) code tensor becomes (64, 32), with absmax
    rounded to bfloat16, so the raw codes are not comparable)."""
    import bitsandbytes as bnb

    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            training = module.training
            module.train()
            try:
                eye = torch.eye(module.in_features, requires_grad=True)
                out = module(eye).detach()
            finally:
                module.train(training)
            weights[name] = (out - (0 if module.bias is None else module.bias.detach())).T
    return weights


def assert_same_base(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """Equal up to the bfloat16 of bitsandbytes' CPU inference layout (its absmax and its
    kernel's output are bfloat16: relative error below 2^-8 + 2^-9), rtol 2^-6. Moving a code to
    a neighbouring NF4 level changes the weight by 28% or more of itself (levels ..., 0.72, 1.0
    of the block's absmax; from 0, 8% of the absmax), so a changed code, a re-quantized or a
    trained base fails."""
    assert before and set(before) == set(after)
    for name, weight in before.items():
        torch.testing.assert_close(after[name], weight, rtol=2**-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("teacher", ["frozen", "ema"])
def test_peft_qlora_teachers_on_a_4bit_model(tmp_path, tok, teacher):
    """QLoRA with bitsandbytes' CPU 4-bit backend: the quantized base is neither copied, nor
    averaged, nor changed by training (compared as the weights the layers compute with, which
    holds on every CPU class); the adapter gets a gradient at every step and moves; the EMA holds
    the float32 adapter only."""
    model = _qlora_model(tok, tmp_path)
    trainer = make_trainer(
        tmp_path / "run",
        tok,
        model=model,
        teacher=teacher,
        ema_decay=0.5,
        peft_config=lora(),
        max_steps=2,
    )
    base = base_weights(trainer.model)
    before = adapter(trainer.model)
    trainer.train()
    assert list(trainer.teacher_model.parameters()) == []
    assert_same_base(base, base_weights(trainer.model))
    # on AVX512-BF16, bitsandbytes' repacking (left on) made these 0 after the first eval pass
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 2 and all(n > 0 for n in norms), norms
    assert any(not torch.equal(v, adapter(trainer.model)[k]) for k, v in before.items())
    values = trainer.teacher_model.values
    if teacher == "frozen":
        assert values is None
    else:
        assert set(values) == set(before) and all(v.dtype == torch.float32 for v in values.values())
    assert all(h["gear/kl_mean"] >= 0 for h in trainer.state.log_history if "gear/kl_mean" in h)


def test_qlora_base_check_sees_a_changed_base_but_not_the_cpu_repacking(tmp_path, tok):
    """`assert_same_base` fails when the 4-bit base did change: one code byte flipped, or the
    adapter merged into the base (re-quantized, as `merge_adapter` does for vLLM); and passes
    across bitsandbytes' repacking for CPU inference where this CPU does it (AVX512-BF16)."""
    import bitsandbytes as bnb

    model = peft.get_peft_model(_qlora_model(tok, tmp_path), lora())
    base = base_weights(model)
    model.eval()
    with torch.no_grad():  # the call that repacks on AVX512-BF16 (a no-op elsewhere)
        model(input_ids=IDS)
    assert_same_base(base, base_weights(model))

    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    saved = layer.weight.data.clone()
    layer.weight.data.view(-1)[0] ^= 0x11  # two 4-bit codes of one byte
    with pytest.raises(AssertionError, match="down_proj"):
        assert_same_base(base, base_weights(model))
    layer.weight.data.copy_(saved)
    assert_same_base(base, base_weights(model))

    model = peft.get_peft_model(_qlora_model(tok, tmp_path), lora())  # not repacked
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # a trained adapter
    model.merge_adapter()
    with pytest.raises(AssertionError, match="proj"):
        assert_same_base(base, base_weights(model))


def test_qlora_gradients_reach_the_adapter_after_an_eval_pass(tmp_path, tok):
    """On an AVX512-BF16 CPU, bitsandbytes repacks a 4-bit layer for inference on its first
    eval-mode no-grad forward (GEAR's teacher and student passes are such forwards of the policy)
    and from then on passes no gradient through it: every LoRA gradient was 0. GEARTrainer turns
    that repacking off for the policy and undoes it when the model arrives repacked; on an AVX2
    CPU nothing is repacked and the same holds."""
    model = peft.get_peft_model(_qlora_model(tok, tmp_path), lora())
    model.eval()
    with torch.no_grad():  # before the trainer: repacked here on AVX512-BF16
        model(input_ids=IDS)
    trainer = make_trainer(tmp_path / "run", tok, model=model, teacher="frozen")
    policy = trainer.model
    for _ in range(2):
        policy.eval()
        with torch.no_grad():  # what the teacher pass does between optimizer steps
            policy(input_ids=IDS)
        policy.train()
        policy.zero_grad()
        policy(input_ids=IDS).logits.float().pow(2).mean().backward()
        grads = {k: p.grad for k, p in policy.named_parameters() if "lora_B" in k}
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())

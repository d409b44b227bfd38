"""`gear.modeling.lora.merged_lora`: a LoRA model's no-grad forward with each layer's weights
merged for its own forward equals the unmerged forward to float rounding, leaves every weight
bit-identical, and skips what it cannot merge exactly; the trainer's teacher pass uses it."""

from __future__ import annotations

import peft
import pytest
import torch

from _trl_helpers import byte_tokenizer, dataset, make_trainer, tiny_model
from gear.modeling.lora import merged_lora
from gear.testing import tied_reward


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _lora_model(tok, **config):
    model = peft.get_peft_model(
        tiny_model(tok, hidden=32, layers=2),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **config),
    )
    for name, p in model.named_parameters():  # B = 0 at init would make the adapter a no-op
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _hidden(model, ids):
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@torch.no_grad()
def test_merged_forward_equals_the_unmerged_one_and_leaves_weights_untouched(tok):
    model = _lora_model(tok)
    ids = torch.randint(3, 259, (3, 11), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = _hidden(model, ids)
    with merged_lora(model) as n:
        merged = _hidden(model, ids)
        merged_again = _hidden(model, ids)  # every forward merges anew
    assert n == 2 * 7  # every linear of both layers (q k v o gate up down)
    torch.testing.assert_close(merged, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged, merged_again)
    with model.disable_adapter():  # the adapter does change the output: the test can fail
        assert not torch.allclose(_hidden(model, ids), plain, atol=1e-3)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(_hidden(model, ids), plain)  # unmerged again after the block


@torch.no_grad()
def test_a_forward_that_raises_leaves_the_weights_restored(tok):
    model = _lora_model(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer = model.base_model.model.model.layers[1].mlp
    handle = layer.register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError), merged_lora(model):
        _hidden(model, torch.tensor([[5, 6, 7]]))
    handle.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._disable_adapters for m in model.modules() if hasattr(m, "_disable_adapters"))


def test_refuses_gradients_and_skips_what_it_cannot_merge(tok):
    model = _lora_model(tok)
    with pytest.raises(RuntimeError, match="no-grad"), merged_lora(model):
        pass
    with torch.no_grad():
        with merged_lora(_lora_model(tok, use_dora=True)) as n:
            assert n == 0  # DoRA's magnitude is not a weight delta
        with merged_lora(tiny_model(tok)) as n:
            assert n == 0  # no PEFT: nothing to do


def test_the_trainers_lora_teacher_pass_runs_merged_and_gives_the_same_advantages(tmp_path, tok):
    from peft import LoraConfig

    def advantages(merge: bool):
        trainer = make_trainer(
            tmp_path / str(merge), tok, model=tiny_model(tok, hidden=32), data=dataset(4),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
            reward_funcs=tied_reward(0.0), credit_method="gear_token",
            per_device_train_batch_size=8, num_generations=2, merge_lora_passes=merge,
        )  # fmt: skip
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
        counts = []
        real = merged_lora

        def counting(model):
            ctx = real(model)
            counts.append(ctx)
            return ctx

        import gear.integrations.trl.forwards as fw

        fw.merged_lora, saved = counting, fw.merged_lora
        try:
            trainer.model.train()
            torch.manual_seed(0)
            out = trainer._generate_and_score_completions(
                [dict(r) for r in dataset(4) for _ in range(2)]
            )
        finally:
            fw.merged_lora = saved
        return out["advantages"], len(counts)

    on, n_on = advantages(True)
    off, n_off = advantages(False)
    assert n_on >= 1 and n_off == 0  # the teacher pass went through merged_lora
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)

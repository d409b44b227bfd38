"""`gear.modeling.lora.merged_lora`: a LoRA model's no-grad forward with each layer's weights
merged for its own forward equals the unmerged forward to float rounding, for every LoRA
variant peft offers, leaves every weight bit-identical, and runs unmerged what it cannot merge
exactly; the trainer's teacher pass uses it."""

from __future__ import annotations

import peft
import pytest
import torch
from peft.tuners.lora.config import BdLoraConfig, KasaConfig, MontecloraConfig, VeloraConfig
from transformers import GPT2Config, GPT2LMHeadModel

from _trl_helpers import byte_tokenizer, dataset, make_trainer, tiny_model
from gear.modeling.lora import merged_lora
from gear.models import tiny_llama
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
    # raised inside a LoRA layer's own forward: restored at once, not only when the block ends
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    handle = base.register_forward_hook(lambda *a: 1 / 0)
    with merged_lora(model):
        with pytest.raises(ZeroDivisionError):
            _hidden(model, torch.tensor([[5, 6, 7]]))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    handle.remove()


def test_refuses_gradients_and_skips_what_it_cannot_merge(tok):
    model = _lora_model(tok)
    with pytest.raises(RuntimeError, match="no-grad"), merged_lora(model):
        pass
    with torch.no_grad(), merged_lora(tiny_model(tok)) as n:
        assert n == 0  # no PEFT: nothing to do


BIASED = {"attention_bias": True, "mlp_bias": True}  # every linear of the base has a bias
#: every LoRA variant of peft 0.21's LoraConfig buildable on a CPU, as (LoraConfig fields,
#: tiny_llama fields or "gpt2", how many linears merge). 0: the variant runs unmerged. Not here:
#: loftq (CUDA only), eva / corda / lora_ga (data-driven inits of a vanilla adapter), arrow
#: (routes among loaded adapters), qalora / megatron (quantised / tensor-parallel bases).
VARIANTS = {
    "vanilla": ({}, {}, 14),
    # lora_B's bias, scaled like B A x: merged into the base's bias; with none, unmerged
    "lora_bias": ({"lora_bias": True}, BIASED, 14),
    "lora_bias_no_base_bias": ({"lora_bias": True}, {}, 0),
    "base_bias": ({}, BIASED, 14),
    "bias_all": ({"bias": "all"}, BIASED, 14),
    "bias_lora_only": ({"bias": "lora_only"}, BIASED, 14),
    "rslora": ({"use_rslora": True}, {}, 14),
    "rank_alpha_patterns": (
        {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"down_proj": 3}},
        {},
        14,
    ),
    "dropout_eval": ({"lora_dropout": 0.3}, {}, 14),
    "fan_in_fan_out_linear": ({"fan_in_fan_out": True}, {}, 14),  # peft resets it for nn.Linear
    "fan_in_fan_out_conv1d": ({"fan_in_fan_out": True}, "gpt2", 0),  # GPT-2's Conv1D base
    "layers_to_transform": (
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
        {},
        2,
    ),
    "exclude_modules": ({"exclude_modules": ["o_proj"]}, {}, 12),
    "layer_replication": ({"layer_replication": [[0, 2], [0, 2]]}, {}, 28),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, {}, 14),
    "trainable_token_indices": ({"trainable_token_indices": [3, 4, 5]}, {}, 14),
    # lora.Embedding runs unmerged (only q_proj merges)
    "embedding": ({"target_modules": ["embed_tokens", "q_proj"]}, {}, 2),
    # the lm_head's LoRA linear merges over the weight it shares with the embedding
    "tied_lm_head": (
        {"target_modules": ["embed_tokens", "lm_head", "q_proj"], "ensure_weight_tying": True},
        {},
        3,
    ),
    "init_gaussian": ({"init_lora_weights": "gaussian"}, {}, 14),
    "init_pissa": ({"init_lora_weights": "pissa"}, {}, 14),
    "init_olora": ({"init_lora_weights": "olora"}, {}, 14),
    "init_orthogonal": ({"init_lora_weights": "orthogonal"}, {}, 14),
    "dora": ({"use_dora": True}, {}, 0),
    "alora": ({"alora_invocation_tokens": [5, 6]}, {}, 0),
    "mica": ({"init_lora_weights": "mica"}, {}, 0),
    "velora": ({"velora_config": VeloraConfig()}, {}, 0),
    "kasa": ({"kasa_config": KasaConfig()}, {}, 0),
    "monteclora": ({"monteclora_config": MontecloraConfig()}, {}, 0),
    "bdlora": (
        {
            "use_bdlora": BdLoraConfig(
                target_modules_bd_a=["q_proj"],
                target_modules_bd_b=["o_proj"],
                nblocks=2,
                match_strict=False,
            )
        },
        {},
        0,
    ),
    "target_parameters": (
        {"target_modules": [], "target_parameters": ["mlp.down_proj.weight"]},
        {},
        0,
    ),
}


def _variant_model(tok, lora: dict, base):
    torch.manual_seed(0)
    if base == "gpt2":
        config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64)
        model = GPT2LMHeadModel(config)
    else:
        model = tiny_llama(tok, hidden_size=32, num_layers=2, **base)
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            **{
                "r": 4,
                "lora_alpha": 8,
                "target_modules": "all-linear",
                "task_type": "CAUSAL_LM",
                **lora,
            }
        ),
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every adapter parameter away from its (often no-op) init
        for name, p in model.named_parameters():
            if "lora_" in name or "trainable_tokens" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_every_lora_variant_merges_exactly_or_runs_unmerged(tok, variant):
    lora, base, n_merged = VARIANTS[variant]
    model = _variant_model(tok, lora, base)
    ids = torch.randint(7, 259, (3, 11), generator=torch.Generator().manual_seed(0))
    ids[:, 3:5] = torch.tensor([5, 6])  # aLoRA's invocation tokens: its adapter acts after them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = model(input_ids=ids).logits
    with merged_lora(model) as n:
        merged = model(input_ids=ids).logits
    assert n == n_merged
    torch.testing.assert_close(merged, plain, atol=2e-4, rtol=1e-4)
    with model.disable_adapter():  # the adapter does change the output: the test can fail
        assert not torch.allclose(model(input_ids=ids).logits, plain, atol=1e-2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@torch.no_grad()
def test_what_changes_inside_the_block_is_seen_at_each_forward(tok):
    """Disabled adapters, LoRA dropout in training mode (random; merging would drop it) and
    rows naming their own adapters run unmerged; two active adapters merge both."""
    model = _lora_model(tok, lora_dropout=0.3)
    model.add_adapter("b", peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights="gaussian"))  # fmt: skip
    ids = torch.randint(3, 259, (3, 11), generator=torch.Generator().manual_seed(0))

    def forwards(**kwargs):
        with model.disable_adapter():
            off = model(input_ids=ids).logits
        model.train()
        torch.manual_seed(2)
        dropped = model(input_ids=ids).logits
        model.eval()
        rows = model(input_ids=ids, adapter_names=["default", "b", "__base__"]).logits
        model.base_model.set_adapter(["default", "b"])
        both = model(input_ids=ids).logits
        model.base_model.set_adapter("default")
        return off, dropped, rows, both

    plain = forwards()
    with merged_lora(model) as n:
        merged = forwards()
    assert n == 14
    for a, b in zip(merged, plain, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(plain[2], plain[3], atol=1e-2)  # the rows' adapters matter


@pytest.mark.parametrize("lora_bias", [False, True])
def test_the_trainers_lora_teacher_pass_runs_merged_and_gives_the_same_advantages(
    tmp_path, tok, lora_bias
):
    from peft import LoraConfig

    biased = BIASED if lora_bias else {}  # lora_bias merges into the base's bias

    def advantages(merge: bool):
        trainer = make_trainer(
            tmp_path / str(merge), tok, model=tiny_model(tok, hidden=32, **biased), data=dataset(4),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_bias=lora_bias),
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

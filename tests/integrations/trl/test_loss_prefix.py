"""Prefix sharing in TRL's log-prob passes (`loss_prefix_sharing`, issue 61): each GRPO group's
prompt runs once and only the completions after it, through TRL's fused LM head. The oracle is
TRL's own `_get_per_token_logps_and_entropies` on the same rows: log-probs, entropies and the
LoRA gradients must match it to float rounding, and a training step must move the parameters
as the plain pass does."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

import gear.prefix as prefix
from _trl_helpers import byte_tokenizer, dataset, make_trainer, parameters, tiny_model
from gear.integrations.trl.forwards import loss_prefix_blocker, shared_prompt_logps

peft = pytest.importorskip("peft")


def rows(V: int, lengths=(9, 23, 4), groups=(0, 0, 1, 1, 2, 2, 1, 1), T=7, seed=0):
    """TRL's layout: prompts left-padded to one width, completions right-padded (B, P + T)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in lengths]
    P, B = max(lengths), len(groups)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i, k in enumerate(groups):
        ids[i, P - lengths[k] : P], mask[i, P - lengths[k] : P] = prompts[k], 1
        end = int(torch.randint(1, T + 1, (1,), generator=g))
        ids[i, P : P + end], mask[i, P : P + end] = torch.randint(3, V, (end,), generator=g), 1
    return ids, mask, T


def lora_policy(seed: int = 0, **config):
    """A 2-layer tiny Llama with TRL's fused LM head (T = 0.7) and a random LoRA adapter."""
    model = tiny_model(byte_tokenizer(), seed=seed, hidden=32, layers=2, **config)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, lora).train()


def trl_plain(model, ids, mask, T, batch_size=None):
    """TRL's own pass (the oracle), called as GRPOTrainer calls it in its loss."""
    stub = SimpleNamespace(accelerator=Accelerator(cpu=True))
    logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        stub, model, ids, mask, T, batch_size=batch_size, compute_entropy=True
    )
    return logps, entropies


def grads_after(model, logps, scored):
    model.zero_grad()
    (-(logps * scored).sum() / scored.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("batch_size", [None, 3])
def test_shared_prompt_logps_equal_trls_pass_with_gradients(batch_size):
    """Groups of rows sharing prompts of three lengths (chunks of 3 cut groups apart): the same
    log-probs, entropies and LoRA gradients as TRL's plain pass."""
    model = lora_policy()
    ids, mask, T = rows(model.config.vocab_size)
    scored = mask[:, -T:].bool()
    want_lp, want_ent = trl_plain(model, ids, mask, T, batch_size)
    want_grads = grads_after(model, want_lp, scored)
    got = shared_prompt_logps(Accelerator(cpu=True), model, ids, mask, T, batch_size, True)
    assert got is not None
    got_lp, got_ent = got
    assert got_lp.shape == want_lp.shape == (len(ids), T)
    torch.testing.assert_close(got_lp[scored], want_lp[scored], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent[scored], want_ent[scored], atol=2e-5, rtol=1e-5)
    got_grads = grads_after(model, got_lp, scored)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert want_lp[scored].std() > 0.1  # a model whose log-probs differ between tokens


def test_shared_prompt_logps_run_each_prompt_once(monkeypatch):
    """The prefix pass sees each unique prompt once per chunk; the tail pass T + 1 columns."""
    model = lora_policy()
    ids, mask, T = rows(model.config.vocab_size)
    widths = []
    inner = model.get_base_model()
    real = inner.forward
    monkeypatch.setattr(
        inner, "forward", lambda *a, **k: widths.append(k["input_ids"].shape) or real(*a, **k)
    )
    with torch.no_grad():
        shared_prompt_logps(Accelerator(cpu=True), model, ids, mask, T)
    assert widths == [(3, ids.shape[1] - T - 1), (len(ids), T + 1)]


def test_loss_prefix_blocker_names_what_stops_sharing():
    model = lora_policy()
    assert loss_prefix_blocker(model, 30, 8) is None
    assert "no prompt column" in loss_prefix_blocker(model, 8, 8)
    dropped = lora_policy(attention_dropout=0.1)
    assert loss_prefix_blocker(dropped, 30, 8) == "dropout is active"
    dropped.eval()
    assert loss_prefix_blocker(dropped, 30, 8) is None  # no-grad passes in eval mode share
    model.get_base_model().activation_checkpointing_enable()
    assert loss_prefix_blocker(model, 30, 8) == "activation checkpointing is on"


def step_parameters(tmp_path, share: bool, calls: list, monkeypatch, **overrides):
    """The trainable parameters after one GEARTrainer step (LoRA on the tiny model)."""
    real = prefix.prefix_cache
    monkeypatch.setattr(prefix, "prefix_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    import gear.integrations.trl.forwards as forwards

    monkeypatch.setattr(forwards, "prefix_cache", prefix.prefix_cache)
    tok = byte_tokenizer()
    data = dataset().map(  # prompts of different lengths: left padding inside the batch
        lambda row, i: {
            "prompt": [{"role": "user", "content": "Hm, " * i + row["prompt"][0]["content"]}]
        },
        with_indices=True,
    )
    trainer = make_trainer(
        tmp_path / str(share),
        tok,
        model=tiny_model(tok, hidden=32, layers=2),
        data=data,
        loss_prefix_sharing=share,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        **overrides,
    )
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    return {k: v for k, v in after.items() if not torch.equal(v, before[k])}


@pytest.mark.parametrize("method", ["gear", "grpo"])
def test_a_training_step_with_shared_prompts_moves_parameters_as_the_plain_pass(
    tmp_path, monkeypatch, method
):
    shared_calls, plain_calls = [], []
    shared = step_parameters(tmp_path, True, shared_calls, monkeypatch, credit_method=method)
    plain = step_parameters(tmp_path, False, plain_calls, monkeypatch, credit_method=method)
    assert shared_calls and not plain_calls  # the switch decides which pass runs
    assert shared.keys() == plain.keys() and len(shared) > 0  # the step moved the adapter
    for name, value in plain.items():
        torch.testing.assert_close(shared[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_runs_trls_plain_pass(tmp_path, monkeypatch):
    calls = []
    moved = step_parameters(tmp_path, True, calls, monkeypatch, gradient_checkpointing=True)
    assert not calls and moved


def test_a_model_without_a_shareable_cache_runs_the_plain_pass(monkeypatch):
    """`prefix_cache` gives None (its one warning): TRL's plain pass is the answer."""
    model = lora_policy()
    ids, mask, T = rows(model.config.vocab_size)
    monkeypatch.setattr(prefix, "_unshareable", lambda cache: "a test cache")
    with pytest.warns(UserWarning, match="a test cache"):
        assert (
            shared_prompt_logps(Accelerator(cpu=True), copy.deepcopy(model), ids, mask, T) is None
        )

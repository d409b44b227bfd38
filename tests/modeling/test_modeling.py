"""One model layer under every integration: the same tiny model and batch give the same KL /
entropy / log-probs through TRL's path (`GEARTrainer._final_hidden` + `_signals`, prompts
left-padded, shared prefixes) and verl's (`micro_batch_signals`, packed and right-padded), and
both equal a plain reference from each unpadded row's own `model(...).logits` (which carry the
model's softcap / logit scale). Families: Llama; Gemma 2 (final-logit softcap); Cohere (logit
scale x 0.5) and Granite (logits / 4); OPT (its causal LM calls `model.decoder`, not
`model`); GPT-2 (learned absolute positions: a row must not depend on its padding).

Prefix sharing equals the plain forward for each family, or falls back to it where the position
scheme makes a shared prefix differ (rotary scaling past its length limit: `dynamic`, Phi-3
`longrope`), with one warning.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers as tf

import gear.prefix as prefix
from _trl_helpers import byte_tokenizer, make_trainer
from gear.credit.signals import signals_from_logits
from gear.integrations.verl.teacher_pass import TeacherPassOptions, micro_batch_signals
from gear.prefix import plain_hidden, prefix_shared_hidden

V = 259  # the byte tokenizer's vocabulary (the TRL path builds a GEARTrainer)
TEMPERATURE = 0.7


def llama_like(**extra):
    return dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**llama_like())),
    "gemma2": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(**llama_like(head_dim=8, final_logit_softcapping=2.0, sliding_window=8))
    ),
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**llama_like(logit_scale=0.5))),
    "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**llama_like(logits_scaling=4.0))),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            vocab_size=V,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=16,  # project_out: part of the decoder's final states
            init_std=0.2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            max_position_embeddings=128,
        )
    ),
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
        )
    ),
}
# rotary scaling that depends on the sequence length, with a limit the test rows exceed
LENGTH_DEPENDENT = {
    "llama_dynamic": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(
            **llama_like(
                max_position_embeddings=16,
                rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
            )
        )
    ),
    "phi3_longrope": lambda: tf.Phi3ForCausalLM(
        tf.Phi3Config(
            **llama_like(
                max_position_embeddings=64,
                original_max_position_embeddings=16,  # Phi-3 reads it here, not in the dict
                rope_parameters={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 4,
                    "long_factor": [4.0] * 4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "rope_theta": 1e4,
                },
            )
        )
    ),
}


def build(name: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {**FAMILIES, **LENGTH_DEPENDENT}[name]().eval()


def rows(seed: int = 0, n: int = 6):
    """Per row: prompt, teacher prompt (prompt + hint) and response ids; rows 2k and 2k + 1
    share their prompt (a GRPO group), prompts and responses differ in length."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)

    prompts = [ids(3, 12) for _ in range(n // 2) for _ in range(2)]
    teachers = [torch.cat([p, ids(2, 6)]) if i % 2 == 0 else None for i, p in enumerate(prompts)]
    teachers = [t if t is not None else teachers[i - 1] for i, t in enumerate(teachers)]
    responses = [ids(1, 8) for _ in range(n)]
    return prompts, teachers, responses


def trl_layout(prompts, responses):
    """TRL's batch: prompts left-padded, responses right-padded. ids, mask (B, P + T), T."""
    P, T = max(len(p) for p in prompts), max(len(r) for r in responses)
    ids = torch.zeros(len(prompts), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P], mask[i, P - len(p) : P] = p, 1
        ids[i, P : P + len(r)], mask[i, P : P + len(r)] = r, 1
    return ids, mask, T


def reference(model, prompt, teacher, response):
    """Each unpadded row alone through the model: its own logits, conventions included."""

    def logits(p):
        out = model(input_ids=torch.cat([p, response])[None]).logits
        return out[:, len(p) - 1 : len(p) - 1 + len(response)]

    with torch.no_grad():
        return signals_from_logits(
            logits(prompt), logits(teacher), response[None], temperature=TEMPERATURE
        )


FIELDS = ("kl", "entropy", "student_logprobs", "teacher_logprobs")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trl_and_verl_paths_give_the_models_own_signals(tmp_path, family):
    model = build(family)
    prompts, teachers, responses = rows()
    want = [reference(model, *row) for row in zip(prompts, teachers, responses, strict=True)]

    opts = TeacherPassOptions(temperature=TEMPERATURE, chunk_size=5, micro_batch_size=4)
    # OPT's decoder builds its causal mask without position_ids, so packed rows (verl's
    # use_remove_padding) would attend to each other, in verl's own forward too: right padding
    for remove_padding in (True, False) if family != "opt" else (False,):
        verl = micro_batch_signals(model, None, prompts, teachers, responses, opts, remove_padding)
        for i, ref in enumerate(want):
            for name in FIELDS:
                torch.testing.assert_close(
                    verl[name][i], getattr(ref, name)[0], atol=1e-5, rtol=1e-4,
                    msg=lambda m, name=name, i=i: f"verl {name} row {i}: {m}",
                )  # fmt: skip

    trainer = make_trainer(tmp_path, byte_tokenizer(), model=model, temperature=TEMPERATURE)
    s_ids, s_mask, T = trl_layout(prompts, responses)
    t_ids, t_mask, _ = trl_layout(teachers, responses)
    valid = s_mask[:, -T:].bool()
    for share in (True, False):
        trainer._forwards = dataclasses.replace(trainer._forwards, prefix_sharing=share)
        with torch.no_grad():
            student = trainer._final_hidden(trainer.model, s_ids, s_mask, T)
            teacher = trainer._final_hidden(trainer.model, t_ids, t_mask, T)
        trl = trainer._signals(student, teacher, s_ids[:, -T:], mask=valid)
        for i, ref in enumerate(want):
            for name in FIELDS:
                torch.testing.assert_close(
                    getattr(trl, name)[i][valid[i]], getattr(ref, name)[0], atol=1e-5, rtol=1e-4,
                    msg=lambda m, name=name, i=i: f"TRL {name} row {i}: {m}",
                )  # fmt: skip
    assert max(float(r.kl.max()) for r in want) > 1e-2  # the hint really moves the teacher


def padded_batch(seed: int = 5):
    """Rows [prompt | completion] of prompts 13, 8 and 21 tokens long, left-padded, with
    right-padded completions (the shared-prefix tests' batch, tests/integrations/trl/test_prefix.py)."""
    from _batches import batch

    ids, mask, _, T = batch(V, lengths=(13, 8, 21), T=9, seed=seed)
    return ids, mask, T


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_sharing_is_exact_for_each_position_scheme(family, monkeypatch):
    """Rotary (Llama, Gemma 2 with a sliding window, Cohere, Granite) and learned absolute
    positions (OPT, GPT-2): shared prefixes, no fallback, the plain forward's states."""
    monkeypatch.setattr(prefix, "_WARNED", set())
    model = build(family)
    ids, mask, T = padded_batch()
    chunks = []
    real = prefix._chunk_hidden
    monkeypatch.setattr(prefix, "_chunk_hidden", lambda *a, **k: chunks.append(1) or real(*a, **k))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        got = prefix_shared_hidden(model, ids, mask, T, batch_size=4)
        want = plain_hidden(model, ids, mask, T)
    assert chunks  # the shared path ran
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(LENGTH_DEPENDENT))
def test_prefix_sharing_falls_back_where_rotary_scaling_depends_on_length(family, monkeypatch):
    """Past the scaling's length limit a shared prefix differs from the plain forward: the plain
    forward runs instead (one warning); below the limit the prefix is shared, exactly."""
    monkeypatch.setattr(prefix, "_WARNED", set())
    model = build(family)
    ids, mask, T = padded_batch()  # 30 columns, limit 16
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = prefix_shared_hidden(model, ids, mask, T, batch_size=4)
        prefix_shared_hidden(model, ids, mask, T)
        # `dynamic` frequencies follow the longest row of a forward and of the calls before
        want = plain_hidden(build(family), ids, mask, T, batch_size=4)
    messages = [str(w.message) for w in caught if "shared-prefix" in str(w.message)]
    assert len(messages) == 1 and "depends on the sequence length" in messages[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # what the fallback avoids: rows whose prompts stay below the limit but whose completions
    # pass it; shared, the prompt runs alone, with the frequencies of a short sequence
    rows_ = mask[:, :-T].sum(1) < 16
    with torch.no_grad():
        prefixes, group = prefix.group_prefixes(ids[rows_], mask[rows_], T)
        forced = prefix._chunk_hidden(
            build(family), prefixes, group, ids[rows_, -T:], mask[rows_, -T:]
        )
        want = plain_hidden(build(family), ids[rows_], mask[rows_], T)
    valid = mask[rows_, -T:].bool()
    assert (forced - want)[valid].abs().max() > 1e-3

    short = slice(ids.size(1) - T - 5, None)  # 14 columns: below the limit
    ids, mask = ids[:, short], mask[:, short]
    keep = mask[:, :-T].any(1)  # rows that keep a prompt token
    ids, mask = ids[keep], mask[keep]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = prefix_shared_hidden(model, ids, mask, T, batch_size=4)
        want = plain_hidden(model, ids, mask, T)
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)

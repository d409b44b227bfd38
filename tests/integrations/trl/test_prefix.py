"""The shared-prefix forward (`gear.prefix`) equals the plain forward: same final hidden states,
so the same per-token KL and entropy (float32, 1e-5), on batches with several groups of rows
sharing a prompt, prompts of different lengths, left padding, padded completions, tool turns."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import gear.prefix as prefix
from _batches import batch
from gear.credit.signals import signals_from_hidden
from gear.models import tiny_model_and_tokenizer
from gear.prefix import group_prefixes, plain_hidden, prefix_shared_hidden


def signals(student: torch.Tensor, teacher: torch.Tensor, model, ids, policy):
    W = model.get_output_embeddings().weight
    return signals_from_hidden(student, teacher, W, ids, mask=policy.bool(), chunk_size=5)


@pytest.fixture(scope="module")
def llama():
    model, _ = tiny_model_and_tokenizer("bytes", hidden_size=48, num_layers=3)
    return model


@pytest.mark.parametrize("batch_size", [None, 4, 1])
@pytest.mark.parametrize("side", ["left", "right"])
def test_prefix_shared_teacher_pass_equals_plain_forward(llama, batch_size, side):
    """KL / entropy from the shared-prefix teacher pass equal those from the plain one, with
    the student's states from a plain forward (as when generation states are not read)."""
    ids, mask, policy, T = batch(llama.config.vocab_size, side=side)
    student_ids, student_mask, _, _ = batch(llama.config.vocab_size, lengths=(5, 3, 11), seed=0)
    student_ids[:, -T:], student_mask[:, -T:] = ids[:, -T:], mask[:, -T:]
    with torch.no_grad():
        student = plain_hidden(llama, student_ids, student_mask, T)
        want = plain_hidden(llama, ids, mask, T, batch_size=batch_size)
        got = prefix_shared_hidden(llama, ids, mask, T, batch_size=batch_size)
    assert got.shape == want.shape == (ids.size(0), T, llama.config.hidden_size)
    completion = ids[:, -T:]
    a, b = (
        signals(student, want, llama, completion, policy),
        signals(student, got, llama, completion, policy),
    )
    # 1e-5, relative where the value is large: this random teacher's KL reaches ~10 nats, where
    # float32 rounding of a different summation order alone is ~1e-6 relative (CI saw 1.1e-5
    # absolute at KL 10.0 with another thread count)
    torch.testing.assert_close(b.kl, a.kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.teacher_logprobs, a.teacher_logprobs, atol=1e-5, rtol=1e-5)
    assert a.kl[policy.bool()].mean() > 1e-2  # the teacher really differs from the student


def test_prefix_shared_student_forward_equals_plain_forward(llama):
    """The student forward (vLLM / tools / rollout_func paths) shares prompts the same way:
    its own signals (entropy, log-probs of the sampled tokens) are unchanged."""
    ids, mask, policy, T = batch(llama.config.vocab_size, lengths=(31, 2, 17), seed=3)
    with torch.no_grad():
        want = plain_hidden(llama, ids, mask, T)
        got = prefix_shared_hidden(llama, ids, mask, T, batch_size=3)
    completion = ids[:, -T:]
    a, b = (
        signals(want, want, llama, completion, policy),
        signals(got, got, llama, completion, policy),
    )
    torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.student_logprobs, a.student_logprobs, atol=1e-5, rtol=1e-5)


def qwen2(sliding_window: int | None) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=1,  # layer 0 full attention, layer 1 a sliding window
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_prefix_shared_qwen2_equals_plain_forward(sliding_window):
    """A Qwen2-style model (biased q/k/v, untied head), also with a sliding window shorter than
    the prompts: the window's cache keeps only its last columns and still matches."""
    model = qwen2(sliding_window)
    ids, mask, policy, T = batch(97, lengths=(13, 8, 21), T=9, seed=5)
    with torch.no_grad():
        want = plain_hidden(model, ids, mask, T)
        got = prefix_shared_hidden(model, ids, mask, T, batch_size=4)
    completion = ids[:, -T:]
    ref = torch.zeros_like(want)  # any fixed student: the teacher side is what changes
    a, b = (
        signals(ref, want, model, completion, policy),
        signals(ref, got, model, completion, policy),
    )
    torch.testing.assert_close(b.kl, a.kl, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.teacher_logprobs, a.teacher_logprobs, atol=1e-5, rtol=1e-5)


def test_prefix_rows_are_grouped_by_ids_and_mask():
    ids = torch.tensor([[0, 5, 6, 9, 9], [7, 5, 6, 8, 1], [5, 6, 0, 9, 9], [0, 5, 6, 2, 2]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    prefixes, group = group_prefixes(ids, mask, n_keep=2)
    # rows 0, 1, 3: left padding (whatever its ids) is not part of the prefix; row 2's trailing
    # padding is (it sits between prompt and completion, as in the plain forward)
    assert prefixes == [((5, 6), (1, 1)), ((5, 6, 0), (1, 1, 0))]
    assert group.tolist() == [0, 0, 1, 0]


def test_prefix_bad_input_is_named():
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="n_keep"):
        group_prefixes(ids, torch.ones_like(ids), n_keep=5)
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        group_prefixes(ids, torch.ones(2, 4, dtype=torch.long), n_keep=2)
    empty = torch.ones_like(ids)
    empty[1, :3] = 0
    with pytest.raises(ValueError, match="at least one prefix token"):
        group_prefixes(ids, empty, n_keep=2)


class NoCache(torch.nn.Module):
    """A causal LM that ignores use_cache (returns no cache)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner  # unwrapped by gear.modeling.unwrap like a DDP wrapper

    def forward(self, **kwargs):
        kwargs["use_cache"] = False
        return self.module(**kwargs)


def test_prefix_without_a_cache_falls_back_to_the_plain_forward_and_warns_once(llama, monkeypatch):
    monkeypatch.setattr(prefix, "_WARNED", set())
    ids, mask, _, T = batch(llama.config.vocab_size)
    model = NoCache(llama)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = prefix_shared_hidden(model, ids, mask, T, batch_size=4)
        prefix_shared_hidden(model, ids, mask, T)
        want = plain_hidden(llama, ids, mask, T, batch_size=4)
    assert [str(w.message) for w in caught if "shared-prefix" in str(w.message)] == [
        "shared-prefix forward: the model returned no KV cache (use_cache unsupported, or "
        "gradient checkpointing on); using the plain forward (each row's prompt is recomputed)"
    ]
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("teacher", ["current", "frozen"])
def test_prefix_sharing_in_the_trainer_gives_the_plain_signals(tmp_path, monkeypatch, teacher):
    """GEARTrainer's teacher pass and student forward share each group's prompt (two groups of
    two rows, prompts of different lengths), and the KL / entropy equal those of plain passes."""
    from _trl_helpers import byte_tokenizer, dataset, make_trainer

    data = dataset().map(
        lambda row, i: {
            "prompt": [{"role": "user", "content": "Hm, " * i + row["prompt"][0]["content"]}]
        },
        with_indices=True,
    )
    trainer = make_trainer(
        tmp_path,
        byte_tokenizer(),
        data=data,
        teacher=teacher,
        student_hidden_from_generation=False,  # the student forward runs too
        skip_zero_advantage_rows=False,  # every row's passes, so every prefix
    )
    shared_chunks = []
    real_chunk = prefix._chunk_hidden
    monkeypatch.setattr(
        prefix, "_chunk_hidden", lambda *a, **k: shared_chunks.append(1) or real_chunk(*a, **k)
    )
    calls, seen = [], []
    real_final, real_signals = trainer._final_hidden, trainer._signals
    monkeypatch.setattr(
        trainer, "_final_hidden", lambda *a, **k: calls.append((a, k)) or real_final(*a, **k)
    )
    monkeypatch.setattr(
        trainer, "_signals", lambda *a, **k: seen.append((a, k)) or real_signals(*a, **k)
    )
    trainer.model.train()
    trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert len(calls) == 2 and len(shared_chunks) == 2  # student, teacher: one chunk each
    teacher_ids = calls[1][0][1]
    n_keep = calls[1][0][3]
    assert len(group_prefixes(teacher_ids, calls[1][0][2], n_keep)[0]) == 2  # 2 groups of 2

    (student, teacher_hidden, ids), kwargs = seen[0]
    trainer._forwards = dataclasses.replace(trainer._forwards, prefix_sharing=False)
    with torch.no_grad():
        plain = [real_final(*a, **k) for a, k in calls]
    shared, unshared = (
        real_signals(student, teacher_hidden, ids, **kwargs),
        real_signals(*plain, ids, **kwargs),
    )
    valid = kwargs["mask"]
    assert valid.any()
    torch.testing.assert_close(shared.kl[valid], unshared.kl[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.entropy[valid], unshared.entropy[valid], atol=1e-5, rtol=0)
    assert unshared.kl[valid].mean() > 1e-3


def test_prefix_shared_forward_runs_shared_under_a_peft_lora_adapter(llama, recwarn):
    """gear train's default trains a LoRA adapter: the teacher pass through the PEFT wrapper
    shares each prompt too (no fallback warning) and equals the plain forward."""
    import copy

    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(llama), config)  # random B: the adapter acts
    ids, mask, _, T = batch(llama.config.vocab_size)
    with torch.no_grad():
        want = plain_hidden(model, ids, mask, T)
        got = prefix_shared_hidden(model, ids, mask, T)
        base = plain_hidden(llama, ids, mask, T)
    assert not [w for w in recwarn if "shared-prefix forward" in str(w.message)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - base).abs().max() > 1e-3  # the adapter changed the states

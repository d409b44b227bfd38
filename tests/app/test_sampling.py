"""gear.app.sampling: evaluation's sampler draws each problem's samples from its own seeds, exactly
from softmax(logits / T), and the held-out metric built on it is reproducible (a model scored
twice gives the same scores: the placebo of issue 35's rule)."""

from __future__ import annotations

import math

import pytest
import torch

from gear.app.evaluate import evaluate
from gear.app.sampling import sample, text_seed
from gear.tasks.arithmetic import ArithmeticTask
from gear.testing import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok, seed=3, hidden=32, layers=2).eval()


PROMPTS = ["What is 2 + 3?", "A longer prompt: what is 17 - 9, please?", "7 * 6"]


def test_a_prompts_samples_do_not_depend_on_the_batch_around_it(model, tok):
    seeds = [text_seed(p) for p in PROMPTS]
    together = sample(model, tok, PROMPTS, seeds, k=4, temperature=1.0, max_new_tokens=12)
    alone = [
        sample(model, tok, [p], [s], k=4, temperature=1.0, max_new_tokens=12)[0]
        for p, s in zip(PROMPTS, seeds, strict=True)
    ]
    reordered = sample(
        model, tok, PROMPTS[::-1], seeds[::-1], k=4, temperature=1.0, max_new_tokens=12
    )
    assert together == alone == reordered[::-1]
    assert len({tuple(c) for c in together[0]}) > 1  # the k samples differ from each other
    other = sample(model, tok, PROMPTS[:1], [seeds[0] + 1], k=4, temperature=1.0, max_new_tokens=12)
    assert other[0] != together[0]  # another seed, other draws


def test_greedy_equals_transformers_generate(model, tok):
    """The cache-sharing, row-dropping loop gives what model.generate gives (the plain path)."""
    seeds = [0] * len(PROMPTS)
    ours = sample(model, tok, PROMPTS, seeds, k=1, temperature=0.0, max_new_tokens=10)
    for prompt, (row,) in zip(PROMPTS, ours, strict=True):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        out = model.generate(
            **ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )[0, ids["input_ids"].shape[1]:].tolist()  # fmt: skip
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id)]
        assert row == out


def test_samples_follow_softmax_of_logits_over_temperature(model, tok):
    """First tokens of 4000 samples against softmax(logits / T): a chi-square within the 99.9%
    quantile (Gumbel-max is an exact draw, so only a broken sampler fails this)."""
    from scipy import stats

    prompt, temperature, n = "What is 2 + 3?", 1.5, 4000
    (rows,) = sample(model, tok, [prompt], [11], k=n, temperature=temperature, max_new_tokens=1)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        p = torch.softmax(model(ids).logits[0, -1].float() / temperature, -1)
    first = [r[0] if r else tok.eos_token_id for r in rows]
    counts = torch.bincount(torch.tensor(first), minlength=p.numel()).float()
    keep = p * n >= 5  # the chi-square needs expected counts >= 5; the rest pooled
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([p[keep] * n, (p[~keep] * n).sum(0, keepdim=True)])
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    assert chi2 < stats.chi2.ppf(0.999, int(keep.sum())), chi2


def test_a_model_scored_twice_gets_the_same_held_out_scores(model, tok):
    """The placebo: same model, same problems, same draws: every per-problem score equal, in
    another batch size too (so an after - before difference is the model's, not the sampler's)."""
    task = ArithmeticTask()
    first = evaluate(
        model, tok, task, n=6, samples=3, temperature=1.0, max_new_tokens=6, batch_size=4
    )
    again = evaluate(
        model, tok, task, n=6, samples=3, temperature=1.0, max_new_tokens=6, batch_size=6
    )
    assert [r["completions"] for r in first.rows] == [r["completions"] for r in again.rows]
    assert first.pass_at == again.pass_at
    assert not math.isnan(first.accuracy)


def test_bad_arguments_are_refused_before_any_work(model, tok):
    with pytest.raises(ValueError, match="seeds"):
        sample(model, tok, PROMPTS, [1], k=1)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, tok, PROMPTS[:1], [1], k=2, temperature=0.0)


def test_the_draws_of_this_eval_version_are_pinned(model, tok):
    """Cached before-training scores are keyed by `EVAL_VERSION`, not by source text: if this
    fails, the sampler's draws changed, so bump `gear.app.sampling.EVAL_VERSION` and update these."""
    import hashlib
    import json

    from gear.app.sampling import EVAL_VERSION

    seeds = [text_seed(p) for p in ("What is 2 + 3?", "7 * 6")]
    out = sample(
        model, tok, ["What is 2 + 3?", "7 * 6"], seeds, k=3, temperature=1.0, max_new_tokens=8
    )
    assert EVAL_VERSION == 1
    assert out[0][0] == [109, 249, 229, 40, 113, 1, 125, 139]
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest()[:16] == "8fcf6adb8d971730"


def test_an_evaluation_in_a_log_prints_its_progress_a_batch_at_a_time(model, tok):
    """In a log (no terminal, no live bar) a sampled evaluation of minutes says how far it is
    after each batch, not only that it started."""
    import io
    import types

    from rich.console import Console

    from gear.app.evaluate import evaluate_now

    log = io.StringIO()
    cfg = types.SimpleNamespace(eval_n=5, eval_samples=2, eval_temperature=0.0,
                                eval_max_new_tokens=4, eval_batch_size=2, eval_seed=0,
                                trainer={"temperature": 0.7})  # fmt: skip
    evaluate_now(model, tok, ArithmeticTask(), cfg, Console(file=log, width=200), "before")
    lines = log.getvalue().splitlines()
    assert "evaluating before: 5 held-out problems, greedy" in lines
    for what in ("greedy", "2 samples at T=0.7"):
        done = [x.split(": ")[1].split(" problems")[0] for x in lines
                if x.startswith(f"  eval before ({what}): ")]  # fmt: skip
        assert done == ["2/5", "4/5", "5/5"]

"""The on-policy localisation study (studies/localization.py) and its rows (studies/onpolicy.py):
the checker, token spans, the shared-prompt forward, a prompt's records, the per-row metrics
and the placebo. No real model: the byte tokenizer and a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch

from studies import localization as loc
from studies import onpolicy


def test_error_token_span_on_the_byte_tokenizer():
    from gear.models import byte_tokenizer

    tok = byte_tokenizer()
    text = "7 * 2 = 16, then 14 - 8 = 6."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    offsets = onpolicy.token_offsets(tok, ids)
    assert "".join(text[a:b] for a, b in offsets) == text
    assert onpolicy.char_to_token_span(offsets, 9, 10) == (9, 10)  # the '6' of "16", one byte each
    with pytest.raises(ValueError, match="no token"):
        onpolicy.char_to_token_span(offsets, len(text) + 5, len(text) + 6)


def test_shared_prompt_forward_equals_a_plain_forward():
    from gear.models import tiny_model_and_tokenizer

    model, _tok = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    model.eval()
    prompt = [5, 9, 33, 70, 12]
    rows = [[40, 41, 42, 43], [50, 51], [60]]
    got = onpolicy.completion_hidden(model, prompt, rows)
    assert got.shape == (3, 4, model.config.hidden_size)
    for b, r in enumerate(rows):
        full = model.model(input_ids=torch.tensor([prompt + r])).last_hidden_state[0]
        want = full[len(prompt) - 1 : len(prompt) - 1 + len(r)]
        torch.testing.assert_close(got[b, : len(r)], want, atol=1e-5, rtol=1e-5)


def test_sampled_token_signals():
    lp_s, lp_t = torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-1.0, -2.5, -0.5])
    torch.testing.assert_close(loc.sampled_token_signal(lp_s, lp_t, "k1"), lp_s - lp_t)
    r = (lp_t - lp_s).exp()
    torch.testing.assert_close(loc.sampled_token_signal(lp_s, lp_t, "k3"), r - 1 - r.log())
    with pytest.raises(ValueError, match="estimator"):
        loc.sampled_token_signal(lp_s, lp_t, "full")


def test_top_k_share_breaks_ties_at_random():
    w = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0])
    assert loc.top_k_share(w, 1) == 1.0  # the single highest
    assert loc.top_k_share(w, 2) == pytest.approx(2 / 3)  # 2 slots left among 3 tied
    assert loc.top_k_share(w, 0) == 0.0
    assert loc.top_k_share(torch.ones(6), 4) == pytest.approx(0.5)  # flat: k / T


def test_blame_shares_split_the_extra_blame_before_at_and_after_the_step():
    w = torch.tensor([1.5, 1.0, 2.0, 3.0, 0.5, 1.5])
    before, at, after = loc.blame_shares(w, 2, 4)
    assert (before, at, after) == pytest.approx((0.5 / 4, 3.0 / 4, 0.5 / 4))
    assert all(math.isnan(x) for x in loc.blame_shares(torch.ones(4), 1, 2))


def test_natural_metrics_step_or_next_token():
    w = torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0])
    m = loc.natural_row_metrics(w, error=1, step=(1, 3))
    assert m["L"] == 1.0 and m["hit1_step"] == 0.0  # the token right after the step counts


def _rec(group, n, error=None, equations=None):
    r = {"case": {"group": group, "detail": {}}, "ids": list(range(n)), "kl": [0.0] * n,
         "entropy": [0.0] * n, "lp_s": [0.0] * n, "lp_t": [0.0] * n}  # fmt: skip
    if error is not None:
        r.update(error=error[0], error_end=error[1], step=list(error[2:]))
        r["case"]["detail"]["equation"] = error[4]
    if equations is not None:
        r["equations"] = equations
    return r


def test_placebo_marks_the_same_equation_index_on_correct_rows_of_the_same_prompt():
    nat = {
        "p0": [_rec("p0", 8, error=(5, 6, 3, 6, 1)),
               _rec("p0", 9, equations=[[0, 3, 2, 3], [4, 8, 7, 8]]),
               _rec("p0", 5, equations=[[0, 4, 3, 4]])],  # fewer equations: the last
        "p1": [_rec("p1", 6, equations=[[0, 3, 2, 3]])],  # no failed row: no placebo
    }  # fmt: skip
    plc = loc.placebo_rows(nat)
    assert [(r["error"], r["step"]) for r in plc] == [(7, [4, 8]), (3, [0, 4])]
    # the checker oracle blames the real error and nothing on a placebo row
    (w_real,) = loc.natural_weights([nat["p0"][0]], "oracle", "full", 0)
    assert int(w_real.argmax()) in range(3, 6) and w_real.max() > 1
    assert torch.allclose(loc.natural_weights(plc, "oracle", "full", 0)[0], torch.ones(9).double())


def test_check_rollout_finds_the_first_wrong_equation_of_a_failed_rollout():
    from gear.tasks import get_task

    check_rollout, equation_spans = onpolicy.check_rollout, onpolicy.equation_spans

    task = get_task("arithmetic")
    text = "12 + 5 = 17, then 17 - 3 = 15, then 15 + 2 = 17. Answer: 17"
    res = check_rollout(text, "16", task)
    e = res["error"]
    assert not res["correct"] and e["equation"] == 1 and (e["stated"], e["right"]) == ("15", "14")
    assert (
        text[e["error_char"] : e["number_end"]] == "5" and e["step"] == equation_spans(text)[1][::2]
    )
    assert check_rollout("12 + 5 = 17. Answer: 17", "17", task) == {"correct": True, "error": None}
    assert check_rollout("Answer: 3", "17", task) == {"correct": False, "error": None}


def test_expressions_are_evaluated_and_nothing_else():
    assert onpolicy.evaluate_expression("3 + 4 * 2") == 11.0
    assert onpolicy.evaluate_expression("6 x 3") == 18.0
    assert onpolicy.evaluate_expression("5 / 0") is None
    assert onpolicy.evaluate_expression("__import__('os')") is None


def test_prompt_records_keep_checked_failures_and_correct_rows_with_token_spans():
    from gear.models import tiny_model_and_tokenizer
    from gear.tasks import get_task

    model, tok = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    model.eval()
    task = get_task("arithmetic")
    row = {"prompt": [{"role": "user", "content": "12 + 5 - 3?"}], "answer": "14",
           "ground_truth": "12 + 5 = 17, then 17 - 3 = 14. The answer is 14.", "level": "chain"}  # fmt: skip
    texts = [
        "12 + 5 = 17, then 17 - 3 = 15. The answer is 15.",  # checked error: "15"
        "The answer is 13.",  # failed, no equation: dropped
        "12 + 5 = 17, then 17 - 3 = 14. The answer is 14.",  # correct
    ]
    ids = [[*tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id] for t in texts]
    recs = onpolicy.prompt_records(model, tok, task, row, "natural-0", ids)
    assert [r["case"]["completion"] for r in recs] == [texts[0], texts[2]]
    bad, good = recs
    assert tok.decode(bad["ids"][bad["error"] : bad["error_end"]]) == "5"  # "15": from its "5"
    assert tok.decode(bad["ids"][slice(*bad["step"])]) == "17 - 3 = 15"
    assert len(bad["kl"]) == len(bad["ids"]) and "equations" not in bad
    assert [tok.decode(good["ids"][a:b]) for a, b, _, _ in good["equations"]] == [
        "12 + 5 = 17", "17 - 3 = 14"]  # fmt: skip
    assert "error" not in good
    only = onpolicy.prompt_records(model, tok, task, row, "placebo-0", ids, correct_only=True)
    assert [r["case"]["completion"] for r in only] == [texts[2]]

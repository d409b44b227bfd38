"""Pure helpers of benchmarks/localization.py: corruption, error spans, metrics, the shared-prompt
forward. No real model: the byte tokenizer and a tiny random Llama."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import localization as loc
import onpolicy

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
    "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


def test_gsm8k_results_match_the_task_text_and_find_each_result():
    from gear.tasks.gsm8k import split_solution

    text, spans = loc.gsm8k_results(GSM8K_ROW["answer"])
    assert text == split_solution(GSM8K_ROW["answer"])[0]
    assert [text[a:b] for a, b in spans] == ["24", "72"]
    assert text[spans[0][0] - 3 : spans[0][0]] == " = "


def test_gsm8k_result_that_differs_from_the_annotation_is_skipped():
    text, spans = loc.gsm8k_results("He has 2+2 = <<2+2=4>>four apples.\n#### 4")
    assert spans == [] and "four" in text


@pytest.mark.parametrize("seed", range(20))
def test_corruption_changes_only_the_number(seed):
    text, spans = loc.gsm8k_results(GSM8K_ROW["answer"])
    rng = random.Random(seed)
    span = spans[seed % 2]
    bad, err, end, step, new = loc.corrupt(text, span, rng, ("\n",))
    a, b = span
    assert new != text[a:b] and bad[a:end] == new
    assert bad[:a] == text[:a] and bad[end:] == text[b:]  # the rest is unchanged
    assert bad[:err] == text[:err] and bad[err] != text[err]  # err = first differing char
    line = bad[step[0] : step[1]]
    assert "\n" not in line and new in line and bad[step[1]] == "\n"


def test_wrong_number_keeps_the_style():
    rng = random.Random(0)
    for s in ("0.2", "7", "1,200", "35.50"):
        new = loc.wrong_number(s, rng)
        assert new != s.replace(",", "") and float(new) >= 0
        decimals = len(s.split(".")[1]) if "." in s else 0
        assert ("." in new) == ("." in s) and len(
            new.split(".")[1] if "." in new else ""
        ) == decimals


def test_step_span_of_an_arithmetic_clause():
    text = "7 * 2 = 14, then 14 - 8 = 6. The answer is 6."
    assert text.__getitem__(slice(*loc.step_span(text, 8, (", ", ". ")))) == "7 * 2 = 14"
    assert text.__getitem__(slice(*loc.step_span(text, 26, (", ", ". ")))) == "then 14 - 8 = 6"
    assert loc.arithmetic_results(text) == [(8, 10), (26, 27)]


def test_first_wrong_equation_and_expressions():
    assert loc.first_wrong_equation("So 3 + 4 = 7, then 7 * 8 = 54, 54 - 1 = 53.") == (27, 29)
    assert loc.first_wrong_equation("3 + 4 * 2 = 11 and 6 / 3 = 2 and 2 x 3 = 6") is None
    assert onpolicy.evaluate_expression("5 / 0") is None
    assert onpolicy.evaluate_expression("__import__('os')") is None


def test_error_token_span_on_the_byte_tokenizer():
    from gear.models import byte_tokenizer

    tok = byte_tokenizer()
    text = "7 * 2 = 16, then 14 - 8 = 6."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    offsets = loc.token_offsets(tok, ids)
    assert "".join(text[a:b] for a, b in offsets) == text
    assert loc.char_to_token_span(offsets, 9, 10) == (9, 10)  # the '6' of "16", one byte each
    with pytest.raises(ValueError, match="no token"):
        loc.char_to_token_span(offsets, len(text) + 5, len(text) + 6)


def test_metrics_on_a_hand_made_row():
    w = torch.tensor([1.0, 0.5, 1.0, 2.0, 2.0, 1.5, 0.0])
    # step = tokens [2, 5), first error at token 3
    m = loc.row_metrics(w, error=3, step=(2, 5))
    assert m["hit1"] == 1.0  # both maxima (3, 4) inside the step
    assert m["hit1_token"] == 1.0
    assert m["blame_after_share"] == pytest.approx(2.5 / 2.5)
    assert m["mass_after_share"] == pytest.approx(6.5 / 8.0)
    # labels: tokens 3.. positive; pos scores {2, 2, 1.5, 0}, neg {1, .5, 1}
    assert m["auroc"] == pytest.approx((3 + 3 + 3 + 0) / 12)
    assert loc.hit_at_1(torch.ones(4), 0, 1) == 0.25  # flat weights: the step's token share
    assert loc.blame_after_share(torch.ones(4), 1) != loc.blame_after_share(torch.ones(4), 1)


def test_bootstrap_interval_contains_the_mean_and_skips_nan():
    mean, (lo, hi), n = loc.bootstrap_ci([0.0, 1.0] * 50 + [float("nan")])
    assert n == 100 and mean == 0.5 and lo < 0.5 < hi and hi - lo < 0.25


def test_shared_prompt_forward_equals_a_plain_forward():
    from gear.models import tiny_model_and_tokenizer

    model, _tok = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    model.eval()
    prompt = [5, 9, 33, 70, 12]
    rows = [[40, 41, 42, 43], [50, 51], [60]]
    got = loc.completion_hidden(model, prompt, rows)
    assert got.shape == (3, 4, model.config.hidden_size)
    for b, r in enumerate(rows):
        full = model.model(input_ids=torch.tensor([prompt + r])).last_hidden_state[0]
        want = full[len(prompt) - 1 : len(prompt) - 1 + len(r)]
        torch.testing.assert_close(got[b, : len(r)], want, atol=1e-5, rtol=1e-5)


def test_gear_weights_pick_the_error_when_kl_spikes_there():
    n, err = 12, 7
    kl = [0.01] * n
    kl[err] = 2.0
    entropy = [1.0] * 9 + [3.0] * 3  # an entropy rise at token 9 ends the segment of onset 7
    rec = {"ids": list(range(n)), "kl": kl, "entropy": entropy,
           "lp_s": [-1.0] * n, "lp_t": [-1.0] * n, "error": err, "step": [5, 9],
           "case": {"group": "g0"}}  # fmt: skip
    ev = loc.evaluate_method([rec], [], "gear")
    # segment = tokens 7, 8; tokens 9-11 have d~ = 0 and tie with the 7 tokens before the error
    assert ev["rows"][0]["hit1"] == 1.0
    assert ev["rows"][0]["auroc"] == pytest.approx((2 * 7 + 0.5 * 3 * 7) / (5 * 7))
    flat = loc.evaluate_method([rec], [], "grpo")["rows"][0]
    assert flat["hit1"] == pytest.approx(4 / 12) and flat["auroc"] == 0.5
    json.dumps(loc._clean(loc.summarise(ev)))  # strict-JSON-able


def test_grouped_bootstrap_resamples_problems_not_rows():
    values = [0.0] * 5 + [1.0] * 5
    groups = ["a"] * 5 + ["b"] * 5
    mean, (lo, hi), n = loc.bootstrap_ci(values, groups)
    assert (mean, n) == (0.5, 10) and lo == 0.0 and hi == 1.0  # two problems: anything goes
    _, (lo_rows, hi_rows), _ = loc.bootstrap_ci(values)
    assert lo_rows > 0.1 and hi_rows < 0.9  # ten independent rows: a narrower interval


def test_sampled_token_signals():
    lp_s, lp_t = torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-1.0, -2.5, -0.5])
    torch.testing.assert_close(loc.sampled_token_signal(lp_s, lp_t, "k1"), lp_s - lp_t)
    r = (lp_t - lp_s).exp()
    torch.testing.assert_close(loc.sampled_token_signal(lp_s, lp_t, "k3"), r - 1 - r.log())
    with pytest.raises(ValueError, match="estimator"):
        loc.sampled_token_signal(lp_s, lp_t, "full")


def test_a_new_number_that_is_a_prefix_of_the_old_one_errs_after_it():
    text = "7 * 2 = 10, then 10 - 8 = 2."

    class Fixed(random.Random):  # wrong_number draws delta = -9: 10 -> 1
        def choice(self, seq):
            return -9

    bad, err, end, step, new = loc.corrupt(text, (8, 10), Fixed(0), (", ", ". "))
    assert (bad, new) == ("7 * 2 = 1, then 10 - 8 = 2.", "1")
    assert err == 9 and bad[err] == "," and end == 10  # the ',' is the first wrong character
    assert bad[step[0] : step[1]] == "7 * 2 = 1"


# ---------------------------------------------------------------- on-policy set (issue 23)


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
    from onpolicy import check_rollout, equation_spans

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

"""The retired injected-error localisation (studies/archive/localization_injected.py): corruption,
error spans, per-row metrics and a method's weights on a hand-made row. No model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from studies.archive import localization_injected as inj

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
    "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


def test_gsm8k_results_match_the_task_text_and_find_each_result():
    from gear.tasks.gsm8k import split_solution

    text, spans = inj.gsm8k_results(GSM8K_ROW["answer"])
    assert text == split_solution(GSM8K_ROW["answer"])[0]
    assert [text[a:b] for a, b in spans] == ["24", "72"]
    assert text[spans[0][0] - 3 : spans[0][0]] == " = "


def test_gsm8k_result_that_differs_from_the_annotation_is_skipped():
    text, spans = inj.gsm8k_results("He has 2+2 = <<2+2=4>>four apples.\n#### 4")
    assert spans == [] and "four" in text


@pytest.mark.parametrize("seed", range(20))
def test_corruption_changes_only_the_number(seed):
    text, spans = inj.gsm8k_results(GSM8K_ROW["answer"])
    rng = random.Random(seed)
    span = spans[seed % 2]
    bad, err, end, step, new = inj.corrupt(text, span, rng, ("\n",))
    a, b = span
    assert new != text[a:b] and bad[a:end] == new
    assert bad[:a] == text[:a] and bad[end:] == text[b:]  # the rest is unchanged
    assert bad[:err] == text[:err] and bad[err] != text[err]  # err = first differing char
    line = bad[step[0] : step[1]]
    assert "\n" not in line and new in line and bad[step[1]] == "\n"


def test_wrong_number_keeps_the_style():
    rng = random.Random(0)
    for s in ("0.2", "7", "1,200", "35.50"):
        new = inj.wrong_number(s, rng)
        assert new != s.replace(",", "") and float(new) >= 0
        decimals = len(s.split(".")[1]) if "." in s else 0
        assert ("." in new) == ("." in s) and len(
            new.split(".")[1] if "." in new else ""
        ) == decimals


def test_step_span_of_an_arithmetic_clause():
    text = "7 * 2 = 14, then 14 - 8 = 6. The answer is 6."
    assert text.__getitem__(slice(*inj.step_span(text, 8, (", ", ". ")))) == "7 * 2 = 14"
    assert text.__getitem__(slice(*inj.step_span(text, 26, (", ", ". ")))) == "then 14 - 8 = 6"
    assert inj.arithmetic_results(text) == [(8, 10), (26, 27)]


def test_metrics_on_a_hand_made_row():
    w = torch.tensor([1.0, 0.5, 1.0, 2.0, 2.0, 1.5, 0.0])
    # step = tokens [2, 5), first error at token 3
    m = inj.row_metrics(w, error=3, step=(2, 5))
    assert m["hit1"] == 1.0  # both maxima (3, 4) inside the step
    assert m["hit1_token"] == 1.0
    assert m["blame_after_share"] == pytest.approx(2.5 / 2.5)
    assert m["mass_after_share"] == pytest.approx(6.5 / 8.0)
    # labels: tokens 3.. positive; pos scores {2, 2, 1.5, 0}, neg {1, .5, 1}
    assert m["auroc"] == pytest.approx((3 + 3 + 3 + 0) / 12)
    assert inj.loc.hit_at_1(torch.ones(4), 0, 1) == 0.25  # flat weights: the step's token share
    assert inj.blame_after_share(torch.ones(4), 1) != inj.blame_after_share(torch.ones(4), 1)


def test_gear_weights_pick_the_error_when_kl_spikes_there():
    n, err = 12, 7
    kl = [0.01] * n
    kl[err] = 2.0
    entropy = [1.0] * 9 + [3.0] * 3  # an entropy rise at token 9 ends the segment of onset 7
    rec = {"ids": list(range(n)), "kl": kl, "entropy": entropy,
           "lp_s": [-1.0] * n, "lp_t": [-1.0] * n, "error": err, "step": [5, 9],
           "case": {"group": "g0"}}  # fmt: skip
    ev = inj.evaluate_method([rec], [], "gear")
    # segment = tokens 7, 8; tokens 9-11 have d~ = 0 and tie with the 7 tokens before the error
    assert ev["rows"][0]["hit1"] == 1.0
    assert ev["rows"][0]["auroc"] == pytest.approx((2 * 7 + 0.5 * 3 * 7) / (5 * 7))
    flat = inj.evaluate_method([rec], [], "grpo")["rows"][0]
    assert flat["hit1"] == pytest.approx(4 / 12) and flat["auroc"] == 0.5
    json.dumps(inj.loc.clean(inj.summarise(ev)))  # strict-JSON-able


def test_a_new_number_that_is_a_prefix_of_the_old_one_errs_after_it():
    text = "7 * 2 = 10, then 10 - 8 = 2."

    class Fixed(random.Random):  # wrong_number draws delta = -9: 10 -> 1
        def choice(self, seq):
            return -9

    bad, err, end, step, new = inj.corrupt(text, (8, 10), Fixed(0), (", ", ". "))
    assert (bad, new) == ("7 * 2 = 1, then 10 - 8 = 2.", "1")
    assert err == 9 and bad[err] == "," and end == 10  # the ',' is the first wrong character
    assert bad[step[0] : step[1]] == "7 * 2 = 1"


def test_first_wrong_equation_gives_the_stated_results_span():
    assert inj.first_wrong_equation("So 3 + 4 = 7, then 7 * 8 = 54, 54 - 1 = 53.") == (27, 29)
    assert inj.first_wrong_equation("3 + 4 * 2 = 11 and 6 / 3 = 2 and 2 x 3 = 6") is None

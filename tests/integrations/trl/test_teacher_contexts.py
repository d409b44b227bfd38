"""The teacher-context localisation study (studies/teacher_contexts.py): the contexts' teacher
prompts, the shared student pass, the contrast signal and the first-onset bands. No real model:
the byte tokenizer and a tiny random Llama."""

from __future__ import annotations

import random

import torch

from studies import onpolicy
from studies import teacher_contexts as tc

PROMPT = [{"role": "user", "content": "What is 12 + 5 - 3?"}]
SOLUTION = "12 + 5 = 17, then 17 - 3 = 14. The answer is 14."


def test_each_context_shows_the_teacher_what_the_spec_says():
    from gear.models import byte_tokenizer
    from gear.tasks.arithmetic import ArithmeticTask

    tok = byte_tokenizer()
    worked = tc.teacher_prompt_ids(tok, PROMPT, SOLUTION, "worked_solution")
    # the rows' cached teacher (onpolicy.teacher_ids) is the worked_solution context's
    assert worked == onpolicy.teacher_ids(tok, PROMPT, SOLUTION)
    right = tok.decode(tc.teacher_prompt_ids(tok, PROMPT, "14", "answer_only"))
    wrong_answer = tc.wrong_answer(ArithmeticTask(), "14", "natural-0")
    assert wrong_answer != "14" and abs(int(wrong_answer) - 14) <= 3
    assert wrong_answer == tc.wrong_answer(ArithmeticTask(), "14", "natural-0")  # fixed seed
    wrong = tok.decode(tc.teacher_prompt_ids(tok, PROMPT, wrong_answer, "contrast"))
    student = tok.decode(onpolicy.render(tok, PROMPT))
    assert "The final answer is 14." in right and SOLUTION not in right
    assert "Here is a reference solution" in tok.decode(worked)
    # the contrast teacher differs from the answer-only one in the answer alone
    assert wrong == right.replace("is 14.", f"is {wrong_answer}.")
    assert len(right) > len(student)


def test_one_student_pass_gives_what_the_rows_own_teacher_pass_gives():
    from gear.models import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    model.eval()
    texts = ["12 + 5 = 17, then 17 - 3 = 15.", "12 + 5 = 18, so 15."]
    case = onpolicy.Case("natural", "natural-0", PROMPT, SOLUTION, texts[0])
    cases = [case, onpolicy.Case(**{**vars(case), "completion": texts[1]})]
    recs = onpolicy.group_signals(model, tok, cases)  # worked-solution teacher
    worked = tc.teacher_prompt_ids(tok, PROMPT, SOLUTION, "worked_solution")
    answer = tc.teacher_prompt_ids(tok, PROMPT, "14", "answer_only")
    got = tc.teacher_records(model, tok, recs, {"worked": worked, "answer": answer})
    for r, g in zip(recs, got["worked"], strict=True):
        torch.testing.assert_close(torch.tensor(g["kl"]), torch.tensor(r["kl"]), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            torch.tensor(g["lp_t"]), torch.tensor(r["lp_t"]), atol=1e-5, rtol=0
        )
    assert got["answer"][0]["ids"] == recs[0]["ids"] and got["answer"][0]["kl"] != recs[0]["kl"]
    assert got["answer"][0]["lp_s"] == recs[0]["lp_s"]  # the student's side is unchanged


def _row(kl: list[float], lp_t: list[float], group: str = "natural-0") -> dict:
    n = len(kl)
    return {"ids": list(range(n)), "kl": kl, "entropy": [1.0] * n, "lp_s": [-1.0] * n,
            "lp_t": lp_t, "case": {"group": group}, "error": 3, "step": [2, 4]}  # fmt: skip


def test_contrast_reads_the_excess_of_the_right_teachers_signal_over_the_wrong_ones():
    gen = random.Random(0)
    right = [_row([gen.random() * 3 for _ in range(12)], [-gen.random() * 4 for _ in range(12)])
             for _ in range(3)]  # fmt: skip
    wrong = [_row([gen.random() * 3 for _ in range(12)], [-gen.random() * 4 for _ in range(12)])
             for _ in range(3)]  # fmt: skip
    for est in ("full", "k1"):
        got, got_first = tc.context_details(right, "gear", est, wrong)
        # by hand: the signal of each estimator (full: kl; k1: lp_s - lp_t), right minus wrong,
        # clamped at 0, as the "full" signal of a plain (no-contrast) pass
        sig = (lambda r: r["kl"]) if est == "full" else (lambda r: [-1.0 - x for x in r["lp_t"]])
        hand = [{**r, "kl": [max(a - b, 0.0) for a, b in zip(sig(r), sig(w), strict=True)]}
                for r, w in zip(right, wrong, strict=True)]  # fmt: skip
        want, want_first = tc.context_details(hand, "gear", "full")
        assert got_first == want_first
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    plain, _ = tc.context_details(right, "gear", "full")
    assert any(not torch.equal(a, b) for a, b in zip(plain, got, strict=True))


def test_first_onset_bands():
    step = [5, 9]  # the wrong equation's tokens
    assert tc.onset_band(-1, step) == "none"
    assert tc.onset_band(0, step) == "position0"
    assert tc.onset_band(3, step) == "before"
    assert [tc.onset_band(t, step) for t in (5, 8)] == ["at", "at"]
    assert tc.onset_band(9, step) == "after"
    assert tc.onset_band(0, [0, 3]) == "at"  # an equation that opens the completion
    rows = [_row([0.0] * 12, [0.0] * 12, g) for g in ("natural-0", "natural-0", "natural-1")]
    for r, s in zip(rows, ([5, 9], [1, 2], [0, 2]), strict=True):
        r["step"] = s
    out = tc.onset_summary([0, 0, 2], rows)
    assert out["position0"]["count"] == 2 and out["after"]["count"] == 1
    assert abs(out["position0"]["fraction"] - 2 / 3) < 1e-9
    assert out["token0"]["count"] == 2  # the first token, whatever the equation


def test_summary_pairs_every_context_on_the_same_rows():
    gen = random.Random(1)

    def recs(group: str, n_bad: int, n_good: int) -> list[dict]:
        out = []
        for k in range(n_bad + n_good):
            r = _row([gen.random() * 3 for _ in range(12)], [-gen.random() * 4 for _ in range(12)])
            r["case"] = {"group": group, "detail": {"equation": 0}}
            if k >= n_bad:  # a correct row: no error, its equations' token spans
                del r["error"], r["step"]
                r["equations"] = [[2, 6, 5, 6], [7, 11, 10, 11]]
            out.append(r)
        return out

    groups = {"natural-0": (3, 1), "natural-1": (2, 0), "natural-2": (2, 1), "placebo-0": (0, 3)}
    sets = {t: {g: recs(g, *n) for g, n in groups.items()} for t in tc.TEACHERS}
    sets["worked_solution"] = {g: recs(g, *n) for g, n in groups.items()}
    out = tc.summary(sets)
    assert out["failed_rows"] == 7 and out["placebo_rows"] == 2 + 3
    assert set(out["contexts"]) == set(tc.CONTEXTS)
    for context in tc.CONTEXTS:
        for est in tc.ESTIMATORS:
            cell = out["contexts"][context][est]
            assert sum(cell["first_onset"][b]["count"] for b in tc.ONSET_BANDS) == 7
            assert set(cell["methods"]) == set(tc.METHODS)
            assert ("vs_worked_solution" in cell) == (context != "worked_solution")


def test_a_model_with_no_placebo_rows_is_reported_uncorrected_not_crashed():
    """Step 0 on chain solves almost nothing, so it has no placebo rows (issue 51): the corrected
    localisation is None, the real side is still reported, and the onset bands count zero."""
    rec = {"case": {"group": "natural-0"}, "step": [2, 5]}
    real = [{"L": 1.0}, {"L": 0.0}]
    got = tc.localisation(real, [], [rec, rec], [], "L")
    assert got == {"real": 0.5, "placebo": None, "corrected": None, "ci": None}
    assert tc.interval(got) == "none (no placebo rows)"
    empty = tc.onset_summary([], [])
    assert all(v == {"fraction": None, "count": 0, "ci": None} for v in empty.values())
    assert set(empty) == {*tc.ONSET_BANDS, "token0"}

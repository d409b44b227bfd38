"""The one teacher-prompt module (gear.teacher, spec §4): hint kinds, placement, truncation,
and a batch's teacher prompts, with a character-level stand-in tokenizer (no model needed)."""

from __future__ import annotations

import random

import pytest

from gear.tasks import get_task
from gear.teacher import (
    ANSWER_HINT_TEMPLATE,
    ELLIPSIS,
    HINT_TEMPLATES,
    TEACHER_CONTEXTS,
    build_teacher_prompts,
    check_wrong_answers,
    context_hint_template,
    fit_teacher_prompt,
    ground_truth_text,
    hint_template,
    offset_answer,
    teacher_prompt,
    wrong_answers,
)


def render(prompt):
    """A 'chat template' over characters: one id per character of a flat rendering."""
    if isinstance(prompt, str):
        return [ord(c) for c in prompt]
    return [ord(c) for m in prompt for c in f"<{m['role']}>{m['content']}"]


def text(ids):
    return "".join(chr(i) for i in ids)


def tokenize(s):
    return [ord(c) for c in s]


def test_auto_hint_kind_picks_the_tool_template_for_tool_rollouts():
    assert hint_template("auto", uses_tools=True) == HINT_TEMPLATES["tool"]
    assert hint_template("auto", uses_tools=False) == HINT_TEMPLATES["math"]
    assert hint_template("math", uses_tools=True, math_template="M {ground_truth}") == (
        "M {ground_truth}"
    )
    assert hint_template("tool", uses_tools=False, tool_template="T {ground_truth}") == (
        "T {ground_truth}"
    )
    with pytest.raises(ValueError, match="hint_kind"):
        hint_template("code", uses_tools=False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("  ", None),
        ("42", "42"),
        (["only"], "only"),
        ([" "], None),
        ([{"name": "add"}], '[{"name": "add"}]'),
        ({"a": 1}, '{"a": 1}'),
        (7, "7"),
    ],
)
def test_ground_truth_values_become_hint_text_or_no_hint(value, expected):
    assert ground_truth_text(value) == expected


def test_a_plain_text_prompt_keeps_its_end_and_a_chat_gets_the_hint_in_its_last_user_turn():
    template = "Ref: {ground_truth}"
    prompt = "Q: 2 + 2?\nA:"
    assert teacher_prompt(prompt, "4", template) == "Ref: 4\n\nQ: 2 + 2?\nA:"
    assert teacher_prompt(prompt, "4", template, text_hint_position="after") == (
        "Q: 2 + 2?\nA:\n\nRef: 4"
    )
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "2 + 2?"},
    ]
    out = teacher_prompt(chat, "4", template)
    assert out[-1]["content"] == "2 + 2?\n\nRef: 4" and out[0]["content"] == "first"
    assert chat[-1]["content"] == "2 + 2?"  # a copy: the student's prompt is untouched
    with pytest.raises(ValueError, match="text_hint_position"):
        teacher_prompt(prompt, "4", template, text_hint_position="middle")
    with pytest.raises(ValueError, match="'user' message"):
        teacher_prompt([{"role": "system", "content": "s"}], "4", template)
    with pytest.raises(ValueError, match="placeholder"):
        teacher_prompt(prompt, "4", "no placeholder")


@pytest.mark.parametrize("position", ["before", "after"])
def test_an_over_long_ground_truth_loses_its_middle_and_fits_the_budget(position):
    truth = "".join(chr(ord("a") + i % 26) for i in range(200))
    prompt = "Sum it.\nAnswer:"
    full, cut = fit_teacher_prompt(
        render, prompt, truth, "R {ground_truth}", None, tokenize, text, position
    )
    assert not cut and text(full) == teacher_prompt(prompt, truth, "R {ground_truth}", position)
    ids, cut = fit_teacher_prompt(
        render, prompt, truth, "R {ground_truth}", 80, tokenize, text, position
    )
    out = text(ids)
    assert cut and len(ids) <= 80 and ELLIPSIS in out
    assert truth[:10] in out and truth[-10:] in out  # head and tail of the truth survive
    assert out.endswith("Answer:") if position == "before" else out.startswith("Sum it.")


def test_a_batch_without_ground_truth_rows_keeps_the_students_prompt_and_counts_them():
    prompts = ["Q1 A:", [{"role": "user", "content": "Q2"}], "Q3 A:", "Q4 A:"]
    students = [[1], [2], [3], [4]]
    truths = ["t1", None, "t3" * 40, "t4"]
    templates = ["M {ground_truth}", "M {ground_truth}", "M {ground_truth}", "T {ground_truth}"]
    seen = []

    def render_row(i, prompt):
        seen.append(i)
        return render(prompt)

    out = build_teacher_prompts(
        prompts, truths, render_row, templates, max_tokens=40, tokenize=tokenize,
        detokenize=text, student_prompt_ids=students, skip=[False, False, False, True],
    )  # fmt: skip
    assert text(out.ids[0]) == "M t1\n\nQ1 A:"
    assert out.ids[1] == [2] and out.ids[3] == [4]  # no truth / skipped: the student's ids
    assert len(out.ids[2]) <= 40 and text(out.ids[2]).endswith("Q3 A:")
    assert out.has_hint == [True, False, True, False]
    assert out.without_ground_truth == 1 and out.truncated == 1  # skipped rows are not counted
    assert 1 not in seen and 3 not in seen  # rows without a hint are not rendered again

    plain = build_teacher_prompts(["Q A:"], [None], lambda i, p: render(p), "M {ground_truth}")
    assert plain.ids == [render("Q A:")] and plain.has_hint == [False]
    with pytest.raises(ValueError, match="ground_truths"):
        build_teacher_prompts(["a", "b"], ["x"], lambda i, p: render(p), "M {ground_truth}")
    with pytest.raises(ValueError, match="teacher_max_prompt_length"):
        build_teacher_prompts(
            ["a"], ["x"], lambda i, p: render(p), "M {ground_truth}", max_tokens=5
        )


# ----------------------------------------------------------------------------- teacher contexts


def test_each_context_picks_its_template_and_the_answer_contexts_share_one():
    for kind, tools in (("auto", False), ("auto", True), ("math", True)):
        assert context_hint_template("worked_solution", kind, tools) == hint_template(kind, tools)
        assert context_hint_template("answer_only", kind, tools) == ANSWER_HINT_TEMPLATE
        assert context_hint_template("contrast", kind, tools) == ANSWER_HINT_TEMPLATE
    assert context_hint_template("answer_only", "auto", False, answer_template="A: {ground_truth}")
    with pytest.raises(ValueError, match=r"teacher_context: expected one of"):
        context_hint_template("hints", "auto", False)
    assert TEACHER_CONTEXTS[0] == "worked_solution"  # the default: the paper's teacher


@pytest.mark.parametrize("answer", ["19", "-4", "0", "2.50", "1,000", " 7 "])
def test_a_numeric_answer_gets_a_near_miss_of_the_same_form(answer):
    rng = random.Random(0)
    for _ in range(20):
        wrong = offset_answer(answer, rng)
        right = float(answer.replace(",", ""))
        assert wrong is not None and 0 < abs(float(wrong) - right) <= 3
        assert ("." in wrong) == ("." in answer)
        if "." in answer:
            assert len(wrong.split(".")[1]) == len(answer.split(".")[1])


def test_other_answers_come_from_the_pool_and_no_wrong_answer_is_an_error_naming_the_setting():
    rng = random.Random(0)
    assert offset_answer("seven", rng) is None
    got = wrong_answers(["seven", None, "12"], rng, pool=["seven", "eight"])
    assert got[0] == "eight" and got[1] is None and got[2] != "12"
    assert check_wrong_answers(["a", "b", "a"]) == ["a", "b"]
    with pytest.raises(
        ValueError, match=r"teacher_context='contrast': no wrong answer for answer 'a'"
    ):
        check_wrong_answers(["a", "a"])
    with pytest.raises(ValueError, match=r"teacher_context='contrast'.*right answer"):
        wrong_answers(["3"], rng, lambda answer, rng: answer)


def test_a_task_offers_a_wrong_answer_hook():
    task = get_task("arithmetic")
    row = task.dataset("train", n=1)[0]
    wrong = task.wrong_answer(row["answer"], random.Random(0))
    assert wrong is not None and not task.is_correct(f"Answer: {wrong}", row["answer"])

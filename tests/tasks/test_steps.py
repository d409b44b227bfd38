"""Arithmetic's step checkers (`gear.tasks.steps`, issue 67): chains are checked link by link,
blanks and line breaks, LaTeX and Unicode operators and leading zeros are read, and an empty
character span marks no token."""

from __future__ import annotations

import random
import re

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gear.spans import char_span_mask
from gear.tasks import get_task
from gear.tasks.arithmetic import ArithmeticTask, make_problem
from gear.tasks.steps import (
    evaluate_expression,
    first_wrong_equation_span,
    first_wrong_token_span,
)


def blamed(checker, text):
    found = checker(text)
    return None if found is None else text[found[0] : found[1]]


# ---------------------------------------------------------------------------- the step form
def test_a_chained_equality_is_checked_link_by_link():
    assert blamed(first_wrong_equation_span, "3 + 4 = 7 + 2 = 10") == "7 + 2 = 10"
    assert blamed(first_wrong_equation_span, "12 + 5 = 17 - 3 = 15, done") == "17 - 3 = 15"
    assert first_wrong_equation_span("3 + 4 = 7 + 2 = 9") is None


def test_a_right_running_total_has_no_wrong_step():
    assert first_wrong_equation_span("12 + 5 - 3 + 7 = 17 - 3 + 7 = 14 + 7 = 21") is None
    assert first_wrong_equation_span("2 + 3 * 4 = 2 + 12 = 14") is None
    text = "12 + 5 - 3 + 7 = 17 - 3 + 7 = 15 + 7 = 22"
    assert blamed(first_wrong_equation_span, text) == "17 - 3 + 7 = 15 + 7"


@pytest.mark.parametrize("blank", ["\n", "\u00a0", "\u2009"])
def test_a_line_break_or_a_no_break_or_thin_space_inside_an_equation_is_read(blank):
    text = f"12 +{blank}5{blank}={blank}18. The answer is 18."
    assert blamed(first_wrong_equation_span, text) == f"12 +{blank}5{blank}={blank}18"
    assert first_wrong_equation_span(f"12{blank}+ 5 ={blank}17") is None


def test_a_bullet_opening_a_line_is_not_an_operator():
    assert first_wrong_equation_span("12 + 5 = 17\n- 17 - 3 = 14\n* 14 * 2 = 28") is None


@pytest.mark.parametrize(
    ("text", "step"),
    [
        ("3 \\times 4 = 13", "3 \\times 4 = 13"),
        ("3 \u00b7 4 = 13", "3 \u00b7 4 = 13"),
        ("7 \u2212 2 = 6", "7 \u2212 2 = 6"),
        ("2 \u2212 5 = \u22124", "2 \u2212 5 = \u22124"),
        ("5 - 2 = \u22123", "5 - 2 = \u22123"),
    ],
)
def test_latex_and_unicode_operators_and_the_unicode_minus_are_read(text, step):
    assert blamed(first_wrong_equation_span, text) == step
    right = {"13": "12", "6": "5", "\u22124": "\u22123", "\u22123": "3"}[step.split("= ")[-1]]
    assert first_wrong_equation_span(text.rsplit("= ", 1)[0] + "= " + right) is None


def test_leading_zeros_are_read():
    assert blamed(first_wrong_equation_span, "07 + 1 = 9") == "07 + 1 = 9"
    assert first_wrong_equation_span("07 + 1 = 8") is None
    assert first_wrong_equation_span("7 + 1 = 08") is None


# ---------------------------------------------------------------------------- the token form
@pytest.mark.parametrize(
    ("text", "token", "at"),
    [
        ("22 - 9 = 14", "4", 10),  # the result's first wrong digit, not its operands
        ("12 + 5 = 27", "2", 9),
        ("12 + 5 = 1", "1", 9),  # a prefix of 17: its last character
        ("12 + 5 = 177", "7", 11),  # longer than 17: the first character past it
        ("5 - 2 = -3", "-", 8),  # a wrong sign: the minus
        ("5 - 2 = \u22123", "\u2212", 8),
        ("2 \u2212 5 = \u22124", "4", 9),
        ("7 / 2 = 3.4", "4", 10),
        ("7 + 1 = 09", "9", 9),  # leading zeros skipped
        ("07 + 1 = 9", "9", 9),
        ("3 \\times 4 = 13", "3", 14),
        ("3 + 4 = 7 + 2 = 10", "1", 16),  # the chain's second link
        ("12 +\n5 = 18", "8", 10),
    ],
)
def test_the_token_form_blames_the_first_wrong_character_of_the_stated_result(text, token, at):
    assert first_wrong_token_span(text) == (at, at + 1)
    assert text[at] == token
    start, end = first_wrong_equation_span(text)
    assert start <= at < end  # inside the step


@pytest.mark.parametrize(
    ("text", "blamed"),
    [
        ("12 + 5 - 3 + 7 = 17 - 3 + 7 = 15 + 7 = 22", (31, "5")),  # vs 14 + 7: the 5 of 15
        ("17 - 3 + 7 = 14 - 7 = 7", (16, "-")),  # vs 14 + 7: the operator
        ("2 + 3 * 4 = 5 * 4 = 20", (12, "5")),  # vs 2 + 12: the 5
        ("2 + 3 + 4 = 5 + 3 + 4", (12, "5")),  # as many numbers: vs 2 + 3 + 4 itself
        ("2 + 3 = 1 + 1 + 1 + 1", (8, "1 + 1 + 1 + 1")),  # more numbers: no right form, all
    ],
)
def test_a_wrong_expression_side_is_blamed_where_it_leaves_the_right_form(text, blamed):
    at, token = blamed
    assert first_wrong_token_span(text) == (at, at + len(token))
    assert text[at : at + len(token)] == token


def solutions(level: str, seed: int) -> str:
    return make_problem(level, random.Random(seed))[2]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["multistep", "chain"]), st.integers(0, 10**6), st.integers(1, 9))
def test_worked_solutions_are_right_and_a_wrong_result_is_blamed_inside_it(level, seed, delta):
    text = solutions(level, seed)
    assert first_wrong_token_span(text) is None and first_wrong_equation_span(text) is None
    results = [m.span() for m in re.finditer(r"(?<== )[0-9]+", text)]
    a, b = random.Random(seed).choice(results)
    wrong = text[:a] + str(int(text[a:b]) + delta) + text[b:]
    start, end = first_wrong_equation_span(wrong)
    token = first_wrong_token_span(wrong)
    assert start < token[0] < token[1] == token[0] + 1 <= end
    assert wrong[token[0]].isdigit() and a <= token[0] and wrong[end - 1].isdigit()


def test_expressions_are_evaluated_safely():
    assert evaluate_expression("07 + 1") == 8.0
    assert evaluate_expression("3 \u00b7 4 \u2212 \u22122") == 14.0
    assert evaluate_expression("2 + 3 * 4 - 6 / 3") == 12.0
    assert evaluate_expression("5 / 0") is None
    assert evaluate_expression("__import__('os')") is None
    assert evaluate_expression("2 ** 3") is None


# ---------------------------------------------------------------------------- the task option
def test_arithmetic_blames_the_token_by_default_and_the_step_on_request():
    from gear.app.config import resolve_config

    assert ArithmeticTask(mix="chain:1").step_checker() is first_wrong_token_span
    cfg = resolve_config(None, {"task_options": {"mix": "chain:1", "error_span": "step"}})
    assert get_task("arithmetic", **cfg.task_options).step_checker() is first_wrong_equation_span
    assert ArithmeticTask(error_span="step").step_checker() is None  # one-equation levels


def test_a_bad_error_span_is_refused_naming_the_field_and_its_values():
    with pytest.raises(ValueError, match=r"error_span must be one of \['token', 'step'\]"):
        get_task("arithmetic", mix="chain:1", error_span="digit")


# ---------------------------------------------------------------------------- char_span_mask
def word_tokenizer():
    """Whole words as tokens ("12", "+", ...), built in code: tokens of several characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "12", "+", "5", "=", "17", "18"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


def test_an_empty_span_marks_no_token_even_inside_one():
    tok = word_tokenizer()
    ids = torch.tensor([tok("12 + 5 = 18", add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    for start in range(12):  # inside "12", "18", at a boundary, at the end
        empty = char_span_mask(tok, ids, mask, lambda i, text, s=start: (s, s), "test")
        assert not bool(empty.any()), start
    one = char_span_mask(tok, ids, mask, lambda i, text: (10, 11), "test")
    assert one.tolist() == [[False, False, False, False, True]]  # "8" marks all of "18"

"""The `math` task's answers as a user meets them (issue 69): a NaN reference is refused, a box
without braces or space (`\\boxed5`) is read, and a trailing percent sign means nothing."""

from __future__ import annotations

import json

import pytest

from gear.io import InputError
from gear.tasks import get_task
from gear.tasks.math import answers_equal, boxed_spans, last_boxed


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_reference_that_is_not_a_finite_number_is_refused_naming_the_row(tmp_path, value):
    path = tmp_path / "aime.jsonl"  # Python's json writes and reads NaN / Infinity as bare words
    path.write_text(
        json.dumps({"problem": "p", "answer": 1})
        + "\n"
        + f'{{"problem": "q", "answer": {value}}}\n'
    )
    with pytest.raises(InputError, match=r"aime\.jsonl: line 2: 'answer' is (nan|inf|-inf), "):
        get_task("math", path=path).dataset("test")


def test_a_box_right_after_its_command_is_read_as_its_answer():
    task = get_task("math")
    assert task.is_correct("so the sum is \\boxed5", "5")
    assert task.is_correct("$\\boxed42$.", "42")
    assert last_boxed("\\boxed7") == "7" and last_boxed("\\fbox{3}") == "3"
    text = "\\boxed5 and \\boxed 6 and \\boxed{7}"
    assert [text[s[0] : s[1]] for s in boxed_spans(text)] == ["5", "6", "7"]
    # a longer command that merely starts with the word is no box
    assert boxed_spans("\\boxedsymbol{x}") == []


@pytest.mark.parametrize(
    ("reference", "predicted"),
    [
        ("10\\%", "10"),
        ("10", "10\\%"),
        ("10\\%", "10%"),
        ("10%", "10 \\%"),
        ("12.5\\%", "\\frac{25}{2}"),
    ],
)
def test_a_trailing_percent_sign_on_either_side_is_ignored(reference, predicted):
    assert answers_equal(reference, predicted)
    assert get_task("math").is_correct(f"so it is \\boxed{{{predicted}}}.", reference)


def test_a_percent_sign_does_not_make_different_numbers_equal():
    assert not answers_equal("10\\%", "0.1")  # the sign is dropped, not read as /100
    assert not answers_equal("10\\%", "11")
    assert not get_task("math").is_correct("\\boxed{1\\%}", "10\\%")


def test_cached_scores_of_the_math_task_graded_before_a_change_are_not_reused(
    tmp_path, monkeypatch
):
    from gear.app.config import resolve_config
    from gear.app.evaluate import eval_cache_key
    from gear.tasks.math import MathTask

    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "p", "answer": "10\\%"}) + "\n")
    cfg = resolve_config(None, {"task": "math", "task_options": {"path": str(path)}, "eval_n": 1})
    key = eval_cache_key(cfg)
    assert key is not None and key == eval_cache_key(cfg)
    monkeypatch.setattr(MathTask, "grading_version", MathTask.grading_version + 1)
    assert eval_cache_key(cfg) != key

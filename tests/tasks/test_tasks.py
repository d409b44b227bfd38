"""Tests for gear.tasks: registry, datasets, rewards, the BFCL checker and the TRL tool loop."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path

import pytest

from gear.tasks import TASKS, get_task
from gear.tasks.base import completion_text, final_answer
from gear.tasks.bfcl import concrete, parse_calls, reference_calls, render_calls
from gear.tasks.tools import ToolEnv, safe_eval, tool_schemas

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
GSM8K = DATA / "gsm8k"
BFCL = DATA / "bfcl"
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason="no GSM8K data")
needs_bfcl = pytest.mark.skipif(not (BFCL / "possible_answer").is_dir(), reason="no BFCL data")
COLUMNS = {"prompt", "ground_truth", "answer"}


def as_messages(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def check_prompts(ds) -> None:
    assert set(ds.column_names) >= COLUMNS
    for row in ds.select(range(min(len(ds), 20))):
        assert row["prompt"] and row["prompt"][-1]["role"] == "user"
        assert all(set(m) == {"role", "content"} and m["content"] for m in row["prompt"])
        assert isinstance(row["ground_truth"], str) and row["ground_truth"]
        assert isinstance(row["answer"], str) and row["answer"]


# ---------------------------------------------------------------- registry


def test_registry_and_errors():
    assert set(TASKS) == {"arithmetic", "gsm8k", "math", "bfcl", "tools"}
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic"):
        get_task("nope")
    with pytest.raises(
        ValueError, match=r"unknown option.*'levels'.*valid options: \['mix', 'error_span'\]"
    ):
        get_task("arithmetic", levels="1digit")
    with pytest.raises(ValueError, match=r"valid: .*multistep"):
        get_task("arithmetic", mix={"3digit": 1.0})
    with pytest.raises(ValueError, match="weights"):
        get_task("arithmetic", mix={"1digit": -1.0})
    task = get_task("arithmetic")
    with pytest.raises(ValueError, match=r"split.*\['train', 'test'\]"):
        task.dataset("validation")
    with pytest.raises(ValueError, match="n must be"):
        task.dataset("train", n=-1)
    with pytest.raises(ValueError, match="answer"):
        task.reward(["p"], ["Answer: 1"], ground_truth=["x"])
    assert {t.hint_kind for t in (TASKS["arithmetic"], TASKS["gsm8k"], TASKS["math"])} == {"math"}
    assert {t.hint_kind for t in (TASKS["bfcl"], TASKS["tools"])} == {"tool"}


def test_final_answer_and_completion_text():
    cases = {
        "12 + 7 = 19. The answer is 19.": "19",
        "Answer: 12 + 7 = 19": "19",
        "Answer: **1,000** apples": "1000",
        "so \\boxed{42} is it": "42",
        "The final answer to 3 + 4 is 7": "7",
        "Answer: 19 (since 12 + 7 = 19), not 5": "19",
        "first 3 then 8": "8",
        "Answer: $-5.5": "-5.5",
        "no numbers": None,
    }
    for text, expected in cases.items():
        assert final_answer(text) == expected, text
    assert completion_text("abc") == "abc"
    assert completion_text({"role": "assistant", "content": "x"}) == "x"
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    msgs = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "f", "content": "99"},
        {"role": "assistant", "content": "Answer: 3"},
    ]
    text = completion_text(msgs)
    assert '"name": "f"' in text and "99" not in text and text.endswith("Answer: 3")


def test_answer_spans_are_where_the_rewards_read_the_answer():
    """`Task.answer_span` (OAR-G's span, issue 53): the characters the reward's parser reads."""
    cases = {
        "12 + 7 = 19. The answer is 19.": "19",
        "Answer: 12 + 7 = 19": "19",
        "Answer: **1,000** apples": "1,000",
        "so \\boxed{ 42 } is it": "42",
        "Answer: $-5.5": "-5.5",
    }
    math = [get_task("arithmetic"), get_task("gsm8k", path="x.jsonl")]
    for text, expected in cases.items():
        for task in math:
            start, end = task.answer_span(text)
            assert text[start:end] == expected, (task.name, text)
            assert text[start:end].replace(",", "") == final_answer(text)
        assert get_task("arithmetic").answer_span("no numbers") is None
    tools = get_task("tools")
    text = '<tool_call>{"name": "f", "arguments": {"x": 8}}</tool_call> <tool_response>99</tool_response> Answer: 7'
    start, end = tools.answer_span(text)
    assert text[start:end] == "7" and tools.answer_span("<tool_response>99</tool_response>") is None
    bfcl = get_task("bfcl", data_dir=BFCL)  # reads no data until asked for rows
    call = '[{"name": "f", "arguments": {"a": 1}}]'
    for text in (f"<tool_call> {call} </tool_call>", call):
        start, end = bfcl.answer_span(text)
        assert text[start:end] == call
    assert bfcl.answer_span("I cannot call anything") is None
    truth = json.dumps([{"f": {"a": [1, 2]}}])
    assert bfcl.reference_text(truth) == render_calls([{"name": "f", "arguments": {"a": 1}}])
    assert math[0].reference_text("19") == "19" and math[0].reference_text(None) is None


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_dataset():
    task = get_task("arithmetic")
    ds = task.dataset("train", n=300, seed=0)
    check_prompts(ds)
    assert len(ds) == 300 and ds.to_list() == task.dataset("train", n=300, seed=0).to_list()
    assert ds["prompt"] != task.dataset("train", n=300, seed=1)["prompt"]
    assert set(ds["level"]) == {"1digit", "2digit", "multistep"}
    for row in ds:
        expr = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        assert eval(expr) == int(row["answer"]) >= 0
        assert row["ground_truth"].endswith(f"The answer is {row['answer']}.")
        assert task.is_correct(row["ground_truth"], row["answer"])
    assert len(task.dataset("test")) == 500 and len(task.dataset("train", n=0)) == 0


def test_arithmetic_chain_solves_in_three_checked_steps():
    """A chain problem's worked solution is three equations, each right, none below zero, and
    the answer is the last result (the localisation benchmark checks rollouts step by step)."""
    task = get_task("arithmetic", mix="chain")
    ds = task.dataset("test", n=100, seed=3)
    assert set(ds["level"]) == {"chain"}
    for row in ds:
        expr = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        assert len(expr.split()) == 7 and eval(expr) == int(row["answer"])
        steps = row["ground_truth"].split(". The answer is")[0].split(", then ")
        assert len(steps) == 3
        for step in steps:
            left, right = step.split(" = ")
            assert eval(left) == int(right) >= 0
        assert task.is_correct(row["ground_truth"], row["answer"])


def test_arithmetic_levels_and_disjoint_splits():
    for level, digits in (("1digit", 1), ("2digit", 2)):
        ds = get_task("arithmetic", mix=level).dataset("train", n=200)
        assert set(ds["level"]) == {level}
        numbers = [n.rstrip("?") for p in ds["prompt"] for n in p[0]["content"].split()[2:5:2]]
        assert {len(n) for n in numbers} == {digits}
    mixed = get_task("arithmetic", mix="1digit:1,multistep:3").dataset("train", n=400)
    assert 0.15 < mixed["level"].count("1digit") / 400 < 0.35
    task = get_task("arithmetic")
    train = {p[0]["content"] for p in task.dataset("train", n=5000)["prompt"]}
    test = {p[0]["content"] for p in task.dataset("test", n=2000)["prompt"]}
    assert len(test) > 400 and not train & test
    one_digit_test = get_task("arithmetic", mix="1digit").dataset("test", n=20)["prompt"]
    assert len({p[0]["content"] for p in one_digit_test}) == 20  # no repeats while possible


def test_arithmetic_reward_str_and_messages():
    task = get_task("arithmetic")
    right = ["Answer: 19", "12 + 7 = 19", "\\boxed{19}", "The answer is 19.", "Answer: 12 + 7 = 19"]
    wrong = ["Answer: 18", "19 + 1 = 20", "I don't know", "", "Answer: 19.5"]
    answers = ["19"] * (len(right) + len(wrong))
    assert task.reward([None] * 10, right + wrong, answer=answers) == [1.0] * 5 + [0.0] * 5
    messages = [as_messages(t) for t in right + wrong]
    rewards = task.reward(
        [None] * 10, messages, answer=answers, ground_truth=["x"] * 10, level=["1digit"] * 10
    )
    assert rewards == [1.0] * 5 + [0.0] * 5


# ---------------------------------------------------------------- gsm8k


@needs_gsm8k
def test_gsm8k_real_rows():
    raw = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:100]]
    task = get_task("gsm8k", path=GSM8K / "test.jsonl")
    ds = task.dataset("test", seed=0)
    check_prompts(ds)
    assert len(ds) == 1319
    by_index = {row["index"]: row for row in ds}
    for i, item in enumerate(raw):
        row = by_index[i]
        final = item["answer"].split("####")[-1].strip().replace(",", "")
        assert row["answer"] == final and float(final) == float(final)
        assert item["question"] in row["prompt"][0]["content"]
        assert "<<" not in row["ground_truth"] and "####" not in row["ground_truth"]
        assert task.is_correct(row["ground_truth"], row["answer"])
        assert task.is_correct(f"So the answer is {final}", row["answer"])
        assert not task.is_correct(f"Answer: {float(final) + 1:g}", row["answer"])
    assert ds.to_list()[:5] == task.dataset("test", seed=0).to_list()[:5]
    assert ds["index"][:20] != task.dataset("test", seed=1)["index"][:20]


@needs_gsm8k
def test_gsm8k_directory_splits_and_reward():
    task = get_task("gsm8k", path=str(GSM8K))
    train = task.dataset("train", n=2000, seed=0)
    test = task.dataset("test", n=200, seed=0)
    assert len(train) == 2000 and len(test) == 200
    assert not {p[0]["content"] for p in train["prompt"]} & {
        p[0]["content"] for p in test["prompt"]
    }
    completions = [
        "Answer: 1,000",
        as_messages("the total is $1000.00"),
        "\\boxed{\\frac{2000}{2}}",
        "Answer: 999",
    ]
    assert task.reward([None] * 4, completions, answer=["1000"] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_gsm8k_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="path="):
        get_task("gsm8k").dataset("test")
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        get_task("gsm8k", path=missing).dataset("test")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl"):
        get_task("gsm8k", path=tmp_path).dataset("train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1 #### 1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2"):
        get_task("gsm8k", path=bad).dataset("test")
    bad.write_text('{"question": "q", "answer": "no final answer"}\n')
    with pytest.raises(ValueError, match="####"):
        get_task("gsm8k", path=bad).dataset("test")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="offline"):
        get_task("gsm8k", path="openai/gsm8k").dataset("test")


# ---------------------------------------------------------------- math

# Problems written for these tests (no benchmark data), one per supported layout.
MATH_ROWS = [  # MATH: a worked solution whose last \boxed{} is the answer
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "Over 4: $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
    },
    {
        "problem": "Which real numbers square to 1?",
        "solution": "Both $1$ and $-1$ do, so the set is $\\boxed{\\{-1, 1\\}}$.",
    },
    {
        "problem": "Compute $2^{10}$.",
        "solution": "First $2^5 = \\boxed{32}$, so $2^{10} = 32^2 = \\boxed{1024}$.",
    },
    {
        "problem": "Simplify $\\sqrt{8}$.",
        "solution": "$\\sqrt{8} = \\sqrt{4 \\cdot 2} = \\boxed{2\\sqrt{2}}$",
    },
]
MATH_ANSWERS = ["\\frac{3}{4}", "\\{-1, 1\\}", "1024", "2\\sqrt{2}"]
AIME_ROWS = [  # AIME: a question and a bare answer, here a number
    {"question": "How many positive divisors does 36 have?", "answer": 9},
    {"problem": "What is the remainder of 100 divided by 7?", "answer": "2"},
]
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    '\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)
DAPO_ROWS = [  # DAPO-Math-17k (verl's layout): a chat prompt, the answer in reward_model
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(i)},
    }
    for i, (problem, answer) in enumerate([("What is 6 times 7?", "42"), ("What is 5 - 8?", "-3")])
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_math_reads_math_style_jsonl_answers_from_the_last_box(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    task = get_task("math", path=path)
    ds = task.dataset("test", seed=0)
    check_prompts(ds)
    by_index = {row["index"]: row for row in ds}
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, (raw, answer) in enumerate(zip(MATH_ROWS, MATH_ANSWERS, strict=True)):
        row = by_index[i]
        assert row["answer"] == answer  # the last box, nested and escaped braces kept whole
        assert row["ground_truth"] == raw["solution"]  # the teacher sees the worked solution
        (message,) = row["prompt"]
        assert message["content"].startswith(raw["problem"]) and "\\boxed{}" in message["content"]
        assert task.is_correct(raw["solution"], answer)  # a solution grades as correct
        start, end = task.answer_span(raw["solution"])
        assert raw["solution"][start:end] == answer
    assert ds.to_list() == task.dataset("test", seed=0).to_list()
    assert ds["index"] != task.dataset("test", seed=1)["index"]
    assert len(task.dataset("train", n=2)) == 2  # one file serves every split


def test_math_reads_aime_jsonl_and_dapo_parquet(tmp_path):
    from gear.teacher import HINT_TEMPLATES, teacher_prompt

    aime = get_task("math", path=write_jsonl(tmp_path / "aime.jsonl", AIME_ROWS))
    rows = sorted(aime.dataset("test"), key=lambda r: r["index"])
    assert [r["answer"] for r in rows] == ["9", "2"]
    assert [r["ground_truth"] for r in rows] == ["9", "2"]  # no solution: the answer alone
    assert AIME_ROWS[0]["question"] in rows[0]["prompt"][0]["content"]

    dapo = get_task("math", path=write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS))
    rows = sorted(dapo.dataset("train"), key=lambda r: r["index"])
    assert [r["prompt"] for r in rows] == [d["prompt"] for d in DAPO_ROWS]  # used as is
    assert [r["answer"] for r in rows] == ["42", "-3"]
    hinted = teacher_prompt(rows[0]["prompt"], rows[0]["ground_truth"], HINT_TEMPLATES["math"])
    assert hinted[-1]["content"].endswith("Here is a reference solution:\n42\n\n"
                                          "Use it to check your own reasoning, then solve the "
                                          "problem yourself.")  # fmt: skip
    completions = ["6 * 7 = 42.\nAnswer: 42", as_messages("Answer: $-3$."), "Answer: 41", "42"]
    answers = ["42", "-3", "42", "42"]
    assert dapo.reward([None] * 4, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0]


def test_math_directory_takes_each_splits_file_in_either_format(tmp_path):
    write_parquet(tmp_path / "train.parquet", DAPO_ROWS)
    write_jsonl(tmp_path / "test.jsonl", MATH_ROWS)
    task = get_task("math", path=tmp_path)
    assert sorted(task.dataset("train")["answer"]) == ["-3", "42"]
    assert sorted(task.dataset("test")["answer"]) == sorted(MATH_ANSWERS)
    write_jsonl(tmp_path / "train.jsonl", AIME_ROWS)
    with pytest.raises(ValueError, match=r"holds train\.jsonl and train\.parquet"):
        task.dataset("train")
    (tmp_path / "test.jsonl").unlink()
    with pytest.raises(ValueError, match=r"holds neither of test\.jsonl, test\.parquet"):
        task.dataset("test")


def test_math_column_names_are_options_with_dotted_paths(tmp_path):
    rows = [
        {"q": "Add 2 and 3.", "meta": {"final": 5}, "work": "2 + 3 = 5"},
        {"q": "Add 1 and 1.", "meta": {"final": 2}, "work": "1 + 1 = 2"},
    ]
    path = write_parquet(tmp_path / "custom.parquet", rows)
    task = get_task("math", path=path, problem_key="q", answer_key="meta.final",
                    solution_key="work", prompt_template="Q: {problem}")  # fmt: skip
    ds = sorted(task.dataset("test"), key=lambda r: r["index"])
    assert [r["answer"] for r in ds] == ["5", "2"]
    assert [r["ground_truth"] for r in ds] == ["2 + 3 = 5", "1 + 1 = 2"]
    assert ds[0]["prompt"] == [{"role": "user", "content": "Q: Add 2 and 3."}]
    # a field named by an option must be in every row, even where a default one is
    path = write_jsonl(tmp_path / "named.jsonl", [*AIME_ROWS[1:], {"problem": "p", "answer": 1}])
    task = get_task("math", path=path, problem_key="question")
    with pytest.raises(
        ValueError, match=r"named\.jsonl: line 1 has no field 'question' \(problem_key\)"
    ):
        task.dataset("test")
    # a solution without a box is fine where the row has an answer
    path = write_jsonl(tmp_path / "both.jsonl", [{"problem": "p", "solution": "s", "answer": "1"}])
    assert get_task("math", path=path).dataset("test")[0]["ground_truth"] == "s"


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([{"question": "q", "answer": "1"}, {"text": "q", "answer": "1"}],
         r"line 2: no problem \(looked for \['problem', 'question', 'prompt'\]\); its fields: \['answer', 'text'\]"),
        ([{"problem": 7, "answer": "1"}], r"line 1: 'problem' is int 7, expected text or a chat"),
        ([{"problem": "  ", "answer": "1"}], r"line 1: 'problem' is str"),
        ([{"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}], r"line 1: 'prompt' is list"),
        ([{"problem": "p"}], r"line 1: no answer \(looked for \['answer', 'reward_model.ground_truth'\]"),
        ([{"problem": "p", "solution": "it is 4"}], r"line 1: no answer field, and its 'solution' has no closed"),
        ([{"problem": "p", "solution": "so \\boxed{4} or \\boxed{\\frac{1}{2}"}], r"line 1: .*no closed"),
        ([{"problem": "p", "solution": ""}], r"line 1: 'solution' is '', expected the text"),
        ([{"problem": "p", "answer": ["1", "2"]}], r"line 1: 'answer' is \['1', '2'\]"),
        ([{"problem": "p", "answer": True}], r"line 1: 'answer' is True"),
        ([{"problem": "p", "answer": " "}], r"line 1: 'answer' is ' '"),
        ([{"problem": "p", "reward_model": {"ground_truth": {}}}], r"line 1: 'reward_model.ground_truth' is \{\}"),
    ],
)  # fmt: skip
def test_math_bad_rows_are_errors_naming_the_file_and_the_row(tmp_path, rows, error):
    from gear.io import InputError

    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(InputError, match=f"bad\\.jsonl: {error}"):
        get_task("math", path=path).dataset("test", n=0)  # every row is checked, not only n


def test_math_parquet_errors_name_the_row_from_0(tmp_path):
    from gear.io import InputError

    rows = [{"problem": "p", "answer": "1"}, {"problem": "q", "answer": None}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(
        InputError, match=r"bad\.parquet: row 1: no answer .*its fields: \[.problem.\];"
    ):
        get_task("math", path=path).dataset("test")


def test_math_bad_files_and_options_are_clear_errors(tmp_path):
    from gear.io import InputError

    with pytest.raises(ValueError, match="math needs the option path="):
        get_task("math").dataset("test")
    with pytest.raises(InputError, match=r"nope\.jsonl: missing"):
        get_task("math", path=tmp_path / "nope.jsonl").dataset("test")
    with pytest.raises(InputError, match=r"nope\.parquet: missing"):
        get_task("math", path=tmp_path / "nope.parquet").dataset("test")
    with pytest.raises(InputError, match=r"math_data: missing: no such file or directory"):
        get_task("math", path=tmp_path / "math_data").dataset("test")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "answer": "1"}\n\n{not json\n')
    with pytest.raises(InputError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        get_task("math", path=bad).dataset("test")
    bad.write_text('{"problem": "p", "answer": "1"}\n["p", "1"]\n')
    with pytest.raises(InputError, match=r"bad\.jsonl: line 2 is a JSON list, expected an object"):
        get_task("math", path=bad).dataset("test")
    bad.write_text("\n")
    with pytest.raises(InputError, match=r"bad\.jsonl: holds no rows"):
        get_task("math", path=bad).dataset("test")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match=r"broken\.parquet: not a readable parquet file"):
        get_task("math", path=broken).dataset("test")
    (tmp_path / "data.csv").write_text("problem,answer\np,1\n")
    with pytest.raises(InputError, match=r"data\.csv: unknown file type '\.csv'"):
        get_task("math", path=tmp_path / "data.csv").dataset("test")
    with pytest.raises(ValueError, match=r"prompt_template needs a '\{problem\}'"):
        get_task("math", prompt_template="Solve it.")
    with pytest.raises(ValueError, match=r"answer_key must be a field name, got 3"):
        get_task("math", answer_key=3)
    with pytest.raises(ValueError, match=r"valid options: \['path', 'problem_key'"):
        get_task("math", column="x")


def test_math_boxes_close_over_nested_and_escaped_braces():
    from gear.tasks.math import boxed_spans, last_boxed

    text = "\\boxed{\\frac{\\sqrt{2}}{2}} and \\fbox{\\{1\\}} then \\boxed 7$ and \\boxed{3"
    spans = boxed_spans(text)
    assert [text[s[0] : s[1]] if s else None for s in spans] == [
        "\\frac{\\sqrt{2}}{2}", "\\{1\\}", "7", None
    ]  # fmt: skip
    assert last_boxed(text) is None  # the last box never closes
    assert last_boxed("$\\boxed{ \\left\\{ x \\right. }$") == "\\left\\{ x \\right."
    assert last_boxed("no box") is None and last_boxed("\\boxed{}") is None


def test_math_grades_the_final_answer_by_math_verify_where_the_span_says():
    task = get_task("math")  # grading needs no data
    cases = [  # (completion, reference, correct, the span's text)
        ("so $x = \\boxed{\\dfrac34}$.", "\\frac{3}{4}", True, "\\dfrac34"),
        ("\\boxed{0.75}", "\\frac{3}{4}", True, "0.75"),
        ("\\boxed{\\{1, -1\\}}", "\\{-1, 1\\}", True, "\\{1, -1\\}"),
        ("\\boxed{2\\sqrt2}", "2\\sqrt{2}", True, "2\\sqrt2"),
        ("\\boxed{\\text{(C)}}", "C", True, "\\text{(C)}"),
        ("First 3, then\nAnswer: $x = 5$.", "5", True, "x = 5"),
        ("The final answer is **9**.", "9", True, "9"),
        ("Answer: 41", "42", False, "41"),
        ("\\boxed{41} no, \\boxed{42}", "42", True, "42"),
        ("\\boxed{42} no, \\boxed{4", "42", False, None),  # cut short: no final answer
        ("it is 42", "42", False, None),  # no box and no marker: not graded as an answer
        ("the answers are 42", "42", False, None),
    ]
    for text, reference, correct, span_text in cases:
        assert task.is_correct(text, reference) is correct, text
        span = task.answer_span(text)
        assert (None if span is None else text[span[0] : span[1]]) == span_text, text


def test_math_rows_feed_verl_and_its_reward(tmp_path):
    from gear.integrations.verl.data import verl_rows
    from gear.integrations.verl.rewards import compute_score

    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS[:1])
    (row,) = verl_rows("math", "train", path=str(path))
    assert row["data_source"] == "gear/math"
    assert row["reward_model"]["ground_truth"] == "\\frac{3}{4}"
    assert row["extra_info"]["ground_truth"] == MATH_ROWS[0]["solution"]
    assert compute_score("gear/math", "so \\boxed{3/4}", "\\frac{3}{4}") == 1.0
    assert compute_score("gear/math", "so \\boxed{1/4}", "\\frac{3}{4}") == 0.0


# ---------------------------------------------------------------- bfcl


@pytest.fixture(scope="module")
def bfcl():
    if not (BFCL / "possible_answer").is_dir():
        pytest.skip("no BFCL data")
    return get_task("bfcl", data_dir=BFCL)


def test_bfcl_dataset(bfcl):
    train, test = bfcl.dataset("train"), bfcl.dataset("test")
    check_prompts(train)
    assert len(train) + len(test) == 800 and 100 < len(test) < 220
    assert not set(train["id"]) & set(test["id"])
    assert set(train["category"]) == {"simple_python", "multiple", "parallel"}
    assert train.to_list()[:10] == bfcl.dataset("train", seed=0).to_list()[:10]
    assert train["id"][:10] != bfcl.dataset("train", seed=1)["id"][:10]
    row = train[0]
    assert row["prompt"][0]["role"] == "system" and "<tool_call>" in row["prompt"][0]["content"]
    for tool in row["tools"]:
        assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
        assert tool["function"]["name"] in row["prompt"][0]["content"]
    schemas = json.dumps([t for r in train for t in r["tools"]])
    assert '"type": "dict"' not in schemas and '"type": "float"' not in schemas
    assert bfcl.is_correct(row["ground_truth"], row["answer"])
    assert len(get_task("bfcl", data_dir=BFCL, categories="parallel").dataset("test", n=5)) == 5


def _variants(ground_truth: list[dict]) -> list[list[dict]]:
    """The reference calls with each argument set to each accepted value (or omitted if "")."""
    canon = reference_calls(ground_truth)
    out = [canon, canon[::-1]]
    for i, call in enumerate(ground_truth):
        ((_, params),) = call.items()
        for param, options in params.items():
            for option in options:
                variant = copy.deepcopy(canon)
                if option == "":
                    variant[i]["arguments"].pop(param, None)
                else:
                    variant[i]["arguments"][param] = concrete(option)
                out.append(variant)
    return out


def _wrong(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + " extra"
    if isinstance(value, list):
        return [*value, value[0]] if value else [0]
    return {**value, "unexpected": 1} if isinstance(value, dict) else "x"


def test_bfcl_checker_on_real_rows(bfcl):
    rows = random.Random(0).sample(bfcl.rows(), 300)
    for row in rows:
        answer = json.dumps(row["ground_truth"])
        for variant in _variants(row["ground_truth"]):
            assert bfcl.is_correct(render_calls(variant), answer), (row["id"], variant)
        canon = reference_calls(row["ground_truth"])
        key = next(iter(canon[0]["arguments"]))
        wrong = copy.deepcopy(canon)
        wrong[0]["arguments"][key] = _wrong(wrong[0]["arguments"][key])
        assert not bfcl.is_correct(render_calls(wrong), answer), (row["id"], wrong)
        extra = copy.deepcopy(canon)
        extra[0]["arguments"]["not_a_param"] = 1
        assert not bfcl.is_correct(render_calls(extra), answer)
        assert not bfcl.is_correct(render_calls(canon + canon[:1]), answer)  # one call too many
        if len(canon) > 1:
            assert not bfcl.is_correct(render_calls(canon[:-1]), answer)


def test_bfcl_checker_semantics(bfcl):
    gt = [
        {"spotify.play": {"artist": ["Taylor Swift"], "duration": [20], "shuffle": ["", False]}},
        {"spotify.play": {"artist": ["Maroon 5"], "duration": [15.0], "shuffle": ["", False]}},
    ]
    answer = json.dumps(gt)
    ok = [
        '<tool_call>[{"name": "spotify.play", "arguments": {"artist": "Maroon 5", "duration": 15}},'
        ' {"name": "spotify.play", "arguments": {"artist": "taylor swift", "duration": 20.0}}]</tool_call>',
        '[spotify_play(artist="Taylor Swift", duration=20, shuffle=False), '
        'spotify.play(artist="Maroon 5", duration=15)]',
        '<tool_call>\n{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}\n'
        '</tool_call>\n<tool_call>\n{"name": "spotify.play", "arguments": '
        '{"artist": "Maroon 5", "duration": 15}}\n</tool_call>',
    ]
    bad = [
        ok[0].replace("Maroon 5", "Maroon 6"),
        ok[0].replace('"duration": 15}', '"duration": "15"}'),  # string for a number
        ok[0].replace('"duration": 15}', '"duration": 15, "shuffle": 0}'),  # 0 is not False
        ok[0].replace('"duration": 15}', '"duration": 15, "shuffle": true}'),
        ok[0].replace('"duration": 20.0', '"volume": 20.0'),
        '<tool_call>[{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}]</tool_call>',
        "I would call spotify.play twice.",
        "",
    ]
    assert all(bfcl.is_correct(text, answer) for text in ok)
    assert not any(bfcl.is_correct(text, answer) for text in bad)
    tool_calls = [
        {
            "type": "function",
            "function": {"name": "spotify.play", "arguments": {"artist": a, "duration": d}},
        }
        for a, d in (("Taylor Swift", 20), ("Maroon 5", 15))
    ]
    completions = [[{"role": "assistant", "content": "", "tool_calls": tool_calls}], ok[1], bad[0]]
    assert bfcl.reward([None] * 3, completions, answer=[answer] * 3) == [1.0, 1.0, 0.0]


def test_bfcl_parse_forms():
    expected = [("f", {"a": 1})]
    for text in (
        '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}',  # unclosed tag, string arguments
        "<tool_call>[{'name': 'f', 'arguments': {'a': 1}}]</tool_call>",
        'Sure: [{"name": "f", "parameters": {"a": 1}}]',
        '```json\n{"f": {"a": 1}}\n```',
        '[{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]',
        "[f(a=1)]",
    ):
        assert parse_calls(text) == expected, text
    for text in ("f(1)", "<tool_call>oops</tool_call>", "no calls here", '{"a": 1, "b": 2}'):
        assert parse_calls(text) is None, text


def test_bfcl_errors(tmp_path):
    with pytest.raises(ValueError, match=r"multi_turn_base.*valid: \['simple_python'"):
        get_task("bfcl", data_dir=tmp_path, categories=["multi_turn_base"])
    with pytest.raises(FileNotFoundError, match=r"BFCL_v4_simple_python\.json"):
        get_task("bfcl", data_dir=tmp_path).dataset("train")
    if importlib.util.find_spec("bfcl_eval") is None:
        with pytest.raises(ValueError, match="data_dir"):
            get_task("bfcl")


# ---------------------------------------------------------------- tools


def test_tool_env():
    env = ToolEnv()
    env.reset(state='{"apples": 37, "pears": 12}', prompt=[], answer="49")
    assert env.lookup("Apples") == "37" and env.calculator("37 + 12") == "49"
    assert env.calculator("7 / 2") == "3.5" and env.calculator("(2 + 3) * -4") == "-20"
    assert [c[0] for c in env.calls] == ["lookup", "calculator", "calculator", "calculator"]
    for bad in ("__import__('os')", "2 ** 1000000", "1 / 0", "x + 1"):
        with pytest.raises(ValueError):
            env.calculator(bad)
    with pytest.raises(ValueError, match="unknown item"):
        env.lookup("bananas")
    env.reset()
    assert env.stock == {} and env.calls == []
    assert safe_eval("3 × 4") == 12


def test_tools_dataset_and_reward():
    task = get_task("tools")
    ds = task.dataset("train", n=50, seed=0)
    check_prompts(ds)
    assert ds.to_list() == task.dataset("train", n=50, seed=0).to_list()
    assert ds["prompt"] != task.dataset("train", n=50, seed=1)["prompt"]
    assert set(ds["kind"]) == {"calc", "lookup"}
    assert ds[0]["tools"] == tool_schemas()

    def problems(split, n):
        ds = task.dataset(split, n=n)
        return {p[1]["content"] + s for p, s in zip(ds["prompt"], ds["state"], strict=True)}

    assert not problems("train", 1000) & problems("test", 300)
    for row in ds:  # the reference calls, replayed in the row's environment, give the answer
        env = ToolEnv()
        env.reset(**row)
        for block in row["ground_truth"].split("<tool_call>\n")[1:]:
            call = json.loads(block.split("\n</tool_call>")[0])
            result = getattr(env, call["name"])(**call["arguments"])
        assert result == row["answer"] and row["ground_truth"].endswith(f"Answer: {row['answer']}")
        assert task.is_correct(row["ground_truth"], row["answer"])
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "40 + 9"}},
    }
    rollout = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": "49"},
        {"role": "assistant", "content": "Answer: 49"},
    ]
    unfinished = [*rollout[:2], {"role": "assistant", "content": "", "tool_calls": [call]}]
    tool_only = rollout[:2]
    completions = [rollout, unfinished, tool_only, "Answer: 49", "Answer: 48", rollout[2]]
    assert task.reward([None] * 6, completions, answer=["49"] * 6) == [1, 0, 0, 1, 0, 1]


def test_tools_prepare_tokenizer():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from gear.models import byte_tokenizer

    task = get_task("tools")
    tok = byte_tokenizer()  # SmolLM2's chat template: no tool support
    assert not supports_tool_calling(tok)
    tok = task.prepare_tokenizer(tok)
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    row = task.dataset("test", n=1)[0]
    text = tok.apply_chat_template(
        row["prompt"], tools=row["tools"], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n" + row["prompt"][0]["content"])
    assert '"name": "lookup"' in text and "Qwen" not in text
    env = ToolEnv()  # TRL renders the environment's bound methods: same text as the tools column
    assert text == tok.apply_chat_template(
        row["prompt"],
        tools=[env.calculator, env.lookup],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert task.prepare_tokenizer(tok) is tok
    assert get_task("arithmetic").prepare_tokenizer(tok) is tok
    assert get_task("arithmetic").trainer_kwargs() == {}
    assert task.trainer_kwargs() == {"environment_factory": ToolEnv}


def test_tools_trl_tool_loop(tmp_path, monkeypatch):
    """GRPOTrainer with the task's kwargs runs the tool loop: a scripted policy that emits the
    reference calls gets the environment's results back and earns reward 1."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    from gear.models import tiny_model_and_tokenizer

    task = get_task("tools")
    model, tok = tiny_model_and_tokenizer(vocab="bytes", hidden_size=16, num_layers=1)
    tok = task.prepare_tokenizer(tok)
    ds = task.dataset("train", n=20)
    ds = ds.select([ds["kind"].index("calc"), ds["kind"].index("lookup")])
    calls = {
        row["prompt"][1]["content"]: row["ground_truth"].split("<tool_response>") for row in ds
    }
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=1,
        max_completion_length=512, max_tool_calling_iterations=4, report_to=[], save_strategy="no",
        use_cpu=True, logging_steps=1,
    )  # fmt: skip
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return task.reward(prompts, completions, **kwargs)

    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[reward], train_dataset=ds, args=args,
        **task.trainer_kwargs(),
    )  # fmt: skip

    def scripted(prompt_ids, *args, **kwargs):
        outs = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            question = next(q for q in calls if q in text)
            steps = [s.split("<tool_call>\n")[-1] for s in calls[question][:-1]]
            done = text.count("<tool_response>")
            if done < len(steps):
                reply = "<tool_call>\n" + steps[done].strip() + "<|im_end|>"
            else:
                last = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
                reply = f"Answer: {last}<|im_end|>"
            outs.append(tok(reply, add_special_tokens=False)["input_ids"])
        return outs, None

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] > 0 and logs["tools/failure_frequency"] == 0
    assert logs["reward"] == 1.0 and len(seen) == 4
    assert {c[0]["tool_calls"][0]["function"]["name"] for c in seen} == {"calculator", "lookup"}
    assert all(any(m["role"] == "tool" for m in c) for c in seen)

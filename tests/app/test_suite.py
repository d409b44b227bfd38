"""`gear eval --suite` (issue 69): the paper's benchmark table on the real shared files, scored as
papers score it, a run's model beside its base, resumable per benchmark, bad input refused
before any model loads; and every row of each shared file read and checked."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gear.app import suite
from gear.app.cli import app
from gear.models import tiny_model_and_tokenizer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
needs_data = pytest.mark.skipif(
    not (DATA / "math500" / "test.jsonl").is_file(), reason="no shared data"
)
runner = CliRunner()
FAST = ["--limit", "2", "--samples", "2", "--max-new-tokens", "3", "--batch-size", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny random models (seeds 0 and 1): a base and a 'trained' one."""
    paths = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny{seed}")
        model, tokenizer = tiny_model_and_tokenizer(seed=seed)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture()
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(suite, "_load", refuse)


# ---------------------------------------------------------------- the real files, every row


@needs_data
def test_every_row_of_the_math_files_is_read_with_its_problem_and_answer():
    from gear.tasks import get_task
    from gear.tasks.math import last_boxed

    for name, size in (("math500/test.jsonl", 500), ("aime/aime24.jsonl", 30),
                       ("aime/aime25.jsonl", 30)):  # fmt: skip
        path = DATA / name
        raw = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = list(get_task("math", path=path).dataset("test"))  # every row parsed and checked
        assert len(raw) == len(rows) == size, name
        for row in rows:
            source = raw[row["index"]]
            assert isinstance(source["problem"], str) and source["problem"].strip()
            assert row["prompt"][0]["content"].startswith(source["problem"])
            assert row["answer"] == str(source["answer"]).strip() != ""
            if "aime" in name:
                assert set(source) == {"problem", "answer"}
                assert row["answer"].isdigit() and 0 <= int(row["answer"]) <= 999
            else:
                assert set(source) == {"problem", "solution", "answer"}
                assert last_boxed(source["solution"]) == source["answer"]  # MATH's own answer
                assert row["ground_truth"] == source["solution"]


@needs_data
@pytest.mark.parametrize(("split", "size"), [("test", 1319), ("train", 7473)])
def test_every_row_of_gsm8k_is_read_with_a_numeric_final_answer(split, size):
    from gear.tasks import get_task
    from gear.tasks.base import to_number

    raw = [json.loads(line) for line in (DATA / "gsm8k" / f"{split}.jsonl").open()]
    rows = list(get_task("gsm8k", path=DATA / "gsm8k").dataset(split))
    assert len(raw) == len(rows) == size
    for row in rows:
        assert set(raw[row["index"]]) == {"question", "answer"}
        assert to_number(row["answer"]) is not None, row["answer"]
        assert row["ground_truth"].endswith(f"The answer is {row['answer']}.")


@needs_data
def test_every_bfcl_question_has_functions_and_an_answer():
    from gear.tasks import get_task

    sizes = {"simple_python": 400, "multiple": 200, "parallel": 200, "multi_turn_base": 200}
    for category, size in sizes.items():
        name = f"BFCL_v4_{category}.json"
        questions = [json.loads(x) for x in (DATA / "bfcl" / name).open() if x.strip()]
        answers = {
            a["id"]: a for a in map(json.loads, (DATA / "bfcl" / "possible_answer" / name).open())
        }
        assert len(questions) == len(answers) == size, category
        for q in questions:
            assert isinstance(q["question"], list) and q["question"], q["id"]
            for turn in q["question"]:
                assert turn and all(m["role"] and isinstance(m["content"], str) for m in turn)
            assert isinstance(answers[q["id"]]["ground_truth"], list), q["id"]
            if category == "multi_turn_base":  # its tools: a class's doc in multi_turn_func_doc/
                assert q["involved_classes"] and len(answers[q["id"]]["ground_truth"]) == len(
                    q["question"]
                )
            else:
                assert q["function"] and all(
                    "name" in f and "parameters" in f for f in q["function"]
                )
    assert len(list((DATA / "bfcl" / "multi_turn_func_doc").glob("*.json"))) == 12
    task = get_task("bfcl", data_dir=DATA / "bfcl")  # the suite's three single-turn categories
    rows = list(task.dataset("test")) + list(task.dataset("train"))
    assert len(rows) == len(task.rows()) == 800
    assert all(task.reference_text(r["answer"]) for r in rows)


# ---------------------------------------------------------------- metrics


def test_wilson_keeps_a_width_where_no_problem_is_solved():
    lo, hi = suite.wilson(0.0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.161, abs=1e-3)
    lo, hi = suite.wilson(0.5, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)
    assert suite.wilson(1.0, 30)[1] == 1.0 and all(math.isnan(x) for x in suite.wilson(0.0, 0))


def test_aime_scores_avg_at_k_and_the_unbiased_pass_at_k_per_problem():
    bench = suite.BENCHMARKS["aime24"]
    rows = [
        {"problem": 3, "correct": [True, False, False, False]},
        {"problem": 7, "correct": [False] * 4},
        {"problem": 9, "correct": [True] * 4},
    ]
    out = suite.scores(bench, rows, 4)
    assert out["avg@4"] == {"3": 0.25, "7": 0.0, "9": 1.0}
    assert out["pass@4"] == {"3": 1.0, "7": 0.0, "9": 1.0}
    greedy = suite.scores(suite.BENCHMARKS["math500"], rows[:2], 1)
    assert greedy == {"pass@1": {"3": 1.0, "7": 0.0}}  # the first completion decides greedy
    assert suite.summarise(out["avg@4"])["value"] == pytest.approx(1.25 / 3)


def test_the_paired_difference_pairs_scores_by_problem_not_by_position():
    model = {"a": 1.0, "b": 0.0, "c": 1.0}
    base = {"c": 0.0, "a": 1.0, "b": 0.0}  # another order
    d = suite.difference(model, base)
    assert d["mean"] == pytest.approx(1 / 3) and d["n"] == 3


# ---------------------------------------------------------------- the suite end to end


@needs_data
def test_paper_math_suite_writes_the_table_with_the_base_beside_the_model(tiny, tmp_path):
    base, model = tiny
    out = tmp_path / "out"
    args = ["eval", str(model), "--base", str(base), "--suite", "paper-math"]
    result = runner.invoke(app, [*args, "--data-dir", str(DATA), *FAST, "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = json.loads((out / "suite_paper-math.json").read_text())
    assert (table["model"], table["base"]) == (str(model), str(base))
    got = [(r["benchmark"], r["metric"]) for r in table["rows"]]
    assert got == [("math500", "pass@1"), ("gsm8k", "pass@1"), ("aime24", "avg@2"),
                   ("aime24", "pass@2"), ("aime25", "avg@2"), ("aime25", "pass@2")]  # fmt: skip
    for row in table["rows"]:
        assert row["n"] == 2 and row["max_new_tokens"] == 3
        assert "{" in row["template"]  # the prompt template itself
        sampled = row["benchmark"].startswith("aime")
        assert (row["samples"], row["temperature"]) == ((2, 0.6) if sampled else (1, 0.0))
        for side in ("model", "base"):
            lo, hi = row[side]["ci"]
            assert 0 <= lo <= row[side]["value"] <= hi <= 1
        assert row["difference"]["n"] == 2
        assert row["data"].startswith(str(DATA))
    md = (out / "suite_paper-math.md").read_text()
    assert "| AIME 2024 | avg@2 | 2 |" in md and "model − base, paired [95%]" in md
    assert "Please reason step by step" in md
    for label in ("model", "base"):  # each benchmark's record, with every completion
        record = json.loads((out / "suite_paper-math" / label / "aime25.json").read_text())
        assert len(record["rows"]) == 2 and all(len(r["completions"]) == 2 for r in record["rows"])
        assert record["settings"]["model"].startswith("sha256:")
    log = (out / "suite_paper-math" / "suite.log").read_text()
    assert "model aime25 (2 samples at T=0.6): 1/2 problems" in log  # a line per batch
    assert "base math500 (greedy): 2/2 problems" in log


@needs_data
def test_a_stopped_suite_continues_from_the_benchmarks_it_scored(tiny, tmp_path, monkeypatch):
    _, model = tiny
    settings = suite.Settings("paper-math", data_dir=str(DATA), k=2, max_new_tokens=3, limit=2)
    scored = []
    real = suite.evaluate

    def stop_at_aime25(model_, tokenizer, task, **kw):
        if len(scored) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the fourth benchmark
        scored.append(task.path)
        return real(model_, tokenizer, task, **kw)

    monkeypatch.setattr(suite, "evaluate", stop_at_aime25)
    with pytest.raises(KeyboardInterrupt):
        suite.run(str(model), settings, tmp_path)
    kept = sorted(p.stem for p in (tmp_path / "suite_paper-math" / "model").glob("*.json"))
    assert kept == ["aime24", "gsm8k", "math500"]  # each written when scored; no temporaries
    assert not list((tmp_path / "suite_paper-math").rglob("*.tmp"))
    scored.clear()
    monkeypatch.setattr(suite, "evaluate", real)
    result = suite.run(str(model), settings, tmp_path)
    assert len(result["rows"]) == 6
    log = (tmp_path / "suite_paper-math" / "suite.log").read_text()
    assert log.count("kept from an earlier run") == 3 and "model aime25: avg@2" in log
    # other settings: only the sets they change are scored again
    calls = []
    monkeypatch.setattr(
        suite, "evaluate", lambda *a, **kw: calls.append(a[2].path) or real(*a, **kw)
    )
    suite.run(str(model), dataclasses.replace(settings, k=3), tmp_path)
    assert sorted(Path(p).name for p in calls) == ["aime24.jsonl", "aime25.jsonl"]
    assert (
        "kept with other settings (samples); scored again"
        in (tmp_path / "suite_paper-math" / "suite.log").read_text()
    )


@needs_data
def test_a_run_directory_is_scored_beside_its_base_model_with_its_chat_settings(
    tiny, tmp_path, no_model_loads, monkeypatch
):
    base, model = tiny
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    for f in model.iterdir():
        (run / "final" / f.name).write_bytes(f.read_bytes())
    (run / "config.yaml").write_text(
        f"model: {base}\ntask: math\ntrainer:\n  chat_template_kwargs: {{enable_thinking: false}}\n"
    )
    seen = {}

    def fake_run(model_path, settings, out_dir, base_path, planned, log_stream=None):
        seen.update(model=model_path, base=base_path, out=out_dir, settings=settings)
        return {"suite": settings.suite, "model": model_path, "base": base_path, "rows": [],
                "settings": {}, "intervals": ""}  # fmt: skip

    monkeypatch.setattr(suite, "run", fake_run)
    result = runner.invoke(app, ["eval", str(run), "--suite", "paper-tools",
                                 "--data-dir", str(DATA), "--limit", "2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen["model"] == str(run / "final") and seen["base"] == str(base)
    assert seen["out"] == run and seen["settings"].limit == 2
    assert seen["settings"].chat_template_kwargs == {"enable_thinking": False}


@needs_data
def test_paper_tools_scores_bfcl_greedy(tiny, tmp_path):
    _, model = tiny
    settings = suite.Settings("paper-tools", data_dir=str(DATA), max_new_tokens=3, limit=2)
    result = suite.run(str(model), settings, tmp_path)
    (row,) = result["rows"]
    assert (row["benchmark"], row["metric"], row["n"], row["temperature"]) == (
        "bfcl",
        "pass@1",
        2,
        0.0,
    )
    assert "<tool_call>" in row["template"]


def test_progress_goes_to_the_gear_suite_logger(tiny, tmp_path, caplog):
    _, model = tiny
    data = tmp_path / "aime.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i} + 1?", "answer": i + 1}) + "\n"
                            for i in range(3)))  # fmt: skip
    paths = {n: str(data) for n in suite.SUITES["paper-math"]} | {"gsm8k": str(_gsm8k(tmp_path))}
    settings = suite.Settings("paper-math", paths=paths, k=1, max_new_tokens=2, batch_size=2)
    with caplog.at_level(logging.INFO, logger="gear.app.suite"):
        suite.run(str(model), settings, tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if "/3 problems" in r.getMessage()]
    assert len(lines) == 8  # 2 batches x 4 sets
    assert "model math500 (greedy): 2/3 problems" in lines[0]
    assert "model aime24 (1 samples at T=0.6): 3/3 problems" in lines[5]


def _gsm8k(tmp_path: Path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(3)))  # fmt: skip
    return path


# ---------------------------------------------------------------- bad input, before a model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "0"], "--samples: k, the samples per AIME problem, expected an integer >= 1, got 0"),
        (["--temperature", "0"], "--temperature: avg@k and pass@k sample at a temperature above 0"),
        (["--limit", "0"], "--limit: problems per set, expected an integer >= 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens: the generation budget"),
        (["--suite-path", "aime24=nope.jsonl"], "aime24 (AIME 2024): nope.jsonl: missing"),
        (["--suite-path", "mmlu=x.jsonl"], "--suite-path: ['mmlu'] is not in suite paper-math"),
        (["--task", "math"], "--suite scores its own sets: --task"),
        (["--n", "5"], "--suite scores its own sets"),
        (["--set", "task_options={path: x}"], "--set task_options does not apply"),
        (["--suite-path", "aime24"], "--suite-path 'aime24': expected NAME=PATH"),
    ],
)  # fmt: skip
@needs_data
def test_bad_input_is_one_line_naming_the_option_before_any_model_loads(
    tiny, args, message, no_model_loads, tmp_path
):
    _, model = tiny
    cmd = ["eval", str(model), "--suite", "paper-math", "--data-dir", str(DATA), *args]
    result = runner.invoke(app, [*cmd, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_missing_data_directory_or_file_is_named(tiny, tmp_path, no_model_loads, monkeypatch):
    _, model = tiny
    monkeypatch.delenv(suite.DATA_ENV, raising=False)
    result = runner.invoke(app, ["eval", str(model), "--suite", "paper-math"])
    assert result.exit_code == 2
    assert "--data-dir: not given and GEAR_DATA_DIR is not set" in " ".join(result.output.split())
    result = runner.invoke(app, ["eval", str(model), "--suite", "paper-mat", "--data-dir", "x"])
    assert "--suite: unknown suite 'paper-mat'; valid: paper-math, paper-tools" in result.output
    monkeypatch.setenv(suite.DATA_ENV, str(tmp_path))  # named once, in the environment
    result = runner.invoke(app, ["eval", str(model), "--suite", "paper-math"])
    words = " ".join(result.output.split())
    assert (
        result.exit_code == 2
        and f"math500 (MATH-500): {tmp_path}/math500/test.jsonl: missing" in words
    )
    bad = tmp_path / "math500"
    bad.mkdir()
    (bad / "test.jsonl").write_text('{"problem": "p", "answer": NaN}\n')
    result = runner.invoke(app, ["eval", str(model), "--suite", "paper-math"])
    words = " ".join(result.output.split())
    assert "math500 (MATH-500): " in words and "line 1: 'answer' is nan" in words


@needs_data
def test_ctrl_c_says_the_same_command_continues(tiny, tmp_path, monkeypatch):
    _, model = tiny

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "evaluate", interrupted)
    args = ["eval", str(model), "--suite", "paper-tools", "--data-dir", str(DATA), "--limit", "1"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 130
    assert "the same command continues from the benchmarks already scored" in result.output


def test_suite_options_without_a_suite_are_refused(tiny, no_model_loads):
    _, model = tiny
    for extra in (["--limit", "3"], ["--base", str(model)], ["--suite-path", "aime24=x"]):
        result = runner.invoke(app, ["eval", str(model), *extra])
        assert result.exit_code == 2 and "go with --suite" in result.output

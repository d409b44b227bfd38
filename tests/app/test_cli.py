"""The `gear` CLI end to end on a tiny model: train, resume, eval, inspect, compare, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gear.app.cli import app
from gear.app.config import resolve_config
from gear.app.precision import cpu_capability, native_cpu_bf16
from gear.models import tiny_model_and_tokenizer

runner = CliRunner()
TINY = [
    "--set",
    "max_completion_length=8",
    "--set",
    "per_device_train_batch_size=4",
    "--set",
    "num_generations=4",
    "--set",
    "eval_n=4",
    "--set",
    "eval_max_new_tokens=8",
    "--set",
    "credit_log_steps=1",
    "--set",
    "save_steps=1",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory) -> tuple[Path, str]:
    """A 2-step run: its directory and what `gear train` printed (CliRunner: not a terminal)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    result = runner.invoke(
        app, ["train", "--model", str(tiny_dir), "--steps", "2", "--output-dir", str(out), *TINY]
    )
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="module")
def run_dir(trained) -> Path:
    return trained[0]


def test_train_writes_a_complete_run_directory(run_dir):
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "summary.md",
        "final",
        "checkpoint-2",
        "plots/reward.png",
        "plots/trajectory.png",
    ):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == "gear" and summary["steps"] == 2
    assert {"eval_before", "eval_after"} <= set(summary)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "gear/kl_mean" in m]
    assert steps == [1, 2]
    assert list((run_dir / "credit").glob("step_*.jsonl"))


def test_config_yaml_keeps_bf16_auto_and_records_the_precision_chosen_for_this_machine(run_dir):
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    native, _ = native_cpu_bf16()
    assert saved["trainer"]["bf16"] == "auto"  # the request, resolved again where it resumes
    assert saved["precision"]["asked"] == "auto" and saved["precision"]["bf16"] is native
    assert saved["precision"]["capability"] == cpu_capability()
    assert saved["precision"]["reason"]


def test_train_prints_one_line_per_step_when_output_is_not_a_terminal(trained):
    output = trained[1]
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    for line in lines:
        assert re.fullmatch(
            r"step \d+/2  reward [\d.]+  (kl_mean [\d.]+|all rows tied)  "
            r"median [\d.]+ s/step  last [\d.]+ s  eta \dm \d\ds",
            line,
        ), line
    assert "precision: float32" in output or "precision: bf16" in output


def _progress_lines(monkeypatch, times: list[float], logs: list[dict]) -> list[str]:
    """`step_line` of steps 1, 2, ... ending at `times` (seconds after training began)."""
    from types import SimpleNamespace

    from gear.app import callbacks as run_callbacks
    from gear.app.callbacks import ProgressCallback, step_line

    clock = iter(times)
    monkeypatch.setattr(run_callbacks, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    progress = ProgressCallback(console=None)
    state = SimpleNamespace(global_step=0, max_steps=len(logs) + 1)
    out = []
    for log in logs:
        state.global_step += 1
        out.append(step_line(progress, state, log))
    return out


def test_the_progress_line_shows_the_last_steps_time_beside_the_median(monkeypatch):
    """Issue 59 item 15: a slow step shows at once, not hidden by the median."""
    logs = [{"reward": 0.5, "gear/kl_mean": 0.1, "frac_reward_zero_std": 0.5}] * 3
    lines = _progress_lines(monkeypatch, [30.0, 60.0, 280.0], logs)
    head = "reward 0.500  kl_mean 0.100  median 30.0 s/step"
    assert lines[0] == f"step 1/4  {head}  last 30.0 s  eta 1m 30s"
    assert lines[2] == f"step 3/4  {head}  last 220.0 s  eta 0m 30s"


def test_a_step_whose_rows_all_tie_says_so_and_prints_no_kl(monkeypatch):
    """Issue 59 item 14: no KL was measured (TRL logs the NaN mean as None); what the line said
    before, `kl_mean 0.000`, read as a measurement. A run that skips no rows measured a KL on
    them, but with every advantage 0 it moves nothing: the line says the same."""
    from types import SimpleNamespace

    from gear.app.callbacks import ProgressCallback

    tied = {"reward": 1.0, "gear/kl_mean": None, "frac_reward_zero_std": 1.0}
    for log in (tied, tied | {"gear/kl_mean": 0.2}):
        [line] = _progress_lines(monkeypatch, [10.0], [log])
        assert "all rows tied" in line and "kl_mean" not in line, line
    [line] = _progress_lines(monkeypatch, [10.0], [{"reward": 1.0, "gear/kl_mean": None}])
    assert "  kl_mean -  " in line  # not measured (a method without a teacher), not tied
    # the bar on a terminal says the same
    shown = []
    bar = ProgressCallback(console=None)
    bar.progress = SimpleNamespace(update=lambda task, info: shown.append(info))
    for log in (tied, {"reward": 0.5, "gear/kl_mean": 0.25, "frac_reward_zero_std": 0.0}):
        bar.on_log(None, SimpleNamespace(global_step=1), None, logs=log)
    assert shown == ["reward 1.000  all rows tied", "reward 0.500  kl_mean 0.250"]


def test_dry_run_checks_and_prints_the_config_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "--dry-run", "--output-dir", str(out), "--set", "learning_rate=2e-6"]
    )
    assert result.exit_code == 0, result.output
    assert "learning_rate: 2.0e-06" in result.output and "precision:" in result.output
    assert not out.exists()


def test_set_values_are_converted_only_where_lossless_and_stay_plain_yaml():
    cfg = resolve_config(
        None,
        {"max_steps": 1e3, "learning_rate": 1, "lr_scheduler_type": "cosine", "run_name": 7,
         "report_to": "none", "bf16": "auto", "task_options": {"digits": 2}},
    )  # fmt: skip
    assert cfg.trainer["max_steps"] == 1000 and isinstance(cfg.trainer["max_steps"], int)
    assert cfg.trainer["learning_rate"] == 1 and cfg.trainer["run_name"] == "7"
    assert cfg.trainer["lr_scheduler_type"] == "cosine" and cfg.task_options == {"digits": 2}
    text = yaml.safe_dump(dataclasses.asdict(cfg))  # what config.yaml holds
    assert yaml.safe_load(text)["trainer"]["lr_scheduler_type"] == "cosine"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--method", "grpo"], ["--method grpo", "credit_method: 'gear'"]),
        (["--model", "smollm2"], ["--model smollm2"]),
        (["--seed", "1"], ["--seed 1", "seed: 0"]),
        (["--task", "gsm8k"], ["--task gsm8k"]),
        (["--output-dir", "elsewhere"], ["--output-dir elsewhere"]),
        (["--set", "learning_rate=1e-3"], ["--set learning_rate=0.001"]),
        (["--set", "eval_n=8", "--seed", "2"], ["--set eval_n=8", "--seed 2"]),
        (["--steps", "1"], ["max_steps 1", "checkpoint-2"]),  # before the checkpoint's step
        (["default"], ["CONFIG argument (default)"]),
    ],
    ids=["method", "model", "seed", "task", "output-dir", "set", "two", "steps-back", "config"],
)
def test_resume_refuses_options_that_would_change_the_run_and_names_them(run_dir, args, names):
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    result = runner.invoke(app, ["train", "--resume", str(run_dir), *args])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    for name in names:
        assert name in output, output
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # nothing written


def test_resume_accepts_the_runs_own_values_and_the_changes_it_allows(run_dir, tiny_dir):
    same = ["--model", str(tiny_dir), "--seed", "0", "--method", "gear", "--set", "beta=0.0"]
    result = runner.invoke(app, ["train", "--resume", str(run_dir), *same, "--dry-run"])
    assert result.exit_code == 0, result.output
    allowed = ["--steps", "9", "--set", "save_steps=3", "--set", "bf16=false", "--dry-run"]
    result = runner.invoke(app, ["train", "--resume", str(run_dir), *allowed])
    assert result.exit_code == 0, result.output
    for line in ("max_steps: 9", "save_steps: 3", "bf16: false"):
        assert f"\n  {line}\n" in result.output


def test_resume_continues_from_the_last_checkpoint_and_resolves_bf16_auto_again(
    run_dir, monkeypatch
):
    """The run was trained with bf16 on this machine's choice; resumed on an AVX2-only CPU
    (simulated), `bf16: auto` picks float32 there instead of forcing emulated bf16."""
    from gear.app import precision as P

    monkeypatch.setattr(P, "cpu_flags", lambda *a: {"fpu", "sse4_2", "avx", "avx2", "fma"})
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "precision: float32 (bf16: auto -> float32" in result.output
    assert (run_dir / "checkpoint-3").is_dir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "gear/kl_mean" in m] == [1, 2, 3]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["bf16"] == "auto" and saved["trainer"]["max_steps"] == 3
    assert saved["precision"]["bf16"] is False


def test_resume_uses_exactly_the_saved_config_of_a_run_started_from_a_yaml(tiny_dir, tmp_path):
    """Keys the user's YAML left out keep GEARConfig's defaults on resume: nothing of gear's
    `default` recipe is merged in (it would set learning_rate 1e-5, max_completion_length 48)."""
    from gear.app.config import read_run_config, resolve_config, resume_config

    user = tmp_path / "mine.yaml"
    user.write_text(
        yaml.safe_dump({
            "model": str(tiny_dir), "eval_n": 0,
            "trainer": {"max_steps": 1, "max_completion_length": 8, "num_generations": 2,
                        "per_device_train_batch_size": 2, "save_steps": 1},
        })
    )  # fmt: skip
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(user), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    first = (out / "config.yaml").read_text()
    assert "learning_rate" not in first and "max_completion_length: 8" in first
    cfg = resume_config(out)
    assert cfg == dataclasses.replace(resolve_config(str(user)), output_dir=str(out))
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "2"])
    assert result.exit_code == 0, result.output
    second = (out / "config.yaml").read_text()
    assert second == first.replace("max_steps: 1", "max_steps: 2")  # only what was asked
    assert read_run_config(out)["trainer"] == {
        **yaml.safe_load(user.read_text())["trainer"],
        "max_steps": 2,
    }


def test_a_config_yaml_of_an_older_gear_with_bf16_resolved_resumes_as_auto(tmp_path):
    from gear.app.config import read_run_config

    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"model": "smollm2", "trainer": {"bf16": True, "max_steps": 3},
                        "precision": {"bf16": True, "asked": "auto"}})
    )  # fmt: skip
    assert read_run_config(tmp_path)["trainer"] == {"bf16": "auto", "max_steps": 3}
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"trainer": {"bf16": True}, "precision": {"asked": "true"}})
    )
    assert read_run_config(tmp_path)["trainer"] == {"bf16": True}  # forced: stays forced


def test_a_new_run_refuses_a_directory_that_holds_a_run(run_dir, tiny_dir):
    result = runner.invoke(
        app, ["train", "--model", str(tiny_dir), "--output-dir", str(run_dir), *TINY]
    )
    assert result.exit_code == 2, result.output
    assert f"gear train --resume {run_dir}" in " ".join(result.output.split())


def test_eval_and_inspect_work_on_the_run_directory(run_dir):
    result = runner.invoke(app, ["eval", str(run_dir), "--n", "4", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "eval_arithmetic_test.json").read_text())
    assert report["n_problems"] == 4 and 0.0 <= report["pass@1"] <= 1.0
    assert len(report["rows"]) == 4
    result = runner.invoke(app, ["inspect", str(run_dir)])
    assert result.exit_code == 0, result.output
    page = (run_dir / "credit.html").read_text()
    assert "credit-data" in page and (run_dir / "plots" / "figure2.png").stat().st_size > 0


def test_eval_says_when_the_split_has_fewer_problems_than_asked(run_dir, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i in range(2)
    ]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", str(run_dir), "--task", "gsm8k", "--task-option", f"path={data}", "--n", "5"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "eval_gsm8k_test.json").read_text())["n_problems"] == 2
    assert "has 2 problems" in " ".join(result.output.split())


MATH_FIXTURE = [  # written for this test: a MATH-style row (nested braces) and an AIME-style one
    {"problem": "What is $1 + 1$?", "solution": "$1 + 1 = \\boxed{2}$."},
    {"problem": "Write one half as a fraction.", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"question": "How many sides has a square?", "answer": 4},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_eval_math_reads_a_file_by_path_and_reports_pass_at_1_and_k(tiny_dir, tmp_path, fmt):
    """Issue 60: `gear eval --task math --set task_options='{path: ...}'` on JSONL and parquet."""
    from gear.tasks import get_task

    data = tmp_path / f"math.{fmt}"
    if fmt == "jsonl":
        data.write_text("".join(json.dumps(r) + "\n" for r in MATH_FIXTURE))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {k for row in MATH_FIXTURE for k in row}  # a row lacking one holds null
        pq.write_table(pa.table({k: [r.get(k) for r in MATH_FIXTURE] for k in columns}), data)
    args = ["eval", str(tiny_dir), "--task", "math", "--set", f"task_options={{path: {data}}}"]
    args += ["--set", "chat_template_kwargs={enable_thinking: false}"]  # Qwen3's; others ignore it
    sampling = ["--samples", "2", "--temperature", "1.0", "--max-new-tokens", "4"]
    result = runner.invoke(app, [*args, *sampling, "--n", "3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval_math_test.json").read_text())
    assert (report["task"], report["n_problems"], report["samples"]) == ("math", 3, 2)
    assert 0.0 <= report["pass@1"] <= report["pass@2"] <= 1.0
    assert sorted(r["answer"] for r in report["rows"]) == ["2", "4", "\\frac{1}{2}"]
    task = get_task("math")
    for row in report["rows"]:  # each sample graded as the task grades it
        assert row["correct"] == [task.is_correct(c, row["answer"]) for c in row["completions"]]
    assert "| pass@2 |" in (tmp_path / "eval_math_test.md").read_text()


def test_eval_set_takes_task_options_and_chat_template_kwargs_only(tiny_dir):
    result = runner.invoke(app, ["eval", str(tiny_dir), "--set", "learning_rate=1e-6"])
    assert result.exit_code == 2
    words = " ".join(result.output.split())
    assert "takes task_options and chat_template_kwargs only, got ['learning_rate']" in words
    result = runner.invoke(app, ["eval", str(tiny_dir), "--set", "task_options=data"])
    assert result.exit_code == 2 and "expected a mapping" in result.output
    missing = ["eval", str(tiny_dir), "--task", "math", "--set", "task_options={path: nope.jsonl}"]
    result = runner.invoke(app, missing)
    assert result.exit_code == 2 and "nope.jsonl: missing" in result.output


def test_compare_trains_methods_x_seeds_and_writes_the_report(tiny_dir, tmp_path):
    """2 methods x 2 seeds of 2 steps on the tiny model: the rule first, every run under its
    hash, the report (compare.json, compare.md, compare.png) from the shared analysis; a rerun
    resumes (skips what is done); a changed rule is refused; --plan reads the pairs."""
    out = tmp_path / "study"
    args = ["compare", "--methods", "grpo", "--methods", "gear", "--seeds", "0", "--seeds", "1",
            "--steps", "2", "--out", str(out), "--set", f"model={tiny_dir}", *TINY,
            "--set", "save_steps=2", "--set", "eval_samples=2"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rule = json.loads((out / "rule.json").read_text())
    assert rule["arms"] == ["grpo", "gear"] and rule["baseline"] == "grpo"
    assert rule["seeds"] == [0, 1] and rule["metric"] == "mean_reward"  # the default recipe's
    report = json.loads((out / "compare.json").read_text())
    assert report["rule_unchanged"] and report["missing"] == {}
    assert [r["seed"] for r in report["per_seed"]["gear"]] == [0, 1]
    assert report["comparisons"]["gear"]["seeds"] == [0, 1]
    assert report["gate"]["seeds"] == [0, 1] and report["verdict"]
    for run in ("grpo-seed0", "grpo-seed1", "gear-seed0", "gear-seed1"):
        summary = json.loads((out / run / "summary.json").read_text())
        assert "mean_reward" in summary["eval_after"]
        assert (out / run / "rule.sha256").read_text().strip() == report["rule_sha256"]
    md = (out / "compare.md").read_text()
    assert f"**Verdict:** {report['verdict']}." in md and "## 1. Learning gate" in md
    assert (out / "compare.png").stat().st_size > 10_000
    assert "verdict:" in result.output
    # a second invocation finds the runs done and only rewrites the report
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and again.output.count("skipped") == 4
    # another rule for the begun study is refused before any work
    more = runner.invoke(app, [*args, "--seeds", "2"])
    assert more.exit_code == 2 and "--amend-rule" in " ".join(more.output.split())
    assert not (out / "grpo-seed2").exists()
    bad = runner.invoke(app, ["compare", "--methods", "grpo", "--methods", "magic", "--out",
                              str(tmp_path / "bad")])  # fmt: skip
    assert bad.exit_code == 2 and "GEARConfig.credit_method" in bad.output
    assert not (tmp_path / "bad").exists()  # refused before the rule or any run
    plan = runner.invoke(app, ["compare", "--plan", "--effect", "0.5", "--out", str(out)])
    assert plan.exit_code == 0, plan.output
    assert "gear: 2 pairs" in plan.output


def finished_run(run_dir: Path, seed: int, after: float, before: float = 0.3) -> None:
    """What a finished `gear train` run leaves for the report (summary.json, metrics.jsonl)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ev = {"pass@1": 0.5, "n_problems": 200}
    (run_dir / "summary.json").write_text(json.dumps({
        "seed": seed,
        "eval_before": ev | {"mean_reward": before},
        "eval_after": ev | {"mean_reward": after},
    }))  # fmt: skip
    (run_dir / "config.yaml").write_text("model: tiny\n")
    rows = [{"step": i + 1, "reward": 0.2 + 0.1 * i} for i in range(3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


AFTER = {"grpo": [0.62, 0.70, 0.66], "gear": [0.70, 0.81, 0.77], "rlsd": [0.63, 0.68, 0.69]}


def fake_train(fail: dict[str, Exception]):
    """gear.app.train.train's stand-in: each run finishes at once (AFTER), or raises as `fail` says."""

    def train(cfg, run_dir, resume, console):
        run_dir = Path(run_dir)
        if run_dir.name in fail:
            raise fail[run_dir.name]
        arm, seed = run_dir.name.rsplit("-seed", 1)
        finished_run(run_dir, int(seed), AFTER[arm][int(seed)])

    return train


STUDY = ["compare", "--methods", "grpo", "--methods", "gear", "--methods", "rlsd", "--seeds",
         "0", "--seeds", "1", "--seeds", "2"]  # fmt: skip


def test_compare_goes_on_after_a_failed_run_and_names_it(tmp_path, monkeypatch):
    """One arm's run raising ended the whole study with a traceback: no later run, no report
    (issue 59, item 7). Now it is logged in its run directory, the study goes on, the report
    names it, and the command exits 1; --report writes the report without training."""
    out = tmp_path / "study"
    monkeypatch.setattr(
        "gear.app.train.train", fake_train({"gear-seed0": RuntimeError("NaN loss")})
    )
    result = runner.invoke(app, [*STUDY, "--out", str(out)])
    text = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "gear-seed0 failed: RuntimeError: NaN loss" in text and "the study goes on" in text
    assert "Traceback" in (out / "gear-seed0" / "error.log").read_text()
    for name in ("grpo-seed2", "gear-seed1", "gear-seed2", "rlsd-seed2"):  # the later runs ran
        assert (out / name / "summary.json").is_file()
    report = json.loads((out / "compare.json").read_text())
    assert report["failed"] == {"gear-seed0": "RuntimeError: NaN loss"}
    assert "gear-seed0 failed: RuntimeError: NaN loss" in report["verdict"]
    assert "1 run(s) failed: gear-seed0" in text
    # report only: trains nothing, writes the report of what exists (a failed run: exit 1)
    (out / "compare.json").unlink()
    monkeypatch.setattr(
        "gear.app.train.train", fake_train({"gear-seed0": AssertionError("trained")})
    )
    again = runner.invoke(app, ["compare", "--report", "--out", str(out)])
    assert again.exit_code == 1, again.output
    assert "gear-seed0 failed" in " ".join(again.output.split())
    assert json.loads((out / "compare.json").read_text())["verdict"] == report["verdict"]
    # the same command retries the failed run; once it finishes the study is whole
    monkeypatch.setattr("gear.app.train.train", fake_train({}))
    retry = runner.invoke(app, [*STUDY, "--out", str(out)])
    assert retry.exit_code == 0, retry.output
    assert not (out / "gear-seed0" / "error.log").exists()
    assert json.loads((out / "compare.json").read_text())["failed"] == {}
    assert runner.invoke(app, ["compare", "--report", "--out", str(out)]).exit_code == 0


def test_compare_after_sigterm_gives_one_instruction(tmp_path, monkeypatch):
    """A stopped run said `gear train --resume RUN` and then `run the same gear compare again`:
    two instructions, the first of which leaves the study (issue 59, item 9)."""
    import signal

    from gear.app.callbacks import RunStopped

    out = tmp_path / "study"
    stop = RunStopped(signal.SIGTERM, out / "gear-seed0", out / "gear-seed0" / "checkpoint-2")
    monkeypatch.setattr("gear.app.train.train", fake_train({"gear-seed0": stop}))
    result = runner.invoke(app, [*STUDY, "--out", str(out)])
    text = " ".join(result.output.split())
    assert result.exit_code == 143, result.output
    assert "stopped by SIGTERM in gear-seed0" in text
    assert "run the same `gear compare` again to continue the study" in text
    assert "gear train --resume" not in text


def test_compare_plan_reads_the_study_rules_arms(tmp_path, monkeypatch):
    """--plan on a 3-arm study planned for the CLI's default pair (issue 59, item 2)."""
    out = tmp_path / "study"
    monkeypatch.setattr("gear.app.train.train", fake_train({}))
    assert runner.invoke(app, [*STUDY, "--effect", "0.1", "--out", str(out)]).exit_code == 0
    plan = runner.invoke(app, ["compare", "--plan", "--out", str(out)])
    assert plan.exit_code == 0, plan.output
    assert "rlsd: 3 pairs" in plan.output and "gear: 3 pairs" in plan.output
    assert "+0.1 with 80% power, two-sided at alpha 0.05/2" in " ".join(plan.output.split())


def test_compare_refuses_an_edited_config_file_naming_the_key(tmp_path, monkeypatch):
    """The rule kept the --config file's path: an edit between invocations trained seeds under
    two recipes (issue 59, item 3)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("extends: default\nlearning_rate: 5.0e-4\n")
    out = tmp_path / "study"
    monkeypatch.setattr("gear.app.train.train", fake_train({}))
    args = [*STUDY, "--config", str(recipe), "--out", str(out)]
    assert runner.invoke(app, [*args, "--only", "grpo"]).exit_code == 0
    recipe.write_text("extends: default\nlearning_rate: 5.0e-2\n")
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2
    assert "(config_values.learning_rate: 0.0005 -> 0.05)" in " ".join(refused.output.split())
    assert not (out / "gear-seed0").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "{file}"], "is a file; a study is a directory"),
        (["--out", "{file}/study"], "lies under the file"),
        (["--report", "--out", "{file}/study"], "lies under the file"),
        (["--effect", "inf", "--out", "{dir}"], "--effect inf: the gain to detect, a finite"),
        (["--plan", "--effect", "nan", "--out", "{dir}"], "--effect nan: the gain to detect"),
    ],
)
def test_compare_refuses_a_bad_out_or_effect_in_one_line(args, message, tmp_path, monkeypatch):
    """A file as --out raised a bare FileExistsError, --effect inf trained every run and then
    crashed every report (issue 59, items 5 and 6)."""
    monkeypatch.setattr(
        "gear.app.train.train", fake_train({})
    )  # where it is not refused: no training
    (tmp_path / "file").write_text("x")
    args = [a.format(file=tmp_path / "file", dir=tmp_path / "study") for a in args]
    result = runner.invoke(app, ["compare", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and result.exception is not None
    assert not (tmp_path / "study").exists() and (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--set", "learning_rat=1e-5"], "unknown config key 'learning_rat'"),
        (
            ["train", "--set", "learning_rate=abc"],
            "config key 'learning_rate' (GEARConfig field): got 'abc' (str), expected float",
        ),
        (["train", "--set", "max_steps=2.5"], "'max_steps' (GEARConfig field): got 2.5"),
        (
            ["train", "--set", "eval_n=all"],
            "'eval_n' (RunConfig field): got 'all' (str), expected int",
        ),
        (["train", "--set", "bf16=maybe"], "expected bool | one of 'auto'"),
        (
            ["train", "--set", "use_cpu=1"],
            "'use_cpu' (GEARConfig field): got 1 (int), expected bool",
        ),
        (
            ["train", "--set", "learning_rate=-1"],
            "config key 'learning_rate' (GEARConfig field): got -1, expected a value >= 0",
        ),
        (["train", "--set", "max_steps=-5"], "'max_steps' (GEARConfig field): got -5, expected"),
        (["train", "--steps", "0"], "'max_steps' (GEARConfig field): got 0, expected a value >= 1"),
        (["train", "--set", "per_device_train_batch_size=0"], "'per_device_train_batch_size'"),
        (["train", "--set", "beta=-1"], "'beta' (GEARConfig field): got -1, expected a value >= 0"),
        (["train", "--set", "temperature=0"], "'temperature' (GEARConfig field): got 0,"),
        (["train", "--set", "temperature=-1"], "expected a value > 0"),
        (["train", "--set", "max_completion_length=0"], "'max_completion_length'"),
        (["train", "--set", "eval_n=-3"], "'eval_n' (RunConfig field): got -3, expected a value"),
        (["train", "--set", "loss_type=nope"], "got 'nope', expected one of 'grpo'"),
        (["train", "--set", "num_generations=0"], "'num_generations' (GEARConfig field): got 0"),
        (["train", "--set", "ema_decay=2"], "'ema_decay' (GEARConfig field): got 2"),
        (["train", "--set", "top_p=1.5"], "expected a value in (0, 1]"),
        (["train", "--task", "poetry"], "unknown task 'poetry'"),
        (["train", "--method", "magic"], "GEARConfig.credit_method"),
        (["train", "--set", "credit_method=magic"], "GEARConfig.credit_method: expected one of"),
        (["train", "no_such_config"], "config 'no_such_config'"),
        (["inspect", "/nonexistent"], "no credit/ directory"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(args, message, tiny_dir, tmp_path):
    out = tmp_path / "run"
    if args[0] == "train":
        args = [*args, "--model", str(tiny_dir), "--output-dir", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not out.exists()


def test_help_lists_every_shipped_recipe():
    """The recipe list in --help comes from the package, so a new recipe cannot be missing."""
    from gear.app.config import recipe_names

    for command in ("train", "compare"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert all(name in text for name in recipe_names()), (command, text)


def test_compare_only_seed_trains_those_seeds_and_keeps_the_rule_whole(tmp_path, monkeypatch):
    """Two processes could share a study only arm by arm: one arm's seeds ran one after another
    on one core while the other sat idle (issue 67's placebo). --only-seed splits them."""
    out = tmp_path / "study"
    monkeypatch.setattr("gear.app.train.train", fake_train({}))
    first = runner.invoke(app, [*STUDY, "--out", str(out), "--only", "grpo", "--only-seed", "1"])
    assert first.exit_code == 0, first.output
    assert sorted(d.name for d in out.glob("*-seed*")) == ["grpo-seed1"]
    assert json.loads((out / "rule.json").read_text())["seeds"] == [0, 1, 2]
    rest = runner.invoke(app, [*STUDY, "--out", str(out), "--only-seed", "0", "--only-seed", "2"])
    assert rest.exit_code == 0, rest.output
    assert len(list(out.glob("*-seed*"))) == 7  # every arm at seeds 0 and 2, grpo at 1
    refused = runner.invoke(app, [*STUDY, "--out", str(out), "--only-seed", "5"])
    assert refused.exit_code == 2
    assert "--only-seed [5]: not among the seeds [0, 1, 2]" in " ".join(refused.output.split())

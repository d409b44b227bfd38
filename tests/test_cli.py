"""The `gear` CLI end to end on a tiny model: train, resume, eval, inspect, compare, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gear.cli import app
from gear.models import tiny_model_and_tokenizer
from gear.precision import cpu_capability, native_cpu_bf16
from gear.run import resolve_config

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


def test_config_yaml_records_the_precision_chosen_for_this_machine(run_dir):
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    native, _ = native_cpu_bf16()
    assert saved["trainer"]["bf16"] is native  # "auto" resolved to what the run used
    assert saved["precision"]["asked"] == "auto" and saved["precision"]["bf16"] is native
    assert saved["precision"]["capability"] == cpu_capability()
    assert saved["precision"]["reason"]


def test_train_prints_one_line_per_step_when_output_is_not_a_terminal(trained):
    output = trained[1]
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    for line in lines:
        assert re.fullmatch(
            r"step \d+/2  reward [\d.]+  kl_mean [\d.]+  [\d.]+ s/step  eta \dm \d\ds", line
        ), line
    assert "precision: float32" in output or "precision: bf16" in output


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


def test_resume_continues_from_the_last_checkpoint(run_dir):
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "--set", "max_steps=3"])
    assert result.exit_code == 0, result.output
    assert (run_dir / "checkpoint-3").is_dir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "gear/kl_mean" in m] == [1, 2, 3]


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


def test_compare_trains_every_method_and_seed_and_writes_a_table(tiny_dir, tmp_path):
    out = tmp_path / "study"
    args = [
        "compare",
        "--methods",
        "grpo",
        "--methods",
        "gear",
        "--seeds",
        "0",
        "--steps",
        "1",
        "--out",
        str(out),
        "--set",
        f"model={tiny_dir}",
        *TINY,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = json.loads((out / "compare.json").read_text())
    assert [r["method"] for r in table["rows"]] == ["grpo", "gear"]
    assert all(r["runs"] == 1 for r in table["rows"])
    assert (out / "learning_curve_accuracy.png").is_file()
    # a second invocation finds the runs done and only rewrites the table
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and again.output.count("skipped") == 2


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
        (["train", "--task", "poetry"], "unknown task 'poetry'"),
        (["train", "--method", "magic"], "CreditParams.method"),
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

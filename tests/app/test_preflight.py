"""One pre-flight check (issue 68): `gear train`, its `--dry-run` and `gear compare` refuse the
same things, all before a model loads: a malformed data file, a LoRA setting the run cannot
build."""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from gear.app.cli import app

runner = CliRunner()


def malformed_math_file(tmp_path):
    """A math JSONL file whose second row has no answer."""
    path = tmp_path / "problems.jsonl"
    rows = [{"problem": "1 + 1?", "answer": "2"}, {"problem": "2 + 2?"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def error_of(result) -> str:
    """The one-line error of a refused command (exit 2), whitespace joined."""
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_dry_run_refuses_a_malformed_math_file_naming_its_line(tmp_path):
    path = malformed_math_file(tmp_path)
    result = runner.invoke(
        app,
        ["train", "--dry-run", "--task", "math", "--set", f"task_options={{path: {path}}}"],
    )
    error = error_of(result)
    assert f"{path}: line 2: no answer" in error, error
    assert "nothing written" not in error


def test_train_refuses_a_malformed_math_file_before_the_model_loads(tmp_path):
    path = malformed_math_file(tmp_path)
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "--task", "math", "--set", f"task_options={{path: {path}}}",
         "--model", str(tmp_path / "no-such-model"), "--output-dir", str(out)],
    )  # fmt: skip
    error = error_of(result)
    assert f"{path}: line 2: no answer" in error, error  # the data, not the missing model
    assert not out.exists()


def test_compare_refuses_a_malformed_math_file_before_any_run(tmp_path):
    path = malformed_math_file(tmp_path)
    out = tmp_path / "study"
    result = runner.invoke(
        app,
        ["compare", "--task", "math", "--set", f"task_options={{path: {path}}}",
         "--out", str(out)],
    )  # fmt: skip
    assert f"{path}: line 2: no answer" in error_of(result)
    assert not out.exists()


def test_dry_run_refuses_a_lora_setting_the_run_refuses(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # PEFT not installed: LoRA cannot be built
    result = runner.invoke(app, ["train", "--dry-run", "--set", "lora_r=8"])
    assert "lora_r=8 needs PEFT" in error_of(result)

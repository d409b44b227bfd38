"""Damaged and malformed inputs end a command with one line that names the file, says what is
wrong and what to do (exit 2, no traceback unless --debug / GEAR_DEBUG=1), before any work and
without changing a file: cut checkpoints, a run without config.yaml or final/, broken YAML,
a directory that is no run, damaged credit records, summaries, metrics, data files and
evaluation-cache entries (recomputed, never trusted). One tiny 2-step LoRA run is shared."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gear.app.cli import app
from gear.testing import save_tiny_model, tiny_run_args

runner = CliRunner()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run (gear train's default recipe on the tiny model): checkpoint-1,
    checkpoint-2, final/, credit records."""
    base = tmp_path_factory.mktemp("damage")
    tiny = save_tiny_model(base / "tiny", vocab="bytes")
    run = base / "run"
    args = ["train", "--model", str(tiny), "--steps", "2", "--output-dir", str(run)]
    result = runner.invoke(app, [*args, *tiny_run_args(eval_n=0)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in run.glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}
    return run


def copy_run(finished: Path, tmp_path: Path, final: bool = False) -> Path:
    """A copy of the shared run; without final/ (a run stopped after step 2) unless `final`."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    if not final:
        shutil.rmtree(run / "final")
    return run


def cut(path: Path, keep: float = 0.5) -> None:
    """Truncate a file to a fraction of its size: a disk that filled up, a copy cut short."""
    os.truncate(path, int(path.stat().st_size * keep))


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` and a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def error_line(result) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if a command loads a model: a refusal comes before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("gear.app.train.load_model_and_data", refuse)
    monkeypatch.setattr("gear.models.load_model_and_tokenizer", refuse)


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(
    ("name", "damage", "problem"),
    [
        ("adapter_model.safetensors", cut, "cut short: "),
        ("trainer_state.json", lambda p: cut(p, 0), "empty (0 bytes)"),
        ("optimizer.pt", cut, "cut short or not a PyTorch file"),
        ("scheduler.pt", cut, "cut short or not a PyTorch file"),
        ("rng_state.pth", cut, "cut short or not a PyTorch file"),
        ("optimizer.pt", Path.unlink, "missing"),
    ],
)
def test_resume_refuses_a_damaged_newest_checkpoint_and_names_the_previous_one(
    finished, tmp_path, no_model_loading, name, damage, problem
):
    run = copy_run(finished, tmp_path)
    damage(run / "checkpoint-2" / name)
    before = snapshot(run)
    line = error_line(runner.invoke(app, ["train", "--resume", str(run)]))
    assert line.startswith(f"error: {run}/checkpoint-2/{name}: {problem}")
    assert "the previous complete checkpoint is checkpoint-1" in line
    aside = f"`mv {run}/checkpoint-2 {run}/damaged-checkpoint-2`"
    assert f"({aside}) and run `gear train --resume {run}` again" in line
    assert snapshot(run) == before  # nothing on disk changed


def test_resume_after_moving_a_cut_checkpoint_aside_continues_from_the_previous_one(
    finished, tmp_path
):
    """The damaged case refuses; the message's command then resumes from checkpoint-1 and the
    run trains step 2 again and finishes (the intact case)."""
    run = copy_run(finished, tmp_path)
    cut(run / "checkpoint-2" / "adapter_model.safetensors")
    line = error_line(runner.invoke(app, ["train", "--resume", str(run)]))
    assert "checkpoint-1" in line
    size = (finished / "checkpoint-2" / "adapter_model.safetensors").stat().st_size
    assert f"cut short: {size // 2} of the {size} bytes its header lists" in line
    os.replace(run / "checkpoint-2", run / "damaged-checkpoint-2")
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 0, result.output
    assert f"resuming from {run / 'checkpoint-1'}" in result.output
    assert (run / "final").is_dir() and (run / "checkpoint-2").is_dir()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if "gear/kl_mean" in x] == [1, 2]  # once each


def test_resume_with_no_complete_checkpoint_says_it_trains_again_from_step_0(
    finished, tmp_path, no_model_loading
):
    run = copy_run(finished, tmp_path)
    shutil.rmtree(run / "checkpoint-1")
    cut(run / "checkpoint-2" / "trainer_state.json", 0)
    line = error_line(runner.invoke(app, ["train", "--resume", str(run)]))
    assert line.startswith(f"error: {run}/checkpoint-2/trainer_state.json: empty (0 bytes)")
    assert "no earlier checkpoint is complete" in line and "from step 0" in line


def test_resume_without_config_yaml_names_it(finished, tmp_path, no_model_loading):
    run = copy_run(finished, tmp_path)
    (run / "config.yaml").unlink()
    before = snapshot(run)
    line = error_line(runner.invoke(app, ["train", "--resume", str(run)]))
    assert line.startswith(f"error: {run}/config.yaml: missing, so the run's configuration is")
    assert "restore it from a copy of the run" in line
    assert snapshot(run) == before


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("model: [smollm2\n", "not valid YAML at line 2, column 1"),
        ("", "empty"),
        ("trainer:\n\tmax_steps: 3\n", "line 2 is indented with a tab"),
        ("trainer: {learning_rate: abc}\n", "config key 'learning_rate' (GEARConfig field)"),
    ],
)
def test_resume_with_a_broken_config_yaml_names_it(
    finished, tmp_path, no_model_loading, text, problem
):
    run = copy_run(finished, tmp_path)
    (run / "config.yaml").write_text(text)
    before = snapshot(run)
    line = error_line(runner.invoke(app, ["train", "--resume", str(run)]))
    assert line.startswith(f"error: {run}/config.yaml: {problem}"), line
    assert snapshot(run) == before


# ------------------------------------------------------------------------------ YAML recipes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "model: smollm2\n  seed: [\n",
            "not valid YAML at line 2, column 7 (mapping values are not allowed here); correct "
            "line 2",
        ),
        (
            "trainer:\n  max_steps: 3\n\tlearning_rate: 0.1\n",
            "line 3 is indented with a tab; YAML indents with spaces only; replace the tab on "
            "line 3 with spaces",
        ),
        ("extends: default\nseed: [1, 2\n", "not valid YAML at line 3, column 1"),
    ],
)
def test_a_broken_yaml_config_is_named_with_its_line(tmp_path, no_model_loading, text, message):
    config = tmp_path / "my.yaml"
    config.write_text(text)
    out = tmp_path / "run"
    line = error_line(runner.invoke(app, ["train", str(config), "--output-dir", str(out)]))
    assert line.startswith(f"error: {config}: {message}"), line
    assert not out.exists()


def test_debug_adds_the_traceback(tmp_path, monkeypatch):
    config = tmp_path / "my.yaml"
    config.write_text("trainer:\n\tmax_steps: 3\n")
    for args, env in ((["--debug"], {}), ([], {"GEAR_DEBUG": "1"})):
        result = runner.invoke(app, [*args, "train", str(config)], env=env)
        assert result.exit_code == 2, result.output
        assert "Traceback" in result.output and "ScannerError" in result.output
        assert f"error: {config}: line 2 is indented with a tab" in result.output
    monkeypatch.delenv("GEAR_DEBUG", raising=False)
    assert "Traceback" not in runner.invoke(app, ["train", str(config)]).output


# ------------------------------------------------------------------------------ not a run


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["train", "--resume"],
            "{d}/config.yaml: missing: {d} is not a gear run directory; give --resume the "
            "directory a `gear train` run wrote",
        ),
        (
            ["eval"],
            "{d}: neither a gear run directory (no config.yaml) nor a model directory (no "
            "config.json or adapter_config.json)",
        ),
        (["inspect"], "{d}: not a gear run directory (no config.yaml, no credit/ directory)"),
    ],
)
def test_a_directory_that_is_not_a_gear_run_is_named(tmp_path, no_model_loading, command, message):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a run\n")
    line = error_line(runner.invoke(app, [*command, str(folder)]))
    assert line.startswith("error: " + message.format(d=folder)), line
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------------------ eval, inspect


def test_eval_of_an_unfinished_run_evaluates_its_newest_complete_checkpoint_and_says_so(
    finished, tmp_path
):
    run = copy_run(finished, tmp_path)
    cut(run / "checkpoint-2" / "adapter_model.safetensors")  # damaged: checkpoint-1 is used
    result = runner.invoke(app, ["eval", str(run), "--n", "2", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"note: {run} has no final/: the run stopped before it finished" in said
    assert "its newest complete checkpoint is checkpoint-1 (step 1 of 2)" in said
    assert f"damaged: {run}/checkpoint-2/adapter_model.safetensors (cut short" in said
    assert said.count("evaluating checkpoint-1") == 1
    report = json.loads((run / "eval_arithmetic_test.json").read_text())
    assert report["model"] == str(run / "checkpoint-1") and report["n_problems"] == 2


def test_eval_of_a_run_with_no_final_and_no_checkpoint_says_there_is_nothing(
    finished, tmp_path, no_model_loading
):
    run = copy_run(finished, tmp_path)
    for checkpoint in run.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    line = error_line(runner.invoke(app, ["eval", str(run)]))
    assert line.startswith(f"error: {run}/final: missing: the run stopped before it finished")
    assert f"`gear train --resume {run}` continues it" in line


def test_eval_of_a_cut_final_model_names_the_file_and_the_checkpoint_to_use(
    finished, tmp_path, no_model_loading
):
    run = copy_run(finished, tmp_path, final=True)
    cut(run / "final" / "adapter_model.safetensors", 0.01)
    before = snapshot(run)
    line = error_line(runner.invoke(app, ["eval", str(run)]))
    assert line.startswith(f"error: {run}/final/adapter_model.safetensors: cut short")
    assert f"(`gear eval {run}/checkpoint-2`)" in line
    assert snapshot(run) == before


def test_inspect_of_an_unfinished_run_says_so_and_names_its_newest_checkpoint(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    result = runner.invoke(app, ["inspect", str(run)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"note: {run} has no final/" in said
    assert "its newest complete checkpoint is checkpoint-2 (step 2 of 2)" in said
    assert (run / "credit.html").is_file()


def test_inspect_names_a_damaged_credit_record_and_its_line(finished, tmp_path):
    run = copy_run(finished, tmp_path, final=True)
    record = run / "credit" / "step_000001.jsonl"
    lines = record.read_text().splitlines()
    record.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # a write cut short
    before = snapshot(run)
    line = error_line(runner.invoke(app, ["inspect", str(run)]))
    assert line.startswith(f"error: {record}: line 2 is not a JSON record (")
    assert line.endswith(
        "; move it aside to read the other records (a record cut short by a run "
        "killed while writing it is written again when the run is resumed: `gear train --resume`)"
    )
    assert snapshot(run) == before


def test_eval_names_a_missing_or_damaged_data_file_before_loading_a_model(
    finished, tmp_path, no_model_loading
):
    data = tmp_path / "gsm8k"
    args = ["eval", str(finished), "--task", "gsm8k", "--task-option", f"path={data}"]
    line = error_line(runner.invoke(app, args))
    assert line == (
        f"error: gsm8k data not found: {data}; give path= a directory with train.jsonl and "
        "test.jsonl, a .jsonl file or a Hub dataset name"
    )
    data.mkdir()
    (data / "test.jsonl").write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"quest\n')
    line = error_line(runner.invoke(app, args))
    assert line.startswith(f"error: {data}/test.jsonl: line 2 is not valid JSON (")
    assert line.endswith("); correct or remove that line")


# ------------------------------------------------------------------------------ compare


def test_compare_names_a_damaged_summary_before_training(tmp_path, no_model_loading):
    out = tmp_path / "study"
    (out / "grpo-seed0").mkdir(parents=True)
    (out / "grpo-seed0" / "summary.json").write_text('{"eval_before": {"pass@1": 0.')
    args = ["compare", "--methods", "grpo", "--methods", "gear", "--seeds", "0", "--out", str(out)]
    line = error_line(runner.invoke(app, args))
    assert line.startswith(f"error: {out}/grpo-seed0/summary.json: not valid JSON (")
    assert f"move {out}/grpo-seed0 aside and `gear compare` trains that run again" in line


def test_compare_names_a_metrics_file_that_is_not_text(tmp_path, no_model_loading):
    out = tmp_path / "study"
    (out / "grpo-seed0").mkdir(parents=True)
    done = {"eval_before": {"pass@1": 0.1}, "eval_after": {"pass@1": 0.2}, "steps": 1}
    (out / "grpo-seed0" / "summary.json").write_text(json.dumps(done))
    (out / "grpo-seed0" / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage')
    args = ["compare", "--methods", "grpo", "--methods", "gear", "--seeds", "0", "--out", str(out)]
    line = error_line(runner.invoke(app, args))
    assert line.startswith(f"error: {out}/grpo-seed0/metrics.jsonl: not UTF-8 text (byte 12")


# ------------------------------------------------------------------------------ eval cache


def scores(n: int = 4) -> dict:
    return {"pass@1": 0.25, "n_problems": n, "per_problem": {"greedy": [1.0, 0.0, 0.0, 0.0][:n]}}


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ('{"pass@1": 0.25, "n_prob', "not valid JSON"),
        ("", "empty (0 bytes)"),
        (json.dumps(scores() | {"pass@1": 7}), "pass@1 is 7, expected a score in [0, 1]"),
        (json.dumps(scores() | {"n_problems": 9}), "n_problems is 9, expected 1..4"),
        (json.dumps(scores() | {"per_problem": {"greedy": [1.0]}}), "per_problem does not hold"),
    ],
)
def test_a_damaged_eval_cache_entry_is_recomputed_with_a_note_never_trusted(
    tmp_path, monkeypatch, entry, problem
):
    from gear.app.config import resolve_config
    from gear.app.evaluate import _eval_cache_file, cached_eval_before, store_eval_before

    monkeypatch.setenv("GEAR_CACHE", str(tmp_path / "cache"))
    cfg = resolve_config(None, {"eval_n": 4, "eval_samples": 0})  # the embedded model's key
    path = _eval_cache_file(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(entry)
    out = io.StringIO()
    assert cached_eval_before(cfg, Console(file=out, width=1000)) is None
    note = out.getvalue()
    assert note.startswith(f"note: {path}: {problem}") and note.count("\n") == 1, note
    assert note.endswith("; not used: the scores are computed again and replace it\n")
    store_eval_before(cfg, scores())  # what `gear train` does with the scores it computed
    assert json.loads(path.read_text()) == scores()
    assert cached_eval_before(cfg) == scores() | {"cached": True}
    store_eval_before(cfg, scores() | {"pass@1": 0.5})  # a sound entry is kept
    assert json.loads(path.read_text()) == scores()

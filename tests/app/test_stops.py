"""Stops lose at most one step: `gear train` in a real subprocess on a tiny model, stopped by
SIGTERM / SIGINT (a checkpoint of the step it was in, exit 128 + signal, `--resume` goes on) or
killed with SIGKILL in the middle of a save (no partial checkpoint is ever visible)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gear.app.callbacks import _publish
from gear.app.rundir import STAGING, last_checkpoint, read_metrics
from gear.testing import save_tiny_model, tiny_run_args

# what a complete HF checkpoint holds besides its weights (trainer_state.json is written last but
# one); the weights are the model's, or a LoRA run's adapter (gear train's default)
CHECKPOINT_FILES = {
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab="bytes")


class GearTrain:
    """`python -m gear.app.cli train ...` with its output read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gear.app.cli", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return line
        self.proc.kill()
        raise AssertionError(f"no line with {text!r}; output:\n" + "\n".join(self.lines))

    def finish(self, timeout: float = 240) -> int:
        rc = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return rc

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def trained_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if "gear/kl_mean" in line]


def eval_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if "eval/accuracy" in line]


def credit_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "credit").glob("step_*.jsonl"))


def without_eval_before(run_dir: Path) -> Path:
    """A run directory whose summary.json already holds the before-training evaluation (as
    `gear compare` shares it between runs), so the run starts training at once."""
    run_dir.mkdir(parents=True)
    before = {"pass@1": 0.0, "n_problems": 1}
    (run_dir / "summary.json").write_text(json.dumps({"eval_before": before}))
    return run_dir


# a held-out evaluation of a few seconds on the tiny model (one problem per batch), long enough
# for a signal to arrive while it runs
SLOW_EVAL = {"eval_n": 64, "eval_batch_size": 1, "eval_max_new_tokens": 16}


def assert_complete(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    missing = CHECKPOINT_FILES - names
    if not names & {"model.safetensors", "adapter_model.safetensors"}:
        missing.add("model.safetensors or adapter_model.safetensors")
    assert not missing, f"{checkpoint} is missing {sorted(missing)}"


def test_sigterm_saves_the_current_step_and_resume_continues_from_it(tiny_dir, tmp_path):
    sig = signal.SIGTERM
    run_dir = tmp_path / "run"
    # no scheduled saves: the checkpoint found below can only come from the signal
    args = tiny_run_args(eval_n=0, save_steps=1000)
    run = GearTrain("--model", str(tiny_dir), "--steps", "40", "--output-dir", str(run_dir), *args)
    run.wait_for("step 1/40")
    run.proc.send_signal(sig)
    rc = run.finish()
    assert rc == 128 + sig, run.output
    assert f"stopped by {sig.name}" in run.output
    saved = last_checkpoint(run_dir)
    assert saved is not None, run.output
    step = int(saved.name.split("-")[1])
    assert 1 <= step < 40  # it stopped early, at the step it was in (or the next one)
    assert trained_steps(run_dir) == list(range(1, step + 1))
    assert_complete(saved)
    assert not (run_dir / "final").exists()  # the run is unfinished, not done
    resumed = GearTrain("--resume", str(run_dir), "--set", f"max_steps={step + 1}")
    assert resumed.finish() == 0, resumed.output
    assert f"resuming from {saved}" in resumed.output
    assert trained_steps(run_dir) == list(range(1, step + 2))  # no step lost, none repeated
    assert (run_dir / f"checkpoint-{step + 1}").is_dir() and (run_dir / "final").is_dir()


def test_kill_9_during_a_save_leaves_only_complete_checkpoints_and_resume_uses_the_last(
    tiny_dir, tmp_path
):
    run_dir = tmp_path / "run"
    run = GearTrain(
        "--model", str(tiny_dir), "--steps", "40", "--output-dir", str(run_dir),
        *tiny_run_args(eval_n=0, save_steps=1),
    )  # fmt: skip
    run.wait_for("step 2/40")
    staging = run_dir / STAGING
    deadline = time.monotonic() + 120
    while not staging.exists() and time.monotonic() < deadline:
        time.sleep(0.0005)
    run.proc.kill()  # SIGKILL while a checkpoint is being written
    run.finish()
    checkpoints = sorted(run_dir.glob("checkpoint-*"))
    assert checkpoints, run.output
    for checkpoint in checkpoints:
        assert_complete(checkpoint)
    last = last_checkpoint(run_dir)
    step = int(last.name.split("-")[1])
    resumed = GearTrain("--resume", str(run_dir), "--set", f"max_steps={step + 1}")
    assert resumed.finish() == 0, resumed.output
    assert f"resuming from {last}" in resumed.output
    assert (run_dir / f"checkpoint-{step + 1}").is_dir()
    assert not staging.exists()  # the killed save's leftovers are gone
    assert trained_steps(run_dir) == list(range(1, step + 2))  # the step trained again: once


def test_kill_9_after_a_logged_step_then_resume_logs_every_step_once(tiny_dir, tmp_path):
    """Killed after step 3 was logged but before it was saved (checkpoints every 2 steps):
    `--resume` starts again at step 3, and metrics.jsonl and the credit records hold each step
    once (an older gear appended the steps it trained again: [1, 2, 3, 3, 4])."""
    run_dir = tmp_path / "run"
    run = GearTrain(
        "--model", str(tiny_dir), "--steps", "40", "--output-dir", str(run_dir),
        *tiny_run_args(eval_n=0, save_steps=2),
    )  # fmt: skip
    run.wait_for("step 3/40")
    run.proc.kill()
    run.finish()
    assert last_checkpoint(run_dir).name == "checkpoint-2", run.output
    assert trained_steps(run_dir)[:3] == [1, 2, 3] and 3 in credit_steps(run_dir)
    config = (run_dir / "config.yaml").read_text()
    resumed = GearTrain("--resume", str(run_dir), "--steps", "4")
    assert resumed.finish() == 0, resumed.output
    assert trained_steps(run_dir) == [1, 2, 3, 4]
    assert credit_steps(run_dir) == [1, 2, 3, 4]  # named as metrics.jsonl names the step
    assert (run_dir / "config.yaml").read_text() == config.replace("max_steps: 40", "max_steps: 4")


def test_sigterm_during_a_periodic_evaluation_saves_the_step_it_follows(tiny_dir, tmp_path):
    """The evaluation after step 1 is ended by the signal and step 1 is saved, without training
    step 2 first; `--resume` then runs the rest with the same config, each step once."""
    run_dir = without_eval_before(tmp_path / "run")
    run = GearTrain(
        "--model", str(tiny_dir), "--steps", "3", "--output-dir", str(run_dir),
        *tiny_run_args(eval_every=1, save_steps=1000, **SLOW_EVAL),
    )  # fmt: skip
    run.wait_for("evaluating at step 1")
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish()
    assert rc == 128 + signal.SIGTERM, run.output
    assert "stopping the evaluation" in run.output
    assert last_checkpoint(run_dir).name == "checkpoint-1", run.output
    assert trained_steps(run_dir) == [1] and eval_steps(run_dir) == []
    # the checkpointed step keeps its full row (the signal lands here while the held-out set is
    # built; one inside generation is the in-process test of issue 29 below)
    (row,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    for key in ("reward", "gear/kl_mean", "gear/onsets_per_row", "completions/mean_length"):
        assert key in row, sorted(row)
    config = (run_dir / "config.yaml").read_text()
    resumed = GearTrain("--resume", str(run_dir))
    assert resumed.finish() == 0, resumed.output
    assert trained_steps(run_dir) == [1, 2, 3] and eval_steps(run_dir) == [2]
    assert (run_dir / "config.yaml").read_text() == config  # the same config, as written
    assert (run_dir / "final").is_dir()


def test_sigterm_during_the_final_evaluation_then_resume_trains_no_further(tiny_dir, tmp_path):
    """Stopped in the evaluation after the last step: `--resume` evaluates and saves the final
    model, and trains no step past max_steps (HF's Trainer, resumed at max_steps, trains one)."""
    run_dir = without_eval_before(tmp_path / "run")
    run = GearTrain(
        "--model", str(tiny_dir), "--steps", "1", "--output-dir", str(run_dir),
        *tiny_run_args(save_steps=1000, **SLOW_EVAL),
    )  # fmt: skip
    run.wait_for("evaluating after training")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.output
    assert not (run_dir / "final").exists()
    config = (run_dir / "config.yaml").read_text()
    resumed = GearTrain("--resume", str(run_dir))
    assert resumed.finish() == 0, resumed.output
    assert trained_steps(run_dir) == [1]
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"]
    assert "step 2/" not in resumed.output
    assert "training already done: checkpoint-1" in resumed.output
    assert (run_dir / "final").is_dir() and (run_dir / "config.yaml").read_text() == config
    assert json.loads((run_dir / "summary.json").read_text())["eval_after"]["step"] == 1


NOISE = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes, imported by peft and TRL
    "Setting accelerator to CPU",  # DeepSpeed, imported by accelerate
)


def test_a_run_prints_nothing_from_libraries_it_does_not_use(tiny_dir, tmp_path):
    """`gear train` neither imports bitsandbytes and DeepSpeed (installed here, unused by the
    run; PEFT, which LoRA runs use, may import the first) nor prints their warnings."""
    program = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('imported:', sorted(m for m in ('bitsandbytes',"
        " 'deepspeed') if sys.modules.get(m))))\n"
        "from gear.app.cli import app\n"
        "app()\n"
    )
    args = ["train", "--model", str(tiny_dir), "--steps", "1", "--output-dir", str(tmp_path / "r")]
    args += tiny_run_args(eval_n=0, save_steps=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", program, *args], capture_output=True, text=True, env=env,
        timeout=240,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "imported: []" in output
    for noise in NOISE:
        assert noise not in output
    assert "deepspeed" in hide_unused_packages_in_a_subprocess(["train", "--set", "deepspeed=x"])


def hide_unused_packages_in_a_subprocess(argv: list[str]) -> str:
    """What `hide_unused_packages(argv)` leaves importable (a fresh process: a test process has
    imported them all already)."""
    program = (
        "import sys; from gear.app.cli import hide_unused_packages\n"
        f"hidden = hide_unused_packages({argv!r})\n"
        "print(sorted(set(('bitsandbytes', 'deepspeed')) - set(hidden)))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_metrics_readers_take_each_step_once_the_last_record_winning(tmp_path):
    """A metrics.jsonl written by an older gear after kill -9 and --resume: steps 4 and 5 twice,
    and a line cut short. `read_metrics`, `gear compare` and the plots see each step once."""
    from gear.app.rundir import read_metrics, truncate_run_logs
    from gear.viz.plots import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward": float(s)} for s in (1, 2, 3, 4, 5)]
    rows += [{"step": s, "reward": 10.0 * s} for s in (4, 5, 6, 7)]
    rows.insert(3, {"step": 3, "eval/accuracy": 0.5})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "rew')
    merged = read_metrics(metrics)
    assert [m["step"] for m in merged] == [1, 2, 3, 4, 5, 6, 7]
    assert [m["reward"] for m in merged] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0, 70.0]
    assert merged[2] == {"step": 3, "reward": 3.0, "eval/accuracy": 0.5}
    plot_metrics(metrics, tmp_path / "plots")  # no zigzag: one point per step (and no error)
    (tmp_path / "credit").mkdir()
    for step in (1, 3, 5):
        (tmp_path / "credit" / f"step_{step:06d}.jsonl").write_text("{}\n")
    truncate_run_logs(tmp_path, 3)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 3]
    assert credit_steps(tmp_path) == [1, 3]  # step_000005: a step after the checkpoint


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tiny_dir, tmp_path, inherited):
    """SIGINT takes the same path as SIGTERM; in-process (CliRunner) to spare a subprocess.

    `ignored`: a process started with `nohup ... &` inherits SIGINT ignored; gear still handles
    Ctrl-C during a run and afterwards leaves the disposition it found (issue 29)."""
    from typer.testing import CliRunner

    from gear.app.cli import app

    # set either way: pytest itself may run with SIGINT ignored (`nohup pytest &`)
    found = signal.default_int_handler if inherited == "default" else signal.SIG_IGN
    before = signal.signal(signal.SIGINT, found)

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    def interrupt_after_the_first_step() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if metrics.is_file() and "gear/kl_mean" in metrics.read_text():
                os.kill(os.getpid(), signal.SIGINT)  # handled on the main thread
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_after_the_first_step, daemon=True).start()
    args = ["train", "--model", str(tiny_dir), "--steps", "40", "--output-dir", str(run_dir)]
    try:
        result = CliRunner().invoke(app, [*args, *tiny_run_args(eval_n=0, save_steps=1000)])
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert result.exit_code == 130, result.output
    assert "stopped by SIGINT" in " ".join(result.output.split())
    saved = last_checkpoint(run_dir)
    assert saved is not None and int(saved.name.split("-")[1]) < 40
    assert_complete(saved)
    assert after is found  # the disposition gear found is restored


def test_publish_replaces_an_existing_checkpoint_of_the_same_step(tmp_path):
    target, staged = tmp_path / "checkpoint-3", tmp_path / STAGING / "checkpoint-3"
    target.mkdir()
    (target / "old").write_text("old")
    staged.mkdir(parents=True)
    (staged / "new").write_text("new")
    _publish(staged, target)
    assert [p.name for p in target.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [STAGING, "checkpoint-3"]


def test_last_checkpoint_ignores_staging_leftovers(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / STAGING / "checkpoint-11").mkdir(parents=True)
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert last_checkpoint(tmp_path / "nothing") is None


def test_atomic_checkpoints_keep_the_ema_teachers_weights_in_the_published_checkpoint(tmp_path):
    """GEARTrainer adds its teacher's weights to each checkpoint; the staging redirect must
    carry them into the renamed checkpoint, and rotation must keep `save_total_limit`."""
    from gear.app.callbacks import atomic_checkpoints
    from gear.integrations.trl import GEARTrainer
    from gear.integrations.trl.config import GEARConfig
    from gear.testing import byte_tokenizer, dataset, fast_kwargs, hash_reward, tiny_model

    tok = byte_tokenizer()
    args = GEARConfig(**fast_kwargs(
        tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=2,
        teacher="ema",
    ))  # fmt: skip
    trainer = GEARTrainer(
        model=tiny_model(tok), reward_funcs=hash_reward, args=args, train_dataset=dataset(8),
        processing_class=tok,
    )  # fmt: skip
    atomic_checkpoints(trainer).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for checkpoint in tmp_path.glob("checkpoint-*"):
        assert_complete(checkpoint)
        assert (checkpoint / "gear_teacher.safetensors").is_file()
    assert not (tmp_path / STAGING).exists()


def test_an_evaluation_ended_by_a_signal_leaves_the_model_training(monkeypatch):
    """Issue 29: a stop signal during a periodic evaluation left the model in eval mode, so
    TRL's `log` read its (empty) eval metrics and the checkpointed step's metrics row lost
    `reward`, `gear/*` and the completion statistics. The signal is raised inside generation."""
    import gear.app.evaluate
    from gear.app.callbacks import EvalInterrupted
    from gear.models import tiny_model_and_tokenizer
    from gear.tasks.arithmetic import ArithmeticTask

    model, tok = tiny_model_and_tokenizer()
    model.train()

    def stopped(*args, **kwargs):
        raise EvalInterrupted(signal.SIGTERM)

    monkeypatch.setattr(gear.app.evaluate, "generate", stopped)
    with pytest.raises(EvalInterrupted):
        gear.app.evaluate.evaluate(model, tok, ArithmeticTask(), n=2)
    assert model.training


def test_a_stop_during_a_periodic_evaluation_keeps_every_checkpointed_steps_full_row(
    tiny_dir, tmp_path, monkeypatch
):
    """Issue 29: `--steps 40 --set eval_every=2`, SIGTERM while the evaluation after step 2
    generates: checkpoint-2 is saved and steps 1 and 2 each keep their full metrics row (step 2
    had kept only loss, grad_norm, learning_rate and epoch). In-process, so that the signal
    comes from inside generation; sent to a subprocess, it landed before, while the held-out
    set was still being built, where the bug did not show."""
    from typer.testing import CliRunner

    import gear.app.evaluate
    from gear.app.cli import app

    generate = gear.app.evaluate.generate

    def generate_then_stop(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # gear's handler raises here, mid-generation
        return generate(*args, **kwargs)

    monkeypatch.setattr(gear.app.evaluate, "generate", generate_then_stop)
    run_dir = without_eval_before(tmp_path / "run")
    args = ["train", "--model", str(tiny_dir), "--steps", "40", "--output-dir", str(run_dir)]
    args += tiny_run_args(eval_every=2, eval_n=2, save_steps=1000)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert "stopping the evaluation" in result.output
    assert last_checkpoint(run_dir).name == "checkpoint-2", result.output
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and eval_steps(run_dir) == []
    for row in rows:
        for key in ("reward", "gear/kl_mean", "gear/onsets_per_row", "completions/mean_length"):
            assert key in row, (row["step"], sorted(row))


def test_an_evaluation_callback_ended_by_a_signal_hands_the_model_back_training(
    tmp_path, monkeypatch
):
    """TRL logs the step after `EvalCallback` by `model.training`: however the evaluation ended
    (here it stops with the model still in eval mode, as a signal inside evaluate's own restore
    would leave it), the callback gives the trainer its model back training, and writes no
    eval/accuracy for the step."""
    import types

    import torch

    import gear.app.callbacks as rc
    import gear.app.evaluate as ev

    def interrupted(model, *args, **kwargs):
        model.eval()
        raise rc.EvalInterrupted(signal.SIGTERM)

    monkeypatch.setattr(ev, "evaluate_now", interrupted)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    cfg = types.SimpleNamespace(eval_every=2, eval_n=2)
    callback = ev.EvalCallback(task=None, cfg=cfg, tokenizer=None, console=None,
                               stop=rc.SignalStop())  # fmt: skip
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=2, max_steps=40)
    control = types.SimpleNamespace(should_training_stop=False)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    callback.on_step_end(args, state, control, model=model)
    assert all(m.training for m in model.modules())
    assert not (tmp_path / "metrics.jsonl").exists()

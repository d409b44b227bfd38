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

from gear.run_callbacks import STAGING, _publish, last_checkpoint
from gear.testing import save_tiny_model, tiny_run_args

# what a complete HF checkpoint holds (trainer_state.json is written last but one)
CHECKPOINT_FILES = {
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab="bytes")


class GearTrain:
    """`python -m gear.cli train ...` with its output read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gear.cli", "train", *args],
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


def assert_complete(checkpoint: Path) -> None:
    missing = CHECKPOINT_FILES - {p.name for p in checkpoint.iterdir()}
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


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tiny_dir, tmp_path):
    """SIGINT takes the same path as SIGTERM; in-process (CliRunner) to spare a subprocess."""
    from typer.testing import CliRunner

    from gear.cli import app

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
    result = CliRunner().invoke(app, [*args, *tiny_run_args(eval_n=0, save_steps=1000)])
    assert result.exit_code == 130, result.output
    assert "stopped by SIGINT" in " ".join(result.output.split())
    saved = last_checkpoint(run_dir)
    assert saved is not None and int(saved.name.split("-")[1]) < 40
    assert_complete(saved)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


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
    from gear.integrations.trl import GEARTrainer
    from gear.integrations.trl.config import GEARConfig
    from gear.run_callbacks import atomic_checkpoints
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

"""Launch `scripts/two_process.sh` (torchrun, 2 CPU processes, gloo, 127.0.0.1) from a test and
read what rank 0 concluded; shared by the DDP, DeepSpeed and FSDP tests.

Each launch is bounded: on timeout the whole process group (torchrun and both ranks) is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SKIP_ALL = os.environ.get("GEAR_SKIP_DISTRIBUTED") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(output_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `scripts/two_process.sh output_dir *args` on a fresh port, killed after `timeout` s."""
    env = {**os.environ, "PORT": str(free_port()), "PYTHON": sys.executable}
    with subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "two_process.sh"), str(output_dir), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends torchrun and the ranks
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[killed after {timeout} s]"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_two_processes(output_dir: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Launch (one retry on a fresh port: a port picked free can be taken before torchrun binds
    it, and gloo on a loaded 2-core machine occasionally fails to rendezvous); return rank 0's
    verdict with the per-rank summaries under "ranks" and the wall time under "wall_s"."""
    attempts = []
    for _ in range(2):
        start = time.perf_counter()
        done = launch(output_dir, *args, timeout=timeout)
        attempts.append(done)
        if done.returncode == 0:
            break
    tails = "".join(a.stdout[-3000:] + a.stderr[-3000:] for a in attempts)
    assert done.returncode == 0, tails
    verdict = json.loads((output_dir / "gear_ok.json").read_text())
    # the per-rank files: the two ranks' stdout lines can interleave
    if "teachers" not in verdict:  # one configuration (several: `run_teachers`)
        verdict["ranks"] = [
            json.loads((output_dir / f"gear_rank{r}.json").read_text()) for r in (0, 1)
        ]
    verdict["wall_s"] = time.perf_counter() - start
    verdict["log"] = tails
    return verdict


def run_teachers(
    output_dir: Path, backend: str, teachers: tuple[str, ...], *args: str, timeout: float = 600
) -> dict[str, dict[str, Any]]:
    """One launch training each teacher in turn (the processes' start-up, most of a run's time
    on this CPU, is paid once); teacher -> rank 0's verdict for it, as `run_two_processes`."""
    done = run_two_processes(
        output_dir, "--backend", backend, "--teacher", ",".join(teachers), *args, timeout=timeout
    )
    verdicts = {}
    for teacher in teachers:
        sub = output_dir / teacher
        verdict = json.loads((sub / "gear_ok.json").read_text())
        verdict["ranks"] = [json.loads((sub / f"gear_rank{r}.json").read_text()) for r in (0, 1)]
        verdicts[teacher] = verdict
    assert done["ok"] and set(done["teachers"]) == set(teachers), done
    print(f"{backend} {','.join(teachers)}: {done['wall_s']:.1f} s wall")  # shown with -s
    return verdicts


def assert_lockstep(
    verdict: dict[str, Any], backend: str, teacher: str, steps: int = 2, peft: bool = False
) -> None:
    """Both ranks trained `steps` steps on gloo, ended with the same full weights and teacher,
    ran the same GEAR forwards, and the teacher holds what it should."""
    ranks = verdict["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2 and r["process_group"] == "gloo", r
        assert r["backend"] == backend and r["teacher"] == teacher and r["steps"] == steps, r
        assert r["params_changed"] > 0 and r["teacher_check"]["ok"], r
        assert all(kl > 0 for kl in r["kl_mean"]) and len(r["kl_mean"]) == steps, r
        # the weights are really sharded the way the backend shards them
        expected = {"zero3": "zero3-partitioned", "fsdp2": "dtensor"}.get(backend, "full")
        assert r["policy_storage"] == expected, r
        if teacher != "current":  # a PEFT teacher is the policy itself: it owns no tensor
            assert r["teacher_storage"] == ("none" if peft else expected), r
        assert r["peft"] == peft, r
    assert verdict["ok"] and verdict["identical_weights"] and verdict["same_gear_forward_passes"]
    assert verdict["policy_moved"] and verdict["teacher_ok"]

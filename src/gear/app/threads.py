"""How many threads a CPU run uses: the cores that are free, on a crowded machine.

PyTorch's CPU kernels use one OpenMP thread per core by default. When other processes already
keep those cores busy, the threads wait on each other: issue 61 measured one GEAR teacher pass at
0.6 s alone and 35 s beside another run, and `gear train` at 7.5 min alone and 25 min beside one.
So a CPU run that was not told how many threads to use (`OMP_NUM_THREADS` unset) takes the cores
that other processes leave free, at least one, and says so in its log; on an idle machine nothing
changes. "Busy" is measured, not guessed from the load average (which counts this process's own
last minute too, e.g. a `gear compare`'s previous run): the machine's busy time from /proc/stat
over 0.3 s, less this process's own CPU time in it. Thread count changes floating-point reduction order,
so a crowded run's numbers may differ from an idle run's in the last bits (each run's
`summary.json` records its threads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Threads:
    """A run's CPU threads and why: `count`, the machine's `cores`, `load` (cores other processes
    kept busy when it started), and one sentence for the log."""

    count: int
    cores: int
    load: float | None
    reason: str


def free_cores(cores: int, load: float) -> int:
    """The cores that `load` busy cores leave free, at least 1."""
    return max(1, min(cores, round(cores - load)))


def busy_cores(
    interval: float = 0.3,
    stat: Callable[[], str] = lambda: Path("/proc/stat").read_text(),
    own: Callable[[], float] = lambda: sum(os.times()[:2]),
) -> float | None:
    """Cores other processes kept busy over the next `interval` seconds: the machine's busy time
    (`stat`, /proc/stat's text) less this process's CPU seconds (`own`); None where /proc/stat
    cannot be read."""

    def machine() -> tuple[float, float, int]:
        lines = stat().splitlines()
        fields = [float(x) for x in lines[0].split()[1:]]
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        return sum(fields[:8]), idle, cpus

    try:
        total0, idle0, cpus = machine()
        own0, t0 = own(), time.perf_counter()
        time.sleep(interval)
        total1, idle1, _ = machine()
        own1, elapsed = own(), time.perf_counter() - t0
    except (OSError, ValueError, IndexError):
        return None
    ticks = total1 - total0
    if ticks <= 0 or elapsed <= 0:
        return None
    busy = (ticks - (idle1 - idle0)) / ticks * cpus
    return max(0.0, busy - (own1 - own0) / elapsed)


def choose_threads(env: dict[str, str] | None = None) -> Threads:
    """The threads for this process (module docstring); does not set them (`apply`)."""
    import torch

    env = dict(os.environ) if env is None else env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    current = torch.get_num_threads()
    if env.get("OMP_NUM_THREADS") or env.get("GEAR_THREADS") == "all":
        why = "OMP_NUM_THREADS" if env.get("OMP_NUM_THREADS") else "GEAR_THREADS=all"
        return Threads(current, cores, None, f"{current} threads ({why} set)")
    load = busy_cores()
    if load is None:  # not measurable here: leave torch's choice
        return Threads(current, cores, None, f"{current} threads")
    free = free_cores(cores, load)
    if free >= current:
        return Threads(
            current, cores, load, f"{current} threads ({load:.1f} of {cores} cores busy)"
        )
    return Threads(
        free,
        cores,
        load,
        f"{free} of {cores} threads: the machine is busy ({load:.1f} of {cores} cores used by "
        "other processes), and "
        "more threads than free cores slow every step many times over; set OMP_NUM_THREADS (or "
        "GEAR_THREADS=all) to choose",
    )


def apply(threads: Threads) -> None:
    import torch

    if torch.get_num_threads() != threads.count:
        torch.set_num_threads(threads.count)

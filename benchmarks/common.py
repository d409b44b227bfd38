"""Shared benchmark harness: run each case in a fresh subprocess, report median wall time and
peak extra resident memory (RSS sampled every 0.5 ms above the level before the call), print a
table and write JSON. Benchmarks never pass or fail on time."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from queue import Empty
from typing import Any

import torch

import gear.evidence

RESULTS = Path(__file__).parent / "results"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager: peak RSS above the level at entry, sampled in a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def time_and_memory(
    fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None
) -> dict:
    """Median seconds over `repeats` calls and the peak extra memory of the first (MB).

    On CUDA the memory is torch's max allocated above the level before the call.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with PeakRSS() as mem:
        fn()
        sync()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else mem.extra_mb
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_mb": peak_mb,
        "repeats": repeats,
    }


def _child(target: Callable[..., dict], kwargs: dict, queue: mp.Queue) -> None:
    try:
        queue.put(target(**kwargs))
    except Exception as e:  # report, never hang the parent
        queue.put({"error": f"{type(e).__name__}: {e}"})


def isolated(target: Callable[..., dict], **kwargs: Any) -> dict:
    """Run `target(**kwargs)` in a fresh spawned process so memory peaks don't mix."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, kwargs, queue))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive():  # killed (out of memory) before it could report?
                try:  # or it reported and exited just after the timeout
                    result = queue.get(timeout=1.0)
                except Empty:
                    result = {"error": f"the measuring process died (exit code {proc.exitcode})"}
                break
    proc.join()
    return result


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_table(rows: list[dict], columns: list[str], title: str) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(
            "| "
            + " | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True))
            + " |"
        )


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def write_json(name: str, payload: dict) -> Path:
    path = RESULTS / f"{name}.json"
    payload = {"machine": machine(), **payload}
    gear.evidence.write_json(path, payload, indent=2)  # atomic: a killed run leaves the last one
    print(f"\nwrote {path}")
    return path

"""A CPU run on a crowded machine takes the cores others leave free (issue 61), says so, and
restores the threads after; a run told its threads, or on an idle machine, is left as it is."""

from __future__ import annotations

import torch

from gear.app import threads


def test_free_cores_leave_at_least_one():
    assert threads.free_cores(2, 0.0) == 2
    assert threads.free_cores(2, 0.9) == 1
    assert threads.free_cores(2, 3.5) == 1
    assert threads.free_cores(16, 6.2) == 10


def test_a_busy_machine_gets_the_free_cores_and_a_reason(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.5: 7.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    t = threads.choose_threads({})
    assert t.count == 1 and "busy" in t.reason and "OMP_NUM_THREADS" in t.reason
    assert threads.choose_threads({"OMP_NUM_THREADS": "8"}).count == 8  # the user's choice
    assert threads.choose_threads({"GEAR_THREADS": "all"}).count == 8
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.5: 0.2)
    assert threads.choose_threads({}).count == 8  # idle: unchanged


def test_busy_cores_are_the_machines_busy_time_less_this_process(monkeypatch):
    """2 CPUs over 100 ticks, 25 of them idle: 1.5 cores busy; this process used 1 s of CPU in
    its 1 s, so the others used 0.5 core."""
    stats = iter(
        ["cpu  100 0 100 300 0 0 0 0\ncpu0 x\ncpu1 x", "cpu  150 0 125 325 0 0 0 0\ncpu0\ncpu1"]
    )
    own = iter([10.0, 11.0])
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    busy = threads.busy_cores(1.0, stat=lambda: next(stats), own=lambda: next(own))
    assert busy == 0.5
    assert threads.busy_cores(stat=lambda: "garbage") is None


def test_gear_train_says_its_threads_and_restores_them(monkeypatch):
    from gear.app.config import resolve_config
    from gear.app.train import cpu_threads

    said = []

    class Console:
        def print(self, message, **kw):
            said.append(message)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.5: 1000.0)
    before = torch.get_num_threads()
    with cpu_threads(resolve_config(None, {}), Console()):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert said and said[0].startswith("threads: ")

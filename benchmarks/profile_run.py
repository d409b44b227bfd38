"""Where `gear train`'s time goes (issue 61): one run of the main job, phase by phase.

`gear train` runs in this process with wall-clock timers wrapped around its phases (class-level
wrappers that call the original: nothing computed changes): model load (with the GGUF
dequantisation when the cache is cold: `--cold` uses a fresh cache), each held-out evaluation
(greedy, sampled), and per training step: generation, the reward, GEAR's teacher prompts and
teacher/student/signal passes and credit, TRL's loss forward, the backward, the optimizer step,
checkpoint writes, the credit record, and the rest of the step (TRL's bookkeeping: batching,
advantages, metrics). Prints a table, writes `benchmarks/results/profile_run.json` (key: the
name given with `--name`) with the CPU capability and thread count.

    .venv/bin/python -m benchmarks.profile_run --steps 4                  # the main job, 4 steps
    .venv/bin/python -m benchmarks.profile_run --cold --name cold         # dequantisation too
    .venv/bin/python -m benchmarks.profile_run --set credit_method=grpo --name grpo
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, machine
from gear.evidence import write_json

OUT = RESULTS / "profile_run.json"

#: (phase, "module:Class.method" or "module:function") timed per call; nested phases are
#: subtracted from the phase that contains them (`PARENT`)
TIMED = {
    "load_model": "gear.models:load_model_and_tokenizer",
    "eval": "gear.app.evaluate:_evaluate_with_progress",
    "step": "transformers.trainer:Trainer.training_step",
    "generate_and_score": "gear.integrations.trl.trainer:GEARTrainer._generate_and_score_completions",
    "generation": "gear.integrations.trl.trainer:GEARTrainer._generate_single_turn",
    "reward": "gear.integrations.trl.trainer:GEARTrainer._calculate_rewards",
    "teacher_prompts": "gear.integrations.trl.trainer:GEARTrainer._teacher_inputs",
    "gear_passes": "gear.integrations.trl.trainer:GEARTrainer._token_signals",
    "credit": "gear.integrations.trl.trainer:GEARTrainer._credit",
    "credit_record": "gear.integrations.trl.trainer:GEARTrainer._maybe_write_credit_record",
    "loss_forward": "gear.integrations.trl.trainer:GEARTrainer._compute_loss",
    "backward": "accelerate.accelerator:Accelerator.backward",
    "optimizer": "torch.optim.adamw:AdamW.step",
    "checkpoint": "gear.integrations.trl.trainer:GEARTrainer._save_checkpoint",
}
PARENT = {
    "generation": "generate_and_score",
    "reward": "generate_and_score",
    "teacher_prompts": "generate_and_score",
    "gear_passes": "generate_and_score",
    "credit": "generate_and_score",
    "credit_record": "generate_and_score",
    "generate_and_score": "step",
    "loss_forward": "step",
    "backward": "step",
}


class Timers:
    """Seconds per phase, and per step for the training phases (the trainer's global step)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, float, dict]]] = defaultdict(list)
        self.step = 0

    @contextlib.contextmanager
    def wrapped(self) -> Iterator[None]:
        undo: list[Callable[[], None]] = []
        for phase, where in TIMED.items():
            module, _, attr = where.partition(":")
            owner: Any = __import__(module, fromlist=["_"])
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            own = name in vars(owner)  # else inherited: undone by deleting the wrapper
            original = vars(owner)[name] if own else getattr(owner, name)
            setattr(owner, name, self._timed(phase, original))
            undo.append(
                functools.partial(setattr, owner, name, original)
                if own
                else functools.partial(delattr, owner, name)
            )
        try:
            yield
        finally:
            for u in reversed(undo):
                u()

    def _timed(self, phase: str, fn: Callable) -> Callable:
        timers = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if phase == "step":  # every phase until the next step is this step's
                timers.step = args[0].state.global_step
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                # _evaluate_with_progress(model, tokenizer, task, cfg, console, label, samples, T)
                info = {"samples": args[6]} if phase == "eval" else {}
                timers.calls[phase].append((timers.step, time.perf_counter() - t0, info))

        return timed


def split(timers: Timers, warmup: int) -> dict[str, Any]:
    """Per phase: total seconds, and for training phases the mean per step (steps > warmup),
    each phase less the phases nested in it (`PARENT`)."""
    per_step: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    own: dict[str, dict[int, float]] = {}
    for phase in ("step", *PARENT):
        for step, seconds, _ in timers.calls.get(phase, []):
            per_step[phase][step] += seconds
    steps = sorted(s for s in per_step["step"] if s >= warmup)
    for phase in list(per_step):
        children = [c for c, p in PARENT.items() if p == phase]
        own[phase] = {
            s: per_step[phase][s] - sum(per_step[c].get(s, 0.0) for c in children) for s in steps
        }
    optimizer = [sec for step, sec, _ in timers.calls.get("optimizer", []) if step >= warmup]
    checkpoint = [sec for _, sec, _ in timers.calls.get("checkpoint", [])]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    step_mean = mean([per_step["step"][s] for s in steps])
    out = {
        "steps_measured": len(steps),
        "step_s": step_mean,
        "per_step": {p: mean(list(v.values())) for p, v in own.items()},
        "optimizer_s": mean(optimizer),
        "checkpoint_s_total": sum(checkpoint),
        "load_model_s": [sec for _, sec, _ in timers.calls.get("load_model", [])],
        "evals": [
            {"samples": info.get("samples"), "seconds": sec}
            for _, sec, info in timers.calls.get("eval", [])
        ],
    }
    # TRL's bookkeeping: the training step less its scoring, loss forward and backward
    out["per_step"]["step_rest"] = out["per_step"].pop("step", 0.0)
    return out


def main(argv: list[str] | None = None) -> None:
    from gear.app.config import parse_value, resolve_config
    from gear.app.train import train

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="steps not counted (the first)")
    ap.add_argument("--cold", action="store_true", help="a fresh model cache: dequantise too")
    ap.add_argument("--set", dest="set_", action="append", default=[], help="KEY=VALUE")
    ap.add_argument("--name", default="main_job")
    a = ap.parse_args(argv)
    overrides: dict[str, Any] = {"max_steps": a.steps, "save_steps": a.steps}
    for pair in a.set_:
        key, _, value = pair.partition("=")
        overrides[key] = parse_value(value)
    with tempfile.TemporaryDirectory() as tmp:
        from gear.models import CACHE_NAME, cache_root

        cache = Path(tmp) / "cache"  # a fresh cache: the before-evaluation runs, not a cached one
        cache.mkdir()
        if not a.cold and (cache_root() / CACHE_NAME).is_dir():  # the dequantised model stays
            (cache / CACHE_NAME).symlink_to(cache_root() / CACHE_NAME)
        os.environ["GEAR_CACHE"] = str(cache)
        cfg = resolve_config(None, {**overrides, "output_dir": str(Path(tmp) / "run")})
        timers = Timers()
        t0 = time.perf_counter()
        with timers.wrapped():
            train(cfg, run_dir=Path(tmp) / "run")
        total = time.perf_counter() - t0
    result = {"machine": machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "args": vars(a),
              "overrides": overrides, "total_s": total, **split(timers, a.warmup)}  # fmt: skip
    kept = json.loads(OUT.read_text()) if OUT.is_file() else {}
    write_json(OUT, kept | {a.name: result}, indent=1)
    print(f"{a.name}: {total:.0f} s total ({result['capability']}, "
          f"{result['threads']} threads)")  # fmt: skip
    for e in result["evals"]:
        print(f"  eval ({e['samples']} sample(s) per problem): {e['seconds']:.1f} s")
    for s in result["load_model_s"]:
        print(f"  model load: {s:.1f} s")
    print(f"  step: {result['step_s']:.2f} s (mean of {result['steps_measured']})")
    for phase, s in sorted(result["per_step"].items(), key=lambda kv: -kv[1]):
        print(f"    {phase:<20} {s:7.2f} s")
    print(f"    {'optimizer':<20} {result['optimizer_s']:7.2f} s")
    print(f"  checkpoints, total: {result['checkpoint_s_total']:.1f} s")


if __name__ == "__main__":
    main()

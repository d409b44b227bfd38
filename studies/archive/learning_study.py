"""The learning study of issue 13 §2 (its power is reported, see BENCHMARKS.md): GEAR vs GRPO, several seeds, 300+ held-out problems.

```
python -m studies.archive.learning_study run          # train what is missing (resumable), then aggregate
python -m studies.archive.learning_study aggregate    # JSON + table + figure from the finished runs
```

Every run trains SmolLM2-135M-Instruct with `studies/archive/learning_study.yaml`, through `gear
train`'s recipe (`gear.app.train`: the same GEARConfig, model, data and trainer); only the credit
method and the seed differ. Runs of one seed see the same prompts in the same order and start from
the same (pretrained) weights. All runs are scored on one fixed held-out set (test split, seed 0),
greedy pass@1, keeping each problem's correctness, so differences can be bootstrapped over seeds
*and* problems. The before-training evaluation is the same for every run and computed once.

Resumability is per finished run: a finished run writes
`studies/archive/results/learning_study/<method>-seed<k>.json` (evaluations with per-problem
correctness, per-step metrics, timings), which is small enough to commit; `run` skips every run
that has one. A run interrupted inside one machine session continues from its last complete
checkpoint under `--work` (gitignored: checkpoints are ~1.6 GB); a run interrupted by a fresh
work tree starts over. Order: seed 0 grpo, seed 0 gear, seed 1 grpo, ... so finished pairs accumulate.

Progress lines go to stdout (one per step and per evaluation); run it with `nohup nice -n 19`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gear.evidence import n_for_power, power_at, t_interval, write_text

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_suffix(".yaml")
RESULTS = ROOT / "studies" / "archive" / "results" / "learning_study"
AGGREGATE = ROOT / "studies" / "archive" / "results" / "learning_study.json"
TABLE = ROOT / "studies" / "archive" / "results" / "learning_study.md"
FIGURE = ROOT / "docs" / "learning_study.png"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
MARK_BEGIN = "<!-- learning_study:begin (written by benchmarks/learning_study.py aggregate) -->"
MARK_END = "<!-- learning_study:end -->"
CORE_METHODS = ("grpo", "gear")  # the comparison the study is planned and powered for
EVAL_SEED = 0  # one held-out set for every run: problems are paired across methods and seeds
METRIC_KEYS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "loss",
    "grad_norm",
    "entropy",
    "completions/mean_length",
    "gear/kl_mean",
    "gear/weight_std_pos",
    "gear/weight_std_neg",
)


def log(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and a rename (`gear.evidence.write_text`): two study processes
    (one per method) may aggregate at once, and a reader must never see half a file."""
    write_text(path, text)


def load_config(path: Path) -> dict[str, Any]:
    cfg = yaml.safe_load(path.read_text()) or {}
    allowed = {"model", "task", "task_options", "train_size", "trainer"}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; expected {sorted(allowed)}")
    if not isinstance(cfg.get("trainer"), dict) or "max_steps" not in cfg["trainer"]:
        raise ValueError(f"{path}: 'trainer' must be a mapping with max_steps")
    return cfg


def environment() -> dict[str, Any]:
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host_cpus": __import__("os").cpu_count(),
    }


# ---------------------------------------------------------------------------- evaluation


def held_out(model: Any, tokenizer: Any, task: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy pass@1 on the fixed held-out set, with each problem's correctness (0/1)."""
    import torch

    from gear.app.evaluate import evaluate

    rng = torch.random.get_rng_state()  # evaluation must not move the training's sampling RNG
    t0 = time.time()
    result = evaluate(
        model,
        tokenizer,
        task,
        split="test",
        n=args.eval_n,
        temperature=0.0,
        max_new_tokens=args.eval_max_new_tokens,
        batch_size=args.eval_batch_size,
        seed=EVAL_SEED,
    )
    torch.random.set_rng_state(rng)
    return {
        "acc": result.accuracy,
        "n": result.n_problems,
        "correct": [int(r["correct"][0]) for r in result.rows],
        "answers": [r["answer"] for r in result.rows],
        "seconds": round(time.time() - t0, 1),
        "sample": [r["completions"][0] for r in result.rows[:5]],
    }


def before_eval(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The pretrained model's held-out evaluation (shared by every run), cached in RESULTS."""
    path = args.results / "before.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("n") == args.eval_n and saved.get("task_options") == cfg.get("task_options"):
            return saved
    from gear.models import load_model_and_tokenizer
    from gear.tasks import get_task

    task = get_task(cfg["task"], **(cfg.get("task_options") or {}))
    model, tokenizer = load_model_and_tokenizer(cfg["model"])
    log(f"before-training evaluation on {args.eval_n} held-out problems ...")
    ev = held_out(model, task.prepare_tokenizer(tokenizer), task, args)
    ev |= {"task": cfg["task"], "task_options": cfg.get("task_options"), "step": 0}
    ev |= {"env": environment()}
    args.results.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(ev))
    log(f"before: pass@1 {ev['acc']:.3f} ({ev['seconds']:.0f} s)")
    return ev


# ---------------------------------------------------------------------------- one run


def make_callback(task: Any, tokenizer: Any, run_dir: Path, args: argparse.Namespace) -> Any:
    from transformers import TrainerCallback

    class StudyCallback(TrainerCallback):
        """Per-step metrics + timing to RUN_DIR/metrics.jsonl and the log; held-out evaluations
        at `eval_steps` to RUN_DIR/evals/step-XXXX.json (skipped when already there)."""

        def __init__(self) -> None:
            self.t_step = time.time()
            self.eval_seconds = 0.0

        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t_step = time.time()
            self.eval_seconds = 0.0

        def on_log(self, a: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            seconds = time.time() - self.t_step - self.eval_seconds  # the step alone
            row = {"step": state.global_step, "seconds": round(seconds, 1)}
            row |= {k: logs[k] for k in METRIC_KEYS if isinstance(logs.get(k), int | float)}
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(
                f"  step {row['step']}/{state.max_steps}: {row['seconds']:.0f} s, "
                f"reward {row.get('reward', float('nan')):.3f}, "
                f"zero-std groups {row.get('frac_reward_zero_std', float('nan')):.2f}"
            )

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            step = state.global_step
            path = run_dir / "evals" / f"step-{step:04d}.json"
            if step not in args.eval_steps or path.is_file() or step >= state.max_steps:
                return
            ev = held_out(model, tokenizer, task, args) | {"step": step}
            self.eval_seconds = ev["seconds"]
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps(ev))
            log(f"  step {step}: held-out pass@1 {ev['acc']:.3f} ({ev['seconds']:.0f} s)")

    return StudyCallback()


def last_complete_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that was written to the end. A kill during a save leaves a
    checkpoint without trainer_state.json (the Trainer writes it last); it is removed, since
    resuming from it fails and the checkpoint rotation would count it."""
    found = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for path in reversed(found):
        if (path / "trainer_state.json").is_file() and (path / "rng_state.pth").is_file():
            return path
        shutil.rmtree(path, ignore_errors=True)
    return None


def forget_after(run_dir: Path, step: int) -> None:
    """Drop metrics and evaluations of steps after `step`: a lost attempt's, to be redone."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        keep = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in keep if json.loads(ln)["step"] <= step]
        metrics.write_text("".join(ln + "\n" for ln in keep))
    for path in (run_dir / "evals").glob("step-*.json"):
        if int(path.stem.split("-")[1]) > step:
            path.unlink()


def run_config(cfg: dict[str, Any], method: str, seed: int, run_dir: Path) -> Any:
    """The study's run of `method` and `seed` as a `gear train` config (`gear.app.config.RunConfig`),
    every key checked as `gear train` checks it."""
    from gear.app.config import resolve_values

    trainer = dict(cfg["trainer"]) | {"credit_method": method}
    return resolve_values(cfg | {"trainer": trainer, "seed": seed, "output_dir": str(run_dir)})


def train_one(cfg: dict[str, Any], method: str, seed: int, args: argparse.Namespace) -> Path:
    """Train (or resume) one run; write its result file; return that file. The trainer is
    `gear train`'s (gear.app.train), built from `run_config`."""
    from transformers.trainer_callback import PrinterCallback

    from gear.app.config import trainer_args
    from gear.app.train import build_trainer, load_model_and_data
    from gear.tasks import get_task

    run_dir = args.work / f"{method}-seed{seed}"
    run = run_config(cfg, method, seed, run_dir)
    task = get_task(run.task, **run.task_options)
    targs = trainer_args(run, run_dir, hint_kind=task.hint_kind)  # every field, before any work
    model, tokenizer, train_ds = load_model_and_data(run, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    callbacks = [make_callback(task, tokenizer, run_dir, args)]
    trainer = build_trainer(targs, model, tokenizer, task, train_ds, callbacks)
    trainer.remove_callback(PrinterCallback)
    checkpoint = last_complete_checkpoint(run_dir)
    forget_after(run_dir, int(checkpoint.name.split("-")[1]) if checkpoint else 0)
    log(f"{method} seed {seed}: {f'resuming from {checkpoint.name}' if checkpoint else 'starting'}")
    t0 = time.time()
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    train_seconds = time.time() - t0
    steps = targs.max_steps
    final = held_out(trainer.model, tokenizer, task, args) | {"step": steps}
    log(f"{method} seed {seed}: held-out pass@1 after {steps} steps {final['acc']:.3f}")
    evals = [json.loads(p.read_text()) for p in sorted((run_dir / "evals").glob("step-*.json"))]
    metrics = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    result = {
        "method": method,
        "seed": seed,
        "task": cfg["task"],
        "task_options": cfg.get("task_options"),
        "model": cfg["model"],
        "steps": steps,
        "eval_n": args.eval_n,
        "evals": [*evals, final],
        "metrics": metrics,
        "train_seconds_this_attempt": round(train_seconds, 1),
        "resumed_from": checkpoint.name if checkpoint else None,
        "trainer": cfg["trainer"],
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "env": environment(),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"{method}-seed{seed}.json"
    write_atomic(out, json.dumps(result))
    for ckpt in run_dir.glob("checkpoint-*"):  # the result file is all that is kept
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    args.eval_steps = set(args.eval_steps)
    check_same_setup(cfg, args)
    log(f"learning study: methods {args.methods}, seeds {args.seeds}, env {environment()}")
    before_eval(cfg, args)
    todo = [(s, m) for s in args.seeds for m in args.methods]
    for seed, method in todo:
        if (args.results / f"{method}-seed{seed}.json").is_file():
            log(f"{method} seed {seed}: done, skipped")
            continue
        if args.max_runs is not None and args.max_runs <= 0:
            break
        try:
            out = train_one(cfg, method, seed, args)
        except Exception:
            log(f"{method} seed {seed} FAILED:\n{traceback.format_exc()}")
            return 1
        log(f"wrote {out}")
        if args.max_runs is not None:
            args.max_runs -= 1
        aggregate(args)
    complete = aggregate(args).get("complete", False)
    log("study complete" if complete else "stopped before the study was complete")
    return 0


def check_same_setup(cfg: dict[str, Any], args: argparse.Namespace) -> None:
    """Finished runs must share the study's setup: a changed config or evaluation would mix two
    studies in one table. Change them only together with a fresh results folder (--results)."""
    for path in sorted(args.results.glob("*-seed*.json")):
        done = json.loads(path.read_text())
        for key, now in (
            ("trainer", cfg["trainer"]),
            ("task_options", cfg.get("task_options")),
            ("eval_n", args.eval_n),
        ):
            if done.get(key) != now:
                raise SystemExit(
                    f"{path}: finished with {key}={done.get(key)!r}, but the study now has "
                    f"{key}={now!r}; restore {args.config} or pass a new --results folder"
                )


def finished_runs(results: Path) -> list[dict[str, Any]]:
    """Every finished run's result file in `results`, each read once."""
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*-seed*.json"))]
    return [r for r in runs if r.get("method")]


def study_methods(asked: list[str], runs: list[dict[str, Any]]) -> list[str]:
    """The methods asked for and any other method with a finished run, in a fixed order. One
    process per method (`run --methods gear`) shares the results folder with the others, and
    its aggregate must report the whole study, not only its own runs."""
    union = set(asked) | {r["method"] for r in runs}
    known = [*CORE_METHODS, "gear_token", "rlsd"]
    return [m for m in known if m in union] + sorted(union - set(known))


def all_done(args: argparse.Namespace, runs: list[dict[str, Any]]) -> bool:
    """Whether every seed of the study's core comparison (`CORE_METHODS`) has finished. Other
    methods (`gear_token`, `rlsd`: the issue's "if the budget allows") are optional arms: they
    are reported with however many seeds they reached and never make the core study partial."""
    done = {(r["method"], r["seed"]) for r in runs}
    return all((m, s) in done for s in args.seeds for m in CORE_METHODS)


# ---------------------------------------------------------------------------- aggregation


def bootstrap_mean(x: np.ndarray, rng: np.random.Generator, reps: int) -> tuple[float, list[float]]:
    """Mean of an (S, P) 0/1 (or difference) matrix and its 95% interval from a two-level
    bootstrap: resample seeds, and (one shared draw) problems, with replacement."""
    s, p = x.shape
    means = np.empty(reps)
    for b in range(reps):
        si = rng.integers(0, s, s)
        pi = rng.integers(0, p, p)
        means[b] = x[np.ix_(si, pi)].mean()
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(x.mean()), [float(lo), float(hi)]


def seed_t_test(per_seed: np.ndarray) -> dict[str, Any]:
    """Over seeds: the 95% Student-t interval of the mean paired difference, its SD, the power
    of a two-sided 5% paired t-test to detect an effect the size of the observed mean with this
    many seeds, and the seeds that would give 80% power (`gear.evidence`)."""
    n = len(per_seed)
    if n < 2 or per_seed.std(ddof=1) == 0:
        return {"t_ci95": None, "sd": None, "power": None, "seeds_for_80_power": None}
    t = t_interval(per_seed.tolist())
    return {"t_ci95": t["ci"], "sd": t["sd"], "power": power_at(abs(t["mean"]), t["sd"], n),
            "seeds_for_80_power": n_for_power(t["mean"], t["sd"])}  # fmt: skip


def aggregate(args: argparse.Namespace) -> dict[str, Any]:
    """learning_study.json, learning_study.md, the figure, and the BENCHMARKS.md block."""
    before_file = args.results / "before.json"
    if not before_file.is_file():
        log("aggregate: no before.json yet")
        return {}
    before = json.loads(before_file.read_text())
    runs_raw = finished_runs(args.results)
    methods_all = study_methods(args.methods, runs_raw)
    runs_raw.sort(key=lambda r: (r["seed"], methods_all.index(r["method"])))
    rng = np.random.default_rng(0)
    runs = []
    for r in runs_raw:
        curve = [[0, before["acc"]]] + [[e["step"], e["acc"]] for e in r["evals"]]
        step_s = [m["seconds"] for m in r["metrics"] if "seconds" in m]
        runs.append(
            {
                "method": r["method"],
                "seed": r["seed"],
                "before": before["acc"],
                "mid": r["evals"][0]["acc"] if len(r["evals"]) > 1 else None,
                "after": r["evals"][-1]["acc"],
                "curve": curve,
                "median_step_seconds": float(np.median(step_s)) if step_s else None,
                "resumed_from": r.get("resumed_from"),
                "eval_seconds": [e.get("seconds") for e in r["evals"]],
                "final_train_reward": float(np.mean([m["reward"] for m in r["metrics"][-5:]]))
                if r["metrics"]
                else None,
            }
        )
    by = {(r["method"], r["seed"]): r for r in runs_raw}
    methods = [m for m in methods_all if any(k[0] == m for k in by)]
    per_method = {}
    for m in methods:
        seeds = sorted(s for (mm, s) in by if mm == m)
        entry: dict[str, Any] = {"runs": len(seeds), "seeds": seeds}
        for label, idx in (("after", -1), ("mid", 0)):
            rows = [by[(m, s)]["evals"][idx]["correct"] for s in seeds]
            mean, ci = bootstrap_mean(np.array(rows, dtype=float), rng, args.reps)
            gain = np.array(rows, dtype=float) - np.array(before["correct"], dtype=float)[None]
            g_mean, g_ci = bootstrap_mean(gain, rng, args.reps)
            entry[label] = {"mean": mean, "ci95": ci, "gain": g_mean, "gain_ci95": g_ci}
            entry[label]["per_seed"] = [by[(m, s)]["evals"][idx]["acc"] for s in seeds]
        per_method[m] = entry
    paired = {}
    for a, b in (
        ("gear", "grpo"),
        ("gear_token", "grpo"),
        ("rlsd", "grpo"),
        ("gear", "gear_token"),
    ):
        seeds = sorted(s for (mm, s) in by if mm == a and (b, s) in by)
        if not seeds:
            continue
        entry = {"seeds": seeds}
        for label, idx in (("after", -1), ("mid", 0)):
            d = np.array(
                [
                    np.array(by[(a, s)]["evals"][idx]["correct"], dtype=float)
                    - np.array(by[(b, s)]["evals"][idx]["correct"], dtype=float)
                    for s in seeds
                ]
            )
            mean, ci = bootstrap_mean(d, rng, args.reps)
            per_seed = d.mean(axis=1)
            entry[label] = {
                "diff": mean,
                "ci95": ci,
                **seed_t_test(per_seed),
                "per_seed": [float(v) for v in per_seed],
                "seeds_positive": int((per_seed > 0).sum()),
                "seeds_negative": int((per_seed < 0).sum()),
            }
        paired[f"{a} - {b}"] = entry
    planned = len(args.seeds) * len(CORE_METHODS)
    result = {
        "task": f"{before['task']} {before.get('task_options') or {}}",
        "model": runs_raw[0]["model"] if runs_raw else None,
        "eval_n": before["n"],
        "steps": runs_raw[0]["steps"]
        if runs_raw
        else load_config(getattr(args, "config", CONFIG))["trainer"]["max_steps"],
        "complete": all_done(args, runs_raw),
        "runs_finished": sum(r["method"] in CORE_METHODS for r in runs),
        "runs_planned": planned,
        "optional_arms": {m: e["seeds"] for m, e in per_method.items() if m not in CORE_METHODS},
        "before": before["acc"],
        "runs": runs,
        "methods": per_method,
        "paired": paired,
        "ci_method": f"two-level bootstrap over seeds and problems, {args.reps} resamples",
        "env": runs_raw[-1]["env"] if runs_raw else before.get("env"),
        "updated": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    official = args.results.resolve() == RESULTS.resolve()
    out_json, out_md, figure = (
        (AGGREGATE, TABLE, FIGURE)
        if official  # a trial study elsewhere leaves the committed files alone
        else (
            args.results / "aggregate.json",
            args.results / "aggregate.md",
            args.results / "curve.png",
        )
    )
    write_atomic(out_json, json.dumps(result, indent=1))
    md = markdown(result)
    write_atomic(out_md, md)
    if official:
        update_benchmarks_md(md)
    if runs:
        plot(result, figure)
    log(
        f"aggregate: {result['runs_finished']}/{planned} core runs, {len(runs)} in all -> {out_json}"
    )
    return result


def fmt_ci(mean: float, ci: list[float], signed: bool = False) -> str:
    s = "+" if signed else ""
    return f"{mean:{s}.3f} [{ci[0]:{s}.3f}, {ci[1]:{s}.3f}]"


def markdown(res: dict[str, Any]) -> str:
    state = "complete" if res["complete"] else "**partial**"
    lines = [
        f"State: {res['runs_finished']} of {res['runs_planned']} runs of the core comparison "
        f"({' vs '.join(CORE_METHODS)}) finished ({state}; "
        f"updated {res['updated']}). Task `{res['task']}`, {res['steps']} steps per run, "
        f"held-out greedy pass@1 on {res['eval_n']} problems; before training "
        f"{res['before']:.3f} for every run. CPU capability `{(res['env'] or {}).get('cpu_capability')}`"
        f", torch threads {(res['env'] or {}).get('torch_threads')} per process.",
    ]
    for m, seeds in res.get("optional_arms", {}).items():
        lines[0] += (
            f" Optional arm `{m}`: seeds {', '.join(map(str, seeds))} only (fewer seeds, wider "
            "intervals; its pairs use the seeds both methods finished)."
        )
    if not res["runs"]:
        return "\n".join([*lines, "", "No run has finished yet."]) + "\n"
    lines += [
        "",
        "| method | seed | before | mid | after | median s/step | train reward, last 5 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        mid = f"{r['mid']:.3f}" if r["mid"] is not None else "-"
        sps = f"{r['median_step_seconds']:.0f}" if r["median_step_seconds"] else "-"
        rew = f"{r['final_train_reward']:.3f}" if r["final_train_reward"] is not None else "-"
        lines.append(
            f"| {r['method']} | {r['seed']} | {r['before']:.3f} | {mid} | {r['after']:.3f} | "
            f"{sps} | {rew} |"
        )
    if res["methods"]:
        lines += [
            "",
            "Mean with 95% interval (bootstrap over seeds and problems):",
            "",
            "| method | runs | mid | after | gain after − before |",
            "|---|---|---|---|---|",
        ]
        for m, e in res["methods"].items():
            lines.append(
                f"| {m} | {e['runs']} | {fmt_ci(e['mid']['mean'], e['mid']['ci95'])} | "
                f"{fmt_ci(e['after']['mean'], e['after']['ci95'])} | "
                f"{fmt_ci(e['after']['gain'], e['after']['gain_ci95'], True)} |"
            )
    if res["paired"]:
        lines += [
            "",
            "Paired difference over the seeds both methods finished (same data, same problems):",
            "",
            "| difference | seeds | mid | after (bootstrap) | after (t over seeds) | seeds +/− "
            "(after) | power | seeds for 80% power |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, e in res["paired"].items():
            a = e["after"]
            t = fmt_ci(a["diff"], a["t_ci95"], True) if a.get("t_ci95") else "-"
            power = f"{a['power']:.2f}" if a.get("power") is not None else "-"
            lines.append(
                f"| {name} | {len(e['seeds'])} | {fmt_ci(e['mid']['diff'], e['mid']['ci95'], True)}"
                f" | {fmt_ci(a['diff'], a['ci95'], True)} | {t} | "
                f"{a['seeds_positive']}/{a['seeds_negative']} | {power} | "
                f"{a.get('seeds_for_80_power') or '-'} |"
            )
        lines += [
            "",
            "Power: of a two-sided 5% paired t-test over seeds, for an effect the size of the "
            "observed mean difference.",
        ]
    resumed = [f"{r['method']} seed {r['seed']} (from {r['resumed_from']})"
               for r in res["runs"] if r.get("resumed_from")]  # fmt: skip
    lines += ["", "Runs resumed from a checkpoint: " + ("; ".join(resumed) or "none") + "."]
    if res["runs"]:
        lines += ["", "![learning study](docs/learning_study.png)"]
    return "\n".join(lines) + "\n"


def update_benchmarks_md(md: str) -> None:
    """Replace the block between the study's markers in BENCHMARKS.md (if the markers exist)."""
    if not BENCHMARKS_MD.is_file():
        return
    text = BENCHMARKS_MD.read_text()
    if MARK_BEGIN not in text or MARK_END not in text:
        return
    head, rest = text.split(MARK_BEGIN, 1)
    _, tail = rest.split(MARK_END, 1)
    write_atomic(BENCHMARKS_MD, f"{head}{MARK_BEGIN}\n{md}{MARK_END}{tail}")


def plot(res: dict[str, Any], figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:gray", "gear": "tab:red", "gear_token": "tab:blue", "rlsd": "tab:green"}
    fig, ax = plt.subplots(figsize=(6, 4))
    curves: dict[str, list] = {}
    for r in res["runs"]:
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, ys, color=colors.get(r["method"], "k"), alpha=0.3, lw=1)
        curves.setdefault(r["method"], []).append((xs, ys))
    for m, cs in curves.items():
        xs = cs[0][0]
        same = [c for c in cs if c[0] == xs]
        mean = np.mean([c[1] for c in same], axis=0)
        ax.plot(
            xs, mean, color=colors.get(m, "k"), lw=2.5, marker="o", label=f"{m} (n={len(same)})"
        )
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out greedy pass@1 ({res['eval_n']} problems)")
    ax.set_title(f"SmolLM2-135M, {res['task']}: per seed (thin), mean (thick)", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    figure.parent.mkdir(exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", choices=["run", "aggregate"])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--methods", nargs="+", default=["grpo", "gear"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--eval-n", type=int, default=300, help="held-out problems per evaluation")
    p.add_argument("--eval-steps", nargs="*", type=int, default=[20], help="mid-run evaluations")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=50)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "learning_study")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--reps", type=int, default=4000, help="bootstrap resamples")
    args = p.parse_args(argv)
    if args.eval_n < 1 or not math.isfinite(args.eval_n):
        p.error(f"--eval-n: expected a positive integer, got {args.eval_n}")
    if args.command == "run":
        return cmd_run(args)
    aggregate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

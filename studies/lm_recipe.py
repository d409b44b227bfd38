"""A real LM that learns (issue 35): the recipe sweep, the learning gate and the main job's seeds.

Every run is `gear train` itself (a subprocess, one thread each), so what is measured is what
users run. A run's record (its summary with per-problem held-out scores, its per-step reward and
seconds, the config it ran) is kept in `studies/results/lm_recipe_runs/<run>.json` as it finishes;
a stopped study resumes: finished records are read back, an interrupted run continues from its
last checkpoint (`gear train --resume`).

Stages (the rule is written in docs/evidence/lm_recipe.md before any of their runs):
- `sweep`: each setting of `SETTINGS`, GRPO, sweep seed 100 (not a gate seed).
- `gate`: GRPO on the chosen setting, seeds 0..7; `gear.evidence.learning_gate` decides.
- `main`: `gear train` as shipped (the default recipe: the paper's GEAR), seeds 0..4; `--tag`
  names a re-run of the recipe as shipped now (the report and `eval-size` read the rule's runs).
- `control`: the positive control: supervised fine-tuning on the worked solutions with the
  gate's LoRA and learning rate, scored by the same evaluation; it must show a gain.
- `report`: studies/results/lm_recipe.json (`sweep`, `gate`, `main_job`) and a table.

    python -m studies.lm_recipe sweep --workers 2
    python -m studies.lm_recipe gate --setting chosen --workers 2   # the rule's choice
    python -m studies.lm_recipe main --workers 2
    python -m studies.lm_recipe control --setting lora16_lr5e-4
    python -m studies.lm_recipe report --setting lora16_lr5e-4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gear.evidence import RecordStore, write_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "studies" / "results"
RECORDS = RESULTS / "lm_recipe_runs"
RUNS = ROOT / "runs" / "lm_recipe"  # run directories (checkpoints): not committed
SWEEP_SEED = 100
GATE_SEEDS = list(range(8))
MAIN_SEEDS = list(range(5))

#: what every sweep setting shares (the held-out metric above all): gear train's default recipe
#: with these keys set
BASE: dict[str, Any] = {
    "task_options": {"mix": "1digit:0.8,2digit:0.2"},
    "eval_n": 200,
    "eval_samples": 8,
    "eval_max_new_tokens": 32,
    "eval_seed": 0,
    "max_completion_length": 32,
    "temperature": 0.7,
    "per_device_train_batch_size": 32,
    "num_generations": 4,
    "max_steps": 16,
    "beta": 0.0,
}

#: the sweep: name -> keys over BASE (all GRPO)
SETTINGS: dict[str, dict[str, Any]] = {
    "lora16_lr2e-4": {"lora_r": 16, "learning_rate": 2e-4},
    "lora16_lr5e-4": {"lora_r": 16, "learning_rate": 5e-4},
    "full_lr3e-6_warmup": {"lora_r": 0, "learning_rate": 3e-6, "warmup_steps": 0.1},
    "lora16_lr2e-4_kl0.04": {"lora_r": 16, "learning_rate": 2e-4, "beta": 0.04},
}


def run_name(stage: str, setting: str, method: str, seed: int) -> str:
    return f"{stage}-{setting}-{method}-seed{seed}"


def settings_of(stage: str, setting: str, method: str) -> dict[str, Any]:
    """The --set keys of a run: the main job runs the shipped default recipe untouched."""
    if stage == "main":
        return {}
    return {**BASE, **SETTINGS[setting], "credit_method": method}


def gear_command(
    name: str, keys: dict[str, Any], seed: int, resume: bool, runs: Path = RUNS
) -> list[str]:
    exe = [sys.executable, "-m", "gear.app.cli", "train"]
    if resume:
        return [*exe, "--resume", str(runs / name)]
    args = [*exe, "--seed", str(seed), "--output-dir", str(runs / name)]
    for key, value in keys.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, dict) else value}"]
    return args


def run_one(stage: str, setting: str, method: str, seed: int, threads: int = 1) -> dict:
    """One run to its record (read back if kept; resumed if stopped)."""
    name = run_name(stage, setting, method, seed)
    meta = {"stage": stage, "setting": setting}
    return train(name, settings_of(stage, setting, method), seed, meta, threads=threads)


def train(
    name: str,
    keys: dict[str, Any],
    seed: int,
    meta: dict[str, Any],
    runs: Path = RUNS,
    records: Path = RECORDS,
    threads: int = 1,
) -> dict:
    """`gear train --seed seed --set keys` as run `name`, to its record `records/<name>.json`
    (read back if kept; resumed from its last checkpoint if stopped). `meta` joins the record."""
    if (kept := RecordStore(records).get(name)) is not None:
        return kept
    run_dir = runs / name
    resume = (run_dir / "config.yaml").is_file()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    runs.mkdir(parents=True, exist_ok=True)
    log = runs / f"{name}.log"
    t0 = time.time()
    with log.open("a") as out:
        done = subprocess.run(
            gear_command(name, keys, seed, resume, runs),
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{name}: gear train exited with {done.returncode}; see {log}")
    return keep(run_dir, records, {"name": name, **meta, "seed": seed}, time.time() - t0, resume)


def keep(run_dir: Path, records: Path, meta: dict[str, Any], wall: float, resumed: bool) -> dict:
    """The record of the finished run in `run_dir` (`meta` first), written atomically."""
    import torch
    import yaml

    from gear.app.rundir import read_metrics

    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "reward" in m]
    record = {
        **meta,
        "method": summary["method"],
        "config": yaml.safe_load((run_dir / "config.yaml").read_text()),
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "reward": [m["reward"] for m in steps],
        "step_seconds": [m.get("step_time", m.get("gear/step_seconds")) for m in steps],
        "train_seconds": summary.get("train_seconds"),
        "wall_s": wall,
        "resumed": resumed,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    return write_record(record, records)


def write_record(record: dict, records: Path = RECORDS) -> dict:
    """Keep `record` as `records/<its name>.json`, atomically (a stop never leaves half a file)."""
    return RecordStore(records).put(record["name"], record)


def ensure_before(stage: str, setting: str, method: str) -> None:
    """The shared held-out scores before training, computed once (all cores) and cached for
    every run (`gear.app.evaluate.cached_eval_before`), so parallel runs do not each compute them."""
    from gear.app.config import resolve_config
    from gear.app.evaluate import cached_eval_before, evaluate_now, store_eval_before

    cfg = resolve_config(None, settings_of(stage, setting, method))
    if cached_eval_before(cfg) is not None:
        return
    from gear.models import load_model_and_tokenizer
    from gear.tasks import get_task

    print(f"computing the shared evaluation before training ({cfg.eval_n} problems)", flush=True)
    model, tok = load_model_and_tokenizer(cfg.model)
    task = get_task(cfg.task, **cfg.task_options)
    store_eval_before(
        cfg, evaluate_now(model, task.prepare_tokenizer(tok), task, cfg, None, "before")
    )


def run_all(jobs: list[tuple[str, str, str, int]], workers: int) -> list[dict]:
    ensure_before(*jobs[0][:3])

    def go(job: tuple[str, str, str, int]) -> dict:
        record = run_one(*job)
        print(f"kept {record['name']}", flush=True)
        return record

    return in_parallel(go, jobs, workers)


def in_parallel(fn: Any, jobs: list, workers: int) -> list:
    """`fn(job)` for every job on `workers` threads, results in the jobs' order. A job that fails
    does not stop the others (`Executor.map` cancels every job not yet started once a result it
    reaches has failed: a run killed by the OOM killer stopped a grid that way); the failures are
    raised together once every job has ended."""
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
    failed = [(job, f.exception()) for job, f in zip(jobs, futures, strict=True) if f.exception()]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(jobs)} jobs failed (the others ran to the end): "
            + "; ".join(f"{job}: {e}" for job, e in failed)
        )
    return [f.result() for f in futures]


# ------------------------------------------------------------------------------ control


def right_padded(rows: list[list[int]], value: int) -> Any:
    """(len(rows), longest) tensor of `rows`, each padded on the right with `value`."""
    import torch

    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def sft_control(setting: str, seed: int = 0, threads: int = 1) -> dict:
    """The positive control: LoRA SFT on training problems' worked solutions (the answer
    itself), `max_steps` steps of `per_device_train_batch_size` rows at the setting's learning
    rate, then the gate's held-out evaluation. An evaluation that cannot see this gain could
    not see GRPO's either. Kept as `control-<setting>-sft-seed<seed>.json`."""
    import torch
    from peft import get_peft_model

    from gear.app.config import resolve_config
    from gear.app.evaluate import cached_eval_before, evaluate_now
    from gear.app.preflight import lora_config
    from gear.models import load_model_and_tokenizer
    from gear.tasks import get_task

    name = run_name("control", setting, "sft", seed)
    if (kept := RecordStore(RECORDS).get(name)) is not None:
        return kept
    torch.set_num_threads(threads)
    t0 = time.time()
    cfg = resolve_config(None, settings_of("gate", setting, "grpo"))
    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(cfg.model)
    task = get_task(cfg.task, **cfg.task_options)
    tok = task.prepare_tokenizer(tok)
    model = get_peft_model(model, lora_config(cfg))
    batch = cfg.trainer["per_device_train_batch_size"]
    steps = cfg.trainer["max_steps"]
    rows = task.dataset("train", n=steps * batch, seed=seed)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.trainer["learning_rate"]
    )
    losses = []
    for step in range(steps):
        ids, labels = [], []
        for row in rows.select(range(step * batch, (step + 1) * batch)):
            prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            target = tok(row["ground_truth"], add_special_tokens=False)["input_ids"]
            target = [*target, tok.eos_token_id]
            ids.append(prompt + target)
            labels.append([-100] * len(prompt) + target)  # loss on the solution only
        loss = model(
            input_ids=right_padded(ids, tok.pad_token_id),
            attention_mask=right_padded([[1] * len(x) for x in ids], 0),
            labels=right_padded(labels, -100),
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the GRPO runs (TRL's)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"control step {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)
    model = model.merge_and_unload().eval()
    before = cached_eval_before(cfg)
    if before is None:
        raise RuntimeError("control: no held-out scores before training; run the gate first")
    after = evaluate_now(model, tok, task, cfg, None, "after")
    record = {
        "name": name,
        "stage": "control",
        "setting": setting,
        "method": "sft",
        "seed": seed,
        "before": before,
        "after": after,
        "loss": losses,
        "wall_s": time.time() - t0,
        "resumed": False,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    return write_record(record)


# ------------------------------------------------------------------------------ report


def records(stage: str, setting: str | None = None) -> list[dict]:
    out = RecordStore(RECORDS).all(f"{stage}-*")
    return [r for r in out if setting is None or r["setting"] == setting]


def sweep_entry(r: dict) -> dict:
    from gear.evidence import paired, slope

    seconds = [s for s in r["step_seconds"] if s is not None]
    return {
        "setting": r["setting"],
        "keys": SETTINGS.get(r["setting"], {}),
        "seed": r["seed"],
        "before": {"mean_reward": r["before"]["mean_reward"], "greedy": r["before"]["pass@1"]},
        "after": {"mean_reward": r["after"]["mean_reward"], "greedy": r["after"]["pass@1"]},
        "gain_over_problems": paired(
            r["after"]["per_problem"]["mean_reward"], r["before"]["per_problem"]["mean_reward"]
        ),
        "reward_slope": slope(r["reward"]),
        "seconds_per_step": sorted(seconds)[len(seconds) // 2] if seconds else None,
        "capability": r["capability"],
    }


def choose(sweep: list[dict]) -> str:
    """The rule's choice (docs/evidence/lm_recipe.md): the largest primary gain; of gains within
    0.01 of the largest, the one with the fewest seconds per step. Needs every setting's run."""
    missing = sorted(set(SETTINGS) - {e["setting"] for e in sweep})
    if missing:
        raise ValueError(f"the sweep has no run yet for {missing}: the rule chooses among all")
    gain = {e["setting"]: e["after"]["mean_reward"] - e["before"]["mean_reward"] for e in sweep}
    best = max(gain.values())
    near = [e for e in sweep if gain[e["setting"]] >= best - 0.01]
    return min(near, key=lambda e: e["seconds_per_step"])["setting"]


def report(setting: str | None, out: Path) -> dict:
    from gear.evidence import learning_gate, mde, paired

    result: dict[str, Any] = {"sweep": [sweep_entry(r) for r in records("sweep")]}
    if {e["setting"] for e in result["sweep"]} >= set(SETTINGS):
        result["chosen"] = choose(result["sweep"])
        setting = setting or result["chosen"]
    gate_runs = records("gate", setting) if setting else []
    if gate_runs:
        per_problem = [
            paired(
                r["after"]["per_problem"]["mean_reward"], r["before"]["per_problem"]["mean_reward"]
            )["mean"]
            for r in gate_runs
        ]
        result["gate"] = learning_gate(
            [r["before"]["mean_reward"] for r in gate_runs],
            [r["after"]["mean_reward"] for r in gate_runs],
            [r["reward"] for r in gate_runs],
            seeds=[r["seed"] for r in gate_runs],
            metric="held-out mean reward (8 samples per problem at T=0.7, 200 problems)",
        ) | {
            "setting": setting,
            "greedy": paired(
                [r["after"]["pass@1"] for r in gate_runs],
                [r["before"]["pass@1"] for r in gate_runs],
            ),
            "per_seed_gain": per_problem,
            "resumed": [r["seed"] for r in gate_runs if r["resumed"]],
            "capability": sorted({r["capability"] for r in gate_runs}),
        }
        # the smallest gain these seeds detect with 80% power at their between-seed SD
        result["gate"]["mde_80"] = mde(result["gate"]["paired"]["sd"], len(gate_runs))
    control = records("control", setting) if setting else []
    if control:
        result["control"] = [
            {
                "setting": r["setting"],
                "method": r["method"],
                "seed": r["seed"],
                "before": r["before"]["mean_reward"],
                "after": r["after"]["mean_reward"],
                "greedy_before": r["before"]["pass@1"],
                "greedy_after": r["after"]["pass@1"],
                "gain_over_problems": (
                    g := paired(
                        r["after"]["per_problem"]["mean_reward"],
                        r["before"]["per_problem"]["mean_reward"],
                    )
                ),
                "passed": g["ci"][0] > 0,
                "capability": r["capability"],
            }
            for r in control
        ]
    main = records("main", "default")  # the recipe the rule ran (tagged re-runs apart)
    if main:
        result["main_job"] = {
            "seeds": [r["seed"] for r in main],
            "method": sorted({r["method"] for r in main}),
            "before": [r["before"]["mean_reward"] for r in main],
            "after": [r["after"]["mean_reward"] for r in main],
            "greedy_before": [r["before"]["pass@1"] for r in main],
            "greedy_after": [r["after"]["pass@1"] for r in main],
            "learned": sum(
                a > b
                for a, b in zip(
                    [r["after"]["mean_reward"] for r in main],
                    [r["before"]["mean_reward"] for r in main],
                    strict=True,
                )
            ),
            "wall_s": [r["wall_s"] for r in main],
            "capability": [r["capability"] for r in main],
            "resumed": [r["seed"] for r in main if r["resumed"]],
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(
        "| setting | seed | mean reward before -> after | gain [95% over problems] | greedy | reward slope / step | s/step | CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for e in result["sweep"]:
        g = e["gain_over_problems"]
        print(
            f"| {e['setting']} | {e['seed']} | {e['before']['mean_reward']:.3f} -> {e['after']['mean_reward']:.3f} "
            f"| {g['mean']:+.3f} [{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}] | {e['before']['greedy']:.3f} -> "
            f"{e['after']['greedy']:.3f} | {e['reward_slope']:+.4f} | {e['seconds_per_step']:.1f} | {e['capability']} |"
        )
    if "gate" in result:
        g = result["gate"]
        p = g["paired"]
        print(
            f"gate ({g['setting']}, seeds {g['seeds']}): after - before {p['mean']:+.3f} "
            f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] (MDE at 80% power {g['mde_80']:.3f}), "
            f"slope {g['reward_slope']['mean']:+.4f}, passed={g['passed']}"
        )
    for c in result.get("control", []):
        g = c["gain_over_problems"]
        print(
            f"positive control ({c['method']}, {c['setting']}): {c['before']:.3f} -> {c['after']:.3f}, "
            f"gain {g['mean']:+.3f} [{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}], passed={c['passed']}"
        )
    if "main_job" in result:
        m = result["main_job"]
        pairs = ", ".join(f"{b:.3f}->{a:.3f}" for b, a in zip(m["before"], m["after"], strict=True))
        print(
            f"main job (seeds {m['seeds']}): learned in {m['learned']} of {len(m['seeds'])}: {pairs}"
        )


def eval_size(runs: list[dict], sizes: tuple[int, ...] = (200, 100, 50)) -> dict:
    """Issue 61: would a smaller held-out set keep the main job's learning evidence decisive?
    For each size n, each run's after - before paired 95% interval over its first n held-out
    problems (the problem order is fixed by `eval_seed`, and a problem's sampling noise by the
    problem alone, so these are the scores an n-problem evaluation gives, up to the float
    rounding of a different batch), per metric, and how many runs' intervals are above 0."""
    from gear.evidence import paired

    out: dict = {}
    for n in sizes:
        row: dict = {}
        for metric in ("mean_reward", "greedy"):
            per_seed = []
            for r in runs:
                b, a = (r[w]["per_problem"][metric][:n] for w in ("before", "after"))
                d = paired(a, b)
                per_seed.append({"seed": r["seed"], "mean": d["mean"], "ci": d["ci"]})
            row[metric] = {"runs": per_seed, "above_0": sum(x["ci"][0] > 0 for x in per_seed)}
        out[str(n)] = row
    return {"seeds": [r["seed"] for r in runs], "sizes": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["sweep", "gate", "main", "control", "report", "eval-size"])
    ap.add_argument("--setting", help="the sweep setting the gate runs on (the rule's choice)")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS))
    ap.add_argument("--seeds", nargs="*", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--tag",
        default="default",
        help="main: the name its runs and records carry (main-TAG-default-seedS); a re-run of "
        "gear train's recipe as shipped now, once the recipe changed (issue 61: 'eval100')",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "lm_recipe.json")
    a = ap.parse_args(argv)
    if a.stage == "sweep":
        run_all([("sweep", s, "grpo", SWEEP_SEED) for s in a.settings], a.workers)
    elif a.stage == "gate":
        if a.setting == "chosen":  # the rule's choice from the kept sweep
            a.setting = choose([sweep_entry(r) for r in records("sweep")])
            print(f"the rule chooses {a.setting}", flush=True)
        if a.setting not in SETTINGS:
            ap.error(f"--setting: 'chosen' or one of {list(SETTINGS)}")
        run_all([("gate", a.setting, "grpo", s) for s in a.seeds or GATE_SEEDS], a.workers)
    elif a.stage == "control":
        if a.setting not in SETTINGS:
            ap.error(f"--setting: one of {list(SETTINGS)}")
        sft_control(a.setting)
    elif a.stage == "main":
        run_all([("main", a.tag, "default", s) for s in a.seeds or MAIN_SEEDS], a.workers)
    elif a.stage == "eval-size":  # reads the main job's kept runs; trains nothing
        result = eval_size(sorted(records("main", "default"), key=lambda r: r["seed"]))
        write_json(RESULTS / "main_job_eval_size.json", result)
        for n, row in result["sizes"].items():
            print(f"{n} problems: " + ", ".join(
                f"{m} above 0 in {v['above_0']} of {len(result['seeds'])} (lowest bound "
                f"{min(x['ci'][0] for x in v['runs']):+.3f})" for m, v in row.items()))  # fmt: skip
        return 0
    report(a.setting, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

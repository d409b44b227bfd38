"""The gym's run: warm start (cached), localisation of blame on natural failures, then every
arm x seed from the same warm start (each finished run kept in a `gear.evidence.RunStore`, so a
stopped grid resumes), then paired statistics, JSON and plots. `run` is the entry point
(`gear.gym.run`); `table` prints its result. See docs/gym.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from gear.credit import METHODS
from gear.evidence import RunStore, code_digest
from gear.evidence import run_key as evidence_run_key
from gear.gym.model import (
    ModelConfig,
    WarmStart,
    build_model,
    cache_dir,
    n_params,
    warm_start,
)
from gear.gym.report import localisation, plots, summarise
from gear.gym.task import ChainTask
from gear.gym.train import DEFAULT_ARMS, Arm, RLConfig, parse_arm, train_arm
from gear.io import write_text

#: the quick mode: a smoke test of the whole pipeline in a few minutes, not evidence
QUICK = {"seeds": 3, "steps": 20, "eval_every": 5, "eval_n": 128, "loc_prompts": 64}


def _threads() -> None:
    torch.set_num_threads(1)


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """A digest of the warm-start weights themselves (a retrained warm start changes it)."""
    return _sha(
        *(
            k.encode() + v.detach().cpu().contiguous().numpy().tobytes()
            for k, v in sorted(state.items())
        )
    )


def run_code(arm: Arm) -> str:
    """16 hex digits over the source of the code a run of `arm` executes: the gym's task, model
    and loop, `gear.credit`, and the module of the arm's method (so editing your own method
    reruns it)."""
    here = Path(__file__).parent
    files = [here / n for n in ("task.py", "model.py", "train.py")]
    files += sorted((here.parent / "credit").glob("*.py"))
    method_file = inspect.getsourcefile(METHODS[arm.method].fn)
    if method_file:
        files.append(Path(method_file))
    return code_digest(files=dict.fromkeys(files))[:16]


def run_params(
    arm: Arm,
    seed: int,
    rl: RLConfig,
    warm_digest: str,
    task: ChainTask | None = None,
    held_out: int = 0,
) -> dict[str, Any]:
    """The parameters of one (arm, seed) run in the run store (its code is `run_code`)."""
    return {
        "task": asdict(task or ChainTask()),
        "warm": warm_digest,
        "method": arm.method,
        "estimator": arm.estimator,
        "oracle": arm.oracle,
        "lr": arm.lr,
        "held_out": held_out,
        "params": asdict(arm.params(seed)),
        "seed": seed,
        "rl": asdict(rl),
        "torch": torch.__version__,
    }


def run_key(
    arm: Arm,
    seed: int,
    rl: RLConfig,
    warm_digest: str,
    task: ChainTask | None = None,
    held_out: int = 0,
) -> str:
    """Everything that determines one (arm, seed) run: the task (its hint, the teacher context,
    included: runs of two contexts never share a key), the warm-start weights, the held-out
    set, the arm as parsed (method, estimator, its own lr, every `CreditParams` value, oracle),
    the seed, the RL settings,
    torch's version and the source of the code a run executes (the gym's task, model and loop,
    `gear.credit`, and the module of the arm's method, so editing your own method reruns it).
    The run is kept as `<key>.json` (`RunStore(root, run_code(arm))` with `run_params`)."""
    return evidence_run_key(run_params(arm, seed, rl, warm_digest, task, held_out), run_code(arm))


def _job(args: tuple) -> dict[str, Any]:
    """One (arm, seed) run, or its kept result: a stopped grid resumes where it stopped."""
    name, spec, seed, task, model_cfg, state, rl, w, store, params = args
    kept = store.get(params)
    if kept is not None:
        return {**kept, "arm": name, "warm": w, "reused": True}
    _threads()
    arm = parse_arm(spec, name)
    result = {**train_arm(arm, seed, task, model_cfg, state, rl, held_out=w), "warm": w}
    return store.put(params, result)  # atomic: a killed worker leaves no half-written result


def _finite(x: Any) -> Any:
    """NaN (an interval of one seed) -> None, so the JSON is standard."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def table(result: dict[str, Any]) -> str:
    """The result as plain-text tables: arms, paired differences, localisation.

    The first column is as wide as its longest name, so a user's arm (`pkg.mod:method@k=v`)
    keeps every column aligned; print it as plain text (no wrapping at a terminal's width)."""
    arms, pairs = result["arms"], result["paired"]
    loc = result["localisation"]
    w_arm = max([16, *(len(n) + 2 for n in [*arms, *loc["arms"]])])
    w_pair = max([22, *(len(n) + 2 for n in pairs)])
    lines = [f"{'arm':<{w_arm}}{'final':>8}{'95% CI':>18}{'sampled':>9}{'reached':>9}"]
    for name, a in arms.items():
        lo, hi = a["final_ci"]
        st = a["steps_to_threshold"]
        reached = f"{st['reached']}/{st['of']}"
        lines.append(
            f"{name:<{w_arm}}{a['final']:>8.3f}{f'[{lo:.3f}, {hi:.3f}]':>18}"
            f"{a['final_accuracy']:>9.3f}{reached:>9}"
        )
    lines += ["", f"{'paired (final)':<{w_pair}}{'mean':>8}{'95% CI':>20}{'wins':>7}"]
    for name, d in pairs.items():
        lo, hi = d["ci"]
        wins = f"{d['wins']}/{d['n']}"
        lines.append(f"{name:<{w_pair}}{d['mean']:>+8.3f}{f'[{lo:+.3f}, {hi:+.3f}]':>20}{wins:>7}")
    lines += [
        "",
        f"localisation: {loc['failures']} failures, {loc['placebo_rows']} placebo rows"
        f" (chance hit_step {loc['chance_hit_step']:.3f})",
        f"{'arm':<{w_arm}}{'hit_step':>10}{'placebo':>10}{'step|next':>11}{'placebo':>10}"
        f"{'hit_token':>11}{'mass_lift':>11}",
    ]
    for name, r in loc["arms"].items():
        real, plac = r.get("real", {}), r.get("placebo", {})
        cells = [
            (real, "hit_step", 10), (plac, "hit_step", 10), (real, "hit_step_or_next", 11),
            (plac, "hit_step_or_next", 10), (real, "hit_token", 11), (real, "mass_lift", 11),
        ]  # fmt: skip
        lines.append(
            f"{name:<{w_arm}}" + "".join(f"{d.get(k, math.nan):>{w}.3f}" for d, k, w in cells)
        )
    return "\n".join(lines)


def sweep_arms(taus: Sequence[float]) -> list[Arm]:
    return [parse_arm(f"gear@tau_onset={t}", name=f"gear_tau{t:g}") for t in taus]


def run(
    methods: Sequence[str] | None = None,
    *,
    seeds: int | Sequence[int] = 20,
    steps: int = 60,
    length: int = 4,
    hint: str = "all_steps",
    warm_starts: int = 1,
    quick: bool = False,
    sweep: Sequence[float] = (),
    workers: int = 1,
    out: str | Path | None = None,
    plot_dir: str | Path | None = None,
    threshold: float | None = None,
    rl: RLConfig | None = None,
    model_cfg: ModelConfig | None = None,
    warm: WarmStart | None = None,
    loc_prompts: int = 256,
    cache: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the gym and return (and write to `out`, if given) the result dict.

    Args:
        methods: arm specs (`train.parse_arm`): default arm names, any registered credit
            method, `module:method` (imported first) or `method@key=value,...`. Default: all
            of `DEFAULT_ARMS`.
        seeds: a count (0..n-1) or explicit seeds. steps: RL steps per run.
        length: chain length (steps per problem). quick: `QUICK` sizes (overrides the above).
        hint: the teacher context, what the teacher's hint holds (`gear.gym.task.HINTS`):
            "all_steps" (every intermediate result) or "answer_only" (the final result; the
            warm start then learns from hints in that format). Recorded in the JSON's `task`.
        warm_starts: how many warm starts; seed i (in the order given) trains from warm start
            i mod warm_starts, whose model initialisation, warm-start data and held-out set are
            drawn with `ModelConfig.init_seed` + w, `WarmStart.seed` + w and held-out set w.
            Warm start 0 is the single warm start of `warm_starts=1`; the JSON reports the
            spread of each arm within and between warm starts. Localisation reads warm start 0.
        sweep: `tau_onset` values; each adds a `gear@tau_onset=t` arm and a `sweep` entry.
        workers: processes (spawned; each uses one thread).
        threshold: the "steps to threshold" level (default warm-start exact accuracy + 0.15).
        cache: where the warm start and each finished (arm, seed) run are kept (default
            ~/.cache/gear/gym), so a stopped grid resumes; the JSON lists reused runs.
    """
    t0 = time.perf_counter()
    rl = rl or RLConfig()
    for name, value in (
        ("steps", steps), ("workers", workers), ("loc_prompts", loc_prompts),
        ("warm_starts", warm_starts),
    ):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"gym: {name}: expected an integer >= 1, got {value!r}")
    if isinstance(seeds, int) and seeds < 1:
        raise ValueError(f"gym: seeds: expected a count >= 1 or a list of seeds, got {seeds!r}")
    loc_n = loc_prompts
    if quick:
        log(f"gym: quick mode: {QUICK['seeds']} seeds x {QUICK['steps']} steps (a smoke test)")
        seeds, steps, loc_n = QUICK["seeds"], QUICK["steps"], QUICK["loc_prompts"]
        rl = replace(rl, eval_every=QUICK["eval_every"], eval_n=QUICK["eval_n"])
    rl = replace(rl, steps=steps)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise ValueError(f"gym: seeds: expected distinct seeds, at least one, got {seed_list}")
    specs = list(methods) if methods else list(DEFAULT_ARMS)
    arms = [parse_arm(s) for s in specs] + sweep_arms(sweep)
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"gym: two arms share a name: {[a.name for a in arms]}")
    task, model_cfg = ChainTask(length, hint), model_cfg or ModelConfig()
    warm = warm or WarmStart()
    _threads()

    starts = []  # (model config, state, info, digest) of warm start w
    for w in range(warm_starts):
        cfg_w = replace(model_cfg, init_seed=model_cfg.init_seed + w)
        state_w, info_w = warm_start(
            task, cfg_w, replace(warm, seed=warm.seed + w), cache=cache, log=log
        )
        starts.append((cfg_w, state_w, {**info_w, "warm": w}, state_hash(state_w)))
    model_cfg, state, warm_info, _ = starts[0]
    model = build_model(model_cfg, task)
    model.load_state_dict(state)
    log(f"gym: localisation on natural failures ({loc_n} prompts x {rl.group})")
    loc = localisation(model, task, arms, prompts=loc_n, group=rl.group)

    run_dir = (cache if cache is not None else cache_dir()) / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    stores = {a.name: RunStore(run_dir, run_code(a)) for a in arms}  # <key>.json, run_key's key
    jobs = []
    for i, s in enumerate(seed_list):
        w = i % warm_starts
        cfg_w, state_w, _, digest = starts[w]
        for a in arms:
            params = run_params(a, s, rl, digest, task, held_out=w)
            jobs.append((a.name, a.spec, s, task, cfg_w, state_w, rl, w, stores[a.name], params))
    log(
        f"gym: {len(arms)} arms x {len(seed_list)} seeds x {steps} steps, {warm_starts} warm "
        f"start(s), {workers} worker(s)"
    )
    if workers > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            runs = list(pool.map(_job, jobs))
    else:
        runs = [_job(j) for j in jobs]

    reused = [f"{r['arm']}/seed{r['seed']}" for r in runs if r.pop("reused", False)]
    if reused:
        log(f"gym: {len(reused)} run(s) read back from {run_dir} (finished before a stop)")
    if threshold is None:
        threshold = round(warm_info["exact"] + 0.15, 3)
    stats = summarise(runs, threshold)
    result: dict[str, Any] = {
        "task": {"name": "chain_sum_mod10", **asdict(task), "tokens": task.completion_len},
        "model_params": n_params(model),
        "model": asdict(model_cfg),
        "warm_start": warm_info,
        "warm_starts": [info for _, _, info, _ in starts],
        "seed_warm_start": {s: i % warm_starts for i, s in enumerate(seed_list)},
        "seeds": seed_list,
        "steps": steps,
        "rl": asdict(rl),
        "metric": "held-out expected accuracy: the probability of the right solution without the "
        "hint, teacher-forced (no sampling noise); `final_accuracy` and the `accuracy` fields: one "
        "sample per problem at temperature 1",
        "reused_runs": reused,
        "quick": quick,
        "arm_specs": {a.name: a.spec for a in arms},
        "arm_lr": {a.name: rl.lr if a.lr is None else a.lr for a in arms},
        **stats,
        "sweep": [
            {
                "tau_onset": dict(a.overrides)["tau_onset"],
                "arm": a.name,
                "final": stats["arms"][a.name]["final"],
                "final_ci": stats["arms"][a.name]["final_ci"],
                "vs_grpo": stats["paired"].get(f"{a.name}-grpo"),
            }
            for a in sweep_arms(sweep)
        ],
        "localisation": loc,
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "torch": torch.__version__,
            "workers": workers,
        },
    }
    if out is not None:
        out = write_text(Path(out), json.dumps(_finite(result), indent=1) + "\n")
        log(f"gym: wrote {out}")
    if plot_dir is not None:
        for p in plots(result, Path(plot_dir)):
            log(f"gym: wrote {p}")
    return result

"""The comparison that decides gear's default (issue 37): credit methods on the real LM that learns.

The rule, written before any run: docs/evidence/2026-11-26-lm-learning-rule.md. Every run is
`gear train` on the shipped recipe (GEARTrainer, one thread, a subprocess) with one arm's keys;
arms are paired by seed and go round by round (seed 0 of every arm, then seed 1, ...), so a
stop leaves complete pairs. Each finished run's record is written to
`studies/results/lm_learning_runs/<arm>-seed<s>.json` (commit it as it lands); a stopped run
resumes from its checkpoint. `grpo` seeds 0-7 and `gear` seeds 0-4 are issue 35's runs of the
identical config, reused as the rule says.

    python -m studies.lm_learning grid --workers 1     # resumable; runs what is missing
    python -m studies.lm_learning status              # finished runs per arm (no scores)
    python -m studies.lm_learning report              # the rule's analysis -> lm_learning.json
    python -m studies.lm_learning report --final      # the budget ended: analyse complete rounds
    python -m studies.lm_learning placebo --arm X     # a winner's shape-matched placebo (step 4)
    python -m studies.lm_learning posthoc             # issue 53's post-hoc OAR-G arm (below)

The grid runs from a fixed checkout of the rule's code, so that later edits cannot change an
arm mid-grid (each record names its commit); records land in this tree's folder:

    git worktree add ../grid 8347d70
    ln -sfn "$PWD/studies/results/lm_learning_runs" ../grid/studies/results/lm_learning_runs
    cp studies/results/teacher_contexts.json ../grid/benchmarks/results/  # C*: the complete one
    (cd ../grid && PYTHONPATH=src OMP_NUM_THREADS=1 ../main/.venv/bin/python studies/lm_learning.py grid)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gear.evidence import RecordStore, git, head_commit, uncommitted
from studies import lm_recipe  # the run machinery: gear train per run, records, resume

ROOT = lm_recipe.ROOT
RESULTS = lm_recipe.RESULTS
RECORDS = RESULTS / "lm_learning_runs"
RUNS = ROOT / "runs" / "lm_learning"  # checkpoints: not committed
RULE = "docs/evidence/2026-11-26-lm-learning-rule.md"
SEEDS = 11  # n_for_power(0.10, 0.0731, alpha=0.05/6): the rule's n
EFFECT = 0.10  # the gain the rule is powered for
PILOT_SD = 0.0731  # paired SD of gear - grpo, issue 35's seeds 0-4
BASELINE = "grpo"
GRID_COMMIT = "8347d7087e65b0fb7c35f6519b0ba808d7b09ef5"  # the grid's fixed checkout
CHECK_STEPS = 3  # the placebo's pipeline check (the rule's 11:37 amendment)
BUDGET_CORE_HOURS = 24.0  # the budget for the new runs (the rule: "If the budget ends")
FIGURE = ROOT / "docs" / "lm_learning.png"

#: pieces of runs that were started and thrown away (they count against the budget; each is
#: listed in the JSON). A stopped run that resumed from its checkpoint is marked in its record.
DISCARDED = [
    {
        "run": "gear_k1-seed1",
        "when": "2026-11-26 ~07:20 UTC",
        "why": "stopped minutes after its start to leave the CPU to the final CI; its run "
        "folder and log were removed, so it restarted from step 0 at the next grid start",
        "wall_s": 600,  # its log is gone: an upper bound ("minutes after its start")
    },
    {
        "run": "gear_k1-seed3",
        "when": "2026-11-26 10:55 UTC",
        "why": "stopped by SIGTERM at the session's end after step 10 (checkpoint-10 saved); "
        "it resumes from there, and its record says resumed",
        "wall_s": 740,  # the process's elapsed time at the stop, plus the step it finished
    },
    {
        "run": "rlsd-seed3",
        "when": "2026-11-26 10:55 UTC",
        "why": "stopped 67 s after its start (no step done); its run folder and log were "
        "removed, so it restarts from step 0",
        "wall_s": 70,
    },
    {
        "run": "gear-seed5",
        "when": "2026-11-26 13:58 UTC",
        "why": "stopped by SIGTERM at the session's end after step 14 (checkpoint-14 saved); "
        "it resumes from there, and its record says resumed",
        "wall_s": 1730,  # 13:29:18 to the checkpoint at 13:58:07
    },
    {
        "run": "gear_k1-seed5",
        "when": "2026-11-26 13:58 UTC",
        "why": "stopped by SIGTERM at the session's end after step 1 (checkpoint-1 saved); "
        "it resumes from there, and its record says resumed",
        "wall_s": 95,  # 13:57:37 to the checkpoint at 13:59:11
    },
    {
        "run": "gear_k1-seed5",
        "when": "2026-11-26 14:20 UTC",
        "why": "its second piece: resumed at 14:08:55 and stopped by SIGTERM at the session's "
        "end after step 11 (checkpoint-11 saved); it resumes from there",
        "wall_s": 680,  # 14:08:55 to the checkpoint at 14:20:15
    },
    {
        "run": "rlsd-seed5",
        "when": "2026-11-26 14:20 UTC",
        "why": "stopped by SIGTERM at the session's end after step 2 (checkpoint-2 saved); it "
        "resumes from there, and its record says resumed",
        "wall_s": 160,  # 14:17:03 to the checkpoint at 14:19:42
    },
    {
        "run": "departure_blame_k1-seed7",
        "when": "2026-11-26 17:29 UTC",
        "why": "stopped by SIGTERM at the session's end after step 5 (checkpoint-5 saved); it "
        "resumes from there, and its record says resumed",
        "wall_s": 365,  # 17:23:54 to the checkpoint at 17:29:56
    },
    {
        "run": "oar_g-seed7",
        "when": "2026-11-26 17:29 UTC",
        "why": "stopped by SIGTERM at the session's end after step 1 (checkpoint-1 saved); it "
        "resumes from there, and its record says resumed",
        "wall_s": 95,  # 17:28:25 to the checkpoint at 17:29:59
    },
]

#: arm -> keys over the shipped default recipe (src/gear/app/configs/default.yaml)
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"credit_method": "grpo"},
    "gear": {},
    "gear_k1": {"kl_estimator": "k1"},
    "rlsd": {"credit_method": "rlsd"},
    "departure_blame_k1": {
        "credit_method": "gear_departure_blame",
        "kl_estimator": "k1",
        "credit_modulation": "exp",
        "credit_beta": 2.0,
        "credit_w_min": 0.0,
        "credit_w_max": 10.0,
    },
    "oar_g": {"credit_method": "oar_g"},
    "gear_k1_context": {"kl_estimator": "k1", "teacher_context": None},  # C*: best_context()
}
CANDIDATES = [a for a in ARMS if a != BASELINE]

#: issue 35's records of the identical configs (the rule's reused runs): arm -> (name, seeds)
REUSED = {
    "grpo": ("gate-lora16_lr5e-4-grpo-seed{seed}", range(8)),
    "gear": ("main-default-default-seed{seed}", range(5)),
}
UNSEEN_FROM = 5  # gear seeds >= 5 were not seen before the rule (its sensitivity analysis)


def best_context(path: Path = RESULTS / "teacher_contexts.json") -> str | None:
    """C*: of answer_only and contrast, the larger placebo-corrected L of `gear` under k1 in
    issue 36's complete result; None while that result is partial (the arm waits)."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result.get("partial", True):
        return None
    score = {
        c: result["contexts"][c]["k1"]["methods"]["gear"]["L"]["corrected"]
        for c in ("answer_only", "contrast")
    }
    return max(score, key=score.__getitem__)


def keys_of(arm: str) -> dict[str, Any] | None:
    """The arm's --set keys, None if it cannot run yet (C* undecided)."""
    keys = dict(ARMS[arm])
    if "teacher_context" in keys:
        keys["teacher_context"] = best_context()
        if keys["teacher_context"] is None:
            return None
    return keys


def placebo_keys(arm: str) -> dict[str, Any]:
    """The rule's placebo of `arm` (step 4): the arm's keys with its credit weights moved to
    random valid positions of each row (`random_shape` of the arm's method, same parameters)."""
    keys = keys_of(arm)
    if keys is None:
        raise RuntimeError(f"{arm}: its teacher context is not decided yet (issue 36 partial)")
    from gear.credit import CreditParams

    method = keys.get("credit_method", "gear")
    CreditParams(method="random_shape", shape_method=method)  # checks the method it moves
    return keys | {"credit_method": "random_shape", "credit_shape_method": method}


def record(arm: str, seed: int) -> dict | None:
    """The arm's finished run at `seed`: its own record or the rule's reused one."""
    if (own := RecordStore(RECORDS).get(f"{arm}-seed{seed}")) is not None:
        return own
    if arm in REUSED and seed in REUSED[arm][1]:
        name = REUSED[arm][0].format(seed=seed)
        reused = RecordStore(lm_recipe.RECORDS).get(name)
        if reused is None:
            raise FileNotFoundError(f"{arm} seed {seed}: the reused record {name} is not kept")
        return reused | {
            "arm": arm,
            "reused_from": f"studies/results/lm_recipe_runs/{name}.json",
        }
    return None


def schedule(seeds: int) -> list[tuple[str, int]]:
    """The missing (arm, seed) runs, round by round; arms that cannot run yet are left out."""
    return [
        (arm, s)
        for s in range(seeds)
        for arm in ARMS
        if record(arm, s) is None and keys_of(arm) is not None
    ]


def placebo_record(arm: str, seed: int) -> dict | None:
    return RecordStore(RECORDS).get(f"placebo-{arm}-seed{seed}")


def run(arm: str, seed: int, placebo: bool = False) -> dict:
    keys = placebo_keys(arm) if placebo else keys_of(arm)
    if keys is None:
        raise RuntimeError(f"{arm}: its teacher context is not decided yet (issue 36 partial)")
    name = f"placebo-{arm}-seed{seed}" if placebo else f"{arm}-seed{seed}"
    stage = "lm_learning_placebo" if placebo else "lm_learning"
    meta = {"stage": stage, "arm": arm, "keys": keys, "commit": head_commit(ROOT)}
    return lm_recipe.train(name, keys, seed, meta, RUNS, RECORDS)


def grid(seeds: int, workers: int) -> None:
    jobs = schedule(seeds)
    print(f"{len(jobs)} runs to go: {jobs}", flush=True)
    run_jobs(jobs, workers)


def placebo(arm: str, seeds: int, workers: int) -> None:
    """The winner's placebo on the analysed seeds 0..seeds-1 (the rule, step 4), once the
    pipeline it shares with the winner is shown unchanged since the grid (`pipeline_check`)."""
    placebo_keys(arm)  # refuse a bad arm before any run
    jobs = [(arm, s) for s in range(seeds) if placebo_record(arm, s) is None]
    print(f"{len(jobs)} placebo runs of {arm} to go: seeds {[s for _, s in jobs]}", flush=True)
    if not jobs:
        return
    check = pipeline_check(arm)
    if not check["equal"]:
        raise RuntimeError(
            f"{arm}: its first {CHECK_STEPS} steps differ between this commit "
            f"({check['head'][:7]}) and the grid's ({GRID_COMMIT[:7]}) or the grid's record: "
            f"{json.dumps(check['differ'])}; the placebo would not share the winner's pipeline"
        )
    run_jobs(jobs, workers, placebo=True)


# ------------------------------------------------------------------------------ post-hoc (53)
# Not part of the rule: arms run after its analysis was read, recorded in the JSON's `post_hoc`
# beside the pre-registered rows, which stay as they are. Records: `posthoc-<arm>-seed<s>.json`.

#: post-hoc arm -> keys over the shipped default recipe
POST_HOC: dict[str, dict[str, Any]] = {
    # OAR-G as designed (issue 53): phi on the completion's parsed final answer ("4" "2", no
    # end token), from raw logits; the rule's `oar_g` scored its last 2 tokens ("2" and
    # <|im_end|>) at the sampling temperature
    # float32, as the grid ran (its AVX2 CPU has no native bf16, so `bf16: auto` chose float32):
    # on an AVX512-BF16 CPU `auto` would choose bf16 autocast, a second change beside the span
    "oar_g_answer_span": {"credit_method": "oar_g", "credit_oar_span": "answer", "bf16": False},
    # GRPO again at this commit on this machine (`posthoc --baseline`): a pair on one CPU class
    "grpo_here": {"credit_method": "grpo", "bf16": False},
}
POST_HOC_ARM = "oar_g_answer_span"
POST_HOC_CHECK = "lm_learning_posthoc_check.json"  # in RESULTS


def posthoc_name(arm: str, seed: int) -> str:
    return f"posthoc-{arm}-seed{seed}"


def posthoc_record(arm: str, seed: int) -> dict | None:
    return RecordStore(RECORDS).get(posthoc_name(arm, seed))


def posthoc(out: Path, workers: int, baseline: bool = False, dry_run: bool = False) -> None:
    """Issue 53's post-hoc OAR-G arm on the seeds the rule analysed (`out`'s `seeds`), with
    `baseline` GRPO rerun here too; resumable (kept records are read back, a stopped run resumes
    from its checkpoint). Before the first run, GRPO's first steps must be the grid's
    (`pipeline_check`, kept in RESULTS / POST_HOC_CHECK). Then `posthoc_report`. `dry_run`:
    check the keys and print the runs' commands, run nothing."""
    from gear.app.config import resolve_config
    from gear.integrations.trl import GEARConfig

    seeds = json.loads(out.read_text())["seeds"]
    arms = [POST_HOC_ARM, *(["grpo_here"] if baseline else [])]
    for arm in arms:  # bad keys fail now, not after hours
        trainer = resolve_config(None, POST_HOC[arm]).trainer
        GEARConfig(output_dir=str(RUNS / "check"), **{**trainer, "bf16": False, "use_cpu": True})
    jobs = [(a, s) for s in seeds for a in arms if posthoc_record(a, s) is None]
    print(f"post-hoc: {len(jobs)} runs to go: {jobs}", flush=True)
    if dry_run:
        for a, s in jobs:
            cmd = lm_recipe.gear_command(posthoc_name(a, s), POST_HOC[a], s, False, RUNS)
            print(" ".join(cmd[1:]))
        return
    if jobs:
        check = pipeline_check(BASELINE, RESULTS / POST_HOC_CHECK)
        if not check["equal"]:
            raise RuntimeError(
                f"{BASELINE}: its first {CHECK_STEPS} steps differ between this commit and the "
                f"grid's ({GRID_COMMIT[:7]}): {json.dumps(check['differ'])}; a post-hoc arm "
                f"would not be paired with the grid's pipeline (see {RESULTS / POST_HOC_CHECK})"
            )
        lm_recipe.ensure_before("gate", "lora16_lr5e-4", "grpo")
        lm_recipe.in_parallel(lambda job: posthoc_run(*job), jobs, workers)
    posthoc_report(out)


def posthoc_run(arm: str, seed: int) -> dict:
    """One post-hoc run to its record, which also keeps `gear/oar_span_fallback` per step."""
    from gear.app.rundir import read_metrics

    name = posthoc_name(arm, seed)
    meta = {"stage": "lm_learning_posthoc", "post_hoc": "issue 53", "arm": arm,
            "keys": POST_HOC[arm], "commit": head_commit(ROOT)}  # fmt: skip
    r = lm_recipe.train(name, POST_HOC[arm], seed, meta, RUNS, RECORDS)
    if "oar_span_fallback" not in r and (RUNS / name / "metrics.jsonl").is_file():
        steps = [m for m in read_metrics(RUNS / name / "metrics.jsonl") if "reward" in m]
        r["oar_span_fallback"] = [m.get("gear/oar_span_fallback") for m in steps]
        lm_recipe.write_record(r, RECORDS)
    print(f"kept {name} ({r['wall_s'] / 60:.1f} min)", flush=True)
    return r


def posthoc_report(out: Path) -> dict | None:
    """`out`'s `post_hoc` section (every other key untouched) once the post-hoc arm has every
    analysed seed: it − GRPO, paired by seed, 95% (no multiplicity correction: one post-hoc
    comparison, labelled as such), against the rerun GRPO where `grpo_here` has every seed,
    else the grid's GRPO; and it − the rule's `oar_g` (the span fix alone)."""
    from gear.evidence import paired

    result = json.loads(out.read_text())
    seeds = result["seeds"]
    rs = [posthoc_record(POST_HOC_ARM, s) for s in seeds]
    if any(r is None for r in rs):
        done = sum(r is not None for r in rs)
        print(f"post-hoc: {done} of {len(seeds)} {POST_HOC_ARM} runs kept; no analysis yet")
        return None
    here = [posthoc_record("grpo_here", s) for s in seeds]
    base = here if all(here) else [record(BASELINE, s) for s in seeds]
    pre = [record("oar_g", s) for s in seeds]
    check_path = RESULTS / POST_HOC_CHECK
    check = json.loads(check_path.read_text()) if check_path.is_file() else {}
    machines = {"post_hoc": sorted({r["capability"] for r in rs}),
                "baseline": sorted({r["capability"] for r in base})}  # fmt: skip
    a = [primary(r) for r in rs]
    per_seed = [
        {"seed": r["seed"], "after": primary(r), "greedy": r["after"]["pass@1"],
         "commit": r.get("commit"), "resumed": r["resumed"], "capability": r["capability"]}
        for r in rs
    ]  # fmt: skip
    section = {
        "label": "post-hoc (issue 53): run after the rule's result was read; not part of the "
        "pre-registered comparison, whose oar_g row (the last 2 tokens) is unchanged",
        "arm": POST_HOC_ARM,
        "keys": POST_HOC[POST_HOC_ARM],
        "what": "oar_g with phi on the completion's parsed final answer (its digits, no end "
        "token), from raw logits; the rule's oar_g scored the last 2 tokens (the last digit "
        "and <|im_end|>) at the sampling temperature",
        "seeds": seeds,
        "baseline": "grpo_here: GRPO rerun at the post-hoc commit on the same machine"
        if all(here)
        else "grpo: the grid's records",
        "vs_grpo": paired(a, [primary(r) for r in base]),
        "vs_grpo_greedy": paired(
            [r["after"]["pass@1"] for r in rs], [r["after"]["pass@1"] for r in base]
        ),
        "vs_preregistered_oar_g": paired(a, [primary(r) for r in pre]),
        "level": 0.95,
        "mean_after": statistics.mean(a),
        "below_before": [r["seed"] for r in rs if primary(r) < r["before"]["mean_reward"]],
        "oar_span_fallback_per_step": statistics.mean(
            v for r in rs for v in r.get("oar_span_fallback", []) if v is not None
        )
        if any(r.get("oar_span_fallback") for r in rs)
        else None,
        "per_seed": per_seed,
        "machine": machines,
        "same_cpu_class": machines["post_hoc"] == machines["baseline"],
        "pipeline_check": {k: check.get(k) for k in ("arm", "head", "capability", "equal")},
        "seconds_per_step": seconds_per_step(rs),
    }
    result["post_hoc"] = {POST_HOC_ARM: section}
    out.write_text(json.dumps(result, indent=1) + "\n")
    d = section["vs_grpo"]
    print(
        f"post-hoc {POST_HOC_ARM} − {section['baseline'].split(':')[0]} (n = {d['n']}, 95%): "
        f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]; machines {machines}"
    )
    return section


#: what `pipeline_check` compares per step (`metrics.jsonl`): all are fixed by the pipeline
CHECK_KEYS = ("reward", "loss", "grad_norm", "gear/kl_mean")


def first_steps(keys: dict[str, Any], seed: int, steps: int, run_dir: Path, src: Path) -> list:
    """CHECK_KEYS of the first `steps` steps of `gear train --set keys` at `seed`, run from the
    source tree `src` in `run_dir` and cut once they are logged (a smaller max_steps would
    change the learning-rate schedule, and so the steps after the first)."""
    from gear.app.rundir import read_metrics

    def logged() -> list[dict]:
        rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if "reward" in m]
        return [{k: m.get(k) for k in CHECK_KEYS} for m in rows[:steps]]

    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = lm_recipe.gear_command(run_dir.name, keys, seed, False, run_dir.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src / "src")}
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src, start_new_session=True
        )
        try:
            while proc.poll() is None and len(logged()) < steps:
                time.sleep(5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the run and anything it started
            proc.wait()
    rows = logged()
    if len(rows) < steps:
        raise RuntimeError(f"{run_dir.name}: gear train ended before step {steps}; see its log")
    return rows


@contextmanager
def grid_tree() -> Iterator[Path]:
    """A temporary checkout of the grid's commit (a git worktree under RUNS)."""
    tree = RUNS / f"src-{GRID_COMMIT[:12]}"
    git(ROOT, "worktree", "remove", "--force", str(tree))  # a stale one
    git(ROOT, "worktree", "prune", check=True)
    git(ROOT, "worktree", "add", "--force", "--detach", str(tree), GRID_COMMIT, check=True)
    try:
        yield tree
    finally:
        done = git(ROOT, "worktree", "remove", "--force", str(tree))
        if done.returncode != 0:
            print(f"could not remove the worktree {tree}: {done.stderr}", flush=True)


#: the code a run executes (what the pipeline check's reuse and refusal look at)
CODE_PATHS = ("src", "studies", "pyproject.toml")


def pipeline_check(arm: str, out: Path | None = None) -> dict:
    """The rule's 11:37 amendment: `arm`'s first CHECK_STEPS steps at seed 0, run at this
    tree's commit and at the grid's on this machine, log the same CHECK_KEYS, and their training
    reward is the grid record's where the record ran on this CPU class (the placebo runs later
    code; this shows the pipeline it shares with the winner unchanged). Kept in `out` and reused
    while the arm, its keys, the CPU class and the code (src/, studies/, pyproject.toml) are."""
    import torch

    out = out or RESULTS / "lm_learning_placebo_check.json"
    if dirty := uncommitted(ROOT, CODE_PATHS):
        raise RuntimeError(f"commit the code first (runs record HEAD, not the tree):\n{dirty}")
    head = head_commit(ROOT)
    keys = keys_of(arm)
    if keys is None:
        raise RuntimeError(f"{arm}: its teacher context is not decided yet (issue 36 partial)")
    capability = torch.backends.cpu.get_cpu_capability()
    if out.is_file():
        kept = json.loads(out.read_text())
        same = git(ROOT, "diff", "--quiet", kept["head"], head, "--", *CODE_PATHS)
        if (kept["arm"], kept["keys"], kept["capability"]) == (arm, keys, capability) and (
            same.returncode == 0
        ):
            return kept
    print(f"pipeline check: {arm} seed 0, {CHECK_STEPS} steps at {GRID_COMMIT[:7]} and here")
    with grid_tree() as tree:
        at_grid = first_steps(keys, 0, CHECK_STEPS, RUNS / f"check-{arm}-grid", tree)
    at_head = first_steps(keys, 0, CHECK_STEPS, RUNS / f"check-{arm}-head", ROOT)
    grid_record = record(arm, 0)
    assert grid_record is not None, f"{arm} seed 0 has no record"
    differ = [
        {"step": i + 1, "key": k, "grid": g[k], "head": h[k]}
        for i, (g, h) in enumerate(zip(at_grid, at_head, strict=True))
        for k in CHECK_KEYS
        if g[k] != h[k]
    ]
    on_record_cpu = grid_record["capability"] == capability
    if on_record_cpu:
        recorded = grid_record["reward"][:CHECK_STEPS]
        differ += [
            {"step": i + 1, "key": "reward", "record": r, "head": h["reward"]}
            for i, (r, h) in enumerate(zip(recorded, at_head, strict=True))
            if r != h["reward"]
        ]
    result = {
        "what": "the winner's first steps at the placebo's commit and at the grid's, on one "
        "machine, and against the grid's record where it ran on this CPU class (training "
        "metrics per step; no held-out score)",
        "arm": arm, "keys": keys, "seed": 0, "grid_commit": GRID_COMMIT, "head": head,
        "compared": list(CHECK_KEYS), "at_grid": at_grid, "at_head": at_head,
        "record": grid_record["name"], "record_capability": grid_record["capability"],
        "against_record": on_record_cpu, "differ": differ, "equal": not differ,
        "capability": capability,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_jobs(jobs: list[tuple[str, int]], workers: int, placebo: bool = False) -> None:
    """Each (arm, seed) job through `run`, `workers` at a time."""
    if not jobs:
        return
    # every arm shares the held-out scores before training (cached once, keyed by the config)
    lm_recipe.ensure_before("gate", "lora16_lr5e-4", "grpo")

    def go(job: tuple[str, int]) -> None:
        r = run(*job, placebo=placebo)
        print(f"kept {r['name']} ({r['wall_s'] / 60:.1f} min)", flush=True)

    lm_recipe.in_parallel(go, jobs, workers)


def status(seeds: int) -> None:
    """Which runs exist and the budget spent (no held-out score is read: the rule forbids
    looking before the analysis)."""
    for arm in ARMS:
        done = [s for s in range(seeds) if record(arm, s) is not None]
        print(f"{arm:20s} {len(done):2d}/{seeds}  seeds {done}")
    b = budget(seeds)
    print(
        f"complete rounds {complete_rounds(seeds)}/{seeds}; new runs {b['new_runs']}, "
        f"{b['core_hours_used']:.1f} of {b['core_hours']:.0f} core-hours"
    )
    fits = b["rounds_in_budget"]
    print(
        f"at {b['core_hours_per_run']:.2f} core-hours per run, rounds 0-{fits - 1} fit the "
        f"budget: run `grid --seeds {fits}`"
        + ("" if fits == seeds else f" (round {fits} would end past {b['core_hours']:.0f})")
    )


def budget(seeds: int) -> dict[str, Any]:
    """Core-hours the new runs used: each runs at one thread, so its wall time bounds its core
    time from above (the machine is shared, so this overcounts). A record's wall time is its
    last piece only: every earlier piece (a stopped run, resumed or restarted) is listed in
    DISCARDED with its wall seconds, and counts."""
    store = RecordStore(RECORDS)
    own = [
        store.get(name)
        for name in store.names("*-seed*")
        if not name.startswith(("placebo-", "posthoc-"))
    ]
    used = (sum(r["wall_s"] for r in own) + sum(d["wall_s"] for d in DISCARDED)) / 3600
    # A round starts only if it is projected to end within the budget (the rule's 2026-11-26
    # 15:13 UTC amendment): a round the budget cannot finish adds nothing to the analysis.
    # Each missing run is costed at the mean of the new runs so far, discarded pieces included
    # (a run resuming from a checkpoint is costed in full: the projection errs early).
    jobs = schedule(seeds)
    per_run = used / len(own) if own else BUDGET_CORE_HOURS / max(len(jobs), 1)
    missing = Counter(s for _, s in jobs)
    fits, projected = 0, used
    while fits < seeds and (
        not missing[fits] or projected + missing[fits] * per_run <= BUDGET_CORE_HOURS
    ):
        projected += missing[fits] * per_run
        fits += 1
    return {
        "core_hours": BUDGET_CORE_HOURS,
        "core_hours_used": used,
        "core_hours_per_run": per_run,
        "rounds_in_budget": fits,
        "new_runs": len(own),
        "runs_asked": len(ARMS) * seeds - sum(min(seeds, len(r)) for _, r in REUSED.values()),
        "counted_as": "wall seconds of each new run at one thread (an upper bound)",
        "discarded": DISCARDED,
    }


# ------------------------------------------------------------------------------ analysis


def complete_rounds(seeds: int) -> int:
    """The number of leading seeds 0..n-1 every arm has finished."""
    n = 0
    while n < seeds and all(record(a, n) is not None for a in ARMS):
        n += 1
    return n


def primary(r: dict) -> float:
    return r["after"]["mean_reward"]


def analyse(
    runs: dict[str, list[dict]], gate_runs: list[dict] | None = None, alpha: float = 0.05
) -> dict[str, Any]:
    """The rule's analysis of `runs` (arm -> records of seeds 0..n-1, same n, paired by seed),
    through the analysis `gear compare` shares (`gear.evidence.compare_arms`). The gate reads
    `gate_runs` (every grpo run of the grid's seeds; default the compared ones): it asks
    whether the baseline recipe learns, which does not depend on the rounds compared.

    Returns {"gate", "comparisons" (candidate -> Bonferroni and 95% paired intervals vs the
    baseline, power at EFFECT), "stability", "beats_baseline", "winner"}."""
    from gear.evidence import compare_arms

    shared = compare_arms(
        runs,
        BASELINE,
        alpha=alpha,
        effect=EFFECT,
        gate_runs=gate_runs or runs[BASELINE],
        metric_label="held-out mean reward (8 samples per problem at T=0.7, 200 problems)",
    )
    comparisons = shared["comparisons"]
    beats = [a for a in comparisons if a in shared["beats_baseline"]]  # the arms' order
    winner = None
    if beats:
        best = max(comparisons[a]["bonferroni"]["mean"] for a in beats)
        near = [a for a in beats if comparisons[a]["bonferroni"]["mean"] >= best - 0.01]
        winner = min(near, key=lambda a: seconds_per_step(runs[a]))
    gate = shared["gate"]
    return {
        "gate": gate,
        "comparisons": comparisons,
        "stability": shared["stability"],
        "beats_baseline": beats,
        "winner": winner,
        # the rule's step 5 (only where the gate lets arms be compared)
        "grpo_beats_gear": gate["passed"] and comparisons["gear"]["bonferroni"]["ci"][1] < 0,
        # secondary: each arm's training-reward slope per step (95% over seeds)
        "reward_slope": shared["reward_slope"],
    }


def seconds_per_step(rs: list[dict]) -> float:
    """Median wall seconds per step over the runs (NaN if none was timed). The runs share a
    machine whose load varied, so it only breaks ties, as the rule says."""
    times = [s for r in rs for s in r["step_seconds"] if s is not None]
    return statistics.median(times) if times else float("nan")


def report(seeds: int, out: Path, final: bool = False, figure: Path = FIGURE) -> dict:
    """The rule's analysis over the complete rounds -> `out` (JSON) and `figure`.

    Before all `seeds` rounds are complete it runs only with `final` (the budget ended: the
    rule analyses the last complete round once), so that nobody reads scores mid-grid."""
    import torch

    from gear.evidence import first_commit, mde, paired, power_at

    if seeds != SEEDS:
        raise SystemExit(f"report: --seeds {seeds}; the rule's n is {SEEDS} (a stop is --final)")
    n = complete_rounds(seeds)
    if n < seeds and not final:
        raise SystemExit(
            f"report: {n} of {seeds} rounds complete; the rule analyses only when all are, or "
            "once when the budget ends (report --final)"
        )
    spent = budget(seeds)
    if n < seeds and spent["rounds_in_budget"] > n:
        raise SystemExit(
            f"report --final: the budget still fits round {n}; the rule analyses early only "
            "when the next round cannot finish within it (`status` prints what fits)"
        )
    if n < 2:
        raise SystemExit(f"report: {n} complete rounds; the analysis needs every arm's seeds")
    if out.is_file() and json.loads(out.read_text())["seeds"] != list(range(n)):
        raise SystemExit(
            f"report: {out} already analysed other rounds; the rule analyses once (a rerun "
            "may only add the placebo of the same rounds)"
        )
    runs = {arm: [record(arm, s) for s in range(n)] for arm in ARMS}
    gate_runs = [r for s in range(seeds) if (r := record(BASELINE, s)) is not None]
    alpha = 0.05 / len(CANDIDATES)
    result = {
        "arms": {arm: keys_of(arm) for arm in ARMS},
        "seeds": list(range(n)),
        "seeds_asked": seeds,
        "complete": n >= seeds,
        "steps": runs[BASELINE][0]["config"]["trainer"]["max_steps"],
        "metric": "held-out mean reward: 200 problems x 8 samples at T=0.7 (eval_seed 0)",
        "rule_commit": first_commit(RULE, ROOT),
        "power": {
            "pilot_sd": PILOT_SD,
            "effect": EFFECT,
            "alpha": alpha,
            "n": n,
            "at_pilot_sd": power_at(EFFECT, PILOT_SD, n, alpha),
            "mde_at_pilot_sd": mde(PILOT_SD, n, alpha),
        },
        "budget": spent | {"final": final},
        "paired": "by seed (prompts, sampling, LoRA init)",
        "per_seed": {
            arm: [
                {
                    "seed": r["seed"],
                    "after": primary(r),
                    "greedy": r["after"]["pass@1"],
                    "reused_from": r.get("reused_from"),
                    "resumed": r["resumed"],
                    "commit": r.get("commit"),
                }
                for r in rs
            ]
            for arm, rs in runs.items()
        },
        "resumed": [r["name"] for rs in runs.values() for r in rs if r["resumed"]],
        "before": runs[BASELINE][0]["before"]["mean_reward"],
        "seconds_per_step": {arm: seconds_per_step(rs) for arm, rs in runs.items()},
        "machine": sorted({r["capability"] for rs in runs.values() for r in rs}),
        "torch": torch.__version__,
    }
    result |= analyse(runs, gate_runs)
    winner = result["winner"]
    if winner is not None:
        shams = [placebo_record(winner, s) for s in range(n)]
        keys = placebo_keys(winner)
        result["placebo"] = {"arm": winner, "keys": keys, "runs": sum(r is not None for r in shams)}
        if all(shams):
            d = paired([primary(r) for r in runs[winner]], [primary(r) for r in shams])
            result["placebo"] |= {"paired": d, "passed": d["ci"][0] > 0}
    # rounds seeds 0..n-1 only: the sensitivity analysis on the seeds unseen before the rule
    unseen = [s for s in range(n) if s >= UNSEEN_FROM]
    if len(unseen) >= 2:
        result["sensitivity_unseen_gear_seeds"] = paired(
            [primary(runs["gear"][s]) for s in unseen], [primary(runs[BASELINE][s]) for s in unseen]
        ) | {"seeds": unseen}
    result["decision"] = decision(result)
    if out.is_file() and "post_hoc" in (kept := json.loads(out.read_text())):
        result["post_hoc"] = kept["post_hoc"]  # issue 53's section, beside the rule's
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {out} and {plot(result, figure)}")
    return result


def decision(result: dict) -> str:
    """The rule's step 4, as one sentence."""
    rounds = f"{len(result['seeds'])} of {result['seeds_asked']} rounds"
    if not result["gate"]["passed"]:
        return f"gate failed ({rounds}): no method compared; the default does not change"
    winner = result["winner"]
    if winner is None:
        return f"no candidate beats grpo ({rounds}): gear train keeps the paper's GEAR"
    sham = result.get("placebo", {})
    if "passed" not in sham:
        return f"{winner} beats grpo ({rounds}): its placebo runs next (the rule, step 4)"
    if not sham["passed"]:
        return (
            f"{winner} beats grpo but not its placebo ({rounds}): gear train keeps the paper's GEAR"
        )
    return f"{winner} beats grpo and its placebo ({rounds}): it becomes gear train's default"


def plot(result: dict, path: Path) -> Path:
    """Left: each arm's held-out score after training per seed (lines join a seed's arms), the
    shared before-score dashed. Right: each candidate − grpo, paired by seed: the Bonferroni
    interval (thick), the 95% one (thin), and the effect the rule is powered for (shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["per_seed"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), width_ratios=[1.2, 1])
    for s in result["seeds"]:
        left.plot(range(len(arms)), [result["per_seed"][a][s]["after"] for a in arms],
                  color="grey", lw=0.5, alpha=0.5)  # fmt: skip
    for i, a in enumerate(arms):
        ys = [r["after"] for r in result["per_seed"][a]]
        left.scatter([i] * len(ys), ys, s=14, zorder=3)
        left.plot([i - 0.25, i + 0.25], [statistics.mean(ys)] * 2, color="black", lw=2)
    left.axhline(result["before"], ls="--", color="black", lw=1, label="before training")
    left.set_xticks(range(len(arms)), arms, rotation=25, ha="right", fontsize=8)
    left.set_ylabel("held-out mean reward after training")
    left.set_title(f"SmolLM2-135M, {result['steps']} steps, n = {len(result['seeds'])} seeds")
    left.legend(fontsize=8)
    cands = list(result["comparisons"])
    level = round(100 * (1 - result["power"]["alpha"]), 1)
    right.axvspan(-EFFECT, EFFECT, color="0.92", label=f"|effect| < {EFFECT} (not powered)")
    right.axvline(0, color="black", lw=0.8)
    for i, a in enumerate(cands):
        c = result["comparisons"][a]
        right.plot(c["bonferroni"]["ci"], [i, i], lw=4, color="C0", solid_capstyle="butt",
                   label=f"{level}% (Bonferroni)" if i == 0 else None)  # fmt: skip
        right.plot(c["ci95"], [i, i], lw=1, color="black", label="95%" if i == 0 else None)
        right.scatter([c["bonferroni"]["mean"]], [i], color="black", zorder=3, s=14)
    right.set_yticks(range(len(cands)), cands, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("candidate − grpo, paired by seed")
    right.set_title(result["decision"], fontsize=8, wrap=True)
    right.legend(fontsize=7, loc="upper left")  # the lower rows hold intervals
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(result: dict) -> None:
    print(f"gate: passed={result['gate']['passed']}  seeds {result['seeds']}")
    level = round(100 * (1 - result["power"]["alpha"]), 2)
    print(f"| arm | mean after | − grpo [{level}%] | 95% | power at {EFFECT} | worst seed |")
    print("|---|---|---|---|---|---|")
    for arm, rs in result["per_seed"].items():
        mean = statistics.mean(r["after"] for r in rs)
        c = result["comparisons"].get(arm)
        cells = (
            f"{c['bonferroni']['mean']:+.3f} [{c['bonferroni']['ci'][0]:+.3f}, "
            f"{c['bonferroni']['ci'][1]:+.3f}] | [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] "
            f"| {c['power_at_effect']:.2f}"
            if c
            else "— | — | —"
        )
        worst = result["stability"][arm]
        print(
            f"| {arm} | {mean:.3f} | {cells} | {worst['worst']:.3f} (seed {worst['worst_seed']}) |"
        )
    print(f"decision: {result['decision']}")
    print("\nREADME's lines (from this JSON):\n" + readme_summary(result))


def readme_summary(result: dict) -> str:
    """The few lines README's evidence section opens with, written from the JSON so that no
    number is copied by hand: the gate, each candidate − grpo with both intervals, the power."""
    g = result["gate"]["paired"]
    n = len(result["seeds"])
    level = round(100 * (1 - result["power"]["alpha"]), 1)
    lines = [
        f"- **The learning gate {'passed' if result['gate']['passed'] else 'failed'}** ("
        f"{g['n']} seeds of GRPO): held-out mean reward {result['before']:.3f} before, "
        f"after − before {g['mean']:+.3f} [{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}] (95%).",
    ]
    if not result["gate"]["passed"]:  # the rule compares no method then
        return "\n".join([*lines, f"- **Decision:** {result['decision']}."])
    lines.append(
        f"- **Against GRPO on the same seeds** (n = {n} paired, {level}% Bonferroni intervals; "
        f"power {result['power']['at_pilot_sd']:.2f} at a gain of {EFFECT} with the pilot's SD):"
    )
    for arm, c in result["comparisons"].items():
        b, unstable = c["bonferroni"], result["stability"][arm]["below_before"]
        lines.append(
            f"  - `{arm}` {b['mean']:+.3f} [{b['ci'][0]:+.3f}, {b['ci'][1]:+.3f}]"
            + (f" (seeds {unstable} end below before)" if unstable else "")
        )
    mdes = [c["mde"] for c in result["comparisons"].values()]
    lines.append(
        f"- Detectable at 80% power with these SDs: gains of {min(mdes):.3f}–{max(mdes):.3f} "
        f"(at the pilot's SD: {result['power']['mde_at_pilot_sd']:.3f})."
    )
    if result["grpo_beats_gear"]:
        lines.append("- **GRPO beats the paper's GEAR** here (its interval is below 0).")
    lines.append(f"- **Decision:** {result['decision']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["grid", "status", "report", "placebo", "posthoc"])
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "lm_learning.json")
    ap.add_argument("--final", action="store_true", help="report: the budget ended (the rule)")
    ap.add_argument("--arm", choices=CANDIDATES, help="placebo: the winner whose placebo runs")
    ap.add_argument("--baseline", action="store_true", help="posthoc: rerun GRPO here too")
    ap.add_argument("--dry-run", action="store_true", help="posthoc: print the runs, run none")
    a = ap.parse_args(argv)
    if a.seeds < 2 or a.workers < 1:
        ap.error("--seeds: at least 2; --workers: at least 1")
    if a.stage == "placebo" and a.arm is None:
        ap.error("placebo: --arm, the winner the report named, is required")
    if a.stage == "grid":
        grid(a.seeds, a.workers)
    elif a.stage == "status":
        status(a.seeds)
    elif a.stage == "placebo":
        placebo(a.arm, a.seeds, a.workers)
    elif a.stage == "posthoc":
        posthoc(a.out, a.workers, a.baseline, a.dry_run)
    else:
        report(a.seeds, a.out, a.final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

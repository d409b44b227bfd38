"""Headroom (issue 58): can any credit assignment speed learning on a real LM here? The rule,
fixed before any run: docs/evidence/2026-11-28-headroom-rule.md. Run from the repository root;
every stage resumes where it stopped.

    python -m studies.headroom checkpoint          # issue 51's seed-0 SFT checkpoint, rebuilt
    python -m studies.headroom lr --lr 1e-4        # amendment 1: GRPO at each candidate rate
    python -m studies.headroom lr --lr 3e-5
    python -m studies.headroom choose-lr           # the rate every arm uses, from GRPO's gain
    python -m studies.headroom pilot --arm grpo    # the pilot, one process per arm (resumable)
    python -m studies.headroom pilot --arm oracle
    python -m studies.headroom plan                # n from the pilot, by the rule's formula
    python -m studies.headroom study --arm grpo    # stage A (then stage B: --arm lead / gear)
    python -m studies.headroom report              # -> studies/results/headroom.json
    python -m studies.headroom restore             # a new session: the committed checkpoint and
                                                   # finished runs back under runs/headroom/
    python -m studies.headroom status

The checkpoint is issue 51's stage 0 (`studies.after_format`: LoRA SFT on chain worked solutions)
retrained to its recorded chosen step. Its checks change nothing that training reads (no dropout,
a fixed data order; `check` reseeds only the sampler), so training straight to that step gives
the same weights on the same CPU class; the step's check is run again and recorded beside the
original. The adapter (base + LoRA, `gear train --model runs/headroom/sft-seed0`) and its content
hash go to runs/headroom/ (not committed) and studies/results/headroom_runs/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gear.app.compare import GATE_MIN_SEEDS, GATE_TREND, read_rule, run_name, run_record
from gear.evidence import RecordStore, head_commit
from gear.models import content_hash

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "studies" / "results"
RECORDS = RESULTS / "headroom_runs"
RUNS = ROOT / "runs" / "headroom"
RULE = "docs/evidence/2026-11-28-headroom-rule.md"
OUT = RESULTS / "headroom.json"
COPIES = RESULTS / "headroom"  # the studies' rule.json / compare.* as gear compare wrote them
PILOT, PILOT2, STUDY = RUNS / "pilot", RUNS / "pilot2", RUNS / "study"  # pilot2: amendment 1

# ------------------------------------------------------------------------------ the rule's numbers
RECIPE = [
    "--task", "arithmetic", "--set", "task_options={mix: 'chain:1'}",
    "--set", "max_completion_length=96", "--set", "eval_max_new_tokens=96", "--set", "bf16=false",
]  # fmt: skip
# Amendment 2: the held-out set pinned to the rule's (gear train's shipped evaluation may change
# under issue 61), and TRL's loss pass sharing each group's prompt (equal to float rounding)
AMENDMENT_2 = [
    "--set", "eval_n=200", "--set", "eval_samples=8", "--set", "eval_seed=0",
    "--set", "loss_prefix_sharing=true",
]  # fmt: skip
# Amendment 3: the recipe file frozen (gear train's default.yaml as of 2026-11-29), so a later
# change to the shipped recipe cannot reach the study's runs or change its rule between sessions
FROZEN_RECIPE = ROOT / "studies" / "headroom_recipe.yaml"
AMENDMENT_3 = ["--config", str(FROZEN_RECIPE.relative_to(ROOT))]
SHARP = "credit_modulation=exp,credit_beta=5,credit_w_min=0,credit_w_max=100"
ARMS = {  # name -> gear compare's --methods value
    "grpo": "grpo",
    "oracle": f"oracle=first_error@{SHARP}",
    "lead": "lead=gear_token@kl_estimator=k1",
    "gear": "gear",
}
STAGE_A, STAGE_B = ("grpo", "oracle"), ("lead", "gear")
PILOT_SEEDS = (100, 101, 102)
EFFECT, ALPHA, BUDGET, STAGE_B_COST = 0.05, 0.05, 24.0, 4.2
LONGER_IF_GRPO_GAINS_BELOW = 0.02  # the pilot's GRPO mean gain under which steps double
# Amendment 1 (the rule's end): GRPO alone, seed 200, at each candidate rate; the larger held-out
# gain picks every arm's rate (ties: the larger rate), and the pilot runs again at it (`pilot2`).
RULE_LR, LR_CANDIDATES, LR_SEED = 5e-4, (1e-4, 3e-5), 200


def records() -> RecordStore:
    return RecordStore(RECORDS)


def checkpoint_record(seed: int = 0) -> dict[str, Any] | None:
    """The checkpoint's record: checked, or else saved and hashed with its check pending."""
    return records().get(f"checkpoint-seed{seed}") or records().get(
        f"checkpoint-pending-seed{seed}"
    )


def lr_dir(lr: float) -> Path:
    return RUNS / f"lr{lr:g}"


def learning_rate() -> float:
    """Every arm's rate: amendment 1's choice once made, else the rule's 5e-4."""
    chosen = records().get("lr")
    return chosen["chosen"] if chosen else RULE_LR


def pilot_dir() -> Path:
    """The pilot `plan` reads: at the chosen rate (`pilot2`) once amendment 1 chose one. The
    rule's 32-step clause also re-ran the pilot at 32 steps; amendment 3 dropped that re-run
    (whatever it showed, n stays 3), so `pilot2` stays the pilot once the clause fired."""
    return PILOT2 if records().get("lr") else PILOT


def studies() -> list[tuple[str, Path]]:
    """Every study directory, in the order they ran: reported, kept and restored alike."""
    return [("pilot", PILOT), *((p.name, p) for p in map(lr_dir, LR_CANDIDATES)),
            ("pilot2", PILOT2), ("study", STUDY)]  # fmt: skip


def checkpoint_dir(seed: int = 0) -> Path:
    return RUNS / f"sft-seed{seed}"


def checkpoint(seed: int = 0) -> dict[str, Any]:
    """Rebuild `seed`'s stage-0 checkpoint of issue 51 at its recorded chosen step (the SFT loop
    of `after_format.sft`, without the intermediate checks), check it with the rule's check, and
    save it as a PEFT adapter directory with its tokenizer. Kept as `checkpoint-seed<seed>`."""
    from studies import after_format as af

    key = f"checkpoint-seed{seed}"
    kept = records().get(key)
    if kept is not None:
        return kept
    original = af.sft_record(seed)
    if original["chosen"] is None:
        raise SystemExit(f"issue 51's seed {seed} has no chosen SFT step")
    step = original["chosen"]["step"]
    recorded = next(c for c in original["checks"] if c["step"] == step)
    out = checkpoint_dir(seed)
    if (out / "adapter_model.safetensors").is_file():
        return checked(seed, step, recorded, original)
    t0, commit = time.time(), head_commit(ROOT)
    model, tok, losses = af.train_sft(seed, step, log=lambda m: print(m, flush=True))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    records().put(f"training-seed{seed}", {"loss": losses, "wall_s": time.time() - t0,
                                           "commit": commit, "threads": torch.get_num_threads()})  # fmt: skip
    check = af.check(model, tok)
    record = {
        "seed": seed,
        "step": step,
        "path": str(out.relative_to(ROOT)),
        "sha256": content_hash(out),
        "check": check,
        "recorded_check": recorded,
        "loss": losses,
        "original_loss": original.get("loss", [])[:step],
        "wall_s": time.time() - t0,
        "commit": commit,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "rule": RULE,
    }
    records().put(key, record)
    print(
        f"seed {seed}: checkpoint at SFT step {step}: pass rate {check['pass_rate']:.4f} "
        f"(issue 51: {recorded['pass_rate']:.4f}), writes its steps {check['writes_steps']:.4f}, "
        f"sha256 {record['sha256'][:12]}",
        flush=True,
    )
    return record


# ------------------------------------------------------------------------------ runs
def steps() -> int:
    """16, or 32 where the rule's one recipe change was made (the `longer` record)."""
    return 32 if records().get("longer") else 16


def compare_command(
    out: Path, arms: tuple[str, ...], seeds: list[int], only: str, lr: float = RULE_LR
) -> list[str]:
    rate = [] if lr == RULE_LR else ["--set", f"learning_rate={lr:g}"]  # the first pilot's command
    amended = (
        [*AMENDMENT_3, *AMENDMENT_2]
        if out not in (PILOT, PILOT2, *map(lr_dir, LR_CANDIDATES))
        else []
    )
    return [
        sys.executable, "-m", "gear.app.cli", "compare",
        "--model", str(checkpoint_dir(0).relative_to(ROOT)), *RECIPE, *rate, *amended,
        "--steps", str(steps()), *(x for a in arms for x in ("--methods", ARMS[a])),
        *(x for s in seeds for x in ("--seeds", str(s))), "--effect", str(EFFECT),
        "--out", str(out.relative_to(ROOT)), "--only", only,
    ]  # fmt: skip


def launch(
    out: Path, arms: tuple[str, ...], seeds: list[int], only: str, threads: int,
    lr: float = RULE_LR,
) -> None:  # fmt: skip
    """One `gear compare` process training arm `only` of the study in `out` (one thread by
    default: two processes share two cores), logged to runs/headroom/<study>-<arm>.log; each
    piece (start, end, wall seconds, exit code, commit, CPU) is kept in the records."""
    if not (checkpoint_dir(0) / "adapter_config.json").is_file():
        raise SystemExit("the checkpoint first: python -m studies.headroom checkpoint")
    cmd = compare_command(out, arms, seeds, only, lr)
    run_piece(cmd, out, only, threads, RUNS / f"{out.name}-{only}.log", records())


def run_piece(
    cmd: list[str], out: Path, only: str, threads: int, log: Path, store: RecordStore,
    seeds: list[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the `gear compare` command `cmd` (training arm `only` of the study in `out`, only its
    `seeds` where given) at `threads` threads, logged to `log`; the piece (start, end, wall
    seconds, exit code, commit, CPU, seeds, the runs it resumes) is kept in `store` while it runs
    and when it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           # large blocks (an evaluation's KV cache) go back to the system when freed: two runs
           # held ~10 GB each without it, and the OOM killer took one (computes nothing else)
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    piece = {"study": out.name, "arm": only, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
             "commit": head_commit(ROOT), "threads": threads,
             "capability": torch.backends.cpu.get_cpu_capability(), "command": cmd[2:]}  # fmt: skip
    # runs this piece continues (begun by an earlier, stopped piece): listed as resumed
    # (only this piece's seeds: another process may be running the arm's other seeds)
    mine = None if seeds is None else {run_name(only, s) for s in seeds}
    piece["resumes"] = sorted(
        d.name
        for d in out.glob(f"{only}-seed*")
        if (d / "config.yaml").is_file() and run_record(d) is None
        and (mine is None or d.name in mine)
    )  # fmt: skip
    t0 = time.time()
    # two pieces of one arm, each of its own seeds, may start in the same second
    tag = "" if seeds is None else f"s{'-'.join(map(str, seeds))}-"
    piece["id"] = f"{out.name}-{only}-{tag}{int(t0)}"
    if seeds is not None:
        piece["seeds"] = list(seeds)
    put_piece(piece, store)  # kept while it runs: a piece killed with the session is still listed
    with log.open("a") as fh:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    piece |= {"wall_s": time.time() - t0, "exit": rc}
    put_piece(piece, store)
    print(f"{out.name} {only}: exit {rc} after {piece['wall_s']:.0f} s (log {log})", flush=True)
    return piece


def put_piece(piece: dict[str, Any], store: RecordStore | None = None) -> None:
    """Add or update (by its id) one piece in the records (`store`, default this study's)."""
    store = store or records()
    pieces = [p for p in store.get("pieces") or [] if p.get("id") != piece["id"]]
    store.put("pieces", [*pieces, piece])


def finished(out: Path, store: RecordStore | None = None) -> dict[str, dict[int, dict[str, Any]]]:
    """Arm -> seed -> the run's record (`gear.app.compare.run_record`, with its summary's CPU
    capability, wall seconds and model identity) for every finished run in `out`; `store`:
    the records that list the study's pieces (default this study's)."""
    from gear.app import compare as study

    rule = study.read_rule(out)
    if rule is None:
        return {}
    resumed = {
        name
        for p in (store or records()).get("pieces") or []
        if p.get("study") == out.name
        for name in p.get("resumes", [])
    }
    out_runs: dict[str, dict[int, dict[str, Any]]] = {}
    for arm in rule["arms"]:
        for seed in rule["seeds"]:
            run_dir = out / study.run_name(arm, seed)
            r = study.run_record(run_dir)
            if r is None:
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            r |= {"precision": summary.get("precision"),
                  "train_seconds": summary.get("train_seconds"),
                  "model_identity": summary.get("model_identity"),
                  "resumed": run_dir.name in resumed}  # fmt: skip
            out_runs.setdefault(arm, {})[seed] = r
    return out_runs


def metric(r: dict[str, Any], when: str = "after") -> float:
    return float(r[when]["mean_reward"])


def core_hours() -> float:
    """Core-hours so far: every piece's wall seconds × its threads, and the checkpoint's."""
    ck = checkpoint_record(0) or {}
    total = ck.get("wall_s", 0.0) * ck.get("threads", 1)
    for p in records().get("pieces") or []:
        total += p.get("wall_s", 0.0) * p.get("threads", 1)
    return total / 3600


def min_detectable(sd: float, n: int) -> float | None:
    """`gear.evidence.mde` at `ALPHA` and 80% power, rounded up to the 0.001 grid the plan
    recorded (the smallest such effect, up to 2); None if none is (or n < 2, or SD 0)."""
    from gear.evidence import mde

    m = mde(sd, n, ALPHA)  # NaN for fewer than 2 pairs or no spread
    e = math.ceil(m * 1000) / 1000 if math.isfinite(m) else math.inf
    return e if e <= 2 else None


def plan() -> dict[str, Any]:
    """The rule's n from the finished pilot: n80 at +0.05 from the pilot's paired SD, the
    budget's cap, n, the MDE at n, and the 32-step clause on GRPO's gain. Kept as `plan`."""
    from gear.evidence import n_for_power, paired

    pilot = pilot_dir()
    runs = finished(pilot)
    pairs = [s for s in PILOT_SEEDS if s in runs.get("grpo", {}) and s in runs.get("oracle", {})]
    if len(pairs) < len(PILOT_SEEDS):
        raise SystemExit(f"the pilot has {len(pairs)} of {len(PILOT_SEEDS)} pairs finished")
    grpo = [runs["grpo"][s] for s in pairs]
    oracle = [runs["oracle"][s] for s in pairs]
    diff = paired([metric(r) for r in oracle], [metric(r) for r in grpo])
    gain = paired([metric(r) for r in grpo], [metric(r, "before") for r in grpo])
    # a run's core-hours: the pilot's pieces (wall x threads) over its runs
    pieces = [p for p in records().get("pieces") or [] if p.get("study") == pilot.name]
    per_run = sum(p["wall_s"] * p["threads"] for p in pieces) / len(grpo + oracle) / 3600
    used = core_hours()
    n80 = n_for_power(EFFECT, diff["sd"], alpha=ALPHA) if diff["sd"] > 0 else 3
    cap = math.floor((BUDGET - used) / (STAGE_B_COST * per_run))
    n = max(3, min(n80 or 10**6, cap))
    mde = min_detectable(diff["sd"], n)
    out = {"pilot": pilot.name, "learning_rate": learning_rate(), "pilot_seeds": pairs,
           "oracle_minus_grpo": diff, "grpo_gain": gain, "core_hours_per_run": per_run,
           "used_core_hours": used, "n80": n80, "n_cap": cap,
           "n": n, "mde_at_n": mde, "longer": gain["mean"] < LONGER_IF_GRPO_GAINS_BELOW,
           "steps": steps()}  # fmt: skip
    records().put("plan", out)
    if out["longer"] and steps() == 16:  # the rule's one recipe change, made once
        records().put("longer", {"pilot": pilot.name, "grpo_gain": gain,
                                 "threshold": LONGER_IF_GRPO_GAINS_BELOW,
                                 "made": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
        out["next"] = ("the 32-step clause fired: every run trains 32 steps from now on; plan "
                       "again, then stage A (amendment 3: the pilot is not re-run)")  # fmt: skip
    return out


def choose_lr() -> dict[str, Any]:
    """Amendment 1: GRPO's held-out gain (after - before, seed `LR_SEED`) at each candidate rate;
    the larger gain is every arm's rate (ties: the larger rate). Reads GRPO only. Kept as `lr`."""
    out = rate_by_grpo_gain(LR_CANDIDATES, LR_SEED, lambda lr: finished(lr_dir(lr)))
    out["learns"] = out["chosen_gain"] > 0
    records().put("lr", out)
    return out


def rate_by_grpo_gain(candidates: tuple[float, ...], seed: int, runs_at: Any) -> dict[str, Any]:
    """GRPO's held-out gain (after - before) of seed `seed` at each candidate rate (`runs_at(lr)`:
    that rate's study's finished runs, as `finished` gives them), and the rate with the larger
    gain (ties: the larger rate)."""
    gains = {}
    for lr in candidates:
        r = runs_at(lr).get("grpo", {}).get(seed)
        if r is None:
            raise SystemExit(f"learning rate {lr:g}: GRPO seed {seed} has not finished")
        gains[lr] = metric(r) - metric(r, "before")
    chosen, gain = max(gains.items(), key=lambda kv: (kv[1], kv[0]))
    return {"seed": seed, "gain": {f"{lr:g}": g for lr, g in gains.items()},
            "chosen": chosen, "chosen_gain": gain}  # fmt: skip


def fits_stage_b(n: int) -> dict[str, Any]:
    """The rule: stage B runs only if the budget then allows its 2n runs. Decided once, when
    stage A is complete (kept as `stage_b_budget`): its 2n runs at stage A's measured
    core-hours per run, +5% for the teacher pass, against what is left of the budget."""
    kept = records().get("stage_b_budget")
    if kept is not None:
        return kept
    pieces = [p for p in records().get("pieces") or [] if p.get("study") == STUDY.name]
    per_run = sum(p.get("wall_s", 0.0) * p.get("threads", 1) for p in pieces) / (2 * n) / 3600
    needs, left = 2 * n * per_run * STAGE_B_COST / 4, BUDGET - core_hours()
    out = {"n": n, "core_hours_per_run": per_run, "needs": needs, "left": left,
           "fits": needs <= left, "made": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    records().put("stage_b_budget", out)
    return out


def bootstrap_share(x: list[float], oracle: list[float], seed: int = 0, n: int = 2000) -> dict:
    """mean(x) / mean(oracle) over seeds (each a difference to grpo, paired by seed) and its
    paired bootstrap 95% interval (seeds resampled together; resamples whose oracle mean is 0
    are dropped and counted)."""
    import random

    rng = random.Random(seed)
    k, shares, dropped = len(x), [], 0
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        den = sum(oracle[i] for i in idx)
        if den == 0:
            dropped += 1
            continue
        shares.append(sum(x[i] for i in idx) / den)
    shares.sort()
    den = sum(oracle)
    point = sum(x) / den if den else None
    ci = (
        [shares[int(0.025 * len(shares))], shares[int(0.975 * len(shares)) - 1]] if shares else None
    )
    return {"share": point, "ci95": ci, "resamples": n, "dropped": dropped}


def stage_a(
    runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int], gate_trend: str = GATE_TREND
) -> dict[str, Any]:
    """The gate (gear compare's, on grpo, with the study rule's trend check) and headroom:
    oracle - grpo at 95%."""
    from gear.evidence import compare_arms, paired

    both = [s for s in seeds if s in runs.get("grpo", {}) and s in runs.get("oracle", {})]
    analysis = compare_arms(
        {a: [runs[a][s] | {"seed": s} for s in both] for a in STAGE_A},
        "grpo",
        metric="mean_reward",
        secondary="pass@1",
        alpha=ALPHA,
        effect=EFFECT,
        gate_min_seeds=GATE_MIN_SEEDS,  # gear compare's gate, as the rule says
        gate_trend=gate_trend,
    )
    diff = paired(
        [metric(runs["oracle"][s]) for s in both], [metric(runs["grpo"][s]) for s in both]
    )
    headroom = analysis["gate"]["passed"] and len(both) >= 2 and diff["ci"][0] > 0
    # amendment 3: the MDE at n from the pilot's SD (the rule's, in `plan`) and, descriptive
    # only, from stage A's own SD (an SD from 3 pairs is itself noisy)
    own = min_detectable(diff["sd"], len(both)) if len(both) >= 2 and diff["sd"] > 0 else None
    return {"seeds": both, "missing": sorted(set(seeds) - set(both)), "gate": analysis["gate"],
            "oracle_minus_grpo": diff, "headroom": bool(headroom),
            "mde_at_own_sd_descriptive": own}  # fmt: skip


def stage_b(
    runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int],
    arms: tuple[str, ...] | list[str] = STAGE_B, family: int = len(STAGE_B),
) -> dict[str, Any]:  # fmt: skip
    """Each of `arms` (default lead and gear) - grpo at Bonferroni over `family` comparisons
    (default two: 97.5%), and its share of the oracle's gain with a paired bootstrap interval
    (issue 67's study passes the arms that ran, of a family of three)."""
    from gear.evidence import bonferroni, paired

    level = bonferroni(family, ALPHA)
    out: dict[str, Any] = {"level": level}
    for arm in arms:
        both = [s for s in seeds if all(s in runs.get(a, {}) for a in ("grpo", "oracle", arm))]
        if len(both) < 2:
            out[arm] = {"seeds": both, "missing": sorted(set(seeds) - set(both))}
            continue
        x = [metric(runs[arm][s]) - metric(runs["grpo"][s]) for s in both]
        o = [metric(runs["oracle"][s]) - metric(runs["grpo"][s]) for s in both]
        diff = paired([metric(runs[arm][s]) for s in both], [metric(runs["grpo"][s]) for s in both],
                      level)  # fmt: skip
        out[arm] = {"seeds": both, "missing": sorted(set(seeds) - set(both)),
                    f"{arm}_minus_grpo": diff, "wins": diff["ci"][0] > 0,
                    "share_of_oracle_gain": bootstrap_share(x, o)}  # fmt: skip
    return out


def report() -> dict[str, Any]:
    """studies/results/headroom.json from what has run: the checkpoint, the pilot and its plan,
    stage A (gate, headroom), stage B or the rule's stop, every run and piece, the budget; the
    studies' rule.json and compare.* are copied into studies/results/headroom/."""
    saved = COPIES / "sft-seed0"  # committed: later sessions start from these very weights
    if (checkpoint_dir(0) / "adapter_model.safetensors").is_file() and not saved.is_dir():
        shutil.copytree(checkpoint_dir(0), saved, ignore=shutil.ignore_patterns("README.md"))
    out: dict[str, Any] = {"rule": RULE, "checkpoint": checkpoint_record(0),
                           "lr": records().get("lr"), "plan": records().get("plan"),
                           "longer": records().get("longer")}  # fmt: skip
    for name, path in studies():
        runs = finished(path)
        out[f"{name}_runs"] = {
            a: {str(s): {k: r.get(k) for k in ("before", "after", "precision", "train_seconds",
                                               "model_identity", "resumed", "rule_sha256")}
                for s, r in rs.items()}
            for a, rs in runs.items()
        }  # fmt: skip
        keep(path, COPIES / name, runs)
    plan_ = out["plan"]
    if plan_ is not None:
        seeds = list(range(plan_["n"]))
        runs = finished(STUDY)
        rule = read_rule(STUDY) or {}
        a = stage_a(runs, seeds, rule.get("gate_trend", GATE_TREND))
        out["stage_a"] = a
        complete = not a["missing"]
        if complete and not a["headroom"]:
            out["stop"] = ("the gate failed: GRPO does not learn here" if not a["gate"]["passed"]
                           else "no headroom: the rule stops after stage A")  # fmt: skip
        elif complete:
            out["stage_b_budget"] = fits_stage_b(len(seeds))
            if out["stage_b_budget"]["fits"]:
                out["stage_b"] = stage_b(runs, seeds)
            else:
                out["stop"] = ("headroom, but stage B's runs do not fit the 24 core-hours: the "
                               "rule runs it only if the budget allows")  # fmt: skip
    out["pieces"] = records().get("pieces") or []
    out["core_hours"] = {"used": round(core_hours(), 2), "limit": BUDGET}
    out["capability"] = torch.backends.cpu.get_cpu_capability()
    from gear.evidence import write_json

    write_json(OUT, out)
    return out


def checked(seed: int, step: int, recorded: dict, original: dict) -> dict[str, Any]:
    """The record of a checkpoint saved by a piece that stopped before its check (issue 58's
    first piece was killed by the OOM killer while checking): the saved adapter, merged, is
    checked now; its training is read from the piece's record or, failing that, its log."""
    from gear.models import load_model_and_tokenizer
    from studies import after_format as af

    out = checkpoint_dir(seed)
    training = records().get(f"training-seed{seed}")
    pending = records().get(f"checkpoint-pending-seed{seed}")
    if training is None and pending is not None:  # saved and hashed in an earlier session
        training = pending["training"] | {"loss": pending["loss"]}
    if training is None:  # the first piece logged its losses only
        log = (RUNS.parent / "headroom-checkpoint.log").read_text().splitlines()
        losses = [float(x.rsplit("loss ", 1)[1]) for x in log if f"seed {seed}: SFT step" in x]
        training = {"loss": losses, "wall_s_approx": 2000, "commit": "bea89be", "threads": 1,
                    "stopped": "killed by the OOM killer during its check, after saving the "
                    "adapter (16:37 UTC); losses read from its log (4 decimals)"}  # fmt: skip
    t0 = time.time()
    model, tok = load_model_and_tokenizer(str(out), dtype=torch.float32)
    check = af.check(model, tok)
    record = {
        "seed": seed, "step": step, "path": str(out.relative_to(ROOT)),
        "sha256": content_hash(out), "check": check, "recorded_check": recorded,
        "loss": training["loss"], "original_loss": original.get("loss", [])[:step],
        "training": training, "check_wall_s": time.time() - t0, "commit": head_commit(ROOT),
        "capability": torch.backends.cpu.get_cpu_capability(), "rule": RULE,
        "wall_s": training.get("wall_s", training.get("wall_s_approx", 0)) + time.time() - t0,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    records().put(f"checkpoint-seed{seed}", record)
    print(f"seed {seed}: checkpoint at SFT step {step}: pass rate {check['pass_rate']:.4f} "
          f"(issue 51: {recorded['pass_rate']:.4f}), sha256 {record['sha256'][:12]}", flush=True)  # fmt: skip
    return record


RUN_FILES = ("summary.json", "metrics.jsonl", "rule.sha256", "config.yaml")


def keep(study_dir: Path, copy: Path, runs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Copy a study's rule and report (gear compare's rule.json, compare.*) and each finished
    run's record files (`RUN_FILES`, no checkpoints) into `copy`, which is committed: the run
    directories are not, and `restore` puts these back so that `gear compare` skips those runs
    in a later session."""
    from gear.app import compare as study

    copy.mkdir(parents=True, exist_ok=True)
    for f in ("rule.json", "compare.json", "compare.md", "compare.png"):
        if (study_dir / f).is_file():
            shutil.copyfile(study_dir / f, copy / f)
    for arm, by_seed in runs.items():
        for seed in by_seed:
            name = study.run_name(arm, seed)
            (copy / name).mkdir(exist_ok=True)
            for f in RUN_FILES:
                if (study_dir / name / f).is_file():
                    shutil.copyfile(study_dir / name / f, copy / name / f)


def restore() -> list[str]:
    """Put the committed checkpoint and finished runs back under runs/headroom/ (a new session's
    work tree has none): the checkpoint's hash is checked against its record."""
    done = []
    ck = checkpoint_record(0)
    saved = COPIES / "sft-seed0"
    if not (checkpoint_dir(0) / "adapter_model.safetensors").is_file() and saved.is_dir():
        shutil.copytree(saved, checkpoint_dir(0), dirs_exist_ok=True)
        done.append(str(checkpoint_dir(0)))
    if ck and content_hash(checkpoint_dir(0)) != ck["sha256"]:
        raise SystemExit(f"{checkpoint_dir(0)}: its weights are not the recorded checkpoint's")
    for name, path in studies():
        done += restore_runs(COPIES / name, path)
    return done


def restore_runs(copy: Path, path: Path) -> list[str]:
    """Put a study's kept rule and finished runs (`keep`'s `copy`) back into `path` where
    missing, so `gear compare` skips those runs; returns the runs put back."""
    done: list[str] = []
    if not (copy / "rule.json").is_file():
        return done
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "rule.json").is_file():
        shutil.copyfile(copy / "rule.json", path / "rule.json")
    for run in sorted(p for p in copy.glob("*-seed*") if p.is_dir()):
        if not (path / run.name / "summary.json").is_file():
            shutil.copytree(run, path / run.name, dirs_exist_ok=True)
            done.append(str(path / run.name))
    return done


def status() -> None:
    for name in records().names("checkpoint-seed*"):
        r = records().get(name)
        print(f"{name}: step {r['step']}, pass rate {r['check']['pass_rate']:.4f}, {r['sha256']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "stage",
        choices=[
            "checkpoint",
            "lr",
            "choose-lr",
            "pilot",
            "plan",
            "study",
            "report",
            "restore",
            "status",
        ],
    )
    ap.add_argument("--seed", type=int, default=0, help="checkpoint: the SFT seed")
    ap.add_argument("--arm", choices=sorted(ARMS), help="pilot/study: the arm this process trains")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, choices=LR_CANDIDATES, help="lr: the candidate rate")
    a = ap.parse_args(argv)
    if a.stage == "checkpoint":
        checkpoint(a.seed)
    elif a.stage == "lr":
        if a.lr is None:
            raise SystemExit(f"lr: --lr, one of {', '.join(f'{x:g}' for x in LR_CANDIDATES)}")
        launch(lr_dir(a.lr), STAGE_A, [LR_SEED], "grpo", a.threads, a.lr)  # gear compare: 2+ arms
    elif a.stage == "choose-lr":
        print(json.dumps(choose_lr(), indent=1))
    elif a.stage == "pilot":
        lr = learning_rate()
        launch(pilot_dir(), STAGE_A, list(PILOT_SEEDS), a.arm or "grpo", a.threads, lr)
    elif a.stage == "plan":
        print(json.dumps(plan(), indent=1))
    elif a.stage == "study":
        kept = records().get("plan")
        if kept is None or kept["pilot"] != pilot_dir().name:
            raise SystemExit(
                f"the plan from {pilot_dir().name} first: python -m studies.headroom plan"
            )
        budget = records().get("stage_b_budget")
        if a.arm in STAGE_B and not (budget or {}).get("fits"):
            raise SystemExit(
                f"{a.arm} is stage B's: it runs after stage A shows headroom and only "
                "if its runs fit the budget (report decides; stage_b_budget)"
            )
        launch(STUDY, (*STAGE_A, *STAGE_B), list(range(kept["n"])), a.arm or "grpo", a.threads,
               learning_rate())  # fmt: skip
    elif a.stage == "restore":
        print("\n".join(restore()) or "nothing to restore")
    elif a.stage == "report":
        print(json.dumps(report(), indent=1)[:4000])
    else:
        status()


if __name__ == "__main__":
    main()

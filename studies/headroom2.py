"""Headroom, take 2 (issue 67, item 4): where GRPO's own credit is weak, can the checker's
blame, or any other credit method, beat GRPO on the real LM? The rule, fixed before any of its
runs: docs/evidence/2026-12-02-headroom2-rule.md. Run from the repository root; every stage
resumes where it stopped; `gear compare` trains every run (`gear train`, the path users run).

    python -m studies.headroom2 regime           # the regime, chosen by the rule's code, kept
    python -m studies.headroom2 lr --lr 1e-4     # the rate, chosen on GRPO alone (seed 200)
    python -m studies.headroom2 lr --lr 3e-4
    python -m studies.headroom2 choose-lr        # the larger held-out gain: every arm's rate
    python -m studies.headroom2 pilot --arm grpo # the pilot, one process per arm (seeds 100-102)
    python -m studies.headroom2 pilot --arm oracle
    python -m studies.headroom2 plan             # n from the finished pilot (kept once)
    python -m studies.headroom2 study --arm grpo # stage A, one process per arm (grpo, oracle,
    python -m studies.headroom2 study --arm oracle #  placebo); stage B's arms only once stage A
    python -m studies.headroom2 study --arm placebo # shows headroom and the budget fits them
    python -m studies.headroom2 study --arm placebo --seed 1  # one seed only (repeatable): two
                                                   #  processes can share an arm
    python -m studies.headroom2 report           # studies/results/headroom2.json, from what ran
    python -m studies.headroom2 keep             # finished runs' records -> studies/results/
    python -m studies.headroom2 restore          # a new session: them and the adapter back
    python -m studies.headroom2 status

The plan, stage A and stage B follow the rule and reuse `studies.headroom`'s pieces (the run
records, the MDE on the plan's grid, the bootstrap share); they were written after the pilot
began and before any of its numbers were read, as the module said they would be.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gear.evidence import RecordStore
from gear.models import content_hash
from studies import headroom

ROOT = Path(__file__).resolve().parent.parent
RULE = "docs/evidence/2026-12-02-headroom2-rule.md"
RECORDS = ROOT / "studies" / "results" / "headroom2_runs"
RUNS = ROOT / "runs" / "headroom2"
RECIPE_FILE = ROOT / "studies" / "headroom2_recipe.yaml"  # frozen: the rule's recipe
COPIES = ROOT / "studies" / "results" / "headroom2"  # what is committed of the runs
SHARP = "credit_modulation=exp,credit_beta=5,credit_w_min=0,credit_w_max=100"
ARMS = {  # name -> gear compare's --methods value
    "grpo": "grpo",
    "oracle": f"oracle=first_error@{SHARP}",
    "placebo": f"placebo=random_shape@credit_shape_method=first_error,{SHARP}",
    "lambda_grpo": "lambda_grpo",
    "lead": "lead=gear_token@kl_estimator=k1",
    "gear": "gear",
}
PILOT_ARMS, STAGE_A, STAGE_B = ("grpo", "oracle"), ("grpo", "oracle", "placebo"), (
    "lambda_grpo", "lead", "gear")  # fmt: skip
LR_CANDIDATES, LR_SEED, PILOT_SEEDS = (1e-4, 3e-4), 200, (100, 101, 102)
EFFECT, ALPHA, BUDGET = 0.05, 0.05, 24.0
STUDY = RUNS / "study"
RUNS_PER_SEED = 6.3  # stage A's 3 runs a seed + stage B's 3 at up to +10% (the rule's n_cap)
TEACHER_ARMS, TEACHER_COST = ("lead", "gear"), 1.1  # a teacher pass: up to 10% more a run


def records() -> RecordStore:
    return RecordStore(RECORDS)


def regime() -> dict[str, Any]:
    """The rule's regime (`studies.implicit_credit.choose_regime`), chosen once and kept, with
    its starting model and temperature."""
    from studies import implicit_credit as ic

    kept = records().get("regime")
    if kept is None:
        data = ic.kept()
        missing = [n for n in ic.CANDIDATES if n not in data["regimes"]]
        if missing:
            raise SystemExit(f"measure {missing} first: python -m studies.implicit_credit measure")
        kept = ic.choose_regime(data)
        name, _, temperature = ic.REGIMES[kept["regime"]]
        model = str(Path(ic.model_path(name)).relative_to(ROOT))
        kept |= {"model": model, "temperature": temperature,
                 "numbers": data["regimes"][kept["regime"]]}  # fmt: skip
        records().put("regime", kept)
    return kept


def model_dir() -> Path:
    return ROOT / regime()["model"]


def saved_model() -> Path:
    """Where the starting adapter is committed (a new session's runs/ has none)."""
    return COPIES / model_dir().name


def model_record() -> dict[str, Any]:
    """The starting model's content hash, recorded once (every run records its own too); the
    adapter is committed beside the records and put back under runs/ where missing."""
    path = model_dir()
    if not (path / "adapter_model.safetensors").is_file() and saved_model().is_dir():
        shutil.copytree(saved_model(), path, dirs_exist_ok=True)
    kept = records().get("model")
    if kept is None:
        if not (path / "adapter_model.safetensors").is_file():
            raise SystemExit(f"{path}: missing; python -m studies.implicit_credit measure "
                             f"--regime {regime()['regime']} rebuilds it")  # fmt: skip
        kept = {"path": str(path.relative_to(ROOT)), "sha256": content_hash(path)}
        records().put("model", kept)
        shutil.copytree(path, saved_model(), dirs_exist_ok=True)
    elif content_hash(path) != kept["sha256"]:
        raise SystemExit(f"{path}: its weights are not the recorded starting model's")
    return kept


def command(out: Path, arms: tuple[str, ...], seeds: list[int], only: str, lr: float,
            only_seeds: list[int] | None = None) -> list:  # fmt: skip
    return [
        sys.executable, "-m", "gear.app.cli", "compare",
        "--model", str(model_dir().relative_to(ROOT)),
        "--config", str(RECIPE_FILE.relative_to(ROOT)),
        "--set", f"temperature={regime()['temperature']:g}", "--set", f"learning_rate={lr:g}",
        *(x for a in arms for x in ("--methods", ARMS[a])),
        *(x for s in seeds for x in ("--seeds", str(s))), "--effect", str(EFFECT),
        "--out", str(out.relative_to(ROOT)), "--only", only,
        *(x for s in only_seeds or () for x in ("--only-seed", str(s))),
    ]  # fmt: skip


def lr_dir(lr: float) -> Path:
    return RUNS / f"lr{lr:g}"


def train(out: Path, arms: tuple[str, ...], seeds: list[int], only: str, lr: float,
          threads: int = 1, only_seeds: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Train arm `only` of the study in `out` (only `only_seeds` of its seeds, where given: two
    pieces can then share one arm, each on its own core) as one recorded piece."""
    model_record()
    cmd = command(out, arms, seeds, only, lr, only_seeds)
    tag = "".join(f"-s{s}" for s in only_seeds or ())
    log = RUNS / f"{out.name}-{only}{tag}.log"
    return headroom.run_piece(cmd, out, only, threads, log, records(), only_seeds)


def choose_lr() -> dict[str, Any]:
    """GRPO's held-out gain (after - before, seed `LR_SEED`) at each candidate rate; the larger
    gain is every arm's rate (ties: the larger rate). Reads GRPO only. Kept as `lr`."""
    out = headroom.rate_by_grpo_gain(
        LR_CANDIDATES, LR_SEED, lambda lr: headroom.finished(lr_dir(lr), records())
    )
    records().put("lr", out)
    return out


def studies() -> list[Path]:
    """Every study directory of the rule, in the order they run."""
    return [*map(lr_dir, LR_CANDIDATES), RUNS / "pilot", STUDY]


def keep() -> None:
    """Each study's rule, report and finished runs' record files (no checkpoints) into
    studies/results/headroom2/, which is committed (`restore` puts them back)."""
    for path in studies():
        if (path / "rule.json").is_file():
            runs = headroom.finished(path, records())
            headroom.keep(path, COPIES / path.name, runs)


def restore() -> list[str]:
    """A new session: the committed starting adapter and finished runs back under runs/."""
    model_record()
    return [run for path in studies() for run in headroom.restore_runs(COPIES / path.name, path)]


def core_hours(study: str | None = None, arms: tuple[str, ...] | None = None) -> float:
    """Core-hours so far: every piece's wall seconds x its threads (only study `study`'s pieces
    training one of `arms`, where given)."""
    pieces = [
        p for p in records().get("pieces") or []
        if (study is None or p.get("study") == study) and (arms is None or p.get("arm") in arms)
    ]  # fmt: skip
    return sum(p.get("wall_s", 0.0) * p.get("threads", 1) for p in pieces) / 3600


def after(r: dict[str, Any]) -> float:
    return headroom.metric(r, "after")


def plan() -> dict[str, Any]:
    """The rule's n, from the finished pilot, kept once as `plan`: the SD of the paired
    difference oracle - grpo (held-out mean reward after training), n80 at +0.05 (80% power,
    two-sided paired t, alpha 0.05), c = the pilot pieces' core-hours over its runs (a stopped
    piece's lost work included: c errs high), n_cap = floor((24 - used) / (6.3 c)), n =
    max(3, min(n80, n_cap)) and the MDE at n. GRPO's pilot gain is reported, not read."""
    from gear.evidence import n_for_power, paired

    kept = records().get("plan")
    if kept is not None:
        return kept
    runs = headroom.finished(RUNS / "pilot", records())
    pairs = [s for s in PILOT_SEEDS if all(s in runs.get(a, {}) for a in PILOT_ARMS)]
    if len(pairs) < len(PILOT_SEEDS):
        raise SystemExit(f"the pilot has {len(pairs)} of {len(PILOT_SEEDS)} pairs finished")
    grpo, oracle = ([runs[a][s] for s in pairs] for a in PILOT_ARMS)
    diff = paired([after(r) for r in oracle], [after(r) for r in grpo])
    gain = paired([after(r) for r in grpo], [headroom.metric(r, "before") for r in grpo])
    per_run = core_hours("pilot") / (len(PILOT_ARMS) * len(pairs))
    used = core_hours()
    n80 = n_for_power(EFFECT, diff["sd"], alpha=ALPHA) if diff["sd"] > 0 else 3
    cap = math.floor((BUDGET - used) / (RUNS_PER_SEED * per_run))
    n = max(3, min(n80 or 10**6, cap))
    out = {"pilot_seeds": pairs, "oracle_minus_grpo": diff, "grpo_gain": gain,
           "learning_rate": records().get("lr")["chosen"], "core_hours_per_run": per_run,
           "used_core_hours": used, "n80": n80, "n_cap": cap, "n": n,
           "mde_at_n": headroom.min_detectable(diff["sd"], n), "seeds": list(range(n)),
           "made": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    records().put("plan", out)
    return out


def stage_a(runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int],
            gate_trend: str) -> dict[str, Any]:  # fmt: skip
    """The gate (`gear compare`'s, on grpo, with the study rule's trend check) and headroom:
    oracle - grpo, paired by seed, two-sided 95%; headroom iff the gate passes and its lower
    bound is above 0. Beside it, not read: oracle - placebo and placebo - grpo."""
    from gear.evidence import compare_arms, paired

    both = [s for s in seeds if all(s in runs.get(a, {}) for a in STAGE_A)]
    analysis = compare_arms(
        {a: [runs[a][s] | {"seed": s} for s in both] for a in STAGE_A}, "grpo",
        metric="mean_reward", secondary="pass@1", alpha=ALPHA, effect=EFFECT,
        gate_min_seeds=headroom.GATE_MIN_SEEDS, gate_trend=gate_trend,
    )  # fmt: skip

    def minus(a: str, b: str) -> dict[str, Any]:
        return paired([after(runs[a][s]) for s in both], [after(runs[b][s]) for s in both])

    diff = minus("oracle", "grpo") if len(both) >= 2 else None
    headroom_ = bool(analysis["gate"]["passed"] and diff is not None and diff["ci"][0] > 0)
    return {"seeds": both, "missing": sorted(set(seeds) - set(both)), "gate": analysis["gate"],
            "oracle_minus_grpo": diff, "headroom": headroom_,
            "oracle_minus_placebo": minus("oracle", "placebo") if diff else None,
            "placebo_minus_grpo": minus("placebo", "grpo") if diff else None,
            "worst_seed": {a: min(((after(runs[a][s]), s) for s in both), default=None)
                           for a in STAGE_A}}  # fmt: skip


def stage_b_budget(n: int) -> dict[str, Any]:
    """Which of stage B's arms run, decided once when stage A is complete (kept as
    `stage_b_budget`): in the rule's order, each arm's n runs at stage A's measured core-hours a
    run (+10% for an arm with a teacher pass: lead, gear; lambda_grpo has none), while they fit
    what is left of the 24 core-hours; the others are listed as not run."""
    kept = records().get("stage_b_budget")
    if kept is not None:
        return kept
    per_run = core_hours("study", STAGE_A) / (len(STAGE_A) * n)
    left = BUDGET - core_hours()
    run, not_run, need = [], [], 0.0
    for arm in STAGE_B:
        cost = n * per_run * (TEACHER_COST if arm in TEACHER_ARMS else 1.0)
        if not not_run and need + cost <= left:
            run.append(arm)
            need += cost
        else:
            not_run.append(arm)
    out = {"n": n, "core_hours_per_run": per_run, "left": left, "needs": need, "run": run,
           "not_run": not_run, "made": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    records().put("stage_b_budget", out)
    return out


def decide(runs: dict[str, dict[int, dict[str, Any]]], plan_: dict[str, Any],
           gate_trend: str) -> dict[str, Any]:  # fmt: skip
    """The rule's reading of what has run: stage A; then its stop, or stage B's budget and,
    once its arms have run, stage B."""
    seeds = plan_["seeds"]
    out: dict[str, Any] = {"stage_a": stage_a(runs, seeds, gate_trend)}
    a = out["stage_a"]
    if a["missing"]:
        out["stop"] = f"stage A is not complete: seeds {a['missing']} have not finished"
    elif not a["gate"]["passed"]:
        out["stop"] = "the gate failed: GRPO is not shown to learn here; headroom is not read"
    elif not a["headroom"]:
        out["stop"] = "no headroom: the oracle's interval is not above GRPO's; the rule stops"
    else:
        out["stage_b_budget"] = stage_b_budget(len(seeds))
        # each arm that ran - grpo, paired by seed, Bonferroni over the three (98.33%): it wins
        # iff its interval is above 0; its share of the oracle's gain (paired bootstrap 95%)
        out["stage_b"] = headroom.stage_b(runs, seeds, out["stage_b_budget"]["run"], len(STAGE_B))
    return out


def study_arms() -> tuple[str, ...]:
    """The arms `study --arm` may train now: stage A's; stage B's that the budget fits, once
    stage A shows headroom."""
    kept = records().get("stage_b_budget")
    return (*STAGE_A, *(kept["run"] if kept else ()))


def report() -> dict[str, Any]:
    """studies/results/headroom2.json from what has run (the rule's `Reporting`): the regime and
    its numbers, the starting model's hash, the rate choice, the pilot and n, stage A (gate,
    headroom), stage B or the rule's stop, every run (resumed ones marked) and piece with its
    CPU capability, the core-hours, and whether the rule was committed before the results."""
    from gear.evidence import preregistered, write_json

    out: dict[str, Any] = {"rule": RULE, "regime": regime(), "model": records().get("model"),
                           "lr": records().get("lr"), "plan": records().get("plan"),
                           "reruns": records().get("reruns") or []}  # fmt: skip
    for path in studies():
        runs = headroom.finished(path, records())
        out.setdefault("runs", {})[path.name] = {
            a: {str(s): {k: r.get(k) for k in ("before", "after", "precision", "train_seconds",
                                               "model_identity", "resumed", "rule_sha256")}
                for s, r in rs.items()}
            for a, rs in runs.items()
        }  # fmt: skip
    if out["plan"] is not None and (STUDY / "rule.json").is_file():
        rule = headroom.read_rule(STUDY) or {}
        out |= decide(headroom.finished(STUDY, records()), out["plan"],
                      rule.get("gate_trend", headroom.GATE_TREND))  # fmt: skip
    out["pieces"] = records().get("pieces") or []
    out["core_hours"] = {"used": round(core_hours(), 2), "limit": BUDGET}
    out["capability"] = torch.backends.cpu.get_cpu_capability()
    out["preregistered"] = preregistered(RULE, "studies/results/headroom2_runs/lr.json", ROOT)
    write_json(ROOT / "studies" / "results" / "headroom2.json", out)
    keep()
    return out


def status() -> None:
    print(f"regime: {(records().get('regime') or {}).get('regime')}")
    print(f"starting model: {records().get('model')}")
    for p in records().get("pieces") or []:
        print(f"  {p['id']}: {p.get('wall_s', 'running')} s, exit {p.get('exit')}, "
              f"{p['capability']}, resumes {p.get('resumes')}")  # fmt: skip
    print(f"lr: {records().get('lr')}")
    print(f"plan: {records().get('plan')}")
    print(f"core-hours used: {core_hours():.2f} of {BUDGET}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.headroom2")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("lr")
    a.add_argument("--lr", type=float, required=True, choices=LR_CANDIDATES)
    a.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("pilot")
    p.add_argument("--arm", choices=PILOT_ARMS, required=True)
    p.add_argument("--threads", type=int, default=1)
    st = sub.add_parser("study")
    st.add_argument("--arm", choices=(*STAGE_A, *STAGE_B), required=True)
    st.add_argument("--threads", type=int, default=1)
    st.add_argument(
        "--seed",
        type=int,
        action="append",
        dest="seeds",
        help="train only this of the plan's seeds (repeatable; default: all)",
    )
    sub.add_parser("plan")
    sub.add_parser("report")
    sub.add_parser("choose-lr")
    sub.add_parser("regime")
    sub.add_parser("keep")
    sub.add_parser("restore")
    sub.add_parser("status")
    args = ap.parse_args(argv)
    if args.cmd == "keep":
        keep()
    elif args.cmd == "restore":
        print("\n".join(restore()) or "nothing to restore")
    elif args.cmd == "regime":
        print({k: v for k, v in regime().items() if k != "numbers"})
    elif args.cmd == "lr":
        # gear compare's rule needs two arms: the rate's study holds the pilot's, trains grpo only
        train(lr_dir(args.lr), PILOT_ARMS, [LR_SEED], "grpo", args.lr, args.threads)
    elif args.cmd == "choose-lr":
        print(choose_lr())
    elif args.cmd == "pilot":
        chosen = records().get("lr")
        if chosen is None:
            raise SystemExit("choose the rate first: python -m studies.headroom2 choose-lr")
        train(RUNS / "pilot", PILOT_ARMS, list(PILOT_SEEDS), args.arm, chosen["chosen"],
              args.threads)  # fmt: skip
    elif args.cmd == "plan":
        print(plan())
    elif args.cmd == "study":
        kept = records().get("plan")
        if kept is None:
            raise SystemExit("plan first: python -m studies.headroom2 plan")
        if args.arm not in study_arms():
            raise SystemExit(f"{args.arm}: stage B runs only after stage A shows headroom and "
                             f"the budget fits it (python -m studies.headroom2 report)")  # fmt: skip
        unknown = sorted(set(args.seeds or ()) - set(kept["seeds"]))
        if unknown:
            raise SystemExit(f"--seed {unknown}: not among the plan's seeds {kept['seeds']}")
        train(STUDY, (*STAGE_A, *STAGE_B), kept["seeds"], args.arm, kept["learning_rate"],
              args.threads, args.seeds)  # fmt: skip
    elif args.cmd == "report":
        out = report()
        print({k: out.get(k) for k in ("plan", "stop", "core_hours")})
    else:
        status()


if __name__ == "__main__":
    main()

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
    python -m studies.headroom2 keep             # finished runs' records -> studies/results/
    python -m studies.headroom2 restore          # a new session: them and the adapter back
    python -m studies.headroom2 status

The pilot's plan, stage A and stage B follow the rule and reuse `studies.headroom`'s analysis
(the gate, the paired intervals, the MDE, the bootstrap share); their commands are added before
they run, as amendments would be if anything in the rule changed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

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


def command(out: Path, arms: tuple[str, ...], seeds: list[int], only: str, lr: float) -> list:
    return [
        sys.executable, "-m", "gear.cli", "compare",
        "--model", str(model_dir().relative_to(ROOT)),
        "--config", str(RECIPE_FILE.relative_to(ROOT)),
        "--set", f"temperature={regime()['temperature']:g}", "--set", f"learning_rate={lr:g}",
        *(x for a in arms for x in ("--methods", ARMS[a])),
        *(x for s in seeds for x in ("--seeds", str(s))), "--effect", str(EFFECT),
        "--out", str(out.relative_to(ROOT)), "--only", only,
    ]  # fmt: skip


def lr_dir(lr: float) -> Path:
    return RUNS / f"lr{lr:g}"


def train(out: Path, arms: tuple[str, ...], seeds: list[int], only: str, lr: float,
          threads: int = 1) -> dict[str, Any]:  # fmt: skip
    model_record()
    cmd = command(out, arms, seeds, only, lr)
    log = RUNS / f"{out.name}-{only}.log"
    return headroom.run_piece(cmd, out, only, threads, log, records())


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
    return [*map(lr_dir, LR_CANDIDATES), RUNS / "pilot", RUNS / "study"]


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


def core_hours() -> float:
    """Core-hours so far: every piece's wall seconds x its threads."""
    pieces = records().get("pieces") or []
    return sum(p.get("wall_s", 0.0) * p.get("threads", 1) for p in pieces) / 3600


def status() -> None:
    print(f"regime: {(records().get('regime') or {}).get('regime')}")
    print(f"starting model: {records().get('model')}")
    for p in records().get("pieces") or []:
        print(f"  {p['id']}: {p.get('wall_s', 'running')} s, exit {p.get('exit')}, "
              f"{p['capability']}, resumes {p.get('resumes')}")  # fmt: skip
    print(f"lr: {records().get('lr')}")
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
    else:
        status()


if __name__ == "__main__":
    main()

"""The credit gym (issue 20): every arm x seed on the chain task, paired statistics, JSON, plots.

    python -m studies.gym --quick                 # smoke test, a few minutes
    python -m studies.gym --workers 2             # the default grid: 10 arms x 20 seeds
    python -m studies.gym --methods grpo --methods mymod:my_method --seeds 10
    python -m studies.gym --sweep 0.05 0.1 0.2 0.4
    python -m studies.gym --hint answer_only      # the teacher sees the final result alone

Writes studies/results/gym.json (gym_answer_only.json with --hint answer_only; or --out) and plots under studies/results/gym/.
See docs/gym.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gear.gym import run, table
from gear.gym.task import HINTS

RESULTS = Path(__file__).parent / "results"  # where docs cite them


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--methods", action="append", help="arm spec (repeat); default: all 10 arms")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1"
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--length", type=int, default=4, help="chain length (steps per problem)")
    ap.add_argument(
        "--hint",
        choices=HINTS,
        default="all_steps",
        help="what the teacher is shown: every intermediate result or the final one alone",
    )
    ap.add_argument(
        "--warm-starts",
        type=int,
        default=1,
        help="warm starts (initialisation seeds); seed i trains from warm start i mod this",
    )
    ap.add_argument("--sweep", type=float, nargs="*", default=[], help="tau_onset values")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="3 seeds x 20 steps (sets --seeds, --steps): a smoke test",
    )
    ap.add_argument("--out", type=Path, help="default: results/gym.json (--quick: gym_quick.json)")
    ap.add_argument("--plots", type=Path, help="default: results/gym/ (--quick: gym_quick/)")
    a = ap.parse_args(argv)
    for name in ("seeds", "steps", "length", "workers", "warm_starts"):
        if getattr(a, name) < 1:
            ap.error(
                f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(a, name)}"
            )
    stem = "gym_quick" if a.quick else "gym"  # a smoke test never overwrites the grid's result
    if a.hint != "all_steps":  # nor does another teacher context
        stem += f"_{a.hint}"
    a.out = a.out or RESULTS / f"{stem}.json"
    a.plots = a.plots or RESULTS / stem
    result = run(
        a.methods,
        seeds=range(a.first_seed, a.first_seed + a.seeds),
        steps=a.steps,
        length=a.length,
        hint=a.hint,
        warm_starts=a.warm_starts,
        quick=a.quick,
        sweep=a.sweep,
        workers=a.workers,
        out=a.out,
        plot_dir=a.plots,
    )
    print(table(result))
    print(f"wall {result['wall_s']} s on {result['machine']['cpu_capability']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

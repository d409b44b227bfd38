"""The fair credit gym: both teacher contexts, three warm starts, GRPO at three learning rates, a
shape-matched placebo, per-seed results (the pre-registered grid of
docs/evidence/2026-11-26-gym-fair.md).

    OMP_NUM_THREADS=1 nohup python -m studies.gym_fair > gym_fair.log 2>&1 &   # resumable
    python -m studies.gym_fair --summary-only                                  # re-read the JSONs

Writes studies/results/gym_fair/{all_steps,answer_only}.json (`gear.gym.run`'s result: every
run's curve and each arm's `seed_table`) and summary.json (the pre-registered read-out). A
stopped run resumes: every finished (arm, seed) run is kept under ~/.cache/gear/gym/runs/.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gear.evidence import t_interval
from gear.gym import _finite, run
from gear.gym.model import WarmStart

OUT = Path(__file__).parent / "results" / "gym_fair"
CONDITIONS = ("all_steps", "answer_only")
SHARP = "gear_departure_blame@estimator=k1,modulation=exp,beta=2,w_min=0,w_max=10"
ARMS = {  # name in the read-out -> arm spec
    "grpo_lr1e-4": "grpo@lr=1e-4",
    "grpo_lr3e-4": "grpo",
    "grpo_lr1e-3": "grpo@lr=1e-3",
    "gear": "gear",
    "gear_k1": "gear@estimator=k1",
    "sharp": SHARP,
    "sharp_guard": f"{SHARP},success_floor=1.0",
    "sharp_placebo": SHARP.replace(
        "gear_departure_blame@", "random_shape@shape_method=gear_departure_blame,"
    ),
    "oar_g": "oar_g",
}
GRPO = ("grpo_lr1e-4", "grpo_lr3e-4", "grpo_lr1e-3")
RECOMMENDED = ("gear", "sharp_guard")  # gear train's default and its departure recipe
WARM = WarmStart(hints="both", teacher_steps=100)
DESIGN = {"seeds": 9, "warm_starts": 3, "steps": 40, "loc_prompts": 64}


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def finals(result: dict[str, Any], name: str) -> dict[int, dict[str, Any]]:
    return {r["seed"]: r for r in result["arms"][ARMS[name]]["seed_table"]}


def paired(result: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    fa, fb = finals(result, a), finals(result, b)
    seeds = sorted(set(fa) & set(fb))
    d = t_interval([fa[s]["final"] - fb[s]["final"] for s in seeds])
    return {"mean": d["mean"], "ci": d["ci"], "n": d["n"], "sd": d["sd"]}


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The pre-registered read-out (docs/evidence/2026-11-26-gym-fair.md)."""
    out: dict[str, Any] = {"conditions": {}, "stable": {}, "beats_grpo": {}}
    for cond, res in results.items():
        best = max(GRPO, key=lambda n: res["arms"][ARMS[n]]["final"])
        arms = {}
        for name, spec in ARMS.items():
            a = res["arms"][spec]
            arms[name] = {
                "spec": spec,
                "change": a["change"],
                "change_ci": a["change_ci"],
                "final": a["final"],
                "within_sd": a["warm_spread"]["within_sd"],
                "between_sd": a["warm_spread"]["between_sd"],
                "worst_seed": a["worst_seed"],
                "below_warm_start": a["below_warm_start"],
                "seeds": len(a["seed_table"]),
                "vs_best_grpo": None if name == best else paired(res, name, best),
            }
        out["conditions"][cond] = {
            "best_grpo": best,
            "arms": arms,
            "pairs": {
                f"{a}-{b}": paired(res, a, b)
                for a, b in (
                    ("sharp_guard", "sharp"),
                    ("sharp", "sharp_placebo"),
                    ("sharp_guard", "sharp_placebo"),
                    ("gear_k1", "gear"),
                )
            },
        }
    for name in ARMS:
        out["stable"][name] = all(
            c["arms"][name]["below_warm_start"] == 0 for c in out["conditions"].values()
        )
        out["beats_grpo"][name] = all(
            c["arms"][name]["vs_best_grpo"] is not None
            and c["arms"][name]["vs_best_grpo"]["ci"][0] > 0
            for c in out["conditions"].values()
        )
    out["recommended_below_warm_start"] = {
        name: {c: v["arms"][name]["below_warm_start"] for c, v in out["conditions"].items()}
        for name in RECOMMENDED
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), cpu_s()
    results = {}
    for cond in CONDITIONS:
        path = a.out / f"{cond}.json"
        if a.summary_only:
            results[cond] = json.loads(path.read_text())
            continue
        results[cond] = run(
            list(ARMS.values()), seeds=DESIGN["seeds"], steps=DESIGN["steps"], hint=cond,
            warm_starts=DESIGN["warm_starts"], warm=WARM, loc_prompts=DESIGN["loc_prompts"],
            out=path,
        )  # fmt: skip
        print(f"gym_fair: {cond} done, wall {time.perf_counter() - t0:.0f} s, "
              f"CPU {cpu_s() - c0:.0f} s", flush=True)  # fmt: skip
    out = summary(results)
    out["design"] = {**DESIGN, "arms": ARMS, "warm": asdict(WARM)}
    if not a.summary_only:
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        out["cpu_s"] = round(cpu_s() - c0, 1)
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    else:
        old = a.out / "summary.json"
        if old.is_file():
            prev = json.loads(old.read_text())
            out.update({k: prev[k] for k in ("wall_s", "cpu_s", "cpu_capability") if k in prev})
    (a.out / "summary.json").write_text(json.dumps(_finite(out), indent=1) + "\n")
    for cond, c in out["conditions"].items():
        print(f"\n{cond} (best-lr GRPO: {c['best_grpo']})")
        for name, r in c["arms"].items():
            lo, hi = r["change_ci"]
            v = r["vs_best_grpo"]
            vs = (
                ""
                if v is None
                else f"  vs GRPO {v['mean']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}]"
            )
            w = r["worst_seed"]
            print(f"  {name:<14}{r['change']:+.3f} [{lo:+.3f}, {hi:+.3f}]  worst {w['change']:+.3f} "
                  f"(seed {w['seed']})  below {r['below_warm_start']}{vs}")  # fmt: skip
    print("\nstable:", out["stable"], "\nbeats GRPO:", out["beats_grpo"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What OAR's two strategies cost per step: TRL's GRPO, OAR-G (one input-gradient pass) and OAR-P
(one forward per masked token), on the same model, batch and seed, in one process, alternated.

Each arm is `benchmarks.step.run`: TRL's `GRPOTrainer` for "grpo", the `GEARTrainer` that `gear
train` builds for "oar_g" / "oar_p" (`credit_method` = the arm, the task's answer parser, the
default `credit_oar_span='answer'` and `credit_oar_pfinal='answer_joint'`). The learning rate is 0
by default, so every arm samples the same completions every step and the difference is the
credit's cost alone (the optimizer still runs); the first step of each run is warm-up. Reported
per step (medians): wall and process CPU seconds, the influence pass (`gear/time_influence`),
and both per 1k completion tokens (the step's mean completion length x completions).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.oar --no-bf16 --lora 16 --completions 32 \\
        --generations 4 --completion-length 32 --temperature 0.7      # gear train's recipe

The result goes to results/oar.json (with `torch.backends.cpu.get_cpu_capability()`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings

import torch

from benchmarks import step
from benchmarks.common import machine, print_table, write_json

ARMS = ("grpo", "oar_g", "oar_p")


def summarise(rows: list[dict], completions: int) -> list[dict]:
    """Per arm, the medians over measured steps (step > 1) and the per-1k-token figures."""
    out = []
    for arm in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == arm and r["step"] > 1]
        med = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "influence_s")}
        tokens = statistics.median(r["completion_mean_length"] * completions for r in mine)
        out.append({
            "method": arm, "steps": len(mine), **med, "completion_tokens": tokens,
            "rows_skipped": statistics.median(r["rows_skipped"] for r in mine),
            "wall_s_per_1k": med["wall_s"] / (tokens / 1000),
            "influence_s_per_1k": med["influence_s"] / (tokens / 1000),
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--completions", type=int, default=32)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--completion-length", type=int, default=32)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lora", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--learning-rate", type=float, default=0.0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--name", default="oar")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]

    from transformers.utils import logging as hf_logging

    from gear.config import resolve_values
    from gear.run import load_model_and_data
    from gear.tasks import get_task

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    cfg = resolve_values({"model": args.model, "train_size": 256, "seed": args.seed})
    model0, tokenizer, dataset = load_model_and_data(cfg, get_task("arithmetic"))
    rows: list[dict] = []
    for rep in range(args.repeats):
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
            with tempfile.TemporaryDirectory() as out:
                result = step.run(arm, model0, tokenizer, dataset, args, out)
            for r in result:
                r["repeat"] = rep
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                      flush=True)  # fmt: skip
            rows += result
    summary = summarise(rows, args.completions)
    print_table(
        summary, list(summary[0]), "Median seconds per step (first step of each run excluded)"
    )
    by = {s["method"]: s for s in summary}
    ratios = {
        f"{a}_over_{b}": by[a][k] / by[b][k]
        for a, b in (("oar_g", "grpo"), ("oar_p", "grpo"), ("oar_p", "oar_g"))
        if a in by and b in by
        for k in ("wall_s",)
    }
    ratios |= {
        f"{a}_over_{b}_cpu": by[a]["cpu_s"] / by[b]["cpu_s"]
        for a, b in (("oar_g", "grpo"), ("oar_p", "grpo"), ("oar_p", "oar_g"))
        if a in by and b in by
    }
    if "oar_p" in by and "oar_g" in by and by["oar_g"]["influence_s"] > 0:
        ratios["influence_oar_p_over_oar_g"] = (
            by["oar_p"]["influence_s"] / by["oar_g"]["influence_s"]
        )
    print({k: round(v, 3) for k, v in ratios.items()})
    write_json(args.name, {
        "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
        "precision": "bf16 autocast" if args.bf16 else "float32",
        "args": vars(args), "rows": rows, "summary": summary, **ratios,
    })  # fmt: skip


if __name__ == "__main__":
    main()

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

`--passes` times the two influence passes alone instead, on one fixed batch (--completions
prompts of the arithmetic task, one completion each, sampled as the recipe does) with process CPU
time, the median of --repeats after a warm-up: OAR-G's input-gradient pass, OAR-P's masked copies
with the shared prefix (`gear.prefix`, TRL's default) and without it (each copy's whole row), and a
plain no-grad forward of the batch, each per 1k completion tokens; the two OAR-P passes' scores
must agree (their largest difference is recorded):

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.oar --passes --completions 16 --repeats 3

The result goes to results/oar.json (with `torch.backends.cpu.get_cpu_capability()`), the pass
timings under "passes".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks import step
from benchmarks.common import RESULTS, machine, print_table, write_json

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


def sampled_batch(model: Any, tok: Any, data: Any, args: argparse.Namespace) -> tuple:
    """(B, P + T) ids and mask of --completions prompts (left-padded) and one sampled completion
    each (right-padded after its end token), and (B, T) bool completion tokens."""
    prompts = [
        tok.apply_chat_template(data[i]["prompt"], add_generation_prompt=True, tokenize=True,
                                return_dict=True)["input_ids"]
        for i in range(args.completions)
    ]  # fmt: skip
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :], mask[i, P - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                             temperature=args.temperature, max_new_tokens=args.completion_length,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
    comp = out[:, P:]
    ended = (comp == tok.eos_token_id).long().cumsum(1)
    valid = (ended == 0) | ((ended == 1) & (comp == tok.eos_token_id))  # up to the end token
    return torch.cat([ids, comp], 1), torch.cat([mask, valid.long()], 1), valid


def cpu_seconds(fn: Any, repeats: int) -> tuple[float, Any]:
    """Median process CPU seconds of `fn()` over `repeats` calls after one warm-up, its result."""
    out, times = fn(), []
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), out


def passes(model: Any, tok: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The influence passes alone on one batch (module docstring)."""
    from gear.credit import CreditParams
    from gear.credit.attribution import tokens_before
    from gear.integrations.trl.forwards import Forwards, answer_influence, answer_perturbation
    from gear.modeling import LogitConventions
    from gear.spans import answer_spans, mask_token_id
    from gear.tasks import get_task

    model.eval()
    ids, mask, valid = sampled_batch(model, tok, data, args)
    B, T = valid.shape
    spans = answer_spans(CreditParams(method="oar_p"), tok, ids[:, -T:], mask[:, -T:], valid,
                         get_task("arithmetic").answer_span)  # fmt: skip
    masked = tokens_before(spans.answer_mask, valid)
    plain = SimpleNamespace(unwrap_model=lambda m: m, autocast=nullcontext, mixed_precision="no")

    def forwards(sharing: bool) -> Any:
        return Forwards(plain, LogitConventions.of(model), 1.0, "full", 1, 64, sharing)

    def oar_p(sharing: bool) -> Any:
        return lambda: answer_perturbation(forwards(sharing), model, ids, mask, spans.span,
                                           masked, mask_token_id(tok), "answer_joint", ids.numel())  # fmt: skip

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)

    s_g, _ = cpu_seconds(
        lambda: answer_influence(forwards(True), model, ids, mask, spans.span, B), args.repeats
    )
    s_p, shared = cpu_seconds(oar_p(True), args.repeats)
    s_u, unshared = cpu_seconds(oar_p(False), args.repeats)
    s_f, _ = cpu_seconds(forward, args.repeats)
    k = int(valid.sum()) / 1000
    out = {
        "rows": B, "completion_tokens": int(valid.sum()), "masked_tokens": int(masked.sum()),
        "prompt_tokens": int(mask[:, :-T].sum()), "answer_found": int((~spans.fallback).sum()),
        "cpu_s": {"oar_g": s_g, "oar_p": s_p, "oar_p_unshared": s_u, "forward": s_f},
        "cpu_s_per_1k_completion_tokens": {
            "oar_g": s_g / k, "oar_p": s_p / k, "oar_p_unshared": s_u / k, "forward": s_f / k,
        },
        "oar_p_over_oar_g": s_p / s_g, "oar_p_over_forward": s_p / s_f,
        "shared_over_unshared": s_p / s_u,
        "max_abs_difference_shared_unshared": float((shared - unshared).abs().max()),
        "max_score": float(shared.max()),
    }  # fmt: skip
    print(json.dumps(out, indent=1))
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
    ap.add_argument("--passes", action="store_true", help="time the influence passes alone")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]

    from transformers.utils import logging as hf_logging

    from gear.app.config import resolve_values
    from gear.app.train import load_model_and_data
    from gear.tasks import get_task

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    cfg = resolve_values({"model": args.model, "train_size": 256, "seed": args.seed})
    model0, tokenizer, dataset = load_model_and_data(cfg, get_task("arithmetic"))
    if args.passes:  # kept beside the step figures of the same file
        path = RESULTS / f"{args.name}.json"
        kept = json.loads(path.read_text()) if path.is_file() else {}
        result = passes(model0, tokenizer, dataset, args)
        write_json(args.name, kept | {"passes": {
            "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
            "args": vars(args), **result}})  # fmt: skip
        return
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

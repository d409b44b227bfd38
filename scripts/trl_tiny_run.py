"""A tiny GEAR run in TRL on CPU: one process, or one rank of `torchrun` (gloo backend).

    python scripts/trl_tiny_run.py --steps 3                      # one process
    torchrun --nproc_per_node 2 scripts/trl_tiny_run.py --steps 2  # see scripts/two_process.sh
    python scripts/trl_tiny_run.py --compare --steps 8            # GEAR step vs GRPO step time

Every rank prints one line `GEAR_RANK {json}`; under torchrun rank 0 then checks that the ranks
hold identical weights and ran the same number of teacher forwards, and prints `GEAR_OK {json}`.
The model is a random 1-layer Llama built in code and the tokenizer needs no download (the
fixtures of `gear.testing`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer

from gear.integrations.trl import GEARConfig, GEARTrainer
from gear.testing import (
    byte_tokenizer,
    dataset,
    fast_kwargs,
    hash_reward,
    load_tokenizer,
    tiny_model,
)


def build(kind: str, args: argparse.Namespace, output_dir: str) -> GRPOTrainer:
    tok = byte_tokenizer() if args.vocab == "bytes" else load_tokenizer()
    model = tiny_model(tok, hidden=args.hidden, layers=args.layers)
    options = fast_kwargs(
        output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        logging_steps=1,
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
        # every completion runs to the full length, so GRPO and GEAR steps do the same work
        generation_kwargs={"min_new_tokens": args.completion_length} if args.compare else None,
    )
    data = dataset(max(8, args.batch * 4))
    if kind == "grpo":  # the same settings, TRL's own classes
        return GRPOTrainer(
            model=model,
            reward_funcs=hash_reward,
            args=GRPOConfig(**options),
            train_dataset=data,
            processing_class=tok,
        )
    config = GEARConfig(
        **options,
        credit_method=args.method,
        teacher=args.teacher,
        loss_mode=args.loss_mode,
        credit_log_steps=args.steps,
    )
    return GEARTrainer(
        model=model, reward_funcs=hash_reward, args=config, train_dataset=data, processing_class=tok
    )


def run(kind: str, args: argparse.Namespace, output_dir: str) -> dict:
    trainer = build(kind, args, output_dir)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    gear_forwards = 0  # GEAR's own student / teacher passes on this rank
    if kind == "gear":
        real = trainer._final_hidden

        def counted(*a, **k):
            nonlocal gear_forwards
            gear_forwards += 1
            return real(*a, **k)

        trainer._final_hidden = counted
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    checksum = _checksum(trainer.model)
    step_times = [h["step_time"] for h in logs]
    summary = {
        "trainer": kind,
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "steps": trainer.state.global_step,
        "params_changed": changed,
        "param_checksum": round(checksum, 6),
        "teacher_checksum": _checksum(getattr(trainer, "teacher_model", None)),
        "gear_forward_passes": gear_forwards,
        "step_time_s": step_times,
        "step_time_mean_s_after_first": statistics.mean(step_times[1:])
        if len(step_times) > 1
        else None,
        "gear": {
            k: round(statistics.mean(h[k] for h in logs), 5)
            for k in logs[-1]
            if k.startswith("gear/")
        },
        "reward": [h.get("reward") for h in logs],
    }
    return summary


def _checksum(model: torch.nn.Module | None) -> float | None:
    return (
        None
        if model is None
        else round(sum(float(v.double().sum()) for v in model.parameters()), 6)
    )


def compare(args: argparse.Namespace, output_dir: str) -> None:
    """Median step time of GRPO and GEAR runs, alternated `--repeats` times (steps 2.. of each)."""
    times: dict[str, list[float]] = {"grpo": [], "gear": []}
    parts: list[dict] = []
    for r in range(args.repeats):
        for kind in ("grpo", "gear"):
            result = run(kind, args, os.path.join(output_dir, f"{kind}-{r}"))
            times[kind] += result["step_time_s"][1:]
            if kind == "gear":
                parts.append(result["gear"])
    grpo, gear = statistics.median(times["grpo"]), statistics.median(times["gear"])
    components = {
        k[len("gear/time_") :]: statistics.median(p[k] for p in parts)
        for k in sorted(parts[0])
        if k.startswith("gear/time_")
    }
    print(f"{'trainer':<8} {'median step (s)':>16}   ({args.repeats} runs x steps 2..{args.steps})")
    print(f"{'GRPO':<8} {grpo:>16.3f}")
    print(f"{'GEAR':<8} {gear:>16.3f}   x{gear / grpo:.2f}")
    print(
        "GEAR extra work per step (median s): "
        + ", ".join(f"{k}={v:.4f}" for k, v in components.items())
    )
    print(
        "GEAR_COMPARE "
        + json.dumps(
            {
                "grpo_step_s": grpo,
                "gear_step_s": gear,
                "ratio": gear / grpo,
                "gear_components_s": components,
                "step_times_s": times,
                "config": {k: v for k, v in vars(args).items() if k != "output_dir"},
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="per-device batch size")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", choices=["bytes", "smollm2"], default="bytes")
    parser.add_argument("--method", default="gear")
    parser.add_argument("--teacher", default="current")
    parser.add_argument("--loss-mode", default="rl")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument(
        "--compare", action="store_true", help="time GRPO and GEAR steps (one process)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each trainer with --compare"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="gear-tiny-")

    if args.compare:
        compare(args, output_dir)
        return

    summary = run("gear", args, output_dir)
    print("GEAR_RANK " + json.dumps(summary), flush=True)
    # the ranks share one stdout, where lines can interleave: also leave a file per rank
    with open(os.path.join(output_dir, f"gear_rank{summary['rank']}.json"), "w") as f:
        json.dump(summary, f)
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, summary)
        if summary["rank"] == 0:
            credit = os.path.join(output_dir, "credit")
            same_weights = (
                len({(s["param_checksum"], s["teacher_checksum"]) for s in everyone}) == 1
            )
            same_forwards = len({s["gear_forward_passes"] for s in everyone}) == 1
            ok = same_weights and same_forwards and all(s["params_changed"] for s in everyone)
            verdict = {
                "ok": ok,
                "world_size": len(everyone),
                "identical_weights": same_weights,
                "same_gear_forward_passes": same_forwards,
                "credit_records": sorted(os.listdir(credit)) if os.path.isdir(credit) else [],
            }
            print("GEAR_OK " + json.dumps(verdict), flush=True)
            with open(os.path.join(output_dir, "gear_ok.json"), "w") as f:
                json.dump(verdict, f)
        else:
            ok = True
        dist.barrier()
        dist.destroy_process_group()  # a live gloo group at exit can abort the process (SIGABRT)
        if summary["rank"] == 0 and not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()

"""GEAR in TRL on two CPU processes under DDP, DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 (gloo backend).

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29540 \
        scripts/distributed_run.py --backend zero3 --teacher frozen --output-dir /tmp/run

(`scripts/two_process.sh` wraps this.) The model is a random tiny Llama built in code (the
fixtures of tests/_trl_helpers.py); optionally with a LoRA adapter (`--peft`). The backend is set
through the training arguments exactly as a user would (`deepspeed=<config dict>`, or
`fsdp="full_shard"` + `fsdp_config={"version": 2}`), so HF Trainer / accelerate build the same
engines as under `accelerate launch`.

Each rank writes `gear_rank<r>.json` and prints `GEAR_RANK {json}`; rank 0 checks that all ranks
hold the same full (gathered) weights, ran the same number of GEAR forwards, that the policy
moved, and that the teacher is what it should be (frozen = the initial weights, EMA = strictly
between the initial and final weights of at least one parameter, neither equal), then writes
`gear_ok.json` and prints `GEAR_OK {json}` (exit 1 if a check fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared tiny fixtures

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from _trl_helpers import byte_tokenizer, dataset, fast_kwargs, hash_reward, tiny_model  # noqa: E402
from gear.integrations.trl import TEACHER_FILE, GEARConfig, GEARTrainer  # noqa: E402
from gear.integrations.trl.teacher_model import teacher_state  # noqa: E402

BACKENDS = ("ddp", "zero2", "zero3", "fsdp2")


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config as users write it for HF Trainer ("auto" filled from the arguments)."""
    zero: dict = {"stage": stage}
    if stage == 3:
        # partition even the tiny model's parameters (by default those under 1e5 elements stay
        # whole on every rank, and nothing would be partitioned); full weights in checkpoints
        zero |= {
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def backend_kwargs(backend: str) -> dict:
    if backend == "ddp":
        return {}
    if backend == "zero2":
        return {"deepspeed": deepspeed_config(2)}
    if backend == "zero3":
        return {"deepspeed": deepspeed_config(3)}
    return {
        "fsdp": "full_shard",
        "fsdp_config": {
            "version": 2,
            "reshard_after_forward": True,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "FULL_STATE_DICT",
        },
    }


def allow_fsdp_on_cpu() -> None:
    """accelerate (1.15) turns an FSDP plugin into `DistributedType.FSDP` only for GPU-like
    process types: on CPU (`MULTI_CPU`, gloo) it keeps the plugin unused and wraps the model in
    DDP, silently. To run GEARTrainer under real FSDP2 sharding here, AcceleratorState is built
    as for MULTI_GPU (its device stays the CPU). A test harness patch, not a supported setup."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        shared = PartialState._shared_state
        forced = (
            fsdp_plugin is not None and shared.get("distributed_type") == DistributedType.MULTI_CPU
        )
        if forced:
            shared["distributed_type"] = DistributedType.MULTI_GPU
        try:
            original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        finally:
            if forced and shared.get("distributed_type") == DistributedType.MULTI_GPU:
                shared["distributed_type"] = DistributedType.MULTI_CPU

    AcceleratorState.__init__ = init


def full_parameters(trainer: GEARTrainer, model: torch.nn.Module | None) -> dict | None:
    """name -> full float64 CPU copy of every parameter (gathered under ZeRO-3 / FSDP2)."""
    if model is None:
        return None
    module = model.module if hasattr(model, "module") else model  # a DeepSpeed engine
    params = list(module.named_parameters())
    gather = nullcontext()
    if any(hasattr(p, "ds_id") for _, p in params):  # ZeRO-3 partitioned
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    with gather:
        out = {}
        for name, p in params:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.removeprefix("_fsdp_wrapped_module.")] = t.detach().double().cpu().clone()
    return out


def storage(model: torch.nn.Module | None) -> str | None:
    """How the model's parameters are held on this rank: 'dtensor' (FSDP2 shards),
    'zero3-partitioned' (DeepSpeed shards, size 0 outside a gather) or 'full'."""
    if model is None:
        return None
    params = list(model.parameters())
    if not params:
        return "none"
    if any(hasattr(p, "full_tensor") for p in params):
        return "dtensor"
    if any(hasattr(p, "ds_id") and p.numel() == 0 for p in params):
        return "zero3-partitioned"
    return "full"


def checksum(params: dict | None) -> float | None:
    return None if params is None else round(sum(float(v.sum()) for v in params.values()), 8)


def build(args: argparse.Namespace) -> GEARTrainer:
    if args.backend == "fsdp2":
        allow_fsdp_on_cpu()
    tok = byte_tokenizer()
    model = tiny_model(tok, hidden=args.hidden, layers=args.layers).to(getattr(torch, args.dtype))
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
        )
    save = {"save_strategy": "steps", "save_steps": 1} if args.save else {}
    config = GEARConfig(
        **fast_kwargs(
            args.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            num_generations=args.generations,
            max_completion_length=args.completion_length,
            ddp_backend="gloo",
            bf16=args.bf16,
            **save,
            **backend_kwargs(args.backend),
        ),
        credit_log_steps=1,
        teacher=args.teacher,
        ema_decay=args.ema_decay,
    )
    teacher_model = None
    if args.teacher_path:  # a frozen teacher given by path: the initial weights, saved by rank 0
        state = PartialState()  # the process group (the config set it up)
        teacher_model = os.path.join(args.output_dir, "teacher_init")
        if state.is_main_process:
            model.save_pretrained(teacher_model)
            tok.save_pretrained(teacher_model)
        state.wait_for_everyone()
    return GEARTrainer(
        model=model,
        reward_funcs=hash_reward,
        args=config,
        train_dataset=dataset(max(8, args.batch * 4)),
        processing_class=tok,
        peft_config=peft_config,
        teacher_model=teacher_model,
    )


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    trainer = build(args)
    trainer.accelerator.free_memory = lambda *objects: list(objects)  # no full gc per train()
    initial = full_parameters(trainer, trainer.model)
    gear_forwards = 0
    real = trainer._final_hidden

    def counted(*a, **k):
        nonlocal gear_forwards
        gear_forwards += 1
        return real(*a, **k)

    trainer._final_hidden = counted
    ema_gathers = measure_ema_gathers(trainer)
    steps: list[dict] = []  # the policy's full weights after each optimizer step

    class Snapshot(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            steps.append(full_parameters(trainer, trainer.model_wrapped))  # every rank gathers

    trainer.add_callback(Snapshot())
    restored: dict = {}
    if args.resume and args.teacher != "current":

        class Restored(TrainerCallback):
            def on_train_begin(self, *_: object, **__: object) -> None:  # after the loading
                restored.update(restored_teacher(trainer, args.resume))

        trainer.add_callback(Restored())
    trainer.train(resume_from_checkpoint=args.resume)
    final = full_parameters(trainer, trainer.model_wrapped)
    teacher = full_parameters(trainer, trainer.teacher_model)
    # what a checkpoint holds: the teacher's full tensors, its float32 EMA masters where it has
    # them (a teacher below float32); collective
    state = None if trainer.teacher_model is None else teacher_state(trainer.teacher_model)
    logs = [h for h in trainer.state.log_history if "gear/kl_mean" in h]
    changed = sorted(k for k in final if not torch.equal(initial[k], final[k]))
    summary = {
        "backend": args.backend,
        "teacher": args.teacher,
        "peft": args.peft,
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "steps": trainer.state.global_step,
        "params_changed": len(changed),
        "param_checksum": checksum(final),
        "teacher_checksum": checksum(teacher),
        "teacher_state_checksum": checksum(state),
        "dtype": args.dtype,
        "teacher_dtypes": sorted({str(v.dtype) for v in (teacher_values(trainer) or [])}),
        "gear_forward_passes": gear_forwards,
        "policy_storage": storage(trainer.model_wrapped),
        "teacher_storage": storage(trainer.teacher_model),
        "kl_mean": [h["gear/kl_mean"] for h in logs],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if restored:
        summary["restored_teacher"] = restored
    if ema_gathers is not None:
        summary["ema_gathers"] = ema_gathers
    masters = {k: v.double() for k, v in (state or {}).items() if k in (teacher or {})}
    summary["teacher_check"] = teacher_check(args, initial, steps, masters or teacher, trainer)
    return summary


def measure_ema_gathers(trainer: GEARTrainer) -> dict | None:
    """Under ZeRO-3 with a full-model EMA teacher: at every gather the EMA update enters, the
    number of elements of both models that are whole (`ds_status` AVAILABLE) on this rank; the
    returned dict fills in during training: its peak, the largest module's own parameters (one
    model) and both whole models, in elements."""
    teacher = trainer.teacher_model
    if teacher is None or not hasattr(teacher, "module"):  # not a DeepSpeed engine
        return None
    if not any(hasattr(p, "ds_id") for p in teacher.module.parameters()):  # ZeRO-2
        return None
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    stats = {"gathers": 0, "peak_available": 0}
    params: list = []  # both models' parameters, once the policy is partitioned (in train())
    real = deepspeed.zero.GatheredParameters

    class Measured(real):
        def __enter__(self):
            super().__enter__()
            stats["gathers"] += 1
            available = sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
            stats["peak_available"] = max(stats["peak_available"], available)

    update = trainer.update_ema_teacher

    def measured_update() -> None:
        if not params:
            policy = trainer.accelerator.unwrap_model(trainer.model)
            params.extend([*teacher.module.parameters(), *policy.parameters()])
            stats["both_models"] = sum(p.ds_numel for p in params)
            stats["largest_module"] = max(
                sum(p.ds_numel for p in m.parameters(recurse=False))
                for m in teacher.module.modules()
            )
        deepspeed.zero.GatheredParameters = Measured
        try:
            update()
        finally:
            deepspeed.zero.GatheredParameters = real

    trainer.update_ema_teacher = measured_update
    return stats


def teacher_values(trainer: GEARTrainer) -> list | None:
    model = trainer.teacher_model
    return None if model is None else list(model.parameters())


def restored_teacher(trainer: GEARTrainer, checkpoint: str) -> dict:
    """The teacher just restored from `checkpoint` against the file it was restored from: the
    same names, full shapes and values, bit for bit (its float32 masters included)."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(checkpoint, TEACHER_FILE))
    now = teacher_state(trainer.teacher_model)  # collective
    if set(saved) != set(now):
        return {"ok": False, "differing_names": sorted(set(saved) ^ set(now))[:5]}
    wrong = sorted(
        k
        for k in saved
        if saved[k].shape != now[k].shape
        or saved[k].dtype != now[k].dtype
        or not torch.equal(saved[k], now[k])
    )
    return {"ok": not wrong, "tensors": len(saved), "differing": wrong[:5]}


def teacher_check(args, initial, steps, teacher, trainer) -> dict:
    """The teacher after training against the policy's weights: frozen = the initial weights
    exactly; EMA = the recursion T_k = d T_(k-1) + (1 - d) theta_k over the recorded steps."""
    if args.teacher == "current":
        return {"ok": trainer.teacher_model is None}
    if args.peft:  # the policy itself: adapter disabled (frozen) or float32 EMA adapter values
        values = trainer.teacher_model.values
        owns = sum(p.numel() for p in trainer.teacher_model.parameters())
        if args.teacher == "frozen":
            return {"ok": values is None and owns == 0, "owned_parameters": owns}
        fp32 = all(v.dtype == torch.float32 for v in values.values())
        adapter_only = all(".lora_" in n for n in values)
        return {"ok": owns == 0 and fp32 and adapter_only, "ema_tensors": len(values)}
    if args.resume:  # the recursion started before the checkpoint: compare with a full run
        return {"ok": True, "skipped": "resumed run"}
    if set(initial) != set(teacher):
        return {"ok": False, "differing_names": sorted(set(initial) ^ set(teacher))[:5]}
    expected = dict(initial)
    if args.teacher == "ema":
        for theta in steps:
            expected = {
                k: args.ema_decay * v + (1 - args.ema_decay) * theta[k] for k, v in expected.items()
            }
    error = max(float((teacher[k] - expected[k]).abs().max()) for k in expected)
    moved = max(float((teacher[k] - initial[k]).abs().max()) for k in expected)
    ok = error <= 1e-5 and (args.teacher == "frozen" or moved > 1e-4)
    return {"ok": ok, "max_error": error, "max_moved": moved, "steps_recorded": len(steps)}


def check(args: argparse.Namespace) -> bool:
    """Train one configuration; rank 0 compares the ranks' summaries and writes the verdict."""
    os.makedirs(args.output_dir, exist_ok=True)
    summary = run(args)
    print("GEAR_RANK " + json.dumps(summary), flush=True)
    # the ranks share one stdout, where lines can interleave: also leave a file per rank
    with open(os.path.join(args.output_dir, f"gear_rank{summary['rank']}.json"), "w") as f:
        json.dump(summary, f)
    if not dist.is_initialized():
        return summary["teacher_check"]["ok"]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, summary)
    same_weights = len({(s["param_checksum"], s["teacher_checksum"]) for s in everyone}) == 1
    same_forwards = len({s["gear_forward_passes"] for s in everyone}) == 1
    moved = all(s["params_changed"] > 0 for s in everyone)
    teacher_ok = all(s["teacher_check"]["ok"] for s in everyone)
    ok = same_weights and same_forwards and moved and teacher_ok
    if summary["rank"] == 0:
        verdict = {
            "ok": ok,
            "backend": args.backend,
            "teacher": args.teacher,
            "peft": args.peft,
            "world_size": len(everyone),
            "identical_weights": same_weights,
            "same_gear_forward_passes": same_forwards,
            "policy_moved": moved,
            "teacher_ok": teacher_ok,
            "seconds": max(s["seconds"] for s in everyone),
        }
        print("GEAR_OK " + json.dumps(verdict), flush=True)
        with open(os.path.join(args.output_dir, "gear_ok.json"), "w") as f:
            json.dump(verdict, f)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=BACKENDS, default="ddp")
    parser.add_argument(
        "--teacher",
        default="current",
        help="current, frozen or ema; a comma-separated list trains each in turn in the same "
        "processes (one launch), into OUTPUT_DIR/<teacher>",
    )
    parser.add_argument("--ema-decay", type=float, default=0.5)
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="per-device batch size")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the policy's weights (TRL's dtype='auto' gives bfloat16 for most checkpoints)",
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (bf16=True)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--teacher-path",
        action="store_true",
        help="frozen teacher: pass the initial weights as a path (loaded under zero.Init)",
    )
    parser.add_argument("--save", action="store_true", help="save a checkpoint every step")
    parser.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    teachers = args.teacher.split(",")
    unknown = sorted(set(teachers) - {"current", "frozen", "ema"})
    if unknown:
        parser.error(f"--teacher: expected current, frozen or ema, got {unknown}")
    warnings.filterwarnings("ignore")

    results = {}
    for teacher in teachers:
        out = args.output_dir if len(teachers) == 1 else os.path.join(args.output_dir, teacher)
        results[teacher] = check(
            argparse.Namespace(**{**vars(args), "teacher": teacher, "output_dir": out})
        )
    if not dist.is_initialized():
        sys.exit(0 if all(results.values()) else 1)
    if len(teachers) > 1 and dist.get_rank() == 0:
        with open(os.path.join(args.output_dir, "gear_ok.json"), "w") as f:
            json.dump({"ok": all(results.values()), "teachers": results}, f)
    dist.barrier()
    dist.destroy_process_group()  # a live gloo group at exit can abort the process (SIGABRT)
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""One training step of GEAR vs GRPO: same model, batch and seed, in one process, alternated.

GRPO is TRL's own `GRPOTrainer`; GEAR is the `GEARTrainer` that `gear train` builds (gear.app.train;
credit_method="gear", current teacher) with each group's teacher prompt computed once
(`prefix_sharing=True`, the default); "gear_unshared" is GEAR with `prefix_sharing=False` (the
plain teacher pass, "before"). Each repeat trains every method from the same initial weights for
--steps steps (the first step of each run is warm-up and not counted), rotating which goes
first. Reported per step: wall time (optimizer included) and its breakdown: generation, GEAR's
teacher prompts + teacher pass, student pass, signals (KL/entropy), credit, and the rest (loss
forward/backward, optimizer).

    .venv/bin/python -m benchmarks.step --no-bf16              # embedded SmolLM2, 16 completions
    .venv/bin/python -m benchmarks.step --model /path/to/model --steps 4 --repeats 3
    .venv/bin/python -m benchmarks.step --methods grpo,gear    # without the "before" arm
    .venv/bin/python -m benchmarks.step --no-bf16 --lora 16 --completions 32 --generations 4 \
        --completion-length 32 --temperature 0.7 --methods grpo,gear   # gear train's recipe

With `--teacher-engine vllm` (run it in .venv-vllm) the arms are instead two GEAR runs that both
generate with vLLM (colocate, eager) and differ only in what scores the teacher: the trainer's
forward or vLLM's prompt log-probs (`teacher_engine`; k1 estimator, temperature 1, which the
vLLM teacher needs). Its teacher seconds per step go to step.json under `teacher_engine`:

    .venv-vllm/bin/python -m benchmarks.step --teacher-engine vllm --no-bf16 --completions 8 \
        --generations 4 --completion-length 32 --steps 3 --repeats 1

`--methods grpo,gear,gear_contrast` adds GEAR with `teacher_context="contrast"` (issue 36: the
right-answer teacher's KL minus a wrong-answer teacher's, one more teacher pass, timed as
`contrast_s`); its figures go to step.json under `teacher_context_contrast`:

    .venv/bin/python -m benchmarks.step --no-bf16 --lora 16 --completions 32 --generations 4 \
        --completion-length 32 --temperature 0.7 --methods grpo,gear,gear_contrast

With `--lora R` every arm trains a LoRA adapter of rank R (gear train's `lora_r`: the same
PEFT config for TRL's trainer and GEAR's); its result is kept under `lora_r<R>` in step.json
beside the full fine-tuning figures.

Beside the step ratio it reports the non-generation ratio (step minus generation, GEAR over
GRPO), the share of rows GEAR left unscored (`gear/rows_skipped`: advantage 0), and GEAR's
teacher pass per 1k teacher tokens against a plain no-grad forward of the same model per 1k
tokens. `--tie-share S` replaces the task's reward by `gear.testing.tied_reward(S)` (a share S
of the prompts tie, the rest vary), so that a randomly initialised model, whose task reward is 0
everywhere, still exercises the teacher; `--random-init` takes only the config and tokenizer
of `--model` (a directory) and initialises the weights at random, for timing at a shape whose
weights are not at hand (a GPU, `benchmarks/gpu.sh step`):

    python -m benchmarks.step --model .cache/smollm2-1.7b-shape --random-init --tie-share 0.5 \
        --completions 64 --generations 8 --completion-length 256 --methods grpo,gear
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from benchmarks.common import RESULTS, machine, print_table, write_json
from gear.app.config import checkpointing_field
from gear.testing import tied_reward

CHECKPOINTING = checkpointing_field(TrainingArguments)  # renamed in transformers 5.18
GEAR_TIMES = ("teacher_prompts", "teacher", "student", "signals", "contrast", "influence", "credit")
#: arms of `run` named after the credit method they train with (benchmarks/oar.py)
CREDIT_ARMS = ("oar_g", "oar_p")
METHODS = (
    "grpo",
    "gear",
    "gear_unshared",
    "gear_contrast",
    "gear_before",
    "gear_shared_loss",
    "grpo_shared_loss",
)
#: issue 61's arms: TRL's log-prob passes share each group's prompt (`loss_prefix_sharing`);
#: grpo_shared_loss is GEARTrainer with credit_method="grpo" (no teacher), so that GEAR's own
#: overhead can be read against a GRPO step that shares its prompts too
SHARED_LOSS = {"gear_shared_loss": "gear", "grpo_shared_loss": "grpo"}


class StepClock(TrainerCallback):
    """Wall time of each optimiser step (generation, loss, backward and optimizer), and the
    process's CPU time (steadier than wall time on a shared machine)."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.cpus: list[float] = []

    def on_step_begin(self, *args: Any, **kw: Any) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def on_step_end(self, *args: Any, **kw: Any) -> None:
        self.walls.append(time.perf_counter() - self.t0)
        self.cpus.append(time.process_time() - self.c0)


def trainer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig fields every arm trains with (GEAR's arms add their own)."""
    return dict(
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.completions,
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        temperature=args.temperature,
        beta=0.0,
        bf16=args.bf16,
        # transformers 5.18 renamed it; .venv-vllm (the vLLM arms) has an older one
        **{CHECKPOINTING: False},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def run(
    method: str,
    model0: Any,
    tokenizer: Any,
    dataset: Any,
    args: argparse.Namespace,
    out: str,
    extra: dict | None = None,
) -> list[dict]:
    from trl import GRPOConfig, GRPOTrainer

    from gear.app.config import resolve_values, trainer_args
    from gear.app.preflight import lora_config
    from gear.app.train import build_trainer
    from gear.tasks import get_task

    task = get_task("arithmetic")
    fields = trainer_fields(args)
    model = copy.deepcopy(model0)
    clock = StepClock()
    peft_config = lora_config(resolve_values({"lora_r": args.lora}))  # None without --lora
    if (
        getattr(args, "tie_share", None) is not None
    ):  # both arms (gear.app.train's build_trainer reads task.reward)
        task = copy.copy(task)
        task.reward = tied_reward(args.tie_share)
    reward = task.reward
    common = dict(  # what both trainers are given besides their config
        model=model,
        reward_funcs=[reward],
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        peft_config=peft_config,
    )
    if method == "grpo":  # TRL's own trainer: the baseline GEAR's cost is measured against
        config = GRPOConfig(
            **fields, output_dir=out, seed=args.seed, use_cpu=not torch.cuda.is_available()
        )
        trainer = GRPOTrainer(args=config, **common)
    else:  # gear train's recipe (gear.app.train) with this config
        gear = dict(
            credit_method=method if method in CREDIT_ARMS else SHARED_LOSS.get(method, "gear"),
            teacher="current",
            credit_log_steps=0,
            prefix_sharing=method != "gear_unshared",
            loss_prefix_sharing=method in SHARED_LOSS,
        ) | (extra or {})
        if method == "gear_contrast":  # the right-answer teacher minus a wrong-answer one
            gear["teacher_context"] = "contrast"
        if method == "gear_before":  # issue 48's "before": every row scored, LoRA unmerged
            gear |= {"skip_zero_advantage_rows": False, "merge_lora_passes": False}
        if extra:  # the vLLM arms: gear.app.train needs the newer transformers of .venv
            from gear.integrations.trl import GEARConfig, GEARTrainer

            config = GEARConfig(
                **fields, **gear, output_dir=out, seed=args.seed, hint_kind=task.hint_kind
            )
            trainer = GEARTrainer(args=config, **common)
        else:
            cfg = resolve_values(
                {
                    "model": args.model,
                    "task": "arithmetic",
                    "seed": args.seed,
                    "trainer": fields | gear,
                }
            )
            targs = trainer_args(cfg, Path(out), hint_kind=task.hint_kind)
            trainer = build_trainer(targs, model, tokenizer, task, dataset, [clock], peft_config)
    gen_times: list[float] = []
    original = trainer._generate

    def timed_generate(prompts: list) -> Any:
        t0 = time.perf_counter()
        result = original(prompts)
        gen_times.append(time.perf_counter() - t0)
        return result

    trainer._generate = timed_generate
    logs: list[dict] = []
    trainer.add_callback(_LogTap(logs))
    trainer.train()
    rows = []
    gear_logs = [entry for entry in logs if "step_time" in entry]
    for i, wall in enumerate(clock.walls):
        entry = gear_logs[i] if i < len(gear_logs) else {}
        row = {
            "method": method,
            "step": i + 1,
            "wall_s": wall,
            "cpu_s": clock.cpus[i],
            "generation_s": gen_times[i],
            "completion_tokens": entry.get("num_tokens"),
            "completion_mean_length": entry.get("completions/mean_length"),
            "rows_skipped": float(entry.get("gear/rows_skipped", 0.0)),
            "teacher_tokens": float(entry.get("gear/teacher_tokens", 0.0)),
        }
        for name in GEAR_TIMES:
            row[f"{name}_s"] = float(entry.get(f"gear/time_{name}", 0.0))
        row["rest_s"] = wall - row["generation_s"] - sum(row[f"{n}_s"] for n in GEAR_TIMES)
        row["non_generation_s"] = wall - row["generation_s"]
        rows.append(row)
    return rows


def plain_forward_per_1k(model: Any, tokenizer: Any, args: argparse.Namespace) -> float:
    """Seconds per 1k tokens of a plain no-grad forward of `model` (eval mode, the run's
    precision, one position of logits as the teacher pass asks): a batch of --completions rows
    of 256 random tokens, the median of 3 after one warm-up. The teacher pass's target is at
    most 1.1x this per token."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = copy.deepcopy(model).to(device).eval()
    ids = torch.randint(100, min(len(tokenizer), 30000), (args.completions, 256), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.bf16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    with torch.no_grad(), autocast:
        for _ in range(4):
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
            sync()
            times.append(time.perf_counter() - t0)
    del model
    return statistics.median(times[1:]) / (ids.numel() / 1000)


def random_model_and_data(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """A model of `--model`'s config (a directory) with random weights (seeded), its tokenizer,
    and the arithmetic task's training set: timing at a shape whose weights are not at hand."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gear.tasks import get_task

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task = get_task("arithmetic")
    return model, task.prepare_tokenizer(tokenizer), task.dataset("train", n=256, seed=args.seed)


class _LogTap(TrainerCallback):
    def __init__(self, sink: list[dict]) -> None:
        self.sink = sink

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
    ) -> None:
        if logs:
            self.sink.append(dict(logs))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--completions", type=int, default=16, help="completions per step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--completion-length", type=int, default=48)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank of every arm (0: full)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--learning-rate",
        type=float,
        default=0.0,
        help="0 (default) keeps the weights, so both methods sample the same completions every "
        "step and the ratio measures GEAR's cost alone; the optimizer still runs",
    )
    ap.add_argument(
        "--methods",
        default="grpo,gear,gear_unshared",
        help="comma-separated, from grpo, gear (prefix sharing on), gear_unshared (off), "
        "gear_contrast (teacher_context='contrast': one more teacher pass, kept under "
        "'teacher_context_contrast'), gear_before (no teacher skip, LoRA passes unmerged: "
        "GEAR before issue 48), gear_shared_loss and grpo_shared_loss (GEAR and GEARTrainer's "
        "GRPO with loss_prefix_sharing: issue 61, kept under '<lora key>_loss_prefix_sharing'); "
        "grpo and gear are required",
    )
    ap.add_argument("--name", default="step")
    ap.add_argument(
        "--tie-share",
        type=float,
        default=None,
        help="replace the task reward by gear.testing.tied_reward(S): a share S of the prompts "
        "tie (advantage 0), the others' completions get varying rewards",
    )
    ap.add_argument(
        "--random-init",
        action="store_true",
        help="--model is a directory with a config and tokenizer; initialise its weights at "
        "random (timing only)",
    )
    ap.add_argument(
        "--teacher-engine",
        choices=("trainer", "vllm"),
        default="trainer",
        help="vllm: compare GEAR's teacher scored by the trainer and by vLLM, both generating "
        "with vLLM colocate (needs .venv-vllm); trainer: the GRPO / GEAR comparison",
    )
    args = ap.parse_args()
    if args.teacher_engine == "vllm":
        return engine_arms(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not {"grpo", "gear"} <= set(methods) or not set(methods) <= set(METHODS):
        ap.error(f"--methods: expected grpo, gear and optionally gear_unshared, got {methods}")

    import tempfile
    import warnings

    from transformers.utils import logging as hf_logging

    from gear.app.config import resolve_values
    from gear.app.train import load_model_and_data
    from gear.tasks import get_task

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # loaded once: every arm and repeat starts from a copy of the same weights
    if args.random_init:
        model0, tokenizer, dataset = random_model_and_data(args)
    else:
        cfg = resolve_values({"model": args.model, "train_size": 256, "seed": args.seed})
        model0, tokenizer, dataset = load_model_and_data(cfg, get_task("arithmetic"))
    rows: list[dict] = []
    for rep in range(args.repeats):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for method in order:
            with tempfile.TemporaryDirectory() as out:
                result = run(method, model0, tokenizer, dataset, args, out)
            for r in result:
                r["repeat"] = rep
                print(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                    flush=True,
                )
            rows += result

    measured = [r for r in rows if r["step"] > 1]
    forward_per_1k = plain_forward_per_1k(model0, tokenizer, args)
    summary = []
    cols = [
        "wall_s",
        "non_generation_s",
        "cpu_s",
        "generation_s",
        "teacher_prompts_s",
        "teacher_s",
        "student_s",
        "signals_s",
        "contrast_s",
        "credit_s",
        "rest_s",
        "rows_skipped",
        "teacher_tokens",
    ]
    for method in methods:
        mine = [r for r in measured if r["method"] == method]
        summary.append(
            {
                "method": method,
                "steps": len(mine),
                **{c: statistics.median(r[c] for r in mine) for c in cols},
            }
        )
    by = {s["method"]: s for s in summary}
    grpo, gear = by["grpo"], by["gear"]
    ratio = gear["wall_s"] / grpo["wall_s"]
    credit_share = gear["credit_s"] / gear["wall_s"]
    non_generation_ratio = gear["non_generation_s"] / grpo["non_generation_s"]
    skipped_share = gear["rows_skipped"] / args.completions
    teacher_per_1k = (
        gear["teacher_s"] / (gear["teacher_tokens"] / 1000) if gear["teacher_tokens"] else None
    )
    print_table(
        summary,
        ["method", "steps", *cols],
        "Median seconds per step (first step of each run excluded)",
    )
    print(
        f"\nGEAR / GRPO step time: {ratio:.3f}   credit share of a GEAR step: {100 * credit_share:.2f}%"
    )
    per_pair = defaultdict(dict)
    for r in measured:
        per_pair[(r["repeat"], r["step"])][r["method"]] = r["wall_s"]
    pair_ratios = [p["gear"] / p["grpo"] for p in per_pair.values() if {"gear", "grpo"} <= set(p)]
    by_pair = defaultdict(dict)
    for r in measured:
        by_pair[(r["repeat"], r["step"])][r["method"]] = r
    components = {  # GEAR / GRPO per paired step, by component
        name: [
            p["gear"][name] / p["grpo"][name]
            for p in by_pair.values()
            if {"gear", "grpo"} <= set(p) and p["grpo"][name] > 0
        ]
        for name in ("wall_s", "non_generation_s", "generation_s", "rest_s")
    }
    print(
        f"GEAR / GRPO outside generation: {non_generation_ratio:.3f}   paired step ratios: "
        f"median {statistics.median(pair_ratios):.3f} over {len(pair_ratios)}   rows skipped: "
        f"{100 * skipped_share:.0f}%"
    )
    if teacher_per_1k is not None:
        print(
            f"teacher pass {teacher_per_1k:.4f} s per 1k teacher tokens; plain no-grad forward "
            f"{forward_per_1k:.4f} s per 1k tokens: {teacher_per_1k / forward_per_1k:.2f}x"
        )
    extra: dict[str, Any] = {}
    if "gear_unshared" in by:
        before = by["gear_unshared"]
        extra = {
            "ratio_unshared": before["wall_s"] / grpo["wall_s"],
            "ratio_unshared_cpu": before["cpu_s"] / grpo["cpu_s"],
            "paired_ratios_unshared": [
                p["gear_unshared"] / p["grpo"]
                for p in per_pair.values()
                if {"gear_unshared", "grpo"} <= set(p)
            ],
            "teacher_s_unshared": before["teacher_s"],
            "teacher_s_shared": gear["teacher_s"],
            "teacher_share_of_unshared": gear["teacher_s"] / before["teacher_s"],
        }
        print(
            f"GEAR without prefix sharing / GRPO: {extra['ratio_unshared']:.3f}   teacher pass "
            f"{before['teacher_s']:.2f} s -> {gear['teacher_s']:.2f} s "
            f"({100 * extra['teacher_share_of_unshared']:.0f}%)"
        )
    if "gear_contrast" in by:
        contrast = by["gear_contrast"]
        extra |= {
            "ratio_contrast": contrast["wall_s"] / grpo["wall_s"],
            "contrast_over_gear": contrast["wall_s"] / gear["wall_s"],
            "contrast_pass_s": contrast["contrast_s"],
            "teacher_s_contrast": contrast["teacher_s"],
        }
        print(
            f"GEAR with the contrast teacher / GRPO: {extra['ratio_contrast']:.3f}, / GEAR: "
            f"{extra['contrast_over_gear']:.3f}   its second teacher pass "
            f"{contrast['contrast_s']:.2f} s"
        )
    if "gear_before" in by:
        old = by["gear_before"]
        extra |= {
            "ratio_before": old["wall_s"] / grpo["wall_s"],
            "ratio_before_cpu": old["cpu_s"] / grpo["cpu_s"],
            "non_generation_ratio_before": old["non_generation_s"] / grpo["non_generation_s"],
            "teacher_s_before": old["teacher_s"],
            "signals_s_before": old["signals_s"],
            "paired_ratios_before": [
                p["gear_before"] / p["grpo"]
                for p in per_pair.values()
                if {"gear_before", "grpo"} <= set(p)
            ],
        }
        print(
            f"GEAR before issue 48 (every row scored, LoRA unmerged) / GRPO: "
            f"{extra['ratio_before']:.3f}   teacher {old['teacher_s']:.2f} s -> "
            f"{gear['teacher_s']:.2f} s, signals {old['signals_s']:.2f} s -> {gear['signals_s']:.2f} s"
        )
    if set(SHARED_LOSS) <= set(by):
        shared_gear, shared_grpo = by["gear_shared_loss"], by["grpo_shared_loss"]
        extra |= {
            "loss_prefix_sharing": {
                "gear_over_gear_plain_loss": shared_gear["wall_s"] / gear["wall_s"],
                "grpo_over_trl_grpo": shared_grpo["wall_s"] / grpo["wall_s"],
                "gear_over_grpo_both_shared": shared_gear["wall_s"] / shared_grpo["wall_s"],
                "gear_over_trl_grpo": shared_gear["wall_s"] / grpo["wall_s"],
                "paired_gear_over_grpo_both_shared": [
                    p["gear_shared_loss"] / p["grpo_shared_loss"]
                    for p in per_pair.values()
                    if set(SHARED_LOSS) <= set(p)
                ],
            }
        }
        ls = extra["loss_prefix_sharing"]
        print(
            f"loss_prefix_sharing: GEAR {gear['wall_s']:.2f} -> {shared_gear['wall_s']:.2f} s "
            f"({ls['gear_over_gear_plain_loss']:.3f}x), GRPO {grpo['wall_s']:.2f} -> "
            f"{shared_grpo['wall_s']:.2f} s ({ls['grpo_over_trl_grpo']:.3f}x); GEAR / GRPO "
            f"both shared: {ls['gear_over_grpo_both_shared']:.3f}"
        )
    result = {
        "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
        "precision": "bf16 autocast" if args.bf16 else "float32",
        "args": vars(args),
        "rows": rows,
        "summary": summary,
        "ratio": ratio,
        "ratio_cpu": gear["cpu_s"] / grpo["cpu_s"],
        "paired_ratios": pair_ratios,
        "median_paired_ratio": statistics.median(pair_ratios),
        "non_generation_ratio": non_generation_ratio,
        "paired_component_ratios": {
            k: statistics.median(v) if v else None for k, v in components.items()
        },
        "rows_skipped_share": skipped_share,
        "teacher_s_per_1k_tokens": teacher_per_1k,
        "plain_forward_s_per_1k_tokens": forward_per_1k,
        "teacher_over_forward_per_token": (
            None if teacher_per_1k is None else teacher_per_1k / forward_per_1k
        ),
        **extra,
        "credit_share": credit_share,
    }
    if torch.cuda.is_available():
        result["machine"]["gpu"] = torch.cuda.get_device_name()
    # beside the full fine-tuning figures of the same file: a LoRA run, a contrast run
    key = f"lora_r{args.lora}" if args.lora else None
    key = "teacher_context_contrast" if "gear_contrast" in methods else key
    if set(SHARED_LOSS) <= set(methods):
        key = f"{key or 'full'}_loss_prefix_sharing"
    if key:
        path = RESULTS / f"{args.name}.json"
        kept = json.loads(path.read_text()) if path.is_file() else {}
        result = kept | {key: result}
    write_json(args.name, result)


ENGINE_ARMS = ("trainer", "vllm")


def engine_arms(args: argparse.Namespace) -> None:
    """GEAR with the teacher scored by the trainer vs by vLLM, both generating with vLLM
    colocate; the median teacher seconds per step (first step excluded) into step.json."""
    import os
    import tempfile
    import warnings
    from functools import partial

    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoModelForCausalLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from gear.tasks import get_task

    warnings.filterwarnings("ignore")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM's CPU torch.compile takes minutes per engine; TRL's colocate LLM(...) hides the flag
    vllm_generation.LLM = partial(vllm_generation.LLM, enforce_eager=True)
    args.temperature = 1.0  # the vLLM teacher's prompt log-probs are at temperature 1
    from gear.models import load_model_and_tokenizer

    task = get_task("arithmetic")
    model, tokenizer = load_model_and_tokenizer(args.model)
    tokenizer = task.prepare_tokenizer(tokenizer)
    dataset = task.dataset("train", n=256, seed=args.seed)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)  # vLLM loads the policy from a path
        tokenizer.save_pretrained(saved)
        model0 = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        for rep in range(args.repeats):
            for engine in ENGINE_ARMS[rep % 2 :] + ENGINE_ARMS[: rep % 2]:
                extra = dict(
                    use_vllm=True,
                    vllm_mode="colocate",
                    vllm_gpu_memory_utilization=0.3,
                    kl_estimator="k1",
                    teacher_engine=engine,
                )
                with tempfile.TemporaryDirectory() as out:
                    result = run(
                        f"gear_{engine}_teacher", model0, tokenizer, dataset, args, out, extra
                    )
                cleanup_dist_env_and_memory()  # the engine, before the next arm builds one
                for r in result:
                    r["repeat"], r["teacher_engine"] = rep, engine
                    print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
                rows += result
    measured = [r for r in rows if r["step"] > 1]
    cols = ["wall_s", "generation_s", "teacher_s", "student_s", "signals_s", "rest_s"]
    summary = [
        {
            "teacher_engine": engine,
            "steps": len(mine := [r for r in measured if r["teacher_engine"] == engine]),
            **{c: statistics.median(r[c] for r in mine) for c in cols},
        }
        for engine in ENGINE_ARMS
    ]
    print_table(summary, ["teacher_engine", "steps", *cols], "Median seconds per step")
    by = {s["teacher_engine"]: s for s in summary}
    ratio = by["vllm"]["teacher_s"] / by["trainer"]["teacher_s"]
    print(f"\nteacher seconds per step, vLLM / trainer: {ratio:.3f}")
    path = RESULTS / f"{args.name}.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    write_json(
        args.name,
        kept
        | {
            "teacher_engine": {
                "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
                "precision": "trainer float32, vLLM its CPU default (bfloat16)",
                "args": vars(args),
                "rows": rows,
                "summary": summary,
                "teacher_ratio_vllm_over_trainer": ratio,
            }
        },
    )


if __name__ == "__main__":
    main()

"""The teacher pass on long prompts: plain forward vs each group's prompt computed once.

Teacher rows as GEARTrainer builds them (`gear.teacher.teacher_prompt`: the task's chat prompt
with the ground truth appended as a hint, SmolLM2's chat template), G completions per prompt:
the reference answer's tokens cut at random lengths (right-padded), standing in for sampled
completions (the cost does not depend on which tokens they are). Both passes run the same model,
float32 by default, no grad, alternated (the first repeat is not counted); reported: median
wall seconds and median CPU seconds of this process (`time.process_time`: on a shared machine
the CPU time is the steadier measure of the work; run with OMP_NUM_THREADS=1 so that no
spinning thread inflates it), and the largest per-token KL(plain || shared) between the two
passes' teacher distributions (0 up to float rounding).

    .venv/bin/python -m benchmarks.teacher_pass --task bfcl       # function docs in the prompt
    .venv/bin/python -m benchmarks.teacher_pass --task gsm8k      # reference solution as hint
    .venv/bin/python -m benchmarks.teacher_pass --task arithmetic --completion-length 48
                                                                  # the default run's rows
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine, print_table, write_json

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def rows(task_name: str, tokenizer, n_prompts: int, G: int, T: int, seed: int):
    """Student ids/mask, teacher ids/mask (B, P + T), completion ids, policy mask (B, T)."""
    from torch.nn.utils.rnn import pad_sequence

    from gear.tasks import get_task
    from gear.teacher import HINT_TEMPLATES, teacher_prompt

    if task_name == "bfcl":
        task = get_task("bfcl", data_dir=str(DATA / "bfcl"))
    elif task_name == "gsm8k":
        task = get_task("gsm8k", path=str(DATA / "gsm8k"))
    else:  # the default run's task (short prompts)
        task = get_task("arithmetic")
    data = task.dataset("train", n=n_prompts, seed=seed)
    template = HINT_TEMPLATES["tool" if task_name == "bfcl" else "math"]
    g = torch.Generator().manual_seed(seed)

    def render(prompt) -> list[int]:
        out = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return list(out)

    student, teacher, completions = [], [], []
    for row in data:
        s, t = (
            render(row["prompt"]),
            render(teacher_prompt(row["prompt"], row["ground_truth"], template)),
        )
        answer = tokenizer(str(row["ground_truth"]), add_special_tokens=False)["input_ids"]
        answer = (answer * (T // max(len(answer), 1) + 1))[:T]
        for _ in range(G):
            n = int(torch.randint(T // 2, T + 1, (1,), generator=g))
            completions.append(torch.tensor(answer[:n]))
            student.append(torch.tensor(s))
            teacher.append(torch.tensor(t))
    pad = tokenizer.pad_token_id

    def left(seqs):
        ids = pad_sequence(seqs, batch_first=True, padding_value=pad, padding_side="left")
        ones = [torch.ones(len(x), dtype=torch.long) for x in seqs]
        return ids, pad_sequence(ones, batch_first=True, padding_value=0, padding_side="left")

    c_ids = pad_sequence(completions, batch_first=True, padding_value=pad)
    if c_ids.size(1) < T:
        c_ids = torch.nn.functional.pad(c_ids, (0, T - c_ids.size(1)), value=pad)
    c_mask = torch.zeros_like(c_ids)
    for i, c in enumerate(completions):
        c_mask[i, : len(c)] = 1
    s_ids, s_mask = left(student)
    t_ids, t_mask = left(teacher)
    return (
        torch.cat([s_ids, c_ids], 1),
        torch.cat([s_mask, c_mask], 1),
        torch.cat([t_ids, c_ids], 1),
        torch.cat([t_mask, c_mask], 1),
        c_ids,
        c_mask,
        [len(x) for x in teacher[::G]],
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--task", choices=("bfcl", "gsm8k", "arithmetic"), default="bfcl")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=2, help="prompts (groups) per batch")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--completion-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="rows per forward (as TRL's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="results file (default step_teacher_<task>)")
    args = ap.parse_args()

    import warnings

    from transformers.utils import logging as hf_logging

    from gear.credit.signals import signals_from_hidden
    from gear.models import load_model_and_tokenizer
    from gear.prefix import plain_hidden, prefix_shared_hidden

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.eval()
    T = args.completion_length
    _, _, t_ids, t_mask, c_ids, c_mask, lengths = rows(
        args.task, tokenizer, args.prompts, args.generations, T, args.seed
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    passes = {
        "plain": lambda: plain_hidden(model, t_ids, t_mask, T, batch_size=args.batch_size),
        "shared_prefix": lambda: prefix_shared_hidden(
            model, t_ids, t_mask, T, batch_size=args.batch_size
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in passes}
    cpu: dict[str, list[float]] = {k: [] for k in passes}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=args.bf16):
        for rep in range(args.repeats + 1):  # repeat 0: warm-up, and the states compared below
            for name in list(passes)[:: 1 if rep % 2 == 0 else -1]:
                t0, c0 = time.perf_counter(), time.process_time()
                hidden = passes[name]()
                elapsed, used = time.perf_counter() - t0, time.process_time() - c0
                if rep == 0:
                    out[name] = hidden
                else:
                    times[name].append(elapsed)
                    cpu[name].append(used)
                print(f"repeat {rep} {name}: {elapsed:.3f} s wall, {used:.3f} s CPU", flush=True)
    W = model.get_output_embeddings().weight
    mask = c_mask.bool()
    kl = signals_from_hidden(
        out["plain"].float(), out["shared_prefix"].float(), W, c_ids, mask=mask
    ).kl
    table = [
        {
            "pass": k,
            "median_s": statistics.median(v),
            "min_s": min(v),
            "median_cpu_s": statistics.median(cpu[k]),
            "rows": t_ids.size(0),
            "tokens_run": t_ids.size(0) * t_ids.size(1)
            if k == "plain"
            else sum(lengths) + t_ids.size(0) * (T - 1),
        }
        for k, v in times.items()
    ]
    share = table[1]["median_s"] / table[0]["median_s"]
    cpu_share = table[1]["median_cpu_s"] / table[0]["median_cpu_s"]
    kl_max = float(kl[mask].abs().max())
    print_table(
        table,
        ["pass", "median_s", "min_s", "median_cpu_s", "rows", "tokens_run"],
        f"Teacher pass, {args.task}: {args.prompts} prompts x {args.generations} completions, "
        f"teacher prompts {lengths} tokens, completions <= {T} ({dtype})",
    )
    print(
        f"\nshared / plain: wall {share:.3f}, CPU {cpu_share:.3f}   "
        f"max KL(plain || shared) {kl_max:.2e}"
    )
    write_json(
        args.name or f"step_teacher_{args.task}",
        {
            "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
            "precision": "bf16 autocast" if args.bf16 else "float32",
            "args": vars(args),
            "teacher_prompt_tokens": lengths,
            "times": times,
            "cpu_times": cpu,
            "threads": torch.get_num_threads(),
            "summary": table,
            "shared_over_plain": share,
            "shared_over_plain_cpu": cpu_share,
            "max_kl_plain_vs_shared": kl_max,
        },
    )


if __name__ == "__main__":
    main()

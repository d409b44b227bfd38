"""TRL's loss pass with and without shared prompts (`loss_prefix_sharing`, issue 61).

One GRPO batch of the embedded SmolLM2-135M with a LoRA adapter (rank 16, every linear, as
`gear train`), TRL's fused LM head at the sampling temperature, in train mode: the loss forward
(log-probs and entropies of the completion tokens) and its backward, timed for TRL's own
`_get_per_token_logps_and_entropies` ("plain") and for `shared_prompt_logps` ("shared"),
alternated, the first repeat of each not counted. Prompts are the task's real chat-templated
prompts (their widths are what sharing saves); completions are random tokens of random lengths
up to the completion width (the compute does not depend on their values). Also checks that the
two agree (log-probs, gradients). Prints a table, writes `benchmarks/results/loss_prefix.json`
under the recipe's name with the CPU capability and thread count.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.loss_prefix              # both recipes
    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.loss_prefix --recipe main_job --repeats 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.common import RESULTS, machine, print_table, write_json

#: name -> (task options, prompts, completions per prompt, completion width, temperature)
RECIPES = {
    "main_job": ({"mix": "1digit:0.8,2digit:0.2"}, 8, 4, 32, 0.7),  # gear train's default
    "headroom": ({"mix": "chain:1"}, 8, 4, 96, 0.7),  # issue 58's study runs
}


def batch(tok, recipe: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's layout: (B, P + T) ids and mask, prompts left-padded, completions right-padded."""
    from gear.tasks import get_task

    options, n_prompts, group, T, _ = RECIPES[recipe]
    rows = get_task("arithmetic", **options).dataset("train", n=n_prompts, seed=seed)
    prompts = [
        tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)["input_ids"]
        for r in rows
    ]  # fmt: skip
    P = max(map(len, prompts))
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n_prompts * group, P + T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(n_prompts * group):
        p = prompts[i // group]
        ids[i, P - len(p) : P], mask[i, P - len(p) : P] = torch.tensor(p), 1
        n = int(torch.randint(T // 4, T + 1, (1,), generator=g))
        ids[i, P : P + n] = torch.randint(3, tok.vocab_size, (n,), generator=g)
        mask[i, P : P + n] = 1
    return ids, mask, T


def policy(temperature: float):
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from gear.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("smollm2")
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(model, lora)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # an adapter that acts (a fresh one is 0: B = 0)
            torch.nn.init.normal_(p, std=0.01)
    return model.train(), tok


def one_pass(how: str, model, ids, mask, T, accelerator) -> tuple[float, float, torch.Tensor, dict]:
    """(forward s, backward s, log-probs, LoRA grads) of one loss pass, plain or shared."""
    from trl import GRPOTrainer

    from gear.integrations.trl.forwards import shared_prompt_logps

    model.zero_grad()
    t0 = time.perf_counter()
    if how == "plain":
        stub = SimpleNamespace(accelerator=accelerator)
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            stub, model, ids, mask, T, compute_entropy=True
        )
    else:
        logps, _ = shared_prompt_logps(accelerator, model, ids, mask, T, None, True)
    t1 = time.perf_counter()
    scored = mask[:, -T:]
    (-(logps * scored).sum() / scored.sum()).backward()
    t2 = time.perf_counter()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return t1 - t0, t2 - t1, logps.detach(), grads


def measure(recipe: str, repeats: int) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, tok = policy(RECIPES[recipe][4])
    ids, mask, T = batch(tok, recipe)
    rows, kept = [], {}
    for rep in range(repeats):
        for how in ("plain", "shared") if rep % 2 == 0 else ("shared", "plain"):
            fwd, bwd, logps, grads = one_pass(how, model, ids, mask, T, accelerator)
            kept[how] = (logps, grads)
            rows.append({"recipe": recipe, "how": how, "repeat": rep, "forward_s": fwd,
                         "backward_s": bwd, "total_s": fwd + bwd})  # fmt: skip
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()},
                  flush=True)  # fmt: skip
    scored = mask[:, -T:].bool()
    (lp_a, g_a), (lp_b, g_b) = kept["plain"], kept["shared"]
    counted = [r for r in rows if r["repeat"] > 0] or rows
    med = {
        how: {k: statistics.median(r[k] for r in counted if r["how"] == how)
              for k in ("forward_s", "backward_s", "total_s")}
        for how in ("plain", "shared")
    }  # fmt: skip
    prompt_width = ids.shape[1] - T
    return {
        "rows": len(ids),
        "prompt_width": prompt_width,
        "completion_width": T,
        "unique_prompts": len({tuple(r) for r in ids[:, :prompt_width].tolist()}),
        "tokens_plain": int(ids.numel()),
        "tokens_shared": RECIPES[recipe][1] * (prompt_width - 1) + len(ids) * (T + 1),
        "median": med,
        "speedup_total": med["plain"]["total_s"] / med["shared"]["total_s"],
        "logp_max_abs_diff": float((lp_a - lp_b)[scored].abs().max()),
        "grad_max_rel_diff": max(
            float((g_a[k] - g_b[k]).norm() / g_a[k].norm().clamp(min=1e-12)) for k in g_a
        ),
        "timings": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", choices=sorted(RECIPES), action="append")
    ap.add_argument(
        "--repeats", type=int, default=3, help="alternated pairs (the first not counted)"
    )
    ap.add_argument("--note", default="", help="what else ran on the machine")
    args = ap.parse_args()
    out = {}
    for recipe in args.recipe or list(RECIPES):
        out[recipe] = measure(recipe, args.repeats)
    table = [
        {"recipe": r, "tokens plain/shared": f"{m['tokens_plain']}/{m['tokens_shared']}",
         **{f"{how} fwd+bwd s": round(m["median"][how]["total_s"], 2) for how in m["median"]},
         "speedup": round(m["speedup_total"], 2), "max |dlogp|": f"{m['logp_max_abs_diff']:.1e}"}
        for r, m in out.items()
    ]  # fmt: skip
    print_table(table, list(table[0]), "TRL's loss pass (forward + backward), median seconds")
    path = RESULTS / "loss_prefix.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    meta = {"machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
            "threads": torch.get_num_threads(), "precision": "float32", "note": args.note}  # fmt: skip
    write_json("loss_prefix", kept | {r: meta | m for r, m in out.items()})


if __name__ == "__main__":
    main()

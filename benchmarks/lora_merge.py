"""The no-grad forward of a LoRA policy (gear's teacher pass) with and without
`gear.modeling.lora.merged_lora`, against the plain model's forward, in one process.

    .venv/bin/python -m benchmarks.lora_merge               # embedded SmolLM2-135M, rank 16
    .venv/bin/python -m benchmarks.lora_merge --rows 32 --length 150 --repeats 5

The adapter is gear train's (rank 16, every linear layer, alpha 32) with B drawn at random so
that it changes the output. Arms alternate within each repeat; medians of --repeats after one
warm-up each. Also reported: the largest difference of the final hidden states and of the
log-probs between the merged and the unmerged forward, and whether every weight is bit-identical
after the merged passes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine, print_table, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="lora_merge")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model

    from gear.modeling.lora import merged_lora
    from gear.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(args.model)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
    peft_model = get_peft_model(model, config).eval()
    g = torch.Generator().manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01, generator=g)
    ids = torch.randint(100, 30000, (args.rows, args.length), generator=g)
    mask = torch.ones_like(ids)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}

    def forward() -> torch.Tensor:
        out = peft_model(
            input_ids=ids, attention_mask=mask, logits_to_keep=1, output_hidden_states=True
        )
        return out.hidden_states[-1]

    def plain() -> torch.Tensor:
        with peft_model.disable_adapter():
            return forward()

    def merged() -> torch.Tensor:
        with merged_lora(peft_model):
            return forward()

    arms = {"plain model": plain, "LoRA unmerged": forward, "LoRA merged": merged}
    times: dict[str, list[float]] = {k: [] for k in arms}
    outputs = {}
    with torch.no_grad():
        for name, fn in arms.items():
            outputs[name] = fn()  # warm-up, and the outputs compared below
        for rep in range(args.repeats):
            names = list(arms)[rep % 3 :] + list(arms)[: rep % 3]
            for name in names:
                t0 = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t0)
        head = peft_model.get_output_embeddings()
        lp = {k: torch.log_softmax(head(outputs[k][:, -16:]).float(), -1) for k in outputs}
    base = statistics.median(times["plain model"])
    rows = [
        {
            "arm": k,
            "median_s": statistics.median(v),
            "vs_plain": statistics.median(v) / base,
            "tokens": ids.numel(),
        }
        for k, v in times.items()
    ]
    diff_h = (outputs["LoRA merged"] - outputs["LoRA unmerged"]).abs().max().item()
    scale = outputs["LoRA unmerged"].abs().max().item()
    diff_lp = (lp["LoRA merged"] - lp["LoRA unmerged"]).abs().max().item()
    intact = all(torch.equal(before[k], v) for k, v in peft_model.state_dict().items())
    print_table(rows, ["arm", "median_s", "vs_plain", "tokens"], "No-grad forward, one thread")
    print(
        f"merged vs unmerged: max |hidden| diff {diff_h:.2e} (of max |hidden| {scale:.1f}), "
        f"max |log-prob| diff {diff_lp:.2e}; weights bit-identical after: {intact}"
    )
    write_json(
        args.name,
        {
            "machine": {**machine(), "capability": torch.backends.cpu.get_cpu_capability()},
            "args": vars(args),
            "rows": rows,
            "max_abs_hidden_diff": diff_h,
            "max_abs_hidden": scale,
            "max_abs_logprob_diff": diff_lp,
            "weights_intact": intact,
        },
    )


if __name__ == "__main__":
    main()

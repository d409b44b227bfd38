"""Student states from generation vs a separate student forward: how far apart are the signals?

GEARTrainer reads the student's final hidden states off `generate()` (float32 on CPU, as TRL
generates) instead of running a no-grad student forward (under bf16 autocast when bf16=True).
This generates one GEAR batch with the embedded model, then compares, at every policy token, the
KL / entropy / log-probs from the generation states with those from a float32 forward and from
an autocast forward of the same rows (the teacher states are shared).

    .venv/bin/python -m benchmarks.student_states
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

from benchmarks.common import print_table, write_json


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--completion-length", type=int, default=48)
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    from gear.integrations.trl import GEARConfig, GEARTrainer
    from gear.models import load_model_and_tokenizer
    from gear.tasks import get_task

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    model, tokenizer = load_model_and_tokenizer(args.model)
    task = get_task("arithmetic")
    cfg = GEARConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.completions,
        num_generations=8,
        max_completion_length=args.completion_length,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        beta=0.0,
        credit_log_steps=0,
        report_to="none",
    )
    trainer = GEARTrainer(
        model=model,
        reward_funcs=[task.reward],
        args=cfg,
        train_dataset=task.dataset("train", n=64, seed=0),
        processing_class=tokenizer,
    )
    seen: list[tuple] = []
    signals = trainer._signals
    trainer._signals = lambda s, t, ids, **kw: seen.append((s, t)) or signals(s, t, ids, **kw)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    generation, teacher = seen[0]
    ids, valid = batch["completion_ids"], batch["completion_mask"].bool()
    ids_all = torch.cat([batch["prompt_ids"], ids], dim=1)
    mask_all = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        autocast = trainer._final_hidden(trainer.model, ids_all, mask_all, ids.size(1))
        backbone = trainer.model.model
        float32 = backbone(input_ids=ids_all, attention_mask=mask_all).last_hidden_state
        float32 = float32[:, -ids.size(1) - 1 : -1]
    reference = signals(generation, teacher, ids, mask=valid)
    rows = []
    for name, states in (("float32 forward", float32), ("bf16 autocast forward", autocast)):
        other = signals(states, teacher, ids, mask=valid)
        for field in ("kl", "entropy", "student_logprobs"):
            a, b = getattr(reference, field)[valid], getattr(other, field)[valid]
            rows.append(
                {
                    "student states": name,
                    "signal": field,
                    "mean (generation)": a.mean().item(),
                    "mean |diff|": (a - b).abs().mean().item(),
                    "max |diff|": (a - b).abs().max().item(),
                    "correlation": torch.corrcoef(torch.stack([a, b]))[0, 1].item(),
                }
            )
    print_table(rows, list(rows[0]), f"Signals at {int(valid.sum())} policy tokens vs generation")
    write_json("student_states", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

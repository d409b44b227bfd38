"""Headroom (issue 58): can any credit assignment speed learning on a real LM here? The rule,
fixed before any run: docs/evidence/2026-11-28-headroom-rule.md. Run from the repository root;
every stage resumes where it stopped.

    python -m studies.headroom checkpoint          # issue 51's seed-0 SFT checkpoint, rebuilt
    python -m studies.headroom status

The checkpoint is issue 51's stage 0 (`studies.after_format`: LoRA SFT on chain worked solutions)
retrained to its recorded chosen step. Its checks change nothing that training reads (no dropout,
a fixed data order; `check` reseeds only the sampler), so training straight to that step gives
the same weights on the same CPU class; the step's check is run again and recorded beside the
original. The adapter (base + LoRA, `gear train --model runs/headroom/sft-seed0`) and its content
hash go to runs/headroom/ (not committed) and studies/results/headroom_runs/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from gear.evidence import RecordStore, head_commit
from gear.models import content_hash

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "studies" / "results"
RECORDS = RESULTS / "headroom_runs"
RUNS = ROOT / "runs" / "headroom"
RULE = "docs/evidence/2026-11-28-headroom-rule.md"


def records() -> RecordStore:
    return RecordStore(RECORDS)


def checkpoint_dir(seed: int = 0) -> Path:
    return RUNS / f"sft-seed{seed}"


def checkpoint(seed: int = 0) -> dict[str, Any]:
    """Rebuild `seed`'s stage-0 checkpoint of issue 51 at its recorded chosen step (the SFT loop
    of `after_format.sft`, without the intermediate checks), check it with the rule's check, and
    save it as a PEFT adapter directory with its tokenizer. Kept as `checkpoint-seed<seed>`."""
    from studies import after_format as af

    key = f"checkpoint-seed{seed}"
    kept = records().get(key)
    if kept is not None:
        return kept
    original = af.sft_record(seed)
    if original["chosen"] is None:
        raise SystemExit(f"issue 51's seed {seed} has no chosen SFT step")
    step = original["chosen"]["step"]
    recorded = next(c for c in original["checks"] if c["step"] == step)
    t0, commit = time.time(), head_commit(ROOT)
    model, tok = af.lora_model(seed)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=af.LR)
    rows = af.task().dataset("train", n=max(af.CHECK_STEPS) * af.ROWS_PER_STEP, seed=seed)
    losses = []
    for s in range(step):
        part = rows.select(range(s * af.ROWS_PER_STEP, (s + 1) * af.ROWS_PER_STEP))
        loss = model(**af.sft_batch(tok, part)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"seed {seed}: SFT step {s + 1}/{step}, loss {losses[-1]:.4f}", flush=True)
    out = checkpoint_dir(seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    check = af.check(model, tok)
    record = {
        "seed": seed,
        "step": step,
        "path": str(out.relative_to(ROOT)),
        "sha256": content_hash(out),
        "check": check,
        "recorded_check": recorded,
        "loss": losses,
        "original_loss": original.get("loss", [])[:step],
        "wall_s": time.time() - t0,
        "commit": commit,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "rule": RULE,
    }
    records().put(key, record)
    print(
        f"seed {seed}: checkpoint at SFT step {step}: pass rate {check['pass_rate']:.4f} "
        f"(issue 51: {recorded['pass_rate']:.4f}), writes its steps {check['writes_steps']:.4f}, "
        f"sha256 {record['sha256'][:12]}",
        flush=True,
    )
    return record


def status() -> None:
    for name in records().names("checkpoint-seed*"):
        r = records().get(name)
        print(f"{name}: step {r['step']}, pass rate {r['check']['pass_rate']:.4f}, {r['sha256']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["checkpoint", "status"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.stage == "checkpoint":
        checkpoint(a.seed)
    else:
        status()


if __name__ == "__main__":
    main()

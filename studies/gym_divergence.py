"""Why the sharp first-departure recipe diverges in the gym under an answer-only teacher.

    python -m studies.gym_divergence --seeds 3 --steps 60
    python -m studies.gym_divergence --arms sharp --arms "sharp@<guard>=..."   # a guard's effect

Trains each arm from the warm start shared by both contexts (`WarmStart(hints="both", teacher_steps=100)`) through the gym's
own `rl_step`, and records at every step what the credit did to the failed rollouts: where each
failed row's largest weight lands (token slot of the step "p+x=r;", before / at / after the
checker's first wrong token, and whether that token was right), the k1 KL and the student's
log-probability there, and the same log-probability after the update. Every `--eval-every`
steps: held-out exact accuracy and the student's entropy and log-probability of the right
solution per slot. Writes studies/results/gym_divergence.json. See
docs/evidence/2026-11-26-gym-fair.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import gear.gym.train as gt
from gear.gym.model import ModelConfig, WarmStart, completion_logits, exact_accuracy, warm_start
from gear.gym.task import STEP_LEN, ChainTask

RESULTS = Path(__file__).parent / "results"
SHARP = "gear_departure_blame@estimator=k1,modulation=exp,beta=2,w_min=0,w_max=10"
SLOTS = ("prev", "+", "operand", "=", "result", ";")


def arm_spec(name: str) -> str:
    """`sharp` -> the sharp recipe; `sharp@k=v` -> the recipe with more overrides."""
    if name == "sharp":
        return SHARP
    if name.startswith("sharp@"):
        return f"{SHARP},{name.removeprefix('sharp@')}"
    return name


@torch.no_grad()
def held_out_profile(model: Any, task: ChainTask, problems: torch.Tensor) -> dict[str, Any]:
    """Exact accuracy and, on the right solutions (teacher-forced, no hint), the student's mean
    entropy and log-probability per slot and at the first token."""
    ref = task.references(problems)
    logits = completion_logits(model, task.prompts(problems), ref).float()
    logp = torch.log_softmax(logits, -1)
    tok = logp.gather(2, ref[..., None]).squeeze(2)
    ent = -(logp.exp() * logp).sum(-1)
    slot = torch.arange(task.completion_len) % STEP_LEN
    return {
        "exact": exact_accuracy(model, task, problems),
        "logp_slot": {s: float(tok[:, slot == i].mean()) for i, s in enumerate(SLOTS)},
        "entropy_slot": {s: float(ent[:, slot == i].mean()) for i, s in enumerate(SLOTS)},
        "logp_first_token": float(tok[:, 0].mean()),
        "entropy_first_token": float(ent[:, 0].mean()),
    }


def run_arm(
    name: str,
    seed: int,
    task: ChainTask,
    cfg: ModelConfig,
    state: dict,
    rl: gt.RLConfig,
    every: int,
) -> dict[str, Any]:
    arm = gt.parse_arm(arm_spec(name), name)
    model = gt.build_model(cfg, task)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=rl.lr if arm.lr is None else arm.lr)
    prompt_gen = torch.Generator().manual_seed(1_000 + seed)
    held = gt.eval_problems(task, rl.eval_n)
    seen: dict[str, Any] = {}
    real_credit = gt.credit

    def spy(arm_, task_, problems, comp, adv, s_logits, t_logits, *a, **kw):
        out = real_credit(arm_, task_, problems, comp, adv, s_logits, t_logits, *a, **kw)
        seen.update(problems=problems, comp=comp, adv=adv, adv_tok=out, s=s_logits.detach(),
                    t=t_logits)  # fmt: skip
        return out

    gt.credit = spy
    steps, evals = [], [{"step": 0, **held_out_profile(model, task, held)}]
    try:
        for step in range(1, rl.steps + 1):
            seen.clear()
            problems = task.problems(rl.prompts, prompt_gen)
            gen = torch.Generator().manual_seed(seed * 100_003 + step)
            m = gt.rl_step(model, opt, arm, task, rl, problems, gen, seed * 100_003 + step)
            if seen:
                steps.append({"step": step, "reward": m["reward"], **blame(model, task, seen)})
            if step % every == 0 or step == rl.steps:
                evals.append({"step": step, **held_out_profile(model, task, held)})
    finally:
        gt.credit = real_credit
    return {"arm": name, "spec": arm.spec, "seed": seed, "steps": steps, "evals": evals}


@torch.no_grad()
def blame(model: Any, task: ChainTask, seen: dict[str, Any]) -> dict[str, Any]:
    """Where the failed rows' largest weights went, and what the update did there."""
    adv, comp, problems = seen["adv"], seen["comp"], seen["problems"]
    failed = adv < 0
    if not bool(failed.any()):
        return {"failed": 0}
    w = (seen["adv_tok"] / adv[:, None])[failed]
    top = w.argmax(dim=1)
    first = task.first_error(problems, comp)[failed]
    right = comp[failed] == task.references(problems)[failed]
    slp = torch.log_softmax(seen["s"].float(), -1)[failed]
    tlp = torch.log_softmax(seen["t"].float(), -1)[failed]
    c = comp[failed]
    lp_s = slp.gather(2, c[..., None]).squeeze(2)
    lp_t = tlp.gather(2, c[..., None]).squeeze(2)
    rep_prompts = task.prompts(problems[failed])
    after = torch.log_softmax(completion_logits(model, rep_prompts, c).float(), -1)
    lp_after = after.gather(2, c[..., None]).squeeze(2)
    rows = torch.arange(len(top))
    pos = torch.where(first >= 0, first, task.completion_len)
    return {
        "failed": int(failed.sum()),
        "top_weight": float(w.max(dim=1).values.mean()),
        "top_pos_hist": torch.bincount(top, minlength=task.completion_len).tolist(),
        "top_slot_hist": torch.bincount(top % STEP_LEN, minlength=STEP_LEN).tolist(),
        "top_before_first_error": int((top < pos).sum()),
        "top_at_first_error": int((top == pos).sum()),
        "top_after_first_error": int((top > pos).sum()),
        "top_token_right": int(right[rows, top].sum()),
        "top_k1": float((lp_s - lp_t)[rows, top].mean()),
        "top_logp_student": float(lp_s[rows, top].mean()),
        "top_logp_teacher": float(lp_t[rows, top].mean()),
        "top_logp_after_update": float(lp_after[rows, top].mean()),
        "first_token_logp": float(lp_s[:, 0].mean()),
        "first_token_logp_after_update": float(lp_after[:, 0].mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arms", action="append", help="default: grpo and sharp")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--hint", default="answer_only")
    ap.add_argument("--out", type=Path, default=RESULTS / "gym_divergence.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    task, cfg, warm = (
        ChainTask(4, a.hint),
        ModelConfig(),
        WarmStart(hints="both", teacher_steps=100),
    )
    state, info = warm_start(task, cfg, warm)
    rl = gt.RLConfig(steps=a.steps)
    runs = []
    for seed in range(a.seeds):
        for name in a.arms or ["grpo", "sharp"]:
            r = run_arm(name, seed, task, cfg, state, rl, a.eval_every)
            ex = [e["exact"] for e in r["evals"]]
            print(f"{name:>40} seed {seed}: exact {ex[0]:.3f} -> {ex[-1]:.3f} "
                  f"(min {min(ex):.3f})", flush=True)  # fmt: skip
            runs.append(r)
    out = {
        "task": {"length": task.length, "hint": task.hint},
        "warm_start": info,
        "rl": asdict(rl),
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out} in {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The gym's model: a tiny Llama over the task's 16-token vocabulary, sampling, and the warm start.

The warm start is supervised training on the right solutions, half the prompts with the
ground-truth hint (in the task's hint format: every result, or the final one alone) and half
without, so that the *same* model is a competent hinted teacher and a modest student. It stops as soon as the sampled held-out accuracy without the hint reaches
`target` (checked every `check_every` steps). The result is cached on disk, keyed by everything
that determines it, so every seed and arm of a grid starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from gear.gym.task import HINTS, VOCAB, ChainTask

#: the hint formats a warm start teaches: the task's own, or both (one warm start, two contexts)
WARM_HINTS = ("task", "both")


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    init_seed: int = 0


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start: stop once the held-out `exact` accuracy (no hint) reaches `target`.

    The stop rule reads the noise-free `exact` metric (one forward pass) every `check_every`
    steps: learning this task is sudden (accuracy ~0.1 for hundreds of steps, then 0.5 within
    fifty), so a coarse or noisy check would overshoot the target.

    `hints`: the format of the hinted half of each batch. "task": the task's hint. "both": the
    default warm start (all-steps hints, whatever the task's hint; kept under its own key),
    then `teacher_steps` steps whose hinted half is trained in both formats (every result, the
    final one alone), so one warm start serves both teacher contexts, the two are compared from
    the same weights, and the answer-only teacher has seen its format. Why not answer-only
    hints from the start: a warm start shown only answer-only hints stayed at exact accuracy
    0.000 for 2400 steps, one whose hinted half was split between the formats at 0.001 for
    3500 (length 4, the defaults below); the all-steps hint, in half the rows, is what lets
    this model learn the sums. Why a teacher phase: without it the answer-only teacher reads
    its one digit as the first intermediate result. Why the teacher phase anchors the unhinted
    half: 100 steps on hinted rows alone took one student's exact accuracy from 0.33 to 0.0000
    and another's from 0.32 to 0.64; with the unhinted half trained on the right solutions,
    from 0.31 to 0.96 and from 0.32 to 0.91 (`info` reports both phases)."""

    target: float = 0.3
    lr: float = 3e-3
    batch: int = 64
    max_steps: int = 4000
    check_every: int = 5
    eval_n: int = 512
    seed: int = 0
    hints: str = "task"
    teacher_steps: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.teacher_steps, int) and self.teacher_steps >= 0):
            raise ValueError(
                f"WarmStart.teacher_steps: expected an integer >= 0, got {self.teacher_steps!r}"
            )
        if self.hints == "both" and self.teacher_steps < 1:
            raise ValueError("WarmStart.teacher_steps: hints='both' needs a teacher phase (>= 1)")
        if self.hints not in WARM_HINTS:
            raise ValueError(
                f"WarmStart.hints: expected one of {list(WARM_HINTS)}, got {self.hints!r}"
            )


def build_model(cfg: ModelConfig, task: ChainTask) -> LlamaForCausalLM:
    """An untrained tiny Llama (tied embeddings) seeded by `cfg.init_seed`; global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(VOCAB),
                hidden_size=cfg.hidden,
                intermediate_size=2 * cfg.hidden,
                num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads,
                num_key_value_heads=cfg.heads,
                max_position_embeddings=4 * task.completion_len,
                tie_word_embeddings=True,
                bos_token_id=VOCAB.index("<bos>"),
                eos_token_id=None,
                pad_token_id=None,
            )
        )
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def completion_logits(model: Any, prompts: Tensor, completions: Tensor) -> Tensor:
    """(n, T, V) logits that score each completion token given the prompt and earlier tokens."""
    ids = torch.cat([prompts, completions], dim=1)
    logits = model(input_ids=ids, use_cache=False).logits
    return logits[:, prompts.shape[1] - 1 : -1]


@torch.no_grad()
def sample(
    model: Any, prompts: Tensor, length: int, generator: torch.Generator, temperature: float = 1.0
) -> Tensor:
    """(n, length) sampled completion ids; every row has the same length (no EOS in the task).

    Plain sampling at `temperature` (no top-k or top-p), as GRPO's; `generator` makes it
    reproducible, so two arms given the same generator state draw the same random numbers.
    Decodes with a KV cache (8x faster than re-running the prefix; same tokens, tested)."""
    out = model(input_ids=prompts, past_key_values=DynamicCache(), use_cache=True)
    tokens = []
    for i in range(length):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        tokens.append(torch.multinomial(probs, 1, generator=generator))
        if i < length - 1:
            out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def evaluate(model: Any, task: ChainTask, problems: Tensor, seed: int) -> dict[str, float]:
    """Held-out accuracy of `model` on `problems` (no hint).

    `accuracy`: one sample per problem at temperature 1 from a generator seeded by `seed` (common
    random numbers across arms); `exact`: the mean probability of the right solution, teacher-
    forced, which is the expected accuracy up to the rare rollouts whose errors cancel out,
    without sampling noise."""
    gen = torch.Generator().manual_seed(seed)
    comp = sample(model, task.prompts(problems), task.completion_len, gen)
    return {
        "accuracy": float(task.rewards(problems, comp).mean()),
        "exact": exact_accuracy(model, task, problems),
    }


@torch.no_grad()
def exact_accuracy(model: Any, task: ChainTask, problems: Tensor) -> float:
    """Mean probability of the right solution (no hint), teacher-forced: one forward pass."""
    prompts, ref = task.prompts(problems), task.references(problems)
    logp = torch.log_softmax(completion_logits(model, prompts, ref).float(), dim=-1)
    return float(logp.gather(2, ref[..., None]).squeeze(2).sum(dim=1).exp().mean())


def cache_dir() -> Path:
    from gear.models import cache_root

    return cache_root() / "gym"


def warm_start_key(task: ChainTask, cfg: ModelConfig, warm: WarmStart) -> str:
    """The task, model and warm-start settings as a key. Fields added later appear only away
    from their defaults (the task's hint at all_steps, `hints` at "task"), so the warm starts
    kept before they existed keep their keys; a "both" warm start does not depend on the
    task's hint, so the two contexts share it."""
    task_fields, warm_fields = asdict(task), asdict(warm)
    if task_fields["hint"] == "all_steps" or warm.hints == "both":
        del task_fields["hint"]
    for name, default in (("hints", "task"), ("teacher_steps", 0)):
        if warm_fields[name] == default:
            del warm_fields[name]
    blob = json.dumps(
        {"task": task_fields, "model": asdict(cfg), "warm": warm_fields, "v": 1}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(
    task: ChainTask,
    cfg: ModelConfig,
    warm: WarmStart,
    cache: Path | None = None,
    log: Any = print,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The warm-started weights (a state dict) and what the warm start reached; cached on disk.

    Returns (state_dict, info) with info = {key, steps, accuracy, exact, hinted_accuracy,
    wall_s, cached}."""
    cache = cache if cache is not None else cache_dir()
    key = warm_start_key(task, cfg, warm)
    path = cache / f"warm-{key}.pt"
    if path.is_file():
        blob = torch.load(path, weights_only=True)
        log(f"gym: warm start {key} from the cache ({path})")
        return blob["state"], {**blob["info"], "cached": True}

    t0 = time.perf_counter()
    eval_problems = task.problems(warm.eval_n, torch.Generator().manual_seed(10_000), "test")
    if warm.teacher_steps:
        model, base = _teacher_phase(task, cfg, warm, eval_problems, cache, log)
        step, extra = base["steps"] + warm.teacher_steps, {"student_phase": base}
    else:
        model, step = _student_phase(task, cfg, warm, eval_problems, log)
        extra = {}
    acc = evaluate(model, task, eval_problems, seed=0)
    model.eval()
    hinted_acc = _hinted_accuracy(model, task, eval_problems)
    by_hint = {h: _hinted_accuracy(model, replace(task, hint=h), eval_problems) for h in HINTS}
    info = {
        "key": key,
        "steps": step,
        "accuracy": acc["accuracy"],
        "exact": acc["exact"],
        "hinted_accuracy": hinted_acc,
        "hinted_accuracy_by_hint": by_hint,
        "hints": warm.hints,
        "wall_s": round(time.perf_counter() - t0, 1),
        **extra,
    }
    log(
        f"gym: warm start done in {info['wall_s']} s, {step} steps: accuracy {acc['accuracy']:.3f}"
        f" without the hint, {hinted_acc:.3f} with it"
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".warm-{key}.{os.getpid()}.tmp"
    torch.save({"state": state, "info": info}, tmp)
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    return state, {**info, "cached": False}


def _student_phase(
    task: ChainTask, cfg: ModelConfig, warm: WarmStart, eval_problems: Tensor, log: Any
) -> tuple[Any, int]:
    """Half the rows hinted, half not, until the exact accuracy without the hint reaches
    `warm.target`. Returns the model and the steps taken."""
    model = build_model(cfg, task)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(warm.seed)
    step = 0
    while step < warm.max_steps:
        problems = task.problems(warm.batch, gen)
        hinted = torch.rand(warm.batch, generator=gen) < 0.5
        loss = _supervised_step(
            model, opt, task, problems,
            [(task.teacher_prompts(problems[hinted]), hinted),
             (task.prompts(problems[~hinted]), ~hinted)],
        )  # fmt: skip
        step += 1
        if step % warm.check_every == 0:
            exact = exact_accuracy(model, task, eval_problems)
            if step % (10 * warm.check_every) == 0 or exact >= warm.target:
                log(f"gym: warm start step {step}  loss {loss:.3f}  exact {exact:.3f}")
            if exact >= warm.target:
                break
    return model, step


def _teacher_phase(
    task: ChainTask,
    cfg: ModelConfig,
    warm: WarmStart,
    eval_problems: Tensor,
    cache: Path,
    log: Any,
) -> tuple[Any, dict[str, Any]]:
    """The student phase as its own (cached) warm start, then `warm.teacher_steps` steps of its
    batches with the hinted half in every taught format (the same rows once per format) and the
    unhinted half anchored to the student phase's own predictions (a KL to them on the right
    solutions, not their cross-entropy), with a fresh optimizer and its own draws: the teacher
    learns its formats and the student stays where the student phase left it. Returns the
    model and the student phase's info."""
    both = warm.hints == "both"
    first = replace(task, hint="all_steps") if both else task
    base_warm = replace(warm, hints="task", teacher_steps=0)
    state, base = warm_start(first, cfg, base_warm, cache=cache, log=log)
    model = build_model(cfg, task)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(warm.seed + 1_000_003)
    taught = [replace(task, hint=h) for h in HINTS] if both else [task]
    anchor = build_model(cfg, task)
    anchor.load_state_dict(state)
    for step in range(1, warm.teacher_steps + 1):
        problems = task.problems(warm.batch, gen)
        hinted = torch.rand(warm.batch, generator=gen) < 0.5
        loss = _supervised_step(
            model,
            opt,
            task,
            problems,
            [(t.teacher_prompts(problems[hinted]), hinted) for t in taught],
            anchor=(anchor, task.prompts(problems[~hinted]), ~hinted),
        )
        if step % (10 * warm.check_every) == 0 or step == warm.teacher_steps:
            log(f"gym: warm start teacher phase step {step}  loss {loss:.3f}")
    return model, {k: v for k, v in base.items() if k != "cached"}


def _supervised_step(
    model: Any,
    opt: torch.optim.Optimizer,
    task: ChainTask,
    problems: Tensor,
    parts: list,
    anchor: tuple[Any, Tensor, Tensor] | None = None,
) -> float:
    """One step of cross-entropy on the right solutions; `parts`: (prompt ids, row mask)
    pairs, each prompt's rows of `problems`. `anchor` (frozen model, prompt ids, row mask):
    those rows take KL(anchor || model) per token on the right solutions instead. The loss is
    the mean over the tokens (with one prompt per row, the batch's reference tokens, as the
    warm start always had). Returns that loss."""
    ref = task.references(problems)
    loss, count = torch.zeros(()), 0
    for prompts, rows in parts:
        if rows.any():
            logits, target = completion_logits(model, prompts, ref[rows]), ref[rows]
            loss = loss + F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            )
            count += target.numel()
    if anchor is not None and anchor[2].any():
        frozen, prompts, rows = anchor
        logp = torch.log_softmax(completion_logits(model, prompts, ref[rows]), -1)
        with torch.no_grad():
            ref_logp = torch.log_softmax(completion_logits(frozen, prompts, ref[rows]), -1)
        loss = loss + (ref_logp.exp() * (ref_logp - logp)).sum()
        count += ref[rows].numel()
    opt.zero_grad(set_to_none=True)
    (loss / count).backward()
    opt.step()
    return loss.item() / count


@torch.no_grad()
def _hinted_accuracy(model: Any, task: ChainTask, problems: Tensor) -> float:
    gen = torch.Generator().manual_seed(1)
    comp = sample(model, task.teacher_prompts(problems), task.completion_len, gen)
    return float(task.rewards(problems, comp).mean())

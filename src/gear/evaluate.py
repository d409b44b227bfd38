"""Held-out evaluation: pass@1 and pass@k of a model on a task split.

pass@k uses the unbiased estimator of Chen et al. (2021, arXiv 2107.03374) over `samples`
completions per problem: 1 - C(n - c, k) / C(n, k). With `samples=1` and `temperature=0` it is
greedy accuracy; with `samples=k` at a temperature T > 0, pass@1 is the mean reward of k samples
per problem at T (a 0/1 reward), the learning metric of `gear train` (`mean_reward`).

Sample j of a problem is drawn from noise fixed by (the evaluation seed, the problem's prompt, j)
(`gear.sampling`): two models, or one model at two steps, are scored on the same draws, so a
difference between them is the models', not the sampler's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gear.sampling import sample, text_seed
from gear.tasks.base import Task


@dataclass
class EvalResult:
    task: str
    split: str
    n_problems: int
    samples: int
    temperature: float
    pass_at: dict[int, float]
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.pass_at[1]

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "split": self.split,
            "n_problems": self.n_problems,
            "samples": self.samples,
            "temperature": self.temperature,
            **{f"pass@{k}": v for k, v in self.pass_at.items()},
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with c correct of n samples."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def render_prompts(tokenizer: Any, rows: list[dict[str, Any]]) -> list[str]:
    """Chat-template each row's prompt (with its tools, if any) ready for generation."""
    texts = []
    for row in rows:
        kwargs = {"tools": row["tools"]} if row.get("tools") else {}
        texts.append(
            tokenizer.apply_chat_template(
                row["prompt"], tokenize=False, add_generation_prompt=True, **kwargs
            )
        )
    return texts


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    num_return_sequences: int = 1,
    seed: int = 0,
) -> list[list[str]]:
    """Completions (text up to the first eos) for each prompt: `num_return_sequences` each,
    sample j of a prompt drawn from seeds fixed by (`seed`, the prompt's text, j)
    (`gear.sampling`), so the same problem gets the same draws in any batch, model or step."""
    seeds = [text_seed(p, seed) for p in prompts]
    ids = sample(
        model,
        tokenizer,
        prompts,
        seeds,
        k=num_return_sequences,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )
    return [tokenizer.batch_decode(rows, skip_special_tokens=True) for rows in ids]


def evaluate(
    model: Any,
    tokenizer: Any,
    task: Task,
    *,
    split: str = "test",
    n: int | None = 100,
    samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Score `model` on `n` problems of `task`'s `split`.

    Args:
        samples: completions per problem (k of pass@k runs over 1, 2, 4, ... up to it).
        temperature: 0 = greedy (then samples must be 1).
        progress: called as progress(done, total) after each batch.
    """
    if samples < 1:
        raise ValueError(f"samples: expected an integer >= 1, got {samples}")
    if temperature <= 0 and samples > 1:
        raise ValueError("samples > 1 needs temperature > 0 (greedy decoding repeats itself)")
    tokenizer = task.prepare_tokenizer(tokenizer)
    rows = list(task.dataset(split, n=n, seed=seed))
    was_training = model.training
    model.eval()
    results = []
    try:  # restored also when a stop signal ends it: TRL logs a step's metrics by model.training
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            outs = generate(
                model,
                tokenizer,
                render_prompts(tokenizer, batch),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                num_return_sequences=samples,
                seed=seed,
            )
            for row, completions in zip(batch, outs, strict=True):
                correct = [task.is_correct(c, row["answer"]) for c in completions]
                results.append(
                    {"answer": row["answer"], "completions": completions, "correct": correct}
                )
            if progress:
                progress(min(start + batch_size, len(rows)), len(rows))
    finally:
        model.train(was_training)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]
    pass_at = {
        k: sum(pass_at_k(samples, sum(r["correct"]), k) for r in results) / max(len(results), 1)
        for k in ks
    }
    return EvalResult(task.name, split, len(results), samples, temperature, pass_at, results)

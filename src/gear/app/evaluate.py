"""Held-out evaluation: pass@1 and pass@k of a model on a task split.

pass@k uses the unbiased estimator of Chen et al. (2021, arXiv 2107.03374) over `samples`
completions per problem: 1 - C(n - c, k) / C(n, k). With `samples=1` and `temperature=0` it is
greedy accuracy; with `samples=k` at a temperature T > 0, pass@1 is the mean reward of k samples
per problem at T (a 0/1 reward), the learning metric of `gear train` (`mean_reward`).

Sample j of a problem is drawn from noise fixed by (the evaluation seed, the problem's prompt, j)
(`gear.app.sampling`): two models, or one model at two steps, are scored on the same draws, so a
difference between them is the models', not the sampler's.

During a run (`gear train`): `evaluate_now` scores the model before and after training (greedy
pass@1, and with `eval_samples` the mean reward, the learning metric), `EvalCallback` every
`eval_every` steps. The embedded model's scores before training are cached on this machine
(`cached_eval_before` / `store_eval_before`, under `eval_cache_key`), so runs that share an
evaluation compute them once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gear.app.callbacks import EvalInterrupted, SignalStop
from gear.app.config import RunConfig
from gear.app.rundir import METRICS_FILE, append_metrics
from gear.app.sampling import sample, text_seed
from gear.io import InputError, read_json, write_text
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


def render_prompts(
    tokenizer: Any, rows: list[dict[str, Any]], chat_template_kwargs: dict | None = None
) -> list[str]:
    """Chat-template each row's prompt (with its tools, if any) ready for generation, with
    `chat_template_kwargs` as training renders them (Qwen3's `enable_thinking: false`)."""
    texts = []
    for row in rows:
        kwargs = dict(chat_template_kwargs or {})
        if row.get("tools"):
            kwargs["tools"] = row["tools"]
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
    (`gear.app.sampling`), so the same problem gets the same draws in any batch, model or step."""
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
    chat_template_kwargs: dict | None = None,
) -> EvalResult:
    """Score `model` on `n` problems of `task`'s `split`.

    Args:
        samples: completions per problem (k of pass@k runs over 1, 2, 4, ... up to it).
        temperature: 0 = greedy (then samples must be 1).
        progress: called as progress(done, total) after each batch.
        chat_template_kwargs: passed to the chat template (a run's trainer setting of that
            name, so evaluation sees the prompts training saw).
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
                render_prompts(tokenizer, batch, chat_template_kwargs),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                num_return_sequences=samples,
                seed=seed,
            )
            for row, completions in zip(batch, outs, strict=True):
                correct = [task.is_correct(c, row["answer"]) for c in completions]
                pid = _problem_id(row)
                results.append(
                    {"answer": row["answer"], "completions": completions, "correct": correct}
                    | ({"problem": pid} if pid is not None else {})
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


def _problem_id(row: dict[str, Any]) -> Any:
    """What names a problem in its set: its position in its file (`index`) or its `id` (BFCL),
    so two models' scores on one set pair by problem; None where the task gives neither."""
    return row.get("index", row.get("id"))


def write_report(out_dir: Path, model: str, task: str, result: EvalResult) -> Path:
    """`gear eval`'s report in `out_dir`: eval_<task>_<split>.json (the summary and every row)
    and a Markdown table of the summary beside it (`task`: the task as the user named it);
    returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"eval_{task}_{result.split}"
    summary = {"model": model, **result.summary()}
    write_text(out_dir / f"{stem}.json", json.dumps({**summary, "rows": result.rows}, indent=2))
    md = [
        f"# Evaluation of `{model}` on {task}/{result.split}",
        "",
        "| metric | value |",
        "|---|---|",
    ] + [f"| {k} | {v} |" for k, v in summary.items()]
    write_text(out_dir / f"{stem}.md", "\n".join(md) + "\n")
    return out_dir / f"{stem}.json"


# -------------------------------------------------------------------------- during a run


@contextlib.contextmanager
def plain_forward(model: Any) -> Iterator[Any]:
    """Run `model` without accelerate's mixed-precision forward wrapper for a while.

    Under `bf16=True`, accelerate wraps `model.forward` in autocast. That suits one big
    forward, but in generation it recasts every weight at every decoding step (no cast cache
    under no_grad): on CPU, sampling was ~5x slower than in float32. Evaluation generates, so it
    uses the original forward.
    """
    original = getattr(model, "_original_forward", None)
    if original is None:
        yield model
        return
    wrapped = model.forward
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def evaluate_now(model: Any, tokenizer: Any, task: Any, cfg: Any, console: Any, label: str) -> dict:
    """Held-out scores of `model` now, with progress: greedy pass@1 (`eval_temperature`, 0 by
    default) on `eval_n` problems and, when `eval_samples` > 0, the mean reward of that many
    samples per problem at the training temperature (`mean_reward`, the learning metric), with
    each problem's score under `per_problem` (for paired intervals). Problems and sampling
    noise come from `eval_seed`, the same for every run."""
    greedy = _evaluate_with_progress(
        model, tokenizer, task, cfg, console, label, 1, cfg.eval_temperature
    )
    out = greedy.summary() | {"per_problem": {"greedy": _scores(greedy)}}
    k = getattr(cfg, "eval_samples", 0)
    if k:
        temperature = float(cfg.trainer.get("temperature", 1.0))
        sampled = _evaluate_with_progress(
            model, tokenizer, task, cfg, console, label, k, temperature
        )
        out |= {
            "mean_reward": sampled.accuracy,
            "samples": k,
            "sample_temperature": temperature,
            "per_problem": out["per_problem"] | {"mean_reward": _scores(sampled)},
        }
    if console is not None:
        line = f"held-out greedy pass@1 {label}: [bold]{greedy.accuracy:.3f}[/]"
        if k:
            line += f", mean reward of {k} samples at T={temperature:g}: [bold]{out['mean_reward']:.3f}[/]"
        console.print(f"{line} ({greedy.n_problems} problems)")
    return out


def _scores(result: Any) -> list[float]:
    """Each problem's mean reward over its samples (0/1 rewards: the fraction correct)."""
    return [sum(r["correct"]) / len(r["correct"]) for r in result.rows]


def _evaluate_with_progress(
    model: Any,
    tokenizer: Any,
    task: Any,
    cfg: Any,
    console: Any,
    label: str,
    samples: int,
    temperature: float,
) -> Any:
    what = (
        "greedy" if samples == 1 and temperature == 0 else f"{samples} samples at T={temperature:g}"
    )
    bar: Any = None
    ctx: Any = contextlib.nullcontext()
    progress: Callable[[int, int], None] | None = None
    if console is not None and not console.is_terminal:  # no live bar in a log: a line a batch
        console.print(
            f"evaluating {label}: {cfg.eval_n} held-out problems, {what}",
            highlight=False,
            soft_wrap=True,
        )
        start = time.monotonic()

        def progress(done: int, total: int) -> None:  # a sampled evaluation takes minutes
            console.print(
                f"  eval {label} ({what}): {done}/{total} problems, "
                f"{time.monotonic() - start:.0f} s",
                highlight=False,
                soft_wrap=True,
            )

    elif console is not None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        bar = Progress(
            TextColumn(f"[bold]eval {label} ({what})"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        ctx = bar
    with ctx, plain_forward(model):
        job = bar.add_task("eval", total=cfg.eval_n) if bar else None
        return evaluate(
            model,
            tokenizer,
            task,
            split="test",
            n=cfg.eval_n,
            samples=samples,
            temperature=temperature,
            max_new_tokens=cfg.eval_max_new_tokens,
            batch_size=cfg.eval_batch_size,
            seed=getattr(cfg, "eval_seed", 0),
            chat_template_kwargs=cfg.trainer.get("chat_template_kwargs"),
            progress=(lambda done, total: bar.update(job, completed=done, total=total))
            if bar
            else progress,
        )


class EvalCallback(TrainerCallback):
    """Every `eval_every` steps: held-out pass@1, written to metrics.jsonl as eval/accuracy.

    stop: the run's `SignalStop`: no evaluation starts once a stop signal came, and one that
    runs ends at the signal (`EvalInterrupted`), so the step it follows is saved at once
    instead of after one more step. Either way the model goes back to the mode it had."""

    def __init__(
        self, task: Any, cfg: Any, tokenizer: Any, console: Any, stop: SignalStop | None = None
    ) -> None:
        self.task, self.cfg, self.tokenizer, self.console = task, cfg, tokenizer, console
        self.stop = stop

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        step = state.global_step
        if not (
            state.is_world_process_zero
            and step % self.cfg.eval_every == 0
            and step < state.max_steps
            and not control.should_training_stop
            and (self.stop is None or self.stop.signum is None)  # a stop signal: save now
        ):
            return
        was_training = model.training
        try:
            with self.stop.evaluation() if self.stop is not None else contextlib.nullcontext():
                if self.stop is not None and self.stop.signum is not None:
                    return  # the signal came just before: no evaluation
                if self.console is not None and not self.console.is_terminal:  # for a log
                    self.console.print(
                        f"evaluating at step {step}: {self.cfg.eval_n} held-out problems",
                        highlight=False,
                        soft_wrap=True,
                    )
                result = evaluate_now(
                    model, self.tokenizer, self.task, self.cfg, None, f"step {step}"
                )
        except EvalInterrupted:
            return  # SignalStop, the next callback, saves this step and stops
        finally:
            # TRL logs this step next, from the metrics of the mode model.training names: left
            # in eval mode, the step's row would lose reward, gear/* and completion statistics
            model.train(was_training)
        append_metrics(
            Path(args.output_dir) / METRICS_FILE,
            step,
            {"eval/accuracy": result["pass@1"]}
            | ({"eval/mean_reward": result["mean_reward"]} if "mean_reward" in result else {}),
        )
        if self.console is not None:
            self.console.log(f"step {step}: held-out pass@1 {result['pass@1']:.3f}")


# -------------------------------------------------------------------------- the evaluation cache


def eval_cache_key(cfg: RunConfig) -> str | None:
    """The key of the held-out evaluation before training of a run of `cfg`, or None when it
    cannot be reused: the model's weights must be fixed by something local (`model_identity`:
    the embedded model's package version, a local directory's or adapter's content hash). The key covers everything the score depends on: the held-out problems
    themselves (their prompts and answers), every eval_* field, the sampling temperature, this
    machine's CPU capability and torch, and `gear.app.sampling.EVAL_VERSION` (what the sampler
    draws and how answers are scored; a test pins it)."""

    import torch

    from gear.app.sampling import EVAL_VERSION
    from gear.models import model_identity
    from gear.tasks import get_task

    model = model_identity(cfg.model)
    if model is None:
        return None
    task = get_task(cfg.task, **cfg.task_options)
    rows = task.dataset("test", n=cfg.eval_n, seed=cfg.eval_seed)
    problems = json.dumps([[r["prompt"], r["answer"]] for r in rows], sort_keys=True)
    evals = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("eval_")
    }
    parts = {
        "model": model,
        "task": cfg.task,
        "problems": hashlib.sha256(problems.encode()).hexdigest(),
        "eval": evals,
        "temperature": cfg.trainer.get("temperature", 1.0),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "version": EVAL_VERSION,
    }
    if cfg.trainer.get("chat_template_kwargs"):  # they change the prompts; absent: keys as before
        parts["chat_template_kwargs"] = cfg.trainer["chat_template_kwargs"]
    if getattr(task, "grading_version", None):  # a task's own grading change; absent: as before
        parts["grading"] = task.grading_version
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _eval_cache_file(cfg: RunConfig) -> Path | None:
    from gear.models import cache_root

    key = eval_cache_key(cfg)
    return None if key is None else cache_root() / "evals" / f"{key}.json"


def _cached_scores(path: Path, cfg: RunConfig) -> dict[str, Any]:
    """The scores in an evaluation cache entry; an `InputError` when it is not what
    `store_eval_before` writes for `cfg` (JSON of pass@1 in [0, 1], n_problems and, with
    `eval_samples`, mean_reward; per-problem scores, one per problem)."""
    scores = read_json(path)
    if not isinstance(scores, dict):
        raise InputError(path, "not a JSON object")
    n = scores.get("n_problems")
    if not (isinstance(n, int) and 0 < n <= cfg.eval_n):
        raise InputError(path, f"n_problems is {n!r}, expected 1..{cfg.eval_n}")
    wanted = ["pass@1"] + (["mean_reward"] if cfg.eval_samples else [])
    for key in wanted:
        value = scores.get(key)
        if not (isinstance(value, int | float) and 0 <= value <= 1):
            raise InputError(path, f"{key} is {value!r}, expected a score in [0, 1]")
    per_problem = scores.get("per_problem")
    if not isinstance(per_problem, dict) or any(
        not isinstance(per_problem.get(k), list) or len(per_problem[k]) != n
        for k in ["greedy"] + (["mean_reward"] if cfg.eval_samples else [])
    ):
        raise InputError(path, f"per_problem does not hold {n} scores per metric")
    return scores


def cached_eval_before(cfg: RunConfig, console: Any = None) -> dict[str, Any] | None:
    """The embedded model's held-out scores for `cfg`'s evaluation, when this machine computed
    them before (`eval_cache_key`); marked `"cached": true`. A damaged entry is never trusted:
    None (the scores are computed again and `store_eval_before` replaces it), with a note."""
    path = _eval_cache_file(cfg)
    if path is None or not path.is_file():
        return None
    try:
        scores = _cached_scores(path, cfg)
    except InputError as e:
        _say(console, f"note: {e}; not used: the scores are computed again and replace it")
        return None
    _say(
        console,
        f"held-out scores before training: reused from {path} (same model, problems, "
        "sampling and code)",
    )
    return scores | {"cached": True}


def store_eval_before(cfg: RunConfig, scores: dict[str, Any]) -> None:
    """Keep the embedded model's held-out scores for later runs with the same evaluation (a
    damaged entry is replaced, a sound one kept)."""
    path = _eval_cache_file(cfg)
    if path is None:
        return
    try:
        _cached_scores(path, cfg)
        return  # a sound entry: kept (another run may have written it meanwhile)
    except InputError:
        write_text(path, json.dumps({k: v for k, v in scores.items() if k != "cached"}))


def _say(console: Any, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False, soft_wrap=True)

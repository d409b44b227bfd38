"""`gear eval TARGET`: a model, or a run's model, scored on a task split (`evaluate_task`) or
on a benchmark suite beside its base model (`evaluate_suite`). Everything that can be checked
(the target, the options, the data files) is checked before a model loads; a ValueError (an
`InputError` for a file) names what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

EVAL_SET_KEYS = ("task_options", "chat_template_kwargs")  # the config keys gear eval reads


def eval_settings(sets: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config keys `gear eval --set` gives: `EVAL_SET_KEYS` only (the rest of a run's
    config does not apply to an evaluation; its own options do), each a mapping."""
    others = sorted(k for k in sets if k not in EVAL_SET_KEYS)
    if others:
        raise ValueError(
            f"gear eval --set takes {' and '.join(EVAL_SET_KEYS)} only, got {others}; the "
            "evaluation's settings are its options (--n, --samples, --temperature, ...)"
        )
    for key, value in sets.items():
        if not isinstance(value, dict):
            raise ValueError(
                f"--set {key}: expected a mapping such as '{{path: data}}', got {value!r}"
            )
    return sets


def _note(console: Any, note: str | None) -> None:
    from rich.markup import escape

    if note:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def evaluate_task(
    target: str,
    task: str | None,
    split: str,
    n: int,
    *,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    task_options: dict[str, Any],
    settings: dict[str, dict[str, Any]],
    out: Path | None,
    console: Any,
) -> None:
    """pass@1 / pass@k of TARGET on `n` problems of `task`'s `split` (default: the run's task,
    with the run's task options and chat template kwargs unless `settings` gives others, then
    `task_options`), written as eval_<task>_<split>.json/.md to `out` (default: the run
    directory, else .) and shown as a table."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from gear.app.evaluate import evaluate, write_report
    from gear.app.rundir import evaluation_target
    from gear.models import load_model_and_tokenizer
    from gear.tasks import get_task

    path = Path(target)
    model_path, run_cfg, note = evaluation_target(target)  # checked before any model is loaded
    options = dict(run_cfg.get("task_options") or {}) if task in (None, run_cfg.get("task")) else {}
    options.update(settings.get("task_options", {}))
    options.update(task_options)
    template_kwargs = settings.get(
        "chat_template_kwargs", (run_cfg.get("trainer") or {}).get("chat_template_kwargs")
    )
    task_name = task or run_cfg.get("task") or "arithmetic"
    t = get_task(task_name, **options)
    t.dataset(split, n=n, seed=seed)  # a missing or damaged data file: said before loading
    _note(console, note)
    model, tokenizer = load_model_and_tokenizer(model_path)
    with Progress(
        TextColumn(f"[bold]eval {task_name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        job = bar.add_task("eval", total=n)
        result = evaluate(
            model,
            tokenizer,
            t,
            split=split,
            n=n,
            samples=samples,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
            progress=lambda d, tot: bar.update(job, completed=d, total=tot),
            chat_template_kwargs=template_kwargs,
        )
    out_dir = out or (path if path.is_dir() else Path("."))
    report = write_report(out_dir, model_path, task_name, result)
    table = Table(title=f"{task_name}/{split}: {result.n_problems} problems")
    for k in result.pass_at:
        table.add_column(f"pass@{k}")
    table.add_row(*(f"{v:.3f}" for v in result.pass_at.values()))
    console.print(table)
    if n is not None and result.n_problems < n:
        console.print(
            f"[yellow]note:[/] {task_name}/{split} has {result.n_problems} problems; all of them "
            f"were evaluated (--n asked for {n})"
        )
    console.print(f"wrote {report} and .md")


def evaluate_suite(
    target: str,
    name: str,
    *,
    data_dir: str | None,
    paths: list[str] | None,
    limit: int | None,
    base: str | None,
    samples: int | None,
    temperature: float | None,
    max_new_tokens: int | None,
    batch_size: int,
    seed: int,
    settings: dict[str, dict[str, Any]],
    out: Path | None,
    console: Any,
) -> None:
    """`gear eval --suite NAME`: check everything before a model loads, then
    `gear.app.suite.run` (TARGET beside `base`, default the run's base model), and show its
    table. A KeyboardInterrupt leaves the benchmarks already scored for the same command."""
    from gear.app import suite
    from gear.app.rundir import evaluation_target

    model_path, run_cfg, note = evaluation_target(target)
    if "task_options" in settings:
        raise ValueError("--suite: --set task_options does not apply (each set has its own task)")
    defaults = suite.Settings(name)
    pairs = [pair.partition("=") for pair in paths or []]
    for pair in paths or []:
        if "=" not in pair:
            raise ValueError(
                f"--suite-path {pair!r}: expected NAME=PATH (NAME: math500, aime24, ...)"
            )
    cfg = suite.Settings(
        name,
        data_dir=data_dir,
        paths={k.strip(): v.strip() for k, _, v in pairs},
        k=defaults.k if samples is None else samples,
        temperature=defaults.temperature if temperature is None else temperature,
        max_new_tokens=defaults.max_new_tokens if max_new_tokens is None else max_new_tokens,
        limit=limit,
        batch_size=batch_size,
        seed=seed,
        chat_template_kwargs=settings.get(
            "chat_template_kwargs", (run_cfg.get("trainer") or {}).get("chat_template_kwargs")
        ),
    )
    planned = suite.plan(cfg)  # every option and data file, before any model loads
    _note(console, note)
    base = base or run_cfg.get("model")
    out_dir = out or (Path(target) if Path(target).is_dir() else Path("."))  # as gear eval
    result = suite.run(model_path, cfg, out_dir, base, planned, log_stream=sys.stderr)
    console.print(suite.markdown(result), highlight=False, soft_wrap=True, markup=False)
    console.print(f"wrote {out_dir / f'suite_{name}.json'} and .md", highlight=False)

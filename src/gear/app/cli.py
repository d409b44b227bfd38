"""`gear`: train, evaluate, compare and inspect GEAR runs.

```
gear train                                   # embedded SmolLM2 + arithmetic, GEAR, < 15 min on CPU
gear train --method grpo --steps 20 --set learning_rate=2e-6
gear train --resume runs/arithmetic-gear-seed0-...
gear eval runs/arithmetic-gear-seed0-... --n 200
gear eval runs/... --suite paper-math --data-dir DATA          # MATH-500, GSM8K, AIME beside the base
gear inspect runs/arithmetic-gear-seed0-...
gear compare --methods grpo --methods gear --seeds 0 --seeds 1 --seeds 2   # does gear beat grpo?
gear compare --plan --effect 0.05                                          # seeds needed, from a pilot
gear compare --report                                                      # the report, no training
```
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from gear.app.unused_packages import hide_unused_packages


class _Gear(typer.Typer):
    """The `gear` program: its entry point (the console script, `python -m gear.app.cli`) first
    hides the optional packages a training command does not use. `typer.testing.CliRunner`
    does not come through here, so a test process keeps every package it has."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hide_unused_packages(sys.argv[1:])
        return super().__call__(*args, **kwargs)


class _Commands(TyperGroup):
    """gear's commands: a damaged or malformed file (`gear.io.InputError`) met anywhere in
    one of them ends it with its one-line message, like any other bad input (`_fail`)."""

    def invoke(self, ctx: Any) -> Any:
        from gear.io import InputError

        try:
            return super().invoke(ctx)
        except InputError as e:
            _fail(str(e))


#: the recipes shipped in the package (gear/app/configs/*.yaml), listed in --help so it cannot drift
_RECIPES = ", ".join(sorted(p.stem for p in (Path(__file__).parent / "configs").glob("*.yaml")))

app = _Gear(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    help=__doc__,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
console = Console()


DEBUG = {"on": False}  # `gear --debug`: errors come with their traceback (also GEAR_DEBUG=1)


def _debugging() -> bool:
    return DEBUG["on"] or os.environ.get("GEAR_DEBUG", "").lower() not in ("", "0", "false", "no")


@app.callback()
def _quiet(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="On an error, print the traceback before the one-line message (or set "
            "GEAR_DEBUG=1).",
        ),
    ] = False,
) -> None:
    """Keep the console for gear's own progress: no library progress bars or deprecation noise."""
    DEBUG["on"] = debug
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="trl")


SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override any config key: --set learning_rate=1e-6 (repeatable)."
    ),
]


def _fail(message: str) -> None:
    """End the command with exit status 2 and `message` on one line (the traceback of the error
    being handled before it, under `--debug` / GEAR_DEBUG=1)."""
    if _debugging() and sys.exc_info()[1] is not None:
        import traceback

        traceback.print_exc()
    console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


NAMED_KEYS = {"method": "credit_method", "steps": "max_steps"}  # option -> config key


def _overrides(pairs: list[str] | None, **named: Any) -> dict[str, Any]:
    from gear.app.config import parse_value

    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            _fail(f"--set {pair!r}: expected KEY=VALUE")
        key, value = pair.split("=", 1)
        out[key.strip()] = parse_value(value)
    for key, value in named.items():
        if value is not None:
            out[NAMED_KEYS.get(key, key)] = value
    return out


def _labels(**named: Any) -> dict[str, str]:
    """Config key -> the option that set it (`{"credit_method": "--method"}`), for messages."""
    return {
        NAMED_KEYS.get(k, k): "--" + k.replace("_", "-") for k, v in named.items() if v is not None
    }


@app.command()
def train(
    config: Annotated[
        str | None,
        typer.Argument(help=f"A YAML file or a recipe shipped with gear: {_RECIPES}."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="'smollm2' (embedded) or a HF model id / path.")
    ] = None,
    task: Annotated[
        str | None, typer.Option(help="arithmetic | gsm8k | math | bfcl | tools")
    ] = None,
    method: Annotated[
        str | None, typer.Option(help="Credit method (gear, grpo, gear_token, rlsd, ...).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimiser steps (max_steps).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
    output_dir: Annotated[
        str | None, typer.Option(help="Run directory (default runs/TASK-METHOD-seedN-TIME).")
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue the run in this directory from its last checkpoint."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Check the configuration, print it and the precision chosen; train nothing.",
        ),
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Train with GEAR (or any credit method) and write a run directory.

    SIGTERM or Ctrl-C saves a checkpoint after the current step; `--resume` continues from it
    with the run's saved config.yaml. A resumed run may change only how far it trains (`--steps`)
    and how it runs here (`--set bf16=...`, `save_steps`, `save_total_limit`, `eval_batch_size`,
    `credit_log_steps`, `credit_log_rows`); an option that would change anything else is an
    error, never ignored.
    """
    from gear.app.callbacks import RunStopped
    from gear.app.config import resolve_config, resume_config
    from gear.app.train import train as run_train

    named = dict(
        model=model, task=task, method=method, steps=steps, seed=seed, output_dir=output_dir
    )
    try:
        if resume is not None:
            if config is not None:
                raise ValueError(
                    f"--resume {resume} continues the run with its saved config.yaml; a CONFIG "
                    f"argument ({config}) would change it. Drop it, or start a new run with it"
                )
            cfg = resume_config(resume, _overrides(set_, **named), labels=_labels(**named))
        else:
            cfg = resolve_config(config, _overrides(set_, **named))
        if dry_run:
            _dry_run(cfg, resume, resume is not None)
            return
        run_dir = run_train(cfg, run_dir=resume, resume=resume is not None, console=console)
    except RunStopped as e:
        console.print(f"[yellow]{e}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
    except (ValueError, OSError, NotImplementedError) as e:
        _fail(str(e))
    console.print(
        f"[green]done[/]: {run_dir}  (summary: {run_dir / 'summary.md'}; "
        f"view credit: gear inspect {run_dir})"
    )


def _dry_run(cfg: Any, run_dir: Path | None, resume: bool) -> None:
    """Everything `gear train` checks before loading a model (`gear.app.preflight`), then the
    resolved config."""
    import yaml

    from gear.app.preflight import preflight

    pre = preflight(cfg, run_dir, resume=resume)
    precision, run_dir = pre.precision, pre.run_dir
    resolved = dataclasses.asdict(cfg)
    console.print(yaml.safe_dump(resolved, sort_keys=False), highlight=False, markup=False)
    console.print(
        f"precision: {precision.name} ({precision.reason}; {precision.capability})",
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"dry run: nothing written (the run would go to {run_dir})", highlight=False)


@app.command("eval")
def eval_(
    target: Annotated[
        str, typer.Argument(help="A run directory, 'smollm2', a model path or HF id.")
    ] = "smollm2",
    task: Annotated[
        str | None, typer.Option(help="Task (default: the run's task, else arithmetic).")
    ] = None,
    split: Annotated[str, typer.Option(help="train | test")] = "test",
    n: Annotated[int | None, typer.Option(help="Problems to evaluate [default: 100].")] = None,
    samples: Annotated[
        int | None,
        typer.Option(
            help="Samples per problem (pass@k up to this) [default: 1; --suite: AIME's k, 32]."
        ),
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="0 = greedy [default: 0; --suite: AIME's, 0.6].")
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Generation budget [default: 128; --suite: 1024].")
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of problem order and sampling.")] = 0,
    task_option: Annotated[
        list[str] | None, typer.Option("--task-option", help="KEY=VALUE task option.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory (default: the run directory or .)")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="task_options={...} (the task's options, as `gear train` takes them) or "
            "chat_template_kwargs={...} (default: the run's; {enable_thinking: false} for Qwen3).",
        ),
    ] = None,
    suite: Annotated[
        str | None,
        typer.Option(help="Score a benchmark suite instead of --task: paper-math | paper-tools."),
    ] = None,
    data_dir: Annotated[
        str | None,
        typer.Option(envvar="GEAR_DATA_DIR", help="--suite: the directory holding its sets."),
    ] = None,
    suite_path: Annotated[
        list[str] | None,
        typer.Option("--suite-path", help="--suite: NAME=PATH, another copy of one set."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="--suite: the first N problems of each set.")
    ] = None,
    base: Annotated[
        str | None,
        typer.Option(help="--suite: the model scored beside (default: a run's base model)."),
    ] = None,
) -> None:
    """pass@1 / pass@k of a model or a run's final model on a task split (JSON + Markdown).

    A run that has no final model (it stopped before it finished) is evaluated at its newest
    complete checkpoint, and the output says which. Task options come as in `gear train`
    (`--set task_options='{path: data/math}'`) or one by one (`--task-option path=data/math`);
    prompts are rendered with the run's `chat_template_kwargs` unless `--set` gives others.

    `--suite paper-math` scores MATH-500, GSM8K (greedy pass@1) and AIME24/25 (avg@k and pass@k,
    k = --samples) from `--data-dir`, a run's model beside its base model, with 95% intervals,
    into suite_paper-math.md / .json; the same command resumes a stopped suite (docs/usage.md).
    """
    from gear.app.eval_target import eval_settings, evaluate_suite, evaluate_task

    if suite is not None:
        if task is not None or task_option or n is not None or split != "test":
            _fail("--suite scores its own sets: --task, --task-option, --split and --n do not "
                  "apply (--limit N takes the first N problems of each set)")  # fmt: skip
    elif limit is not None or base is not None or suite_path:
        _fail("--limit, --base and --suite-path go with --suite (--n takes N problems of a task)")
    try:
        settings = eval_settings(_overrides(set_))
        if suite is not None:
            evaluate_suite(target, suite, data_dir=data_dir, paths=suite_path, limit=limit,
                           base=base, samples=samples, temperature=temperature,
                           max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                           settings=settings, out=out, console=console)  # fmt: skip
            return
        evaluate_task(
            target, task, split, 100 if n is None else n,
            samples=1 if samples is None else samples,
            temperature=0.0 if temperature is None else temperature,
            max_new_tokens=128 if max_new_tokens is None else max_new_tokens,
            batch_size=batch_size, seed=seed, task_options=_overrides(task_option),
            settings=settings, out=out, console=console,
        )  # fmt: skip
    except typer.Exit:  # _fail's own (a RuntimeError)
        raise
    except (ValueError, OSError, RuntimeError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        if suite is None:
            raise
        console.print("stopped: the same command continues from the benchmarks already scored")
        raise typer.Exit(130) from None


@app.command()
def inspect(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with credit records.")],
    out: Annotated[
        Path | None, typer.Option(help="HTML file (default RUN_DIR/credit.html).")
    ] = None,
) -> None:
    """Render the run's credit records: an HTML token viewer and the Figure-2 trajectory PNG.

    A run that has no final model (it stopped before it finished) shows the records it wrote,
    and the output says so and names its newest complete checkpoint.
    """
    from gear.app.inspect_run import inspect_run

    try:
        inspect_run(run_dir, out, console)
    except ValueError as e:  # an InputError too: a damaged file, named
        _fail(str(e))


@app.command()
def gym(
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="Arm, repeatable: a registered credit method, 'module:method' (the module is "
            "imported first, so a method you register there runs), or 'method@key=value,...'. "
            "Default: the gym's 10 arms.",
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per arm (paired by seed).")] = 20,
    steps: Annotated[int, typer.Option(help="RL steps per run.")] = 60,
    length: Annotated[int, typer.Option(help="Chain length (steps per problem).")] = 4,
    hint: Annotated[
        str,
        typer.Option(
            help="What the teacher is shown: 'all_steps' (every intermediate result) or "
            "'answer_only' (the final result alone)."
        ),
    ] = "all_steps",
    warm_starts: Annotated[
        int, typer.Option(help="Warm starts (initialisation seeds); seed i uses i mod this.")
    ] = 1,
    sweep: Annotated[
        list[float] | None, typer.Option("--sweep", help="tau_onset values for gear (repeatable).")
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes, one thread each.")] = 1,
    quick: Annotated[
        bool, typer.Option(help="3 seeds x 20 steps (sets --seeds, --steps): a smoke test.")
    ] = False,
    out: Annotated[Path, typer.Option(help="Result JSON.")] = Path("gym.json"),
    plots: Annotated[Path, typer.Option(help="Directory for the plots.")] = Path("gym_plots"),
) -> None:
    """Test credit methods in the credit gym before spending GPU hours (docs/gym.md)."""
    import gear.gym

    for name, value in (
        ("seeds", seeds),
        ("steps", steps),
        ("length", length),
        ("workers", workers),
        ("warm-starts", warm_starts),
    ):
        if value < 1:
            _fail(f"--{name}: expected an integer >= 1, got {value}")
    from gear.gym.task import HINTS

    if hint not in HINTS:
        _fail(f"--hint: expected one of {list(HINTS)}, got {hint!r}")
    result = gear.gym.run(
        methods or None, seeds=seeds, steps=steps, length=length, hint=hint,
        warm_starts=warm_starts, quick=quick,
        sweep=sweep or (), workers=workers, out=out, plot_dir=plots,
    )  # fmt: skip
    # plain text: rich would wrap long arm names at the terminal's width and read "[...]"
    typer.echo(gear.gym.table(result))


@app.command()
def compare(
    methods: Annotated[
        list[str] | None,
        typer.Option(
            help="Arms to compare (repeat the option): a credit method, or "
            "'[name=]method@key=value,...' with the config keys that arm alone sets "
            "(e.g. 'lead=gear_token@kl_estimator=k1'). Default grpo and gear; with --plan, "
            "the study rule's arms.",
        ),
    ] = None,
    seeds: Annotated[list[int], typer.Option(help="Seeds (repeat the option).")] = [0, 1, 2],  # noqa: B006
    config: Annotated[
        str | None, typer.Option(help=f"Base config (a file, or a shipped recipe: {_RECIPES}).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="'smollm2' (embedded) or a HF model id / path.")
    ] = None,
    task: Annotated[
        str | None, typer.Option(help="arithmetic | gsm8k | math | bfcl | tools")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Steps per run (same for all).")] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            help="The arm (its name) the others are compared to. Default grpo; with --plan, "
            "the study rule's."
        ),
    ] = None,
    effect: Annotated[
        float | None,
        typer.Option(
            help="The gain on the learning metric the study is planned for. Default 0.05; "
            "with --plan, the study rule's."
        ),
    ] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Train nothing: from the finished pairs in --out (a pilot), print the seeds "
            "needed to detect --effect at 80% power.",
        ),
    ] = False,
    report_only: Annotated[
        bool,
        typer.Option(
            "--report",
            help="Train nothing: write the report of --out's rule from the runs that exist "
            "(missing and failed runs are named in its verdict; exit 1 if a run failed). "
            "Reads only --out.",
        ),
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            help="Train only these arms now (repeat the option); the rule keeps every arm and "
            "the report lists the others as missing. A gated second stage, or two processes "
            "sharing one study (each its own --only), use it.",
        ),
    ] = None,
    only_seed: Annotated[
        list[int] | None,
        typer.Option(
            "--only-seed",
            help="Train only these of the rule's seeds now (repeat the option); the rule keeps "
            "every seed. Two processes can share one arm's seeds this way.",
        ),
    ] = None,
    amend_rule: Annotated[
        bool,
        typer.Option(
            "--amend-rule",
            help="Change the rule of a study whose runs began (the report then calls no winner).",
        ),
    ] = False,
    out: Annotated[Path, typer.Option(help="Study directory (resumable).")] = Path("runs/compare"),
    set_: SetOpt = None,
) -> None:
    """Train methods x seeds paired by seed, then report whether any beats the baseline.

    The rule (arms, baseline, metric, seeds, alpha, effect, the config's content) is written to
    OUT/rule.json before the first run. The report (compare.md, compare.json, compare.png): the
    learning gate on the baseline, each method - baseline with Bonferroni and 95% intervals,
    the detectable effect, the worst seeds and one verdict. Run the same command again to resume
    a stopped study. A run that raises is logged (RUN/error.log) and the study goes on; the
    command then exits 1, and the report names the run (the next invocation retries it).
    `--report` writes the report of what exists without training.
    """
    from gear.app import compare as study
    from gear.app.callbacks import RunStopped
    from gear.app.compare.runs import begin_study, run_study

    try:
        study.check_out(out)
        if plan and report_only:
            raise ValueError("--plan and --report: one at a time")
    except ValueError as e:
        _fail(str(e))
    if plan:
        try:
            typer.echo(study.plan_text(study.plan(out, methods, baseline, effect)))
        except ValueError as e:
            _fail(str(e))
        return
    if report_only:
        try:
            result = study.report(out)
        except ValueError as e:
            _fail(str(e))
        _print_report(out, result)
        if result["failed"]:
            raise typer.Exit(1)
        return
    named = dict(steps=steps, model=model, task=task)
    try:
        begun = begin_study(
            out,
            methods or ["grpo", "gear"],
            baseline or "grpo",
            seeds,
            config=config,
            overrides=_overrides(set_, **named),
            effect=study.EFFECT if effect is None else effect,
            only=only,
            only_seeds=only_seed,
            amend=amend_rule,
            labels=_labels(**named),
        )
    except (ValueError, NotImplementedError) as e:
        _fail(str(e))
    try:
        failed = run_study(begun, console)
    except RunStopped as e:
        raise typer.Exit(e.exit_code) from None
    result = study.report(out)
    _print_report(out, result)
    if failed:
        console.print(
            f"[red]{len(failed)} run(s) failed:[/] {', '.join(failed)} (each its error.log); "
            "run the same `gear compare` again to retry them",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _print_report(out: Path, result: dict[str, Any]) -> None:
    console.print(f"[bold]verdict:[/] {escape(result['verdict'])}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'compare.md'}, compare.json and {result['figure']}")


if __name__ == "__main__":
    app()

"""The runs of a study (`gear.app.compare`): the loop that trains one `gear train` run per arm
and seed, paired by seed, and the records the report reads of finished, failed and missing runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gear.app.compare.rule import (
    RUN_HASH,
    fix_rule,
    make_rule,
    mark_run,
    parse_arms,
    run_name,
)
from gear.io import write_text

ERROR_FILE = "error.log"  # in a run directory whose run raised: its traceback


@dataclasses.dataclass
class Study:
    """A study whose rule is fixed: its directory, the config and overrides every run takes,
    its arms (name -> the config values its runs set), seeds, the rule's hash, and the arms and
    seeds to train now (`--only`, `--only-seed`; None: all)."""

    out: Path
    config: str | None
    overrides: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    seeds: list[int]
    rule_hash: str
    only: list[str] | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> the option's name
    only_seeds: list[int] | None = None


def begin_study(
    out: Path,
    methods: Sequence[str],
    baseline: str,
    seeds: Sequence[int],
    *,
    config: str | None,
    overrides: Mapping[str, Any],
    effect: float,
    only: Sequence[str] | None = None,
    amend: bool = False,
    labels: Mapping[str, str] | None = None,
    only_seeds: Sequence[int] | None = None,
) -> Study:
    """Check every arm's config as `gear train` would before its model loads
    (`gear.app.preflight`), then fix the rule (`fix_rule`): nothing is written before every
    arm passes. A ValueError (or NotImplementedError) names what is wrong."""
    from gear.app.config import resolve_config
    from gear.app.preflight import preflight

    arms = parse_arms(methods)
    if baseline not in arms:
        raise ValueError(f"--baseline {baseline}: not one of the arms {list(arms)}")
    first = resolve_config(config, {**overrides, **arms[baseline], "seed": seeds[0]})
    for values in arms.values():
        preflight(resolve_config(config, {**overrides, **values, "seed": seeds[0]}))
    rule = make_rule(
        methods, baseline, seeds, first, config=config, overrides=overrides, effect=effect
    )
    unknown = sorted(set(only or ()) - set(arms))
    if unknown:
        raise ValueError(f"--only {unknown}: not among the arms {list(arms)}")
    unknown_seeds = sorted(set(only_seeds or ()) - set(seeds))
    if unknown_seeds:
        raise ValueError(f"--only-seed {unknown_seeds}: not among the seeds {list(seeds)}")
    h = fix_rule(out, rule, amend=amend)
    return Study(Path(out), config, dict(overrides), arms, list(seeds), h,
                 list(only) if only else None, dict(labels or {}),
                 list(only_seeds) if only_seeds else None)  # fmt: skip


def run_study(study: Study, console: Any) -> list[str]:
    """Train the study's runs that have not finished, seed by seed (a study stopped early has
    complete pairs), each continued where it stopped; returns the names of the runs that
    failed. A run that raises is logged (RUN/error.log) and the study goes on; a stop
    (SIGTERM, Ctrl-C) is said as the study's and `RunStopped` raised."""
    import signal

    from rich.markup import escape

    from gear.app.callbacks import RunStopped
    from gear.app.config import resolve_config, resume_config
    from gear.app.rundir import is_run_dir
    from gear.app.train import train

    failed: list[str] = []
    for seed in study.seeds:
        if study.only_seeds and seed not in study.only_seeds:
            continue
        for arm, arm_values in study.arms.items():
            if study.only and arm not in study.only:
                continue
            run_dir = study.out / run_name(arm, seed)
            if run_record(run_dir) is not None:
                console.print(f"[dim]{run_dir.name}: done, skipped[/]")
                continue
            console.rule(f"{arm} seed {seed}")
            mark_run(run_dir, study.rule_hash)
            clear_failure(run_dir)
            try:
                share_eval_before(study.out, run_dir, seed)
                values = {**study.overrides, **arm_values, "seed": seed}
                if is_run_dir(run_dir):  # started before: continue it as it was
                    cfg = resume_config(run_dir, values, labels=study.labels)
                else:
                    cfg = resolve_config(study.config, {**values, "output_dir": str(run_dir)})
                    cfg = dataclasses.replace(cfg, output_dir=str(run_dir))
                train(cfg, run_dir=run_dir, resume=run_dir.is_dir(), console=console)
            except RunStopped as e:  # one instruction: the study's, not the run's own
                what = f"checkpoint saved: {e.checkpoint}" if e.checkpoint else "no new checkpoint"
                console.print(
                    f"[yellow]stopped by {signal.Signals(e.signum).name} in {run_dir.name}; "
                    f"{what}[/]; run the same `gear compare` again to continue the study",
                    highlight=False,
                    soft_wrap=True,
                )
                raise
            except Exception as e:  # one run's failure ends that run, not the study
                log = record_failure(run_dir, e)
                failed.append(run_dir.name)
                console.print(
                    f"[red]{run_dir.name} failed:[/] {escape(f'{type(e).__name__}: {e}')} "
                    f"(traceback: {log}); the study goes on",
                    highlight=False,
                    soft_wrap=True,
                )
    return failed


def record_failure(run_dir: Path, error: BaseException) -> Path:
    """Write the traceback of `error`, which ended the run in `run_dir`, to its error.log."""
    import traceback

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text(run_dir / ERROR_FILE, "".join(traceback.format_exception(error)))


def clear_failure(run_dir: Path) -> None:
    """Before another attempt at a run: its earlier error.log goes (it fails anew, or it ends)."""
    (Path(run_dir) / ERROR_FILE).unlink(missing_ok=True)


def failure(run_dir: Path) -> str | None:
    """The error that ended the run in `run_dir` (the last line of its error.log), or None."""
    path = Path(run_dir) / ERROR_FILE
    if not path.is_file():
        return None
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "error.log is empty"


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A study run's summary.json (`gear.app.rundir.read_summary`); an `InputError` naming it
    when it is damaged, saying how the study recovers."""
    from gear.app.rundir import read_summary as read

    todo = f"move {run_dir} aside and `gear compare` trains that run again, or restore the file"
    return read(run_dir, todo)


def share_eval_before(out: Path, run_dir: Path, seed: int) -> None:
    """Runs of one seed start from the same model and data: reuse a sibling's before-training
    evaluation instead of repeating it (written into the new run's summary.json)."""
    from gear.app.rundir import SUMMARY_FILE

    if (run_dir / SUMMARY_FILE).is_file():
        return
    for sibling in sorted(out.glob(f"*-seed{seed}/{SUMMARY_FILE}")):
        before = read_summary(sibling.parent).get("eval_before")
        if before:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text(run_dir / SUMMARY_FILE, json.dumps({"eval_before": before}, indent=2))
            return


def run_record(run_dir: Path) -> dict[str, Any] | None:
    """The finished run in `run_dir` as a record (`gear.evidence.compare`): its held-out
    scores before and after training (summary.json) and training reward per step
    (metrics.jsonl); None while it has not finished."""
    from gear.app.rundir import METRICS_FILE, SUMMARY_FILE, read_metrics

    run_dir = Path(run_dir)
    if not (run_dir / SUMMARY_FILE).is_file():
        return None
    summary = read_summary(run_dir)
    if not summary.get("eval_after") or not summary.get("eval_before"):
        return None
    steps = [m for m in read_metrics(run_dir / METRICS_FILE) if m.get("reward") is not None]
    hash_file = run_dir / RUN_HASH
    return {
        "name": run_dir.name,
        "seed": summary.get("seed"),
        "method": summary.get("method"),
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "reward": [m["reward"] for m in steps],
        "steps": [m["step"] for m in steps],
        "rule_sha256": hash_file.read_text().strip() if hash_file.is_file() else None,
        "precision": summary.get("precision"),
    }


def collect(
    out: Path, arms: Sequence[str], seeds: Sequence[int] | None, metric: str
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[int]], dict[str, str], dict[str, str]]:
    """The finished runs of `arms` in `out` (at `seeds`; None: every seed found), the seeds
    asked but not finished per arm, the runs that cannot be used (name -> why) and the runs
    that failed (name -> the error that ended them; `failure`)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    missing: dict[str, list[int]] = {}
    unusable: dict[str, str] = {}
    failed: dict[str, str] = {}
    for arm in arms:
        wanted = seeds
        if wanted is None:
            found = (d.name[len(arm) + len("-seed") :] for d in Path(out).glob(f"{arm}-seed*"))
            wanted = sorted(int(s) for s in found if s.isdigit())
        runs[arm], missing[arm] = [], []
        for seed in wanted:
            name = run_name(arm, seed)
            r = run_record(Path(out) / name)
            if r is None:
                missing[arm].append(seed)
                error = failure(Path(out) / name)
                if error is not None:
                    failed[name] = error
            elif metric not in r["before"] or metric not in r["after"]:
                unusable[name] = f"no {metric} in its held-out scores (eval_samples 0?)"
                missing[arm].append(seed)
            else:
                runs[arm].append(r | {"seed": seed})
    return runs, missing, unusable, failed

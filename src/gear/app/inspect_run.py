"""`gear inspect RUN_DIR`: a run's credit records as an HTML token viewer (`gear.viz.html`)
and the Figure-2 trajectory of one row (`gear.viz.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def inspect_run(run_dir: Path, out: Path | None, console: Any) -> None:
    """Write RUN_DIR's credit viewer (`out`, default RUN_DIR/credit.html) and
    RUN_DIR/plots/figure2.png, and say what was written. A run that has no final model (it
    stopped before it finished) shows the records it wrote, with a note naming its newest
    complete checkpoint. A ValueError when there is nothing to show."""
    from rich.markup import escape

    from gear.app.rundir import (
        checkpoints,
        is_run_dir,
        newest_complete,
        run_config_file,
        unfinished_note,
    )
    from gear.viz.html import write_credit_html
    from gear.viz.plots import plot_trajectory
    from gear.viz.record import read_credit_records, trajectory_row

    if not (run_dir / "credit").is_dir():
        if not is_run_dir(run_dir):
            raise ValueError(
                f"{run_dir}: not a gear run directory (no config.yaml, no credit/ directory); "
                "give `gear inspect` the directory a `gear train` run wrote"
            )
        raise ValueError(
            f"{run_dir}: no credit/ directory: the run has written no credit records yet (one "
            "every credit_log_steps steps)"
        )
    if is_run_dir(run_dir) and not (run_dir / "final").is_dir():
        config = run_config_file(run_dir, "fix or restore it")
        newest, damaged = newest_complete(checkpoints(run_dir))
        note = unfinished_note(run_dir, newest, damaged, config) + "; showing the records it wrote"
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    records = read_credit_records(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'credit'}: no credit records yet")
    page = write_credit_html(run_dir, out)
    record, why = trajectory_row(records)
    fig = plot_trajectory(record, run_dir / "plots" / "figure2.png", why)
    console.print(f"wrote {page} ({len(records)} rows) and {fig}")
    console.print(f"{fig.name}: step {record['step']}, row {record['row']}: {why}", highlight=False)

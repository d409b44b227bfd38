"""Static PNG plots (matplotlib, Agg backend): one trajectory, run metrics, learning curves."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from gear.viz.html import SEGMENT_COLOURS, WHITESPACE_MARKS, token_label

KL_COLOUR, ENT_COLOUR, W_COLOUR = "#cb181d", "#2171b5", "#4d9221"
TICK_PITCH = 0.13  # inches per token label (7 pt text, rotated): closer ones overlap
LABEL_CHARS = 10  # a longer token label is cut, with '…'
PLOT_MARKS = WHITESPACE_MARKS | {"\r": "\\r"}  # matplotlib's DejaVu Sans has no '␍'


def _nan(xs: Sequence[float | None]) -> np.ndarray:
    """A float array with None -> NaN."""
    return np.array([np.nan if x is None else float(x) for x in xs], dtype=float)


def _runs(values: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Maximal runs of equal values: [(start, end_exclusive, value), ...]."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, values[start]))
            start = i
    return runs


def _labelled(n: int, onsets: Sequence[int], room: int) -> list[int]:
    """The token positions that get a label: all `n` when they fit in `room`, else every k-th
    (k = ceil(n / room)) and every onset (the blamed tokens), dropping the k-th ones nearer
    than k to an onset, where their labels would overlap."""
    if n <= room:
        return list(range(n))
    k = math.ceil(n / room)
    marked = np.zeros(n + 2 * k, dtype=bool)  # onsets, padded by k on both sides
    marked[np.asarray(onsets, dtype=int) + k] = True
    near = np.convolve(marked, np.ones(2 * k - 1), mode="same")[k:-k] > 0
    return sorted({*onsets, *(i for i in range(0, n, k) if not near[i])})


def _token_ticks(ax: Any, record: dict[str, Any], width: float) -> int:
    """Label the x axis with the row's tokens as the viewer shows them (`token_label`),
    rotated and thinned to fit `width` inches (`_labelled`): onsets bold, observation tokens
    grey. Returns the label stride (1: every token)."""
    tokens, n = record["tokens"], len(record["tokens"])
    onsets = [i for i, o in enumerate(record["onset"]) if o]
    ticks = _labelled(n, onsets, max(1, int((width - 1.8) / TICK_PITCH)))
    labels = []
    for i in ticks:
        text = token_label(tokens[i], PLOT_MARKS)
        labels.append(text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…")
    # parse_math=False: a token such as '$x^$' is text, not (broken) math markup
    ax.set_xticks(ticks, labels=labels, rotation=90, fontsize=7, parse_math=False)
    for i, label in zip(ticks, ax.get_xticklabels(), strict=True):
        if record["onset"][i]:
            label.set_fontweight("bold")
        elif not record["valid"][i]:
            label.set_color("#6b7280")
    return math.ceil(n / len(ticks)) if ticks else 1


def plot_trajectory(record: dict[str, Any], path: str | Path, why: str | None = None) -> Path:
    """The paper's Figure-2 view of one credit record (contracts format).

    x = the row's tokens (0 .. T_row-1), labelled with their text as the viewer shows it
    (whitespace marked, onsets bold; thinned to every k-th token and every onset when they do
    not fit), token index on the top axis; normalised KL (red) and entropy (blue) on the left
    axis, weights (green steps) on a twin axis; onsets as vertical lines, segments shaded by id,
    observation (invalid) tokens shaded grey. `why`: why this row was picked
    (`gear.viz.record.trajectory_row`), written above the title. Returns the PNG path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(record["tokens"])
    x = np.arange(n)
    valid = np.array(record["valid"], dtype=bool)
    kl = np.where(valid, _nan(record["kl_norm"]), np.nan)
    ent = np.where(valid, _nan(record["entropy_norm"]), np.nan)
    w = np.where(valid, _nan(record["weight"]), np.nan)

    width = max(8.0, min(32.0, 1.8 + n * TICK_PITCH))
    fig, ax = plt.subplots(figsize=(width, 4.4), dpi=110, layout="constrained")
    for start, end, seg in _runs(record["segment_id"]):
        if seg >= 0:
            colour = SEGMENT_COLOURS[seg % len(SEGMENT_COLOURS)]
            ax.axvspan(start - 0.5, end - 0.5, color=colour, alpha=0.16, lw=0)
    for start, end, ok in _runs(valid.tolist()):
        if not ok:
            ax.axvspan(start - 0.5, end - 0.5, color="#9ca3af", alpha=0.3, lw=0, hatch="//")
    for i in np.flatnonzero(np.array(record["onset"], dtype=bool)):
        ax.axvline(i, color="#111", lw=0.9, alpha=0.8)
    ax.plot(x, kl, color=KL_COLOUR, lw=1.5, label="normalised KL d̃")
    ax.plot(x, ent, color=ENT_COLOUR, lw=1.2, alpha=0.85, label="normalised entropy H̃")
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_ylim(-0.03, 1.05)
    stride = _token_ticks(ax, record, width)
    shown = "every token" if stride == 1 else f"1 in {stride} labelled, and every onset"
    ax.set_xlabel(f"token ({shown}; · space, ↵ newline, ∅ empty)", fontsize=9)
    top = ax.secondary_xaxis("top")
    top.tick_params(labelsize=7)
    top.set_xlabel("token index", fontsize=8)
    ax.set_ylabel("normalised signal")
    ax.spines[["top"]].set_visible(False)

    ax2 = ax.twinx()
    ax2.step(x, w, where="mid", color=W_COLOUR, lw=1.3, ls="--", label="weight w")
    ax2.axhline(1.0, color=W_COLOUR, lw=0.6, alpha=0.4)
    finite = w[np.isfinite(w)]
    top = max(1.5, float(finite.max()) * 1.08) if finite.size else 1.5
    ax2.set_ylim(0, top)
    ax2.set_ylabel("weight", color=W_COLOUR)
    ax2.tick_params(axis="y", colors=W_COLOUR)
    ax2.spines[["top"]].set_visible(False)

    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    handles += [
        Line2D([], [], color="#111", lw=0.9, label="onset"),
        Patch(color=SEGMENT_COLOURS[0], alpha=0.25, lw=0, label="segment (colour = id)"),
        Patch(facecolor="#d1d5db", hatch="//", lw=0, label="observation (no credit)"),
    ]
    ncol = 6 if width >= 11 else 3  # one row where it fits
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
    adv, rew = record.get("advantage"), record.get("reward")
    ax.set_title(
        f"{record.get('method', '?')} · step {record.get('step', '?')} · row "
        f"{record.get('row', '?')} · reward {rew if rew is None else f'{rew:.3g}'} · "
        f"advantage {adv if adv is None else f'{adv:+.3f}'}",
        loc="left", fontsize=10,
    )  # fmt: skip
    if why:
        fig.suptitle(f"picked: {why}", x=0.01, ha="left", fontsize=8, color="#555")
    with warnings.catch_warnings():  # a glyph DejaVu Sans lacks (CJK, emoji) draws as a box
        warnings.filterwarnings("ignore", "Glyph .* missing from font")
        fig.savefig(path)
    plt.close(fig)
    return path


def _metric_keys(keys: set[str]) -> list[str]:
    """What `plot_metrics` draws, in order: reward, eval/accuracy, entropy, then gear/*."""
    first = [k for k in ("reward", "eval/accuracy", "entropy") if k in keys]
    return first + sorted(k for k in keys if k.startswith("gear/"))


def plot_metrics(metrics_jsonl_path: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG per metric of a `metrics.jsonl` (one JSON object per line with a `step` key).

    Draws `reward`, `eval/accuracy`, `entropy` and every `gear/*` key that occurs, against
    `step`; a line lacking a key (e.g. eval every k steps) is skipped for that key. A step
    written twice has its last value drawn; a line that is not complete JSON (a write cut short)
    is skipped. Files are named after the key with '/' -> '_' (e.g. `gear_kl_mean.png`).
    Returns the written paths.
    """
    by_key: dict[str, dict[float, float]] = {}
    for line in Path(metrics_jsonl_path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int | float):
            continue
        for k, v in row.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                by_key.setdefault(k, {})[float(step)] = float(v)  # the last record wins
    series = {k: list(points.items()) for k, points in by_key.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in _metric_keys(set(series)):
        pts = sorted(series[key])
        fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, lw=1.5, color="#1f77b4")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _mean_std(
    seeds: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std (ddof 0) across seeds; seeds on different step grids are interpolated onto
    the union of their steps within the range all seeds cover. Returns (steps, mean, std)."""
    curves = [(np.asarray(s, float), np.asarray(v, float)) for s, v in seeds if len(s)]
    lo = max(s.min() for s, _ in curves)
    hi = min(s.max() for s, _ in curves)
    grid = np.unique(np.concatenate([s for s, _ in curves]))
    grid = grid[(grid >= lo) & (grid <= hi)]
    ys = np.stack([np.interp(grid, *zip(*sorted(zip(s, v, strict=True)), strict=True))
                   for s, v in curves])  # fmt: skip
    return grid, ys.mean(axis=0), ys.std(axis=0)


def plot_learning_curves(
    curves: dict[str, list[tuple[Sequence[float], Sequence[float]]]],
    path: str | Path,
    ylabel: str,
) -> Path:
    """Mean ± std band across seeds, one line per method.

    Args:
        curves: method -> one (steps, values) pair per seed (equal-length sequences).
        path: PNG to write. ylabel: y-axis label.
    Returns:
        The PNG path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=110)
    for k, (method, seeds) in enumerate(curves.items()):
        if not any(len(s) for s, _ in seeds):
            continue
        steps, mean, std = _mean_std(seeds)
        colour = f"C{k % 10}"
        n = sum(1 for s, _ in seeds if len(s))
        ax.plot(steps, mean, color=colour, lw=1.8, label=f"{method} (n={n})")
        ax.fill_between(steps, mean - std, mean + std, color=colour, alpha=0.18, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

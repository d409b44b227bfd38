"""The figure of a `gear compare` report (gear.app.compare): learning curves beside the paired
differences with their intervals."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def plot_comparison(result: dict[str, Any], path: str | Path) -> Path:
    """Left: each arm's training reward per step (mean over its seeds, thin lines per seed).
    Middle: the held-out metric before and after training, one line per run. Right: each
    candidate - baseline after training, paired by seed: the Bonferroni interval (thick), the
    95% one (thin), the mean (dot); the band |difference| < the study's effect is shaded."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    per_seed, base = result["per_seed"], result["baseline"]
    fig, (curves, held, diffs) = plt.subplots(1, 3, figsize=(15, 4.4), width_ratios=[1.1, 0.8, 1])
    for k, (arm, rs) in enumerate(per_seed.items()):
        colour = f"C{k % 10}"
        for r in rs:
            curves.plot(r["steps"], r["reward"], color=colour, lw=0.6, alpha=0.35)
            last = r["steps"][-1] if r["steps"] else 1
            held.plot([0, last], [r["before"], r["after"]], color=colour, lw=0.8, alpha=0.6,
                      marker="o", ms=3)  # fmt: skip
        lengths = {len(r["reward"]) for r in rs}
        if rs and len(lengths) == 1 and lengths != {0}:  # the mean where the seeds align
            mean = np.mean([r["reward"] for r in rs], axis=0)
            curves.plot(rs[0]["steps"], mean, color=colour, lw=2, label=f"{arm} (n={len(rs)})")
        else:
            curves.plot([], [], color=colour, lw=2, label=f"{arm} (n={len(rs)})")
    curves.set_xlabel("step")
    curves.set_ylabel("training reward")
    curves.set_title("training reward per step")
    curves.legend(fontsize=8, frameon=False)
    held.set_xlabel("step")
    held.set_ylabel(result["metric"].split(" (")[0])  # its details are in compare.md
    held.set_title("held-out metric, before and after")
    comps = result["comparisons"]
    effect = result["rule"]["effect"]
    diffs.axvspan(-effect, effect, color="0.92", label=f"|difference| < {effect:g}")
    diffs.axvline(0, color="black", lw=0.8)
    level = f"{100 * result['level']:.4g}%"
    for i, c in enumerate(comps.values()):
        b = c["bonferroni"]
        if None in b["ci"] or b["mean"] is None:
            continue
        diffs.plot(b["ci"], [i, i], lw=5, color="C0", solid_capstyle="butt",
                   label=f"{level} (Bonferroni)" if i == 0 else None)  # fmt: skip
        diffs.plot(c["ci95"], [i, i], lw=1.2, color="black", label="95%" if i == 0 else None)
        diffs.scatter([b["mean"]], [i], color="black", zorder=3, s=16)
    diffs.set_yticks(
        range(len(comps)), [f"{a} (n={c['bonferroni']['n']})" for a, c in comps.items()]
    )
    diffs.set_ylim(len(comps) - 0.5, -0.5)
    diffs.set_xlabel(f"method − {base} after training, paired by seed")
    diffs.set_title("\n".join(textwrap.wrap(result["verdict"], 70)), fontsize=8)
    diffs.legend(fontsize=7, loc="lower right", frameon=False)
    for ax in (curves, held, diffs):
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

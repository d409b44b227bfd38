"""What the gym reports: paired statistics over seeds, localisation of blame, plots.

Statistics: every arm's final held-out accuracy per seed; the mean over seeds with a t-interval;
paired differences between arms on the same seeds (same warm start, same prompts, same random
numbers) with a t-interval (`gear.evidence`); steps to a threshold. Localisation: on natural
failures of the warm-started model, where each arm's largest weight lands relative to the
checker's first wrong step, against a placebo (correct rollouts scored as failures, a random step
called wrong).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gear.evidence import t_interval
from gear.gym.model import completion_logits, sample
from gear.gym.task import STEP_LEN, ChainTask
from gear.gym.train import Arm, answer_influence, credit

#: paired differences always reported when both arms ran: "a-b" = a minus b
PAIRS = (("oracle", "grpo"), ("gear", "grpo"), ("gear", "random"), ("gear_k1", "gear"))


def _final(run: dict[str, Any], metric: str) -> float:
    return float(run["curve"][-1][metric])


def steps_to(run: dict[str, Any], threshold: float, metric: str) -> int | None:
    """First evaluated step whose `metric` reaches `threshold`, None if never."""
    return next((c["step"] for c in run["curve"] if c[metric] >= threshold), None)


def summarise(
    runs: list[dict[str, Any]], threshold: float, metric: str = "exact"
) -> dict[str, Any]:
    """`arms` and `paired` of the result JSON from the per-(arm, seed) runs.

    `metric` is the primary one (`exact`: the probability of the right solution, no sampling
    noise); the other (`accuracy`, one sample per problem) is reported beside it."""
    other = "accuracy" if metric == "exact" else "exact"
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    arms = {}
    for name, per_seed in by_arm.items():
        seeds = sorted(per_seed)
        finals = [_final(per_seed[s], metric) for s in seeds]
        steps = [c["step"] for c in per_seed[seeds[0]]["curve"]]
        curve = []
        for i, step in enumerate(steps):
            ci = t_interval([per_seed[s]["curve"][i][metric] for s in seeds])
            ot = t_interval([per_seed[s]["curve"][i][other] for s in seeds])
            curve.append({"step": step, "mean": ci["mean"], "ci": ci["ci"], other: ot["mean"]})
        reached = [steps_to(per_seed[s], threshold, metric) for s in seeds]
        final = t_interval(finals)
        arms[name] = {
            "final": final["mean"],
            "final_ci": final["ci"],
            **change_vs_warm_start(per_seed, metric),
            f"final_{other}": t_interval([_final(per_seed[s], other) for s in seeds])["mean"],
            "per_seed": finals,
            "curve": curve,
            "steps_to_threshold": {
                "threshold": threshold,
                "reached": sum(x is not None for x in reached),
                "of": len(seeds),
                "median_step": _median([x for x in reached if x is not None]),
            },
        }
    paired = {}
    names = list(by_arm)
    pairs = [p for p in PAIRS if p[0] in by_arm and p[1] in by_arm]
    pairs += [(n, "grpo") for n in names if n != "grpo" and "grpo" in by_arm]
    for a, b in dict.fromkeys(pairs):
        common = sorted(set(by_arm[a]) & set(by_arm[b]))
        diff = [_final(by_arm[a][s], metric) - _final(by_arm[b][s], metric) for s in common]
        sec = [_final(by_arm[a][s], other) - _final(by_arm[b][s], other) for s in common]
        d = t_interval(diff)
        e = t_interval(sec)
        paired[f"{a}-{b}"] = {
            "mean": d["mean"],
            "ci": d["ci"],
            "n": d["n"],
            "sd": d["sd"],
            "wins": sum(x > 0 for x in diff),
            other: {"mean": e["mean"], "ci": e["ci"]},
        }
    return {"arms": arms, "paired": paired}


def change_vs_warm_start(per_seed: dict[int, dict[str, Any]], metric: str) -> dict[str, Any]:
    """What RL did to one arm, per seed: final minus step 0 (the warm start on that seed's
    held-out set), the mean with a t-interval, the worst seed, how many ended below their warm
    start, and the spread within and between warm starts (runs carry their warm start's index
    as `warm`; one warm start: no between-spread).

    `warm_spread`: `within_sd` is the pooled SD of the change around each warm start's mean
    (the seeds' own variance), `between_sd` the SD of the warm starts' means (the
    initialisation's variance; it holds within / sqrt(seeds per warm start) of sampling noise)."""
    rows = [
        {
            "seed": s,
            "warm": int(r.get("warm", 0)),
            "start": float(r["curve"][0][metric]),
            "final": _final(r, metric),
            "change": _final(r, metric) - float(r["curve"][0][metric]),
        }
        for s, r in sorted(per_seed.items())
    ]
    change = t_interval([r["change"] for r in rows])
    worst = min(rows, key=lambda r: r["change"])
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["warm"], []).append(r["change"])
    means = {w: sum(v) / len(v) for w, v in sorted(groups.items())}
    dof = sum(len(v) - 1 for v in groups.values())
    within = (
        math.sqrt(sum((x - means[w]) ** 2 for w, v in groups.items() for x in v) / dof)
        if dof > 0
        else math.nan
    )
    between = t_interval(list(means.values()))["sd"]
    return {
        "change": change["mean"],
        "change_ci": change["ci"],
        "worst_seed": worst,
        "below_warm_start": sum(r["change"] < 0 for r in rows),
        "warm_spread": {"within_sd": within, "between_sd": between, "mean_by_warm": means},
        "seed_table": rows,
    }


def _median(xs: list[int]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    mid = len(xs) // 2
    return float(xs[mid]) if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


@torch.no_grad()
def localisation(
    model: Any, task: ChainTask, arms: list[Arm], prompts: int = 256, group: int = 8, seed: int = 0
) -> dict[str, Any]:
    """Where each arm's blame lands on natural failures of `model`.

    Samples `prompts` x `group` rollouts; failed ones are scored with A = -1, and for each arm
    `hit_step` is the share of the largest weight that falls in the checker's first wrong step
    (ties split evenly, so uniform weights score 1 / length), `hit_token` the same for the first
    wrong token, `hit_step_or_next` the same for the step or the token after it (the next
    step's first token, where a full-vocabulary KL first sees the step's last digit),
    `mass_lift` the mean weight in that step over the row's mean weight. Placebo:
    the correct rollouts, also scored with A = -1, with a random step (seeded) called wrong;
    `shuffled`: the failed rows with their first-error labels permuted among them (controls for
    where errors tend to fall).
    """
    gen = torch.Generator().manual_seed(30_000 + seed)
    problems = task.problems(prompts, gen, "test").repeat_interleave(group, dim=0)
    student = task.prompts(problems)
    comp = sample(model, student, task.completion_len, gen)
    correct = task.rewards(problems, comp) > 0
    first_tok = task.first_error(problems, comp)
    failed = ~correct & (first_tok >= 0)
    s_logits = completion_logits(model, student, comp)
    t_logits = completion_logits(model, task.teacher_prompts(problems), comp)
    c_logits = completion_logits(model, task.contrast_teacher_prompts(problems), comp)
    fake_step = torch.randint(0, task.length, (len(problems),), generator=gen)
    # the second placebo: the failed rows themselves, their first-error labels permuted among
    # them (same rows, same spread of error positions, label unrelated to the row)
    perm = torch.randperm(int(failed.sum()), generator=gen)
    shuffled_tok = first_tok.clone()
    shuffled_tok[failed] = first_tok[failed][perm]
    out: dict[str, Any] = {
        "rollouts": len(problems),
        "failures": int(failed.sum()),
        "placebo_rows": int(correct.sum()),
        "chance_hit_step": 1 / task.length,
        "arms": {},
    }
    for arm in arms:
        res = {}
        for label, rows, step, tok in (
            ("real", failed, first_tok // STEP_LEN, first_tok),
            ("placebo", correct, fake_step, fake_step * STEP_LEN + 4),
            ("shuffled", failed, shuffled_tok // STEP_LEN, shuffled_tok),
        ):
            if not bool(rows.any()):
                continue
            p, c, st, tk = problems[rows], comp[rows], step[rows], tok[rows]
            adv = -torch.ones(len(p))
            w = -credit(
                arm, task, p, c, adv, s_logits[rows], t_logits[rows], seed=seed,
                contrast_logits=c_logits[rows],
                influence=answer_influence(model, arm, task, p, c),
            )  # fmt: skip
            top = w >= w.max(dim=1, keepdim=True).values - 1e-9
            in_step = task.step_mask(st)
            pos = torch.arange(task.completion_len)[None, :]
            on_tok = pos == tk[:, None]
            # a full-vocabulary KL first sees token t at t + 1: count the token after the step
            after = in_step | (pos == (st[:, None] + 1) * STEP_LEN)
            res[label] = {
                "hit_step": float(((top & in_step).sum(1) / top.sum(1)).mean()),
                "hit_step_or_next": float(((top & after).sum(1) / top.sum(1)).mean()),
                "hit_token": float(((top & on_tok).sum(1) / top.sum(1)).mean()),
                "mass_lift": float(((w * in_step).sum(1) / STEP_LEN / w.mean(1)).mean()),
            }
        for other in ("placebo", "shuffled"):
            if "real" in res and other in res:
                res[f"real_minus_{other}"] = {
                    k: res["real"][k] - res[other][k] for k in res["real"]
                }
        out["arms"][arm.name] = res
    return out


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Accuracy curves with 95% bands and a forest plot of the paired differences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, arm in result["arms"].items():
        steps = [c["step"] for c in arm["curve"]]
        mean = [c["mean"] for c in arm["curve"]]
        ax.plot(steps, mean, label=name, lw=2 if name in ("oracle", "grpo", "gear") else 1)
        lo = [c["ci"][0] for c in arm["curve"]]
        hi = [c["ci"][1] for c in arm["curve"]]
        if not any(math.isnan(x) for x in lo):
            ax.fill_between(steps, lo, hi, alpha=0.12)
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out {result.get('metric_name', 'exact')} accuracy")
    ax.set_title(
        f"credit gym: chain length {result['task']['length']}, {len(result['seeds'])} seeds"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "gym_curves.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    pairs = list(result["paired"].items())
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(pairs) + 1.2))
    for i, (name, d) in enumerate(pairs):
        ax.errorbar(
            d["mean"],
            i,
            xerr=None
            if math.isnan(d["ci"][0])
            else [[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]],
            fmt="o",
            color="C3" if name.startswith("oracle") else "C0",
            capsize=3,
        )
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(pairs)), [p[0] for p in pairs])
    ax.invert_yaxis()
    ax.set_xlabel("paired difference in final held-out accuracy (95% t-interval)")
    fig.tight_layout()
    paths.append(out_dir / "gym_paired.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths

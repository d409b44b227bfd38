"""Issue 27: where GEAR's blame lands relative to the first error, and the pre-registered
confirmation of the first-departure variants (BENCHMARKS.md, "First departure").

    python -m studies.credit_confirm diagnose          # seconds once caches exist
    python -m studies.credit_confirm confirm --workers 2

`diagnose` reads natural failures of the gym's warm-started model (chain lengths 4 and 3; the
same rollouts as the gym's localisation readout) and of SmolLM2-135M (the on-policy cache of
`python -m studies.localization natural`), and says, per KL estimator, where the KL mass, the
onsets and the extra blame of `gear`, `gear_departure` and `gear_departure_point` fall
relative to the first wrong step: before it, on it, after it. Writes
studies/results/credit_diagnosis.json and docs/credit_diagnosis.png.

`confirm` runs the pre-registered gym grid (`ARMS` x `SEEDS` at each of `LENGTHS`; every
finished (arm, seed) run is kept by `gear.gym`, so a stopped grid resumes), the SmolLM2
localisation with its placebo, applies the rule and writes studies/results/credit_confirm.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gear import evidence
from gear.evidence import bonferroni, bootstrap_difference
from studies import localization as loc  # the on-policy study: SmolLM2's failed rows
from studies import onpolicy

HERE = Path(__file__).parent

RESULTS = HERE / "results"  # where docs/evidence and the README cite them
DOCS = HERE.parent / "docs"
METHODS = ("gear", "gear_departure", "gear_departure_point")
OFFSETS = range(-3, 4)  # steps relative to the first wrong step


def _where(before: float, at: float, after: float) -> dict[str, float]:
    total = before + at + after
    if total <= 0:
        return {"before": math.nan, "at": math.nan, "after": math.nan}
    return {"before": before / total, "at": at / total, "after": after / total}


# --------------------------------------------------------------------------- gym diagnosis


@torch.no_grad()
def gym_failures(length: int, prompts: int = 256, group: int = 8) -> dict[str, Any]:
    """The natural failures of the gym's readout (same seed as `gear.gym.report.localisation`)
    with the student's and the teacher's logits."""
    from gear.gym.model import (
        ModelConfig,
        WarmStart,
        build_model,
        completion_logits,
        sample,
        warm_start,
    )
    from gear.gym.task import ChainTask

    task, cfg = ChainTask(length), ModelConfig()
    state, _ = warm_start(task, cfg, WarmStart(), log=lambda s: None)
    model = build_model(cfg, task)
    model.load_state_dict(state)
    model.eval()
    gen = torch.Generator().manual_seed(30_000)
    problems = task.problems(prompts, gen, "test").repeat_interleave(group, dim=0)
    comp = sample(model, task.prompts(problems), task.completion_len, gen)
    first = task.first_error(problems, comp)
    failed = (task.rewards(problems, comp) == 0) & (first >= 0)
    return {
        "task": task,
        "comp": comp[failed],
        "first": first[failed],
        "student": completion_logits(model, task.prompts(problems[failed]), comp[failed]),
        "teacher": completion_logits(model, task.teacher_prompts(problems[failed]), comp[failed]),
    }


def by_offset(values: torch.Tensor, rel: torch.Tensor) -> dict[str, float]:
    """Mean over rows of each offset's share of the row's total. values, rel: (N, T)."""
    total = values.sum(dim=1).clamp(min=1e-12)
    return {str(o): float(((values * (rel == o)).sum(dim=1) / total).mean()) for o in OFFSETS}


def gym_diagnosis(length: int) -> dict[str, Any]:
    """Per estimator: KL mass, onsets, the first onset and the extra blame by step offset."""
    from gear.credit import CreditParams, credit_details
    from gear.credit.signals import signals_from_logits
    from gear.gym.task import STEP_LEN

    f = gym_failures(length)
    n, T = f["comp"].shape
    step = torch.arange(T)[None, :] // STEP_LEN
    rel = step - (f["first"] // STEP_LEN)[:, None]
    out: dict[str, Any] = {"failed_rows": n, "estimators": {}}
    for est in ("full", "k1", "topk"):
        sig = signals_from_logits(f["student"], f["teacher"], f["comp"], estimator=est)
        kl = sig.kl.double()
        mass = kl.clamp(min=0)
        e: dict[str, Any] = {
            "kl_mass": by_offset(mass, rel),
            "kl_mass_where": _where(*(float((mass * m).sum()) for m in _bands(rel))),
            "methods": {},
        }
        for name in METHODS:
            d = credit_details(
                -torch.ones(n, dtype=torch.float64), torch.ones(n, T, dtype=torch.bool),
                kl=kl, entropy=sig.entropy.double(), params=CreditParams(method=name),
            )  # fmt: skip
            onsets = d.onsets.double()
            first_onset = torch.where(d.onsets.any(1), d.onsets.long().argmax(1), -1)
            has = first_onset >= 0
            first_rel = rel.gather(1, first_onset.clamp(min=0)[:, None]).squeeze(1)[has]
            blame = (d.weights.double() - 1).clamp(min=0)
            e["methods"][name] = {
                "onsets_per_row": float(onsets.sum(1).mean()),
                "onsets": by_offset(onsets, rel),
                "first_onset_where": {
                    "before": float((first_rel < 0).double().mean()),
                    "at": float((first_rel == 0).double().mean()),
                    "after": float((first_rel > 0).double().mean()),
                    "rows_without": int((~has).sum()),
                },
                "blame": by_offset(blame, rel),
                "blame_where": _where(*(float((blame * m).sum()) for m in _bands(rel))),
            }
        out["estimators"][est] = e
    out["note"] = (
        "topk = full here: the gym's vocabulary (16) is below k (64), so the top-k KL is exact"
    )
    return out


def _bands(rel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (rel < 0).double(), (rel == 0).double(), (rel > 0).double()


# --------------------------------------------------------------------------- SmolLM2 diagnosis


def natural_failed(cache: Path) -> list[dict[str, Any]]:
    nat = onpolicy.load_cache(cache / "natural.pt")
    return [r for g in nat.values() for r in g if "error" in r]


def lm_diagnosis(cache: Path) -> dict[str, Any]:
    """Before / on / after the erroneous equation (tokens) on SmolLM2's failed rows, for the
    full KL and k1 (the cache holds the full KL and the sampled token's log-probabilities; the
    top-k KL would need the logits again)."""
    from gear.credit import CreditParams, credit_details

    bad = natural_failed(cache)
    if not bad:
        return {"rows": 0, "note": f"no on-policy cache in {cache}"}
    out: dict[str, Any] = {"rows": len(bad), "estimators": {}}
    for est in ("full", "k1"):
        b = loc.batch(bad, est)
        valid = b["valid"]
        pos = torch.arange(valid.shape[1])[None, :]
        lo = torch.tensor([r["step"][0] for r in bad])[:, None]
        hi = torch.tensor([r["step"][1] for r in bad])[:, None]
        bands = ((pos < lo) & valid, (pos >= lo) & (pos < hi), (pos >= hi) & valid)
        mass = torch.where(valid, b["kl"].double().clamp(min=0), 0.0)
        e: dict[str, Any] = {
            "kl_mass_where": _where(*(float((mass * m).sum()) for m in bands)),
            "methods": {},
        }
        for name in METHODS:
            d = credit_details(
                -torch.ones(len(bad)), valid, kl=b["kl"], entropy=b["entropy"],
                params=CreditParams(method=name),
            )  # fmt: skip
            blame = torch.where(valid, (d.weights.double() - 1).clamp(min=0), 0.0)
            first_onset = torch.where(d.onsets.any(1), d.onsets.long().argmax(1), -1)[:, None]
            has = (first_onset >= 0).squeeze(1)
            fo = first_onset[has]
            e["methods"][name] = {
                "onsets_per_row": float(d.onsets.double().sum(1).mean()),
                "onsets_where": _where(*(float((d.onsets & m).sum()) for m in bands)),
                "first_onset_where": {
                    "before": float((fo < lo[has]).double().mean()),
                    "at": float(((fo >= lo[has]) & (fo < hi[has])).double().mean()),
                    "after": float((fo >= hi[has]).double().mean()),
                    "rows_without": int((~has).sum()),
                },
                "blame_where": _where(*(float((blame * m).sum()) for m in bands)),
            }
        out["estimators"][est] = e
    return out


def plot_diagnosis(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result["gym"]["4"]["estimators"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    xs = list(OFFSETS)
    for ax, est in zip(axes[:2], ("full", "k1"), strict=True):
        e = g[est]
        ax.plot(xs, [e["kl_mass"][str(o)] for o in xs], "k--", label="KL mass")
        for name in METHODS:
            ax.plot(xs, [e["methods"][name]["blame"][str(o)] for o in xs], marker="o", label=name)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_title(f"gym, length 4, {est} KL: share per step")
        ax.set_xlabel("step relative to the first wrong step")
    axes[0].set_ylabel("share of the row's KL / extra blame")
    axes[0].legend(fontsize=8)
    ax = axes[2]
    lm = result["lm"]
    if lm.get("rows"):
        labels, width = ["before", "at", "after"], 0.2
        for i, (name, est) in enumerate(
            [("gear", "full"), ("gear", "k1"), ("gear_departure_point", "full"),
             ("gear_departure_point", "k1")]
        ):  # fmt: skip
            w = lm["estimators"][est]["methods"][name]["blame_where"]
            ax.bar([j + (i - 1.5) * width for j in range(3)], [w[k] for k in labels], width,
                   label=f"{name} [{est}]")  # fmt: skip
        ax.set_xticks(range(3), ["before", "on the wrong equation", "after"])
        ax.set_title(f"SmolLM2-135M, {lm['rows']} failed rows: extra blame")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_diagnose(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = {
        "gym": {str(L): gym_diagnosis(L) for L in (4, 3)},
        "lm": lm_diagnosis(Path(args.cache)),
        "machine": machine(),
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = RESULTS / "credit_diagnosis.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(diagnosis_table(result))
    print(f"wrote {out} and {plot_diagnosis(result, DOCS / 'credit_diagnosis.png')}")


def diagnosis_table(result: dict[str, Any]) -> str:
    lines = [
        "| set | estimator | what | before | on the first wrong step | after | first onset before / at / after |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    sets = [(f"gym L{L}", result["gym"][L]) for L in result["gym"]]
    if result["lm"].get("rows"):
        sets.append(("SmolLM2", result["lm"]))
    for label, s in sets:
        for est, e in s["estimators"].items():
            if label != "SmolLM2" and est == "topk":
                continue  # equal to full there (the vocabulary is below k)
            k = e["kl_mass_where"]
            lines.append(
                f"| {label} | {est} | KL mass | {k['before']:.2f} | {k['at']:.2f} | "
                f"{k['after']:.2f} | |"
            )
            for name, m in e["methods"].items():
                b, fo = m["blame_where"], m["first_onset_where"]
                lines.append(
                    f"| {label} | {est} | blame of `{name}` ({m['onsets_per_row']:.1f} onsets/row)"
                    f" | {b['before']:.2f} | {b['at']:.2f} | {b['after']:.2f} | "
                    f"{fo['before']:.2f} / {fo['at']:.2f} / {fo['after']:.2f} |"
                )
    return "\n".join(lines)


# --------------------------------------------------------------------------- confirmation
# Pre-registered in BENCHMARKS.md ("First departure: the confirmation, written before it ran");
# these constants are that text's, and the rule below is its decision rule.

LENGTHS = (4, 3)
SEEDS = tuple(range(400, 420))  # disjoint from the pilot (0-3), the grid (100-119), the
STEPS = 60  # 120-step check (200-219) and this development seeds (300-307)
SHARP2 = "modulation=exp,beta=2,w_min=0,w_max=10"
CANDIDATES: dict[str, str] = {  # name -> gym arm spec (BENCHMARKS.md, the pre-registration)
    "departure_point_k1": "gear_departure_point@estimator=k1",
    "departure_blame_k1": "gear_departure_blame@estimator=k1",
    "departure_blame_k1_sharp": f"gear_departure_blame@estimator=k1,{SHARP2}",
}
CONTROLS = {
    "grpo": "grpo",
    "gear": "gear",
    "gear_k1": "gear_k1",  # k1-GEAR, which beat GRPO in the grid: what does departure add?
    "rlsd": "rlsd",
    "oracle_sharp": "oracle_sharp",  # the positive control (gate)
    "random": "random",  # the placebo arm: gear's segment count, random boundaries
}
LEVEL = bonferroni(3)  # 1 - 0.05 / 3: Bonferroni over at most three candidates
LM_MARGIN = 0.05  # SmolLM2 non-inferiority margin on placebo-corrected L, vs gear


def arm_specs() -> list[tuple[str, str]]:
    return [*CONTROLS.items(), *CANDIDATES.items()]


def key(name: str) -> str:
    """The key of arm `name` in a `gear.gym.run` result (which names an arm by its spec)."""
    return dict(arm_specs()).get(name, name)


def paired(result: dict[str, Any], a: str, b: str, level: float = 0.95) -> dict[str, Any]:
    """a - b on final held-out expected accuracy, paired by seed (t-interval at `level`)."""
    pa, pb = result["arms"][key(a)]["per_seed"], result["arms"][key(b)]["per_seed"]
    d = evidence.paired(pa, pb, level)
    return {"mean": d["mean"], "ci": d["ci"], "n": d["n"], "sd": d["sd"],
            "wins": sum(x > y for x, y in zip(pa, pb, strict=True))}  # fmt: skip


def lm_localisation(cache: Path, arms: dict[str, str]) -> dict[str, Any]:
    """L (the top weight on the erroneous equation or the token after it) on SmolLM2's failed
    rows and on placebo rows (correct rollouts scored as failures, a pseudo-error on one of
    their equations), per arm; placebo-corrected differences with a bootstrap over prompts."""
    from gear.credit import CreditParams
    from gear.gym.train import parse_arm

    nat = onpolicy.load_cache(cache / "natural.pt")
    plc_set = onpolicy.load_cache(cache / "placebo.pt")
    bad = [r for g in nat.values() for r in g if "error" in r]
    placebo = loc.placebo_rows(nat) + [
        {**r, "error": e0, "error_end": e1, "step": [s0, e1], "placebo": True}
        for g in plc_set.values()
        for r in g
        if "error" not in r and r.get("equations")
        for s0, _, e0, e1 in r["equations"][:1]  # the first equation: where 97% of errors are
    ]
    out: dict[str, Any] = {
        "failed_rows": len(bad), "failed_prompts": len({r["case"]["group"] for r in bad}),
        "placebo_rows": len(placebo),
        "placebo_prompts": len({r["case"]["group"] for r in placebo}),
        "metric": "L: share of the top weight (ties split) on the first wrong equation or the "
        "token after it; placebo: correct rollouts with a pseudo-error",
        "arms": {},
    }  # fmt: skip
    per_prompt: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for name, spec in arms.items():
        arm = parse_arm(spec, name)
        sets = []
        for recs in (bad, placebo):
            if arm.oracle:
                ws = loc.natural_weights(recs, "oracle", "full", 0)
            else:
                params = CreditParams(method=arm.method, **dict(arm.overrides))
                ws = loc.method_weights(recs, -1.0, params, arm.estimator)
            rows = [
                loc.natural_row_metrics(w, r["error"], r["step"])
                for w, r in zip(ws, recs, strict=True)
            ]
            sets.append(loc.per_prompt(rows, recs, "L"))
        per_prompt[name] = (sets[0], sets[1])
        real, plc = (sum(v.values()) / max(len(v), 1) for v in sets)
        out["arms"][name] = {"L_real": real, "L_placebo": plc, "L_corrected": real - plc}
    for name in arms:
        for ref in ("grpo", "gear"):
            if name != ref and ref in arms:
                # (a_real - a_placebo) - (b_real - b_placebo): the per-prompt a - b on the
                # real and on the placebo prompts, each set resampled on its own
                a, b = per_prompt[name], per_prompt[ref]
                real, plc = ([a[k][g] - b[k][g] for g in sorted(a[k])] for k in range(2))
                out["arms"][name][f"corrected_minus_{ref}"] = bootstrap_difference(real, plc)
    return out


def decide(gym: dict[str, dict[str, Any]], lm: dict[str, Any]) -> dict[str, Any]:
    """The pre-registered rule (BENCHMARKS.md); every input and every step's verdict."""
    steps: dict[str, Any] = {"lengths": {}}
    readable = True
    for L, res in gym.items():
        gate = paired(res, "oracle_sharp", "grpo")
        placebo = paired(res, "random", "grpo")
        ok = gate["ci"][0] > 0 and not placebo["ci"][0] > 0
        steps["lengths"][L] = {"gate": gate, "placebo": placebo, "readable": ok}
        readable &= ok
    confirmed = {}
    for name in CANDIDATES:
        per_len = {L: paired(res, name, "grpo", LEVEL) for L, res in gym.items()}
        beats = all(d["ci"][0] > 0 for d in per_len.values())
        loc4 = gym["4"]["localisation"]["arms"]
        hit = loc4[key(name)]["real"]["hit_step"]
        placebo = loc4[key(name)]["shuffled"]["hit_step"]
        localises = hit > loc4["gear"]["real"]["hit_step"] and hit > placebo
        confirmed[name] = {
            "vs_grpo_bonferroni": per_len, "beats_grpo_at_both_lengths": beats,
            "gym_hit_step": hit, "localises": localises, "confirmed": readable and beats and localises,
            "mean_gain": sum(d["mean"] for d in per_len.values()) / len(per_len),
        }  # fmt: skip
    winners = sorted((n for n, c in confirmed.items() if c["confirmed"]),
                     key=lambda n: -confirmed[n]["mean_gain"])  # fmt: skip
    winner = winners[0] if winners else None
    recipe = False
    if winner is not None:
        d = lm["arms"][winner].get("corrected_minus_gear", {"ci": [-math.inf, math.inf]})
        recipe = d["ci"][0] >= -LM_MARGIN
    return {
        "readable": readable,
        "candidates": confirmed,
        "recommended": winner,
        "recipe_uses_it": recipe,
        "steps": steps,
    }


def run_confirm(args: argparse.Namespace) -> None:
    from gear.gym import _finite, run, table  # _finite: NaN -> None, as gym.json

    if not CANDIDATES:
        sys.exit("no candidates registered: CANDIDATES is empty (the pre-registration fills it)")
    t0 = time.perf_counter()
    specs = [spec for _, spec in arm_specs()]  # gear.gym names an arm by its spec
    gym = {}
    for L in LENGTHS:
        out = HERE.parent / "runs" / "departure" / f"confirm_L{L}.json"
        res = run(specs, seeds=SEEDS, steps=STEPS, length=L, workers=args.workers, out=out,
                  plot_dir=RESULTS / "credit_confirm" / f"L{L}")  # fmt: skip
        print(table(res), flush=True)
        gym[str(L)] = res
    lm = lm_localisation(Path(args.cache), dict(arm_specs()) | {"oracle": "oracle"})
    decision = decide(gym, lm)
    result = {
        "arms": dict(arm_specs()),
        "seeds": list(SEEDS),
        "lengths": list(LENGTHS),
        "steps": STEPS,
        "metric": "final held-out expected accuracy (probability of the right solution without "
        "the hint), paired by seed; 95% t-intervals (decision: 98.33%, Bonferroni over 3)",
        "paired": {
            L: {f"{n}-grpo": paired(res, n, "grpo") for n, _ in arm_specs() if n != "grpo"}
            | {f"{n}-{ref}": paired(res, n, ref) for n in CANDIDATES for ref in ("gear_k1", "gear")}
            for L, res in gym.items()
        },
        "localisation": {
            "gym": {L: res["localisation"] for L, res in gym.items()},
            "smollm2": lm,
        },
        "reused_runs": {L: res["reused_runs"] for L, res in gym.items()},
        "rule_commit": args.rule_commit,
        "decision": decision,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    path = RESULTS / "credit_confirm.json"
    path.write_text(json.dumps(_finite(result), indent=1) + "\n")
    print(json.dumps(_finite(decision), indent=1))
    print(f"wrote {path}")


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
        "commit": evidence.head_commit(HERE),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["diagnose", "confirm"])
    ap.add_argument(
        "--cache", default=str(loc.CACHE), help="on-policy signal cache (localization.py)"
    )
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rule-commit", default="", help="the commit that registered the rule")
    args = ap.parse_args(argv)
    {"diagnose": run_diagnose, "confirm": run_confirm}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

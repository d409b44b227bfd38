"""Where the blame lands on the model's own errors (on-policy credit localisation, issue 23).

The embedded SmolLM2-135M-Instruct samples groups of completions on arithmetic with 2- and 3-step
solutions; the checker finds each failed rollout's first arithmetically wrong equation
(`onpolicy`). Every failed row gets A = -1 and each credit method's weights w (`gear.credit`).
Per row: *L*, the share of the highest weights (ties split) on the wrong equation or the token
after it (the issue-23 rule's metric); the wrong token among the 3 highest weights; the extra
blame sum(max(w - 1, 0)) before, on and after the equation. Placebo: the correct rollouts of the
same prompts scored as failures, with a pseudo-error on the equation of the same index as the
prompt's first failed row. Intervals: 95% bootstrap over prompts (`gear.evidence.bootstrap`).

Two stages: ``natural`` samples and caches each prompt's records (signals, first error;
resumable, one cache entry per prompt); ``natural-metrics`` computes every method from the cache
in seconds and writes studies/results/localization.json ("natural").

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.localization natural --natural-prompts 240
    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.localization natural --placebo-set \\
        --placebo-prompts 216   # correct rows of easier prompts: credit_confirm's placebo
    .venv/bin/python -m studies.localization natural-metrics

The caches (runs/localization/{natural,placebo}.pt) feed studies/credit_confirm.py too. The
injected-error stages of this study are retired: studies/archive/localization_injected.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gear.evidence import bootstrap
from studies import onpolicy

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "studies" / "results"  # where docs/evidence and the README cite it
CACHE = ROOT / "runs" / "localization"
RANDOM_SEEDS = (0, 1, 2, 3, 4)  # `random` boundaries: each row's metrics averaged over these
NATURAL_METHODS = ("gear", "gear_token", "random", "fixed")  # read a KL signal
NATURAL_PLAIN = ("rlsd", "grpo", "oracle")  # read none (oracle: the checker's first error)
NATURAL_SIGNALS = ("full", "k1", "k3")
TOP_K = 3

# --------------------------------------------------------------------------- signals -> weights


def sampled_token_signal(lp_s: Tensor, lp_t: Tensor, estimator: str) -> Tensor:
    """A divergence of the sampled token only (the full KL at t ignores y_t: it depends on y<t).

    "k1": log pi_S(y_t) - log pi_T(y_t), high where the teacher finds y_t less likely;
    "k3": r - 1 - log r with r = pi_T(y_t) / pi_S(y_t) (large mostly where r >> 1).
    """
    if estimator == "k1":
        return lp_s - lp_t
    if estimator == "k3":
        log_ratio = lp_t - lp_s
        return log_ratio.exp() - 1 - log_ratio
    raise ValueError(f"estimator: expected 'k1' or 'k3', got {estimator!r}")


def batch(recs: list[dict[str, Any]], signal: str = "full") -> dict[str, Tensor]:
    """Pad records into (N, T) tensors "kl", "entropy", "lp_s", "lp_t" and the bool "valid".
    signal: "full" (the spec's KL), or "k1" / "k3" from the sampled token's log-probabilities
    (`sampled_token_signal`) in place of the KL."""
    N, T = len(recs), max(len(r["ids"]) for r in recs)
    out = {k: torch.zeros(N, T) for k in ("kl", "entropy", "lp_s", "lp_t")}
    valid = torch.zeros(N, T, dtype=torch.bool)
    for i, r in enumerate(recs):
        n = len(r["ids"])
        valid[i, :n] = True
        for k in out:
            out[k][i, :n] = torch.tensor(r[k])
    if signal != "full":
        kl = sampled_token_signal(out["lp_s"].double(), out["lp_t"].double(), signal)
        out["kl"] = torch.where(valid, kl, 0.0).float()
    out["valid"] = valid
    return out


def method_weights(
    recs: list[dict[str, Any]], advantage: float, params: Any, signal: str = "full", size: int = 16
) -> list[Tensor]:
    """Weights w (T_row,) of each record's valid tokens under `params`, in training-sized
    batches of `size` rows, every row with the same `advantage`."""
    from gear.credit import credit_details

    out = []
    for k in range(0, len(recs), size):
        part = recs[k : k + size]
        b = batch(part, signal)
        d = credit_details(
            torch.full((len(part),), float(advantage)),
            b["valid"],
            kl=b["kl"],
            entropy=b["entropy"],
            student_logprobs=b["lp_s"],
            teacher_logprobs=b["lp_t"],
            params=params,
        )
        out.extend(d.weights[i, : len(r["ids"])].double() for i, r in enumerate(part))
    return out


def natural_weights(recs: list[dict[str, Any]], name: str, signal: str, seed: int) -> list[Tensor]:
    """A = -1 weights of each row under method `name` with `signal` (oracle: gear_token on the
    indicator of the checker's first wrong equation, which a placebo row does not have)."""
    from gear.credit import CreditParams

    if name != "oracle":
        return method_weights(recs, -1.0, CreditParams(method=name, seed=seed), signal)
    ind = []
    for r in recs:
        x = [0.0] * len(r["ids"])
        if not r.get("placebo"):
            x[r["step"][0] : r["step"][1]] = [1.0] * (r["step"][1] - r["step"][0])
        ind.append({**r, "kl": x})
    return method_weights(ind, -1.0, CreditParams(method="gear_token"), "full")


# --------------------------------------------------------------------------- per-row metrics


def hit_at_1(w: Tensor, lo: int, hi: int) -> float:
    """Share of the highest-weight tokens (ties share) that lie in [lo, hi). w: (T,) valid only."""
    top = w >= w.max() - 1e-9
    idx = top.nonzero().squeeze(1)
    return float(((idx >= lo) & (idx < hi)).double().mean())


def top_k_share(w: Tensor, token: int, k: int = TOP_K) -> float:
    """P(token is among the k highest weights) with ties broken at random. w: (T,)."""
    above = int((w > w[token] + 1e-9).sum())
    tied = int(((w - w[token]).abs() <= 1e-9).sum())
    return 0.0 if above >= k else min(1.0, (k - above) / tied)


def blame_shares(w: Tensor, lo: int, hi: int) -> tuple[float, float, float]:
    """Extra blame sum(max(w - 1, 0)) before [lo, hi), on it and after it, as shares (NaN when
    there is none). w: (T,)."""
    extra = (w.double() - 1).clamp(min=0)
    total = float(extra.sum())
    if total <= 1e-12:
        return math.nan, math.nan, math.nan
    return (float(extra[:lo].sum()) / total, float(extra[lo:hi].sum()) / total,
            float(extra[hi:].sum()) / total)  # fmt: skip


def natural_row_metrics(w: Tensor, error: int, step: Sequence[int]) -> dict[str, float]:
    """Per-row metrics of the on-policy set. w: (T,); error: first wrong token; step:
    [start, end) tokens of the erroneous equation."""
    lo, hi = step
    before, at, after = blame_shares(w, lo, hi)
    return {
        "L": hit_at_1(w, lo, min(hi + 1, w.numel())),  # the rule's metric: step or next token
        "hit1_step": hit_at_1(w, lo, hi),
        "exact_top3": top_k_share(w, error),
        "blame_before": before,
        "blame_at": at,
        "blame_after": after,
    }


def placebo_rows(nat: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Correct rollouts as pseudo-failures: the pseudo-error is the result of the equation with
    the index of the first failed row of the same prompt (the last equation if fewer)."""
    out = []
    for recs in nat.values():
        failed = [r for r in recs if "error" in r]
        if failed:
            out += pseudo_failures(recs, failed[0]["case"]["detail"]["equation"])
    return out


def pseudo_failures(recs: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The correct rollouts of `recs` as placebo rows, the pseudo-error on the result of their
    equation with index `k` (the last equation if fewer)."""
    out = []
    for r in recs:
        if "error" in r or not r.get("equations"):
            continue
        s0, _, e0, e1 = r["equations"][min(k, len(r["equations"]) - 1)]
        out.append({**r, "error": e0, "error_end": e1, "step": [s0, e1], "placebo": True})
    return out


def natural_eval(recs: list[dict[str, Any]], name: str, signal: str) -> list[dict[str, float]]:
    """Per-row metrics (random: averaged over RANDOM_SEEDS)."""
    seeds = RANDOM_SEEDS if name == "random" else (0,)
    per_seed = [
        [natural_row_metrics(w, r["error"], r["step"])
         for w, r in zip(natural_weights(recs, name, signal, s), recs, strict=True)]
        for s in seeds
    ]  # fmt: skip
    keys = per_seed[0][0].keys() if recs else []
    return [{k: nanmean([ps[i][k] for ps in per_seed]) for k in keys} for i in range(len(recs))]


def per_prompt(rows: list[dict[str, float]], recs: list[dict[str, Any]], key: str) -> dict:
    """{prompt: mean of the finite `key` over its rows}."""
    by: dict[str, list[float]] = {}
    for m, r in zip(rows, recs, strict=True):
        if math.isfinite(m[key]):
            by.setdefault(r["case"]["group"], []).append(m[key])
    return {g: sum(v) / len(v) for g, v in by.items()}


def nanmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def chance(bad: list[dict[str, Any]]) -> dict[str, float]:
    """What a flat weighting gets: the step's share of tokens and the share at/after the step."""
    step = [(r["step"][1] - r["step"][0]) / len(r["ids"]) for r in bad]
    after = [(len(r["ids"]) - r["step"][0]) / len(r["ids"]) for r in bad]
    return {"step_token_share": nanmean(step), "after_step_token_share": nanmean(after)}


def profile(recs: list[dict[str, Any]], key: str, radius: int = 6) -> list[float]:
    """Mean of per-row min-max-normalised signal `key` at offsets -radius..radius from the error."""
    sums, counts = [0.0] * (2 * radius + 1), [0] * (2 * radius + 1)
    for r in recs:
        x = torch.tensor(r[key], dtype=torch.float64)
        lo, hi = float(x.min()), float(x.max())
        x = (x - lo) / (hi - lo) if hi - lo > 1e-8 else torch.zeros_like(x)
        for j, off in enumerate(range(-radius, radius + 1)):
            t = r["error"] + off
            if 0 <= t < len(x):
                sums[j] += float(x[t])
                counts[j] += 1
    return [s / c if c else float("nan") for s, c in zip(sums, counts, strict=True)]


# --------------------------------------------------------------------------- the study


def natural_summary(nat: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The on-policy set: every metric per signal x method on the failed rows (real) and on the
    placebo rows, real - placebo per prompt, and the rule's D_loc (bootstrap over prompts)."""
    recs = [r for g in nat.values() for r in g]
    bad = [r for r in recs if "error" in r]
    good = [r for r in recs if "error" not in r]
    plc = placebo_rows(nat)
    out: dict[str, Any] = {
        "note": "on-policy failed rollouts (A = -1) of SmolLM2-135M-Instruct, temperature 1, "
        "arithmetic multistep + chain; first error = first arithmetically wrong equation; "
        "placebo = correct rollouts of the same prompts, A = -1, pseudo-error on the equation of "
        "the same index; intervals: 95% bootstrap over prompts",
        "prompts": len(nat),
        "rows": len(bad),
        "correct_rows": len(good),
        "placebo_rows": len(plc),
        "placebo_prompts": len({r["case"]["group"] for r in plc}),
        "levels": {
            lv: sum(r["case"]["detail"].get("level") == lv for r in bad)
            for lv in ("multistep", "chain")
        },
        "error_equation_index": {
            str(k): sum(r["case"]["detail"]["equation"] == k for r in bad) for k in range(4)
        },
        "truncated_rows": sum(bool(r["case"]["detail"].get("truncated")) for r in bad),
        "chance": chance(bad),
        "methods": {},
        "placebo": {},
        "corrected": {},
    }
    if not bad:
        return out
    keys = ("L", "hit1_step", "exact_top3", "blame_before", "blame_at", "blame_after")
    combos = [(n, s) for s in NATURAL_SIGNALS for n in NATURAL_METHODS]
    combos += [(n, "full") for n in NATURAL_PLAIN]
    diffs: dict[str, dict[str, float]] = {}
    reals: dict[str, list[dict[str, float]]] = {}
    for name, signal in combos:
        label = name if signal == "full" or name in NATURAL_PLAIN else f"{name}[{signal}]"
        real, fake = natural_eval(bad, name, signal), natural_eval(plc, name, signal)
        reals[label] = real
        for target, rows, rr in ((out["methods"], real, bad), (out["placebo"], fake, plc)):
            target[label] = {}
            for k in keys:
                b = bootstrap([x[k] for x in rows], [r["case"]["group"] for r in rr])
                target[label][k], target[label][f"{k}_ci"] = b["mean"], b["ci"]
        pr, pp = per_prompt(real, bad, "L"), per_prompt(fake, plc, "L")
        diffs[label] = {g: pr[g] - pp[g] for g in pr if g in pp}
        b = bootstrap(list(diffs[label].values()))
        out["corrected"][label] = {"L": b["mean"], "L_ci": b["ci"], "prompts": b["n"]}
        print(f"natural {label:18s} L {out['methods'][label]['L']:.3f} "
              f"placebo {out['placebo'][label]['L']:.3f}  real-placebo {b['mean']:+.3f} "
              f"[{b['ci'][0]:+.3f}, {b['ci'][1]:+.3f}] ({b['n']} prompts)", flush=True)  # fmt: skip
    # Descriptive, on every failed row (no placebo, so positional effects are not removed):
    # paired per row, bootstrap over prompts.
    groups = [r["case"]["group"] for r in bad]
    out["paired_real"] = {}
    for a, b in (
        ("gear", "grpo"),
        ("gear", "random"),
        ("gear", "gear_token"),
        ("gear[k1]", "gear"),
        ("gear_token[k1]", "gear_token"),
        ("gear", "rlsd"),
        ("gear[k1]", "random[k1]"),
    ):
        pair = out["paired_real"][f"{a}-{b}"] = {}
        for k in ("L", "exact_top3"):
            d = bootstrap([x[k] - y[k] for x, y in zip(reals[a], reals[b], strict=True)], groups)
            pair[k], pair[f"{k}_ci"] = d["mean"], d["ci"]
    shared = [g for g in diffs["gear"] if g in diffs["gear[k1]"]]
    d = bootstrap([diffs["gear[k1]"][g] - diffs["gear"][g] for g in shared])
    out["decision_input"] = {
        "failed_rows": len(bad),
        "d_loc": {"mean": d["mean"], "ci": d["ci"], "prompts": d["n"]},
    }
    print(f"D_loc = gear[k1] - gear, placebo-corrected L: {d['mean']:+.3f} "
          f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]")  # fmt: skip
    out["profile"] = {"offsets": list(range(-6, 7)), "kl_norm": profile(bad, "kl")}
    return out


def clean(x: Any) -> Any:
    """Floats rounded to 4 digits, NaN and inf as None (strict JSON)."""
    if isinstance(x, float):
        return round(x, 4) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def run_natural(args: argparse.Namespace) -> None:
    """Stage 1: sample groups of completions on 2- and 3-step arithmetic (`multistep`, `chain`),
    grade them with the checker and cache the records of every failed row with a checked first
    error and every correct row (the placebo). Resumable: one cache entry per prompt;
    `--natural-prompts` can grow between runs."""
    from gear.tasks.arithmetic import ArithmeticTask

    torch.set_num_threads(args.threads)
    if args.placebo_set:  # easier prompts whose correct rollouts feed the placebo only
        task, n, name = ArithmeticTask(mix=onpolicy.PLACEBO_MIX), args.placebo_prompts, "placebo"
    else:
        task, n, name = ArithmeticTask(mix=onpolicy.NATURAL_MIX), args.natural_prompts, "natural"
    rows = task.dataset("test", n=n, seed=args.seed)
    model, tok = onpolicy.load_model()
    path = Path(args.cache) / f"{name}.pt"
    done = onpolicy.load_cache(path)
    todo = [j for j in range(len(rows)) if f"{name}-{j}" not in done]
    t0 = time.time()
    print(f"{name}: {len(done)} prompts cached, {len(todo)} to sample "
          f"({args.samples} samples, <= {args.max_new_tokens} tokens)", flush=True)  # fmt: skip
    for k in range(0, len(todo), args.prompts_per_call):
        part = todo[k : k + args.prompts_per_call]
        # each call's seed is fixed by its prompts, so a resumed run samples what a fresh one would
        torch.manual_seed(args.seed * 100003 + part[0])
        groups = onpolicy.sample_groups(
            model, tok, [onpolicy.render(tok, rows[j]["prompt"]) for j in part],
            args.samples, args.max_new_tokens,
        )  # fmt: skip
        for j, gen in zip(part, groups, strict=True):
            done[f"{name}-{j}"] = onpolicy.prompt_records(
                model, tok, task, rows[j], f"{name}-{j}", gen, correct_only=args.placebo_set
            )
        onpolicy.save_cache(path, done)
        all_recs = [r for v in done.values() for r in v]
        n_fail = sum("error" in r for r in all_recs)
        print(
            f"{name}: {len(done)}/{len(rows)} prompts, {n_fail} failed rows with a checked error, "
            f"{len(all_recs) - n_fail} correct rows, {time.time() - t0:.0f} s",
            flush=True,
        )


def run_natural_metrics(args: argparse.Namespace) -> None:
    """Stage 2: every method from the on-policy cache -> localization.json ("natural")."""
    nat = onpolicy.load_cache(Path(args.cache) / "natural.pt")
    if not nat:
        sys.exit(f"no on-policy signals in {args.cache}; run the 'natural' stage first")
    path = Path(args.out)
    path.write_text(json.dumps(clean({"natural": natural_summary(nat)}), indent=1))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["natural", "natural-metrics"])
    ap.add_argument("--natural-prompts", type=int, default=40)
    ap.add_argument(
        "--placebo-set", action="store_true",
        help="natural: sample the placebo set (easier 1- and 2-digit prompts, correct rows only).",
    )  # fmt: skip
    ap.add_argument("--placebo-prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="Samples per prompt.")
    ap.add_argument("--prompts-per-call", type=int, default=8, help="Prompts per generate call.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="1: faster than 2 on the shared CPU.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=str(CACHE), help="Signal cache directory.")
    ap.add_argument("--out", default=str(RESULTS / "localization.json"), help="natural-metrics.")
    args = ap.parse_args(argv)
    {"natural": run_natural, "natural-metrics": run_natural_metrics}[args.stage](args)


if __name__ == "__main__":
    main()

"""RETIRED (issue 38): credit localisation on injected errors, off-policy. Its question (does
the blame land on a known error?) is answered on the model's own errors by the on-policy study,
studies/localization.py; here the final answer stays right and the hint gives the exact digits
away, so it cannot measure it (studies/archive/README.md). Kept as an off-policy stress test;
its results are results/localization_injected.json, results/localization.png and the viewer
sample results/localization_records/.

Injected errors (exact ground truth): correct worked solutions -- GSM8K train reference solutions
(their ``<<a*b=c>>`` results) and the arithmetic task's multistep worked solutions -- get one
calculation result replaced by a wrong number; the rest of the text is unchanged. The student
scores question -> corrupted solution; the teacher scores question + hint (the correct
reference, `gear.teacher.teacher_prompt` with the math hint template) -> the same tokens. Each
corrupted solution is a failed rollout (A = -1); each uncorrupted solution is scored as a
successful one (A = +1).

Per method (`gear.credit.credit_details`): hit@1 (the highest-weight token of an A < 0 row lies
in the erroneous step; ties share the hit), the share of extra blame sum(max(w - 1, 0)) on the
erroneous step and after it, the per-row AUROC of w for "token at or after the first error",
and on A > 0 rows the weight spread. Means carry 95% bootstrap intervals over problems
(`gear.evidence.bootstrap`).

Two stages: ``signals`` runs the model once and caches the per-token signals (resumable);
``metrics`` computes every method, the sweeps, the JSON, the figure and the viewer records from
the cache in seconds.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.archive.localization_injected signals
    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.archive.localization_injected signals --reverse
    .venv/bin/python -m studies.archive.localization_injected metrics
    .venv/bin/python -m studies.archive.localization_injected table
    .venv/bin/gear inspect studies/archive/results/localization_records --out /tmp/localization.html
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gear.evidence import bootstrap
from studies import localization as loc  # the on-policy study's shared pieces
from studies import onpolicy
from studies.onpolicy import EQUATION, Case, first_difference

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

RESULTS = HERE / "results"
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
CACHE = ROOT / "runs" / "localization"
METHODS = (
    "gear", "gear_token", "gear_kl_only", "gear_entropy_only", "turn", "fixed", "random",
    "entropy_top", "rlsd", "grpo",
)  # fmt: skip
NUMBER = r"\d[\d,]*(?:\.\d+)?"

# --------------------------------------------------------------------------- cases (pure)


def _to_float(s: str) -> float:
    return float(s.replace(",", ""))


def gsm8k_results(answer: str) -> tuple[str, list[tuple[int, int]]]:
    """Reference text of a GSM8K answer and the character spans of its calculation results.

    Args:
        answer: the raw GSM8K ``answer`` field (``<<48/2=24>>24`` annotations, ``#### 72``).
    Returns:
        (text, spans): text equals `gear.tasks.gsm8k.split_solution(answer)[0]` (annotations
        removed, last line "The answer is N."); spans are the (start, end) characters of each
        visible result that follows an annotation and equals the annotated value.
    """
    from gear.tasks.gsm8k import split_solution

    steps = answer.rsplit("####", 1)[0]
    pieces, spans, pos, cursor = [], [], 0, 0
    for m in re.finditer(r"<<([^=>]*)=([^>]*)>>", steps):
        pieces.append(steps[cursor : m.start()])
        pos += m.start() - cursor
        cursor = m.end()
        after = re.match(NUMBER, steps[cursor:])
        try:
            same = after is not None and math.isclose(
                _to_float(after.group()), _to_float(m.group(2)), rel_tol=1e-9
            )
        except ValueError:
            same = False
        if same:
            spans.append((pos, pos + len(after.group())))
    pieces.append(steps[cursor:])
    raw = "".join(pieces)
    text, _final = split_solution(answer)
    lead = len(raw) - len(raw.lstrip())  # split_solution strips the steps
    spans = [(a - lead, b - lead) for a, b in spans]
    if not text.startswith(raw.strip()):
        raise ValueError("gsm8k_results: reconstructed text differs from split_solution's")
    return text, [s for s in spans if s[0] >= 0 and s[1] <= len(raw.strip())]


def arithmetic_results(solution: str) -> list[tuple[int, int]]:
    """Character spans of the results of the equations ``a op b = r`` in a worked solution."""
    return [m.span(4) for m in EQUATION.finditer(solution) if m.group(4)]


def first_wrong_equation(text: str) -> tuple[int, int] | None:
    """Span of the stated result of the first equation whose result is arithmetically wrong."""
    found = onpolicy.first_wrong_equation(text)
    return None if found is None else found[1].span(4)


def wrong_number(correct: str, rng: random.Random) -> str:
    """A different number in the same style: integer +- 1..9 (never negative); decimals keep
    their decimal places; thousands separators are dropped."""
    value = _to_float(correct)
    decimals = len(correct.split(".", 1)[1]) if "." in correct else 0
    for _ in range(100):
        delta = rng.choice([d for d in range(-9, 10) if d != 0])
        new = value + delta
        if new >= 0:
            out = f"{new:.{decimals}f}"
            if out != correct.replace(",", ""):
                return out
    raise ValueError(f"wrong_number: no replacement for {correct!r}")


def step_span(text: str, pos: int, separators: Sequence[str]) -> tuple[int, int]:
    """(start, end) of the step holding character `pos`: between the nearest separators."""
    starts = [text.rfind(s, 0, pos) for s in separators]
    start = max([i + len(s) for i, s in zip(starts, separators, strict=True) if i >= 0] or [0])
    ends = [text.find(s, pos) for s in separators]
    end = min([i for i in ends if i >= 0] or [len(text)])
    return start, end


def corrupt(
    text: str, span: tuple[int, int], rng: random.Random, separators: Sequence[str]
) -> tuple[str, int, int, tuple[int, int], str]:
    """Replace the number at `span` by a wrong one; nothing else changes.

    Returns (corrupted text, first differing character, end of the new number, step span,
    the new number).
    """
    a, b = span
    new = wrong_number(text[a:b], rng)
    out = text[:a] + new + text[b:]
    # first differing character of the whole texts: when the new number is a prefix of the old
    # one ("10" -> "1") it is the character after the number
    err = a + first_difference(text[a:], out[a:])
    return out, err, max(a + len(new), err + 1), step_span(out, a, separators), new


def injected_cases(
    n_gsm8k: int, n_arithmetic: int, seed: int = 0, per_problem: int = 5, variants: int = 2
) -> list[Case]:
    """Corrupted and clean cases from GSM8K train (short solutions) and multistep arithmetic.

    Each problem yields one clean row and corrupted rows: GSM8K one per result (at most
    `per_problem`), arithmetic `variants` different wrong numbers per result (the rows of one
    problem share its prompt pass; the intervals resample problems, not rows). Sources
    alternate so that a partial run covers both.
    """
    from gear.tasks.arithmetic import ArithmeticTask
    from gear.tasks.gsm8k import PROMPT as GSM8K_PROMPT

    rng = random.Random(seed)
    gsm: list[list[Case]] = []
    lines = GSM8K_TRAIN.read_text(encoding="utf-8").splitlines()
    order = list(range(len(lines)))
    rng.shuffle(order)
    for i in order:
        if len(gsm) >= n_gsm8k:
            break
        row = json.loads(lines[i])
        if len(row["answer"]) > 220 or len(row["question"]) > 300:
            continue  # keep the forward passes short on the shared CPU
        text, spans = gsm8k_results(row["answer"])
        if not spans:
            continue
        prompt = [{"role": "user", "content": GSM8K_PROMPT.format(question=row["question"])}]
        gsm.append(_group("gsm8k", f"gsm8k-{i}", prompt, text, spans, rng, ("\n",), per_problem, 1))
    arith: list[list[Case]] = []
    rows = ArithmeticTask(mix={"multistep": 1.0}).dataset("train", n=n_arithmetic, seed=seed)
    for j, row in enumerate(rows):
        text = row["ground_truth"]
        spans = arithmetic_results(text)
        arith.append(
            _group(
                "arithmetic",
                f"arith-{j}",
                row["prompt"],
                text,
                spans,
                rng,
                (", ", ". "),
                9,
                variants,
            )
        )
    out: list[Case] = []
    for k in range(max(len(gsm), len(arith))):
        for groups in (arith, gsm):
            if k < len(groups):
                out.extend(groups[k])
    return out


def _group(
    source: str,
    group: str,
    prompt: list[dict[str, str]],
    text: str,
    spans: list[tuple[int, int]],
    rng: random.Random,
    separators: tuple[str, ...],
    per_problem: int,
    variants: int,
) -> list[Case]:
    cases = [Case(source, group, prompt, text, text)]
    for span in rng.sample(spans, min(per_problem, len(spans))):
        seen: set[str] = set()
        for _ in range(20 * variants):
            if len(seen) == variants:
                break
            bad, err, end, step, new = corrupt(text, span, rng, separators)
            if new in seen:
                continue
            seen.add(new)
            cases.append(
                Case(
                    source, group, prompt, text, bad, err, end, step,
                    {"original": text[span[0] : span[1]], "new": new,
                     "result_index": spans.index(span)},
                )
            )  # fmt: skip
    return cases


# --------------------------------------------------------------------------- metrics (pure)


def blame_after_share(w: Tensor, start: int) -> float:
    """sum(max(w - 1, 0)) on tokens >= start over the whole row; NaN when no extra blame."""
    extra = (w.double() - 1).clamp(min=0)
    total = float(extra.sum())
    return float(extra[start:].sum()) / total if total > 1e-12 else float("nan")


def mass_after_share(w: Tensor, start: int) -> float:
    """sum(w) on tokens >= start over sum(w) (defined for every method; flat = token share)."""
    w = w.double()
    total = float(w.sum())
    return float(w[start:].sum()) / total if total > 1e-12 else float("nan")


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Mann-Whitney AUROC (ties count 1/2); NaN when one class is empty. Both (T,)."""
    pos, neg = scores[labels].double(), scores[~labels].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().sum()
    ties = (pos[:, None] == neg[None, :]).double().sum()
    return float((greater + 0.5 * ties) / (pos.numel() * neg.numel()))


def row_metrics(w: Tensor, error: int, step: tuple[int, int]) -> dict[str, float]:
    """All per-row localisation metrics of one failed row.

    Args:
        w: (T,) weights of the row's valid tokens.
        error: index of the first wrong token. step: [start, end) tokens of the erroneous step.
    """
    pos = torch.arange(w.numel())
    return {
        "hit1": loc.hit_at_1(w, *step),
        "hit1_token": loc.hit_at_1(w, error, step[1]),
        "blame_after_share": blame_after_share(w, step[0]),
        "mass_after_share": mass_after_share(w, step[0]),
        "auroc": auroc(w, pos >= error),
    }


# --------------------------------------------------------------------------- stages


def run_signals(args: argparse.Namespace) -> None:
    """Stage 1: signals of every injected case, cached per group (resumable)."""
    torch.set_num_threads(args.threads)
    cases = injected_cases(args.gsm8k, args.arithmetic, seed=args.seed)
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)
    cache = Path(args.cache)
    path = cache / ("injected.reverse.pt" if args.reverse else "injected.pt")
    done = onpolicy.load_cache(path)

    def elsewhere() -> set[str]:  # groups a second worker (--reverse) has finished
        return {g for f in cache.glob("injected*.pt") if f != path for g in onpolicy.load_cache(f)}

    order = list(groups)[::-1] if args.reverse else list(groups)
    n_bad = sum(c.error_char is not None for c in cases)
    print(f"{len(groups)} groups, {n_bad} corrupted + {len(groups)} clean rows", flush=True)
    model, tok = onpolicy.load_model()
    t0, n = time.time(), 0
    for g in order:
        if g in done or g in elsewhere():
            continue
        done[g] = onpolicy.group_signals(model, tok, groups[g])
        onpolicy.save_cache(path, done)
        n += 1
        print(f"{n} groups ({len(done)} in {path.name}), {time.time() - t0:.0f} s", flush=True)


def evaluate_method(
    bad: list[dict[str, Any]], good: list[dict[str, Any]], name: str, signal: str = "full",
    **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """Per-row metrics of method `name` (random: averaged over loc.RANDOM_SEEDS per row)."""
    from gear.credit import CreditParams

    seeds = loc.RANDOM_SEEDS if name == "random" else (0,)
    per_seed = []
    for s in seeds:
        p = CreditParams(method=name, seed=s, **overrides)
        w_bad = loc.method_weights(bad, -1.0, p, signal)
        rows = [
            row_metrics(w, r["error"], tuple(r["step"])) for w, r in zip(w_bad, bad, strict=True)
        ]
        w_good = loc.method_weights(good, 1.0, p, signal) if good else []
        spread = [float(w.std(unbiased=False)) for w in w_good]
        per_seed.append((rows, spread))
    keys = per_seed[0][0][0].keys() if bad else []
    rows = [
        {k: loc.nanmean([ps[0][i][k] for ps in per_seed]) for k in keys} for i in range(len(bad))
    ]
    spread = [loc.nanmean([ps[1][i] for ps in per_seed]) for i in range(len(good))]
    return {
        "rows": rows,
        "spread": spread,
        "per_seed": per_seed if len(seeds) > 1 else None,
        "groups": [r["case"]["group"] for r in bad],
        "good_groups": [r["case"]["group"] for r in good],
    }


def summarise(ev: dict[str, Any]) -> dict[str, Any]:
    """Means and problem-level bootstrap intervals of an `evaluate_method` result."""
    out: dict[str, Any] = {}
    for key in ("hit1", "hit1_token", "blame_after_share", "mass_after_share", "auroc"):
        b = bootstrap([r[key] for r in ev["rows"]], ev.get("groups"))
        out[key], out[f"{key}_ci"] = b["mean"], b["ci"]
        if key == "blame_after_share":
            out["blame_rows"] = b["n"]  # rows with any extra blame
    b = bootstrap(ev["spread"], ev.get("good_groups"))
    out["weight_spread_pos"], out["weight_spread_pos_ci"] = b["mean"], b["ci"]
    if ev["per_seed"]:
        out["hit1_per_seed"] = [loc.nanmean([r["hit1"] for r in ps[0]]) for ps in ev["per_seed"]]
    return out


def paired(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, Any]:
    """Mean and problem-level bootstrap CI of the per-row difference a - b (two evaluations)."""
    return bootstrap(
        [x[key] - y[key] for x, y in zip(a["rows"], b["rows"], strict=True)], a["groups"]
    )


def _with_signal(recs: list[dict[str, Any]], estimator: str) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        lp_s = torch.tensor(r["lp_s"], dtype=torch.float64)
        lp_t = torch.tensor(r["lp_t"], dtype=torch.float64)
        out.append({**r, estimator: loc.sampled_token_signal(lp_s, lp_t, estimator).tolist()})
    return out


def _clean_aligned(bad: list[dict[str, Any]], good: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each corrupted row, its problem's clean row with the corrupted row's error index
    (tokens before the error are identical, so the KL there is too)."""
    clean = {r["case"]["group"]: r for r in good}
    return [
        {**clean[r["case"]["group"]], "error": r["error"], "step": r["step"]}
        for r in bad
        if r["case"]["group"] in clean
    ]


def run_metrics(args: argparse.Namespace) -> None:
    from gear.credit import CreditParams

    inj = {}
    for f in sorted(Path(args.cache).glob("injected*.pt")):  # one file per worker
        inj.update(onpolicy.load_cache(f))
    recs = [r for g in inj.values() for r in g]
    bad = [r for r in recs if "error" in r]
    good = [r for r in recs if "error" not in r]
    if not bad:
        sys.exit(f"no injected signals in {args.cache}; run the 'signals' stage first")
    print(f"injected: {len(bad)} corrupted rows, {len(good)} clean rows")
    payload: dict[str, Any] = {
        "cases": len(bad),
        "clean_rows": len(good),
        "model": "SmolLM2-135M-Instruct (embedded, float32, eval)",
        "signals": "full-vocabulary reverse KL(student || teacher) and student entropy, "
        "gear.credit.signals_from_hidden, temperature 1",
        "advantages": "corrupted rows A = -1, clean rows A = +1",
        "defaults": {k: v for k, v in CreditParams().to_dict().items() if k != "method"},
        "random_seeds": list(loc.RANDOM_SEEDS),
        "sources": {s: sum(r["case"]["source"] == s for r in bad) for s in ("arithmetic", "gsm8k")},
        "chance": loc.chance(bad),
        "methods": {},
    }
    evs: dict[str, dict] = {}
    for name in METHODS:
        evs[name] = evaluate_method(bad, good, name)
        payload["methods"][name] = summarise(evs[name])
        for src in ("arithmetic", "gsm8k"):
            idx = [i for i, r in enumerate(bad) if r["case"]["source"] == src]
            sub = {
                "rows": [evs[name]["rows"][i] for i in idx],
                "groups": [evs[name]["groups"][i] for i in idx],
                "spread": [],
                "per_seed": None,
            }
            s = summarise(sub)
            payload["methods"][name][f"by_source_{src}"] = {
                k: s[k] for k in ("hit1", "hit1_ci", "auroc", "auroc_ci", "blame_after_share")
            }
        m = payload["methods"][name]
        print(f"{name:18s} hit1 {m['hit1']:.3f} [{m['hit1_ci'][0]:.3f}, {m['hit1_ci'][1]:.3f}]"
              f"  auroc {m['auroc']:.3f}  blame_after {m['blame_after_share']:.3f}"
              f"  spread+ {m['weight_spread_pos']:.3f}", flush=True)  # fmt: skip
    payload["paired"] = {
        f"gear-{b}": {k: paired(evs["gear"], evs[b], k) for k in ("hit1", "auroc")}
        for b in ("random", "gear_token", "grpo", "rlsd", "turn")
    }
    # Variants: a sampled-token divergence (k1, k3) in place of the full-vocabulary KL.
    payload["variants"] = {
        "note": "kl replaced by k1 = log pi_S(y_t) - log pi_T(y_t) or k3 = r - 1 - log r, "
        "r = pi_T(y_t)/pi_S(y_t), from the same two passes; everything else as the spec",
    }
    for est in ("k1", "k3"):
        payload["variants"][est] = {}
        for name in ("gear", "gear_token", "gear_kl_only", "random"):
            ev = evaluate_method(bad, good, name, signal=est)
            s = {k: v for k, v in summarise(ev).items() if not k.startswith("by_")}
            payload["variants"][est][name] = s
            if est == "k1" and name == "gear":
                payload["paired"]["gear_k1-gear"] = {
                    k: paired(ev, evs["gear"], k) for k in ("hit1", "auroc")
                }
                payload["paired"]["gear_k1-random"] = {
                    k: paired(ev, evs["random"], k) for k in ("hit1", "auroc")
                }
            print(f"[{est}] {name:14s} hit1 {s['hit1']:.3f} {s['hit1_ci']}  auroc {s['auroc']:.3f}")
    # Placebo: each corrupted row's clean twin scored as if failed (A = -1), error index kept.
    # Whatever a method "finds" there is where the reference helps, not the error.
    placebo = _clean_aligned(bad, good)
    payload["placebo_clean_rows"] = {"note": "clean twin of each corrupted row, A = -1"}
    for name in ("gear", "gear_token", "random", "grpo"):
        s = summarise(evaluate_method(placebo, [], name))
        payload["placebo_clean_rows"][name] = {
            k: s[k] for k in ("hit1", "hit1_ci", "auroc", "auroc_ci", "blame_after_share")
        }
        print(f"[placebo] {name:10s} hit1 {s['hit1']:.3f} {s['hit1_ci']}  auroc {s['auroc']:.3f}")
    payload["sweep"] = _sweep(bad)
    payload["profile"] = {
        "offsets": list(range(-6, 7)),
        "kl_norm": loc.profile(bad, "kl"),
        "kl_norm_clean_row": loc.profile(_clean_aligned(bad, good), "kl"),
        "entropy_norm": loc.profile(bad, "entropy"),
        "k1_norm": loc.profile(_with_signal(bad, "k1"), "k1"),
        "k3_norm": loc.profile(_with_signal(bad, "k3"), "k3"),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "localization_injected.json"
    path.write_text(json.dumps(loc.clean(payload), indent=1))
    print(f"wrote {path}")
    plot(payload, RESULTS / "localization.png")
    write_records(bad, good, RESULTS / "localization_records")


def _sweep(bad: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tau in (0.05, 0.1, 0.2, 0.3, 0.5):
        for delta in (0.05, 0.1, 0.2, 0.5, 1.0):
            ev = evaluate_method(bad, [], "gear", tau_onset=tau, delta_entropy=delta)
            s = summarise(ev)
            out.append({"tau_onset": tau, "delta_entropy": delta, "hit1": s["hit1"],
                        "hit1_ci": s["hit1_ci"], "auroc": s["auroc"],
                        "blame_after_share": s["blame_after_share"]})  # fmt: skip
    return out


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Three panels: hit@1 and AUROC per method with 95% CIs, and the signals around the error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["methods"])
    ms = payload["methods"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for a, key, ref, title in (
        (ax[0], "hit1", payload["chance"]["step_token_share"], "hit@1 (top token in error step)"),
        (ax[1], "auroc", 0.5, "AUROC of w for 'at/after first error'"),
    ):
        y = [ms[n][key] for n in names]
        err = [[y[i] - ms[n][f"{key}_ci"][0] for i, n in enumerate(names)],
               [ms[n][f"{key}_ci"][1] - y[i] for i, n in enumerate(names)]]  # fmt: skip
        colors = ["tab:red" if n.startswith("gear") else "tab:gray" for n in names]
        a.bar(names, y, yerr=err, color=colors, capsize=3)
        a.axhline(ref, color="k", ls="--", lw=1, label="flat / chance")
        a.set_title(title)
        a.tick_params(axis="x", rotation=60)
        a.legend(fontsize=8)
    pr = payload["profile"]
    for key, label in (("kl_norm", "full KL (spec)"),
                       ("kl_norm_clean_row", "full KL, same problem's clean row"),
                       ("k1_norm", "k1 = log pS(y) - log pT(y)"),
                       ("entropy_norm", "student entropy")):  # fmt: skip
        ax[2].plot(pr["offsets"], pr[key], marker="o", label=label)
    ax[2].axvline(0, color="k", lw=1, ls=":")
    ax[2].set_xlabel("token offset from the first wrong token")
    ax[2].set_ylabel("per-row min-max normalised value")
    ax[2].set_title("signals around the injected error")
    ax[2].legend(fontsize=8)
    fig.suptitle(f"Credit localisation, {payload['cases']} injected errors, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def write_records(bad: list[dict], good: list[dict], run_dir: Path, n: int = 6) -> Path:
    """A sample as credit records (gear.viz.record) for `gear inspect`: step k = method k of
    (gear, gear_token, rlsd); rows = n corrupted (half per source) + 2 clean."""
    from gear.credit import CreditParams, credit_details
    from gear.models import smollm2_tokenizer
    from gear.viz.record import credit_record_path, credit_rows, write_credit_record

    tok = smollm2_tokenizer()
    pick = [r for r in bad if r["case"]["source"] == "arithmetic"][: n // 2]
    pick += [r for r in bad if r["case"]["source"] == "gsm8k"][: n - len(pick)]
    pick += good[:2]
    adv = torch.tensor([-1.0 if "error" in r else 1.0 for r in pick])
    b = loc.batch(pick)
    tokens = [[tok.decode([i]) for i in r["ids"]] for r in pick]
    for step, name in enumerate(("gear", "gear_token", "rlsd")):
        d = credit_details(adv, b["valid"], kl=b["kl"], entropy=b["entropy"],
                           student_logprobs=b["lp_s"], teacher_logprobs=b["lp_t"],
                           params=CreditParams(method=name))  # fmt: skip
        prompts = []
        for r in pick:
            c = r["case"]
            note = (f"[injected: {c['detail']['original']} -> {c['detail']['new']} at token "
                    f"{r['error']}, step tokens {r['step']}] " if "error" in r else "[clean] ")  # fmt: skip
            prompts.append(note + c["prompt"][-1]["content"])
        rows = credit_rows(
            d, tokens=tokens, rewards=[0.0 if "error" in r else 1.0 for r in pick],
            advantages=adv, prompts=prompts, completions=[r["case"]["completion"] for r in pick],
            step=step, method=name, kl=b["kl"], entropy=b["entropy"],
            token_ids=[r["ids"] for r in pick],
        )  # fmt: skip
        write_credit_record(credit_record_path(run_dir, step), rows)
    print(f"wrote credit records to {run_dir}/credit (gear inspect {run_dir})")
    return run_dir


def _ci(m: dict[str, Any], key: str) -> str:
    v, ci = m.get(key), m.get(f"{key}_ci")
    if v is None:
        return "n/a"
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and ci[0] is not None else f"{v:.3f}"


def run_table(args: argparse.Namespace) -> None:
    """Print the Markdown tables of BENCHMARKS.md from results/localization_injected.json."""
    r = json.loads((RESULTS / "localization_injected.json").read_text())
    print(f"{r['cases']} injected errors ({r['sources']}), {r['clean_rows']} clean rows\n")
    print("| method | hit@1 (step) | hit@1 (wrong number) | extra blame on/after step | "
          "AUROC at/after error | weight std, A > 0 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, m in r["methods"].items():
        print(f"| `{name}` | {_ci(m, 'hit1')} | {_ci(m, 'hit1_token')} | "
              f"{_ci(m, 'blame_after_share')} | {_ci(m, 'auroc')} | "
              f"{_ci(m, 'weight_spread_pos')} |")  # fmt: skip
    c = r["chance"]
    print(f"\nflat: step token share {c['step_token_share']:.3f}, "
          f"at/after-step token share {c['after_step_token_share']:.3f}\n")  # fmt: skip
    for est in ("k1", "k3"):
        for name, m in r["variants"][est].items():
            print(f"| `{name}` [{est}] | {_ci(m, 'hit1')} | {_ci(m, 'hit1_token')} | "
                  f"{_ci(m, 'blame_after_share')} | {_ci(m, 'auroc')} | "
                  f"{_ci(m, 'weight_spread_pos')} |")  # fmt: skip
    print()
    for k, v in r["paired"].items():
        print(f"{k}: " + ", ".join(f"{m} {d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
                                   for m, d in v.items()))  # fmt: skip
    print()
    for src in ("arithmetic", "gsm8k"):
        print(src, {n: (m[f"by_source_{src}"]["hit1"], m[f"by_source_{src}"]["auroc"])
                    for n, m in r["methods"].items()})  # fmt: skip
    best = sorted(r["sweep"], key=lambda x: -(x["hit1"] or 0))[:5]
    print("\nsweep best hit1:", best)
    print("sweep default:", [x for x in r["sweep"] if x["tau_onset"] == 0.1
                             and x["delta_entropy"] == 0.1])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["signals", "metrics", "table"])
    ap.add_argument("--gsm8k", type=int, default=45, help="GSM8K problems (<= 5 errors each).")
    ap.add_argument("--arithmetic", type=int, default=150, help="Multistep problems (2 x 2 each).")
    ap.add_argument("--threads", type=int, default=1, help="1: faster than 2 on the shared CPU.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reverse", action="store_true", help="signals: a second worker, from the other end."
    )
    ap.add_argument("--cache", default=str(CACHE), help="Signal cache directory.")
    args = ap.parse_args()
    {"signals": run_signals, "metrics": run_metrics, "table": run_table}[args.stage](args)


if __name__ == "__main__":
    main()

"""Where the self-teacher's signal lands on SmolLM2 under each teacher context (issue 36).

The rows are `localization.py natural`'s: SmolLM2-135M-Instruct's own failed rollouts on 2- and
3-step arithmetic with the checker's first wrong equation, and correct rollouts for the placebo
(a pseudo-error on one of their equations). Their records already hold the `worked_solution`
teacher's signals (gear's math hint with the worked solution). This study adds, on the *same*
completion ids, the teachers of the other contexts, built with gear.teacher's functions as
GEARTrainer builds them: `answer_only` ("The final answer is N.") and the contrast's wrong-answer
teacher (`Task.wrong_answer`, a fixed seed per prompt). One student pass and one pass per
teacher give both estimators: the full KL and k1 = log pi_S(y_t) - log pi_T(y_t).

Per context x estimator, on failed rows (A = -1) and on the placebo: where the first onset of
`gear`'s segmentation falls (position 0, before / at / after the first wrong equation) and each
method's localisation L (the top weight on the wrong equation or the token after it) and
negative-blame share on it, placebo-corrected with a 95% bootstrap over prompts.

    # the rows, sampled once and shared by every context (skip if runs/localization has them)
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m studies.localization natural \\
        --natural-prompts 200 --cache .cache/teacher_contexts
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m studies.localization natural \\
        --placebo-set --placebo-prompts 100 --cache .cache/teacher_contexts
    # the other contexts' teacher passes (resumable: one cache per teacher, one entry per prompt)
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m studies.teacher_contexts signals \\
        --rows .cache/teacher_contexts
    .venv/bin/python -m studies.teacher_contexts metrics --rows .cache/teacher_contexts
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gear.evidence import bootstrap, bootstrap_difference
from studies import localization as loc  # the batching, per-row metrics and placebo
from studies import onpolicy  # the rows: forwards, rendering, caches

ROOT = Path(__file__).parent.parent
CACHE = ROOT / ".cache" / "teacher_contexts"  # git-ignored
CONTEXTS = ("worked_solution", "answer_only", "contrast")
ESTIMATORS = ("full", "k1")
METHODS = ("gear", "gear_token", "gear_departure_blame")
TEACHERS = ("answer_only", "wrong_answer")  # passes beyond the rows' own worked-solution one
ONSET_BANDS = ("none", "position0", "before", "at", "after")
SEED = 0  # the wrong answers' seed


def teacher_prompt_ids(tok: Any, prompt: list[dict[str, str]], hint: str, context: str) -> list:
    """The teacher's prompt ids under `context`, as GEARTrainer builds them
    (`build_teacher_prompts` with `context_hint_template`; math hint, no tools, no budget).
    `hint` is the worked solution (`worked_solution`) or an answer (right or wrong)."""
    from gear.teacher import build_teacher_prompts, context_hint_template

    built = build_teacher_prompts(
        [prompt],
        [hint],
        lambda i, p: onpolicy.render(tok, p),
        context_hint_template(context, "auto", uses_tools=False),
    )
    return built.ids[0]


def wrong_answer(task: Any, answer: str, group: str, seed: int = SEED) -> str:
    """The contrast teacher's answer of a prompt (`gear.teacher.wrong_answers` with the task's
    hook), from a generator seeded by `seed` and the prompt, so a resumed run draws the same."""
    from gear.teacher import wrong_answers

    return wrong_answers([answer], random.Random(f"{seed}:{group}"), task.wrong_answer)[0]


@torch.no_grad()
def teacher_records(
    model: Any, tok: Any, recs: list[dict[str, Any]], prompts: dict[str, list[int]]
) -> dict[str, list[dict[str, Any]]]:
    """The records of one prompt under each teacher of `prompts` ({name: teacher prompt ids}):
    the same rows (ids, error spans, student entropy and log-probs) with "kl" and "lp_t"
    recomputed against that teacher. One student pass is shared by every teacher."""
    from gear.credit import signals_from_hidden

    ids = [r["ids"] for r in recs]
    student = onpolicy.render(tok, recs[0]["case"]["prompt"])
    hs = onpolicy.completion_hidden(model, student, ids)  # (B, T, H)
    T = hs.shape[1]
    tokens = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for b, r in enumerate(ids):
        tokens[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), True
    lm = model.get_output_embeddings()
    out = {}
    for name, prompt in prompts.items():
        ht = onpolicy.completion_hidden(model, prompt, ids)
        sig = signals_from_hidden(
            hs, ht, lm.weight, tokens, lm_head_bias=lm.bias, mask=mask, chunk_size=128
        )
        out[name] = [
            {**r, "kl": sig.kl[b, : len(r["ids"])].tolist(),
             "lp_t": sig.teacher_logprobs[b, : len(r["ids"])].tolist()}
            for b, r in enumerate(recs)
        ]  # fmt: skip
    return out


def context_details(
    recs: list[dict[str, Any]],
    method: str,
    estimator: str,
    contrast: list[dict[str, Any]] | None = None,
    size: int = 16,
) -> tuple[list[Tensor], list[int]]:
    """A = -1 weights w (T_row,) of each row and the index of its first onset (-1: none), in
    batches of `size` rows. `contrast`: the same rows under the wrong-answer teacher; the method
    then reads max(signal - contrast signal, 0) (`CreditParams.contrast`, as the trainers do)."""
    from gear.credit import CreditParams, credit_details

    params = CreditParams(method=method, contrast=contrast is not None)
    weights, first = [], []
    for k in range(0, len(recs), size):
        b = loc.batch(recs[k : k + size], estimator)
        c = loc.batch(contrast[k : k + size], estimator)["kl"] if contrast else None
        d = credit_details(
            -torch.ones(b["valid"].shape[0]), b["valid"], kl=b["kl"], entropy=b["entropy"],
            student_logprobs=b["lp_s"], teacher_logprobs=b["lp_t"], contrast_kl=c, params=params,
        )  # fmt: skip
        fo = torch.where(d.onsets.any(1), d.onsets.long().argmax(1), -1)
        for i, r in enumerate(recs[k : k + size]):
            weights.append(d.weights[i, : len(r["ids"])].double())
            first.append(int(fo[i]))
    return weights, first


def onset_band(first: int, step: list[int]) -> str:
    """Where a first onset falls: "none", "position0" (the first completion token), or before /
    at / after the [start, end) tokens of the (pseudo-)error's equation."""
    if first < 0:
        return "none"
    if first == 0 and step[0] > 0:
        return "position0"
    return "before" if first < step[0] else "at" if first < step[1] else "after"


def onset_summary(firsts: list[int], recs: list[dict[str, Any]]) -> dict[str, Any]:
    """{band: {"fraction", "count"}} of the rows' first onsets, with a 95% bootstrap over
    prompts of each fraction."""
    bands = [onset_band(f, r["step"]) for f, r in zip(firsts, recs, strict=True)]
    groups = [r["case"]["group"] for r in recs]
    if not recs:  # no rows (a placebo of a model that solves nothing): counts 0, no fractions
        return {
            band: {"fraction": None, "count": 0, "ci": None} for band in (*ONSET_BANDS, "token0")
        }
    out = {}
    for band in ONSET_BANDS:
        b = bootstrap([float(x == band) for x in bands], groups)
        out[band] = {"fraction": b["mean"], "count": bands.count(band), "ci": b["ci"]}
    # not a band: the first token whatever the equation (issue 36's count; most wrong equations
    # open the completion, where the bands call a first-token onset "at")
    b = bootstrap([float(f == 0) for f in firsts], groups)
    out["token0"] = {"fraction": b["mean"], "count": firsts.count(0), "ci": b["ci"]}
    return out


def placebo_set(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Correct rollouts scored as failures: the natural prompts' (`loc.placebo_rows`) and the
    placebo set's, with the pseudo-error on their first equation (where 97% of errors are), as
    credit_confirm's SmolLM2 placebo."""
    natural = {g: v for g, v in rows.items() if g.startswith("natural-")}
    return loc.placebo_rows(natural) + [
        {**r, "error": e0, "error_end": e1, "step": [s0, e1], "placebo": True}
        for g, v in rows.items() if g.startswith("placebo-")
        for r in v if "error" not in r and r.get("equations")
        for s0, _, e0, e1 in r["equations"][:1]
    ]  # fmt: skip


#: per context, the teacher whose signal the methods read and the contrast teacher (or None)
CONTEXT_TEACHERS = {
    "worked_solution": ("worked_solution", None),
    "answer_only": ("answer_only", None),
    "contrast": ("answer_only", "wrong_answer"),
}


def localisation(
    real: list[dict], fake: list[dict], r_recs: list, f_recs: list, key: str, alpha: float = 0.05
) -> dict:
    """Placebo-corrected `key`: per-prompt means on the real rows minus on the placebo rows, with
    each side resampled on its own (interval at 1 - `alpha`)."""
    pr, pp = loc.per_prompt(real, r_recs, key), loc.per_prompt(fake, f_recs, key)
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    if not pr or not pp:  # e.g. a model that solves nothing has no placebo: nothing to correct by
        return {"real": mean(list(pr.values())), "placebo": mean(list(pp.values())),
                "corrected": None, "ci": None}  # fmt: skip
    d = bootstrap_difference(list(pr.values()), list(pp.values()), alpha=alpha)
    return {"real": mean(list(pr.values())), "placebo": mean(list(pp.values())),
            "corrected": d["mean"], "ci": d["ci"]}  # fmt: skip


def interval(d: dict[str, Any]) -> str:
    """`localisation`'s corrected value as "+0.123 [+0.010, +0.240]" (or "none": no placebo)."""
    if d["corrected"] is None:
        return "none (no placebo rows)"
    return f"{d['corrected']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


Rows = dict[str, list[dict[str, Any]]]  # {prompt: records} of one teacher


def split_rows(
    sets: dict[str, Rows], placebo: Callable[[Rows], list[dict[str, Any]]] = placebo_set
) -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """{teacher: (failed rows with a checked first error, placebo rows)} of `sets`."""
    return {t: ([r for v in s.values() for r in v if "error" in r], placebo(s))
            for t, s in sets.items()}  # fmt: skip


def cell_rows(
    split: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    context: str,
    est: str,
    method: str,
    part: int,
) -> tuple[list[dict[str, float]], list[int]]:
    """`method`'s per-row metrics and first onsets under teacher `context` and estimator `est`,
    on the failed (`part` 0) or placebo (`part` 1) rows of `split_rows`."""
    right, wrong = CONTEXT_TEACHERS[context]
    recs, con = split[right][part], split[wrong][part] if wrong else None
    w, first = context_details(recs, method, est, con)
    metrics = [
        loc.natural_row_metrics(x, r["error"], r["step"]) for x, r in zip(w, recs, strict=True)
    ]
    return metrics, first


def summary(
    sets: dict[str, Rows], placebo: Callable[[Rows], list[dict[str, Any]]] = placebo_set
) -> dict[str, Any]:
    """Every metric of the pre-registration from `sets` = {teacher: {prompt: records}} (the same
    prompts and rows for every teacher); `placebo` picks a set's placebo rows."""
    split = split_rows(sets, placebo)
    bad, plc = split["worked_solution"]
    for t, (b, p) in split.items():  # the contexts are paired row for row
        assert [r["ids"] for r in b + p] == [r["ids"] for r in bad + plc], f"{t}: other rows"
    out: dict[str, Any] = {
        "failed_rows": len(bad), "failed_prompts": len({r["case"]["group"] for r in bad}),
        "placebo_rows": len(plc), "placebo_prompts": len({r["case"]["group"] for r in plc}),
    }  # fmt: skip
    per_row: dict[tuple[str, str], dict[str, Any]] = {}
    for context, (right, _) in CONTEXT_TEACHERS.items():
        for est in ESTIMATORS:
            cell: dict[str, Any] = {"failed_rows": len(bad), "placebo_rows": len(plc)}
            rows: dict[str, Any] = {}
            for part, k in (("failed", 0), ("placebo", 1)):
                for m in METHODS:
                    rows[part, m], first = cell_rows(split, context, est, m, k)
                    if m == "gear":
                        rows[part, "first"] = first
                name = "first_onset" if part == "failed" else "placebo_first_onset"
                cell[name] = onset_summary(rows[part, "first"], split[right][k])
            cell["methods"] = {
                m: {key: localisation(rows["failed", m], rows["placebo", m], bad, plc, key)
                    for key in ("L", "blame_before", "blame_at", "blame_after")}
                for m in METHODS
            }  # fmt: skip
            per_row[context, est] = rows
            out.setdefault("contexts", {}).setdefault(context, {})[est] = cell
            print(f"{context:16s} {est:4s} first onset at position 0 "
                  f"{cell['first_onset']['position0']['count']}/{len(bad)}, at the error "
                  f"{cell['first_onset']['at']['count']}; corrected L " + ", ".join(
                      f"{m} {interval(v['L'])}" for m, v in cell["methods"].items()),
                  flush=True)  # fmt: skip
    groups = [r["case"]["group"] for r in bad]
    for (context, est), rows in per_row.items():
        if context == "worked_solution":
            continue
        base = per_row["worked_solution", est]
        pos0 = [float(onset_band(a, r["step"]) == "position0")
                - float(onset_band(b, r["step"]) == "position0")
                for a, b, r in zip(rows["failed", "first"], base["failed", "first"], bad,
                                   strict=True)]  # fmt: skip
        vs: dict[str, Any] = {"position0": bootstrap(pos0, groups)}
        for m in METHODS:
            # (a_real - a_placebo) - (b_real - b_placebo): per-prompt a - b on each side
            a, b = ([loc.per_prompt(x[part, m], recs, "L") for part, recs in
                     (("failed", bad), ("placebo", plc))] for x in (rows, base))  # fmt: skip
            diffs = [[a[k][g] - b[k][g] for g in sorted(a[k]) if g in b[k]] for k in range(2)]
            vs[f"{m}_L_corrected"] = bootstrap_difference(*diffs) if all(diffs) else None
        out["contexts"][context][est]["vs_worked_solution"] = vs
    return out


def load_rows(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The shared rows: {prompt: records} of the natural and the placebo set (worked solution)."""
    rows = {**onpolicy.load_cache(Path(args.rows) / "natural.pt"),
            **onpolicy.load_cache(Path(args.rows) / "placebo.pt")}  # fmt: skip
    if not rows:
        sys.exit(
            f"no rows in {args.rows}: run `python -m studies.localization natural` first (docstring)"
        )
    return rows


def run_signals(args: argparse.Namespace) -> None:
    """Each prompt's records under the answer-only and the wrong-answer teacher, cached per
    teacher (`--cache`/{teacher}.pt, one entry per prompt; resumable)."""
    from gear.tasks.arithmetic import ArithmeticTask

    torch.set_num_threads(1)
    rows = load_rows(args)
    tasks = {"natural": ArithmeticTask(mix=onpolicy.NATURAL_MIX),
             "placebo": ArithmeticTask(mix=onpolicy.PLACEBO_MIX)}  # fmt: skip
    n = {k: 1 + max((int(g.split("-")[1]) for g in rows if g.startswith(k)), default=-1)
         for k in tasks}  # fmt: skip
    data = {k: t.dataset("test", n=n[k], seed=0) for k, t in tasks.items() if n[k] > 0}
    paths = {t: Path(args.cache) / f"{t}.pt" for t in TEACHERS}
    caches = {t: onpolicy.load_cache(p) for t, p in paths.items()}
    model, tok = onpolicy.load_model()
    todo = [g for g in rows if not all(g in c for c in caches.values())]
    print(f"{len(rows) - len(todo)} prompts cached, {len(todo)} to score", flush=True)
    t0 = time.time()
    for k, g in enumerate(todo):
        kind, j = g.split("-")
        row = data[kind][int(j)]
        recs = rows[g]
        if recs:
            assert recs[0]["case"]["prompt"] == row["prompt"], f"{g}: not the rows' prompt"
            wrong = wrong_answer(tasks[kind], row["answer"], g)
            prompts = {
                "answer_only": teacher_prompt_ids(tok, row["prompt"], row["answer"], "answer_only"),
                "wrong_answer": teacher_prompt_ids(tok, row["prompt"], wrong, "contrast"),
            }
            got = teacher_records(model, tok, recs, prompts)
        else:
            got = {t: [] for t in TEACHERS}
        for t in TEACHERS:
            caches[t][g] = got[t]
        if (k + 1) % 4 == 0 or k + 1 == len(todo):
            for t in TEACHERS:
                onpolicy.save_cache(paths[t], caches[t])
            print(f"{k + 1}/{len(todo)} prompts, {time.time() - t0:.0f} s", flush=True)


def commands(groups: list[str], rows: str) -> list[str]:
    """The commands that made a result on `groups` (prompts "natural-j" / "placebo-j")."""
    n = {k: 1 + max((int(g.split("-")[1]) for g in groups if g.startswith(k)), default=-1)
         for k in ("natural", "placebo")}  # fmt: skip
    run = "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m studies."
    return [
        f"{run}localization natural --natural-prompts {n['natural']} --cache {rows}",
        f"{run}localization natural --placebo-set --placebo-prompts {n['placebo']} --cache {rows}",
        f"{run}teacher_contexts signals --rows {rows}",
        f".venv/bin/python -m studies.teacher_contexts metrics --rows {rows}",
    ]


def run_metrics(args: argparse.Namespace) -> None:
    """Every metric from the caches -> studies/results/teacher_contexts.json."""
    rows = load_rows(args)
    caches = {t: onpolicy.load_cache(Path(args.cache) / f"{t}.pt") for t in TEACHERS}
    groups = [g for g in rows if all(g in c for c in caches.values())]
    sets = {"worked_solution": {g: rows[g] for g in groups}}
    sets.update({t: {g: c[g] for g in groups} for t, c in caches.items()})
    t0 = time.time()
    out = {
        "question": "where the self-teacher's first KL onset and each method's negative blame "
        "fall on SmolLM2-135M-Instruct's own failed rows, per teacher context and estimator; "
        "pre-registered in docs/evidence/2026-11-26-teacher-contexts.md",
        "prompts": len(groups),
        **summary(sets),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
        "commands": commands(groups, str(args.rows)),
    }  # fmt: skip
    out["metrics_s"] = time.time() - t0
    # the pre-registered sizes (>= 500 failed rows, >= 100 placebo rows); below them: partial
    out["partial"] = out["failed_rows"] < 500 or out["placebo_rows"] < 100
    path = Path(args.out)
    path.write_text(json.dumps(loc.clean(out), indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["signals", "metrics"])
    ap.add_argument("--rows", default=str(loc.CACHE), help="natural.pt / placebo.pt directory.")
    ap.add_argument("--cache", default=str(CACHE), help="The teachers' caches.")
    ap.add_argument("--out", default=str(loc.RESULTS / "teacher_contexts.json"))
    args = ap.parse_args(argv)
    {"signals": run_signals, "metrics": run_metrics}[args.stage](args)


if __name__ == "__main__":
    main()

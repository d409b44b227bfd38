"""Where OAR-P and OAR-G put the weight on issue 51's rows (issue 60 item 1), read as the rule
fixed before any number: docs/evidence/2026-11-28-oar-localisation-rule.md.

On seed 0's chosen SFT checkpoint's stage-1 rows (`studies.after_format rows`), every failed row
with a checked first wrong equation and every placebo row (`after_format.placebo`) gets A = -1
and the weights of `oar_p` and `oar_g` at their defaults (the parsed answer span; OAR-P's
`answer_joint`), computed by the trainer's own passes (`gear.integrations.trl.forwards`); the
metric, placebo and level are those of issue 51's `gear` threshold, with the checker's oracle
beside them. Run from the repository root; the scoring resumes where it stopped.

    python -m studies.after_format rows        # issue 51's rows, if runs/ does not hold them
    python -m studies.oar_localise score       # OAR-G's and OAR-P's scores, cached per prompt
    python -m studies.oar_localise localise    # -> studies/results/after_format_oar.json
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch

from gear.evidence import bonferroni, head_commit, write_json
from studies import after_format as af

RULE = "docs/evidence/2026-11-28-oar-localisation-rule.md"
OUT = af.RESULTS / "after_format_oar.json"
METHODS = ("oar_p", "oar_g")
SIGNAL = {"oar_p": "perturbation", "oar_g": "influence"}


def cache_path() -> Any:
    return af.rows_dir(False) / "oar.pt"


#: tokens per forward of OAR-P's masked copies: a whole row's copies in one chunk here (its
#: prefix computed once); the scores do not depend on it
TOKENS_PER_FORWARD = 4096


def used_groups(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The prompts whose rows the reading uses: those with a failed row (placebo rows come from
    them alone)."""
    return [g for g, recs in rows.items() if any("error" in r for r in recs)]


def used(r: dict[str, Any]) -> bool:
    """A row the reading can use: failed with a checked error, or correct with the equations a
    placebo row needs (`localization.pseudo_failures`)."""
    return "error" in r or bool(r.get("equations"))


def group_scores(model: Any, tok: Any, task: Any, prompt: list[int], recs: list[dict]) -> dict:
    """One prompt's rows: each row's OAR-G influence and OAR-P perturbation (T,), its answer
    span inside the completion (T,) and whether the parser found it, as `GEARTrainer` computes
    them (`answer_spans`, `answer_influence`, `answer_perturbation`; raw logits, float32)."""
    from gear.credit import CreditParams
    from gear.credit.attribution import tokens_before
    from gear.integrations.trl.forwards import Forwards, answer_influence, answer_perturbation
    from gear.modeling import LogitConventions
    from gear.spans import answer_spans, mask_token_id

    B, T, P = len(recs), max(len(r["ids"]) for r in recs), len(prompt)
    comp = torch.full((B, T), tok.pad_token_id, dtype=torch.long)
    cmask = torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(recs):
        comp[i, : len(r["ids"])], cmask[i, : len(r["ids"])] = torch.tensor(r["ids"]), 1
    valid = cmask.bool()
    spans = answer_spans(CreditParams(method="oar_p"), tok, comp, cmask, valid, task.answer_span)
    ids = torch.cat([torch.tensor(prompt).expand(B, P), comp], dim=1)
    mask = torch.cat([torch.ones(B, P, dtype=torch.long), cmask], dim=1)
    plain = SimpleNamespace(unwrap_model=lambda m: m, autocast=nullcontext, mixed_precision="no")
    fw = Forwards(plain, LogitConventions.of(model), 1.0, "full", 1, 64, prefix_sharing=True)
    infl = answer_influence(fw, model, ids, mask, spans.span, B)
    masked = tokens_before(spans.answer_mask, valid)
    pert = answer_perturbation(
        fw, model, ids, mask, spans.span, masked, mask_token_id(tok), "answer_joint",
        TOKENS_PER_FORWARD,
    )  # fmt: skip
    return {
        "ids": [list(r["ids"]) for r in recs],
        "influence": [infl[i, : len(r["ids"])].tolist() for i, r in enumerate(recs)],
        "perturbation": [pert[i, : len(r["ids"])].tolist() for i, r in enumerate(recs)],
        "answer": [spans.answer_mask[i, : len(r["ids"])].tolist() for i, r in enumerate(recs)],
        "fallback": spans.fallback.tolist(),
    }


def score() -> None:
    """Every used prompt's scores into cache_path(), saved every 4 prompts (resumable)."""
    from studies import onpolicy

    torch.set_num_threads(1)
    rows = onpolicy.load_cache(af.rows_dir(False) / "natural.pt")
    if not rows:
        raise SystemExit("no rows: run `python -m studies.after_format rows` first")
    done = onpolicy.load_cache(cache_path())
    todo = [g for g in used_groups(rows) if g not in done]
    data = af.task().dataset("test", n=len(rows), seed=0)
    model, tok = af.load_rows_model(False) if todo else (None, None)
    t0, commit = time.time(), head_commit(af.ROOT)
    for k, g in enumerate(todo):
        row = data[int(g.split("-")[1])]
        assert rows[g][0]["case"]["prompt"] == row["prompt"], f"{g}: not the rows' prompt"
        with torch.no_grad():  # OAR-G's pass turns the input gradient on for itself
            done[g] = group_scores(model, tok, af.task(), onpolicy.render(tok, row["prompt"]),
                                   [r for r in rows[g] if used(r)])  # fmt: skip
        if (k + 1) % 4 == 0 or k + 1 == len(todo):
            onpolicy.save_cache(cache_path(), done)
            print(f"oar scores: {k + 1}/{len(todo)} prompts, {time.time() - t0:.0f} s", flush=True)
    if todo:
        pieces = done.get("_pieces", [])
        done["_pieces"] = [*pieces, {"wall_s": time.time() - t0, "prompts": len(todo),
                                     "commit": commit,
                                     "capability": torch.backends.cpu.get_cpu_capability()}]  # fmt: skip
        onpolicy.save_cache(cache_path(), done)


def with_scores(recs: list[dict], scores: dict) -> list[dict]:
    """Each record of the row set with its OAR scores, found by its group and completion ids."""
    out = []
    for r in recs:
        s = scores[r["case"]["group"]]
        i = s["index"][tuple(r["ids"])]
        out.append({**r, **{k: s[k][i] for k in ("influence", "perturbation", "answer",
                                                  "fallback")}})  # fmt: skip
    return out


def oar_weights(recs: list[dict], method: str) -> list[torch.Tensor]:
    """A = -1 weights (T_row,) of each record under `method` at its default params."""
    from gear.credit import CreditParams, credit_details

    out = []
    for r in recs:
        d = credit_details(
            torch.tensor([-1.0], dtype=torch.float64),
            torch.ones(1, len(r["ids"]), dtype=torch.bool),
            **{SIGNAL[method]: torch.tensor([r[SIGNAL[method]]], dtype=torch.float64)},
            answer_mask=torch.tensor([r["answer"]]),
            params=CreditParams(method=method),
        )
        out.append(d.weights[0].double())
    return out


def localise() -> dict[str, Any]:
    """The rule's reading into OUT."""
    from studies import localization as loc
    from studies import onpolicy
    from studies import teacher_contexts as tc

    rows = onpolicy.load_cache(af.rows_dir(False) / "natural.pt")
    scores = onpolicy.load_cache(cache_path())
    missing = [g for g in used_groups(rows) if g not in scores]
    if missing:
        raise SystemExit(f"{len(missing)} prompts have no OAR scores: run `score` first")
    for g in used_groups(rows):  # a record is found by its ids within its prompt
        scores[g]["index"] = {tuple(ids): i for i, ids in enumerate(scores[g]["ids"])}
    sets = {g: rows[g] for g in used_groups(rows)}
    bad = with_scores([r for v in sets.values() for r in v if "error" in r], scores)
    plc = with_scores(af.placebo(sets), scores)
    level = bonferroni(af.CELLS)

    def reading(w_bad: list, w_plc: list) -> dict[str, Any]:
        real, fake = (
            [loc.natural_row_metrics(w, r["error"], r["step"]) for w, r in zip(ws, recs, strict=True)]
            for ws, recs in ((w_bad, bad), (w_plc, plc))
        )  # fmt: skip
        d = tc.localisation(real, fake, bad, plc, "L", alpha=1 - level)
        return {**d, "localises": d["ci"] is not None and d["ci"][0] > 0}

    out: dict[str, Any] = {
        "question": "on issue 51's rows (SmolLM2-135M after LoRA SFT on chain, seed 0's chosen "
        "checkpoint), does the top weight of oar_p / oar_g (A = -1, default params) land on the "
        "first wrong equation more than on a placebo's, beside the checker's oracle",
        "rule": RULE,
        "level": level,
        "failed_rows": len(bad),
        "placebo_rows": len(plc),
        "prompts": len(sets),
        "answer_not_found": {
            "failed": sum(r["fallback"] for r in bad),
            "placebo": sum(r["fallback"] for r in plc),
        },
        "methods": {m: reading(oar_weights(bad, m), oar_weights(plc, m)) for m in METHODS},
        "oracle": reading(*(loc.natural_weights(x, "oracle", "full", 0) for x in (bad, plc))),
        "score_pieces": scores.get("_pieces", []),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
    }
    write_json(OUT, loc.clean(out), indent=1)
    for name, d in (*out["methods"].items(), ("oracle", out["oracle"])):
        print(f"{name:7s} corrected L {tc.interval(d)} ({level:.2%}); real {d['real']:.3f}, "
              f"placebo {d['placebo']:.3f}", flush=True)  # fmt: skip
    print(f"wrote {OUT}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["score", "localise"])
    a = ap.parse_args(argv)
    score() if a.stage == "score" else localise()


if __name__ == "__main__":
    main()

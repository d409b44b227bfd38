"""Issue 60's OAR localisation (studies/oar_localise.py) end to end on a tiny model: the trainer's
passes score every row of the prompts with a failed row, the scoring resumes, and the reading
gives oar_p, oar_g and the oracle the same metric, placebo and level as issue 51's threshold."""

from __future__ import annotations

import json

import pytest
import torch

from studies import after_format as af
from studies import oar_localise as ol

WRONG = "12 + 5 = 18, then 18 - 3 = 15. The answer is 15."
RIGHT = "12 + 5 = 17, then 17 - 3 = 14. The answer is 14."


def record(tok, group, prompt, text, wrong):
    ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    n = len(ids)
    r = {"case": {"group": group, "prompt": prompt, "detail": {}}, "ids": ids,
         "kl": [0.0] * n, "entropy": [0.0] * n, "lp_s": [0.0] * n, "lp_t": [0.0] * n}  # fmt: skip
    if wrong:  # the first equation's result "18" is wrong: tokens 8-9, the step 0-9
        r.update(error=8, error_end=10, step=[0, 10])
        r["case"]["detail"]["equation"] = 0
    else:
        r["equations"] = [[0, 10, 8, 10], [12, 24, 22, 24]]
    return r


@pytest.fixture
def study(monkeypatch, tmp_path):
    from gear.models import tiny_model_and_tokenizer
    from studies import onpolicy

    model, tok = tiny_model_and_tokenizer("bytes", seed=0)
    monkeypatch.setattr(af, "load_rows_model", lambda step0: (model.eval(), tok))
    monkeypatch.setattr(af, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(ol, "OUT", tmp_path / "after_format_oar.json")
    data = af.task().dataset("test", n=3, seed=0)
    rows = {}
    for j in range(3):  # prompt 2 has no failed row: not scored, no placebo
        g = f"natural-{j}"
        p = data[j]["prompt"]
        texts = [(WRONG, j < 2), (RIGHT, False), (RIGHT, False)]
        rows[g] = [record(tok, g, p, t, w) for t, w in texts]
        rows[g].append({**rows[g][1], "equations": []})  # no placebo can use it: not scored
    onpolicy.save_cache(af.rows_dir(False) / "natural.pt", rows)
    return tmp_path


def test_scores_every_used_prompt_once_and_reads_the_rule(study):
    from studies import onpolicy

    tmp_path = study
    ol.score()
    scores = onpolicy.load_cache(ol.cache_path())
    assert sorted(k for k in scores if k != "_pieces") == ["natural-0", "natural-1"]
    assert len(scores["_pieces"]) == 1 and scores["_pieces"][0]["prompts"] == 2
    s = scores["natural-0"]
    assert len(s["ids"]) == 3 and len(s["perturbation"]) == 3
    n = WRONG.rindex("15")  # the answer "15" starts there (one byte a token)
    assert s["answer"][0][n : n + 2] == [True, True] and not any(s["fallback"])
    # OAR-P masks only the tokens before the answer; nothing after its first token moves phi
    for key, first in (("perturbation", n), ("influence", n + 1)):
        assert all(v == 0 for v in s[key][0][first:]) and any(v > 0 for v in s[key][0][:n])
    ol.score()  # nothing left: no new piece
    assert len(onpolicy.load_cache(ol.cache_path())["_pieces"]) == 1

    out = ol.localise()
    saved = json.loads((tmp_path / "after_format_oar.json").read_text())
    assert saved["failed_rows"] == 2 and saved["placebo_rows"] == 4 and saved["prompts"] == 2
    assert saved["level"] == pytest.approx(1 - 0.05 / 6, abs=1e-4) and saved["rule"] == ol.RULE
    assert set(saved["methods"]) == {"oar_p", "oar_g"}
    assert out["oracle"]["real"] == 1.0  # the oracle marks the wrong equation itself
    for d in (*saved["methods"].values(), saved["oracle"]):
        assert {"real", "placebo", "corrected", "ci", "localises"} <= set(d)


def test_oar_weights_keep_the_answer_and_what_follows_at_one(study):
    ol.score()
    from studies import onpolicy

    rows = onpolicy.load_cache(af.rows_dir(False) / "natural.pt")
    scores = onpolicy.load_cache(ol.cache_path())
    scores["natural-0"]["index"] = {tuple(x): i for i, x in enumerate(scores["natural-0"]["ids"])}
    (r,) = ol.with_scores(rows["natural-0"][:1], scores)
    n = WRONG.rindex("15")
    for m in ol.METHODS:
        (w,) = ol.oar_weights([r], m)
        assert torch.all(w[n:] == 1) and float(w[:n].mean()) == pytest.approx(1.0)
        assert not torch.all(w[:n] == 1)

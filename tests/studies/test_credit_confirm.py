"""The pre-registered decision rule of issue 27 (`studies/credit_confirm.py`), on synthetic
results: each condition of the rule can fail a candidate on its own."""

from __future__ import annotations

import pytest

from studies import credit_confirm as cc


def gym(gains: dict[str, float], hits: dict[str, float], n: int = 20) -> dict:
    """A `gear.gym.run` result: per-seed finals = 0.5 + gain + small seed noise."""
    noise = [0.004 * ((7 * s) % 5 - 2) for s in range(n)]
    arms = {cc.key(a): {"per_seed": [0.5 + g + e for e in reversed(noise)]}
            for a, g in gains.items()}  # fmt: skip
    arms[cc.key("grpo")] = {"per_seed": [0.5 + e for e in noise]}
    loc = {cc.key(a): {"real": {"hit_step": h}, "shuffled": {"hit_step": 0.25}}
           for a, h in hits.items()}  # fmt: skip
    return {"arms": arms, "localisation": {"arms": loc}}


BASE = {"oracle_sharp": 0.03, "random": 0.0, "gear": -0.02}
HITS = {"gear": 0.16, **{c: 0.9 for c in cc.CANDIDATES}}


def lm(bound: float) -> dict:
    return {"arms": {c: {"corrected_minus_gear": {"mean": 0.05, "ci": [bound, 0.2]}}
                     for c in cc.CANDIDATES}}  # fmt: skip


def test_the_largest_confirmed_gain_is_recommended_and_the_recipe_follows_smollm2():
    gains = {**BASE, "departure_point_k1": 0.0, "departure_blame_k1": 0.02,
             "departure_blame_k1_sharp": 0.03}  # fmt: skip
    g = {"4": gym(gains, HITS), "3": gym(gains, HITS)}
    d = cc.decide(g, lm(-0.04))
    assert d["readable"]
    assert [n for n, c in d["candidates"].items() if c["confirmed"]] == [
        "departure_blame_k1", "departure_blame_k1_sharp"]  # fmt: skip
    assert d["recommended"] == "departure_blame_k1_sharp" and d["recipe_uses_it"]
    assert not cc.decide(g, lm(-0.06))["recipe_uses_it"]  # worse than gear on SmolLM2


@pytest.mark.parametrize("what", ["gate", "placebo", "one_length", "localisation"])
def test_each_condition_can_refuse(what):
    gains = {**BASE, "departure_point_k1": 0.0, "departure_blame_k1": 0.0,
             "departure_blame_k1_sharp": 0.03}  # fmt: skip
    hits = dict(HITS)
    g4, g3 = dict(gains), dict(gains)
    if what == "gate":
        g3["oracle_sharp"] = 0.0
    elif what == "placebo":
        g4["random"] = 0.03
    elif what == "one_length":
        g3["departure_blame_k1_sharp"] = 0.0
    else:
        hits["departure_blame_k1_sharp"] = 0.1  # below gear's share
    d = cc.decide({"4": gym(g4, hits), "3": gym(g3, hits)}, lm(0.0))
    assert d["recommended"] is None and not d["recipe_uses_it"]

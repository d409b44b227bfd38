"""The `success_floor` guard: a divergence the teacher also shows on successful rollouts takes
no blame. It is what keeps the departure recipe (configs/departure.yaml) from pushing down right
tokens under an answer-only teacher (docs/evidence/2026-11-26-gym-fair.md); `gear` at its
defaults stays the paper's definition."""

from __future__ import annotations

from importlib import resources

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gear.credit import CreditParams, credit_details
from gear.credit.segments import minmax_normalise
from gear.testing import gear_row


def recipe(name: str) -> CreditParams:
    """The CreditParams of a shipped `gear train` recipe (its `credit_*` trainer keys)."""
    text = resources.files("gear.app.configs").joinpath(f"{name}.yaml").read_text()
    trainer = yaml.safe_load(text)["trainer"]
    keys = {k.removeprefix("credit_"): v for k, v in trainer.items() if k.startswith("credit_")}
    return CreditParams(**{k: v for k, v in keys.items() if k != "log_steps" and k != "log_rows"})


def answer_only_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """What the answer-only teacher did in the gym: a k1 spike of ~8 nats at a right token
    (t = 4, the first step's result) in every row, successes and failures alike, and, in the
    failed rows, the real disagreement at the wrong final result (t = 22)."""
    g = torch.Generator().manual_seed(0)
    kl = 0.3 * torch.randn(6, 24, generator=g, dtype=torch.float64)
    kl[:, 4] = 8.0 + 0.2 * torch.randn(6, generator=g, dtype=torch.float64)
    kl[3:, 22] = 12.0
    return torch.tensor([1.0, 0.8, 1.2, -1.0, -0.9, -1.1], dtype=torch.float64), kl


def test_the_departure_recipe_does_not_blame_a_spike_successful_rollouts_share():
    """Without the guard the shared spike at t = 4 is a departure: 2.7x a failed row's
    advantage on a right token, and a successful row's credit there falls to 0.16x, so the
    right token is pushed down from both sides. The recipe's guard leaves it near 1 in every
    row and keeps the blame on the wrong final result (t = 22)."""
    adv, kl = answer_only_batch()
    w = credit_details(
        adv, torch.ones_like(kl, dtype=torch.bool), kl=kl, params=recipe("departure")
    ).weights
    failed = w[3:]
    assert torch.all(failed.argmax(dim=1) == 22)
    assert torch.all(failed[:, 4] <= 1.0)
    assert torch.all(w[:3, 4] >= 0.9)


def test_gear_at_its_defaults_is_the_papers_definition():
    """`gear` with CreditParams() equals the spec's plain loop on a batch where the guard, when
    turned on, changes its output."""
    adv, kl = answer_only_batch()
    ent = torch.rand(kl.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    valid = torch.ones_like(kl, dtype=torch.bool)
    got = credit_details(adv, valid, kl=kl, entropy=ent).weights
    for i in range(len(adv)):
        want = gear_row(float(adv[i]), [True] * 24, kl[i].tolist(), ent[i].tolist())["weights"]
        assert got[i].tolist() == pytest.approx(want, abs=1e-12)
    guarded = credit_details(adv, valid, kl=kl, entropy=ent, params=CreditParams(success_floor=1.0))
    assert not torch.allclose(guarded.weights, got)


def loop_floored(x, valid, adv, level):
    """Plain loop of `success_floored_normalise`."""
    peaks = [max(float(x[i, t]) for t in range(x.shape[1]) if valid[i, t])
             for i in range(len(adv)) if adv[i] > 0 and valid[i].any()]  # fmt: skip
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        vals = [float(x[i, t]) for t in range(x.shape[1]) if valid[i, t]]
        if not vals or max(vals) - min(vals) <= 1e-8:
            continue
        lo, hi = min(vals), max(vals)
        floor = max(lo, level * sum(peaks) / len(peaks)) if peaks and level else lo
        for t in range(x.shape[1]):
            if valid[i, t]:
                out[i, t] = max(float(x[i, t]) - floor, 0.0) / (hi - lo)
    return out


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 5),
    t=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    level=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    data=st.data(),
)
def test_the_floor_equals_a_plain_loop(n, t, seed, level, data):
    from gear.credit.segments import success_floored_normalise

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, generator=g, dtype=torch.float64) * 3
    valid = torch.rand(n, t, generator=g) < 0.8
    adv = torch.tensor(
        data.draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=n, max_size=n))
    )
    got = success_floored_normalise(x, valid, adv, level)
    torch.testing.assert_close(got, loop_floored(x, valid, adv, level))
    if level == 0 or not bool(((adv > 0) & valid.any(1)).any()):
        assert torch.equal(got, minmax_normalise(x, valid))  # off: spec §2.2 exactly


def test_success_floor_is_checked():
    with pytest.raises(ValueError, match="success_floor"):
        CreditParams(success_floor=-0.5)

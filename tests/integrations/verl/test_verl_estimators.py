"""GEAR's verl advantage estimators (gear.integrations.verl.estimators), without verl: GRPO per
uid, vectorised, and each estimator against gear.credit on a batch like verl's.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import pytest
import torch

from _verl_helpers import expected_token_advantages, verl_like_batch
from gear.credit import CreditParams
from gear.integrations.verl.config import VERL_ESTIMATORS
from gear.integrations.verl.estimators import (
    ESTIMATOR_FNS,
    GearBatch,
    gear_batch,
    grpo_advantages,
    register_estimators,
)


def loop_grpo(scores, uids, eps, norm=True):
    out = []
    for i, u in enumerate(uids):
        group = torch.tensor(
            [float(scores[j]) for j in range(len(uids)) if uids[j] == u], dtype=torch.float64
        )
        mean, std = (
            (group.mean(), group.std())
            if len(group) > 1
            else (torch.tensor(0.0), torch.tensor(1.0))
        )
        out.append((float(scores[i]) - mean) / (std + eps) if norm else float(scores[i]) - mean)
    return torch.tensor(out, dtype=torch.float32)


def test_grpo_advantages_vectorised():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (11,), generator=g).float()
    uids = ["a", "b", "a", "c", "b", "a", "b", "d", "c", "a", "b"]  # "d" is a group of one
    for norm in (True, False):
        got = grpo_advantages(scores, uids, epsilon=1e-4, norm_adv_by_std=norm)
        torch.testing.assert_close(got, loop_grpo(scores, uids, 1e-4, norm), rtol=0, atol=1e-6)
    # sessions: only each session's final output counts; its advantage is shared
    sessions = ["a0", "a0", "a1", "b0", "b1"]
    final = torch.tensor([False, True, True, True, True])
    s = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    got = grpo_advantages(s, ["a", "a", "a", "b", "b"], final=final, sessions=sessions)
    want = loop_grpo(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"], 1e-4)
    torch.testing.assert_close(got, torch.stack([want[0], want[0], want[1], want[2], want[3]]))


#: estimators whose signals verl's trainer computes (OAR's answer influence and a step
#: checker's mask it does not yet: `check_gear_config` refuses those, and a direct call names the
#: missing signal, tested below)
COMPUTED = sorted(
    n
    for n, m in VERL_ESTIMATORS.items()
    if not {"influence", "perturbation", "error_mask", "prefix_count"}
    & set(CreditParams(method=m).required_signals)
)


def test_estimator_without_its_signal_names_it():
    rewards, mask, uids, signals = verl_like_batch()
    with pytest.raises(ValueError, match="influence"):
        ESTIMATOR_FNS["gear_oar_g"](
            token_level_rewards=rewards,
            response_mask=mask,
            config={"norm_adv_by_std_in_grpo": True},
            index=uids,
            **signals,
        )


@pytest.mark.parametrize("name", COMPUTED)
def test_estimator_equals_gear_credit(name):
    rewards, mask, uids, signals = verl_like_batch()
    fn = ESTIMATOR_FNS[name]
    adv, returns = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        config={"norm_adv_by_std_in_grpo": True},
        index=uids,
        **signals,
    )
    want = expected_token_advantages(rewards, mask, uids, signals, VERL_ESTIMATORS[name])
    torch.testing.assert_close(adv, want)
    assert returns is adv
    assert bool((adv[mask == 0] == 0).all())  # tool observations and padding get nothing
    # the same through the trainer's context instead of keyword arguments
    with gear_batch(GearBatch(signals=signals, response_mask=mask.bool())) as ctx:
        adv2, _ = fn(token_level_rewards=rewards, response_mask=mask, index=uids)
    torch.testing.assert_close(adv2, want)
    assert ctx.details is not None and "gear/mass_error" in ctx.details.stats


def test_estimator_errors_and_registration_without_verl():
    rewards, mask, uids, signals = verl_like_batch()
    with pytest.raises(
        ValueError, match=r"needs the per-token signals \['gear_kl', 'gear_entropy'\].*gear_sync"
    ):
        ESTIMATOR_FNS["gear"](token_level_rewards=rewards, response_mask=mask, index=uids)
    with pytest.raises(ValueError, match="gear_kl: expected the response mask's shape"):
        ESTIMATOR_FNS["gear"](
            token_level_rewards=rewards,
            response_mask=mask,
            index=uids,
            gear_kl=signals["gear_kl"][:, :5],
            gear_entropy=signals["gear_entropy"],
        )
    registry: dict = {}
    assert register_estimators(registry) == register_estimators(registry) == list(VERL_ESTIMATORS)
    assert registry == ESTIMATOR_FNS
    registry["gear"] = lambda **kw: None  # someone else's estimator under our name
    with pytest.raises(ValueError, match="'gear' is already registered"):
        register_estimators(registry)


def test_every_registered_credit_method_is_a_verl_estimator():
    """The verl estimator names come from the credit registry, one per method, none of them
    verl's own ("grpo"): a method registered in gear.credit needs no second list."""
    from gear.credit import METHODS

    assert sorted(VERL_ESTIMATORS.values()) == sorted(METHODS)
    assert all(name.startswith("gear") for name in VERL_ESTIMATORS)
    assert VERL_ESTIMATORS["gear_grpo"] == "grpo" and VERL_ESTIMATORS["gear_turn"] == "turn"

"""The credit core against spec §2-3: a loop oracle, the invariants, and hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gear.credit import METHODS, CreditParams, credit_details, register_method, token_advantages
from gear.testing import gear_row

SEGMENT_VARIANTS = [
    "gear", "gear_token", "gear_kl_only", "gear_entropy_only",
    "gear_departure", "gear_departure_point", "gear_departure_blame",
]  # fmt: skip
FLOAT_KEYS = ("token_advantages", "weights", "source")


def random_batch(seed: int, N: int = 6, T: int = 40, spiky: bool = True):
    """A batch with gaps (tool tokens), right padding, turn starts and all three signs of A."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.7, -0.3, 2.0])[:N]
    valid = torch.ones(N, T, dtype=torch.bool)
    for i in range(N):
        end = int(torch.randint(T // 2, T + 1, (1,), generator=g))
        valid[i, end:] = False
        if i % 2:
            a = int(torch.randint(1, T // 2, (1,), generator=g))
            valid[i, a : a + 3] = False
    turn = torch.rand(N, T, generator=g) < 0.05
    kl = torch.rand(N, T, generator=g, dtype=torch.float64)
    if spiky:  # mostly small with spikes and plateaus, like real KL
        kl = torch.where(kl > 0.8, kl * 5, kl * 0.2)
    ent = torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    return adv.double(), valid, kl, ent, turn


def oracle_batch(adv, valid, kl, ent, turn, variant, **kw) -> dict[str, torch.Tensor]:
    rows = [
        gear_row(
            float(adv[i]),
            valid[i].tolist(),
            kl[i].tolist(),
            ent[i].tolist(),
            turn[i].tolist() if turn is not None else None,
            variant=variant,
            **kw,
        )
        for i in range(len(adv))
    ]
    return {
        k: torch.tensor([r[k] for r in rows], dtype=torch.float64 if k in FLOAT_KEYS else None)
        for k in rows[0]
    }


# ----------------------------------------------------------------------------- oracle equality


@pytest.mark.parametrize("variant", SEGMENT_VARIANTS)
@pytest.mark.parametrize("modulation", ["linear", "exp"])
@pytest.mark.parametrize("preserve_mass", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_vectorised_equals_loop_oracle(variant, modulation, preserve_mass, seed):
    adv, valid, kl, ent, turn = random_batch(seed)
    kw = dict(
        modulation=modulation, preserve_mass=preserve_mass, max_segment_len=7 if seed == 3 else 512
    )
    params = CreditParams(method=variant, **kw)
    d = credit_details(adv, valid, kl=kl, entropy=ent, turn_starts=turn, params=params)
    ref = oracle_batch(adv, valid, kl, ent, turn, variant, **kw)
    torch.testing.assert_close(d.token_advantages, ref["token_advantages"], atol=1e-12, rtol=0)
    torch.testing.assert_close(d.weights, ref["weights"], atol=1e-12, rtol=0)
    torch.testing.assert_close(d.source, ref["source"], atol=1e-12, rtol=0)
    assert torch.equal(d.onsets, ref["onsets"])
    if variant != "gear_token":
        assert torch.equal(d.segment_ids, ref["segment_ids"])


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    T=st.integers(1, 24),
    variant=st.sampled_from(SEGMENT_VARIANTS),
    modulation=st.sampled_from(["linear", "exp"]),
    preserve_mass=st.booleans(),
    max_segment_len=st.integers(1, 8),
    tau=st.sampled_from([0.1, 0.3, 1.0]),
    delta=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_vectorised_equals_loop_oracle_property(
    data, T, variant, modulation, preserve_mass, max_segment_len, tau, delta
):
    floats = st.floats(0, 10, allow_nan=False, width=64)
    adv = data.draw(st.sampled_from([-1.5, -0.2, 0.0, 0.4, 1.0]))
    valid = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    turn = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    kl = data.draw(st.lists(floats, min_size=T, max_size=T))
    ent = data.draw(st.lists(floats, min_size=T, max_size=T))
    kw = dict(
        modulation=modulation,
        preserve_mass=preserve_mass,
        max_segment_len=max_segment_len,
        tau_onset=tau,
        delta_entropy=delta,
    )
    d = credit_details(
        torch.tensor([adv], dtype=torch.float64),
        torch.tensor([valid]),
        kl=torch.tensor([kl], dtype=torch.float64),
        entropy=torch.tensor([ent], dtype=torch.float64),
        turn_starts=torch.tensor([turn]),
        params=CreditParams(method=variant, **kw),
    )
    ref = gear_row(adv, valid, kl, ent, turn, variant=variant, **kw)
    assert d.onsets[0].tolist() == ref["onsets"]
    assert d.token_advantages[0].tolist() == pytest.approx(ref["token_advantages"], abs=1e-12)
    if variant != "gear_token":
        assert d.segment_ids[0].tolist() == ref["segment_ids"]


# ----------------------------------------------------------------------------- invariants

row_strategy = st.integers(2, 30).flatmap(
    lambda T: st.tuples(
        st.lists(st.floats(0, 5, allow_nan=False, width=32), min_size=T, max_size=T),
        st.lists(st.floats(0, 5, allow_nan=False, width=32), min_size=T, max_size=T),
        st.lists(st.booleans(), min_size=T, max_size=T),
    )
)


def one_row(kl, ent, valid, adv=1.0, **kw):
    return credit_details(
        torch.tensor([adv]),
        torch.tensor([valid]),
        kl=torch.tensor([kl]),
        entropy=torch.tensor([ent]),
        params=CreditParams(**kw),
    )


@settings(max_examples=100, deadline=None)
@given(row=row_strategy, modulation=st.sampled_from(["linear", "exp"]))
def test_zero_advantage_gives_zero(row, modulation):
    kl, ent, valid = row
    d = one_row(kl, ent, valid, adv=0.0, modulation=modulation)
    assert torch.all(d.token_advantages == 0)


@settings(max_examples=100, deadline=None)
@given(row=row_strategy, c=st.floats(0, 5, width=32), adv=st.sampled_from([-2.0, 0.5, 1.0]))
def test_constant_kl_is_grpo_exactly(row, c, adv):
    _, ent, valid = row
    d = one_row([c] * len(valid), ent, valid, adv=adv)
    expected = torch.tensor([[adv if ok else 0.0 for ok in valid]])
    assert torch.equal(d.token_advantages, expected)


@settings(max_examples=150, deadline=None)
@given(
    row=row_strategy,
    adv=st.sampled_from([-1.3, -0.5, 0.5, 1.0, 2.5]),
    method=st.sampled_from([*SEGMENT_VARIANTS, "turn", "fixed", "random"]),
    modulation=st.sampled_from(["linear", "exp"]),
)
def test_mass_is_preserved_when_clipping_does_not_bind(row, adv, method, modulation):
    kl, ent, valid = row
    # wide clip bounds so that clipping cannot bind
    d = one_row(
        kl, ent, valid, adv=adv, method=method, modulation=modulation, w_min=0.0, w_max=100.0
    )
    n = sum(valid)
    assert float(d.token_advantages.double().sum()) == pytest.approx(n * adv, rel=1e-5, abs=1e-5)
    if n:
        assert d.stats["gear/mass_error"] < 1e-5
    else:  # no policy token: nothing measured, no statistic (issue 59, item 14)
        assert math.isnan(d.stats["gear/mass_error"])


@settings(max_examples=150, deadline=None)
@given(
    row=row_strategy, sign=st.sampled_from([-1.0, 1.0]), method=st.sampled_from(SEGMENT_VARIANTS)
)
def test_direction_larger_source_never_gets_larger_weight_for_positive_advantage(row, sign, method):
    kl, ent, valid = row
    d = one_row(kl, ent, valid, adv=sign, method=method)
    a = d.source[0][d.valid[0]]
    w = d.weights[0][d.valid[0]]
    order = a.argsort()
    a, w = a[order], w[order]
    strictly_larger = a[1:] > a[:-1]
    if sign > 0:
        assert torch.all(w[1:][strictly_larger] <= w[:-1][strictly_larger] + 1e-6)
    else:
        assert torch.all(w[1:][strictly_larger] >= w[:-1][strictly_larger] - 1e-6)


@settings(max_examples=150, deadline=None)
@given(row=row_strategy, turns=st.data(), method=st.sampled_from([*SEGMENT_VARIANTS[2:], "gear"]))
def test_segment_tokens_share_onset_weight_and_never_cross_a_continuation_start(row, turns, method):
    kl, ent, valid = row
    T = len(valid)
    ts = turns.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    d = credit_details(
        torch.tensor([1.0]),
        torch.tensor([valid]),
        kl=torch.tensor([kl]),
        entropy=torch.tensor([ent]),
        turn_starts=torch.tensor([ts]),
        params=CreditParams(method=method),
    )
    ids, w = d.segment_ids[0].tolist(), d.weights[0].tolist()
    cont = [t == 0 or not valid[t - 1] or ts[t] for t in range(T)]
    for t in range(1, T):
        if ids[t] >= 0 and ids[t] == ids[t - 1]:
            assert not cont[t], "a segment crossed a continuation start"
            assert w[t] == w[t - 1]
    for t in range(T):
        if ids[t] >= 0 and (t == 0 or ids[t - 1] != ids[t]):
            assert d.onsets[0, t], "a segment does not begin at its onset"


@settings(max_examples=100, deadline=None)
@given(
    row=row_strategy, junk=st.floats(-1e6, 1e6, width=32), method=st.sampled_from(SEGMENT_VARIANTS)
)
def test_values_at_invalid_positions_change_nothing(row, junk, method):
    kl, ent, valid = row
    kl2 = [k if ok else junk for k, ok in zip(kl, valid, strict=True)]
    ent2 = [e if ok else abs(junk) for e, ok in zip(ent, valid, strict=True)]
    a = one_row(kl, ent, valid, method=method).token_advantages
    b = one_row(kl2, ent2, valid, method=method).token_advantages
    assert torch.equal(a, b)


@settings(max_examples=100, deadline=None)
@given(
    row=row_strategy, k=st.sampled_from([0.25, 2.0, 8.0]), method=st.sampled_from(SEGMENT_VARIANTS)
)
def test_scaling_signals_by_a_positive_constant_changes_nothing(row, k, method):
    kl, ent, valid = row
    a = one_row(kl, ent, valid, method=method).token_advantages
    b = one_row([x * k for x in kl], [x * k for x in ent], valid, method=method).token_advantages
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_rows_are_independent():
    adv, valid, kl, ent, turn = random_batch(7)
    full = token_advantages(adv, valid, kl=kl, entropy=ent, turn_starts=turn)
    for i in range(len(adv)):
        alone = token_advantages(
            adv[i : i + 1],
            valid[i : i + 1],
            kl=kl[i : i + 1],
            entropy=ent[i : i + 1],
            turn_starts=turn[i : i + 1],
        )
        assert torch.equal(alone[0], full[i])


# ----------------------------------------------------------------------------- hand-worked methods


def test_gear_hand_worked_example():
    # kl normalises to d~ = [0, 0.5, 0.6, 0, 1, 1, 0.2, 0]; entropy rises (+0.5) at t=6 only.
    kl = torch.tensor([[0.0, 5.0, 6.0, 0.0, 10.0, 10.0, 2.0, 0.0]])
    ent = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0]])
    d = credit_details(
        torch.tensor([1.0]),
        torch.ones(1, 8, dtype=torch.bool),
        kl=kl,
        entropy=ent,
        params=CreditParams(preserve_mass=False),
    )
    # onsets at 1 (rising edge) and 4; the plateau 4-5 is one spike; segment of 4 stops at the
    # entropy rise at 6, and 6 (d~ = 0.2 >= 0.1, re-armed by the rise) is an onset of its own.
    assert d.onsets[0].tolist() == [False, True, False, False, True, False, True, False]
    assert d.segment_ids[0].tolist() == [-1, 0, 0, 0, 1, 1, 2, 2]
    assert d.source[0].tolist() == pytest.approx([0, 0.5, 0.5, 0.5, 1, 1, 0.2, 0.2])
    assert d.weights[0].tolist() == pytest.approx([1, 0.75, 0.75, 0.75, 0.5, 0.5, 0.9, 0.9])


def test_grpo_is_the_sequence_advantage_on_valid_tokens():
    valid = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    out = token_advantages(torch.tensor([2.0, -1.0]), valid, params=CreditParams(method="grpo"))
    assert out.tolist() == [[2.0, 2.0, 0.0, 2.0], [-1.0, 0.0, 0.0, 0.0]]


def test_turn_uses_the_max_kl_of_each_continuation():
    valid = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.0, 4.0, 99.0, 2.0, 1.0, 0.0]])  # d~ = [0, 1, -, .5, .25, 0]
    d = credit_details(
        torch.tensor([1.0]), valid, kl=kl, params=CreditParams(method="turn", preserve_mass=False)
    )
    assert d.segment_ids[0].tolist() == [0, 0, -1, 1, 1, 1]
    assert d.source[0].tolist() == pytest.approx([1, 1, 0, 0.5, 0.5, 0.5])
    assert d.weights[0].tolist() == pytest.approx([0.5, 0.5, 1, 0.75, 0.75, 0.75])


def test_fixed_cuts_each_continuation_into_fixed_len_pieces():
    valid = torch.tensor([[1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 4.0]])  # d~ = [0, .5, .25, -, 0, 0, 1]
    d = credit_details(
        torch.tensor([-1.0]),
        valid,
        kl=kl,
        params=CreditParams(method="fixed", fixed_len=2, preserve_mass=False),
    )
    assert d.segment_ids[0].tolist() == [0, 0, 1, -1, 2, 2, 3]
    assert d.source[0].tolist() == pytest.approx([0.5, 0.5, 0.25, 0, 0, 0, 1])
    assert d.weights[0].tolist() == pytest.approx([1.25, 1.25, 1.125, 1, 1, 1, 1.5])


def test_random_has_as_many_segments_as_gear_and_is_seeded():
    adv, valid, kl, ent, _turn = random_batch(3)
    g = credit_details(adv, valid, kl=kl, entropy=ent, params=CreditParams(method="gear"))
    r1 = credit_details(
        adv, valid, kl=kl, entropy=ent, params=CreditParams(method="random", seed=1)
    )
    r2 = credit_details(
        adv, valid, kl=kl, entropy=ent, params=CreditParams(method="random", seed=1)
    )
    r3 = credit_details(
        adv, valid, kl=kl, entropy=ent, params=CreditParams(method="random", seed=2)
    )
    assert torch.equal(g.onsets.sum(1), r1.onsets.sum(1))
    assert torch.equal(r1.token_advantages, r2.token_advantages)
    assert not torch.equal(r1.onsets, r3.onsets)
    starts = r1.onsets
    assert torch.allclose(r1.source[starts], r1.kl_norm[starts])


def test_rlsd_matches_its_formula():
    lp_s = torch.tensor([[-1.0, -2.0, -0.5]])
    lp_t = torch.tensor([[-0.5, -2.5, -0.5]])  # delta = [0.5, -0.5, 0]
    valid = torch.ones(1, 3, dtype=torch.bool)
    for adv in (1.0, -2.0):
        out = token_advantages(
            torch.tensor([adv]),
            valid,
            student_logprobs=lp_s,
            teacher_logprobs=lp_t,
            params=CreditParams(method="rlsd"),
        )
        s = math.copysign(1, adv)
        ratio = [min(max(math.exp(s * dl), 0.8), 1.2) for dl in (0.5, -0.5, 0.0)]
        assert out[0].tolist() == pytest.approx([adv * (0.5 + 0.5 * r) for r in ratio])


def test_entropy_top_keeps_the_top_rho_of_the_batch():
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ent = torch.tensor([[0.1, 0.9, 0.2, 0.3, 0.4], [5.0, 0.0, 0.0, 0.0, 0.0]])
    out = token_advantages(
        torch.tensor([1.0, -1.0]),
        valid,
        entropy=ent,
        params=CreditParams(method="entropy_top", rho=0.2),
    )
    assert out.tolist() == [[0, 1, 0, 0, 0], [-1, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------- bad input, fallback


def test_non_finite_rows_fall_back_to_weight_one_and_are_counted():
    adv, valid, kl, ent, _turn = random_batch(1)
    kl[2, 0] = math.nan
    ent[4, 1] = math.inf
    valid[4, 1] = True
    d = credit_details(adv, valid, kl=kl, entropy=ent)
    assert d.fallback_rows.tolist() == [False, False, True, False, True, False]
    assert d.stats["gear/fallback_rows"] == 2
    for i in (2, 4):
        assert torch.equal(d.token_advantages[i], torch.where(valid[i], adv[i], 0.0))
    assert torch.isfinite(d.token_advantages).all()


def test_nan_on_an_invalid_token_is_not_a_fallback():
    adv, valid, kl, ent, _turn = random_batch(1)
    kl[0, -1], valid[0, -1] = math.nan, False
    assert not credit_details(adv, valid, kl=kl, entropy=ent).fallback_rows.any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kl=torch.zeros(2, 3)), "kl: expected shape"),
        (dict(entropy=torch.zeros(3, 4, dtype=torch.long)), "entropy: expected a floating"),
        (dict(turn_starts=torch.full((3, 4), 0.5)), "turn_starts: expected a bool"),
        (dict(response_mask=torch.ones(2, 4, dtype=torch.bool)), "response_mask: expected 3 rows"),
        (dict(kl=None), r"needs \['kl'\]"),
    ],
)
def test_bad_input_errors_name_the_field(kwargs, match):
    args = dict(
        response_mask=torch.ones(3, 4, dtype=torch.bool),
        kl=torch.rand(3, 4),
        entropy=torch.rand(3, 4),
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        credit_details(torch.ones(3), args.pop("response_mask"), **args)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("method", "nope"),
        ("tau_onset", 0.0),
        ("alpha", 1.0),
        ("modulation", "cubic"),
        ("w_min", 5.0),
        ("max_segment_len", 0),
        ("rho", 0.0),
        ("beta", float("nan")),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"CreditParams.{field}"):
        CreditParams(**{field: value})


def test_unknown_param_keys_are_listed():
    with pytest.raises(ValueError, match=r"unknown field.*tau_onsett"):
        CreditParams.from_dict({"tau_onsett": 0.2})


def test_registry_refuses_a_different_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_method("gear")(lambda x, p: None)


def test_every_method_runs_and_zeroes_invalid_tokens():
    adv, valid, kl, ent, turn = random_batch(5)
    for name in METHODS:
        out = token_advantages(
            adv.float(),
            valid,
            kl=kl.float(),
            entropy=ent.float(),
            turn_starts=turn,
            student_logprobs=-kl.float(),
            teacher_logprobs=-ent.float(),
            influence=kl.float(),
            perturbation=ent.float(),
            error_mask=kl > kl.median(),
            prefix_count=torch.ones_like(kl) + (kl > kl.median()),
            params=CreditParams(method=name),
        )
        assert out.dtype == torch.float32 and out.shape == valid.shape
        assert torch.all(out[~valid] == 0), name

"""The first-departure extensions (issue 27) and the contrast teacher option against plain loops
of their definitions (`gear.testing.departure_row`) and hand-worked rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gear.credit import CreditParams, credit_details, token_advantages
from gear.testing import gear_row

DEPARTURE = ["gear_departure", "gear_departure_point", "gear_departure_blame"]


def details(kl, method, adv=-1.0, valid=None, turns=None, **kw):
    kl = torch.tensor([kl], dtype=torch.float64)
    return credit_details(
        torch.tensor([adv], dtype=torch.float64),
        torch.ones_like(kl, dtype=torch.bool) if valid is None else torch.tensor([valid]),
        kl=kl,
        entropy=torch.zeros_like(kl),
        turn_starts=None if turns is None else torch.tensor([turns]),
        params=CreditParams(method=method, **kw),
    )


# A departure at 2 (d~ 5/9), a larger spike at 5 before the student realigns (3 tokens below
# tau from 6 on: realigned at 8), then a second departure at 10 after the realignment.
ROW = [0, 0, 5, 0, 0, 9, 0, 0, 0, 0, 3, 0]
D = [k / 9 for k in ROW]


def test_departure_absorbs_later_spikes_until_realignment():
    d = details(ROW, "gear_departure", realign_len=3)
    assert d.onsets[0].nonzero().flatten().tolist() == [2, 10]  # the spike at 5 opens nothing
    assert d.segment_ids[0].tolist() == [-1, -1, 0, 0, 0, 0, 0, 0, -1, -1, 1, 1]
    want = [0, 0] + [D[2]] * 6 + [0, 0, D[10], D[10]]
    assert d.source[0].tolist() == pytest.approx(want)
    # the spec's GEAR (no entropy rises here) opens a segment at each spike instead
    g = details(ROW, "gear_kl_only")
    assert g.onsets[0].nonzero().flatten().tolist() == [2, 5, 10]


def test_departure_point_puts_the_span_maximum_on_the_departure_and_explains_away_the_rest():
    d = details(ROW, "gear_departure_point", realign_len=3)
    want = [0, 0, 1.0, 0, 0, 0, 0, 0, 0, 0, D[10], 0]
    assert d.source[0].tolist() == pytest.approx(want)
    assert d.segment_ids[0].tolist() == [-1, -1, 0] + [-1] * 7 + [1, -1]
    w = d.weights[0]
    assert int(w.argmax()) == 2  # A < 0: the most blame on the departure, not on the spike at 5
    assert w[5] < w[2]


def test_departure_blame_places_a_failure_at_its_departure_and_leaves_a_success_token_level():
    failed = details(ROW, "gear_departure_blame", adv=-1.0, realign_len=3)
    point = details(ROW, "gear_departure_point", adv=-1.0, realign_len=3)
    torch.testing.assert_close(failed.weights, point.weights, atol=0, rtol=0)
    assert int(failed.weights[0].argmax()) == 2
    ok = details(ROW, "gear_departure_blame", adv=1.0, realign_len=3)
    token = details(ROW, "gear_token", adv=1.0)
    torch.testing.assert_close(ok.weights, token.weights, atol=0, rtol=0)
    assert ok.weights[0, 5] < ok.weights[0, 2] < ok.weights[0, 0]  # less credit where divergent
    assert not ok.onsets.any()


def test_realign_len_one_is_gear_kl_only():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        kl = (torch.rand(1, 30, generator=g, dtype=torch.float64) ** 4).tolist()[0]
        a = details(kl, "gear_departure", realign_len=1)
        b = details(kl, "gear_kl_only")
        assert torch.equal(a.onsets, b.onsets)
        torch.testing.assert_close(a.weights, b.weights, atol=0, rtol=0)


def test_a_continuation_start_ends_a_departure_and_can_open_the_next():
    turns = [False] * 12
    turns[4] = True
    d = details(ROW, "gear_departure", realign_len=8, turns=turns)
    # the span from 2 stops at the turn start 4; the spike at 5 opens the next turn's departure
    assert d.onsets[0].nonzero().flatten().tolist() == [2, 5]
    assert d.segment_ids[0].tolist()[:6] == [-1, -1, 0, 0, -1, 1]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    T=st.integers(1, 30),
    method=st.sampled_from(DEPARTURE),
    modulation=st.sampled_from(["linear", "exp"]),
    preserve_mass=st.booleans(),
    max_segment_len=st.integers(1, 12),
    realign_len=st.integers(1, 6),
    tau=st.sampled_from([0.1, 0.3, 1.0]),
)
def test_vectorised_equals_the_plain_loop(
    data, T, method, modulation, preserve_mass, max_segment_len, realign_len, tau
):
    floats = st.floats(0, 10, allow_nan=False, width=64)
    adv = data.draw(st.sampled_from([-1.5, -0.2, 0.0, 0.4, 1.0]))
    valid = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    turn = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    kl = data.draw(st.lists(floats, min_size=T, max_size=T))
    kw = dict(
        modulation=modulation,
        preserve_mass=preserve_mass,
        max_segment_len=max_segment_len,
        tau_onset=tau,
        realign_len=realign_len,
    )
    d = details(kl, method, adv=adv, valid=valid, turns=turn, **kw)
    ref = gear_row(adv, valid, kl, [0.0] * T, turn, variant=method, **kw)
    assert d.onsets[0].tolist() == ref["onsets"]
    assert d.segment_ids[0].tolist() == ref["segment_ids"]
    assert d.source[0].tolist() == pytest.approx(ref["source"], abs=1e-12)
    assert d.token_advantages[0].tolist() == pytest.approx(ref["token_advantages"], abs=1e-12)


# ----------------------------------------------------------------------------- contrast


def test_contrast_is_the_method_on_the_excess_kl_over_the_contrast_teacher():
    g = torch.Generator().manual_seed(1)
    adv = torch.tensor([-1.0, 1.0, -0.5], dtype=torch.float64)
    valid = torch.ones(3, 20, dtype=torch.bool)
    kl = torch.rand(3, 20, generator=g, dtype=torch.float64) * 4
    other = torch.rand(3, 20, generator=g, dtype=torch.float64) * 4
    ent = torch.rand(3, 20, generator=g, dtype=torch.float64)
    for method in ("gear", "gear_departure_point"):
        with_contrast = token_advantages(
            adv, valid, kl=kl, entropy=ent, contrast_kl=other,
            params=CreditParams(method=method, contrast=True),
        )  # fmt: skip
        plain = token_advantages(
            adv,
            valid,
            kl=(kl - other).clamp(min=0),
            entropy=ent,
            params=CreditParams(method=method),
        )
        torch.testing.assert_close(with_contrast, plain, atol=0, rtol=0)
        ignored = token_advantages(  # contrast off: the contrast teacher's KL changes nothing
            adv, valid, kl=kl, entropy=ent, contrast_kl=other, params=CreditParams(method=method)
        )
        torch.testing.assert_close(
            ignored,
            token_advantages(adv, valid, kl=kl, entropy=ent, params=CreditParams(method=method)),
        )


def test_contrast_errors_name_what_is_missing():
    adv, valid = torch.tensor([1.0]), torch.ones(1, 4, dtype=torch.bool)
    kl = torch.rand(1, 4)
    with pytest.raises(ValueError, match=r"with contrast needs \['contrast_kl'\]"):
        token_advantages(adv, valid, kl=kl, entropy=kl, params=CreditParams(contrast=True))
    with pytest.raises(ValueError, match=r"CreditParams.contrast: .*'grpo' uses no KL"):
        token_advantages(adv, valid, params=CreditParams(method="grpo", contrast=True))
    with pytest.raises(ValueError, match=r"CreditParams\.contrast: expected a bool"):
        CreditParams(contrast="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"CreditParams\.realign_len: expected an integer >= 1"):
        CreditParams(realign_len=0)


def test_a_non_finite_contrast_row_falls_back_to_grpo():
    adv = torch.tensor([-1.0, -1.0])
    kl = torch.rand(2, 6) + torch.arange(6.0)
    other = torch.zeros(2, 6)
    other[1, 3] = float("nan")
    d = credit_details(
        adv, torch.ones(2, 6, dtype=torch.bool), kl=kl, entropy=kl, contrast_kl=other,
        params=CreditParams(contrast=True),
    )  # fmt: skip
    assert d.fallback_rows.tolist() == [False, True]
    assert torch.all(d.weights[1] == 1) and not torch.all(d.weights[0] == 1)


# ----------------------------------------------------------------------------- in the gym


def test_the_contrast_teacher_sees_a_hint_wrong_at_every_step():
    from gear.gym.task import ChainTask

    task = ChainTask(4)
    problems = task.problems(32, torch.Generator().manual_seed(0))
    right, wrong = task.teacher_prompts(problems), task.contrast_teacher_prompts(problems)
    hint = slice(1, 1 + task.length)
    assert torch.all(wrong[:, hint] != right[:, hint])
    assert torch.equal(wrong[:, hint], (right[:, hint] + 5) % 10)
    rest = torch.ones(right.shape[1], dtype=torch.bool)
    rest[hint] = False
    assert torch.equal(wrong[:, rest], right[:, rest])


def test_a_contrast_arm_against_an_identical_teacher_is_grpo_and_needs_its_logits():
    from gear.gym.task import ChainTask
    from gear.gym.train import credit, parse_arm

    task = ChainTask(3)
    g = torch.Generator().manual_seed(0)
    problems = task.problems(4, g)
    comp = torch.randint(0, 10, (4, task.completion_len), generator=g)
    student = torch.randn(4, task.completion_len, 16, generator=g)
    teacher = torch.randn(4, task.completion_len, 16, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    arm = parse_arm("gear@contrast=true")
    same = credit(arm, task, problems, comp, adv, student, teacher, 0, contrast_logits=teacher)
    torch.testing.assert_close(same, adv[:, None].expand_as(same))  # no excess KL: GRPO
    plain = credit(parse_arm("gear"), task, problems, comp, adv, student, teacher, 0)
    assert not torch.allclose(plain, adv[:, None].expand_as(plain))
    with pytest.raises(ValueError, match="contrast=true needs the contrast teacher"):
        credit(arm, task, problems, comp, adv, student, teacher, 0)


def test_the_gym_trains_and_reads_out_the_new_arms(tmp_path):
    from gear.gym import run
    from gear.gym.model import ModelConfig, WarmStart
    from gear.gym.train import RLConfig

    specs = ["grpo", "gear_departure_blame@estimator=k1", "gear_departure_point@contrast=true"]
    result = run(
        specs, seeds=2, steps=2, length=3,
        rl=RLConfig(prompts=4, group=4, eval_every=1, eval_n=16),
        model_cfg=ModelConfig(hidden=16, layers=1, heads=2),
        warm=WarmStart(target=1.0, max_steps=10, check_every=5, eval_n=16, batch=16),
        loc_prompts=4, cache=tmp_path, log=lambda _: None,
    )  # fmt: skip
    for spec in specs:
        assert len(result["arms"][spec]["per_seed"]) == 2
        assert f"{spec}-grpo" in result["paired"] or spec == "grpo"
        assert (
            "real" in result["localisation"]["arms"][spec]
            or result["localisation"]["failures"] == 0
        )

"""The teacher skip: rows with a zero sequence advantage get no teacher, contrast, influence or
signal pass, and the token advantages are bit-identical with the skip on and off (every
registered method, loss types, micro-batch sizes, multi-turn masks in the credit core).

Bit-identical needs forwards whose per-row numerics do not depend on the other rows of the
pass: the plain forward's (`prefix_sharing=False`). With prefix sharing the cached completion
pass's attention kernel varies with the number of rows in float rounding (~5e-7 here, as when
the micro-batch size changes), so there the test asks for agreement to that rounding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _trl_helpers import byte_tokenizer, dataset, make_trainer, method_options
from gear.credit import METHODS, CreditParams, credit_details
from gear.testing import tied_reward

SIGNAL_NAMES = (
    "kl", "entropy", "student_logprobs", "teacher_logprobs", "contrast_kl", "influence",
    "perturbation",
)  # fmt: skip
COUNTS = ("gear/rows_skipped", "gear/fallback_rows")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _batch(trainer, n_prompts: int = 4) -> list[dict]:
    data = dataset(n_prompts)
    return [dict(row) for row in data for _ in range(trainer.args.num_generations)]


def _advantages(trainer, inputs, skip: bool) -> tuple[torch.Tensor, dict]:
    trainer.args.skip_zero_advantage_rows = skip
    trainer.model.train()
    trainer._metrics["train"].clear()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return out["advantages"], metrics


def _skip_is_exact(trainer, inputs) -> dict:
    on, metrics = _advantages(trainer, inputs, skip=True)
    off, metrics_off = _advantages(trainer, inputs, skip=False)
    assert on.shape == off.shape and on.dim() == 2
    assert torch.equal(on, off)  # bit-identical
    assert metrics_off["gear/rows_skipped"] == 0.0
    return metrics


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"grpo"}))
def test_token_advantages_are_bit_identical_with_the_skip_on_and_off(tmp_path, tok, method):
    trainer = make_trainer(
        tmp_path, tok, **method_options(method), reward_funcs=tied_reward(0.5),
        per_device_train_batch_size=8, num_generations=2, prefix_sharing=False,
    )  # fmt: skip
    inputs = _batch(trainer)
    metrics = _skip_is_exact(trainer, inputs)
    tied = int(metrics["gear/rows_skipped"])
    if CreditParams(method=method).signal_rows == "advantaged":
        assert tied >= 2  # tied_reward(0.5) ties some of the 4 groups (2 rows each)
    else:  # entropy_top ranks every row of the batch: nothing skipped
        assert tied == 0


@pytest.mark.parametrize(
    ("loss_type", "micro_batch", "extra"),
    [
        ("grpo", 2, {}),
        ("dapo", 4, {"teacher_context": "contrast"}),
        ("dr_grpo", 8, {"credit_method": "rlsd"}),
        ("bnpo", 2, {"credit_success_floor": 0.5}),
    ],
)
def test_skip_is_exact_across_loss_types_micro_batches_and_contexts(
    tmp_path, tok, loss_type, micro_batch, extra
):
    trainer = make_trainer(
        tmp_path, tok, reward_funcs=tied_reward(0.5), loss_type=loss_type,
        per_device_train_batch_size=micro_batch, steps_per_generation=8 // micro_batch,
        num_generations=2, prefix_sharing=False, **extra,
    )  # fmt: skip
    _skip_is_exact(trainer, _batch(trainer))


def test_with_prefix_sharing_the_skip_agrees_to_float_rounding(tmp_path, tok):
    """gear_token's weights are continuous in the KL, so rounding stays rounding."""
    trainer = make_trainer(
        tmp_path, tok, credit_method="gear_token", reward_funcs=tied_reward(0.5),
        per_device_train_batch_size=8, num_generations=2,
    )  # fmt: skip
    inputs = _batch(trainer)
    on, metrics = _advantages(trainer, inputs, skip=True)
    off, _ = _advantages(trainer, inputs, skip=False)
    assert metrics["gear/rows_skipped"] > 0
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


def test_tied_rows_get_no_teacher_pass_and_are_marked_in_the_record(tmp_path, tok):
    trainer = make_trainer(
        tmp_path, tok, reward_funcs=tied_reward(1.0), per_device_train_batch_size=8,
        num_generations=2, credit_log_rows=8,
    )  # fmt: skip
    calls = []
    real = trainer._teacher_pass
    trainer._teacher_pass = lambda ids, *a, **k: calls.append(ids.shape[0]) or real(ids, *a, **k)
    _, metrics = _advantages(trainer, _batch(trainer), skip=True)
    assert calls == []  # every group tied: no teacher pass at all
    assert metrics["gear/rows_skipped"] == 8.0
    # nothing was measured: NaN (TRL logs None), never a KL of 0
    assert math.isnan(metrics["gear/kl_mean"]) and math.isnan(metrics["gear/entropy_mean"])
    assert math.isnan(metrics["gear/onsets_per_row"])
    trainer.log({})
    assert trainer.state.log_history[-1]["gear/kl_mean"] is None
    records = [
        json.loads(line) for line in Path(tmp_path, "credit").glob("*.jsonl").__next__().open()
    ]
    assert records and all(r["skipped"] and r["kl"][0] is None for r in records)
    assert all(w == 1.0 for r in records for w, v in zip(r["weight"], r["valid"], strict=True) if v)


def test_teacher_pass_runs_on_the_advantaged_rows_only(tmp_path, tok):
    trainer = make_trainer(
        tmp_path, tok, reward_funcs=tied_reward(0.5), per_device_train_batch_size=8,
        num_generations=2,
    )  # fmt: skip
    calls = []
    real = trainer._teacher_pass
    trainer._teacher_pass = lambda ids, *a, **k: calls.append(ids.shape[0]) or real(ids, *a, **k)
    _, metrics = _advantages(trainer, _batch(trainer), skip=True)
    assert calls == [8 - int(metrics["gear/rows_skipped"])]
    assert 0 < metrics["gear/rows_skipped"] < 8


# --------------------------------------------------------------------------- the credit core


@st.composite
def _credit_batch(draw):
    n, t = draw(st.integers(2, 6)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    valid = torch.arange(t)[None] < lengths[:, None]
    turn_starts = valid & (torch.rand(n, t, generator=g) < 0.2) if draw(st.booleans()) else None
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[torch.rand(n, generator=g) < 0.4] = 0.0
    signals = {k: torch.rand(n, t, generator=g, dtype=torch.float64) * 3 for k in SIGNAL_NAMES}
    signals["student_logprobs"] = -signals["student_logprobs"]
    signals["teacher_logprobs"] = -signals["teacher_logprobs"]
    signals["error_mask"] = torch.rand(n, t, generator=g) < 0.3  # first_error's (a bool mask)
    signals["prefix_count"] = torch.randint(1, n + 1, (n, t), generator=g).double()  # lambda_grpo
    return advantages, valid, turn_starts, signals, g


@settings(max_examples=3, deadline=None)
@given(batch=_credit_batch())
def test_the_skip_batch_carries_every_signal_a_method_reads(batch):
    """The property below samples every method: a signal missing from its batch fails only when
    hypothesis happens to draw that method (CI once drew `lambda_grpo` without `prefix_count`)."""
    signals = batch[3]
    missing = {m: set(METHODS[m].requires) - set(signals) for m in METHODS}
    assert not any(missing.values()), missing


@settings(max_examples=30, deadline=None)
@given(
    batch=_credit_batch(), method=st.sampled_from(sorted(METHODS)), floor=st.sampled_from([0, 0.5])
)
def test_core_skip_is_exact_with_masks_and_turns(batch, method, floor):
    """Unscored rows' signals may hold anything (here: garbage, NaN): with advantage 0 the
    token advantages equal those computed with every row's true signals."""
    advantages, valid, turn_starts, signals, _ = batch
    params = CreditParams(method=method, success_floor=floor)
    if params.signal_rows != "advantaged":
        return
    full = credit_details(advantages, valid, turn_starts=turn_starts, params=params, **signals)
    scored = advantages != 0
    garbage = {
        k: v if v.dtype == torch.bool else torch.where(scored[:, None], v, torch.nan)
        for k, v in signals.items()
    }
    part = credit_details(
        advantages, valid, turn_starts=turn_starts, params=params, scored=scored, **garbage
    )
    assert torch.equal(full.token_advantages, part.token_advantages)
    assert part.stats["gear/rows_skipped"] == float((~scored).sum())
    assert part.stats["gear/fallback_rows"] == 0.0
    measured = bool((valid & scored[:, None]).any())  # else every statistic but a count is NaN
    assert all(math.isfinite(v) == measured for k, v in part.stats.items() if k not in COUNTS)


def test_a_batch_with_no_scored_token_reports_no_statistic_but_its_counts():
    """Issue 59 item 14: every row tied (or no policy token among the scored rows): no KL was
    measured, so the means are NaN, not 0; a signal the method never computes is NaN too."""
    valid = torch.ones(2, 3, dtype=torch.bool)
    kl = torch.rand(2, 3)
    tied = credit_details(
        torch.zeros(2), valid, kl=kl, entropy=kl, scored=torch.tensor([False, False])
    )
    assert all(math.isnan(v) for k, v in tied.stats.items() if k not in COUNTS), tied.stats
    assert (tied.stats["gear/rows_skipped"], tied.stats["gear/fallback_rows"]) == (2.0, 0.0)
    one = credit_details(torch.tensor([1.0, 0.0]), valid, kl=kl, entropy=kl,
                         scored=torch.tensor([True, False]))  # fmt: skip
    assert one.stats["gear/kl_mean"] == pytest.approx(float(kl[0].mean()))
    no_kl = credit_details(torch.tensor([1.0, -1.0]), valid, params=CreditParams(method="grpo"))
    assert math.isnan(no_kl.stats["gear/kl_mean"]) and no_kl.stats["gear/mass_error"] == 0.0


def test_core_refuses_an_unscored_row_that_carries_advantage():
    valid = torch.ones(2, 3, dtype=torch.bool)
    kl = torch.rand(2, 3)
    with pytest.raises(ValueError, match="non-zero advantage was left unscored"):
        credit_details(torch.tensor([1.0, 0.0]), valid, kl=kl, entropy=kl,
                       scored=torch.tensor([False, True]))  # fmt: skip
    with pytest.raises(ValueError, match="reads every row"):
        credit_details(torch.tensor([1.0, 0.0]), valid, entropy=kl,
                       params=CreditParams(method="entropy_top"),
                       scored=torch.tensor([True, False]))  # fmt: skip


class _TwoProcesses:
    """An accelerator of 2 processes whose other process scores `other` rows."""

    num_processes = 2

    def __init__(self, other: int):
        self.other = other

    def gather(self, t):
        return torch.cat([t, torch.tensor([self.other])])


def test_every_process_scores_as_many_rows_as_the_busiest():
    """A forward is collective under DDP's buffer sync, ZeRO-3 and FSDP: a process with fewer
    advantaged rows fills up with tied ones, in order, so every process runs the same passes."""
    from gear.integrations.trl.credit import scored_rows

    adv = torch.tensor([0.0, 0.5, 0.0, 0.0, -0.5, 0.0])
    params = CreditParams()
    assert scored_rows(adv, params, True).tolist() == [False, True, False, False, True, False]
    filled = scored_rows(adv, params, True, _TwoProcesses(other=4))
    assert filled.tolist() == [True, True, True, False, True, False]  # 4 rows: 2 tied added
    assert scored_rows(adv, params, True, _TwoProcesses(other=1)).sum() == 2  # already busiest
    assert scored_rows(torch.zeros(6), params, True, _TwoProcesses(other=0)).sum() == 0
    assert scored_rows(adv, params, False, _TwoProcesses(other=4)) is None
    assert scored_rows(adv, CreditParams(method="entropy_top"), True) is None


def _record(step, row, advantage, valid_len, onset_at=None, skipped=False):
    n = 8
    rec = {
        "step": step, "row": row, "advantage": advantage, "valid": [i < valid_len for i in range(n)],
        "onset": [i == onset_at for i in range(n)],
    }  # fmt: skip
    if skipped:
        rec["skipped"] = True
    return rec


def test_the_trajectory_shows_a_row_where_credit_acts():
    """Issue 50 item 5: not the last record (a tied or unscored row shows weight 1 and nothing
    else) but a failed row with an onset, of typical length, from the latest step with one."""
    from gear.viz.record import trajectory_row

    records = [
        _record(10, 0, -1.0, 5, onset_at=2),  # an older step
        _record(12, 0, -0.5, 2, onset_at=1),  # failed with an onset, short
        _record(12, 1, -0.5, 6, onset_at=3),  # failed with an onset, typical: this one
        _record(12, 2, 0.5, 6, onset_at=2),  # succeeded
        _record(12, 3, 0.0, 6, skipped=True),  # tied, unscored (the old pick: records[-1])
    ]
    pick, why = trajectory_row(records)
    assert (pick["step"], pick["row"]) == (12, 1) and "failed row with a KL onset" in why
    only_tied = [_record(3, 0, 0.0, 4, skipped=True), _record(3, 1, 0.0, 4, skipped=True)]
    pick, why = trajectory_row(only_tied)
    assert pick is only_tied[-1] and "no recorded row" in why
    no_onset = [_record(5, 0, 0.7, 3), _record(5, 1, -0.7, 4)]
    assert trajectory_row(no_onset)[0]["row"] in (0, 1)


def test_the_credit_record_keeps_rows_where_credit_acts():
    from gear.credit import credit_details
    from gear.integrations.trl.records import record_rows

    valid = torch.arange(6)[None] < torch.tensor([[6], [1], [4], [5], [6], [2]])
    adv = torch.tensor([0.0, 0.8, -0.8, 0.8, 0.0, -0.8])
    kl = torch.rand(6, 6)
    details = credit_details(adv, valid, kl=kl, entropy=kl, scored=adv != 0)
    # acting rows 1, 2, 3, 5 (lengths 1, 4, 5, 2; median 4): 2 and 3 are the typical ones
    assert record_rows(details, adv, 2) == [2, 3]
    assert record_rows(details, adv, 5) == [0, 1, 2, 3, 5]  # then a tied row (0: nearest 4)

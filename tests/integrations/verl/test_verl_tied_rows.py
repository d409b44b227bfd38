"""No teacher work on tied rows in GEAR's verl trainer (`skip_zero_advantage_rows`): the rows
with a sequence advantage of 0 get no teacher prompt and no forward, and the advantages
are those of scoring every row.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import json

import pytest
import torch

from _verl_helpers import (
    FakeActorWorkerGroup,
    FakeTQ,
    Tok,
    fake_render,
    random_rows,
    tiny_llama,
    tq_row,
    verl_cfg,
    verl_like_batch,
    verl_old_log_prob,
)
from gear.integrations.verl.config import GearConfigError, validate_verl_config
from gear.integrations.verl.estimators import ESTIMATOR_FNS, SIGNAL_FIELDS, register_estimators

tiny_lm = pytest.fixture(scope="module", name="tiny_lm")(tiny_llama)  # one per module

#: 3 prompts, interleaved (so that the teacher forwards group other rows with the skip on than
#: off): uidA mixed (a session of two outputs, tool tokens), uidB tied at 1 (a session of two
#: outputs whose first, non-final output scored 0.3: only final outputs enter GRPO), uidC tied at
#: 0, and one verl padding row; the uidA rows carry advantage, the others do not
SKIP_KEYS = [
    "uidA_0_0", "uidB_0_0", "uidC_0_0", "uidA_1_0", "uidB_1_0", "uidA_1_1",
    "uidC_1_0", "uidB_1_1", "uidA_2_0", "uidB_2_0", "uidC_2_0", "padX_0_0",
]  # fmt: skip


SKIP_SCORES = [1.0, 1.0, 0.0, 0.0, 0.3, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]


SKIP_SCORED = [k.startswith("uidA") for k in SKIP_KEYS]


def run_with_skip(
    monkeypatch, model, run_dir, estimator, skip, bypass=False, context=None, teacher_rows=1
):
    """GEAR's trainer (fake TransferQueue, the real worker on 2 'ranks') on the SKIP_KEYS rows,
    `teacher_rows` rows per teacher forward. Returns the per-row advantages, the metrics, the
    stored rows, the row counts of every teacher forward and of every student forward of GEAR's
    own, and the credit record."""
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import teacher_pass
    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    forwards: dict[str, list[int]] = {"teacher": [], "student": []}
    for name, who in (("teacher_signals", "teacher"), ("forward_hidden", "student")):
        real = getattr(teacher_pass, name)
        real = getattr(real, "__wrapped__", real)  # an earlier run's counter

        def counted(module, seqs, *a, _real=real, _who=who, **k):
            forwards[_who].append(len(seqs))
            return _real(module, seqs, *a, **k)

        counted.__wrapped__ = real
        monkeypatch.setattr(teacher_pass, name, counted)
    register_estimators()
    n = len(SKIP_KEYS)
    _, _, responses = random_rows(7, n=n)
    responses[3] = responses[3] + [7, 8, 9, 10]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[3][1:3] = 0  # tool output
    raw = [[{"role": "user", "content": f"question {k[3]}"}] for k in SKIP_KEYS]
    prompts = [fake_render(m, None) for m in raw]
    rows = [
        tq_row(
            k.split("_")[0], prompts[i], responses[i], masks[i], SKIP_SCORES[i], raw[i],
            str(10 + ord(k[3]) % 7),
        )
        for i, k in enumerate(SKIP_KEYS)
    ]  # fmt: skip
    tq.kv_batch_put(keys=SKIP_KEYS, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    tags = [{}] * (n - 1) + [{"is_padding": True}]
    batch = KVBatchMeta(keys=list(SKIP_KEYS), tags=tags, partition_id="train", extra_info={})
    overrides = {
        "algorithm.adv_estimator": estimator,
        "gear.skip_zero_advantage_rows": skip,
        "gear.signal_chunk_size": 5,
        "gear.teacher_micro_batch_size_per_gpu": teacher_rows,
        "gear.credit_log_steps": 1,
        "gear.credit_log_rows": n,
        "gear.credit_log_dir": str(run_dir),
    }
    if context:
        overrides["gear.teacher_context"] = context
    config = OmegaConf.create({**verl_cfg(**overrides), "data": {"apply_chat_template_kwargs": {}}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    if bypass:
        config.algorithm.rollout_correction = {"bypass_mode": True}
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render, trainer._gear_tool_schemas = fake_render, {}
    trainer._gear_next_record_step, trainer._gear_answer_pool = 0, []
    trainer.global_steps, trainer.tokenizer, trainer.processor = 2, Tok(), None
    trainer.actor_rollout_wg = FakeActorWorkerGroup(tq, model)
    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    trainer._compute_advantage(batch, metrics)
    adv = list(tq.kv_batch_get(SKIP_KEYS, "train", ["advantages"])["advantages"].unbind())
    record = run_dir / "credit" / "step_000002.jsonl"
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return adv, metrics, tq.rows, forwards, lines


@pytest.mark.parametrize(
    ("estimator", "bypass", "context"),
    [
        ("gear", False, None),
        ("gear_token", False, None),
        ("gear_rlsd", False, None),
        ("gear_departure", True, None),
        ("gear_turn", False, "contrast"),
    ],
)
def test_tied_rows_get_no_teacher_work_and_the_advantages_are_bit_identical(
    monkeypatch, tiny_lm, tmp_path, estimator, bypass, context
):
    """gear.skip_zero_advantage_rows: rows whose GRPO sequence advantage is 0 (tied groups, a
    session of a tied group, verl's padding row), decided before the old-log-prob pass from
    verl's rewards and uids, get no teacher or contrast forward (nor GEAR's own student forward
    in bypass mode) and zero signals; the token advantages equal the unskipped run's bit for
    bit; gear/rows_skipped counts the batch's skipped rows; the credit record marks them.

    Bit for bit needs a row's signals not to depend on the rows it shares a teacher forward and
    a kernel chunk with: one row per teacher forward here. With several, the skip changes the
    company, which moves the signals by float rounding, as changing
    gear.teacher_micro_batch_size_per_gpu does (next test)."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    on = run_with_skip(monkeypatch, tiny_lm, tmp_path / "on", estimator, True, bypass, context)
    off = run_with_skip(monkeypatch, tiny_lm, tmp_path / "off", estimator, False, bypass, context)
    adv_on, metrics_on, stored_on, forwards_on, record_on = on
    adv_off, metrics_off, stored_off, forwards_off, record_off = off
    for a, b in zip(adv_on, adv_off, strict=True):
        assert torch.equal(a, b)  # bit-identical
    assert all(bool(a.ne(0).any()) == s for a, s in zip(adv_on, SKIP_SCORED, strict=True))
    assert [bool(stored_on[k]["gear_scored"]) for k in SKIP_KEYS] == SKIP_SCORED
    assert "gear_scored" not in stored_off[SKIP_KEYS[0]]
    assert metrics_on["gear/rows_skipped"] == 7.0 and metrics_off["gear/rows_skipped"] == 0.0
    # teacher forwards: the 4 advantaged rows only, one per forward
    passes = 2 if context == "contrast" else 1
    assert forwards_on["teacher"] == [1] * 4 * passes
    assert forwards_off["teacher"] == [1] * len(SKIP_KEYS) * passes
    assert sum(forwards_on["student"]) == (4 if bypass else 0)
    for k, s in zip(SKIP_KEYS, SKIP_SCORED, strict=True):  # zero signals, no work
        assert "gear_teacher_prompts" in stored_on[k]  # built for every row
        for field in SIGNAL_FIELDS.values():
            assert bool(stored_on[k][field].eq(0).all()) != s
    assert [r.get("skipped", False) for r in record_on] == [not s for s in SKIP_SCORED[:-1]]
    assert all(r["kl"][0] is None for r in record_on if r.get("skipped"))
    assert not any(r.get("skipped") for r in record_off)
    for a, b in zip(record_on, record_off, strict=True):
        assert a["token_advantage"] == b["token_advantage"]


def test_with_several_rows_per_teacher_forward_the_skip_agrees_to_float_rounding(
    monkeypatch, tiny_lm, tmp_path
):
    """Groups of 2 rows per teacher forward: the skip regroups the advantaged rows (fewer
    forwards), which moves their signals by float rounding; gear_token's weights are continuous
    in the KL, so the advantages agree to that rounding."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    on = run_with_skip(monkeypatch, tiny_lm, tmp_path / "on", "gear_token", True, teacher_rows=2)
    off = run_with_skip(monkeypatch, tiny_lm, tmp_path / "off", "gear_token", False, teacher_rows=2)
    assert sum(on[3]["teacher"]) == 4 and sum(off[3]["teacher"]) == len(SKIP_KEYS)
    assert len(on[3]["teacher"]) < len(off[3]["teacher"])
    for a, b in zip(on[0], off[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_skip_is_off_where_a_method_reads_every_row_or_the_reward_changes_later(
    monkeypatch, tiny_lm, tmp_path
):
    """gear_entropy_top ranks every row of the batch, and with algorithm.use_kl_in_reward the
    reward (hence the ties) is known only after the pass: both score every row."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    _, metrics, stored, _, _ = run_with_skip(
        monkeypatch, tiny_lm, tmp_path, "gear_entropy_top", True
    )
    assert "gear_scored" not in stored[SKIP_KEYS[0]] and metrics["gear/rows_skipped"] == 0.0
    assert all(bool(stored[k]["gear_entropy"].ne(0).any()) for k in SKIP_KEYS)
    cfg = verl_cfg(**{"algorithm.use_kl_in_reward": True})
    assert validate_verl_config(verl_cfg()).skips_tied_rows
    assert not validate_verl_config(cfg).skips_tied_rows
    off = verl_cfg(**{"gear.skip_zero_advantage_rows": False})
    assert not validate_verl_config(off).skips_tied_rows
    with pytest.raises(GearConfigError, match=r"gear\.skip_zero_advantage_rows.*true or false"):
        validate_verl_config(verl_cfg(**{"gear.skip_zero_advantage_rows": "yes"}))


def test_the_estimator_refuses_a_skipped_row_that_carries_advantage():
    """If the rewards changed after the tie decision, the estimator says so instead of leaving
    a row with advantage unscored."""
    rewards, mask, uids, signals = verl_like_batch(0)
    scored = torch.ones(rewards.shape[0], dtype=torch.bool)
    scored[0] = False
    with pytest.raises(ValueError, match=r"gear_scored: .* gear\.skip_zero_advantage_rows=false"):
        ESTIMATOR_FNS["gear"](
            token_level_rewards=rewards, response_mask=mask, index=uids, gear_scored=scored,
            **signals,
        )  # fmt: skip

"""GEAR's v1 trainer on verl, on CPU: an in-memory TransferQueue (or the real one, with
GEAR_TEST_RAY=1) and the real `GearActorRolloutRefWorker` over verl's CPU inference path on
2 "ranks" (`_verl_helpers`), against a full-logits oracle; the contrast teacher; a method
without a teacher. The teacher pass itself: tests/integrations/verl/test_verl_worker.py.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _verl_helpers import (
    BridgedActorWorkerGroup,
    FakeActorWorkerGroup,
    FakeTQ,
    Tok,
    compose,
    expected_token_advantages,
    fake_render,
    random_rows,
    reference_signals,
    tiny_llama,
    tq_row,
    verl_cfg,
    verl_old_log_prob,
)
from gear.credit import CreditParams, token_advantages
from gear.integrations.verl.config import (
    VERL_ESTIMATORS,
    GearConfigError,
    answer_values,
    validate_verl_config,
)
from gear.integrations.verl.estimators import SIGNAL_FIELDS, grpo_advantages, register_estimators
from gear.integrations.verl.teacher_inputs import build_teacher_prompts

tiny_lm = pytest.fixture(scope="module", name="tiny_lm")(tiny_llama)  # one per module


def run_trainer_plumbing(tq, worker_group, model, monkeypatch, run_dir, partition="train"):
    """GEAR's trainer steps on 7 rows: 2 prompts x 3 sessions and one verl padding row.

    Row 1 is multi-turn (a tool observation, response_mask 0), row 4 has no ground truth (the
    teacher is the student). Checks the teacher prompts, the signals against an unpadded
    single-row forward, and the advantages against gear.credit on the same signals, where row 4
    has no teacher (spec §4): weight 1, its sequence advantage on every token, counted as the one
    fallback row (the padding row is not)."""
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import trainer as gear_trainer

    register_estimators()
    _, _, responses = random_rows(3, n=7)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)] + ["pad0_0_0"]
    uids = [k.split("_")[0] for k in keys]
    responses[1] = responses[1] + [7, 8, 9, 10, 11]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[1][2:4] = 0
    masks[-1] = torch.zeros(len(responses[-1]), dtype=torch.long)
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    raw = [[{"role": "user", "content": f"question {i}"}] for i in range(7)]
    student_prompts = [fake_render(m, None) for m in raw]
    rows = [
        tq_row(
            uids[i], student_prompts[i], responses[i], masks[i], scores[i], raw[i],
            None if i == 4 else f"answer {i}",
        )
        for i in range(7)
    ]  # fmt: skip
    tags = [{"status": "success"}] * 7
    tq.kv_batch_put(
        keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(rows), tags=tags
    )
    batch = KVBatchMeta(
        keys=keys, tags=[{}] * 6 + [{"is_padding": True}], partition_id=partition, extra_info={}
    )

    overrides = {
        "gear.teacher_micro_batch_size_per_gpu": 2,
        "gear.signal_chunk_size": 5,
        "gear.credit_log_steps": 1,
        "gear.credit_log_dir": str(run_dir),
    }
    config = OmegaConf.create({**verl_cfg(**overrides), "data": {"apply_chat_template_kwargs": {}}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render = fake_render
    trainer._gear_tool_schemas = {}
    trainer._gear_next_record_step = 0
    trainer.global_steps = 3
    trainer.tokenizer = Tok()
    trainer.processor = None
    trainer.actor_rollout_wg = worker_group
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)

    metrics: dict = {}
    assert trainer._compute_old_log_prob(batch, metrics) is batch  # verl's pass, then GEAR's
    assert worker_group.calls == 1
    assert metrics["gear/rows_without_ground_truth"] == 1.0

    names = ["gear_teacher_prompts", "gear_has_hint", "gear_scored", *SIGNAL_FIELDS.values()]
    got = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=names)
    # verl's padding row (reward 0, a group of its own: advantage 0) gets no teacher pass
    assert got["gear_scored"].tolist() == [True] * 6 + [False]
    cfg = trainer.gear_settings.gear
    for i in range(7):
        teacher_prompt = (
            student_prompts[i]
            if i == 6
            else build_teacher_prompts([rows[i]], [student_prompts[i]], cfg, fake_render).ids[0]
        )
        assert got["gear_teacher_prompts"][i].tolist() == teacher_prompt
        ref = reference_signals(model, student_prompts[i], teacher_prompt, responses[i], 0.8)
        for name, field in SIGNAL_FIELDS.items():
            want = getattr(ref, name)[0] * (i != 6)  # zeros for the skipped row
            torch.testing.assert_close(got[field][i], want, rtol=1e-4, atol=1e-5)
    assert float(got["gear_kl"][4].abs().max()) < 1e-5  # no hint: teacher = student
    assert got["gear_has_hint"].tolist() == [True] * 4 + [False, True, False]

    metrics = {}
    trainer._compute_advantage(batch, metrics)
    assert 0 <= metrics["gear/frac_tokens_in_segments"] <= 1 and "gear/mass_error" in metrics
    assert metrics["gear/rows_skipped"] == 0.0  # the padding row is not the batch's

    width = max(len(r) for r in responses)

    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r.float(), (0, width - len(r))) for r in rows])

    sig = {f: pad(list(got[f].unbind())) for f in SIGNAL_FIELDS.values()}
    for f in ("gear_kl", "gear_teacher_logprobs"):  # row 4 has no teacher: gear.credit's fallback
        sig[f][4] = torch.nan
    rewards = pad([r["rm_scores"] for r in rows])
    want = expected_token_advantages(rewards, pad(masks).long(), uids, sig, "gear")
    seq = grpo_advantages(rewards.sum(-1), uids)
    assert metrics["gear/fallback_rows"] == 1.0
    adv = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=["advantages"])[
        "advantages"
    ]
    for i in range(7):
        torch.testing.assert_close(adv[i], want[i, : len(responses[i])])
    assert bool((adv[1][masks[1] == 0] == 0).all())  # tool observation tokens: no credit
    assert bool((adv[6] == 0).all())  # verl's padding row
    torch.testing.assert_close(adv[4], seq[4].expand(len(responses[4])))  # weight 1 (GRPO)
    record = run_dir / "credit" / "step_000003.jsonl"
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["row"] for r in lines] == [0, 1, 2, 3] and lines[1]["valid"][2:4] == [False, False]
    return trainer


def test_trainer_plumbing_with_a_fake_worker(monkeypatch, tiny_lm, tmp_path):
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from verl.trainer.ppo.v1 import trainer_base

    from gear.integrations.verl import trainer as gear_trainer
    from gear.integrations.verl.worker import GearActorRolloutRefWorker

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer = run_trainer_plumbing(
        tq, FakeActorWorkerGroup(tq, tiny_lm), tiny_lm, monkeypatch, tmp_path
    )

    # the actor role runs GEAR's worker
    trainer.config = compose("qwen3_4b_gsm8k")
    trainer._init_resource_pool_mgr()
    actors = [
        getattr(c, "__ray_actor_class__", c)
        for r, c in trainer.role_worker_mapping.items()
        if "actor" in str(r).lower()
    ]
    assert actors == [GearActorRolloutRefWorker]


def test_contrast_runs_a_second_teacher_shown_a_wrong_answer(monkeypatch, tiny_lm):
    """teacher_context: contrast through GEAR's trainer and the real worker (fake TransferQueue):
    each row's contrast prompt shows a wrong answer (the numeric default: the answer plus a
    nonzero offset) in the answer template, its KL equals an unpadded oracle's, and the
    advantages are gear.credit's with `contrast_kl`."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    register_estimators()
    _, _, responses = random_rows(5, n=6)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)]
    uids = [k.split("_")[0] for k in keys]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    raw = [[{"role": "user", "content": f"question {i // 3}"}] for i in range(6)]
    student = [fake_render(m, None) for m in raw]
    answers = [str(10 + i // 3) for i in range(6)]
    rows = [
        tq_row(uids[i], student[i], responses[i], masks[i], scores[i], raw[i], answers[i])
        for i in range(6)
    ]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    batch = KVBatchMeta(keys=keys, tags=[{}] * 6, partition_id="train", extra_info={})
    config = OmegaConf.create(
        {
            **verl_cfg(**{"gear.teacher_context": "contrast", "gear.signal_chunk_size": 5}),
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render, trainer._gear_tool_schemas = fake_render, {}
    trainer._gear_next_record_step, trainer._gear_answer_pool = 0, []
    trainer.global_steps, trainer.tokenizer, trainer.processor = 1, Tok(), None
    trainer.actor_rollout_wg = FakeActorWorkerGroup(tq, tiny_lm)
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    trainer._compute_old_log_prob(batch, {})
    assert trainer.actor_rollout_wg.asked[0][2]["gear_contrast"] is True

    names = ["gear_teacher_prompts", "gear_contrast_prompts", "gear_contrast_kl", "gear_kl"]
    got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=names)

    def hinted(i, answer):
        hint = f"The final answer is {answer}."
        return fake_render([{"role": "user", "content": f"{raw[i][0]['content']}\n\n{hint}"}], None)

    for i in range(6):
        assert got["gear_teacher_prompts"][i].tolist() == hinted(i, answers[i])
        shown = [
            int(answers[i]) + d
            for d in (-3, -2, -1, 1, 2, 3)
            if hinted(i, int(answers[i]) + d) == got["gear_contrast_prompts"][i].tolist()
        ]
        assert len(shown) == 1  # a wrong answer, in the same template
        ref = reference_signals(tiny_lm, student[i], hinted(i, shown[0]), responses[i], 0.8)
        torch.testing.assert_close(got["gear_contrast_kl"][i], ref.kl[0], rtol=1e-4, atol=1e-5)

    metrics = {}
    trainer._compute_advantage(batch, metrics)
    width = max(len(r) for r in responses)

    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r.float(), (0, width - len(r))) for r in rows])

    fields = [*SIGNAL_FIELDS.values(), "gear_contrast_kl"]
    sig = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=fields)
    sig = {f: pad(list(sig[f].unbind())) for f in fields}
    rewards = pad([r["rm_scores"] for r in rows])
    want = token_advantages(
        grpo_advantages(rewards.sum(-1), uids),
        pad(masks).bool(),
        kl=sig["gear_kl"],
        entropy=sig["gear_entropy"],
        contrast_kl=sig["gear_contrast_kl"],
        params=CreditParams(contrast=True),
    )
    adv = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])
    for i in range(6):
        torch.testing.assert_close(adv["advantages"][i], want[i, : len(responses[i])])
    plain = token_advantages(
        grpo_advantages(rewards.sum(-1), uids),
        pad(masks).bool(),
        kl=sig["gear_kl"],
        entropy=sig["gear_entropy"],
        params=CreditParams(),
    )
    assert not torch.allclose(want, plain)  # the contrast changed the credit


def test_contrast_without_any_wrong_answer_in_the_training_files_fails_before_start(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    table = [{"prompt": "q", "reward_model": {"ground_truth": a}} for a in ("4", "seven", "8")]
    pq.write_table(pa.Table.from_pylist(table), path)
    cfg = verl_cfg(**{"data.train_files": str(path), "gear.teacher_context": "contrast"})
    assert answer_values("reward_model.ground_truth", [str(path)]) == ["4", "seven", "8"]
    assert validate_verl_config(cfg).params.contrast  # "seven" is shown "4" or "8"
    pq.write_table(pa.Table.from_pylist(table[1:2] * 3), path)
    with pytest.raises(GearConfigError, match=r"gear\.teacher_context='contrast': no wrong answer"):
        validate_verl_config(cfg)


@pytest.mark.skipif(
    os.environ.get("GEAR_TEST_RAY") != "1",
    reason="starts a local Ray + TransferQueue (~15 s); set GEAR_TEST_RAY=1",
)
def test_trainer_plumbing_with_a_real_transfer_queue(monkeypatch, tiny_lm, tmp_path):
    pytest.importorskip("verl")
    ray = pytest.importorskip("ray")
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        run_trainer_plumbing(tq, BridgedActorWorkerGroup(tiny_lm), tiny_lm, monkeypatch, tmp_path)
    finally:
        tq.close()
        ray.shutdown()


@pytest.mark.parametrize("bypass", [False, True], ids=["fused", "bypass"])
@pytest.mark.parametrize("estimator", ["gear_entropy_top", "gear_grpo"])
def test_a_method_without_a_teacher_builds_no_teacher_prompt_and_runs_no_teacher_forward(
    monkeypatch, tiny_lm, estimator, bypass
):
    """GEAR's trainer on 6 rows that all have a ground truth: for gear_entropy_top (the
    student's entropy alone) and gear_grpo (no signal) no teacher prompt is built or stored and
    no teacher forward runs; entropy_top's worker pass is told so (``gear_teacher=False``, no
    teacher-prompt field in bypass mode) and still writes the student's signals, which equal a
    plain forward's; gear_grpo leaves verl's pass as it is. The advantages are gear.credit's."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import teacher_pass
    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setattr(
        gear_trainer, "build_teacher_prompts", lambda *a, **k: pytest.fail("a teacher prompt")
    )
    monkeypatch.setattr(
        teacher_pass, "teacher_signals", lambda *a, **k: pytest.fail("a teacher forward ran")
    )
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    register_estimators()
    prompts, _, responses = random_rows(4, n=6)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)]
    uids = [k.split("_")[0] for k in keys]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    rows = [
        tq_row(
            uids[i], prompts[i], responses[i], torch.ones(len(responses[i]), dtype=torch.long),
            scores[i], [{"role": "user", "content": f"question {i}"}], f"answer {i}",
        )
        for i in range(6)
    ]  # fmt: skip
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    batch = KVBatchMeta(keys=keys, tags=[{}] * 6, partition_id="train", extra_info={})
    config = OmegaConf.create({**verl_cfg(**{"algorithm.adv_estimator": estimator}), "data": {}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    if bypass:
        config.algorithm.rollout_correction = {"bypass_mode": True}
    config.actor_rollout_ref.rollout.update({"temperature": 0.8, "multi_turn": {}, "agent": {}})
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_next_record_step = 0
    trainer.global_steps = 1
    trainer.tokenizer, trainer.processor = Tok(), None
    trainer.actor_rollout_wg = group = FakeActorWorkerGroup(tq, tiny_lm)

    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    stored = set(tq.rows[keys[0]])
    assert not {"gear_teacher_prompts", "gear_has_hint"} & stored
    assert not {"gear/rows_without_ground_truth", "timing_s/gear_teacher_prompts"} & set(metrics)
    written = {name for name, field in SIGNAL_FIELDS.items() if field in stored}
    if estimator == "gear_grpo":
        assert written == set()
        assert group.asked == [("compute_log_prob", None, {})]  # verl's pass, nothing of GEAR's
    else:
        assert written == {"entropy", "student_logprobs"}
        gear_pass = group.asked[-1]
        assert gear_pass[0] == ("compute_gear_signals" if bypass else "compute_log_prob")
        assert gear_pass[2]["gear_teacher"] is False
        if bypass:
            assert "gear_teacher_prompts" not in gear_pass[1]
        got = tq.kv_batch_get(keys, "train", [SIGNAL_FIELDS[n] for n in written])
        for i in range(6):
            ref = reference_signals(tiny_lm, prompts[i], prompts[i], responses[i], 0.8)
            for name in written:
                torch.testing.assert_close(
                    got[SIGNAL_FIELDS[name]][i], getattr(ref, name)[0], rtol=1e-4, atol=1e-5
                )

    trainer._compute_advantage(batch, metrics)
    width = max(len(r) for r in responses)

    def pad(values):
        return torch.stack(
            [torch.nn.functional.pad(v.float(), (0, width - len(v))) for v in values]
        )

    mask = pad([r["response_mask"] for r in rows]).long()
    signals = {f: torch.zeros(6, width) for f in SIGNAL_FIELDS.values()}  # read by neither method
    for name in written:
        signals[SIGNAL_FIELDS[name]] = pad(list(got[SIGNAL_FIELDS[name]].unbind()))
    method = VERL_ESTIMATORS[estimator]
    want = expected_token_advantages(
        pad([r["rm_scores"] for r in rows]), mask, uids, signals, method
    )
    adv = tq.kv_batch_get(keys, "train", ["advantages"])["advantages"]
    for i in range(6):
        torch.testing.assert_close(adv[i], want[i, : len(responses[i])])

"""The verl integration's config checks (gear.integrations.verl.config), on CPU: what a
method needs of the run, the refusals with their reasons, the defaults file.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import re

import pytest
import yaml

from _verl_helpers import CONFIGS, verl_cfg
from gear.credit import CreditParams
from gear.integrations.verl.config import (
    GearConfigError,
    GearVerlConfig,
    check_ground_truth_field,
    default_gear_section,
    validate_verl_config,
)
from gear.integrations.verl.teacher_inputs import MissingGroundTruthError, get_field


def test_random_shape_needs_what_its_candidate_reads():
    def settings(shape: str):
        over = {
            "algorithm.adv_estimator": "gear_random_shape",
            "gear.credit": {"shape_method": shape},
        }
        return validate_verl_config(verl_cfg(**over))

    assert settings("rlsd").needs_teacher
    entropy = settings("entropy_top")  # the student's entropy alone: no teacher pass
    assert entropy.needs_signals and not entropy.needs_teacher
    with pytest.raises(GearConfigError, match="influence"):
        settings("oar_g")  # verl computes no answer influence yet, for oar_g or its placebo
    with pytest.raises(GearConfigError, match=r"one forward per masked token.*collective"):
        settings("oar_p")  # OAR-P's data-dependent forwards would desynchronise sharded ranks
    with pytest.raises(GearConfigError, match="step checker"):
        settings("first_error")  # nor a step checker's mask
    with pytest.raises(GearConfigError, match=r"lambda_grpo.*response token ids"):
        settings("lambda_grpo")  # nor each row's response ids for the group prefix tree


def test_lambda_grpo_is_refused_with_the_reason():
    with pytest.raises(GearConfigError, match=r"gear_lambda_grpo.*compute_advantage passes only"):
        validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_lambda_grpo"}))


def test_random_methods_draw_anew_each_step():
    pytest.importorskip("verl")
    from gear.integrations.verl import trainer as gear_trainer

    for estimator in ("gear_random", "gear_random_shape"):
        trainer = object.__new__(gear_trainer.GearPPOTrainer)
        over = {"algorithm.adv_estimator": estimator, "gear.credit": {"seed": 3}}
        trainer.gear_settings = validate_verl_config(verl_cfg(**over))
        seeds = set()
        for step in range(3):
            trainer.global_steps = step
            seeds.add(trainer._batch_credit_params().seed)
        assert seeds == {3, 4, 5}, estimator


def test_config_validation_errors(tmp_path):
    s = validate_verl_config(verl_cfg())
    assert (s.estimator, s.method, s.needs_teacher) == ("gear", "gear", True)
    assert (
        validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_turn"})).method == "turn"
    )
    grpo = validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_grpo"}))
    assert not grpo.needs_teacher and not grpo.needs_signals
    entropy = validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_entropy_top"}))
    assert entropy.needs_signals and not entropy.needs_teacher  # the student's entropy alone
    cases = {
        "algorithm.adv_estimator": ("grpo", "algorithm.adv_estimator: expected one of"),
        "trainer.v1.trainer_mode": ("sync", "trainer.v1.trainer_mode: expected 'gear_sync'"),
        "trainer.use_v1": (False, "trainer.use_v1"),
        "actor_rollout_ref.actor.strategy": ("megatron", "actor_rollout_ref.actor.strategy"),
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
            2,
            "ulysses_sequence_parallel_size",
        ),
        "actor_rollout_ref.model.use_fused_kernels": (True, "use_fused_kernels"),
        "actor_rollout_ref.rollout.n": (1, "actor_rollout_ref.rollout.n"),
        "gear.colour": ("red", "gear: unknown key(s) ['colour']"),
        "gear.credit": ({"method": "gear"}, "algorithm.adv_estimator"),
        "gear.kl_estimator": ("exact", "gear.kl_estimator"),
        "gear.hint_kind": ("poem", "gear.hint_kind"),
        "gear.math_hint_template": ("no placeholder", "gear.math_hint_template"),
        "gear.teacher": ("ema", "gear.teacher"),
        "gear.teacher_micro_batch_size_per_gpu": (0, "gear.teacher_micro_batch_size_per_gpu"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(GearConfigError, match=re.escape(message)):
            validate_verl_config(verl_cfg(**{key: value}))
    with pytest.raises(GearConfigError, match=r"gear\.credit: CreditParams\.tau_onset"):
        validate_verl_config(verl_cfg(**{"gear.credit": {"tau_onset": 2.0}}))

    # a missing ground-truth field, found in the parquet schema before anything starts
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "q", "reward_model": {"ground_truth": "4"}}]), path
    )
    check_ground_truth_field("reward_model.ground_truth", [str(path)])
    with pytest.raises(
        GearConfigError, match=r"reward_model in .* has no field 'solution'.*\['ground_truth'\]"
    ):
        validate_verl_config(
            verl_cfg(
                **{
                    "data.train_files": str(path),
                    "gear.ground_truth_field": "reward_model.solution",
                }
            )
        )
    with pytest.raises(
        GearConfigError,
        match=r"has no field 'extra_info'; fields present: \['prompt', 'reward_model'\]",
    ):
        check_ground_truth_field("extra_info.ground_truth", [str(path)])
    # ... and at run time, per row
    with pytest.raises(
        MissingGroundTruthError, match=r"reward_model has no field 'ground_truth'.*\['style'\]"
    ):
        get_field({"reward_model": {"style": "rule"}}, "reward_model.ground_truth")


def test_gear_defaults_yaml_matches_code():
    section = yaml.safe_load((CONFIGS / "gear_defaults.yaml").read_text())["gear"]
    assert section == default_gear_section()
    assert (
        GearVerlConfig(**{**section, "credit": section["credit"]}).credit_params("gear")
        == CreditParams()
    )

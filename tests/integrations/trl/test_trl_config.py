"""GEARConfig: every CreditParams knob is a config field, bad values are refused up front."""

from __future__ import annotations

import dataclasses

import pytest

from _trl_helpers import fast_config
from gear.credit import CreditParams
from gear.credit.params import CONTEXT_FIELDS
from gear.integrations.trl import GEARConfig
from gear.teacher import HINT_TEMPLATES


def test_every_credit_param_is_a_config_field_with_the_same_default(tmp_path):
    config = GEARConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    names = {f.name for f in dataclasses.fields(GEARConfig)}
    for f in dataclasses.fields(CreditParams):
        if f.name in CONTEXT_FIELDS:  # set by teacher_context='contrast'
            assert f"credit_{f.name}" not in names
            continue
        assert f"credit_{f.name}" in names
        assert getattr(config, f"credit_{f.name}") == f.default
    assert config.credit_params == CreditParams()


def test_config_builds_the_credit_params_it_names(tmp_path):
    config = fast_config(
        tmp_path,
        credit_method="fixed",
        credit_fixed_len=3,
        credit_alpha=0.25,
        credit_beta=2.0,
        credit_seed=7,
    )
    assert config.credit_params == CreditParams(
        method="fixed", fixed_len=3, alpha=0.25, beta=2.0, seed=7
    )
    assert config.beta == 0.0  # GRPO's KL coefficient is untouched


def test_config_defaults_follow_the_spec(tmp_path):
    config = fast_config(tmp_path)
    assert (config.teacher, config.ema_decay, config.loss_mode) == ("current", 0.99, "rl")
    assert config.math_hint_template == HINT_TEMPLATES["math"]
    assert config.tool_hint_template == HINT_TEMPLATES["tool"]
    assert config.kl_estimator == "full"
    assert config.ground_truth_column == "ground_truth"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("credit_method", "nope", "credit_method|method"),
        ("credit_tau_onset", 0.0, "tau_onset"),
        ("teacher", "oracle", "teacher"),
        ("ema_decay", 1.0, "ema_decay"),
        ("loss_mode", "sft", "loss_mode"),
        ("kl_estimator", "k2", "kl_estimator"),
        ("hint_kind", "code", "hint_kind"),
        ("math_hint_template", "no placeholder", "math_hint_template"),
        ("teacher_max_prompt_length", 0, "teacher_max_prompt_length"),
        ("signal_chunk_size", 0, "signal_chunk_size"),
        ("credit_log_steps", -1, "credit_log_steps"),
    ],
)
def test_config_refuses_bad_values(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        fast_config(tmp_path, **{field: value})


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("learning_rate", -1.0, "a value >= 0"),
        ("max_steps", -5, "a value >= 1 or -1"),
        ("per_device_train_batch_size", 0, "a value >= 1"),
        ("beta", -1.0, "a value >= 0"),
        ("temperature", 0.0, "a value > 0"),
        ("max_completion_length", 0, "a value >= 1 or null"),
        ("num_generations", 0, "a value >= 2"),  # TRL itself: ZeroDivisionError
        ("loss_type", "nope", "one of 'grpo', 'dr_grpo', 'dapo'"),
    ],
)
def test_config_refuses_values_trl_accepts_naming_field_value_and_range(
    tmp_path, field, value, expected
):
    with pytest.raises(ValueError) as info:
        fast_config(tmp_path, **{field: value})
    assert str(info.value).startswith(f"GEARConfig.{field}: got {value!r}, expected {expected}")


def test_every_declared_check_names_a_field_and_passes_the_defaults(tmp_path):
    from gear.integrations.trl.config import config_checks

    fields = {f.name: f for f in dataclasses.fields(GEARConfig)}
    for name, check in config_checks().items():
        assert name in fields, name
        f = fields[name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert check.ok(default), (name, default)
    assert fast_config(tmp_path, max_steps=-1).max_steps == -1  # HF's "train by epochs"


VLLM_TEACHER = {
    "teacher_engine": "vllm",
    "use_vllm": True,
    "kl_estimator": "k1",
    "temperature": 1.0,
}


def test_the_trainer_scores_the_teacher_by_default_and_vllm_takes_its_settings(tmp_path):
    assert fast_config(tmp_path).teacher_engine == "trainer"
    for estimator in ("k1", "k3", "topk"):
        config = fast_config(tmp_path, **{**VLLM_TEACHER, "kl_estimator": estimator})
        assert config.teacher_engine == "vllm"
    fast_config(tmp_path, **VLLM_TEACHER, vllm_mode="server")


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"use_vllm": False}, "use_vllm=False"),
        ({"teacher": "frozen"}, "teacher='frozen'"),
        ({"teacher": "ema"}, "teacher='ema'"),
        ({"kl_estimator": "full"}, "kl_estimator='full'"),
        ({"loss_mode": "self_distill"}, "loss_mode='self_distill'"),
        ({"temperature": 0.7}, "temperature=0.7"),
        ({"generation_kwargs": {"temperature": 0.5}}, "temperature=0.5"),
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode=True"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2"),
    ],
)
def test_a_vllm_teacher_refuses_what_it_cannot_score_naming_both_settings(tmp_path, setting, named):
    """vLLM scores the current weights, gives top-k log-probs of the raw logits: anything else is
    refused when the config is built, naming teacher_engine and the setting in conflict."""
    with pytest.raises(ValueError) as info:
        fast_config(tmp_path, **{**VLLM_TEACHER, **setting})
    assert str(info.value).startswith(f"GEARConfig.teacher_engine='vllm' with {named}:")
    fast_config(tmp_path, **setting)  # each is fine with the trainer scoring the teacher


def test_teacher_engine_takes_trainer_or_vllm(tmp_path):
    with pytest.raises(ValueError, match="teacher_engine"):
        fast_config(tmp_path, teacher_engine="sglang")

"""The settings TRL and verl share (gear.settings) are declared once: both configs take their
defaults, help and checks from `GEARSettings`, and refuse the same bad value naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from gear.integrations.trl import GEARConfig
from gear.integrations.verl.config import (
    GearConfigError,
    GearVerlConfig,
    default_gear_section,
    validate_verl_config,
)
from gear.settings import GEARSettings

SHARED = {f.name: f for f in dataclasses.fields(GEARSettings)}
# where an integration differs from the schema, on purpose (setting(name, default=/check=))
VERL_DEFAULTS = {"credit_log_steps": 0}  # records only when asked
VERL_CHECKS = {"teacher"}  # the current teacher only

BAD = [
    ("teacher", "oracle"),
    ("teacher_context", "hints"),
    ("answer_hint_template", "The answer is {answer}."),
    ("hint_kind", "code"),
    ("math_hint_template", "no placeholder"),
    ("tool_hint_template", "Reference: {answer}"),
    ("teacher_max_prompt_length", 0),
    ("teacher_max_prompt_length", 8.5),
    ("kl_estimator", "k2"),
    ("kl_topk", 0),
    ("kl_topk", 2.5),
    ("kl_topk", True),
    ("signal_chunk_size", 0),
    ("credit_log_steps", -1),
    ("credit_log_rows", -1),
]


def verl_run(**gear):
    """A verl config for a GEAR run with this `gear:` section."""
    return {
        "algorithm": {"adv_estimator": "gear"},
        "trainer": {"use_v1": True, "v1": {"trainer_mode": "gear_sync"}},
        "actor_rollout_ref": {"rollout": {"n": 4}},
        "gear": gear,
    }


def test_every_shared_setting_has_a_bad_value_below():
    assert {name for name, _ in BAD} == set(SHARED)


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_both_configs_refuse_the_same_bad_value_naming_the_field(tmp_path, name, value):
    with pytest.raises(ValueError) as trl:
        GEARConfig(output_dir=str(tmp_path), use_cpu=True, **{name: value})
    with pytest.raises(GearConfigError) as verl:
        validate_verl_config(verl_run(**{name: value}), check_files=False)
    trl_head, trl_expected = str(trl.value).split(", expected ")
    verl_head, verl_expected = str(verl.value).split(", expected ")
    assert trl_head == f"GEARConfig.{name}: got {value!r}"
    assert verl_head == f"gear.{name}: got {value!r}"
    assert trl_expected == SHARED[name].metadata["check"].describe()
    if name not in VERL_CHECKS:
        assert verl_expected == trl_expected


@pytest.mark.parametrize("config", [GEARConfig, GearVerlConfig], ids=["trl", "verl"])
def test_both_configs_take_every_shared_setting_from_the_schema(config):
    """Same default (except the declared differences), same help, and the schema's own `Check`
    object: a setting declared a second time in a config would bring its own."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    overrides = VERL_DEFAULTS if config is GearVerlConfig else {}
    for name, declared in SHARED.items():
        f = fields[name]
        assert f.default == overrides.get(name, declared.default), name
        assert f.metadata["help"] == declared.metadata["help"], name
        if config is GearVerlConfig and name in VERL_CHECKS:
            continue
        assert f.metadata["check"] is declared.metadata["check"], name


def test_verl_narrows_the_teachers_to_the_current_one(tmp_path):
    schema = SHARED["teacher"].metadata["check"]
    verl = {f.name: f for f in dataclasses.fields(GearVerlConfig)}["teacher"].metadata["check"]
    assert set(verl.choices) < set(schema.choices) and verl.choices == ("current",)
    for teacher in schema.choices:
        assert GEARConfig(output_dir=str(tmp_path), use_cpu=True, teacher=teacher)
    with pytest.raises(GearConfigError, match="TRL integration only"):
        GearVerlConfig(teacher="ema")


def test_both_configs_take_every_context_and_contrast_needs_a_kl_method(tmp_path):
    schema = SHARED["teacher_context"].metadata["check"]
    for context in schema.choices:
        assert GEARConfig(output_dir=str(tmp_path), use_cpu=True, teacher_context=context)
        settings = validate_verl_config(verl_run(teacher_context=context), check_files=False)
        assert settings.params.contrast == (context == "contrast")
    assert GearVerlConfig(teacher_context="answer_only").hint_field == "reward_model.ground_truth"
    refused = verl_run(teacher_context="contrast")
    refused["algorithm"]["adv_estimator"] = "gear_rlsd"
    with pytest.raises(GearConfigError, match=r"gear\.teacher_context.*reads no KL"):
        validate_verl_config(refused, check_files=False)


def test_the_defaults_pass_their_own_checks(tmp_path):
    GEARConfig(output_dir=str(tmp_path), use_cpu=True)
    assert validate_verl_config(verl_run(), check_files=False).gear == GearVerlConfig()
    section = default_gear_section()
    for name, declared in SHARED.items():
        assert declared.metadata["check"].ok(declared.default), name
        assert section[name] == VERL_DEFAULTS.get(name, declared.default), name

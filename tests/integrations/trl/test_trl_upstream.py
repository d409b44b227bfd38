"""A GRPO user swaps two class names and it runs: TRL's own GRPO configurations, re-created
from TRL's `tests/test_grpo_trainer.py` (read, not copied) with offline stand-in models.

For each configuration the same seed trains three times, one step:
- `GRPOTrainer` on a GRPO user's dataset (no ground-truth column);
- `GEARTrainer(credit_method="grpo")` on that same dataset: it must need nothing more and
  reach the *same* parameters as GRPOTrainer (GEAR's token advantages are A_i on every token);
- `GEARTrainer(credit_method="gear")` with a ground-truth column: it trains and logs GEAR's
  statistics.
And TRL's own argument errors reach the user as TRL's messages, before any of GEAR's.

The default selection keeps this module fast; `GEAR_TRL_UPSTREAM=all` runs every case.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from _trl_helpers import byte_tokenizer, fast_kwargs, parameters, tiny_model
from gear.integrations.trl import GEARConfig, GEARTrainer

ALL = os.environ.get("GEAR_TRL_UPSTREAM") == "all"


def spread_reward(completions: list, **kwargs: Any) -> list[float]:
    """Deterministic and almost never equal within a group (so advantages are non-zero)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [int(hashlib.sha256(t.encode()).hexdigest(), 16) % 1000 / 1000.0 for t in texts]


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [min(len(t), 20) / 20.0 for t in texts]


def not_applicable_reward(completions: list, **kwargs: Any) -> list[float | None]:
    return [None] * len(completions)  # TRL: a reward that does not apply to these rows


def _tiny(kind: str, tok: Any) -> Any:
    """A stand-in for TRL's hub test models, built in code (no download)."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, initializer_range=0.2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    if kind == "llama":
        return tiny_model(tok)
    if kind == "gemma2":  # final-logit softcapping, tied head
        config = Gemma2Config(**common, final_logit_softcapping=30.0, tie_word_embeddings=True)
        return Gemma2ForCausalLM(config)
    if kind == "qwen3":  # untied head
        return Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    raise ValueError(kind)


def _dataset(conversational: bool, ground_truth: bool, n: int = 4) -> Dataset:
    """TRL's 'standard_prompt_only' / 'conversational_prompt_only' shapes, in our own words."""
    questions = [f"What is {i} plus {i + 2}?" for i in range(n)]
    data: dict[str, list] = {
        "prompt": [[{"role": "user", "content": q}] for q in questions]
        if conversational
        else [f"{q} The answer is" for q in questions]
    }
    if ground_truth:
        data["ground_truth"] = [f"{i} + {i + 2} = {2 * i + 2}" for i in range(n)]
    return Dataset.from_dict(data)


# name -> (GRPOConfig overrides, options: model, conversational, rewards, eval)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "standard_prompt": ({}, {}),
    "conversational_prompt": ({}, {"conversational": True}),
    "loss_dr_grpo": ({"loss_type": "dr_grpo"}, {}),
    "loss_cispo": ({"loss_type": "cispo"}, {}),
    "loss_sapo": ({"loss_type": "sapo"}, {}),
    "loss_luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {}),
    "loss_bnpo": ({"loss_type": "bnpo"}, {}),
    "loss_dapo": ({"loss_type": "dapo"}, {}),
    "loss_vespo": ({"loss_type": "vespo"}, {}),
    "multiple_iterations": ({"num_iterations": 2}, {}),
    "reference_model_beta": ({"beta": 0.1}, {}),
    "sync_ref_model": ({"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1}, {}),
    "bias_correction_kl": ({"beta": 0.1, "use_bias_correction_kl": True}, {}),
    "pad_to_multiple_of": ({"pad_to_multiple_of": 8}, {}),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.5}, {}),
    "static_entropy_bonus": ({"entropy_coef": 0.1}, {}),
    "entropy_filter": ({"top_entropy_quantile": 0.2}, {}),
    "sampling_settings": (
        {"top_p": 0.9, "top_k": 10, "min_p": 0.01, "repetition_penalty": 1.1},
        {},
    ),
    "generation_kwargs": ({"generation_kwargs": {"top_k": 20, "temperature": 0.8}}, {}),
    "scale_rewards_batch": ({"scale_rewards": "batch"}, {}),
    "scale_rewards_none": ({"scale_rewards": "none"}, {}),
    "mask_truncated_completions": ({"mask_truncated_completions": True, "loss_type": "dapo"}, {}),
    "num_generations_above_batch": (
        {"num_generations": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        {},
    ),
    "delta_clipping": ({"delta": 2.0}, {}),
    "sequence_importance_sampling": ({"importance_sampling_level": "sequence"}, {}),
    "weighted_reward_funcs": (
        {"reward_weights": [0.7, 0.3]},
        {"rewards": [spread_reward, length_reward]},
    ),
    "reward_func_with_none": ({}, {"rewards": [spread_reward, not_applicable_reward]}),
    "chat_template_kwargs": (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"conversational": True},
    ),
    "with_eval": (
        {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4},
        {"eval": True},
    ),
    "cast_lm_head_to_fp32_gemma2": ({"cast_lm_head_to_fp32": True}, {"model": "gemma2"}),
    "cast_lm_head_to_fp32_qwen3": ({"cast_lm_head_to_fp32": True}, {"model": "qwen3"}),
}
DEFAULT = (  # a representative selection: formats, losses, reference model, TRL's own passes
    "standard_prompt", "conversational_prompt", "loss_cispo", "multiple_iterations",
    "reference_model_beta", "pad_to_multiple_of", "entropy_filter", "generation_kwargs",
    "mask_truncated_completions", "num_generations_above_batch", "weighted_reward_funcs",
    "reward_func_with_none", "with_eval", "cast_lm_head_to_fp32_gemma2",
)  # fmt: skip
SELECTED = list(CASES) if ALL else list(DEFAULT)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model_path(tok, tmp_path_factory):
    """kind -> a directory holding the stand-in model, passed by path as TRL's tests pass hub
    ids (TRL builds the reference model of beta > 0 from that path)."""
    paths: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in paths:
            path = tmp_path_factory.mktemp(f"model-{kind}")
            _tiny(kind, tok).save_pretrained(path)
            paths[kind] = str(path)
        return paths[kind]

    return get


def _train(
    tok: Any, model_path: Any, tmp: Any, case: str, trainer_cls: type, config_cls: type,
    **gear: Any,
) -> Any:  # fmt: skip
    overrides, options = CASES[case]
    conversational = options.get("conversational", False)
    with_truth = gear.get("credit_method") == "gear"
    args = config_cls(
        **fast_kwargs(tmp, learning_rate=0.1, **{"gradient_checkpointing": False, **overrides}),
        **gear,
    )
    trainer = trainer_cls(
        model=model_path(options.get("model", "llama")),
        reward_funcs=options.get("rewards", spread_reward),
        args=args,
        train_dataset=_dataset(conversational, with_truth),
        eval_dataset=_dataset(conversational, with_truth, 2) if options.get("eval") else None,
        processing_class=tok,
    )
    trainer.accelerator.free_memory = lambda *objects: list(objects)  # no gc.collect per run
    before = parameters(trainer.model)
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("case", SELECTED)
def test_trl_grpo_configuration_runs_the_same_under_gear_trainer(tmp_path, tok, model_path, case):
    def train(name: str, trainer_cls: type, config_cls: type, **gear: Any) -> Any:
        return _train(tok, model_path, tmp_path / name, case, trainer_cls, config_cls, **gear)

    grpo, initial = train("grpo", GRPOTrainer, GRPOConfig)
    same, _ = train("same", GEARTrainer, GEARConfig, credit_method="grpo", credit_log_steps=0)
    gear, _ = train("gear", GEARTrainer, GEARConfig, credit_method="gear")

    # credit_method="grpo" on a GRPO dataset: the very same update as GRPOTrainer
    expected = parameters(grpo.model)
    assert any(not torch.equal(initial[k], v) for k, v in expected.items())
    for name, value in parameters(same.model).items():
        # one Adam step of size lr = 0.1: 1e-5 is float round-off of the (B, T) advantages'
        # sums, amplified where Adam divides a near-zero gradient by its own magnitude
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=1e-4)
    grpo_logs, same_logs = grpo.state.log_history[0], same.state.log_history[0]
    assert same_logs["loss"] == pytest.approx(grpo_logs["loss"], abs=1e-6)
    assert same_logs["reward"] == pytest.approx(grpo_logs["reward"])

    # credit_method="gear": trains, with GEAR's statistics
    logs = gear.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["gear/kl_mean"] > 0
    assert any(not torch.equal(initial[k], v) for k, v in parameters(gear.model).items())
    if CASES[case][1].get("eval"):
        assert any("eval_gear/kl_mean" in entry for entry in gear.state.log_history)
    if case.startswith("cast_lm_head_to_fp32"):
        assert gear.model.get_output_embeddings().weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("trainer_kwargs", "config", "message"),
    [
        ({"reward_funcs": None}, {}, "No reward source provided"),
        ({"train_dataset": None}, {}, "`train_dataset` is required"),
        ({}, {"reward_weights": [1.0, 2.0]}, "Number of reward weights"),
        (
            {"reward_processing_classes": [None, None]},
            {},
            "number of reward processing classes",
        ),
    ],
    ids=["no_reward_source", "no_dataset", "reward_weights", "reward_processing_classes"],
)
def test_trls_argument_errors_reach_the_user_before_gears(
    tmp_path, tok, trainer_kwargs, config, message
):
    """TRL validates first: the GRPO user's dataset lacks GEAR's ground-truth column, yet the
    error is TRL's own."""
    kwargs = dict(
        model=tiny_model(tok),
        reward_funcs=spread_reward,
        args=GEARConfig(**fast_kwargs(tmp_path, **config)),
        train_dataset=_dataset(False, ground_truth=False),
        processing_class=tok,
    )
    kwargs.update(trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        GEARTrainer(**kwargs)


def test_gears_generate_needs_no_more_state_than_trls():
    """TRL's `TestGRPORolloutDispatch` builds the trainer with `object.__new__` and sets only
    what TRL's `_generate` reads; a rollout_func that leaves out a key must then meet TRL's own
    ValueError, not an AttributeError from GEAR's override (re-created here: TRL's test files
    are not in its sdist)."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    trainer = object.__new__(GEARTrainer)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=2)
    trainer._last_loaded_step = 1
    trainer.use_vllm = False
    trainer.use_transformers_paged = False
    trainer.vllm_generation = SimpleNamespace(sync_weights=MagicMock())
    trainer.rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]]})
    with pytest.raises(ValueError, match="rollout_func must return keys"):
        trainer._generate(["prompt"])
    trainer.rollout_func.assert_called_once_with(["prompt"], trainer)

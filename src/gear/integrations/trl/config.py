"""`GEARConfig`: every `GRPOConfig` field plus GEAR's (credit method, teacher, signals, logging)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from gear.credit import CreditParams
from gear.credit.signals import DEFAULT_CHUNK, ESTIMATORS
from gear.teacher import HINT_KINDS, HINT_TEMPLATES, TEACHERS, TEXT_HINT_POSITIONS

LOSS_MODES = ("rl", "self_distill")

_CREDIT_FIELDS = {f.name: f for f in dataclasses.fields(CreditParams)}


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
    something else in `GRPOConfig`. `credit_params` returns them as a `CreditParams`.
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
    credit_rlsd_lambda: float = _credit_field("rlsd_lambda")
    credit_rlsd_eps: float = _credit_field("rlsd_eps")
    credit_rho: float = _credit_field("rho")
    credit_seed: int = field(
        default=_CREDIT_FIELDS["seed"].default,
        metadata={
            "help": "Seed of the 'random' method; the generation batch of step s uses seed + s, so "
            "boundaries differ across steps. (CreditParams.seed)"
        },
    )

    # Teacher (spec §4)
    teacher: str = field(
        default="current",
        metadata={
            "help": "'current': the policy's weights; 'frozen': the initial weights (or `teacher_model`); "
            "'ema': an exponential moving average of the policy, updated after each optimizer step."
        },
    )
    ema_decay: float = field(
        default=0.99, metadata={"help": "Decay of the 'ema' teacher, in [0, 1)."}
    )
    ground_truth_column: str = field(
        default="ground_truth",
        metadata={
            "help": "Dataset column whose value fills the teacher hint's {ground_truth}; needed "
            "only by methods that use the teacher (not 'grpo' or 'entropy_top'). A row whose "
            "value is None gets no hint and weight 1 (counted as gear/rows_without_ground_truth)."
        },
    )
    hint_kind: str = field(
        default="auto",
        metadata={
            "help": "Which hint template the teacher gets: 'math', 'tool', or 'auto' ('tool' when the "
            "trainer has tools or an environment, else 'math')."
        },
    )
    math_hint_template: str = field(
        default=HINT_TEMPLATES["math"],
        metadata={"help": "Teacher hint for math; holds {ground_truth}."},
    )
    tool_hint_template: str = field(
        default=HINT_TEMPLATES["tool"],
        metadata={"help": "Teacher hint for tool use; holds {ground_truth}."},
    )
    text_hint_position: str = field(
        default="before",
        metadata={
            "help": "Where a plain-text (non-chat) prompt gets the hint: 'before' the prompt, so "
            "the prompt still ends as the student's did and the completion continues it, or "
            "'after' it. Chat prompts get it at the end of the last user message."
        },
    )
    teacher_max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of a teacher prompt; longer ones lose the middle of the ground truth "
            "(counted as gear/teacher_prompts_truncated). None: no limit."
        },
    )

    # Signals
    kl_estimator: str = field(
        default="full", metadata={"help": "KL estimator: 'full' (exact), 'topk', 'k1' or 'k3'."}
    )
    kl_topk: int = field(default=64, metadata={"help": "k of the 'topk' KL estimator."})
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
    signal_chunk_size: int = field(
        default=DEFAULT_CHUNK,
        metadata={
            "help": "Tokens per chunk when forming logits for the signals and the self-distill loss."
        },
    )

    # Logging
    credit_log_steps: int = field(
        default=50,
        metadata={
            "help": "Write a credit record (output_dir/credit/step_XXXXXX.jsonl) every this many "
            "steps; 0: never."
        },
    )
    credit_log_rows: int = field(default=4, metadata={"help": "Rows per credit record."})

    # Loss
    loss_mode: str = field(
        default="rl",
        metadata={
            "help": "'rl': TRL's loss (any loss_type) with GEAR's token advantages; 'self_distill': "
            "per-token reverse KL(student || detached teacher), no reward (OPSD baseline)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.credit_params  # noqa: B018  (validates every credit_* field)

        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"GEARConfig.{name}: expected {expected}, got {getattr(self, name)!r}"
            )

        if self.teacher not in TEACHERS:
            raise bad("teacher", f"one of {list(TEACHERS)}")
        if not 0 <= self.ema_decay < 1:
            raise bad("ema_decay", "a number in [0, 1)")
        if self.loss_mode not in LOSS_MODES:
            raise bad("loss_mode", f"one of {list(LOSS_MODES)}")
        if self.hint_kind not in HINT_KINDS:
            raise bad("hint_kind", f"one of {list(HINT_KINDS)}")
        if self.text_hint_position not in TEXT_HINT_POSITIONS:
            raise bad("text_hint_position", f"one of {list(TEXT_HINT_POSITIONS)}")
        for name in ("math_hint_template", "tool_hint_template"):
            if "{ground_truth}" not in getattr(self, name):
                raise bad(name, "a template with a '{ground_truth}' placeholder")
        if self.kl_estimator not in ESTIMATORS:
            raise bad("kl_estimator", f"one of {list(ESTIMATORS)}")
        if self.teacher_max_prompt_length is not None and self.teacher_max_prompt_length < 1:
            raise bad("teacher_max_prompt_length", "None or an integer >= 1")
        for name in ("kl_topk", "signal_chunk_size"):
            if getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        for name in ("credit_log_steps", "credit_log_rows"):
            if getattr(self, name) < 0:
                raise bad(name, "an integer >= 0")

    @property
    def credit_params(self) -> CreditParams:
        """The `credit_*` fields as a validated `CreditParams`."""
        return CreditParams(**{name: getattr(self, f"credit_{name}") for name in _CREDIT_FIELDS})


__all__ = ["HINT_KINDS", "LOSS_MODES", "TEACHERS", "GEARConfig"]

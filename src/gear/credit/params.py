"""`CreditParams`: every knob of spec sections 2-3, with the spec's names and defaults."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gear.credit.registry import METHODS

MODULATIONS = ("linear", "exp")
#: what OAR-G's phi scores (docs/spec.md, OAR-G): the completion's parsed final answer, the
#: reference answer appended after the completion (the authors' way), or the last k tokens
OAR_SPANS = ("answer", "reference", "last")
#: what OAR-P measures of the answer on each masked copy (`gear.credit.attribution.PFINAL_MODES`)
OAR_PFINAL = ("answer_joint", "answer_mean", "last")
#: fields the trainers (TRL, verl) do not take as credit fields: `contrast` needs a second
#: teacher pass, which their `teacher_context` setting ('contrast') turns on with it
CONTEXT_FIELDS = ("contrast",)


@dataclass(frozen=True)
class CreditParams:
    """Hyper-parameters of the credit methods (spec §2-3). Validated on construction."""

    method: str = field(
        default="gear", metadata={"help": "Credit method (see gear.credit.METHODS)."}
    )
    tau_onset: float = field(
        default=0.1,
        metadata={"help": "Normalised-KL threshold of an onset (spec §2.4), in (0, 1]."},
    )
    delta_entropy: float = field(
        default=0.1, metadata={"help": "Normalised-entropy rise that ends a segment (spec §2.3)."}
    )
    max_segment_len: int = field(default=512, metadata={"help": "Longest segment, in tokens."})
    modulation: str = field(default="linear", metadata={"help": "'linear' or 'exp' (spec §2.7)."})
    alpha: float = field(default=0.5, metadata={"help": "Linear modulation strength, in [0, 1)."})
    beta: float = field(default=1.0, metadata={"help": "Exponential modulation strength, >= 0."})
    preserve_mass: bool = field(
        default=True, metadata={"help": "Rescale weights to mean 1 per row (spec §2.8)."}
    )
    w_min: float = field(default=0.2, metadata={"help": "Lower clip of a token weight."})
    w_max: float = field(default=3.0, metadata={"help": "Upper clip of a token weight."})
    tau_entropy: float = field(
        default=0.5, metadata={"help": "Normalised-entropy onset threshold (gear_entropy_only)."}
    )
    fixed_len: int = field(default=32, metadata={"help": "Segment length of the 'fixed' method."})
    realign_len: int = field(
        default=8,
        metadata={
            "help": "gear_departure*: the student has realigned with the teacher after this many "
            "consecutive tokens below tau_onset; a departure's segment ends there."
        },
    )
    rlsd_lambda: float = field(default=0.5, metadata={"help": "RLSD mixing weight, in [0, 1]."})
    rlsd_eps: float = field(default=0.2, metadata={"help": "RLSD ratio clip, in [0, 1)."})
    rho: float = field(
        default=0.2, metadata={"help": "Fraction of highest-entropy tokens kept (entropy_top)."}
    )
    seed: int = field(
        default=0, metadata={"help": "Seed of the 'random' and 'random_shape' methods."}
    )
    shape_method: str = field(
        default="gear",
        metadata={
            "help": "random_shape: the candidate method whose per-row weights it permutes to "
            "random valid positions (the shape-matched placebo of that method); it reads the "
            "candidate's signals."
        },
    )
    oar_span: str = field(
        default="answer",
        metadata={
            "help": "oar_g, oar_p: the tokens whose log-probability phi the influence is "
            "measured on. "
            "'answer': the completion's own final answer as the task parses it (its tokens, "
            "found through the tokenizer's offsets; no end token); they and the tokens after "
            "them keep weight 1. 'reference': the authors' way, the reference answer (the "
            "answer column) appended after the completion; every completion token is reshaped. "
            "'last': each row's last oar_answer_len policy tokens (gear before issue 53). A row "
            "whose answer (or reference) is not found falls back to 'last' "
            "(gear/oar_span_fallback counts them)."
        },
    )
    oar_answer_len: int = field(
        default=2,
        metadata={
            "help": "oar_g, oar_p: k, the span of oar_span='last' and of the rows whose answer is not "
            "found: each row's last k policy tokens, which keep weight 1."
        },
    )
    oar_quantile: float = field(
        default=0.5,
        metadata={
            "help": "oar_g, oar_p: quantile of a row's influence that splits low from high, [0, 1]."
        },
    )
    oar_boost: float = field(
        default=1.0,
        metadata={
            "help": "oar_g, oar_p: the most influential token gets 1 + oar_boost before rescaling."
        },
    )
    oar_floor: float = field(
        default=0.1,
        metadata={"help": "oar_g, oar_p: least weight of a low-influence token, in [0, 1]."},
    )
    oar_pfinal: str = field(
        default="answer_joint",
        metadata={
            "help": "oar_p: what a masked copy's score measures (the authors' pfinal_mode). "
            "'answer_joint': |phi - phi_masked|, phi the span's mean log-probability (OAR-G's "
            "phi). 'answer_mean': KL(p || p_masked) of the softmax of the mean logits over the "
            "positions that predict the span. 'last': KL(p || p_masked) at the position that "
            "predicts the span's first token. oar_g takes 'answer_joint' only (the gradient of "
            "a KL vanishes at the clean input)."
        },
    )
    success_floor: float = field(
        default=0.0,
        metadata={
            "help": "Guard (ours): raise every row's KL normalisation floor (spec §2.2's row "
            "minimum) to success_floor x the mean, over the batch's successful rows (A > 0), of "
            "their largest KL, so a divergence the teacher also shows on successful rollouts "
            "(an answer-only teacher's style or hint-reading artefact) takes no blame. Any "
            "KL-reading method; 0 (the default) is spec §2.2 exactly; 1 is the departure "
            "recipe's."
        },
    )
    contrast: bool = field(
        default=False,
        metadata={
            "help": "Use max(kl - contrast_kl, 0) as the KL, where contrast_kl is the KL to a "
            "teacher shown a wrong ground truth (an extension after RLCSD, arXiv 2606.11709): "
            "disagreement the hint causes whatever its content is removed. Needs contrast_kl."
        },
    )

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"CreditParams.{name}: expected {expected}, got {getattr(self, name)!r}"
            )

        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(f.name, "a finite number")
        if self.method not in METHODS:
            raise bad("method", f"one of {sorted(METHODS)}")
        if self.shape_method not in METHODS or self.shape_method == "random_shape":
            raise bad(
                "shape_method", f"a credit method other than 'random_shape' {sorted(METHODS)}"
            )
        if self.modulation not in MODULATIONS:
            raise bad("modulation", f"one of {list(MODULATIONS)}")
        if not 0 < self.tau_onset <= 1:
            raise bad("tau_onset", "a number in (0, 1]")
        if self.delta_entropy < 0:
            raise bad("delta_entropy", "a number >= 0")
        if not 0 < self.tau_entropy <= 1:
            raise bad("tau_entropy", "a number in (0, 1]")
        if int(self.max_segment_len) != self.max_segment_len or self.max_segment_len < 1:
            raise bad("max_segment_len", "an integer >= 1")
        if int(self.fixed_len) != self.fixed_len or self.fixed_len < 1:
            raise bad("fixed_len", "an integer >= 1")
        if int(self.realign_len) != self.realign_len or self.realign_len < 1:
            raise bad("realign_len", "an integer >= 1")
        if not 0 <= self.alpha < 1:
            raise bad("alpha", "a number in [0, 1) so that every weight stays positive")
        if self.success_floor < 0:
            raise bad("success_floor", "a number >= 0")
        if self.beta < 0:
            raise bad("beta", "a number >= 0")
        if not 0 <= self.w_min <= self.w_max:
            raise bad("w_min", f"0 <= w_min <= w_max (w_max={self.w_max})")
        if (
            self.method == "first_error"
            and self.preserve_mass
            and not self.w_min <= 1 <= self.w_max
        ):
            raise bad(
                "w_max" if self.w_max < 1 else "w_min",
                f"w_min <= 1 <= w_max with first_error, which preserves each row's mass after "
                f"the clip (w_min={self.w_min}, w_max={self.w_max})",
            )
        if not 0 <= self.rlsd_lambda <= 1:
            raise bad("rlsd_lambda", "a number in [0, 1]")
        if not 0 <= self.rlsd_eps < 1:
            raise bad("rlsd_eps", "a number in [0, 1)")
        if not 0 < self.rho <= 1:
            raise bad("rho", "a number in (0, 1]")
        if self.oar_span not in OAR_SPANS:
            raise bad("oar_span", f"one of {list(OAR_SPANS)}")
        if int(self.oar_answer_len) != self.oar_answer_len or self.oar_answer_len < 1:
            raise bad("oar_answer_len", "an integer >= 1")
        if not 0 <= self.oar_quantile <= 1:
            raise bad("oar_quantile", "a number in [0, 1]")
        if self.oar_boost < 0:
            raise bad("oar_boost", "a number >= 0")
        if not 0 <= self.oar_floor <= 1:
            raise bad("oar_floor", "a number in [0, 1]")
        if self.oar_pfinal not in OAR_PFINAL:
            raise bad("oar_pfinal", f"one of {list(OAR_PFINAL)}")
        if self.oar_pfinal != "answer_joint" and "influence" in self.required_signals:
            raise bad(
                "oar_pfinal",
                "'answer_joint' with oar_g (its input gradient is of phi; a KL's gradient "
                "vanishes at the clean input): the KL modes are oar_p's",
            )
        for name in ("preserve_mass", "contrast"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")

    @property
    def required_signals(self) -> tuple[str, ...]:
        """The per-token signals `method` reads (`random_shape`: those of its `shape_method`,
        whose weights it moves); `contrast` adds `contrast_kl` on top of these."""
        name = self.shape_method if self.method == "random_shape" else self.method
        return METHODS[name].requires

    @property
    def signal_rows(self) -> str:
        """Which rows' signals `method` reads (`gear.credit.registry.ROWS`): "advantaged" (rows
        with a non-zero sequence advantage; tied rows may go unscored) or "all"
        (`random_shape`: its `shape_method`'s)."""
        name = self.shape_method if self.method == "random_shape" else self.method
        return METHODS[name].rows

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CreditParams:
        """Build from a mapping; unknown keys are an error naming them and the valid keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"CreditParams: unknown field(s) {unknown}; valid: {sorted(known)}")
        return cls(**values)

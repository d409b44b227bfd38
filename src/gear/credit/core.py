"""`token_advantages` and `credit_details`: validate a batch, run a credit method, fall back on
non-finite rows, and summarise what happened (spec §5)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gear.credit import segments as seg
from gear.credit.params import CreditParams
from gear.credit.registry import CONTRAST_KL, CREDIT_SIGNALS, MASK_SIGNALS, METHODS, CreditInputs


@dataclass
class CreditDetails:
    """Everything logging and visualisation need about one batch. Tensors are (N, T) unless noted.

    Attributes:
        token_advantages: A_i * w_t on valid tokens, 0 elsewhere (dtype of `advantages`).
        weights: w_t, 1 at invalid tokens and on fallback rows.
        valid: response mask (bool).
        kl_norm, entropy_norm: normalised signals d~, H~ (0 when the signal was not given).
        source: a_t (0 where the method has none).
        onsets: bool. segment_ids: long, -1 = no segment.
        fallback_rows: (N,) bool, rows whose signals were not finite (weights forced to 1).
        stats: the spec §5 statistics, `gear/...` -> float.
        skipped_rows: (N,) bool, rows left unscored (advantage 0, no signals computed; weights
            1, no onsets or segments).
    """

    token_advantages: Tensor
    weights: Tensor
    valid: Tensor
    kl_norm: Tensor
    entropy_norm: Tensor
    source: Tensor
    onsets: Tensor
    segment_ids: Tensor
    fallback_rows: Tensor
    stats: dict[str, float]
    skipped_rows: Tensor | None = None


def _check(name: str, t: Tensor | None, shape: tuple[int, ...], kind: str) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if kind == "float" and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if kind == "bool" and t.dtype != torch.bool:
        integer = not (t.is_floating_point() or t.is_complex())
        if not (integer and bool(((t == 0) | (t == 1)).all())):
            raise TypeError(f"{name}: expected a bool (or 0/1 integer) tensor, got {t.dtype}")


def _inputs(
    advantages: Tensor,
    response_mask: Tensor,
    signals: dict[str, Tensor | None],
    turn_starts: Tensor | None,
    params: CreditParams,
    answer_mask: Tensor | None = None,
) -> tuple[CreditInputs, Tensor]:
    """Validate, cast to float64, and zero the signals of non-finite rows.

    Returns the inputs and (N,) bool fallback rows.
    """
    if not isinstance(advantages, Tensor) or advantages.dim() != 1:
        raise ValueError(
            f"advantages: expected a (N,) tensor, got {getattr(advantages, 'shape', advantages)!r}"
        )
    _check("advantages", advantages, tuple(advantages.shape), "float")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages: expected finite values, got NaN or inf")
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2:
        raise ValueError(
            f"response_mask: expected a (N, T) tensor, got {getattr(response_mask, 'shape', response_mask)!r}"
        )
    shape = tuple(response_mask.shape)
    if shape[0] != advantages.shape[0]:
        raise ValueError(
            f"response_mask: expected {advantages.shape[0]} rows (from advantages), got {shape[0]}"
        )
    _check("response_mask", response_mask, shape, "bool")
    _check("turn_starts", turn_starts, shape, "bool")
    _check("answer_mask", answer_mask, shape, "bool")
    for name, value in signals.items():
        _check(name, value, shape, "float")

    requires = params.required_signals
    if params.contrast:
        if "kl" not in requires:
            raise ValueError(
                f"CreditParams.contrast: credit method {params.method!r} uses no KL to contrast"
            )
        requires = (*requires, CONTRAST_KL)
    missing = [s for s in requires if signals.get(s) is None]
    if missing:
        what = f"credit method {params.method!r}" + (" with contrast" if params.contrast else "")
        raise ValueError(f"{what} needs {missing}, which were not given")

    device = advantages.device
    valid = response_mask.to(device=device, dtype=torch.bool)
    fallback = torch.zeros(shape[0], dtype=torch.bool, device=device)
    cast: dict[str, Tensor | None] = {}
    for name, value in signals.items():
        if value is None or name not in requires:
            cast[name] = None if value is None else value.to(device, torch.float64)
            continue
        value = value.to(device, torch.float64)
        bad_row = (valid & ~torch.isfinite(value)).any(dim=1)
        fallback |= bad_row
        cast[name] = torch.where(torch.isfinite(value), value, 0.0)
    for name in requires:  # a fallback row carries no signal at all
        cast[name] = torch.where(fallback[:, None], 0.0, cast[name])  # type: ignore[arg-type]
    contrast_kl = cast.pop(CONTRAST_KL)
    if params.contrast:  # what this hint says beyond any hint: the excess over the contrast
        cast["kl"] = (cast["kl"] - contrast_kl).clamp(min=0.0)  # type: ignore[operator]
    inputs = CreditInputs(
        advantages=advantages.to(torch.float64),
        valid=valid,
        turn_starts=None
        if turn_starts is None
        else turn_starts.to(device=device, dtype=torch.bool),
        answer_mask=None
        if answer_mask is None
        else answer_mask.to(device=device, dtype=torch.bool),
        **cast,
    )
    if params.success_floor > 0 and inputs.kl is not None:  # the guard: every method's d~
        inputs.kl_norm = seg.success_floored_normalise(
            inputs.kl, valid, inputs.advantages, params.success_floor
        )
    return inputs, fallback


def credit_details(
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl: Tensor | None = None,
    entropy: Tensor | None = None,
    turn_starts: Tensor | None = None,
    student_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    contrast_kl: Tensor | None = None,
    influence: Tensor | None = None,
    perturbation: Tensor | None = None,
    answer_mask: Tensor | None = None,
    error_mask: Tensor | None = None,
    prefix_count: Tensor | None = None,
    params: CreditParams | None = None,
    scored: Tensor | None = None,
) -> CreditDetails:
    """Per-token advantages of `params.method` plus everything needed to log and render them.

    Args:
        advantages: (N,) sequence advantages A_i (finite).
        response_mask: (N, T) bool, 1 on tokens the policy generated.
        kl: (N, T) per-token reverse KL(student || teacher).
        entropy: (N, T) student entropy.
        turn_starts: (N, T) bool, first policy token of each assistant turn (optional).
        student_logprobs, teacher_logprobs: (N, T) log-probability of the sampled token.
        contrast_kl: (N, T) KL to a teacher shown a wrong ground truth (`params.contrast`).
        influence: (N, T) a token's influence on the final answer (`oar_g`;
            `gear.credit.attribution`).
        perturbation: (N, T) how far the final answer moves when the token is masked (`oar_p`;
            `gear.credit.attribution.perturbation_influence`).
        answer_mask: (N, T) bool, the final answer's tokens in each completion (the span of
            `oar_g` and `oar_p`, `gear.spans`); None: each row's last `params.oar_answer_len`
            valid tokens.
        error_mask: (N, T) bool, the tokens of each row's first wrong step as a step checker
            marks them (`first_error`; `gear.spans.error_token_mask`); no True where it found none.
        prefix_count: (N, T) how many rows of each row's group share its prefix through each
            token, >= 1 on valid tokens (`lambda_grpo`; `gear.credit.implicit.prefix_counts`).
        params: `CreditParams`; default GEAR with the spec's defaults.
        scored: (N,) bool, the rows whose signals were computed, or None for all. Unscored rows
            must have advantage 0 and the method must read only advantaged rows
            (`CreditParams.signal_rows`): their signals are ignored, their weights are 1 and
            their token advantages 0, exactly as if they had been scored; the statistics
            describe the scored rows (`gear/rows_skipped` counts the others).
    Returns:
        `CreditDetails`. Rows whose needed signals are not finite on valid tokens get w = 1.
    """
    # the per-token signals by name (test_signal_names checks that the keywords above are
    # exactly `CREDIT_SIGNALS`; the assert, that this mapping names each of them)
    signals: dict[str, Tensor | None] = {
        "kl": kl,
        "entropy": entropy,
        "student_logprobs": student_logprobs,
        "teacher_logprobs": teacher_logprobs,
        CONTRAST_KL: contrast_kl,
        "influence": influence,
        "perturbation": perturbation,
        "error_mask": error_mask,
        "prefix_count": prefix_count,
    }
    assert tuple(signals) == CREDIT_SIGNALS, "credit_details: a signal left out"
    params = params or CreditParams()
    skipped = _skipped_rows(scored, advantages, params)
    for name in MASK_SIGNALS:
        if signals[name] is not None:
            signals[name] = _as_float_mask(name, signals[name], response_mask)
    signals["prefix_count"] = _checked_counts(prefix_count, response_mask, scored)
    if skipped is not None:  # unscored rows carry no signal: 0, never a fallback
        skipped = skipped.to(advantages.device)
        signals = {
            k: None if v is None else torch.where(skipped.to(v.device)[:, None], 0.0, v)
            for k, v in signals.items()
        }
    x, fallback = _inputs(advantages, response_mask, signals, turn_starts, params, answer_mask)
    out = METHODS[params.method].fn(x, params)

    unweighted = fallback if skipped is None else fallback | skipped
    weights = torch.where(unweighted[:, None] & x.valid, 1.0, out.weights)
    token_adv = torch.where(x.valid, x.advantages[:, None] * weights, 0.0)
    zeros = torch.zeros_like(weights)
    none = torch.full_like(x.valid, -1, dtype=torch.long)
    onsets = out.onsets if out.onsets is not None else torch.zeros_like(x.valid)
    segment_ids = out.segment_ids if out.segment_ids is not None else none
    onsets = onsets & ~unweighted[:, None]
    segment_ids = torch.where(unweighted[:, None], -1, segment_ids)
    details = CreditDetails(
        token_advantages=token_adv.to(advantages.dtype),
        weights=weights.to(advantages.dtype),
        valid=x.valid,
        kl_norm=x.kl_norm if x.kl is not None else zeros,
        entropy_norm=x.entropy_norm if x.entropy is not None else zeros,
        source=out.source if out.source is not None else zeros,
        onsets=onsets,
        segment_ids=segment_ids,
        fallback_rows=fallback,
        stats={},
        skipped_rows=skipped,
    )
    details.stats = credit_stats(details, x)
    return details


def _as_float_mask(name: str, mask: Tensor, response_mask: Tensor) -> Tensor:
    """A bool (or 0/1) (N, T) mask as float 0/1, checked like any mask, so it travels with the
    float signals (skipped rows, fallback)."""
    shape = tuple(response_mask.shape) if isinstance(response_mask, Tensor) else None
    _check(name, mask, shape or tuple(mask.shape), "bool")
    return mask.to(torch.float32)


def _checked_counts(
    counts: Tensor | None, response_mask: Tensor, scored: Tensor | None
) -> Tensor | None:
    """`prefix_count` as float, after checking it counts at least the row itself on every valid
    token of a scored row."""
    if counts is None:
        return None
    if not isinstance(counts, Tensor) or tuple(counts.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"prefix_count: expected shape {tuple(response_mask.shape)}, got "
            f"{tuple(getattr(counts, 'shape', ()))}"
        )
    rows = response_mask.bool().to(counts.device)
    if scored is not None:
        rows = rows & scored.bool().to(counts.device)[:, None]
    if bool((rows & ~(counts >= 1)).any()):
        raise ValueError(
            "prefix_count: expected >= 1 on every valid token (each row shares its own prefix)"
        )
    return counts.to(torch.float32)


def _skipped_rows(scored: Tensor | None, advantages: Tensor, params: CreditParams) -> Tensor | None:
    """(N,) bool rows left unscored, after checking that skipping them is exact; None: none."""
    if scored is None:
        return None
    n = advantages.shape[0] if isinstance(advantages, Tensor) and advantages.dim() == 1 else None
    _check("scored", scored, (n,) if n is not None else tuple(scored.shape), "bool")
    skipped = ~scored.to(torch.bool)
    if not bool(skipped.any()):
        return skipped
    if params.signal_rows != "advantaged":
        raise ValueError(
            f"scored: credit method {params.method!r} reads every row's signals "
            f"(rows={params.signal_rows!r}); score all rows"
        )
    if bool((advantages.to(skipped.device)[skipped] != 0).any()):
        raise ValueError("scored: a row with a non-zero advantage was left unscored")
    return skipped


def token_advantages(advantages: Tensor, response_mask: Tensor, **kwargs: Any) -> Tensor:
    """(N, T) per-token advantages of `params.method`: `credit_details(...).token_advantages`,
    with `credit_details`' arguments (its signature is this function's)."""
    return credit_details(advantages, response_mask, **kwargs).token_advantages


token_advantages.__signature__ = inspect.signature(credit_details).replace(  # type: ignore[attr-defined]
    return_annotation="Tensor"
)


COUNT_STATS = ("gear/fallback_rows", "gear/rows_skipped")  # counts: defined on any batch


def credit_stats(d: CreditDetails, x: CreditInputs) -> dict[str, float]:
    """The spec §5 statistics of one batch (floats), over its scored rows
    (`CreditDetails.skipped_rows`), plus `gear/rows_skipped`. Where nothing was measured they
    are NaN, never 0 (TRL logs NaN as None): all but the counts (`COUNT_STATS`) when no policy
    token of a scored row is left (every row tied, say), and a mean of a signal the method does
    not compute (`gear/kl_mean` without a teacher). 0.0 where a measured batch leaves one
    undefined (no onsets: `gear/mean_segment_len`; under 2 weights: `gear/weight_std_*`)."""
    skipped = d.skipped_rows
    valid = x.valid if skipped is None else x.valid & ~skipped[:, None]
    n_rows = valid.shape[0] - (0 if skipped is None else int(skipped.sum()))
    n_valid = valid.sum(dim=1)
    n_total = max(int(n_valid.sum()), 1)
    in_seg = (d.segment_ids >= 0) & valid
    n_onsets = int(d.onsets.sum())
    w = d.weights.double()

    def masked_mean(v: Tensor | None) -> float:
        return math.nan if v is None else float(torch.where(valid, v, 0.0).sum() / n_total)

    def weight_std(rows: Tensor) -> float:
        m = valid & rows[:, None]
        return float(w[m].std(unbiased=False)) if int(m.sum()) > 1 else 0.0

    mass = torch.where(valid, d.token_advantages.double(), 0.0).sum(dim=1)
    expected = n_valid * x.advantages
    error = (mass - expected).abs() / n_valid.clamp(min=1)
    mass_error = error.mean() if skipped is None else error[~skipped].sum() / max(n_rows, 1)
    stats = {
        "gear/kl_mean": masked_mean(x.kl),
        "gear/entropy_mean": masked_mean(x.entropy),
        "gear/onsets_per_row": n_onsets / max(n_rows, 1),
        "gear/frac_tokens_in_segments": int(in_seg.sum()) / n_total,
        "gear/mean_segment_len": int(in_seg.sum()) / n_onsets if n_onsets else 0.0,
        "gear/weight_std_pos": weight_std(x.advantages > 0),
        "gear/weight_std_neg": weight_std(x.advantages < 0),
        "gear/mass_error": float(mass_error),
        "gear/fallback_rows": float(d.fallback_rows.sum()),
        "gear/rows_skipped": 0.0 if skipped is None else float(skipped.sum()),
    }
    if not bool(valid.any()):  # no token measured: a 0 here would read as a measurement
        stats |= {k: math.nan for k in stats if k not in COUNT_STATS}
    return stats

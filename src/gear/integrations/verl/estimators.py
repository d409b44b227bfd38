"""GEAR's advantage estimators in verl's registry (`verl.trainer.ppo.core_algos`).

verl calls a registered estimator as ``fn(token_level_rewards=, response_mask=, config=, index=)``
(``index``: the rollout group ``uid`` of each row) and expects ``(advantages, returns)``, both
(N, T). A GEAR estimator:

1. computes the GRPO sequence advantage per group, vectorised (`grpo_advantages`):
   (r - mean) / (std + epsilon), unbiased std, singleton groups get mean 0 and std 1 as in verl;
2. turns it into per-token advantages with `gear.credit.credit_details` and the per-token signals
   ``gear_kl``, ``gear_entropy``, ``gear_student_logprobs``, ``gear_teacher_logprobs``, of the
   rows ``gear_scored`` marks (the rows the trainer found tied have advantage 0 and no signals).

verl's stock ``compute_advantage`` passes only rewards, masks and uids, so the signals arrive
either as keyword arguments (``gear_kl=...``) or from the `gear_batch` context that GEAR's trainer
opens around verl's ``_compute_advantage`` (see trainer.py). Keyword arguments win.

Nothing here imports verl at module level; `register_estimators` does, when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gear.credit import CreditDetails, CreditParams, credit_details
from gear.credit.registry import CONTRAST_KL, PASS_SIGNALS
from gear.integrations.verl.config import VERL_ESTIMATORS

#: gear.credit signal name -> batch field name (in verl's batch / TransferQueue): "gear_" + the
#: name, for each signal of the signal pass (`gear.credit.registry.PASS_SIGNALS`)
SIGNAL_FIELDS: dict[str, str] = {name: f"gear_{name}" for name in PASS_SIGNALS}
#: batch field of the contrast teacher's KL (``teacher_context: contrast``, `CreditParams.contrast`)
CONTRAST_KL_FIELD = f"gear_{CONTRAST_KL}"
#: every per-token field GEAR's pass may write: the signals and the contrast KL
OUTPUT_FIELDS: dict[str, str] = {**SIGNAL_FIELDS, CONTRAST_KL: CONTRAST_KL_FIELD}
ESTIMATOR_MARK = "__gear_estimator__"


@dataclass
class GearBatch:
    """What GEAR's trainer hands to the estimator for one batch (rows in verl's batch order).

    Attributes:
        signals: batch field name (SIGNAL_FIELDS values) -> (N, T) tensor.
        response_mask: (N, T) mask the signals were computed for (shape and subset check).
        params: CreditParams of the run (its method is replaced by the estimator's).
        epsilon: GRPO epsilon. norm_adv_by_std: divide by the group std.
        sessions: (N,) session label of each row, and `final` (N,) bool: verl's v1 agent loops can
            emit several outputs per rollout session; then only the final output of each session
            enters the group statistics and its advantage is shared by the session's rows.
        scored: (N,) bool, the rows whose signals were computed (`skip_zero_advantage_rows`:
            the others have a sequence advantage of 0 and zero signals), or None for all.
        details, scores, sequence_advantages: filled in by the estimator (for logging).
    """

    signals: dict[str, Tensor] = field(default_factory=dict)
    response_mask: Tensor | None = None
    params: CreditParams | None = None
    epsilon: float = 1e-4
    norm_adv_by_std: bool | None = None
    sessions: Sequence[Any] | None = None
    final: Tensor | None = None
    scored: Tensor | None = None
    details: CreditDetails | None = None
    scores: Tensor | None = None
    sequence_advantages: Tensor | None = None


_ACTIVE: list[GearBatch] = []


@contextlib.contextmanager
def gear_batch(batch: GearBatch) -> Iterator[GearBatch]:
    """Make `batch` visible to GEAR estimators called inside the block (verl's compute_advantage)."""
    _ACTIVE.append(batch)
    try:
        yield batch
    finally:
        _ACTIVE.remove(batch)


def active_batch() -> GearBatch | None:
    return _ACTIVE[-1] if _ACTIVE else None


def group_ids(labels: Any) -> Tensor:
    """(N,) long ids 0..G-1 from any labels (uids as strings, ints, a tensor, a numpy array)."""
    if isinstance(labels, Tensor):
        labels = labels.cpu().numpy()
    arr = np.asarray(labels, dtype=object).reshape(-1)
    _, inverse = np.unique(np.array([str(x) for x in arr], dtype=object), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    index: Any,
    *,
    epsilon: float = 1e-4,
    norm_adv_by_std: bool = True,
    final: Tensor | None = None,
    sessions: Any = None,
) -> Tensor:
    """(N,) GRPO sequence advantages, vectorised over groups (rows with equal `index`).

    Args:
        scores: (N,) rewards.
        index: (N,) group labels (verl's ``uid``).
        epsilon: (r - mean) / (std + epsilon). norm_adv_by_std: False gives r - mean (Dr. GRPO).
        final, sessions: see `GearBatch`; both or neither.
    Returns:
        (N,) float32. Unbiased std; a group of one row has mean 0 and std 1 (verl's convention).
    """
    s = scores.detach().to(torch.float64).reshape(-1)
    n = s.numel()
    g = group_ids(index).to(s.device)
    if g.numel() != n:
        raise ValueError(f"index: expected {n} group labels, got {g.numel()}")
    w = (
        torch.ones(n, dtype=torch.float64, device=s.device)
        if final is None
        else final.to(s.device).double()
    )
    n_groups = int(g.max()) + 1 if n else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, g, w)
    total = torch.zeros_like(count).index_add_(0, g, w * s)
    mean = total / count.clamp(min=1)
    sq = torch.zeros_like(count).index_add_(0, g, w * (s - mean[g]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count <= 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = s - mean[g]
    if norm_adv_by_std:
        adv = adv / (std[g] + epsilon)
    if sessions is not None:
        if final is None:
            raise ValueError(
                "sessions: also pass `final` (which row of each session is its last output)"
            )
        sid = group_ids(sessions).to(s.device)
        per_session = torch.zeros(int(sid.max()) + 1, dtype=torch.float64, device=s.device)
        per_session.index_add_(0, sid[final.bool()], adv[final.bool()])
        adv = per_session[sid]
    return adv.to(torch.float32)


def _as_mask(mask: Tensor) -> Tensor:
    return mask.bool() if mask.dtype != torch.bool else mask


def _config_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping) or hasattr(config, "get"):
        try:
            value = config.get(key, default)
            return default if value is None else value
        except Exception:
            return default
    return getattr(config, key, default)


def gear_token_advantages(
    estimator: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, CreditDetails, Tensor, Tensor]:
    """The work of a registered estimator. Returns (token advantages, details, scores, A_i)."""
    if estimator not in VERL_ESTIMATORS:
        raise ValueError(f"estimator: expected one of {sorted(VERL_ESTIMATORS)}, got {estimator!r}")
    method = VERL_ESTIMATORS[estimator]
    ctx = active_batch()
    mask = _as_mask(response_mask)
    shape = tuple(mask.shape)
    if index is None:
        raise ValueError(
            f"verl advantage estimator {estimator!r}: needs the rollout group ids (`index`, verl's "
            "non_tensor_batch['uid']), which were not given"
        )

    signals: dict[str, Tensor | None] = {}
    for name, key in OUTPUT_FIELDS.items():
        value = kwargs.get(key)
        if value is None and ctx is not None:
            value = ctx.signals.get(key)
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{key}: expected the response mask's shape {shape}, got {tuple(value.shape)} "
                "(the signals must be in the batch's row order and padded to its response length)"
            )
        signals[name] = None if value is None else value.to(mask.device)
    params = (
        kwargs.get("gear_params") or (ctx.params if ctx is not None else None) or CreditParams()
    )
    params = dataclasses.replace(params, method=method) if params.method != method else params
    requires = (*params.required_signals, *(("contrast_kl",) if params.contrast else ()))
    # a signal verl's trainer never computes (OAR-G's influence) is named as itself
    missing = [OUTPUT_FIELDS.get(s, s) for s in requires if signals.get(s) is None]
    if missing:
        raise ValueError(
            f"verl advantage estimator {estimator!r} needs the per-token signals {missing}, which "
            "neither the call nor GEAR's trainer provided. Train with GEAR's trainer "
            "(trainer.v1.trainer_mode=gear_sync, launched with `python -m gear.integrations.verl.main`)."
        )
    if ctx is not None and ctx.response_mask is not None:
        known = _as_mask(ctx.response_mask).to(mask.device)
        if tuple(known.shape) != shape:
            raise ValueError(
                f"response_mask: GEAR's signals were computed for shape {tuple(known.shape)}, "
                f"verl passed {shape}"
            )
        if bool((mask & ~known).any()):  # rollout correction may drop tokens, never add them
            raise ValueError(
                "response_mask: verl's mask has tokens the GEAR signals were not computed for"
            )

    epsilon = kwargs.get("gear_epsilon", ctx.epsilon if ctx is not None else 1e-4)
    norm = kwargs.get("norm_adv_by_std_in_grpo")
    if norm is None and ctx is not None:
        norm = ctx.norm_adv_by_std
    if norm is None:
        norm = bool(_config_get(config, "norm_adv_by_std_in_grpo", True))
    sessions = kwargs.get("gear_sessions", ctx.sessions if ctx is not None else None)
    final = kwargs.get("gear_final", ctx.final if ctx is not None else None)
    scored = kwargs.get("gear_scored", ctx.scored if ctx is not None else None)
    if scored is not None and tuple(scored.shape) != shape[:1]:
        raise ValueError(
            f"gear_scored: expected one flag per row, shape {shape[:1]}, got {tuple(scored.shape)}"
        )

    scores = token_level_rewards.sum(dim=-1)
    seq_adv = grpo_advantages(
        scores,
        index,
        epsilon=float(epsilon),
        norm_adv_by_std=bool(norm),
        final=final,
        sessions=sessions,
    ).to(mask.device)
    if scored is not None and bool((seq_adv[~scored.to(seq_adv.device).bool()] != 0).any()):
        raise ValueError(
            "gear_scored: a row GEAR's trainer found tied before the old-log-prob pass (sequence "
            "advantage 0, no teacher pass) has a non-zero advantage here: the rewards changed "
            "after that pass; set gear.skip_zero_advantage_rows=false"
        )
    details = credit_details(
        seq_adv,
        mask,
        **signals,  # the signal pass's, by their gear.credit names (OUTPUT_FIELDS)
        params=params,
        scored=None if scored is None else scored.to(mask.device).bool(),
    )
    adv = details.token_advantages.to(torch.float32)
    if ctx is not None:
        ctx.details, ctx.scores, ctx.sequence_advantages = details, scores.detach(), seq_adv
    return adv, details, scores, seq_adv


def make_estimator(estimator: str) -> Any:
    """A function with verl's estimator signature for `estimator` (a VERL_ESTIMATORS name)."""
    if estimator not in VERL_ESTIMATORS:
        raise ValueError(f"estimator: expected one of {sorted(VERL_ESTIMATORS)}, got {estimator!r}")

    def fn(
        token_level_rewards: Tensor,
        response_mask: Tensor,
        config: Any = None,
        index: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        adv, *_ = gear_token_advantages(
            estimator, token_level_rewards, response_mask, index, config, **kwargs
        )
        return adv, adv

    fn.__name__ = fn.__qualname__ = f"compute_{estimator}_advantage"
    fn.__doc__ = (
        f"verl advantage estimator {estimator!r}: GRPO sequence advantage reweighted per token by "
        f"gear.credit method {VERL_ESTIMATORS[estimator]!r}."
    )
    setattr(fn, ESTIMATOR_MARK, estimator)
    return fn


ESTIMATOR_FNS: dict[str, Any] = {name: make_estimator(name) for name in VERL_ESTIMATORS}


def register_estimators(registry: dict[str, Any] | None = None) -> list[str]:
    """Register every GEAR estimator with verl (idempotent). Returns the names.

    Re-registering is a no-op; an entry left by an earlier import of this module (a reload, a
    second copy) is replaced; a name taken by anything else raises `ValueError`.
    """
    if registry is None:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

        registry = ADV_ESTIMATOR_REGISTRY
    else:
        register_adv_est = None
    for name, fn in ESTIMATOR_FNS.items():
        existing = registry.get(name)
        if existing is fn:
            continue
        if existing is not None and getattr(existing, ESTIMATOR_MARK, None) != name:
            raise ValueError(
                f"verl advantage estimator {name!r} is already registered to "
                f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}"
            )
        if existing is None and register_adv_est is not None:
            register_adv_est(name)(fn)  # verl's public API for a new name
        else:
            registry[name] = fn  # our own stale entry
    return list(ESTIMATOR_FNS)

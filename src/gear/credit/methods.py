"""The credit methods of spec §3: one registry, one signature.

Each method is a small function `(CreditInputs, CreditParams) -> MethodOutput` registered under
its name with the signals it needs and the rows whose signals it reads (`rows`): "advantaged"
when a row's weights depend only on its own signals and on those of other rows with a non-zero
advantage (the trainers then skip the teacher on tied rows, whose token advantages are 0 under
any weights), "all" when it reads every row (a batch-wide ranking; the safe default).
`gear.credit.token_advantages` validates the inputs, calls the method, applies the non-finite
fallback and returns A_i * w_t on valid tokens.
The registry itself (`METHODS`, `register_method`, `CreditInputs`, `MethodOutput`, the signal
names) is `gear.credit.registry`; its names are importable from here too.
A new method is one decorated function::

    @register_method("my_method", requires=("kl",), rows="advantaged")
    def my_method(x: CreditInputs, p: CreditParams) -> MethodOutput:
        return MethodOutput(weights=...)
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from gear.credit import segments as seg
from gear.credit.attribution import answer_span, masked_quantile, tokens_before
from gear.credit.params import CreditParams
from gear.credit.registry import (  # the registry's names, importable from here as before
    METHODS,
    CreditInputs,
    MethodOutput,
    register_method,
)
from gear.credit.registry import ROWS as ROWS
from gear.credit.registry import SIGNALS as SIGNALS
from gear.credit.registry import Method as Method
from gear.credit.registry import MethodFn as MethodFn

# --------------------------------------------------------------------------- shared steps 7-9


def modulate(
    source: Tensor, x: CreditInputs, p: CreditParams, mass_after_clip: bool = False
) -> Tensor:
    """Spec §2.7-2.9: sign-aware modulation, mass preservation, clip.

    Args:
        source: (N, T) a_t in [0, 1] (0 at invalid tokens).
        mass_after_clip: rescale so that the *clipped* weights have mean 1 per row
            (`clipped_to_mass`; ours). The spec clips after rescaling, which loses mass wherever
            the clip binds: a sharp form's one blamed token of a long row (exp, beta 5, clip
            [0, 100], n = 400) would take 108 before the clip and the row -391.6 instead of -400.
    Returns:
        (N, T) weights w_t; 1 at invalid tokens.
    """
    if p.modulation == "linear":
        raw = 1.0 - x.sign * p.alpha * source
    else:
        raw = torch.exp(-x.sign * p.beta * source)
    raw = torch.where(x.valid, raw, 0.0)
    if p.preserve_mass and mass_after_clip:
        return torch.where(x.valid, clipped_to_mass(raw, x.valid, p.w_min, p.w_max), 1.0)
    if p.preserve_mass:
        n = x.valid.sum(dim=1, keepdim=True)
        total = raw.sum(dim=1, keepdim=True)
        raw = raw * (n / torch.where(n > 0, total, 1.0))
    w = raw.clamp(p.w_min, p.w_max)
    return torch.where(x.valid, w, 1.0)


def clipped_to_mass(raw: Tensor, valid: Tensor, lo: float, hi: float, iters: int = 64) -> Tensor:
    """(N, T) w = clamp(s_i * raw, lo, hi) with the one scale s_i per row at which the row's
    valid weights sum to its valid count n_i (needs lo <= 1 <= hi and raw > 0 on valid tokens;
    0 elsewhere). The mass is nondecreasing in s: bisection finds which tokens sit at a bound,
    then s solves the free tokens' linear equation exactly."""
    n = valid.sum(dim=1, keepdim=True).to(raw.dtype)
    smallest = torch.where(valid, raw, torch.inf).min(dim=1, keepdim=True).values
    low = torch.zeros_like(n)
    high = torch.where(torch.isfinite(smallest), hi / smallest, 1.0)  # every weight at hi
    for _ in range(iters):
        mid = (low + high) / 2
        mass = torch.where(valid, (mid * raw).clamp(lo, hi), 0.0).sum(dim=1, keepdim=True)
        low, high = torch.where(mass < n, mid, low), torch.where(mass < n, high, mid)
    scaled = high * raw
    at_lo, at_hi = valid & (scaled <= lo), valid & (scaled >= hi)
    free = valid & ~at_lo & ~at_hi
    free_raw = torch.where(free, raw, 0.0).sum(dim=1, keepdim=True)
    n_lo, n_hi = (m.sum(dim=1, keepdim=True).to(raw.dtype) for m in (at_lo, at_hi))
    rest = n - lo * n_lo - hi * n_hi
    s = torch.where(free_raw > 0, rest / torch.where(free_raw > 0, free_raw, 1.0), high)
    w = torch.where(at_lo, lo, torch.where(at_hi, hi, s * raw))
    return torch.where(valid, w, 0.0)


def segmented(x: CreditInputs, p: CreditParams, onsets: Tensor, stops: Tensor) -> MethodOutput:
    """Spec §2.5-2.9 for given onsets: segments, source values a_t, weights."""
    owner = seg.segment_owner(onsets, stops | ~x.valid | x.cont_start, p.max_segment_len)
    source = seg.spread_from_owner(x.kl_norm, owner, x.kl_norm)
    return MethodOutput(
        weights=modulate(source, x, p),
        source=source,
        onsets=onsets,
        segment_ids=seg.segment_ids_from_owner(onsets, owner),
    )


def grouped(x: CreditInputs, p: CreditParams, starts: Tensor) -> MethodOutput:
    """Segments that tile the valid tokens from `starts`; value = max d~ in the segment."""
    ids = seg.group_ids(starts | x.cont_start, x.valid)
    source = seg.group_max(x.kl_norm, ids)
    return MethodOutput(
        weights=modulate(source, x, p),
        source=source,
        onsets=(starts | x.cont_start) & x.valid,
        segment_ids=ids,
    )


# --------------------------------------------------------------------------- methods


@register_method("grpo", rows="advantaged")
def grpo(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """A_t = A_i on every valid token (Shao et al., DeepSeekMath, arXiv 2402.03300)."""
    return MethodOutput(weights=torch.ones_like(x.valid, dtype=x.advantages.dtype))


@register_method("gear", requires=("kl", "entropy"), rows="advantaged")
def gear(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """GEAR (arXiv 2605.11853), spec §2: KL-spike onsets, segments end at an entropy rise."""
    rises = seg.entropy_rises(x.entropy_norm, x.valid, x.cont_start, p.delta_entropy)
    onsets = seg.rising_edges(x.kl_norm, x.valid, x.cont_start, p.tau_onset, also=rises)
    return segmented(x, p, onsets, stops=rises)


@register_method("gear_token", requires=("kl",), rows="advantaged")
def gear_token(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Token-level ablation of GEAR: no segments, a_t = d~_t."""
    return MethodOutput(weights=modulate(x.kl_norm, x, p), source=x.kl_norm)


@register_method("gear_kl_only", requires=("kl",), rows="advantaged")
def gear_kl_only(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Ablation: a segment ends where d~ falls below tau_onset, not at an entropy rise."""
    onsets = seg.rising_edges(x.kl_norm, x.valid, x.cont_start, p.tau_onset)
    return segmented(x, p, onsets, stops=x.kl_norm < p.tau_onset)


@register_method("gear_entropy_only", requires=("kl", "entropy"), rows="advantaged")
def gear_entropy_only(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Ablation: onsets are rising edges of H~ >= tau_entropy; the value is still d~ at the onset.

    Segments end as in `gear` (entropy rise, continuation start, invalid token, next onset).
    """
    rises = seg.entropy_rises(x.entropy_norm, x.valid, x.cont_start, p.delta_entropy)
    onsets = seg.rising_edges(x.entropy_norm, x.valid, x.cont_start, p.tau_entropy)
    return segmented(x, p, onsets, stops=rises)


# --------------------------------------------------------------------------- first departure
# Extensions (issue 27, docs/spec.md "Extensions"), not the paper's definition: a teacher that
# knows the right answer disagrees with everything that follows a wrong step, often more than
# with the step itself, so GEAR's "every spike opens a segment" puts blame on the consequences.


def departures(x: CreditInputs, p: CreditParams) -> tuple[Tensor, Tensor]:
    """Departure onsets and realignment stops, (N, T) bool each.

    The student has *realigned* at t once `realign_len` consecutive tokens up to t lie below
    `tau_onset`. A *departure* is the first KL rising edge (spec §2.4 without the entropy
    re-arm) of a continuation or after a realignment; later spikes before the next
    realignment belong to it and open nothing.
    """
    run = seg.below_run_length(x.kl_norm, x.valid, x.cont_start, p.tau_onset)
    realigned = run >= p.realign_len
    edges = seg.rising_edges(x.kl_norm, x.valid, x.cont_start, p.tau_onset)
    onsets = seg.first_in_span(edges, realigned | ~x.valid | x.cont_start)
    return onsets, realigned


@register_method("gear_departure", requires=("kl",), rows="advantaged")
def gear_departure(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """First departure: a departure's segment absorbs later spikes and runs until the student
    realigns, the continuation ends or `max_segment_len`; it takes the departure's d~."""
    onsets, realigned = departures(x, p)
    return segmented(x, p, onsets, stops=realigned)


@register_method("gear_departure_point", requires=("kl",), rows="advantaged")
def gear_departure_point(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """The departure carries what it caused: its own run (the departure until d~ first falls
    below `tau_onset`) takes the largest d~ of its span (departure to realignment); the rest
    of the span takes 0, explained away by the departure; tokens outside spans keep d~_t."""
    onsets, realigned = departures(x, p)
    ends = ~x.valid | x.cont_start
    span = seg.segment_owner(onsets, realigned | ends, p.max_segment_len)
    run = seg.segment_owner(onsets, (x.kl_norm < p.tau_onset) | ends, p.max_segment_len)
    span_max = seg.group_max(x.kl_norm, span)
    source = torch.where(run >= 0, span_max, torch.where(span >= 0, 0.0, x.kl_norm))
    return MethodOutput(
        weights=modulate(source, x, p),
        source=source,
        onsets=onsets,
        segment_ids=seg.segment_ids_from_owner(onsets, run),
    )


@register_method("gear_departure_blame", requires=("kl",), rows="advantaged")
def gear_departure_blame(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Sign-aware: a failed row (A < 0) is explained by its first departure
    (`gear_departure_point`); a successful row had no error to place, so its tokens keep their
    own d~_t (`gear_token`: credit moves away from each divergent token)."""
    point = gear_departure_point(x, p)
    failed = x.advantages[:, None] < 0
    source = torch.where(failed, point.source, x.kl_norm)  # type: ignore[arg-type]
    return MethodOutput(
        weights=modulate(source, x, p),
        source=source,
        onsets=point.onsets & failed,  # type: ignore[operator]
        segment_ids=torch.where(failed, point.segment_ids, -1),  # type: ignore[arg-type]
    )


@register_method("turn", requires=("kl",), rows="advantaged")
def turn(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Turn-level baseline: one segment per continuation (assistant turn); value = max d~."""
    return grouped(x, p, starts=x.cont_start)


@register_method("fixed", requires=("kl",), rows="advantaged")
def fixed(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Fixed-length baseline: each continuation cut into `fixed_len` pieces; value = max d~."""
    pos = torch.arange(x.valid.shape[1], device=x.valid.device).expand_as(x.valid)
    cont_begin = torch.where(x.cont_start, pos, 0).cummax(dim=1).values
    return grouped(x, p, starts=(pos - cont_begin) % p.fixed_len == 0)


@register_method("random", requires=("kl", "entropy"), rows="advantaged")
def random(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Random-boundary baseline: per row as many segments as `gear` finds, at random valid
    positions (seeded by `seed`); segments end as in `gear`'s stop rule without entropy (next
    start, continuation start, invalid token, max_segment_len); value = d~ at the start."""
    k = gear(x, p).onsets.sum(dim=1, keepdim=True)  # type: ignore[union-attr]
    gen = torch.Generator(device="cpu").manual_seed(p.seed)
    keys = torch.rand(x.valid.shape, generator=gen, dtype=torch.float64).to(x.valid.device)
    keys = torch.where(x.valid, keys, 2.0)  # invalid tokens sort last
    rank = keys.argsort(dim=1).argsort(dim=1)
    starts = x.valid & (rank < k)
    return segmented(x, p, starts, stops=torch.zeros_like(starts))


#: the methods that draw from `seed`: trainers add the step to it, so each step draws anew (as
#: the gym does), rather than repeating one permutation for rows of the same length
STEP_SEEDED = ("random", "random_shape")


# it reads the signals and rows of its `shape_method` (`CreditParams.required_signals`,
# `signal_rows`), so none here
@register_method("random_shape")
def random_shape(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Shape-matched placebo (ours): the weights of `shape_method` (run with the same params),
    each row's valid weights moved to a random permutation of the row's valid positions
    (seeded by `seed`). Every row keeps its multiset of weights, so the same concentration,
    the same mass and the same sign-awareness; only where the weight lands is random. A
    candidate that beats it places its weight better than chance at equal strength.

    Shapes: the candidate's weights (N, T) -> permuted weights (N, T), 1 at invalid tokens."""
    w = METHODS[p.shape_method].fn(x, replace(p, method=p.shape_method)).weights
    gen = torch.Generator(device="cpu").manual_seed(p.seed)
    keys = torch.rand(x.valid.shape, generator=gen, dtype=torch.float64).to(x.valid.device)
    src = (~x.valid).to(torch.int8).argsort(dim=1, stable=True)  # valid positions, in order
    dst = torch.where(x.valid, keys, 2.0).argsort(dim=1)  # valid positions, in random order
    moved = torch.ones_like(w).scatter(1, dst, w.gather(1, src))  # invalid slots take 1s
    return MethodOutput(weights=torch.where(x.valid, moved, 1.0))


@register_method("rlsd", requires=("student_logprobs", "teacher_logprobs"), rows="advantaged")
def rlsd(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Self-Distilled RLVR (arXiv 2604.03128): delta_t = log pi_T(y_t) - log pi_S(y_t),
    w_t = (1 - lambda) + lambda * clip(exp(sigma * delta_t), 1 - eps, 1 + eps)."""
    assert x.student_logprobs is not None and x.teacher_logprobs is not None
    delta = torch.where(x.valid, x.teacher_logprobs - x.student_logprobs, 0.0)
    ratio = torch.exp(x.sign * delta).clamp(1 - p.rlsd_eps, 1 + p.rlsd_eps)
    w = (1 - p.rlsd_lambda) + p.rlsd_lambda * ratio
    return MethodOutput(weights=torch.where(x.valid, w, 1.0))


@register_method("entropy_top", requires=("entropy",))
def entropy_top(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Keep the top `rho` highest-entropy valid tokens of the batch (arXiv 2506.01939):
    w = 1 there, 0 on other valid tokens. The count is ceil(rho * valid tokens)."""
    assert x.entropy is not None
    k = math.ceil(p.rho * int(x.valid.sum()))
    flat = torch.where(x.valid, x.entropy, -torch.inf).flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.topk(k).indices] = True
    keep = keep.view_as(x.valid) & x.valid
    w = torch.where(x.valid, keep.to(x.advantages.dtype), 1.0)
    return MethodOutput(weights=w)


def bilevel(x: CreditInputs, p: CreditParams, influence: Tensor) -> MethodOutput:
    """OAR's conservative bi-level reshaping (Li et al., arXiv 2601.07408) of a token's
    influence on the final answer, (N, T) -> weights (N, T). The valid tokens before the answer
    span (`answer_mask`; all of them where it is empty, as when the reference is appended;
    without it the last `oar_answer_len` valid tokens) are reshaped; the span and what follows
    it keep w = 1: s = min-max of log1p|influence|, tau its `oar_quantile`; w = max(s / tau,
    `oar_floor`) below tau, 1 + `oar_boost` (s - tau) / (1 - tau) from tau on; then scaled to
    mean 1 over those tokens. Not sign-aware: w does not depend on A."""
    span = x.answer_mask if x.answer_mask is not None else answer_span(x.valid, p.oar_answer_len)
    scored = tokens_before(span, x.valid)
    s = seg.minmax_normalise(torch.log1p(influence.abs()), scored)
    tau = masked_quantile(s, scored, p.oar_quantile)
    low = s < tau  # only possible where tau > 0
    suppressed = (s / torch.where(tau > 0, tau, 1.0)).clamp(min=p.oar_floor)
    boosted = 1.0 + p.oar_boost * (s - tau) / torch.where(tau < 1, 1.0 - tau, 1.0)
    w = torch.where(scored, torch.where(low, suppressed, boosted), 0.0)
    n = scored.sum(dim=1, keepdim=True)
    total = w.sum(dim=1, keepdim=True)  # >= 1 where n > 0: the row's largest s is >= tau
    w = w * (n / torch.where(n > 0, total, 1.0))
    return MethodOutput(weights=torch.where(scored, w, 1.0), source=s)


@register_method("oar_g", requires=("influence",), rows="advantaged")
def oar_g(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """OAR-G: `bilevel` of each token's input-gradient influence on the answer's
    log-probability (one backward, `gear.credit.attribution.input_gradient_influence`)."""
    assert x.influence is not None
    return bilevel(x, p, x.influence)


@register_method("oar_p", requires=("perturbation",), rows="advantaged")
def oar_p(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """OAR-P, the authors' other strategy: `bilevel` of how far the final answer moves when the
    token is replaced by the pad token (`oar_pfinal`; one forward per token,
    `gear.credit.attribution.perturbation_influence`)."""
    assert x.perturbation is not None
    return bilevel(x, p, x.perturbation)


@register_method("first_error", requires=("error_mask",), rows="advantaged")
def first_error(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """Credit from a step checker (ours, issue 58; not the paper's): a failed row (A < 0) puts
    its blame on the tokens of its first wrong step (`error_mask`), a_t = 1 there and 0 elsewhere,
    through the sign-aware modulation and mass preservation of spec §2.7-2.9. A correct row, or
    a failed row the checker could not place, has a_t = 0 everywhere: w = 1, GRPO's advantage.
    With the default params these are the weights of issue 51's oracle (the clip never binds
    there). The mass is preserved after the clip (`clipped_to_mass`), so a sharp form keeps each row's
    mass exactly; the spec's order (rescale, then clip) would lose it where the clip binds. The
    checker decides the span: the first wrong token (arithmetic's default) or the whole step.
    The credit gym's winning positive control is the sharp form (`modulation='exp'`, `beta=5`,
    `w_min=0`, `w_max=100`) over the whole first wrong step."""
    assert x.error_mask is not None
    failed = (x.advantages < 0)[:, None]
    source = torch.where(x.valid & failed & (x.error_mask > 0), 1.0, 0.0).to(x.advantages.dtype)
    return MethodOutput(weights=modulate(source, x, p, mass_after_clip=True), source=source)


@register_method("lambda_grpo", requires=("prefix_count",), rows="advantaged")
def lambda_grpo(x: CreditInputs, p: CreditParams) -> MethodOutput:
    """lambda-GRPO (Sullivan, arXiv 2509.21154): each token's advantage is divided by c_t, the
    number of the group's rows that share the row's prefix through that token (`prefix_count`,
    the row itself included). Rows sharing a prefix have the same gradient there, so GRPO moves
    a prefix node shared by c rows by the *sum* of their advantages; lambda-GRPO moves it by
    their *mean*: each node of the group's prefix tree counts once, whatever its visit count.
    No rescaling, as in the authors' code (the scale multiplies the per-token loss, which is
    then averaged over the row's token count): a row's mass is A_i * sum_t 1/c_t, below GRPO's
    A_i * n_i by its shared tokens; on tokens no other row shares (c_t = 1) it is GRPO. Needs
    no teacher. Source a_t = 1 - 1/c_t, the share of the node's visits that are other rows'."""
    assert x.prefix_count is not None
    c = x.prefix_count.clamp(min=1.0)
    weights = torch.where(x.valid, 1.0 / c, 1.0)
    return MethodOutput(weights=weights, source=torch.where(x.valid, 1.0 - 1.0 / c, 0.0))

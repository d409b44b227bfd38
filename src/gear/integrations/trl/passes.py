"""The scoring passes of one TRL batch: what the credit reads beside the sequence advantages.

The signal pass (`token_signals`: the student's states, one teacher forward, a contrast teacher's,
then the chunked signal kernel), OAR's influence pass (`influence`) and a step checker's mask
(`error_mask`), each on the batch TRL generated (`output`: its (B, P) prompts and (B, T)
completions). `CreditBatch` collects what they give for the credit core.

Every function takes the trainer and reaches the model through the trainer's seams
(`_final_hidden`, `_teacher_pass`, `_signals`, `_teacher`), called on the trainer, so a test
that patches one of them sees every pass go through it (trainer.py lists the seams).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gear.credit import TokenSignals
from gear.credit.attribution import tokens_before
from gear.integrations.trl.credit import ContrastSignals, without_unhinted_rows
from gear.integrations.trl.forwards import eval_mode
from gear.integrations.trl.vllm_teacher import (
    TeacherLogprobs,
    score_rows,
    teacher_logprobs,
    teacher_sequences,
)
from gear.spans import answer_spans, error_token_mask, mask_token_id


@dataclass
class CreditBatch:
    """One generation batch's inputs to the credit, filled pass by pass; None: the pass did
    not run (the run's method needs none of it). Tensors are (B, T) unless said.

    Attributes:
        valid: bool policy tokens (completion minus tool output); turn_starts: bool, a policy
            token right after tool output, or None without tools (`response_mask`).
        teacher: (ids, mask, has_hint) of the teacher's (B, L) inputs and (B,) bool.
        contrast: (ids, mask) of the contrast teacher's (B, L) inputs (a wrong answer).
        scored: (B,) bool, the rows the passes ran on (`credit.scored_rows`), None for all.
        signals: the signal pass's `TokenSignals` (a `ContrastSignals` with a contrast teacher).
        influence: OAR-G's; perturbation: OAR-P's; answer_mask: bool, OAR's answer span.
        error_mask: bool, each row's first wrong step as the step checker places it.
    """

    valid: Tensor
    turn_starts: Tensor | None
    teacher: tuple[Tensor, Tensor, Tensor] | None = None
    contrast: tuple[Tensor, Tensor] | None = None
    scored: Tensor | None = None
    signals: TokenSignals | None = None
    influence: Tensor | None = None
    perturbation: Tensor | None = None
    answer_mask: Tensor | None = None
    error_mask: Tensor | None = None

    @classmethod
    def of(cls, output: dict[str, Any]) -> CreditBatch:
        return cls(*response_mask(output))

    @property
    def credit_signals(self) -> TokenSignals | None:
        """The signals the credit reads: a row without a hint (no ground truth) has no teacher,
        so its teacher signals become NaN (`credit.without_unhinted_rows`: weight 1)."""
        if self.signals is None or self.teacher is None:
            return self.signals
        return without_unhinted_rows(self.signals, self.teacher[2])


def micro_batch(args: Any, mode: str) -> int:
    """Rows per forward of the extra passes (teacher, student, influence): the run's own
    per-device batch of that mode."""
    if mode == "train":
        return args.per_device_train_batch_size
    return args.per_device_eval_batch_size


# ------------------------------------------------------------------------------- signal pass


@torch.no_grad()
def token_signals(
    trainer: Any,
    output: dict[str, Any],
    teacher: tuple[Tensor, Tensor, Tensor] | None,
    valid: Tensor,
    mode: str,
    stats: dict[str, float],
    contrast: tuple[Tensor, Tensor] | None = None,
    scored: Tensor | None = None,
) -> TokenSignals:
    """One student pass (or the states of generation or of TRL's pass, captured) and, given
    `teacher` = (ids, mask, has_hint), one teacher pass (eval mode, like the student's);
    then the chunked signals at the (B, T) `valid` policy tokens. Given `contrast` = (ids,
    mask) of the contrast teacher (a wrong answer), one more teacher pass and its (B, T) KL
    by the same kernel, returned as `ContrastSignals.contrast_kl` (`gear/time_contrast`:
    that pass and its signals). Given `scored` (B,) bool, every pass runs on those rows
    only; the other rows' signals are 0."""
    student_hidden = trainer._student.take(output)
    if scored is not None:
        rows = scored.nonzero().squeeze(1)
        if rows.numel() == 0:  # every row tied: nothing to score, every pass took 0 s
            for name in ("time_student", "time_teacher", "time_signals", "teacher_tokens"):
                stats[f"gear/{name}"] = 0.0
            if contrast is not None:
                stats["gear/time_contrast"] = 0.0
            return unscored_signals(valid, with_teacher=teacher is not None, contrast=contrast)
        signals = scored_signals(
            trainer,
            rows_of(output, rows),
            None if teacher is None else tuple(x[rows] for x in teacher),
            valid[rows],
            mode,
            stats,
            None if contrast is None else tuple(x[rows] for x in contrast),
            None if student_hidden is None else student_hidden[rows],
        )
        return signals_in_rows(signals, rows, valid.shape[0])
    return scored_signals(trainer, output, teacher, valid, mode, stats, contrast, student_hidden)


@torch.no_grad()
def scored_signals(
    trainer: Any,
    output: dict[str, Any],
    teacher: tuple[Tensor, ...] | None,
    valid: Tensor,
    mode: str,
    stats: dict[str, float],
    contrast: tuple[Tensor, ...] | None,
    student_hidden: Tensor | None,
) -> TokenSignals:
    """`token_signals` of every row of `output`, the student's states given (or None)."""
    completion_ids = output["completion_ids"]
    n_keep = completion_ids.size(1)
    batch_size = micro_batch(trainer.args, mode)
    t0 = time.perf_counter()
    forward = student_hidden is None
    if forward:
        with eval_mode(trainer.accelerator.unwrap_model(trainer.model)):
            student_hidden = trainer._final_hidden(
                trainer.model,
                torch.cat([output["prompt_ids"], completion_ids], dim=1),
                torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                n_keep,
                batch_size,
            )
    t1 = time.perf_counter()
    scored = None
    if teacher is not None:
        scored = trainer._teacher_pass(teacher[0], teacher[1], output, batch_size)
    t2 = time.perf_counter()
    signals = teacher_signals(trainer, student_hidden, scored, output, valid)
    stats["gear/time_student"] = t1 - t0 if forward else 0.0
    stats["gear/time_teacher"], stats["gear/time_signals"] = t2 - t1, time.perf_counter() - t2
    # the tokens the teacher pass read (its input rows, prompts included): its cost per token
    stats["gear/teacher_tokens"] = 0.0 if teacher is None else float(teacher[1].sum())
    if contrast is not None:
        t3 = time.perf_counter()
        scored = trainer._teacher_pass(contrast[0], contrast[1], output, batch_size)
        contrast_kl = teacher_signals(trainer, student_hidden, scored, output, valid).kl
        signals = ContrastSignals(**vars(signals), contrast_kl=contrast_kl)
        stats["gear/time_contrast"] = time.perf_counter() - t3
    return signals


def teacher_pass(
    trainer: Any, ids: Tensor, mask: Tensor, output: dict[str, Any], batch_size: int
) -> Tensor | TeacherLogprobs:
    """The teacher on its (B, L) input `ids` / `mask`: its (B, T, H) final hidden states
    (`teacher_engine='trainer'`, eval mode), or its log-probs of the completion tokens scored
    by TRL's vLLM engine (`'vllm'`: one prefill per row, `vllm_teacher`)."""
    args = trainer.args
    if args.teacher_engine == "vllm":
        k = args.kl_topk if args.kl_estimator == "topk" else 0
        sequences, starts = teacher_sequences(ids, mask, output["completion_mask"])
        scored = score_rows(trainer.vllm_generation, trainer.accelerator, sequences, starts, k)
        return teacher_logprobs(scored, output["completion_mask"], k)
    with eval_mode(trainer.accelerator.unwrap_model(trainer._teacher())):
        n_keep = output["completion_ids"].size(1)
        return trainer._final_hidden(trainer._teacher(), ids, mask, n_keep, batch_size)


def teacher_signals(
    trainer: Any,
    student_hidden: Tensor,
    teacher: Tensor | TeacherLogprobs | None,
    output: dict[str, Any],
    valid: Tensor,
) -> TokenSignals:
    """Signals at the (B, T) `valid` tokens from the student's (B, T, H) states and the
    teacher's states or vLLM log-probs (`teacher_pass`; None: the student's alone). With
    vLLM's log-probs the student side of k1 / k3 is vLLM's too: the log-probs it sampled
    the tokens with (TRL's `sampling_per_token_logps`), so the two engines' numerics do not
    enter the KL (docs/spec.md, 'Teacher engines')."""
    completion_ids = output["completion_ids"]
    if not isinstance(teacher, TeacherLogprobs):
        return trainer._signals(student_hidden, teacher, completion_ids, mask=valid)
    sampled = output.get("sampling_per_token_logps")
    if sampled is None and not trainer._gear_warned_no_sampling_logprobs:
        trainer._gear_warned_no_sampling_logprobs = True
        warnings.warn(
            "teacher_engine='vllm': the batch has no vLLM sampling log-probs "
            "(sampling_per_token_logps; a rollout_func that returns none?), so the KL "
            "compares the trainer's student log-probs with vLLM's teacher log-probs",
            stacklevel=2,
        )
    return trainer._forwards.logprob_signals(
        trainer.model, student_hidden, completion_ids, teacher, sampled, mask=valid
    )


# ------------------------------------------------------------------------------- OAR, checker


def influence(
    trainer: Any,
    inputs: list[dict[str, Any]],
    output: dict[str, Any],
    valid: Tensor,
    mode: str,
    stats: dict[str, float],
    scored: Tensor | None,
    kernel: Callable[..., Tensor],
) -> tuple[Tensor, Tensor]:
    """(B, T) influence of each completion token on the row's answer span
    (`gear.spans.answer_spans` under `credit_oar_span`), eval mode: OAR-G's input gradient
    of its log-probability (`kernel` = `forwards.answer_influence`) or OAR-P's change of it
    when the token is replaced by the pad token (`forwards.answer_perturbation`,
    `credit_oar_pfinal`), as `trainer._influence_signal` says, and the (B, T) bool answer span
    inside the completions. Given `scored` (B,) bool, the influence pass runs on those rows
    only (the others' influence is 0). Scored rows whose answer is not found (scored on their
    last `credit_oar_answer_len` tokens) are counted in `gear/oar_span_fallback`; the seconds
    go to `gear/time_influence`."""
    t0 = time.perf_counter()
    params, tokenizer = trainer.credit_params, trainer._tokenizer
    references = None
    if params.oar_span == "reference":
        column = trainer.args.answer_column
        references = [trainer._gear_reference_text(row.get(column)) for row in inputs]
    spans = answer_spans(
        params,
        tokenizer,
        output["completion_ids"],
        output["completion_mask"],
        valid,
        trainer._gear_answer_span,
        references,
    )
    ids = torch.cat([output["prompt_ids"], spans.completion_ids], dim=1)
    mask = torch.cat([output["prompt_mask"], spans.completion_mask], dim=1)
    rows = None if scored is None else scored.nonzero().squeeze(1)
    found = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    if rows is None or rows.numel() > 0:
        keep = slice(None) if rows is None else rows
        forwards, model = trainer._forwards, trainer.model
        batch_size = micro_batch(trainer.args, mode)
        with eval_mode(trainer.accelerator.unwrap_model(model)):
            if trainer._influence_signal == "perturbation":
                masked = tokens_before(spans.answer_mask, valid)  # the tokens OAR reshapes
                masked = torch.nn.functional.pad(masked, (0, spans.span.shape[1] - valid.shape[1]))
                part = kernel(
                    forwards,
                    model,
                    ids[keep],
                    mask[keep],
                    spans.span[keep],
                    masked[keep],
                    mask_token_id(tokenizer),
                    params.oar_pfinal,
                    batch_size * ids.shape[1],  # a training forward's tokens
                )
            else:
                part = kernel(forwards, model, ids[keep], mask[keep], spans.span[keep], batch_size)
        found[keep] = part[:, : valid.shape[1]].to(found.dtype)
    fallback = (
        spans.fallback if scored is None else spans.fallback & scored.to(spans.fallback.device)
    )
    stats["gear/oar_span_fallback"] = float(fallback.sum())
    stats["gear/time_influence"] = time.perf_counter() - t0
    return found, spans.answer_mask


def error_mask(
    trainer: Any,
    inputs: list[dict[str, Any]],
    output: dict[str, Any],
    valid: Tensor,
    stats: dict[str, float],
) -> Tensor:
    """(B, T) bool: each row's first wrong step in tokens, as the step checker places it in
    the completion's text (`gear.spans.error_token_mask`), policy tokens only. Failed rows
    (advantage < 0) it places are counted in `gear/first_error_placed`, those it cannot in
    `gear/first_error_unplaced` (they keep GRPO's advantage); seconds in
    `gear/time_step_checker`."""
    t0 = time.perf_counter()
    column = trainer.args.ground_truth_column
    truths = trainer._gear_env_ground_truths or [row.get(column) for row in inputs]
    mask = error_token_mask(
        trainer._tokenizer,
        output["completion_ids"],
        output["completion_mask"],
        trainer._gear_step_checker,
        truths,
    ) & valid.to(output["completion_ids"].device)
    failed = output["advantages"] < 0
    placed = mask.any(dim=1).to(failed.device)
    stats["gear/first_error_placed"] = float((failed & placed).sum())
    stats["gear/first_error_unplaced"] = float((failed & ~placed).sum())
    stats["gear/time_step_checker"] = time.perf_counter() - t0
    return mask


# ------------------------------------------------------------------------------- rows, masks


def response_mask(output: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """(B, T) policy tokens (completion minus tool output) and turn starts (a policy token right
    after tool output), or None without tools."""
    valid = output["completion_mask"].bool()
    tool_mask = output.get("tool_mask")
    if tool_mask is None:
        return valid, None
    policy = tool_mask.bool()
    valid = valid & policy
    after_tool = torch.zeros_like(valid)
    after_tool[:, 1:] = ~policy[:, :-1]
    return valid, valid & after_tool


def rows_of(output: dict[str, Any], rows: Tensor) -> dict[str, Any]:
    """The batch `output` restricted to `rows`: every (B, ...) tensor indexed, the rest kept."""
    B = output["completion_ids"].size(0)
    return {
        k: v[rows] if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == B else v
        for k, v in output.items()
    }


def signals_in_rows(signals: TokenSignals, rows: Tensor, n: int) -> TokenSignals:
    """(len(rows), T) signals placed at `rows` of (n, T) ones, 0 in the other rows."""

    def place(v: Tensor | None) -> Tensor | None:
        if v is None:
            return None
        return v.new_zeros(n, *v.shape[1:]).index_copy_(0, rows, v)

    return dataclasses.replace(
        signals, **{f.name: place(getattr(signals, f.name)) for f in dataclasses.fields(signals)}
    )


def unscored_signals(
    valid: Tensor, with_teacher: bool, contrast: tuple[Tensor, ...] | None
) -> TokenSignals:
    """The signals of a batch none of whose rows is scored: 0 everywhere."""
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    teacher = zeros if with_teacher else None
    signals = TokenSignals(
        kl=teacher, entropy=zeros, student_logprobs=zeros, teacher_logprobs=teacher
    )
    if contrast is not None:
        return ContrastSignals(**vars(signals), contrast_kl=zeros)
    return signals

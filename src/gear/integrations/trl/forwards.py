"""GEAR's forwards in TRL: final hidden states, the LM heads, and the chunked signal kernel.

`Forwards` holds what these need and nothing else (the accelerator, the model's logit
conventions, the sampling temperature, the kernel's estimator and chunking, prefix sharing);
the trainer builds it once and hands it to the code that runs forwards (its own signal pass
and `self_distill`). The models are passed at each call: under FSDP the trainer's `model` is
replaced when training starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import maybe_gather_lm_head_ctx

from gear.credit import TokenSignals
from gear.credit.attribution import (
    input_gradient_influence,
    perturbation_influence,
    span_logprob,
    span_positions,
)
from gear.credit.signals import signals_from_hidden, signals_from_teacher_logprobs
from gear.integrations.trl.states import dropout_active
from gear.modeling import LogitConventions
from gear.modeling.lora import merged_lora
from gear.modeling.model import capture_final_hidden, lm_head, only_capture, takes_position_ids
from gear.modeling.model import unwrap as unwrap_model
from gear.modeling.positions import padding_free_positions, prefix_sharing_blocker
from gear.prefix import plain_hidden, prefix_cache, prefix_shared_hidden

Heads = tuple[Tensor, Tensor | None, Tensor, Tensor | None]


@dataclass(frozen=True)
class Forwards:
    """What GEAR's forwards and signal kernels need, fixed when the trainer is built.

    temperature: the temperature generation sampled with (`sampling_temperature`), before the
        model's logit scale, which `conventions.signal_kwargs` folds in.
    """

    accelerator: Any
    conventions: LogitConventions
    temperature: float
    estimator: str
    topk: int
    chunk_size: int
    prefix_sharing: bool
    gradient_checkpointing_kwargs: dict | None = None
    merge_lora: bool = True

    def kernel_kwargs(self) -> dict[str, Any]:
        """`temperature` and `softcap` for `gear.credit.signals` (the logit scale folded in)."""
        return self.conventions.signal_kwargs(self.temperature)

    def hidden(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        n_keep: int,
        batch_size: int | None = None,
        grad: bool = False,
    ) -> Tensor:
        """(B, n_keep, H) final hidden states predicting the last n_keep tokens of the (B, L)
        `input_ids` (`final_hidden`; prefix sharing for no-grad passes when configured)."""
        return final_hidden(
            self.accelerator,
            model,
            input_ids,
            attention_mask,
            n_keep,
            batch_size,
            grad=grad,
            gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs,
            share_prefix=self.prefix_sharing and not grad,
            merge_lora=self.merge_lora and not grad,
        )

    @contextmanager
    def heads(self, student: nn.Module, teacher: nn.Module | None) -> Iterator[Heads]:
        """(W_S, b_S, W_T, b_T) of the student's and the teacher's LM heads, gathered if sharded:
        W (V, H), b (V,) or None. `teacher` None: the student's head (the current teacher)."""
        s_head = self.accelerator.unwrap_model(student).get_output_embeddings()
        t_head = s_head if teacher is None else _unwrapped(teacher).get_output_embeddings()
        with maybe_gather_lm_head_ctx(s_head.weight, s_head.bias, t_head.weight, t_head.bias):
            yield (*_full(s_head.weight, s_head.bias), *_full(t_head.weight, t_head.bias))

    def signals(
        self,
        student: nn.Module,
        teacher: nn.Module | None,
        student_hidden: Tensor,
        teacher_hidden: Tensor | None,
        token_ids: Tensor,
        mask: Tensor | None = None,
    ) -> TokenSignals:
        """Per-token KL / entropy / log-probs (spec §1) of the (B, T) `token_ids` from (B, T, H)
        final hidden states (`teacher_hidden` None: the student's entropy and log-probs only),
        computed at the (B, T) `mask` positions (0 elsewhere). `student` / `teacher` give the
        LM heads (`teacher` None: the student's)."""
        with self.heads(student, teacher) as (ws, bs, wt, bt):
            separate = wt is not ws or bt is not bs
            # The LM-head projections run in the run's precision, as TRL's own logits do under
            # autocast (bf16: 4x faster on a CPU with AVX512-BF16); the kernel does the softmax
            # and every reduction in float32. Weights are cast once, not once per chunk.
            dtype = projection_dtype(self.accelerator, ws)
            ws, bs = _cast(ws, bs, dtype)
            wt, bt = _cast(wt, bt, dtype) if separate else (ws, bs)
            hs = student_hidden.to(dtype)
            ht = None if teacher_hidden is None else teacher_hidden.to(dtype)
            return signals_from_hidden(
                hs,
                ht,
                ws,
                token_ids,
                lm_head_bias=bs,
                teacher_lm_head_weight=wt if separate else None,
                teacher_lm_head_bias=bt if separate else None,
                estimator=self.estimator,
                topk=self.topk,
                chunk_size=self.chunk_size,
                mask=mask,
                **self.kernel_kwargs(),
            )

    def logprob_signals(
        self,
        student: nn.Module,
        student_hidden: Tensor,
        token_ids: Tensor,
        teacher: Any,
        student_logprobs: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> TokenSignals:
        """`signals` with the teacher given as log-probs (`vllm_teacher.TeacherLogprobs`, a
        teacher scored by vLLM) instead of hidden states; `student_logprobs` (B, T), the
        sampling engine's log-probs of the tokens, replace the student's own in the KL
        (`gear.credit.signals.signals_from_teacher_logprobs`)."""
        with self.heads(student, None) as (ws, bs, _, _):
            dtype = projection_dtype(self.accelerator, ws)
            ws, bs = _cast(ws, bs, dtype)
            return signals_from_teacher_logprobs(
                student_hidden.to(dtype),
                ws,
                token_ids,
                teacher.logprobs,
                teacher_topk_ids=teacher.topk_ids,
                teacher_topk_logprobs=teacher.topk_logprobs,
                student_logprobs=student_logprobs,
                lm_head_bias=bs,
                estimator=self.estimator,
                chunk_size=self.chunk_size,
                mask=mask,
                **self.kernel_kwargs(),
            )


def answer_influence(
    forwards: Forwards,
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    span: Tensor,
    batch_size: int | None = None,
) -> Tensor:
    """(B, T) OAR-G influence of each of the last T tokens (`gear.credit.attribution`): one
    forward and one input-gradient backward per chunk of `batch_size` rows, no parameter
    gradients.

    Args:
        input_ids, attention_mask: (B, L) prompt + completion (and, under
            `oar_span='reference'`, the appended reference), the completion its last T columns.
        span: (B, T) bool, the answer span among the last T columns (`gear.spans`): phi is the
            mean log-probability of its tokens under the model's raw logits (the authors'
            objective; the sampling temperature is not applied, the model's own logit
            conventions are).
    Logits are formed only at the span's positions (B, longest span, V), never (B, L, V).
    """
    inner = unwrap_model(forwards.accelerator.unwrap_model(model))
    T = span.shape[1]
    idx, real = span_positions(span)
    raw = forwards.conventions.signal_kwargs(1.0)  # softcap / logit scale, no temperature
    targets = input_ids[:, -T:].gather(1, idx)
    head, positions = lm_head(inner), takes_position_ids(inner)
    batch_size = batch_size or input_ids.size(0)
    checkpointed = checkpointing(inner)  # reentrant checkpointing refuses autograd.grad
    no_checkpointing = (
        disable_gradient_checkpointing(inner, forwards.gradient_checkpointing_kwargs)
        if checkpointed
        else nullcontext()
    )
    out = []
    with no_checkpointing, forwards.accelerator.autocast():
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            mask = attention_mask[rows]
            extra = {"position_ids": padding_free_positions(mask)} if positions else {}

            def score(
                embeds: Tensor, rows: slice = rows, mask: Tensor = mask, extra=extra
            ) -> Tensor:
                with capture_final_hidden(inner, lambda h: h[:, -T - 1 : -1]) as got:
                    inner(
                        inputs_embeds=embeds,
                        attention_mask=mask,
                        logits_to_keep=1,
                        use_cache=False,
                        **extra,
                    )
                h = only_capture(got, inner)  # (b, T, H), predicting each completion token
                h = h.gather(1, idx[rows, :, None].expand(-1, -1, h.shape[-1]))
                return span_logprob(head(h), targets[rows], real[rows], **raw)

            embeds = inner.get_input_embeddings()(input_ids[rows])
            out.append(input_gradient_influence(score, embeds)[:, -T:])
    return torch.cat(out)


def answer_perturbation(
    forwards: Forwards,
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    span: Tensor,
    scored: Tensor,
    pad_id: int,
    mode: str,
    tokens_per_forward: int,
) -> Tensor:
    """(B, T) OAR-P influence of each `scored` token of the last T columns
    (`gear.credit.attribution.perturbation_influence`): the token replaced by `pad_id`, one
    masked copy per token, no gradient; a chunk of copies computes its shared prefix once when
    `forwards.prefix_sharing` is on (`gear.prefix`; exact, else the plain forward), and LoRA
    runs merged as in the teacher pass.

    The copies run on the unwrapped model: a row's number of forwards depends on its length,
    so they must not be collective (DDP's buffer broadcast); the trainer refuses sharded models.

    Args:
        input_ids, attention_mask: (B, L) prompt + completion (+ the appended reference).
        span: (B, T) bool, the answer span; scored: (B, T) bool, the tokens to mask, all before
            each row's span. phi is read from the model's raw logits (its own logit conventions,
            no sampling temperature), as OAR-G's.
    """
    unwrapped = forwards.accelerator.unwrap_model(model)
    inner = unwrap_model(unwrapped)

    def hidden(ids: Tensor, n_keep: int) -> Tensor:
        return forwards.hidden(unwrapped, ids, torch.ones_like(ids), n_keep)

    with torch.no_grad(), forwards.accelerator.autocast():
        return perturbation_influence(
            hidden,
            lm_head(inner),
            input_ids,
            attention_mask,
            span,
            scored,
            pad_id,
            mode,
            tokens_per_forward,
            **forwards.conventions.signal_kwargs(1.0),  # softcap / logit scale, no temperature
        )


def shared_prompt_logps(
    accelerator: Any,
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
) -> tuple[Tensor, Tensor | None] | None:
    """TRL's per-token log-probs (and entropies) of the last `logits_to_keep` tokens, with each
    prompt shared by several rows (a GRPO group) run once: per chunk of `batch_size` rows, one
    forward of the chunk's unique prefixes with a KV cache (`gear.prefix.prefix_cache`, under
    the caller's grad mode), then one forward of each row's last prompt token and completion
    through TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`: `labels`,
    `fused_lm_head=True`), which scores only those positions.

    A plain TRL pass runs every row's prompt, and on CPU projects every position through the LM
    head. The result equals it to float rounding (tests/integrations/trl/test_loss_prefix.py), gradients
    included: the prefix's keys and values carry them to the rows that read them. Positions
    are the plain pass's (no `position_ids`, as TRL passes none).

    Args:
        model: the policy (or a reference) as TRL calls it, with TRL's fused LM head added.
        input_ids, attention_mask: (B, L) left-padded prompts, then completions.
    Returns:
        ((B, logits_to_keep) log-probs, (B, logits_to_keep) entropies or None), or None when
        the model's cache cannot be shared (then run TRL's plain pass).
    """
    n_tail = logits_to_keep + 1  # the last prompt token predicts completion token 0
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start : start + batch_size]
        mask = attention_mask[start : start + batch_size]
        with accelerator.autocast():
            cache = prefix_cache(model, ids, mask, n_tail)
            if cache is None:
                return None
            tail = ids[:, -n_tail:]
            labels = tail.masked_fill(mask[:, -n_tail:] == 0, -100)
            labels[:, 0] = -100  # the prompt's own last token is not scored
            out = model(
                input_ids=tail,
                attention_mask=mask,
                past_key_values=cache,
                labels=labels,
                fused_lm_head=True,
            )
        logps.append(out.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(out.entropy[:, -logits_to_keep:])
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None


def loss_prefix_blocker(model: nn.Module, width: int, n_tail: int) -> str | None:
    """Why `shared_prompt_logps` must not run on (B, `width`) rows of `model` now, or None:
    a position scheme a shared prefix does not reproduce (`prefix_sharing_blocker`), no prefix
    column, activation checkpointing (the model then returns no cache), or dropout in train
    mode (one dropout draw for a group's prompt instead of one per row)."""
    if width - n_tail < 1:
        return "the rows have no prompt column before the last prompt token"
    inner = unwrap_model(model)
    if checkpointing(inner):
        return "activation checkpointing is on"
    if dropout_active(inner):
        return "dropout is active"
    return prefix_sharing_blocker(model, width)


def loss_prompts_shareable(
    model: nn.Module, width: int, logits_to_keep: int, args: tuple, kwargs: dict
) -> bool:
    """Whether TRL's log-prob pass over (B, `width`) rows, called with its extra `args` /
    `kwargs`, may share the rows' prompts (`shared_prompt_logps`): text only (no other model
    input), no auxiliary loss, and no `loss_prefix_blocker`."""
    text_only = not args and all(
        kwargs.get(k) is None
        for k in kwargs
        if k not in ("batch_size", "compute_entropy", "compute_aux_loss")
    )
    return (
        text_only
        and not kwargs.get("compute_aux_loss", False)
        and loss_prefix_blocker(model, width, logits_to_keep + 1) is None
    )


def projection_dtype(accelerator: Any, weight: Tensor) -> torch.dtype:
    """bfloat16 when the run trains in bf16 mixed precision, else the LM head's own dtype."""
    return torch.bfloat16 if accelerator.mixed_precision == "bf16" else weight.dtype


def _cast(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def final_hidden(
    accelerator: Any,
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    n_keep: int,
    batch_size: int | None = None,
    grad: bool = False,
    gradient_checkpointing_kwargs: dict | None = None,
    share_prefix: bool = False,
    merge_lora: bool = False,
) -> Tensor:
    """(B, n_keep, H) final hidden states at the positions predicting the last n_keep tokens.

    Runs the root module (so DDP / DeepSpeed / PEFT hooks fire) with `logits_to_keep=1` and
    reads the backbone's output (`gear.prefix.plain_hidden`); rows go in chunks of
    `batch_size`, like TRL's passes. With `share_prefix` (no-grad only), rows sharing their
    first L - n_keep tokens compute them once (`gear.prefix.prefix_shared_hidden`). With
    `merge_lora` (no-grad only), a PEFT LoRA model's layers run with merged weights
    (`gear.modeling.lora.merged_lora`: a plain forward's cost, the weights untouched).
    """
    unwrapped = accelerator.unwrap_model(model)
    no_checkpointing = (
        disable_gradient_checkpointing(unwrapped, gradient_checkpointing_kwargs)
        if not grad and checkpointing(unwrapped)
        else nullcontext()
    )
    if not grad:
        merged = merged_lora(unwrapped) if merge_lora else nullcontext()
        with no_checkpointing, accelerator.autocast(), torch.no_grad(), merged:
            if share_prefix:
                return prefix_shared_hidden(
                    model, input_ids, attention_mask, n_keep, batch_size=batch_size
                )
            return plain_hidden(model, input_ids, attention_mask, n_keep, batch_size=batch_size)
    with no_checkpointing, accelerator.autocast():
        return plain_hidden(model, input_ids, attention_mask, n_keep, batch_size=batch_size)


def checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, without transformers' rename warning."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run the signal passes in eval mode (no dropout), restoring each module's mode after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _unwrapped(teacher: nn.Module) -> nn.Module:
    return teacher.module if hasattr(teacher, "module") else teacher  # a DeepSpeed engine


def _full(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """FSDP2 exposes sharded DTensors; the signals need plain full tensors."""
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    return weight, bias

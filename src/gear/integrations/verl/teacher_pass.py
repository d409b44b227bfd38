"""The worker-side teacher pass: per-token signals of spec §1 (full-vocabulary reverse KL, student
entropy, log-probabilities of the sampled tokens) from the *final hidden states* of the student
and of the teacher and the LM head, through `gear.credit.signals_from_hidden`, the one chunked
kernel. No forward here asks the model for more than one position of logits
(``logits_to_keep=1``), so beyond the model's own activations the pass holds, per micro-batch,
the (M, H) student and teacher hidden states of the M response tokens and one chunk of
(chunk_size, V) logits, never (rows, R, V).

Layouts are verl's (v1 trainer, ``pad_mode=no_padding``): each row's sequence is prompt ⊕
response with no padding inside it; a micro-batch is either *packed* (``use_remove_padding``:
input ids (1, N), position ids restarting at 0 for every row, no attention mask; verl's
flash-attention varlen patch on GPU, transformers' packed-sequence mask elsewhere) or
right-padded (B, W) with an attention mask. Row i's response token k sits at sequence index
P_i + k and is predicted by the final hidden state at P_i + k - 1.

Pure PyTorch: `micro_batch_signals` takes the (FSDP-wrapped) Hugging Face module; `worker.py`
calls it once per verl micro-batch, on the student hidden states it captured from verl's own
old-log-prob forward (or from one student forward of ours where verl runs none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gear.credit.registry import SIGNAL_SPECS
from gear.credit.signals import TokenSignals, signals_from_hidden
from gear.modeling import LogitConventions, capture_final_hidden, lm_head
from gear.modeling.model import only_capture

#: non-tensor batch key: verl's old-log-prob pass runs the teacher pass too (worker.py)
FUSED_KEY = "gear_signals"
#: what the signal pass gives without a teacher: the student's own signals (entropy, log-probs)
STUDENT_SIGNALS = tuple(s.name for s in SIGNAL_SPECS if s.signal_pass and not s.teacher)


@dataclass
class TeacherPassOptions:
    """Options of the pass (``gear.*`` keys, carried in the batch's non-tensor data).

    teacher: whether a teacher forward runs (rows carry teacher prompts); False for methods
        that read the student's signals only (``gear_entropy_top``).
    contrast: whether a second teacher forward runs on the contrast teacher's prompts (a wrong
        answer; ``teacher_context: contrast``), giving ``contrast_kl``.
    temperature: the sampling temperature; the model's own logit conventions (logit scale,
        final-logit softcap: `gear.modeling.LogitConventions`) come from its config.

    micro_batch_size: at most this many rows per teacher forward (verl's micro-batch is split).
    max_token_len: with verl's dynamic batch size, at most this many tokens per teacher forward
        (a row longer than that on its own still gets its own forward); None: no token cap.
    """

    teacher: bool = True
    contrast: bool = False
    temperature: float = 1.0
    estimator: str = "full"
    topk: int = 64
    chunk_size: int = 256
    micro_batch_size: int = 4
    pad_token_id: int = 0
    max_token_len: int | None = None

    def kernel_kwargs(self, conventions: LogitConventions) -> dict[str, Any]:
        """The `signals_from_hidden` options of every forward of the pass: the estimator,
        chunking, and the temperature and softcap under the model's logit conventions."""
        return dict(
            estimator=self.estimator,
            topk=self.topk,
            chunk_size=self.chunk_size,
            **conventions.signal_kwargs(self.temperature),
        )


def _rows(x: Tensor | Sequence[Tensor | Sequence[int]]) -> list[Tensor]:
    """Rows of a jagged nested tensor, a list of tensors or lists, or a 2-D tensor."""
    if isinstance(x, Tensor) and x.is_nested:
        return [t.reshape(-1) for t in x.unbind()]
    if isinstance(x, Tensor):
        return [t.reshape(-1) for t in x]
    return [torch.as_tensor(t).reshape(-1) for t in x]


def nested(rows: list[Tensor]) -> Tensor:
    """A jagged nested tensor of 1-D rows (verl's layout for per-token fields)."""
    return torch.nested.as_nested_tensor([r.reshape(-1) for r in rows], layout=torch.jagged)


# ----------------------------------------------------------------------------------- the model


def _full(t: Tensor | None) -> Tensor | None:
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


@contextlib.contextmanager
def capture_rows(module: nn.Module, index: Tensor) -> Iterator[list[Tensor]]:
    """While open, each forward of `module` appends its output's rows `index` of the flattened
    (B * W, H) final hidden states, as an (M, H) copy (the full output is not kept)."""

    def keep(h: Tensor) -> Tensor:
        return h.reshape(-1, h.shape[-1]).index_select(0, index.to(h.device)).detach()

    with capture_final_hidden(module, keep) as got:
        yield got


@contextlib.contextmanager
def on_head(module: nn.Module, fn: Callable[[Tensor, Tensor | None], None]) -> Iterator[None]:
    """While open, `fn(weight, bias)` runs just before each call of the LM head, inside the
    forward, where FSDP (1 or 2) holds the head's full weight."""

    def hook(mod: nn.Module, args: Any) -> None:
        fn(_full(mod.weight), _full(getattr(mod, "bias", None)))

    handle = lm_head(module).register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------- layouts


@dataclass
class Inputs:
    """Model inputs of a list of sequences in verl's packed or right-padded layout."""

    kwargs: dict[str, Tensor | None]
    starts: Tensor  # (B,) flat index of each row's first token in the (B * W, H) output
    lengths: Tensor  # (B,)


def model_inputs(seqs: Sequence[Tensor], remove_padding: bool, pad_token_id: int) -> Inputs:
    """input_ids / position_ids / attention_mask of `seqs` (1-D long each), on CPU."""
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long)
    positions = [torch.arange(n, dtype=torch.long) for n in lengths.tolist()]
    if remove_padding:
        starts = torch.cumsum(lengths, 0) - lengths
        kwargs: dict[str, Tensor | None] = {
            "input_ids": torch.cat(list(seqs)).unsqueeze(0),
            "position_ids": torch.cat(positions).unsqueeze(0),
            "attention_mask": None,
        }
        return Inputs(kwargs, starts, lengths)
    width = int(lengths.max())
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    pos = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, positions, strict=True)):
        ids[i, : s.numel()], mask[i, : s.numel()], pos[i, : s.numel()] = s, 1, p
    kwargs = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
    return Inputs(kwargs, torch.arange(len(seqs)) * width, lengths)


def response_index(starts: Tensor, lengths: Tensor, response_lengths: Tensor) -> Tensor:
    """(M,) flat indices of the hidden states predicting each row's response tokens: row i's
    positions L_i - R_i - 1 .. L_i - 2 (prompt ⊕ response, P_i = L_i - R_i >= 1)."""
    prompt_lengths = lengths - response_lengths
    if bool((prompt_lengths < 1).any()):
        raise ValueError(
            f"teacher pass: every row needs a prompt of at least one token, got prompt lengths "
            f"{prompt_lengths.tolist()}"
        )
    first = starts + prompt_lengths - 1
    return torch.cat(
        [
            torch.arange(f, f + r)
            for f, r in zip(first.tolist(), response_lengths.tolist(), strict=True)
        ]
        or [torch.zeros(0, dtype=torch.long)]
    )


def groups(lengths: Sequence[int], max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Consecutive rows in groups of at most `max_rows` rows and `max_tokens` tokens (a longer
    row alone makes a group)."""
    out: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        full = out and (
            len(out[-1]) >= max_rows or (max_tokens is not None and tokens + n > max_tokens)
        )
        if not out or full:
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += n
    return out


# ----------------------------------------------------------------------------------- the pass


def forward_hidden(
    module: nn.Module,
    seqs: Sequence[Tensor],
    response_lengths: Tensor,
    remove_padding: bool,
    pad_token_id: int,
    device: torch.device | str,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Tensor:
    """One forward of `seqs`; (M, H) final hidden states predicting the response tokens."""
    x = model_inputs(seqs, remove_padding, pad_token_id)
    index = response_index(x.starts, x.lengths, response_lengths)
    kwargs = {k: v.to(device) if v is not None else None for k, v in x.kwargs.items()}
    with capture_rows(module, index) as got, autocast():
        module(**kwargs, use_cache=False, logits_to_keep=1)
    return only_capture(got, module)


def dummy_forward(
    module: nn.Module, pad_token_id: int, device: torch.device | str, autocast: Callable
) -> None:
    """A one-token forward whose result is discarded: keeps FSDP's collectives in step on a
    rank that has less (or nothing) to compute."""
    with autocast():
        module(
            input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long, device=device),
            position_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            attention_mask=None,
            use_cache=False,
            logits_to_keep=1,
        )


def teacher_signals(
    module: nn.Module,
    seqs: Sequence[Tensor],
    response_lengths: Tensor,
    student_hidden: Tensor,
    tokens: Tensor,
    options: TeacherPassOptions,
    remove_padding: bool,
    device: torch.device | str,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> TokenSignals:
    """One teacher forward of `seqs` (teacher prompt ⊕ response); the signals are computed just
    before the LM head runs (its full weight at hand under FSDP), from the teacher's final hidden
    states and `student_hidden` (M, H) of the same M response `tokens`. Returns (1, M) signals."""
    x = model_inputs(seqs, remove_padding, options.pad_token_id)
    index = response_index(x.starts, x.lengths, response_lengths)
    kwargs = {k: v.to(device) if v is not None else None for k, v in x.kwargs.items()}
    result: list[TokenSignals] = []
    conventions = LogitConventions.of(module)  # softcap, logit scale: as the model's logits
    with capture_rows(module, index) as teacher_hidden:

        def signals(weight: Tensor, bias: Tensor | None) -> None:
            # the backbone has run (its hook filled teacher_hidden); the head has not
            result.append(
                signals_from_hidden(
                    student_hidden.to(weight.dtype)[None],
                    only_capture(teacher_hidden, module).to(weight.dtype)[None],
                    weight,
                    tokens[None],
                    lm_head_bias=bias,
                    **options.kernel_kwargs(conventions),
                )
            )

        with on_head(module, signals), autocast():
            module(**kwargs, use_cache=False, logits_to_keep=1)
    if len(result) != 1:
        raise RuntimeError(
            f"teacher pass: expected one LM head call per forward, got {len(result)}"
        )
    return result[0]


def student_signals(
    module: nn.Module,
    student_hidden: Tensor | None,
    tokens: Tensor,
    options: TeacherPassOptions,
    device: torch.device | str,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> dict[str, Tensor]:
    """The student's entropy and log-probs of the M response `tokens` (M,) from its (M, H)
    final hidden states (None when M = 0), no teacher: `signals_from_hidden(student, None, ...)`
    run just before the LM head of a one-token forward, where FSDP holds the head's full
    weight; every rank runs that one forward. Returns {"entropy", "student_logprobs"} -> (M,)
    float32 on CPU."""
    conventions = LogitConventions.of(module)
    result: list[TokenSignals] = []

    def signals(weight: Tensor, bias: Tensor | None) -> None:
        if student_hidden is None or student_hidden.shape[0] == 0:
            return
        result.append(
            signals_from_hidden(
                student_hidden.to(weight.dtype)[None],
                None,
                weight,
                tokens[None],
                lm_head_bias=bias,
                **options.kernel_kwargs(conventions),
            )
        )

    with on_head(module, signals):
        dummy_forward(module, options.pad_token_id, device, autocast)
    if not result:
        return {k: torch.zeros(0) for k in STUDENT_SIGNALS}
    return {k: getattr(result[0], k)[0].float().cpu() for k in STUDENT_SIGNALS}


def micro_batch_signals(
    module: nn.Module,
    student_hidden: Tensor | None,
    prompts: Sequence[Tensor],
    teacher_prompts: Sequence[Tensor] | None,
    responses: Sequence[Tensor],
    options: TeacherPassOptions,
    remove_padding: bool,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    sync: Callable[[int], int] = lambda n: n,
    contrast_prompts: Sequence[Tensor] | None = None,
    scored: Sequence[bool] | Tensor | None = None,
) -> dict[str, list[Tensor]]:
    """Signals of one micro-batch of rows, each a list of (R_i,) float32 tensors on CPU.

    Args:
        module: the model (root module: FSDP's hooks fire).
        student_hidden: (M, H) student final hidden states predicting the M = Σ R_i response
            tokens (row-major), captured from verl's forward; None: one student forward here.
        prompts / teacher_prompts / responses: per row, 1-D ids. teacher_prompts None: no
            teacher forward; the student's entropy and log-probs only (`student_signals`).
        options: see `TeacherPassOptions`.
        remove_padding: verl's ``use_remove_padding`` (packed forwards) or right padding.
        autocast: the context verl's forward runs under (mixed precision).
        sync: n -> the number of teacher forwards to run, >= n (the largest n over the
            data-parallel ranks); the extra forwards are one-token dummies.
        contrast_prompts: per row, the contrast teacher's prompt ids (a wrong answer), or None:
            a second teacher pass like the first, of which only the KL is kept.
        scored: (n,) bool, the rows whose signals the credit method reads (the others have a
            sequence advantage of 0: `skip_zero_advantage_rows`), or None for all. Only those
            rows enter the teacher and contrast forwards (and our own student forward), and
            the kernel; the others' signals are zeros. `sync` still sees every rank's count.
    Returns:
        {"kl", "entropy", "student_logprobs", "teacher_logprobs"} -> list of (R_i,) tensors,
        plus "contrast_kl" given contrast prompts; {"entropy", "student_logprobs"} without
        teacher prompts.
    """
    n = len(responses)
    if scored is not None:
        if len(scored) != n:
            raise ValueError(f"scored: expected {n} flags (one per row), got {len(scored)}")
        keep = [i for i, s in enumerate(torch.as_tensor(scored, dtype=torch.bool).tolist()) if s]
        if len(keep) < n:
            return _scored_rows_only(
                keep, module, student_hidden, prompts, teacher_prompts, responses, options,
                remove_padding, device, autocast, sync, contrast_prompts,
            )  # fmt: skip
    n_teacher = n if teacher_prompts is None else len(teacher_prompts)
    if not len(prompts) == n_teacher == n:
        raise ValueError(
            f"teacher pass: expected as many prompts, teacher prompts and responses, got "
            f"{len(prompts)}, {n_teacher}, {n}"
        )
    r_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    if student_hidden is None:
        if n:
            student_seqs = [
                torch.cat([p.long(), r.long()]) for p, r in zip(prompts, responses, strict=True)
            ]
            student_hidden = forward_hidden(
                module, student_seqs, r_len, remove_padding, options.pad_token_id, device, autocast
            )
        else:
            dummy_forward(module, options.pad_token_id, device, autocast)
    elif student_hidden.shape[0] != int(r_len.sum()):
        raise ValueError(
            f"student_hidden: expected {int(r_len.sum())} rows (one per response token), got "
            f"{tuple(student_hidden.shape)}"
        )
    if teacher_prompts is None:
        tokens = torch.cat([r.long() for r in responses]) if n else torch.zeros(0, dtype=torch.long)
        sig = student_signals(module, student_hidden, tokens.to(device), options, device, autocast)
        return {
            key: [piece.clone() for piece in values.split(r_len.tolist())]
            for key, values in sig.items()
        }

    def rows_of(prompts: Any) -> dict[str, Any]:  # the same pass for either teacher's prompts
        return _teacher_rows(
            module, prompts, responses, student_hidden, options, remove_padding, device,
            autocast, sync,
        )  # fmt: skip

    out = rows_of(teacher_prompts)
    if contrast_prompts is not None:
        if len(contrast_prompts) != n:
            raise ValueError(
                f"teacher pass: expected {n} contrast teacher prompts, got {len(contrast_prompts)}"
            )
        out["contrast_kl"] = rows_of(contrast_prompts)["kl"]
    return out


def _scored_rows_only(
    keep: list[int],
    module: nn.Module,
    student_hidden: Tensor | None,
    prompts: Sequence[Tensor],
    teacher_prompts: Sequence[Tensor] | None,
    responses: Sequence[Tensor],
    options: TeacherPassOptions,
    remove_padding: bool,
    device: torch.device | str,
    autocast: Callable[[], contextlib.AbstractContextManager],
    sync: Callable[[int], int],
    contrast_prompts: Sequence[Tensor] | None,
) -> dict[str, list[Tensor]]:
    """`micro_batch_signals` of the rows `keep` alone (the student's hidden states of those rows
    picked out of verl's), placed among zeros for the other rows."""
    r_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    if student_hidden is not None:
        if student_hidden.shape[0] != int(r_len.sum()):
            raise ValueError(
                f"student_hidden: expected {int(r_len.sum())} rows (one per response token), "
                f"got {tuple(student_hidden.shape)}"
            )
        offsets = (torch.cumsum(r_len, 0) - r_len).tolist()
        index = torch.cat(
            [torch.arange(offsets[i], offsets[i] + int(r_len[i])) for i in keep]
            or [torch.zeros(0, dtype=torch.long)]
        )
        student_hidden = student_hidden.index_select(0, index.to(student_hidden.device))

    def pick(rows: Sequence[Tensor] | None) -> list[Tensor] | None:
        return None if rows is None else [rows[i] for i in keep]

    part = micro_batch_signals(
        module, student_hidden, pick(prompts), pick(teacher_prompts), pick(responses), options,
        remove_padding, device, autocast, sync, pick(contrast_prompts),
    )  # fmt: skip
    names = (
        list(STUDENT_SIGNALS)
        if teacher_prompts is None
        else [
            *TokenSignals.__dataclass_fields__,
            *(["contrast_kl"] if contrast_prompts is not None else []),
        ]
    )
    out = {k: [torch.zeros(int(r)) for r in r_len.tolist()] for k in names}
    for j, i in enumerate(keep):
        for k in names:
            out[k][i] = part[k][j]
    return out


def _teacher_rows(
    module: nn.Module,
    teacher_prompts: Sequence[Tensor],
    responses: Sequence[Tensor],
    student_hidden: Tensor,
    options: TeacherPassOptions,
    remove_padding: bool,
    device: torch.device | str,
    autocast: Callable[[], contextlib.AbstractContextManager],
    sync: Callable[[int], int],
) -> dict[str, list[Tensor]]:
    """The teacher forwards of `micro_batch_signals` (groups of rows, ranks kept in step) and
    each row's signals against the student's."""
    n = len(responses)
    r_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    offsets = torch.cumsum(r_len, 0) - r_len
    teacher_seqs = [
        torch.cat([tp.long(), r.long()]) for tp, r in zip(teacher_prompts, responses, strict=True)
    ]
    parts = groups(
        [s.numel() for s in teacher_seqs], options.micro_batch_size, options.max_token_len
    )
    total = sync(len(parts))
    out: dict[str, list[Tensor]] = {
        k: [torch.zeros(0)] * n for k in TokenSignals.__dataclass_fields__
    }
    for k in range(total):
        if k >= len(parts):
            dummy_forward(module, options.pad_token_id, device, autocast)
            continue
        rows = parts[k]
        lens = r_len[rows]
        if int(lens.sum()) == 0:  # nothing to score, but the forward keeps ranks in step
            dummy_forward(module, options.pad_token_id, device, autocast)
            for i in rows:
                for key in out:
                    out[key][i] = torch.zeros(0)
            continue
        s_index = torch.cat([torch.arange(offsets[i], offsets[i] + r_len[i]) for i in rows])
        sig = teacher_signals(
            module,
            [teacher_seqs[i] for i in rows],
            lens,
            student_hidden.index_select(0, s_index.to(student_hidden.device)),
            torch.cat([responses[i].long() for i in rows]).to(device),
            options,
            remove_padding,
            device,
            autocast,
        )
        for key in out:
            values = getattr(sig, key)[0].float().cpu()
            for i, piece in zip(rows, values.split(lens.tolist()), strict=True):
                out[key][i] = piece.clone()
    return out

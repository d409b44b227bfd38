"""Forwards that compute each shared prompt once (the teacher pass, the student forward where one
still runs, and TRL's log-prob passes with their gradients: `prefix_cache`).

In GRPO the G completions of a prompt share it, and so share the teacher prompt (prompt + hint).
A plain forward over `[prompt | completion]` rows recomputes that prefix G times. Here the rows
are grouped by identical prefix ids; each unique prefix runs once with a KV cache, and only the
completion tokens run after it, reading their prefix's keys and values. The result is the final
hidden states that predict each completion token: at column 0 the prefix's last state, at column
t > 0 the state of completion token t - 1, exactly as the plain forward gives them (up to float
rounding) and ready for `gear.credit.signals_from_hidden` (no logits are kept).

Both passes take the position ids of the plain forward (`gear.modeling.padding_free_positions`),
so the shared prefix is exact wherever a position's encoding depends on its id alone; where it
does not (length-dependent rotary scaling, ALiBi: `gear.modeling.prefix_sharing_blocker`) the
plain forward runs. The prefix's keys are gathered per layer, one layer at a time, and nothing
is stored in the cache during the completion pass, so memory stays that of the plain forward's
activations. Models whose cache is not a plain key/value cache (linear attention, recurrent
state, quantised or offloaded caches) or that return none fall back to the plain forward too,
with one warning per reason.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from gear.modeling import capture_final_hidden, padding_free_positions, prefix_sharing_blocker
from gear.modeling.model import only_capture, takes_position_ids

_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"shared-prefix forward: {reason}; using the plain forward (each row's prompt "
            "is recomputed)",
            stacklevel=3,
        )


def _columns(columns: slice) -> Callable[[Tensor], Tensor]:
    """Keep `h[:, columns]` of a capture, as a copy (the whole (B, L, H) output is freed)."""
    return lambda h: h[:, columns].clone()


def plain_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    n_keep: int,
    *,
    batch_size: int | None = None,
) -> Tensor:
    """(B, n_keep, H) final hidden states predicting the last `n_keep` tokens of each row, from
    one forward over whole rows (the reference the shared-prefix pass must equal). Runs under
    the caller's grad mode.

    Args:
        model: a causal LM (or its DDP / DeepSpeed / PEFT wrapper) taking `logits_to_keep`.
        input_ids, attention_mask: (B, L), L > n_keep.
        batch_size: rows per forward (default all).
    """
    batch_size = batch_size or input_ids.size(0)
    positions = takes_position_ids(model)
    out: list[Tensor] = []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        mask = attention_mask[rows]
        extra = {"position_ids": padding_free_positions(mask)} if positions else {}
        with capture_final_hidden(model, _columns(slice(-n_keep - 1, -1))) as got:
            model(
                input_ids=input_ids[rows],
                attention_mask=mask,
                logits_to_keep=1,
                use_cache=False,
                **extra,
            )
        out.append(only_capture(got, model))
    return torch.cat(out)


def group_prefixes(
    input_ids: Tensor, attention_mask: Tensor, n_keep: int
) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], Tensor]:
    """Unique prefixes of `[prefix | completion]` rows and each row's prefix index.

    The prefix of a row is its first L - n_keep columns without the leading padding (mask 0):
    left- and right-padded prompts both work, and a row's inner padding (mask 0 after its first
    token) stays, so that positions match the plain forward. Rows equal when ids and mask are.

    Args:
        input_ids, attention_mask: (B, L); n_keep: the completion width T (1 <= T < L).
    Returns:
        (unique prefixes as (ids, mask) tuples, (B,) long index of each row's prefix).
    """
    B, L = input_ids.shape
    if tuple(attention_mask.shape) != (B, L):
        raise ValueError(
            f"attention_mask: expected shape {(B, L)} like input_ids, got "
            f"{tuple(attention_mask.shape)}"
        )
    if not 1 <= n_keep < L:
        raise ValueError(f"n_keep: expected 1 <= n_keep < {L} (the row length), got {n_keep}")
    ids = input_ids[:, : L - n_keep].tolist()
    mask = (attention_mask[:, : L - n_keep] != 0).long().tolist()
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    rows = []
    for r_ids, r_mask in zip(ids, mask, strict=True):
        start = r_mask.index(1) if 1 in r_mask else len(r_mask)
        if start == len(r_mask):
            raise ValueError(
                "attention_mask: every row needs at least one prefix token (mask 1) in its "
                f"first {L - n_keep} columns; a row has none"
            )
        key = (tuple(r_ids[start:]), tuple(r_mask[start:]))
        rows.append(index.setdefault(key, len(index)))
    return list(index), torch.tensor(rows, dtype=torch.long)


def prefix_shared_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    n_keep: int,
    *,
    batch_size: int | None = None,
) -> Tensor:
    """`plain_hidden` with each unique prefix computed once (see the module docstring).

    Args:
        model: a causal LM (or its DDP / DeepSpeed / PEFT wrapper) taking `past_key_values`,
            `position_ids` and `logits_to_keep`. Run under `torch.no_grad()`.
        input_ids, attention_mask: (B, L) rows `[prefix | completion]`: the prefix (teacher or
            student prompt) in the first L - n_keep columns, padded on either side; the
            completion (tool turns included) in the last n_keep columns, with its mask.
        n_keep: T, the completion width.
        batch_size: rows per completion pass (default all); each chunk's prefixes run once.
            Every chunk runs exactly two forwards whatever the data (a prefix pass and a
            completion pass), so sharded ranks (ZeRO-3, FSDP) stay in step.
    Returns:
        (B, T, H) final hidden states; [:, t] predicts input_ids[:, L - T + t].
    """
    prefixes, group = group_prefixes(input_ids, attention_mask, n_keep)
    B = input_ids.size(0)
    reason = prefix_sharing_blocker(model, input_ids.size(1))
    if reason is not None:
        _warn_once(reason)
        return plain_hidden(model, input_ids, attention_mask, n_keep, batch_size=batch_size)
    batch_size = batch_size or B
    order = torch.sort(group, stable=True).indices  # each group's rows together
    completion_ids = input_ids[:, -n_keep:]
    completion_mask = attention_mask[:, -n_keep:]
    out: Tensor | None = None
    for start in range(0, B, batch_size):
        rows = order[start : start + batch_size]
        hidden = _chunk_hidden(
            model,
            prefixes,
            group[rows],
            completion_ids[rows.to(input_ids.device)],
            completion_mask[rows.to(input_ids.device)],
            width=input_ids.size(1) - n_keep,
        )
        if hidden is None:  # no reusable cache: this model takes the plain path
            return plain_hidden(model, input_ids, attention_mask, n_keep, batch_size=batch_size)
        if out is None:
            out = hidden.new_empty((B, *hidden.shape[1:]))
        out[rows.to(out.device)] = hidden
    assert out is not None
    return out


def _chunk_hidden(
    model: nn.Module,
    prefixes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    group: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    width: int | None = None,
) -> Tensor | None:
    """(b, T, H) for one chunk of b rows: its unique prefixes in one pass with a cache, each
    left-padded to the batch's prefix `width` (None: the chunk's longest prefix; a fixed width
    keeps a row's padding independent of which rows share its chunk), then the completion
    tokens 0..T-2 over the gathered cache. None if the model's cache cannot be shared."""
    device = completion_ids.device
    used, local = torch.unique(group, return_inverse=True)  # the chunk's prefixes, row -> local
    chunk = [prefixes[i] for i in used.tolist()]
    P = width if width is not None else max(len(ids) for ids, _ in chunk)
    ids, mask = _left_padded(chunk, P, device)
    local = local.to(device)

    with capture_final_hidden(model, _columns(slice(-1, None))) as last:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=padding_free_positions(mask),  # those of the plain forward
            logits_to_keep=1,
            use_cache=True,
        )
    cache = getattr(out, "past_key_values", None)
    reason = _unshareable(cache)
    if reason is not None:
        _warn_once(reason)
        return None
    first = only_capture(last, model)[local]  # (b, 1, H): predicts completion token 0
    # The last completion token predicts nothing, so tokens 0..T-2 run (token 0 alone when
    # T = 1, its state unused: every rank runs the same number of forwards).
    T = completion_ids.size(1)
    n = max(T - 1, 1)
    row_mask = torch.cat([mask[local], completion_mask[:, :n]], dim=1)
    with capture_final_hidden(model, _columns(slice(None))) as steps:
        model(
            input_ids=completion_ids[:, :n],
            attention_mask=row_mask,
            position_ids=padding_free_positions(row_mask)[:, -n:],
            past_key_values=_gathered(cache, local),
            logits_to_keep=1,
            use_cache=True,
        )
    return torch.cat([first, only_capture(steps, model)[:, : T - 1]], dim=1)


def _left_padded(
    prefixes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], width: int, device: Any
) -> tuple[Tensor, Tensor]:
    """(u, width) ids and mask of the prefixes, each left-padded to `width` (pad id 0, mask 0)."""
    ids = torch.zeros(len(prefixes), width, dtype=torch.long)
    mask = torch.zeros(len(prefixes), width, dtype=torch.long)
    for i, (p_ids, p_mask) in enumerate(prefixes):
        ids[i, width - len(p_ids) :] = torch.tensor(p_ids)
        mask[i, width - len(p_mask) :] = torch.tensor(p_mask)
    return ids.to(device), mask.to(device)


def prefix_cache(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, n_tail: int
) -> DynamicCache | None:
    """A KV cache serving each row its prefix, every unique prefix computed once: for one
    forward of the rows' last `n_tail` columns (`past_key_values=`, with the rows' whole (B, L)
    `attention_mask`). This is the loss forward's half of prefix sharing (TRL's log-prob
    passes, `gear.integrations.trl.forwards.shared_prompt_logps`).

    Runs under the caller's grad mode: with gradients on, the prefix's keys and values carry
    them to every row that reads them, so the gradient equals the plain forward's (to float
    rounding). Each prefix keeps its rows' columns (left-padded to L - n_tail), so a forward
    without `position_ids` gives every token the position the plain forward without them
    gives it (its column), as TRL's own passes do.

    Args:
        input_ids, attention_mask: (B, L) rows; the first L - n_tail columns are the prefix
            (left-padded prompts: equal prompts give equal prefixes), 1 <= n_tail < L.
    Returns:
        the gathered cache, or None (after one warning) when the model's cache cannot be
        shared; then run the plain forward.
    """
    prefixes, group = group_prefixes(input_ids, attention_mask, n_tail)
    ids, mask = _left_padded(prefixes, input_ids.size(1) - n_tail, input_ids.device)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=True)
    cache = getattr(out, "past_key_values", None)
    reason = _unshareable(cache)
    if reason is not None:
        _warn_once(reason)
        return None
    return _gathered(cache, group.to(input_ids.device))


def _unshareable(cache: Any) -> str | None:
    """Why `cache` cannot be gathered by rows, or None if it can."""
    if cache is None:
        return (
            "the model returned no KV cache (use_cache unsupported, or gradient checkpointing on)"
        )
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return f"its cache is a {type(cache).__name__}, not a plain DynamicCache"
    for layer in cache.layers:
        if type(layer) not in _ONE_PASS or getattr(layer, "record_past", False):
            return f"its cache has {type(layer).__name__} layers (only full / sliding-window KV)"
    return None


class _OnePass:
    """A cache layer holding the unique prefixes' keys/values (u, heads, P, d) and each row's
    prefix index; `update` returns the rows' prefix states followed by the new ones and stores
    nothing (one completion pass), so only one layer's gathered states exist at a time."""

    rows: Tensor

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        return (
            torch.cat([self.keys.index_select(0, self.rows), key_states], dim=-2),
            torch.cat([self.values.index_select(0, self.rows), value_states], dim=-2),
        )


class _OnePassLayer(_OnePass, DynamicLayer):
    pass


class _OnePassSlidingLayer(_OnePass, DynamicSlidingWindowLayer):
    pass  # keys hold the last window - 1 prefix columns; mask sizes come from the prefix pass


_ONE_PASS = {DynamicLayer: _OnePassLayer, DynamicSlidingWindowLayer: _OnePassSlidingLayer}


def _gathered(cache: DynamicCache, rows: Tensor) -> DynamicCache:
    """A copy of `cache` whose layers serve rows `rows` (b,) of it for one forward."""
    layers = []
    for layer in cache.layers:
        one = _ONE_PASS[type(layer)].__new__(_ONE_PASS[type(layer)])
        one.__dict__.update(layer.__dict__)
        one.rows = rows
        layers.append(one)
    gathered = copy.copy(cache)
    gathered.layers = layers
    gathered.layer_class_to_replicate = None  # every layer exists already
    return gathered

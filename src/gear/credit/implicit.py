"""The credit GRPO already assigns through shared prefixes (Sullivan, arXiv 2509.21154).

Rows of one group that share a completion prefix have the same per-token gradient on it, so
on that prefix GRPO's update is the *sum* of those rows' advantages: zero on the prefix the
whole group shares, a Monte-Carlo estimate of the prefix's value on a prefix some rows share.
A failed row's blame therefore already concentrates after the point where it departs from
its successful siblings. This module measures that tree, vectorised over groups (each group's
tree is bounded by the group size; no Python loop over tokens or rows):

- `prefix_counts`: (N, T) how many rows of a row's group share its prefix through token t,
  which `lambda_grpo` divides by (`gear.credit.methods`);
- `implicit_credit_stats`: the per-batch diagnostics GEARTrainer logs as ``gear/prefix_*``,
  ``gear/branch_*`` and ``gear/shared_sum_*``.

Every function takes the group tree `common_prefix_lengths` returns as `tree` where the caller
already has it (it is the costly part). Shapes: N rows, T completion columns, right-padded; a row's group is `group_ids[i]` (rows need
not be contiguous). `mask` is the completion's attention mask: a row's prefix through t is its
tokens 0..t, and two rows share it when those ids are equal and both rows still have token t.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: where a failed row's first error lies relative to its branch point (`branch_points`)
BRANCH_RELATIONS = ("before", "at", "after")


def _grouped(group_ids: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """Each row's (group, slot) in a (B, G) layout of the groups, B groups of at most G rows."""
    _, group = torch.unique(group_ids, return_inverse=True)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(group)
    slot[order] = torch.arange(len(group), device=group.device) - starts[group[order]]
    return group, slot, int(counts.numel()), int(counts.max()) if len(counts) else 0


def common_prefix_lengths(ids: Tensor, mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(N, G) long: `lcp[i, k]`, how many leading tokens row i shares with the k-th row of its
    group (itself included: its own length; -1 for an empty slot of a smaller group), and the
    (N, G) long row index of that k-th row (-1 for an empty slot), as a pair.

    Memory: (B, G, G, T) bool for B groups of G rows, transient."""
    group, slot, B, G = _grouped(group_ids)
    N, T = ids.shape
    gid = torch.zeros(B, G, T, dtype=ids.dtype, device=ids.device)
    gmask = torch.zeros(B, G, T, dtype=torch.bool, device=ids.device)
    member = torch.full((B, G), -1, dtype=torch.long, device=ids.device)
    gid[group, slot], gmask[group, slot] = ids, mask.bool()
    member[group, slot] = torch.arange(N, device=ids.device)
    same = (gid[:, :, None] == gid[:, None]) & gmask[:, :, None] & gmask[:, None]  # (B, G, G, T)
    differs = torch.cat([~same, same.new_ones(B, G, G, 1)], dim=-1)
    lcp = differs.to(torch.uint8).argmax(dim=-1)  # the first column they do not share
    lcp = torch.where(member[:, None, :] >= 0, lcp, -1)  # (B, G, G)
    return lcp[group, slot], member[group]


def prefix_counts(
    ids: Tensor, mask: Tensor, group_ids: Tensor, tree: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """(N, T) long: c[i, t], the rows of row i's group (itself included) whose first t + 1
    tokens equal row i's; 0 where row i has no token t (`mask` false).

    Args:
        ids: (N, T) completion token ids; mask: (N, T) bool, the completion's tokens
            (right-padded); group_ids: (N,) any integer label per group."""
    lcp, _ = tree or common_prefix_lengths(ids, mask, group_ids)  # (N, G)
    N, T = ids.shape
    # c[i, t] = #{k : lcp[i, k] > t}: a histogram of lcp, summed from the right
    hist = torch.zeros(N, T + 2, dtype=torch.long, device=ids.device)
    hist.scatter_add_(1, (lcp + 1).clamp(min=0), torch.ones_like(lcp))  # empty slots -> bin 0
    above = hist.flip(1).cumsum(1).flip(1)  # above[:, b] = #{lcp + 1 >= b}
    counts = above[:, 2 : T + 2]  # t -> #{lcp >= t + 1}
    return torch.where(mask.bool(), counts, 0)


def branch_points(
    ids: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    success: Tensor,
    tree: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """(N,) long: the column where each row departs from its nearest successful sibling (the
    longest common prefix with another row of its group that succeeded); -1 where its group
    has no other successful row. A row that is a copy of a successful sibling gets its length."""
    lcp, member = tree or common_prefix_lengths(ids, mask, group_ids)
    N = ids.shape[0]
    ok = member >= 0
    sibling = ok & (member != torch.arange(N, device=ids.device)[:, None])
    sibling &= success.bool()[member.clamp(min=0)]
    best = torch.where(sibling, lcp, -1).max(dim=1).values
    return best


def shared_node_sums(
    ids: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    token_adv: Tensor,
    tree: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """(N, T) float: at each token, the sum over the rows that share its prefix (itself
    included) of their token advantages at t: GRPO's update on that prefix node is this sum
    (their per-token gradients are equal). 0 where `mask` is false."""
    T = ids.shape[1]
    lcp, member = tree or common_prefix_lengths(ids, mask, group_ids)  # (N, G)
    pos = torch.arange(T, device=ids.device)
    shares = lcp[:, :, None] > pos  # (N, G, T): the k-th row shares i's prefix through t
    adv = token_adv[member.clamp(min=0)]  # (N, G, T)
    sums = torch.where(shares, adv, 0.0).sum(dim=1)
    return torch.where(mask.bool(), sums, 0.0)


def implicit_credit_stats(
    ids: Tensor,
    mask: Tensor,
    valid: Tensor,
    group_ids: Tensor,
    advantages: Tensor,
    token_advantages: Tensor | None = None,
    error_mask: Tensor | None = None,
) -> dict[str, float]:
    """The prefix tree's statistics of one batch (`gear/...` -> float; NaN where undefined).

    Args:
        ids, mask: (N, T) completion ids and attention mask; valid: (N, T) bool policy tokens
            (the statistics count these); group_ids: (N,).
        advantages: (N,) sequence advantages: a row succeeded where A > 0, failed where A < 0.
        token_advantages: (N, T) a credit method's, or None: the ``gear/shared_sum_*`` entries
            then compare GRPO with itself.
        error_mask: (N, T) bool, each row's first wrong step or token (a step checker's), or
            None: no ``gear/branch_*`` entries.

    Returns, over the batch's valid tokens pooled:
        gear/prefix_shared_frac: share of tokens on a prefix shared by >= 2 rows;
        gear/prefix_rows_mean: mean number of rows sharing a token's prefix;
        gear/shared_sum_abs_grpo, gear/shared_sum_abs_method: the mean |sum of token
            advantages| over the shared prefix nodes (each node once), GRPO's and the method's;
        gear/shared_sum_diff: the mean |method - GRPO| over those nodes, divided by the first;
        and with `error_mask`, over failed rows whose error is placed and whose group has a
        successful row: gear/branch_rows, gear/branch_error_{before,at,after} (shares),
        gear/branch_to_error_tokens (mean tokens from the branch point to the error, over the
        'after' rows: the tokens GRPO spreads a failed row's blame over beyond its error).
    """
    valid = valid.bool() & mask.bool()
    tree = common_prefix_lengths(ids, mask, group_ids)  # once for every statistic below
    counts = prefix_counts(ids, mask, group_ids, tree)
    n = int(valid.sum())
    nan = math.nan
    stats = {
        "gear/prefix_shared_frac": float((valid & (counts >= 2)).sum()) / n if n else nan,
        "gear/prefix_rows_mean": float(counts[valid].double().mean()) if n else nan,
    }
    adv = advantages.double()
    grpo_tok = torch.where(valid, adv[:, None], 0.0)
    method_tok = grpo_tok if token_advantages is None else token_advantages.double()
    method_tok = torch.where(valid, method_tok, 0.0)
    node = valid & (counts >= 2)
    weight = torch.where(node, 1.0 / counts.clamp(min=1).double(), 0.0)  # each node once
    nodes = float(weight.sum())
    if nodes > 0:
        s_grpo = shared_node_sums(ids, mask, group_ids, grpo_tok, tree)
        s_method = shared_node_sums(ids, mask, group_ids, method_tok, tree)
        abs_grpo = float((weight * s_grpo.abs()).sum()) / nodes
        abs_method = float((weight * s_method.abs()).sum()) / nodes
        diff = float((weight * (s_method - s_grpo).abs()).sum()) / nodes
        stats |= {
            "gear/shared_sum_abs_grpo": abs_grpo,
            "gear/shared_sum_abs_method": abs_method,
            "gear/shared_sum_diff": diff / abs_grpo if abs_grpo > 0 else nan,
        }
    else:
        stats |= dict.fromkeys(
            ("gear/shared_sum_abs_grpo", "gear/shared_sum_abs_method", "gear/shared_sum_diff"),
            nan,
        )
    if error_mask is not None:
        stats |= branch_stats(ids, mask, group_ids, advantages, error_mask & valid, tree)
    return stats


def branch_stats(
    ids: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    advantages: Tensor,
    error_mask: Tensor,
    tree: tuple[Tensor, Tensor] | None = None,
) -> dict[str, float]:
    """``gear/branch_*`` of `implicit_credit_stats`: where each failed row's first error token
    (the first True of `error_mask`) lies relative to its branch point from its nearest
    successful sibling (`branch_points`)."""
    failed = advantages < 0
    branch = branch_points(ids, mask, group_ids, advantages > 0, tree)
    placed = error_mask.bool().any(dim=1)
    error = error_mask.to(torch.uint8).argmax(dim=1)
    rows = failed & placed & (branch >= 0)
    k = int(rows.sum())
    out = {"gear/branch_rows": float(k)}
    gap = (error - branch)[rows]
    for name, hit in zip(BRANCH_RELATIONS, (gap < 0, gap == 0, gap > 0), strict=True):
        out[f"gear/branch_error_{name}"] = float(hit.sum()) / k if k else math.nan
    after = gap[gap > 0]
    out["gear/branch_to_error_tokens"] = float(after.double().mean()) if len(after) else math.nan
    return out

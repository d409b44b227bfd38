"""Batches shared by tests in different folders (tests/integrations/trl/test_prefix.py,
tests/modeling/test_modeling.py): a helper module on pytest's path, so a test never imports
another test module (which only works when that module happens to be collected first)."""

from __future__ import annotations

import torch


def batch(
    V: int,
    lengths: tuple[int, ...] = (9, 23, 4),
    groups: tuple[int, ...] = (0, 1, 0, 2, 1, 1, 0, 2, 2, 1),
    T: int = 7,
    seed: int = 0,
    side: str = "left",
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows [prompt | completion] (B, P + T): prompts `lengths[groups[i]]` long, padded on
    `side`; completions right-padded at different lengths, one holding a tool turn (tokens
    that are not the policy's, mask 1 in the row). Returns ids, mask, policy mask (B, T), T."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in lengths]
    P, B = max(lengths), len(groups)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i, k in enumerate(groups):
        cols = slice(P - lengths[k], P) if side == "left" else slice(0, lengths[k])
        ids[i, cols], mask[i, cols] = prompts[k], 1
    ids[:, P:] = torch.randint(3, V, (B, T), generator=g)
    mask[:, P:] = 1
    ends = torch.randint(2, T + 1, (B,), generator=g)
    for i, end in enumerate(ends.tolist()):  # padding after EOS
        ids[i, P + end :], mask[i, P + end :] = pad_id, 0
    policy = mask[:, P:].clone()
    policy[1, 2:5] = 0  # a tool's output inside row 1's completion: in the row, not scored
    ends[1] = T
    ids[1, P:], mask[1, P:] = torch.randint(3, V, (T,), generator=g), 1
    return ids, mask, policy, T

"""`gear.credit.implicit`: the group's prefix tree against a plain-loop re-derivation, on
hand-built groups (identical rows, no shared token, nested prefixes, padding) and random ones."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gear.credit.implicit import (
    branch_points,
    implicit_credit_stats,
    prefix_counts,
    shared_node_sums,
)


def shares(ids, mask, i, j, t):
    """Rows i and j have the same tokens 0..t, and both have all of them (the plain rule)."""
    return all(mask[i][s] and mask[j][s] and ids[i][s] == ids[j][s] for s in range(t + 1))


def plain_counts(ids, mask, groups):
    n, T = len(ids), len(ids[0])
    return [
        [
            sum(shares(ids, mask, i, j, t) for j in range(n) if groups[j] == groups[i])
            if mask[i][t]
            else 0
            for t in range(T)
        ]
        for i in range(n)
    ]


def plain_branch(ids, mask, groups, success):
    out = []
    for i in range(len(ids)):
        best = -1
        for j in range(len(ids)):
            if j == i or groups[j] != groups[i] or not success[j]:
                continue
            lcp = 0
            while lcp < len(ids[0]) and shares(ids, mask, i, j, lcp):
                lcp += 1
            best = max(best, lcp)
        out.append(best)
    return out


def plain_sums(ids, mask, groups, adv):
    n, T = len(ids), len(ids[0])
    return [
        [
            sum(
                adv[j][t] for j in range(n) if groups[j] == groups[i] and shares(ids, mask, i, j, t)
            )
            if mask[i][t]
            else 0.0
            for t in range(T)
        ]
        for i in range(n)
    ]


def tensors(rows, pad=0):
    """Right-padded (ids, mask) of token lists."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[k < len(r) for k in range(T)] for r in rows])
    return ids, mask


def test_identical_rows_share_every_token():
    ids, mask = tensors([[5, 6, 7]] * 3)
    assert prefix_counts(ids, mask, torch.zeros(3, dtype=torch.long)).tolist() == [[3, 3, 3]] * 3


def test_rows_with_no_shared_token_count_only_themselves():
    ids, mask = tensors([[1, 2], [3, 2], [4, 2]])
    assert prefix_counts(ids, mask, torch.zeros(3, dtype=torch.long)).tolist() == [[1, 1]] * 3


def test_nested_prefixes_and_padding():
    # row 1 is a prefix of row 0; row 2 departs at column 1; padding (pad id == a real id) counts
    # as no token at all
    ids, mask = tensors([[1, 2, 3, 0], [1, 2], [1, 9, 3, 0]], pad=0)
    counts = prefix_counts(ids, mask, torch.zeros(3, dtype=torch.long)).tolist()
    assert counts == [[3, 2, 1, 1], [3, 2, 0, 0], [3, 1, 1, 1]]


def test_groups_are_separate_and_need_not_be_contiguous():
    ids, mask = tensors([[1, 2], [1, 2], [1, 2], [1, 3]])
    groups = torch.tensor([0, 1, 0, 1])
    assert prefix_counts(ids, mask, groups).tolist() == [[2, 2], [2, 1], [2, 2], [2, 1]]


@st.composite
def groups_of_rows(draw):
    n_groups, size, T = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 7))
    vocab = draw(st.integers(1, 3))  # a small vocabulary, so prefixes are shared often
    rows = [
        draw(st.lists(st.integers(0, vocab), min_size=0, max_size=T))
        for _ in range(n_groups * size)
    ]
    rows[0] = rows[0] or [0]  # at least one column
    groups = draw(st.permutations([g for g in range(n_groups) for _ in range(size)]))
    extra = draw(st.integers(0, n_groups))  # a smaller group: groups need not be equal
    rows += [[0]] * extra
    groups = list(groups) + [n_groups + k for k in range(extra)]
    return rows, groups


@settings(max_examples=150, deadline=None)
@given(groups_of_rows(), st.data())
def test_every_statistic_equals_the_plain_loop(batch, data):
    rows, groups = batch
    ids, mask = tensors(rows)
    g = torch.tensor(groups)
    L, M = ids.tolist(), mask.tolist()
    assert prefix_counts(ids, mask, g).tolist() == plain_counts(L, M, groups)
    success = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    assert branch_points(ids, mask, g, torch.tensor(success)).tolist() == plain_branch(
        L, M, groups, success
    )
    adv = torch.randn(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        shared_node_sums(ids, mask, g, adv),
        torch.tensor(plain_sums(L, M, groups, adv.tolist()), dtype=torch.float64),
    )


def test_grpo_sums_to_zero_on_the_prefix_the_whole_group_shares():
    """On a prefix every row of a group shares, GRPO's update is the sum of the group's
    advantages, 0; on a node two rows share it is their sum."""
    ids, mask = tensors([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
    adv = torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64)
    tok = adv[:, None].expand(3, 3)
    sums = shared_node_sums(ids, mask, torch.zeros(3, dtype=torch.long), tok)
    assert sums[:, 0].tolist() == [0.0, 0.0, 0.0]
    assert sums[0, 1].item() == sums[1, 1].item() == 0.5


def test_stats_on_a_hand_built_group():
    # rows 0, 1 succeed; rows 2, 3 fail. Row 2 shares 3 tokens with row 0 and errs at column 4
    # (after its branch point 3); row 3 shares 1 token with row 1 and errs at column 1 (at it)
    ids, mask = tensors([[1, 2, 3, 4, 5], [1, 7, 7, 7, 7], [1, 2, 3, 9, 9], [1, 8, 8, 8, 8]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    err = torch.zeros(4, 5, dtype=torch.bool)
    err[2, 4] = err[3, 1] = True
    s = implicit_credit_stats(ids, mask, mask, torch.zeros(4, dtype=torch.long), adv, None, err)
    # shared tokens: column 0 of all 4 rows, columns 1-2 of rows 0 and 2: 8 of 20
    assert s["gear/prefix_shared_frac"] == pytest.approx(8 / 20)
    assert s["gear/prefix_rows_mean"] == pytest.approx((4 * 4 + 4 * 2 + 12 * 1) / 20)
    assert s["gear/branch_rows"] == 2
    assert s["gear/branch_error_after"] == 0.5 and s["gear/branch_error_at"] == 0.5
    assert s["gear/branch_error_before"] == 0.0
    assert s["gear/branch_to_error_tokens"] == 1.0
    # GRPO against itself: nodes are column 0 (sum 0) and columns 1, 2 of rows 0 + 2 (sum 0)
    assert s["gear/shared_sum_abs_grpo"] == s["gear/shared_sum_abs_method"] == 0.0
    assert math.isnan(s["gear/shared_sum_diff"])


def test_a_method_that_reweights_rows_changes_the_shared_sums():
    ids, mask = tensors([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
    adv = torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64)
    tok = adv[:, None] * torch.tensor([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    s = implicit_credit_stats(ids, mask, mask, torch.zeros(3, dtype=torch.long), adv, tok)
    # nodes: column 0 (GRPO 0, method 1 - 1.5 - 0.5 = -1) and column 1 of rows 0, 1 (0.5, 0.5)
    assert s["gear/shared_sum_abs_grpo"] == pytest.approx(0.25)
    assert s["gear/shared_sum_abs_method"] == pytest.approx(0.75)
    assert s["gear/shared_sum_diff"] == pytest.approx(0.5 / 0.25)

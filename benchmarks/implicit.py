"""The group prefix tree (`gear.credit.implicit`): what GEARTrainer's per-step diagnostics and
`lambda_grpo`'s counts cost, vectorised, beside a plain per-row loop (a dict trie per group) and
beside the credit call they accompany (`credit_details`, GEAR), in one run.

    .venv/bin/python -m benchmarks.implicit           # the study's batch and a GPU-sized one
    .venv/bin/python -m benchmarks.implicit --quick
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import isolated, print_table, time_and_memory, write_json


def batch(groups: int, G: int, T: int, vocab: int = 3, seed: int = 0):
    """Rows over a small alphabet, so prefixes are shared often; lengths vary (padding)."""
    g = torch.Generator().manual_seed(seed)
    N = groups * G
    ids = torch.randint(0, vocab, (N, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return ids, mask, torch.arange(N) // G, torch.randn(N, generator=g).double()


def loop_counts(ids, mask, group_ids):
    """c[i][t] by a dict trie per group: the plain rule."""
    visits: dict = {}
    rows = [ids[i][mask[i]].tolist() for i in range(len(ids))]
    for r, g in zip(rows, group_ids.tolist(), strict=True):
        for t in range(len(r)):
            key = (g, tuple(r[: t + 1]))
            visits[key] = visits.get(key, 0) + 1
    return [[visits[(g, tuple(r[: t + 1]))] for t in range(len(r))]
            for r, g in zip(rows, group_ids.tolist(), strict=True)]  # fmt: skip


def case(impl: str, groups: int, G: int, T: int, repeats: int) -> dict:
    from gear.credit import CreditParams, credit_details
    from gear.credit.implicit import implicit_credit_stats, prefix_counts

    ids, mask, gids, adv = batch(groups, G, T)
    kl, ent = torch.rand(ids.shape).double(), torch.rand(ids.shape).double()
    fns = {
        "prefix_counts": lambda: prefix_counts(ids, mask, gids),
        "implicit_credit_stats": lambda: implicit_credit_stats(ids, mask, mask, gids, adv),
        "credit_details(gear)": lambda: credit_details(
            adv, mask, kl=kl, entropy=ent, params=CreditParams()
        ),
        "loop_counts": lambda: loop_counts(ids, mask, gids),
    }
    out = time_and_memory(fns[impl], repeats)
    if impl == "prefix_counts" and groups * G * T <= 64 * 1024:
        want = loop_counts(ids, mask, gids)
        got = prefix_counts(ids, mask, gids)
        out["equal_to_loop"] = all(got[i][mask[i]].tolist() == want[i] for i in range(len(want)))
    return {"impl": impl, "N": groups * G, "G": G, "T": T, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shapes = [(4, 8, 96)] if args.quick else [(4, 8, 96), (32, 16, 1024)]
    rows = []
    for groups, G, T in shapes:
        impls = ["prefix_counts", "implicit_credit_stats", "credit_details(gear)"]
        if groups * G * T <= 64 * 1024:
            impls.append("loop_counts")
        for impl in impls:
            rows.append(isolated(case, impl=impl, groups=groups, G=G, T=T, repeats=args.repeats))
    print_table(rows, ["impl", "N", "G", "T", "median_s", "peak_mb", "equal_to_loop"],
                "the group prefix tree (CPU)")  # fmt: skip
    write_json("implicit", {"rows": rows})


if __name__ == "__main__":
    main()

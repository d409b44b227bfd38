"""The credit core: vectorised `gear` vs the plain per-token loop of spec §2, and the signals
(naive vs chunked logits vs hidden states) at the SmolLM2 vocabulary.

    .venv/bin/python -m benchmarks.credit                 # N=64, T=4096; V=49152, T in {512, 2048}
    .venv/bin/python -m benchmarks.credit --quick         # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

HERE = Path(__file__).parent
from benchmarks.common import isolated, print_table, time_and_memory, write_json  # noqa: E402


def credit_case(impl: str, N: int, T: int, repeats: int) -> dict:
    from gear.credit import CreditParams, token_advantages
    from gear.testing import gear_row

    g = torch.Generator().manual_seed(0)
    adv = torch.randn(N, generator=g)
    valid = torch.rand(N, T, generator=g) > 0.02  # a few tool/padding gaps
    kl = torch.rand(N, T, generator=g) ** 4 * 3
    ent = torch.rand(N, T, generator=g) * 4
    turn = torch.rand(N, T, generator=g) < 0.002

    def vectorised():
        return token_advantages(
            adv, valid, kl=kl, entropy=ent, turn_starts=turn, params=CreditParams()
        )

    def loop():
        v, k, e, ts, a = valid.tolist(), kl.tolist(), ent.tolist(), turn.tolist(), adv.tolist()
        return [gear_row(a[i], v[i], k[i], e[i], ts[i])["token_advantages"] for i in range(N)]

    fn = {"vectorised": vectorised, "loop": loop}[impl]
    out = time_and_memory(fn, repeats)
    if impl == "vectorised":
        ref = torch.tensor(loop(), dtype=torch.float64)
        out["max_abs_diff_vs_loop"] = float((vectorised().double() - ref).abs().max())
    return {"impl": impl, "N": N, "T": T, **out}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    N, T = (8, 512) if args.quick else (64, 4096)
    rows = [
        isolated(credit_case, impl=i, N=N, T=T, repeats=1 if i == "loop" else args.repeats)
        for i in ("loop", "vectorised")
    ]
    rows[1]["speedup"] = rows[0]["median_s"] / rows[1]["median_s"]
    print_table(
        rows,
        ["impl", "N", "T", "median_s", "peak_mb", "speedup", "max_abs_diff_vs_loop"],
        "gear credit: vectorised vs per-token loop (CPU)",
    )

    from benchmarks import signals

    sig_rows = signals.main(
        [
            "--vocab",
            "49152",
            "--T",
            *(["512"] if args.quick else ["512", "2048"]),
            "--methods",
            "naive",
            "chunked_logits",
            "hidden",
            "--chunk-size",
            "128",
            "--repeats",
            str(args.repeats),
            "--name",
            "credit_signals",
        ]
    )
    write_json("credit", {"credit": rows, "signals": sig_rows})


if __name__ == "__main__":
    main()

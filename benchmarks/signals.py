"""Per-token reverse KL + entropy over the full vocabulary: naive full logits vs gear's
chunked-logits path vs gear's hidden-state chunk kernel (`hidden`, the CPU's) vs gear's fold
(`fold`, the GPU's: `gear.credit.fold`) vs TRL's chunked divergence kernel, with the floor of
each: the chunk kernel's GEMMs (`gemm_only`) and the fold's float32-output tile GEMMs
(`gemm_tiles`).

    .venv/bin/python -m benchmarks.signals --vocab 49152 --T 512 2048
    .venv/bin/python -m benchmarks.signals --vocab 49152 151936 --T 512 2048 8192 --chunk-size 256 1024
    # on a GPU (the name is recorded): bf16 as a bf16 run projects
    python -m benchmarks.signals --device cuda --dtype bfloat16 --hidden 2048 --T 16384 \
        --vocab 151936 49152 --methods hidden fold trl gemm_only gemm_tiles --chunk-size 256 4096

Each case runs in a fresh process; time is the median of --repeats calls, memory the peak
extra RSS (CPU) or max allocated (CUDA) above the inputs.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import isolated, print_table, time_and_memory, write_json

METHODS = ("naive", "chunked_logits", "hidden", "fold", "trl", "gemm_only", "gemm_tiles")
CHUNKED = ("chunked_logits", "hidden", "gemm_only")


def _inputs(N: int, T: int, H: int, V: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(N, T, H, generator=g)
    ht = hs + 0.3 * torch.randn(N, T, H, generator=g)
    W = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
    ids = torch.randint(0, V, (N, T), generator=g)
    return hs.to(device, dtype), ht.to(device, dtype), W.to(device, dtype), ids.to(device)


def case(
    method: str,
    N: int,
    T: int,
    H: int,
    V: int,
    dtype: str,
    device: str,
    chunk_size: int,
    repeats: int,
    threads: int,
) -> dict:
    """One measurement, run inside its own process."""
    from gear.credit.signals import signals_from_hidden, signals_from_logits

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    hs, ht, W, ids = _inputs(N, T, H, V, dt, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @torch.no_grad()
    def naive():
        logp_s = torch.log_softmax((hs @ W.T).float(), -1)
        logp_t = torch.log_softmax((ht @ W.T).float(), -1)
        p_s = logp_s.exp()
        kl = (p_s * (logp_s - logp_t)).sum(-1)
        ent = -(p_s * logp_s).sum(-1)
        return kl, ent, logp_s.gather(-1, ids[..., None]), logp_t.gather(-1, ids[..., None])

    @torch.no_grad()
    def chunked_logits():
        return signals_from_logits(hs @ W.T, ht @ W.T, ids, chunk_size=chunk_size)

    @torch.no_grad()
    def hidden():
        return signals_from_hidden(hs, ht, W, ids, chunk_size=chunk_size, kernel="chunk")

    @torch.no_grad()
    def fold():
        return signals_from_hidden(hs, ht, W, ids, kernel="fold")

    @torch.no_grad()
    def trl():
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        h_s, h_t = hs.reshape(-1, H), ht.reshape(-1, H)
        # beta = 1.0: reverse KL(student || teacher); returns per-token divergence and entropy
        return ChunkedDivergenceFunction.apply(
            h_s, W, None, h_t, W, None, 1.0, 1.0, 1.0, None, 1.0, None
        )

    @torch.no_grad()
    def gemm_only():  # the hidden path's two logit GEMMs per chunk and nothing else: its floor
        h_s, h_t = hs.reshape(-1, H), ht.reshape(-1, H)
        for a in range(0, h_s.shape[0], chunk_size):
            torch.nn.functional.linear(h_s[a : a + chunk_size], W)
            torch.nn.functional.linear(h_t[a : a + chunk_size], W)

    @torch.no_grad()
    def gemm_tiles():  # the fold's float32-output tile GEMMs and nothing else: its floor
        from gear.credit.fold import TOKEN_TILE, VOCAB_TILE, _project

        h_s, h_t = hs.reshape(-1, H), ht.reshape(-1, H)
        buf = torch.empty(min(TOKEN_TILE, h_s.shape[0]), VOCAB_TILE, device=device)
        for a in range(0, h_s.shape[0], TOKEN_TILE):
            for c in range(0, V, VOCAB_TILE):
                n, d = min(TOKEN_TILE, h_s.shape[0] - a), min(c + VOCAB_TILE, V)
                _project(buf[:n, : d - c], h_s[a : a + n], W[c:d], None)
                _project(buf[:n, : d - c], h_t[a : a + n], W[c:d], None)

    fn = {
        "naive": naive,
        "fold": fold,
        "gemm_tiles": gemm_tiles,
        "chunked_logits": chunked_logits,
        "hidden": hidden,
        "trl": trl,
        "gemm_only": gemm_only,
    }[method]
    out = time_and_memory(fn, repeats, sync)
    return {
        "method": method,
        "N": N,
        "T": T,
        "V": V,
        "H": H,
        "dtype": dtype,
        "device": device,
        "chunk_size": chunk_size if method in CHUNKED else None,
        **out,
    }


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        return kb / 2**20
    except (OSError, StopIteration):
        return float("inf")


def check_agreement(V: int, device: str) -> dict:
    """Max |difference| on small float32 cases: gear's chunk kernel vs TRL's kernel (KL), and
    gear's fold vs its chunk kernel (KL, entropy and both log-probs) for each estimator the fold
    computes, with and without softcap, bias, temperature and a separate teacher head."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    from gear.credit.fold import FOLD_ESTIMATORS
    from gear.credit.signals import signals_from_hidden

    hs, ht, W, ids = _inputs(1, 64, 64, V, torch.float32, device)
    chunk = signals_from_hidden(hs, ht, W, ids, kernel="chunk")
    with torch.no_grad():
        theirs, _ = ChunkedDivergenceFunction.apply(
            hs.reshape(-1, 64), W, None, ht.reshape(-1, 64), W, None, 1.0, 1.0, 1.0, None, 1.0, None
        )
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(V, generator=g).to(device)
    w_t = (W.cpu() + 0.1 * torch.randn(W.shape, generator=g)).to(device)
    fold_diff = 0.0
    for estimator in FOLD_ESTIMATORS:
        for extra in (
            {},
            {"temperature": 0.7, "lm_head_bias": bias},
            {"softcap": 30.0, "teacher_lm_head_weight": w_t, "temperature": 1.3},
        ):
            a, b = (
                signals_from_hidden(hs, ht, W, ids, estimator=estimator, kernel=k, **extra)
                for k in ("chunk", "fold")
            )
            for k in ("kl", "entropy", "student_logprobs", "teacher_logprobs"):
                fold_diff = max(fold_diff, float((getattr(a, k) - getattr(b, k)).abs().max()))
    return {
        "diff": float((chunk.kl.reshape(-1) - theirs.reshape(-1).float()).abs().max()),
        "fold_vs_chunk": fold_diff,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152])
    ap.add_argument("--T", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--N", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--chunk-size", type=int, nargs="+", default=[256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--name", default="signals", help="results/<name>.json")
    ap.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="skip naive cases whose five (N, T, V) float32 tensors would not fit (default: "
        "free memory of the device)",
    )
    args = ap.parse_args(argv)
    if args.memory_gb is None:
        cuda = args.device.startswith("cuda")
        args.memory_gb = torch.cuda.mem_get_info()[0] / 2**30 if cuda else _available_gb()

    rows = []
    for V in args.vocab:
        for T in args.T:
            for method in args.methods:
                naive_gb = 5 * args.N * T * V * 4 / 2**30
                if method == "naive" and naive_gb > args.memory_gb:
                    r = {
                        "method": method,
                        "N": args.N,
                        "T": T,
                        "V": V,
                        "error": (
                            f"skipped: needs about {naive_gb:.0f} GB, {args.memory_gb:.0f} GB available"
                        ),
                    }
                    rows.append(r)
                    print(r, flush=True)
                    continue
                for cs in args.chunk_size if method in CHUNKED else [None]:
                    r = isolated(
                        case,
                        method=method,
                        N=args.N,
                        T=T,
                        H=args.hidden,
                        V=V,
                        dtype=args.dtype,
                        device=args.device,
                        chunk_size=cs or 256,
                        repeats=args.repeats,
                        threads=args.threads,
                    )
                    r.setdefault("method", method)
                    rows.append(r)
                    print(r, flush=True)
    for V in args.vocab:
        naive = {r["T"]: r for r in rows if r.get("method") == "naive" and r.get("V") == V}
        for r in rows:
            base = naive.get(r.get("T"))
            if r.get("V") == V and base and "peak_mb" in r and r["peak_mb"] > 0:
                r["mem_vs_naive"] = base["peak_mb"] / r["peak_mb"]
                r["speed_vs_naive"] = base["median_s"] / r["median_s"]
    cols = [
        "method",
        "V",
        "T",
        "N",
        "chunk_size",
        "median_s",
        "peak_mb",
        "speed_vs_naive",
        "mem_vs_naive",
        "error",
    ]
    print_table(rows, cols, f"Reverse KL + entropy, {args.dtype} on {args.device}")
    agreement = fold_diff = None
    if "trl" in args.methods:
        checked = isolated(check_agreement, V=args.vocab[0], device=args.device)
        agreement = checked.get("diff", float("nan"))
        fold_diff = checked.get("fold_vs_chunk", float("nan"))
        print(f"max |KL(gear chunk) - KL(TRL kernel)| on a 64-token case: {agreement:.2e}")
        print(f"max |fold - chunk| over KL, entropy, log-probs (float32): {fold_diff:.2e}")
    payload = {"args": vars(args), "rows": rows, "max_abs_diff_vs_trl": agreement}
    write_json(args.name, {**payload, "max_abs_diff_fold_vs_chunk": fold_diff})
    return rows


if __name__ == "__main__":
    main()

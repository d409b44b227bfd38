"""verl teacher pass at long context: peak memory and time, before and after issue 11.

- before: the pass as it was up to commit 5ab5855^ (copied below, `before_pass`): a student and a
  teacher forward with ``logits_to_keep = R + 1``, i.e. two (rows, R + 1, V) logits tensors per
  micro-batch, then `signals_from_logits` over them in chunks.
- after: `gear.integrations.verl.teacher_pass.micro_batch_signals` with no captured student
  states (what ``compute_gear_signals`` runs in verl's bypass mode; with verl's old-log-prob pass
  the student forward is verl's own and this pass adds only the teacher forward): both forwards
  with ``logits_to_keep=1``, logits a chunk at a time from the final hidden states.

A tiny-hidden Llama (H=64, 2 layers, SDPA attention, float32) with a real-size vocabulary, rows
of equal length (prompt 128 tokens, teacher prompt 160, response R), right-padded layout. Each
case runs in a fresh spawned process (`benchmarks.common.isolated`); `peak_mb` is the peak RSS
above the level before the pass (model and inputs built), `process_peak_mb` the process's
ru_maxrss, `seconds` the wall time of a second call. A "before" case whose logits would not fit
in the memory available now is skipped and says why (it needs four (rows, R + 1, V) float32
tensors: the two forwards' logits and the contiguous copies `signals_from_logits` makes of their
sliced views)::

    nice -n 5 .venv/bin/python -m benchmarks.verl_teacher_pass          # V=151936, R 2048..16384

One thread by default: on a shared 2-core machine two threads under contention ran ~8x slower.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from benchmarks.common import RESULTS, PeakRSS, isolated, print_table, write_json

PROMPT, HINT = 128, 32


def tiny_model(V: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------ before (the old pass, copied)


def before_pass(model, prompts, teacher_prompts, responses, temperature=1.0, chunk_size=256):
    """The old worker pass for one micro-batch: left-padded prompts, two forwards keeping R + 1
    positions of logits, `signals_from_logits` in chunks."""
    from gear.credit.signals import signals_from_logits

    def left_pad(ps, rs, width):
        p_max = max(p.numel() for p in ps)
        ids = torch.zeros((len(ps), p_max + width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
            ids[i, p_max - p.numel() : p_max] = p
            ids[i, p_max : p_max + r.numel()] = r
            mask[i, p_max - p.numel() : p_max + r.numel()] = 1
        return ids, mask, (mask.cumsum(1) - 1).clamp(min=0), ids[:, p_max:]

    width = max(r.numel() for r in responses)

    def run(ps):
        ids, mask, pos, resp = left_pad(ps, responses, width)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=False,
            logits_to_keep=width + 1,
        ).logits
        return logits[:, -(width + 1) : -1], resp

    with torch.no_grad():
        s_logits, tokens = run(prompts)
        t_logits, _ = run(teacher_prompts)
        sig = signals_from_logits(
            s_logits, t_logits, tokens, temperature=temperature, chunk_size=chunk_size
        )
    return sig.kl


# ------------------------------------------------------------------ after


def after_pass(model, prompts, teacher_prompts, responses, temperature=1.0, chunk_size=256):
    from gear.integrations.verl.teacher_pass import TeacherPassOptions, micro_batch_signals

    opts = TeacherPassOptions(
        temperature=temperature, chunk_size=chunk_size, micro_batch_size=len(prompts)
    )
    with torch.no_grad():
        out = micro_batch_signals(model, None, prompts, teacher_prompts, responses, opts, False)
    return torch.stack(out["kl"])


def case(impl: str, R: int, V: int, rows: int, threads: int, check: bool, calls: int) -> dict:
    torch.set_num_threads(threads)
    model = tiny_model(V)
    g = torch.Generator().manual_seed(R)
    prompts = [torch.randint(2, V, (PROMPT,), generator=g) for _ in range(rows)]
    teachers = [torch.cat([p, torch.randint(2, V, (HINT,), generator=g)]) for p in prompts]
    responses = [torch.randint(2, V, (R,), generator=g) for _ in range(rows)]
    fn = before_pass if impl == "before" else after_pass
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        kl = fn(model, prompts, teachers, responses)
    seconds = time.perf_counter() - t0
    if calls > 1:  # time a second call, without the memory sampler running
        t0 = time.perf_counter()
        fn(model, prompts, teachers, responses)
        seconds = time.perf_counter() - t0
    out = {
        "R": R,
        "V": V,
        "rows": rows,
        "impl": impl,
        "peak_mb": round(mem.extra_mb, 1),
        "seconds": round(seconds, 2),
        "timed_call": "second" if calls > 1 else "first (memory sampled meanwhile)",
        "process_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "kl_mean": float(kl.float().mean()),
    }
    if check:  # both implementations on a slice of the same rows: the same signals
        short = [r[:64] for r in responses]
        a = before_pass(model, prompts, teachers, short)
        b = after_pass(model, prompts, teachers, short)
        out["max_abs_kl_diff_vs_other_impl"] = float((a - b).abs().max())
    return out


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--R", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--impl", nargs="+", default=["before", "after"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--headroom-mb",
        type=float,
        default=6000,
        help="skip a 'before' case unless its logits fit in MemAvailable minus this",
    )
    ap.add_argument(
        "--calls",
        type=int,
        default=2,
        choices=[1, 2],
        help="2: memory on the first call, time on a second; 1: both on one call",
    )
    ap.add_argument(
        "--append", action="store_true", help="keep the cases already in results/<name>.json"
    )
    ap.add_argument("--name", default="verl_teacher_pass", help="results/<name>.json")
    args = ap.parse_args(argv)
    capability = torch.backends.cpu.get_cpu_capability()
    results = []
    path = RESULTS / f"{args.name}.json"
    if args.append and path.exists():
        results = json.loads(path.read_text())["cases"]
    done = {(r["R"], r["rows"], r["impl"]) for r in results}
    for R in args.R:
        for rows in args.rows:
            for impl in args.impl:
                if (R, rows, impl) in done:
                    continue
                # the two forwards' logits and the contiguous copies signals_from_logits makes
                # of their sliced views (measured: 10.0 GB at R=2048, 2 rows)
                need_mb = 4 * rows * (R + 1) * args.V * 4 / 2**20
                avail = _available_mb()
                if impl == "before" and need_mb > avail - args.headroom_mb:
                    r = {
                        "R": R,
                        "V": args.V,
                        "rows": rows,
                        "impl": impl,
                        "peak_mb": None,
                        "seconds": None,
                        "skipped": (
                            f"four (rows, R+1, V) float32 tensors need {need_mb / 1024:.1f} GB; "
                            f"{avail / 1024:.1f} GB available on the shared machine "
                            f"(headroom {args.headroom_mb / 1024:.1f} GB kept)"
                        ),
                    }
                else:
                    r = isolated(
                        case,
                        impl=impl,
                        R=R,
                        V=args.V,
                        rows=rows,
                        threads=args.threads,
                        check=(args.R[0] == R and rows == args.rows[0]),
                        calls=args.calls,
                    )
                    r.update({k: v for k, v in (("R", R), ("rows", rows), ("impl", impl))})
                results.append(r)
                print(r, flush=True)
                payload = {"capability": capability, "threads": args.threads, "cases": results}
                write_json(args.name, payload)  # after every case: partial results survive
    print_table(
        results,
        ["R", "V", "rows", "impl", "peak_mb", "process_peak_mb", "seconds", "skipped"],
        f"verl teacher pass, CPU ({capability}), {args.threads} threads, float32",
    )
    return results


if __name__ == "__main__":
    main()

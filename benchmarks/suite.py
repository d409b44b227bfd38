"""The embedded model on the paper's benchmark suites (issue 69): a small subset of each real set,
scored as `gear eval --suite` scores it, with wall time and the CPU's capability.

    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.suite
    .venv/bin/python -m benchmarks.suite --limit 50 --samples 8 --max-new-tokens 256 --threads 2

A figure, not a test: SmolLM2-135M is near 0 on MATH-500, GSM8K, AIME and BFCL, and that is
what it shows, with how long the suite takes on this machine and how often the model gives a
final answer the task can read at all (`answered`). The per-benchmark records (every
completion) go to --work and are resumed from there; benchmarks/results/<name>.json holds the
table, the settings and the times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data"))
    ap.add_argument("--suites", nargs="+", default=["paper-math", "paper-tools"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--samples", type=int, default=4, help="AIME's k")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="/tmp/gear-bench-suite")
    ap.add_argument("--name", default="suite_smollm2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from gear.app import suite

    rows, times, answered, start = [], {}, {}, time.monotonic()
    for name in args.suites:
        settings = suite.Settings(
            name,
            data_dir=args.data_dir,
            k=args.samples,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            limit=args.limit,
            batch_size=args.batch_size,
        )
        planned = suite.plan(settings)
        result = suite.run(args.model, settings, args.work, planned=planned, log_stream=sys.stderr)
        for p in planned:  # how long each set took, and how often the model gave an answer at all
            path = Path(args.work) / f"suite_{name}" / "model" / f"{p.bench.name}.json"
            record = json.loads(path.read_text())
            times[p.bench.name] = record["wall_s"]
            done = [
                p.task.answer_span(c) is not None for r in record["rows"] for c in r["completions"]
            ]
            answered[p.bench.name] = sum(done) / len(done)
        for row in result["rows"]:
            rows.append(
                {
                    "suite": name,
                    "benchmark": row["title"],
                    "metric": row["metric"],
                    "n": row["n"],
                    "value": row["model"]["value"],
                    "ci_lo": row["model"]["ci"][0],
                    "ci_hi": row["model"]["ci"][1],
                    "T": row["temperature"],
                    "max_new_tokens": row["max_new_tokens"],
                    "answered": answered[row["benchmark"]],
                    "scoring_s": times[row["benchmark"]],
                }
            )
    capability = torch.backends.cpu.get_cpu_capability()
    title = (
        f"{args.model} on the paper's suites, first {args.limit} problems of each set, "
        f"AIME k={args.samples} at T={args.temperature:g}, {args.max_new_tokens} new tokens, "
        f"{args.threads} thread(s), {capability}"
    )
    print_table(rows, list(rows[0]), title)
    scoring = sum(times.values())
    print(f"\nscoring time {scoring:.0f} s over {len(times)} sets (this invocation "
          f"{time.monotonic() - start:.0f} s, resumed sets not rescored)")  # fmt: skip
    write_json(
        args.name,
        {
            "command": "python -m benchmarks.suite " + " ".join(sys.argv[1:]),
            "model": args.model,
            "settings": vars(args),
            "cpu_capability": capability,
            "scoring_s": scoring,
            "scoring_s_per_set": times,
            "answered": "the fraction of completions with a final answer the task reads at all "
            "(a closed \\boxed{}, an 'Answer:', a tool call that parses)",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()

"""gear's tasks as verl RL parquet files::

    python -m gear.integrations.verl.data --task gsm8k --option path=/data/gsm8k --out ~/data/gear_gsm8k
    python -m gear.integrations.verl.data --task math --option path=/data/math --out ~/data/gear_math
    python -m gear.integrations.verl.data --task tools --out ~/data/gear_tools

writes ``train.parquet`` and ``test.parquet`` with verl's RL columns:

- ``data_source``: ``gear/<task>`` (the reward function `gear.integrations.verl.rewards` reads it),
- ``prompt``: the chat (verl's ``data.prompt_key``), ``ability``: the task's hint kind,
- ``reward_model``: ``{"style": "rule", "ground_truth": <final answer>}`` (the reward's reference),
- ``extra_info``: ``{"split", "index", "ground_truth": <worked solution / reference calls>,
  "tools_kwargs"}``: the teacher hint reads ``extra_info.ground_truth``
  (``gear.ground_truth_field``),
- ``agent_name``: ``tool_agent`` for tasks with tools, else ``single_turn_agent``.

Pure Python (datasets + pyarrow); no verl import. No network unless a task option asks for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gear.tasks import get_task


def verl_rows(
    task_name: str, split: str, n: int | None = None, seed: int = 0, **options: Any
) -> list[dict]:
    """The rows of one split of a gear task in verl's RL format (see the module doc)."""
    task = get_task(task_name, **options)
    ds = task.dataset(split, n=n, seed=seed)
    rows = []
    for i, row in enumerate(ds):
        has_tools = bool(row.get("tools"))
        extra: dict[str, Any] = {
            "split": split,
            "index": i,
            "ground_truth": str(row["ground_truth"]),
        }
        if has_tools:
            extra["tools_kwargs"] = {
                "lookup": {"create_kwargs": {"state": str(row.get("state") or "{}")}}
            }
        rows.append(
            {
                "data_source": f"gear/{task_name}",
                "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
                "ability": task.hint_kind,
                "reward_model": {"style": "rule", "ground_truth": str(row["answer"])},
                "extra_info": extra,
                "agent_name": "tool_agent" if has_tools else "single_turn_agent",
            }
        )
    return rows


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--task", required=True, help="a gear task: gsm8k, math, tools, arithmetic, bfcl"
    )
    ap.add_argument("--out", required=True, help="output directory (train.parquet, test.parquet)")
    ap.add_argument(
        "--option", action="append", default=[], help="task option KEY=VALUE (repeatable)"
    )
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-test", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    options = dict(kv.split("=", 1) for kv in args.option)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        rows = verl_rows(args.task, split, n=n, seed=args.seed, **options)
        out = write_parquet(rows, Path(args.out) / f"{split}.parquet")
        print(f"{out}: {len(rows)} rows")


if __name__ == "__main__":
    main()

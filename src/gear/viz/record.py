"""Per-token credit records: the one way to write and read `RUN_DIR/credit/step_*.jsonl`.

A record is one rollout row of one step, in the format of docs/contracts.md ("Credit record"):
scalar fields (step, row, method, prompt, completion, reward, advantage) and per-token lists
(tokens, token_ids, valid, kl, entropy, kl_norm, entropy_norm, onset, segment_id, weight,
token_advantage), all of the row's completion length T_row (padding removed). Non-finite
floats are written as null, so every file is strict JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from gear.credit import CreditDetails
from gear.io import InputError, read_text, write_text

# what to do about a damaged credit record (`read_credit_records`)
CREDIT_TODO = (
    "move it aside to read the other records (a record cut short by a run killed while "
    "writing it is written again when the run is resumed: `gear train --resume`)"
)


def credit_record_path(run_dir: str | Path, step: int) -> Path:
    """`RUN_DIR/credit/step_{step:06d}.jsonl`."""
    return Path(run_dir) / "credit" / f"step_{step:06d}.jsonl"


def _float(x: float) -> float | None:
    """A JSON-safe float (7 significant digits, about float32), None when not finite."""
    x = float(x)
    return float(f"{x:.7g}") if math.isfinite(x) else None


def _text(x: Any) -> str:
    """A prompt or completion as text: strings as is, chat messages as 'role: content' lines."""
    if isinstance(x, str):
        return x
    if isinstance(x, Sequence) and all(isinstance(m, dict) for m in x):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in x)
    return json.dumps(x, default=str)


def _scalar(x: Any, i: int) -> float | None:
    """Element i of a (N,) tensor or sequence, as a JSON-safe float."""
    return _float(x[i].item() if isinstance(x, Tensor) else x[i])


def credit_rows(
    details: CreditDetails,
    *,
    tokens: Sequence[Sequence[str]],
    rewards: Sequence[float] | Tensor,
    advantages: Sequence[float] | Tensor,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    step: int,
    method: str,
    rows: Sequence[int] | None = None,
    kl: Tensor | None = None,
    entropy: Tensor | None = None,
    token_ids: Tensor | Sequence[Sequence[int]] | None = None,
    completion_mask: Tensor | None = None,
) -> list[dict[str, Any]]:
    """Credit records (contracts format) of some rows of one batch.

    Args:
        details: `CreditDetails` of the batch; its tensors are (N, T).
        tokens: N lists of token strings, each at least T_row long (extra entries, e.g. padding,
            are dropped).
        rewards, advantages: (N,) floats. prompts, completions: N strings or chat message lists.
        step: the training step the rows' rollouts train, 1-based (as metrics.jsonl numbers
            it). method: credit method name.
        rows: which rows to record (default all N).
        kl, entropy: (N, T) raw signals (optional; written as null when not given).
        token_ids: (N, T) ids (optional; null when not given).
        completion_mask: (N, T) bool, 1 on every real completion token, policy and tool
            observation alike (optional). T_row = 1 + the last position where it or
            `details.valid` is set; without it, observation tokens after the last policy
            token are dropped with the padding.
    Returns:
        One dict per recorded row; per-token lists have length T_row. Tool tokens inside a row
        stay, with valid = false.
    """
    valid = details.valid.bool().cpu()
    real = valid if completion_mask is None else valid | completion_mask.bool().cpu()
    cols = {
        "kl": kl, "entropy": entropy, "kl_norm": details.kl_norm,
        "entropy_norm": details.entropy_norm, "weight": details.weights,
        "token_advantage": details.token_advantages,
    }  # fmt: skip
    cols = {k: None if v is None else v.detach().double().cpu().tolist() for k, v in cols.items()}
    onsets = details.onsets.bool().cpu().tolist()
    seg = details.segment_ids.long().cpu().tolist()
    skipped = None if details.skipped_rows is None else details.skipped_rows.cpu().tolist()
    ids = token_ids.long().cpu().tolist() if isinstance(token_ids, Tensor) else token_ids
    out = []
    for i in range(valid.shape[0]) if rows is None else rows:
        nz = real[i].nonzero()
        n = int(nz[-1]) + 1 if len(nz) else 0
        if len(tokens[i]) < n:
            raise ValueError(f"tokens[{i}] has {len(tokens[i])} entries, the row needs {n}")
        rec: dict[str, Any] = {
            "step": int(step), "row": int(i), "method": method,
            "prompt": _text(prompts[i]), "completion": _text(completions[i]),
            "reward": _scalar(rewards, i), "advantage": _scalar(advantages, i),
            "tokens": [str(t) for t in tokens[i][:n]],
            "token_ids": [int(t) for t in ids[i][:n]] if ids is not None else [None] * n,
            "valid": valid[i, :n].tolist(),
        }  # fmt: skip
        unscored = bool(skipped and skipped[i])  # no signals were computed for the row
        for key in ("kl", "entropy", "kl_norm", "entropy_norm"):
            scored = cols[key] and not unscored
            rec[key] = [_float(v) for v in cols[key][i][:n]] if scored else [None] * n
        rec["onset"] = onsets[i][:n]
        rec["segment_id"] = seg[i][:n]
        rec["weight"] = [_float(v) for v in cols["weight"][i][:n]]
        rec["token_advantage"] = [_float(v) for v in cols["token_advantage"][i][:n]]
        if unscored:
            rec["skipped"] = True
        out.append(rec)
    return out


def write_credit_record(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write records as JSONL (one per line, strict JSON), replacing the file. Returns the path.

    Use `credit_record_path(run_dir, step)` for the path of a training run's step.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False, allow_nan=False) for r in rows]
    write_text(path, "".join(line + "\n" for line in lines))  # a stop never leaves half
    return path


def read_credit_records(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """All records of a run, sorted by (step, row).

    Accepts a run directory (reads `credit/step_*.jsonl`), the credit directory itself, or
    one JSONL file. A file that is not JSON lines of records (cut short, say, by a run killed
    while writing it) is an `InputError` naming it and the line.
    """
    p = Path(run_dir_or_file)
    if p.is_file():
        files = [p]
    else:
        credit = p / "credit" if (p / "credit").is_dir() else p
        files = sorted(credit.glob("step_*.jsonl"))
    records = []
    for f in files:
        for n, line in enumerate(read_text(f, CREDIT_TODO).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f, f"line {n} is not a JSON record ({e.msg})", CREDIT_TODO
                ) from None
            if not isinstance(record, dict):
                raise InputError(f, f"line {n} is not a record (a JSON object)", CREDIT_TODO)
            records.append(record)
    return sorted(records, key=lambda r: (r.get("step", 0), r.get("row", 0)))


def trajectory_row(records: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The record the run's trajectory plot shows, and why, by a stated rule: the latest step
    that recorded a scored row with a non-zero advantage (credit acts only there; a tied row's
    weights multiply 0); in it, a failed row (A < 0) with a KL onset if there is one, else any
    row with an onset, else any such row; among those, the one whose length is closest to the
    median length of the step's scored rows (ties: the first). Without any such row, the last
    record. `records`: `read_credit_records` output, sorted by (step, row)."""
    if not records:
        raise ValueError("records: expected at least one credit record, got none")

    def acts(r: dict[str, Any]) -> bool:
        return not r.get("skipped") and bool(r.get("advantage")) and any(r["valid"])

    steps = sorted({r["step"] for r in records if acts(r)})
    if not steps:
        return records[-1], "the last record (no recorded row has a non-zero advantage)"
    step = steps[-1]
    rows = [r for r in records if r["step"] == step and acts(r)]
    lengths = sorted(sum(r["valid"]) for r in rows)
    median = lengths[len(lengths) // 2]
    kinds = (
        ("a failed row with a KL onset", lambda r: r["advantage"] < 0 and any(r["onset"])),
        ("a row with a KL onset", lambda r: any(r["onset"])),
        ("a row with a non-zero advantage", lambda r: True),
    )
    for kind, keep in kinds:
        pool = [r for r in rows if keep(r)]
        if pool:
            pick = min(pool, key=lambda r: abs(sum(r["valid"]) - median))
            why = (
                f"{kind} of the latest step with one ({step}), the length nearest the "
                f"median of its {len(rows)} scored rows ({sum(pick['valid'])} vs {median} tokens)"
            )
            return pick, why
    raise AssertionError("unreachable: the last kind keeps every row")

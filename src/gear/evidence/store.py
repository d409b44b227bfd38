"""The run store: each finished run of a study is one JSON file, named by a key that digests the
code that determines the run and the run's parameters.

A grid that stops resumes: a run whose key is kept is read back, not rerun. An edit of the code
that determines the runs changes every key, so a stale run is never read; an edit of anything
else (the analysis, a figure, the command line) keeps them. Writes are atomic (`gear.io`: a
temporary file, then a rename), so a killed run leaves no half-written result, and a temporary
is never counted.

    store = RunStore(root, code_digest([train_fn, eval_fn], files=[...]))
    params = {"arm": "grpo", "seed": 3, "cfg": asdict(cfg)}
    result = store.get(params)
    if result is None:
        result = store.put(params, train(...))

`RecordStore` keeps runs under names a study chooses instead (`records/<name>.json`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gear.io import write_json


def code_digest(objects: Iterable[Any] = (), files: Iterable[Path] = ()) -> str:
    """SHA-256 (hex) over the source of `objects` (functions, classes), in order, then over the
    bytes of `files`, in order. A missing file is an error, never skipped: skipping it would
    change every key without saying why."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def run_key(params: Mapping[str, Any], code: str) -> str:
    """16 hex digits of SHA-256 over the JSON of `params` with `code` added under "code"
    (keys sorted, so the order in which `params` was written does not matter)."""
    if "code" in params:
        raise ValueError("run_key: 'code' is the store's own entry; name the parameter otherwise")
    blob = json.dumps({**params, "code": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunStore:
    """Finished runs under `root`, keyed by `code` (a `code_digest`) and each run's parameters.

    `prefix` names a kind of result kept beside the runs (e.g. "base-" for a step-0 evaluation
    shared by every arm of a seed); it is part of the file name, not of the key.
    """

    root: Path
    code: str

    def key(self, params: Mapping[str, Any]) -> str:
        return run_key(params, self.code)

    def path(self, params: Mapping[str, Any], prefix: str = "") -> Path:
        return Path(self.root) / f"{prefix}{self.key(params)}.json"

    def get(self, params: Mapping[str, Any], prefix: str = "") -> dict[str, Any] | None:
        """The kept result of the run `params`, or None if it has not finished."""
        path = self.path(params, prefix)
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, params: Mapping[str, Any], result: Any, prefix: str = "") -> Any:
        """Keep `result` as the run `params` (atomically); returns `result`."""
        write_json(self.path(params, prefix), result)
        return result

    def kept(self, prefix: str = "") -> list[str]:
        """The keys of every finished run under `root` with this `prefix` (sorted; temporaries
        and other files are not runs)."""
        root = Path(self.root)
        if not root.is_dir():
            return []
        stems = (p.name[len(prefix) : -len(".json")] for p in root.glob(f"{prefix}*.json"))
        return sorted(s for s in stems if re.fullmatch("[0-9a-f]{16}", s))

    def status(self, grid: Iterable[Mapping[str, Any]], prefix: str = "") -> dict[str, Any]:
        """Which runs of `grid` (each a parameter mapping) are kept: {"kept", "missing" (the
        parameters of each run not yet finished), "of"}. Reads file names, never results, so
        a grid spread over sessions can be checked without reading its numbers."""
        grid = list(grid)
        missing = [dict(p) for p in grid if not self.path(p, prefix).is_file()]
        return {"kept": len(grid) - len(missing), "missing": missing, "of": len(grid)}


@dataclass(frozen=True)
class RecordStore:
    """Finished runs under `root` kept by name, `<root>/<name>.json`: for a study that names its
    runs itself (`gate-lora16_lr5e-4-grpo-seed3`) and commits each record as it lands, where
    `RunStore` keys them by a digest of their code. Written as JSON with `indent`, atomically;
    the studies' records use indent 1, so a record read and rewritten keeps its bytes."""

    root: Path
    indent: int | None = 1

    def path(self, name: str) -> Path:
        return Path(self.root) / f"{name}.json"

    def get(self, name: str) -> dict[str, Any] | None:
        """The record `name`, or None if it is not kept."""
        path = self.path(name)
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, name: str, record: Any) -> Any:
        """Keep `record` as `name` (atomically); returns `record`."""
        write_json(self.path(name), record, indent=self.indent)
        return record

    def names(self, pattern: str = "*") -> list[str]:
        """The names of the kept records that match the glob `pattern`, sorted (temporaries and
        other files are not records)."""
        return sorted(p.name[: -len(".json")] for p in Path(self.root).glob(f"{pattern}.json"))

    def all(self, pattern: str = "*") -> list[dict[str, Any]]:
        """Every record whose name matches the glob `pattern`, in name order."""
        return [json.loads(self.path(n).read_text()) for n in self.names(pattern)]

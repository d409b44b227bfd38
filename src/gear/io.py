"""Files gear reads and writes: read and checked before they are used, written atomically.

A damaged or malformed file is an `InputError`: one line that names the file, says what is
wrong with it and what to do (`gear` prints it and exits 2, without a traceback unless
`gear --debug` or GEAR_DEBUG=1 asks for one). Covered here: text, YAML and JSON files, and the
weight files of a model directory (safetensors and `torch.save` files, their index), checked
from their headers and directories, never read whole: milliseconds per checkpoint.

Every file gear writes goes through `replacing` (`write_text`, `write_json`): written beside
its path, then renamed onto it, so a reader (or a resumed run) never sees half a file. The
tasks, the viewer, the evidence stores and the program (`gear.app.rundir` for a run directory)
all read and write through this module.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


class InputError(ValueError):
    """A file gear reads is missing, damaged or malformed: `path`, `problem` (what is wrong),
    `todo` (what to do). Its message is one line: "PATH: PROBLEM; TODO"."""

    def __init__(self, path: str | Path, problem: str, todo: str = "") -> None:
        self.path, self.problem, self.todo = Path(path), problem, todo
        super().__init__(f"{path}: {problem}" + (f"; {todo}" if todo else ""))

    def with_todo(self, todo: str) -> InputError:
        return InputError(self.path, self.problem, todo)


def read_text(path: str | Path, todo: str = "") -> str:
    """A text file's content (UTF-8); an InputError when it is missing or unreadable."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise InputError(path, "missing", todo) from e
    except IsADirectoryError as e:
        raise InputError(path, "is a directory, expected a file", todo) from e
    except UnicodeDecodeError as e:
        raise InputError(
            path, f"not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})", todo
        ) from e
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror})", todo) from e


def read_yaml(path: str | Path, todo: str | None = None) -> Any:
    """A YAML file's content; an InputError naming the line and column of a syntax error, and
    saying so when that line is indented with a tab (YAML indents with spaces only). `todo`:
    what to do about it (default: correct that line)."""
    path = Path(path)
    text = read_text(path, todo or "")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        tabbed = [
            n
            for n, line in enumerate(text.splitlines(), 1)
            if "\t" in line[: len(line) - len(line.lstrip())]
        ]
        if mark is not None and tabbed and (mark.line + 1 in tabbed or "'\\t'" in str(e)):
            line = mark.line + 1 if mark.line + 1 in tabbed else tabbed[0]
            raise InputError(
                path,
                f"line {line} is indented with a tab; YAML indents with spaces only",
                todo or f"replace the tab on line {line} with spaces",
            ) from e
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        fix = f"correct line {mark.line + 1}" if mark is not None else "correct it"
        raise InputError(
            path,
            f"not valid YAML{where} ({what})",
            todo or f"{fix} (YAML: `key: value` lines, nested keys indented with spaces)",
        ) from e


def read_json(path: str | Path, todo: str = "") -> Any:
    """A JSON file's content; an InputError when it is missing, empty or not JSON."""
    path = Path(path)
    text = read_text(path, todo)
    if not text.strip():
        raise InputError(path, f"empty ({len(text.encode())} bytes)", todo)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            path, f"not valid JSON ({e.msg}: line {e.lineno}, column {e.colno})", todo
        ) from e


# ------------------------------------------------------------------------------ weight files

SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors format's own limit


def check_safetensors(path: Path) -> None:
    """An InputError unless `path` is a whole safetensors file: its header parses and its size
    is exactly what the header's tensor offsets say (a cut file is shorter)."""
    size = path.stat().st_size
    if size < 8:
        raise InputError(path, f"cut short: {size} bytes, less than a safetensors header")
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > SAFETENSORS_MAX_HEADER:
            raise InputError(path, "not a safetensors file (its first 8 bytes are no header size)")
        if 8 + n > size:
            raise InputError(path, f"cut short: {size} bytes, its header alone needs {8 + n}")
        header = f.read(n)
    try:
        meta = json.loads(header)
        end = max(
            (int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__"), default=0
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise InputError(path, "not a safetensors file (its header is not a tensor table)") from e
    expected = 8 + n + end
    if size < expected:
        raise InputError(path, f"cut short: {size} of the {expected} bytes its header lists")
    if size > expected:
        raise InputError(path, f"{size} bytes, {size - expected} more than its header lists")


def check_torch_file(path: Path) -> None:
    """An InputError unless `path` looks like a whole `torch.save` file: a zip archive whose
    directory (written last, at its end) is there and which holds a pickle."""
    size = path.stat().st_size
    if size == 0:
        raise InputError(path, "empty (0 bytes)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise InputError(
            path, f"cut short or not a PyTorch file ({size} bytes, no zip directory at its end)"
        ) from e
    if not any(name.endswith("data.pkl") for name in names):
        raise InputError(path, "not a PyTorch file (no data.pkl in it)")


WEIGHT_FILES = (
    "adapter_model.safetensors",
    "model.safetensors",
    "adapter_model.bin",
    "pytorch_model.bin",
)
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_files(folder: Path) -> list[Path]:
    """Check a model directory's config and weight files (a checkpoint, `final/`, a saved
    model): an InputError naming the first damaged one. Returns the weight files found."""
    for name in ("config.json", "adapter_config.json"):
        if (folder / name).is_file() and not isinstance(read_json(folder / name), dict):
            raise InputError(folder / name, "not a JSON object")
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    for name in WEIGHT_INDEXES:
        if (folder / name).is_file():
            index = read_json(folder / name)
            shards = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(shards, dict):
                raise InputError(folder / name, "holds no weight_map")
            for shard in sorted(set(map(str, shards.values()))):
                if not (folder / shard).is_file():
                    raise InputError(folder / shard, f"missing (listed in {name})")
                files.append(folder / shard)
    for file in files:
        (check_safetensors if file.suffix == ".safetensors" else check_torch_file)(file)
    return files


# ------------------------------------------------------------------------------ writing


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside `path` (named by this process) to write in the block, renamed onto
    `path` when the block ends without an error, so a reader (or a resumed run) never sees half a
    file. The one atomic write of the project: `write_text` goes through it, and a writer that
    needs a path of its own uses it directly (`with replacing(p) as tmp: torch.save(x, tmp)`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:  # a block that failed leaves neither half a file nor its temporary
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: Path, obj: Any, indent: int | None = None) -> Path:
    """Write `obj` as JSON to `path` atomically (`write_text`)."""
    return write_text(path, json.dumps(obj, indent=indent))

"""Files gear reads, checked before they are used.

A damaged or malformed file is an `InputError`: one line that names the file, says what is
wrong with it and what to do (`gear` prints it and exits 2, without a traceback unless
`gear --debug` or GEAR_DEBUG=1 asks for one). Covered here: YAML (recipes, a run's
config.yaml), JSON (trainer_state.json, summary.json, ...), checkpoints (weights, optimizer,
scheduler, RNG state, trainer state), `final/`, and what a run directory holds. The checks read
headers and directories, never whole weight files: milliseconds per checkpoint.

A run directory is one that holds `config.yaml` (`gear train` writes it first). Its checkpoints
are `checkpoint-<step>` directories; the newest one is what `gear train --resume` continues from
(`resume_checkpoint`: a damaged newest checkpoint is refused, never skipped or overwritten).
"""

from __future__ import annotations

import json
import re
import zipfile
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


# ------------------------------------------------------------------------------ text files


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


# ------------------------------------------------------------------------------ checkpoints

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # HF's pattern (transformers.trainer_utils)


def checkpoints(run_dir: Path) -> list[Path]:
    """A run's `checkpoint-<step>` directories, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CHECKPOINT.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(CHECKPOINT.match(p.name).group(1)))  # type: ignore[union-attr]


def check_checkpoint(checkpoint: Path) -> None:
    """An InputError naming the first missing or damaged file of a checkpoint: weights
    (`check_model_files`), optimizer.pt and scheduler.pt (without them HF's Trainer resumes
    silently with a new optimizer), rng_state*.pth, trainer_state.json. DeepSpeed and FSDP
    checkpoints keep weights and optimizer in their own layout: only their other files are
    checked."""
    checkpoint = Path(checkpoint)
    sharded = any(
        p.name.startswith("global_step") or "fsdp" in p.name for p in checkpoint.iterdir()
    )
    weights = check_model_files(checkpoint)
    if not weights and not sharded:
        raise InputError(
            checkpoint, "holds no model weights (adapter_model.safetensors or model.safetensors)"
        )
    for name in ("optimizer.pt", "scheduler.pt"):
        if (checkpoint / name).is_file():
            check_torch_file(checkpoint / name)
        elif not sharded:
            raise InputError(checkpoint / name, "missing")
    for rng in sorted(checkpoint.glob("rng_state*.pth")):
        check_torch_file(rng)
    state = read_json(checkpoint / "trainer_state.json")
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise InputError(checkpoint / "trainer_state.json", "holds no global_step")


def checkpoint_problem(checkpoint: Path) -> InputError | None:
    """What is wrong with a checkpoint (`check_checkpoint`), or None when it is complete."""
    try:
        check_checkpoint(checkpoint)
    except InputError as e:
        return e
    return None


def newest_complete(found: list[Path]) -> tuple[Path | None, list[InputError]]:
    """The newest complete checkpoint of `found` (oldest first; None if none is complete) and
    the problems of the newer, damaged ones, newest first."""
    damaged = []
    for checkpoint in reversed(found):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, damaged
        damaged.append(problem)
    return None, damaged


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `gear train --resume` continues from: the run's newest, checked (None
    when it has none). A damaged newest checkpoint is refused, never skipped: an InputError
    naming the damaged file and the previous complete checkpoint, with the command that
    continues from it (move the damaged one aside). Nothing on disk is changed."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    if not found:
        return None
    newest = found[-1]
    problem = checkpoint_problem(newest)
    if problem is None:
        return newest
    previous, _ = newest_complete(found[:-1])
    move = f"`mv {newest} {run_dir / ('damaged-' + newest.name)}`"
    if previous is not None:
        todo = (
            f"{newest.name} is damaged and the previous complete checkpoint is {previous.name}: "
            f"to continue from it, move the damaged one aside ({move}) and run "
            f"`gear train --resume {run_dir}` again"
        )
    else:
        todo = (
            f"{newest.name} is damaged and no earlier checkpoint is complete: move it aside "
            f"({move}) and `gear train --resume {run_dir}` trains the run again from step 0"
        )
    raise problem.with_todo(todo)


# ------------------------------------------------------------------------------ run directories


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a gear run directory (it holds config.yaml, written first)."""
    return (Path(path) / "config.yaml").is_file()


def run_config_file(run_dir: Path, todo: str) -> dict[str, Any]:
    """The mapping in RUN_DIR/config.yaml; an InputError when it is missing, broken or empty."""
    path = Path(run_dir) / "config.yaml"
    values = read_yaml(path, todo)
    if not values:
        raise InputError(path, "empty", todo)
    if not isinstance(values, dict):
        raise InputError(
            path, f"expected a mapping of keys to values, got {type(values).__name__}", todo
        )
    return values


def _step_of(checkpoint: Path, config: dict[str, Any]) -> str:
    """`checkpoint-2 (step 2 of 40)`: the step of a checkpoint and the run's max_steps."""
    step = CHECKPOINT.match(checkpoint.name).group(1)  # type: ignore[union-attr]
    total = (config.get("trainer") or {}).get("max_steps")
    of = f" of {total}" if isinstance(total, int) and total > 0 else ""
    return f"{checkpoint.name} (step {step}{of})"


def unfinished_note(
    run_dir: Path, checkpoint: Path | None, damaged: list[InputError], config: dict[str, Any]
) -> str:
    """What `gear eval` / `gear inspect` say of a run without final/: that it did not finish,
    its newest complete checkpoint and the newer damaged ones."""
    note = (
        f"{run_dir} has no final/: the run stopped before it finished (continue it with "
        f"`gear train --resume {run_dir}`)"
    )
    if checkpoint is not None:
        note += f"; its newest complete checkpoint is {_step_of(checkpoint, config)}"
    if damaged:
        note += "; damaged: " + ", ".join(f"{d.path} ({d.problem})" for d in damaged)
    return note


def evaluation_target(target: str) -> tuple[str, dict[str, Any], str | None]:
    """What `gear eval TARGET` evaluates, checked before any model is loaded: (the model path
    or name, the run's config mapping ({} when TARGET is no run), a note to print or None).

    A run directory: its `final/`; a run without one (stopped before it finished) is evaluated
    at its newest complete checkpoint, and the note says so. A run's `final/` or checkpoint
    directory: that model, with the run's task. A model directory: that model. Anything that is
    not a directory (`smollm2`, a Hub id, a .gguf file): as it is. A directory that is neither a
    run nor a model, a damaged config.yaml or damaged weights: an InputError."""
    path = Path(target)
    if not path.is_dir():
        return target, {}, None
    run_todo = (
        f"fix or restore it, or evaluate a model of the run directly (`gear eval {path}/final`)"
    )
    if is_run_dir(path):
        config = run_config_file(path, run_todo)
        found = checkpoints(path)
        final = path / "final"
        if final.is_dir():
            try:
                if not check_model_files(final):
                    raise InputError(final, "holds no model weights")
            except InputError as e:
                newest, _ = newest_complete(found)
                raise e.with_todo(
                    f"evaluate the run's newest complete checkpoint instead (`gear eval {newest}`),"
                    f" or let `gear train --resume {path}` continue from it and write final/ again"
                    if newest is not None
                    else "the run has no complete checkpoint to evaluate instead"
                ) from None
            return str(final), config, None
        newest, damaged = newest_complete(found)
        if newest is None:
            when = "and its checkpoints are damaged" if damaged else "before its first checkpoint"
            raise InputError(
                final,
                f"missing: the run stopped before it finished, {when}, so it has no model to "
                "evaluate",
                f"`gear train --resume {path}` continues it"
                + (" (and says what to do about the damaged checkpoint)" if damaged else ""),
            )
        note = unfinished_note(path, newest, damaged, config) + f"; evaluating {newest.name}"
        return str(newest), config, note
    if (CHECKPOINT.match(path.name) or path.name == "final") and is_run_dir(path.parent):
        config = run_config_file(path.parent, run_todo)  # a model of a run: the run's task
        if not check_model_files(path):
            raise InputError(path, "holds no model weights")
        return str(path), config, None
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        raise InputError(
            path,
            "neither a gear run directory (no config.yaml) nor a model directory (no config.json "
            "or adapter_config.json)",
            "give `gear eval` a run directory, a model directory, 'smollm2' or a Hub model id",
        )
    check_model_files(path)  # the weight files it has (a Hub layout may have others)
    return str(path), {}, None

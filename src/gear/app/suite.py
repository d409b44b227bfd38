"""The paper's benchmark table in one command: `gear eval RUN_OR_MODEL --suite paper-math`.

A suite is a list of benchmarks, each a gear task on a file under one data directory:
`paper-math` is MATH-500, GSM8K, AIME24 and AIME25; `paper-tools` is BFCL (its three
single-turn categories, the `bfcl` task's test split). Each is scored as papers score it:

- greedy pass@1 on MATH-500, GSM8K and BFCL;
- avg@k (the mean accuracy of k samples per problem at a temperature) and pass@k (the unbiased
  estimator of Chen et al. 2021, `gear.app.evaluate.pass_at_k`) on AIME, whose 30 problems make a
  single greedy pass too noisy;
- a 95% interval on each: the Wilson score interval of the mean of the per-problem scores (see
  `wilson`), and, beside a base model, the paired difference over problems with its t-interval
  (`gear.evidence.paired`).

Every benchmark's result is written atomically, as soon as it is scored, to
`OUT/suite_<suite>/<model|base>/<benchmark>.json` with the settings that determine it (the
model's identity, the problems, the template, k, temperature, max_new_tokens, limit, seed): a
suite stopped part way continues from the benchmarks already scored, and a result whose settings
differ is scored again. Progress goes to the `gear.app.suite` logger, one line per batch, and to
`OUT/suite_<suite>/suite.log`. The table is `OUT/suite_<suite>.md` and `.json`.

`plan` checks everything a suite reads (the suite's name, k, the temperature, each data file and
every row of it) before any model is loaded; `run` scores; `table` and `markdown` assemble.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gear.app.evaluate import evaluate, pass_at_k
from gear.evidence import paired
from gear.io import write_json, write_text
from gear.tasks import get_task
from gear.tasks.base import Task

log = logging.getLogger("gear.app.suite")

DATA_ENV = "GEAR_DATA_DIR"  # the data directory, named once (`--data-dir` overrides it)
SPLIT = "test"


@dataclass(frozen=True)
class Benchmark:
    """One set of a suite: `task` (a gear task) reads `default` under the data directory through
    its option `option`; `sampled` sets report avg@k and pass@k at a temperature, the others
    greedy pass@1."""

    name: str
    title: str
    task: str
    option: str
    default: str
    sampled: bool = False


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("math500", "MATH-500", "math", "path", "math500/test.jsonl"),
        Benchmark("gsm8k", "GSM8K", "gsm8k", "path", "gsm8k/test.jsonl"),
        Benchmark("aime24", "AIME 2024", "math", "path", "aime/aime24.jsonl", sampled=True),
        Benchmark("aime25", "AIME 2025", "math", "path", "aime/aime25.jsonl", sampled=True),
        Benchmark("bfcl", "BFCL v4 (simple, multiple, parallel)", "bfcl", "data_dir", "bfcl"),
    )
}
SUITES = {"paper-math": ("math500", "gsm8k", "aime24", "aime25"), "paper-tools": ("bfcl",)}


class SuiteError(ValueError):
    """Bad input to a suite, found before any model is loaded; its message names the option."""


@dataclass(frozen=True)
class Settings:
    """What a suite is run with. `k` and `temperature` are the sampled sets' (AIME's): the
    others are greedy. `paths` replaces a benchmark's file (`{"aime24": "my/aime24.jsonl"}`);
    `limit` takes the first N problems of each set in `gear eval`'s order (shuffled by `seed`)."""

    suite: str
    data_dir: str | None = None
    paths: dict[str, str] = field(default_factory=dict)
    k: int = 32
    temperature: float = 0.6
    max_new_tokens: int = 1024
    limit: int | None = None
    batch_size: int = 16
    seed: int = 0
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class Planned:
    """A benchmark ready to score: its task, the file it reads and its problems' digest."""

    bench: Benchmark
    task: Task
    path: str
    n_problems: int
    problems: str
    template: str


def _template(task: Task) -> str:
    """The prompt template a task wraps a problem in (its system prompt for BFCL)."""
    from gear.tasks import bfcl, gsm8k

    if hasattr(task, "prompt_template"):
        return task.prompt_template
    return {"gsm8k": gsm8k.PROMPT, "bfcl": bfcl.SYSTEM}.get(task.name, "")


def _check_number(option: str, value: Any, what: str, low: float, integer: bool) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or not math.isfinite(value) or value < low:
        kind = "an integer" if integer else "a number"
        raise SuiteError(f"{option}: {what}, expected {kind} >= {low:g}, got {value!r}")


def plan(settings: Settings) -> list[Planned]:
    """The suite's benchmarks with their tasks and problems, every option and every data file
    checked (each file read and every row of it checked by its task): a `SuiteError` naming the
    option or the benchmark and its file, before any model is loaded."""
    s = settings
    if s.suite not in SUITES:
        raise SuiteError(f"--suite: unknown suite {s.suite!r}; valid: {', '.join(SUITES)}")
    names = SUITES[s.suite]
    if any(BENCHMARKS[n].sampled for n in names):
        _check_number("--samples", s.k, "k, the samples per AIME problem", 1, True)
        t = s.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise SuiteError(
                f"--temperature: avg@k and pass@k sample at a temperature above 0, got {t!r}"
            )
    _check_number("--max-new-tokens", s.max_new_tokens, "the generation budget", 1, True)
    _check_number("--batch-size", s.batch_size, "prompts per batch", 1, True)
    if s.limit is not None:
        _check_number("--limit", s.limit, "problems per set", 1, True)
    unknown = sorted(set(s.paths) - set(names))
    if unknown:
        raise SuiteError(
            f"--suite-path: {unknown} {'is' if len(unknown) == 1 else 'are'} not in suite "
            f"{s.suite}; its benchmarks: {', '.join(names)}"
        )
    needs_dir = [n for n in names if n not in s.paths]
    if needs_dir and not s.data_dir:
        raise SuiteError(
            f"--data-dir: not given and {DATA_ENV} is not set; name the directory that holds "
            + ", ".join(BENCHMARKS[n].default for n in needs_dir)
            + " (or give each set with --suite-path NAME=PATH)"
        )
    if needs_dir and not Path(s.data_dir).expanduser().is_dir():
        raise SuiteError(f"--data-dir: {s.data_dir} is not a directory")
    planned = []
    for name in names:
        bench = BENCHMARKS[name]
        path = s.paths.get(name) or str(Path(s.data_dir).expanduser() / bench.default)
        if not Path(path).expanduser().exists():
            raise SuiteError(
                f"{name} ({bench.title}): {path}: missing; "
                + (
                    f"--suite-path {name}=PATH names another copy"
                    if name in s.paths
                    else f"--data-dir should hold {bench.default}, or --suite-path {name}=PATH "
                    "names another copy"
                )
            )
        try:
            task = get_task(bench.task, **{bench.option: path})
            rows = list(task.dataset(SPLIT, n=s.limit, seed=s.seed))
        except (ValueError, OSError) as e:  # InputError is a ValueError: file and row named
            raise SuiteError(f"{name} ({bench.title}): {e}") from e
        problems = json.dumps([[r["prompt"], r["answer"]] for r in rows], sort_keys=True)
        digest = hashlib.sha256(problems.encode()).hexdigest()[:16]
        planned.append(Planned(bench, task, path, len(rows), digest, _template(task)))
    return planned


# ---------------------------------------------------------------- scores and intervals


def wilson(mean: float, n: int, level: float = 0.95) -> list[float]:
    """The Wilson score interval [lo, hi] of a mean of n scores in [0, 1].

    For 0/1 scores (greedy pass@1) it is the usual interval of a proportion, and unlike a
    t-interval it keeps a width at 0 of n correct, where a small model sits (0 of 20: [0, 0.16]).
    For scores in between (avg@k, a problem's fraction of k samples) it is conservative: a
    score in [0, 1] with mean p has variance at most p(1 - p), the binary case's."""
    from statistics import NormalDist

    if n < 1:
        return [math.nan, math.nan]
    z = NormalDist().inv_cdf(0.5 + level / 2)
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
    return [max(0.0, centre - half), min(1.0, centre + half)]


def metric_names(bench: Benchmark, k: int) -> list[str]:
    return [f"avg@{k}", f"pass@{k}"] if bench.sampled else ["pass@1"]


def scores(bench: Benchmark, rows: list[dict[str, Any]], k: int) -> dict[str, dict[str, float]]:
    """Per metric, each problem's score by its id: pass@1 the greedy completion's 0/1; avg@k a
    problem's fraction correct of its k samples; pass@k its unbiased pass@k (with k samples, 1
    where one is correct)."""
    out: dict[str, dict[str, float]] = {m: {} for m in metric_names(bench, k)}
    for i, row in enumerate(rows):
        pid, c, n = str(row.get("problem", i)), sum(row["correct"]), len(row["correct"])
        if bench.sampled:
            out[f"avg@{k}"][pid] = c / n
            out[f"pass@{k}"][pid] = pass_at_k(n, c, k)
        else:
            out["pass@1"][pid] = float(c > 0)
    return out


def summarise(per_problem: dict[str, float]) -> dict[str, Any]:
    """{"value", "ci", "n"}: the mean of a metric's per-problem scores and its Wilson interval."""
    n = len(per_problem)
    mean = sum(per_problem.values()) / n if n else math.nan
    return {"value": mean, "ci": wilson(mean, n), "n": n}


def difference(model: dict[str, float], base: dict[str, float]) -> dict[str, Any]:
    """{"mean", "ci", "n", "sd"}: model - base paired over the problems both scored (95% t)."""
    common = [p for p in model if p in base]
    return paired([model[p] for p in common], [base[p] for p in common])


# ---------------------------------------------------------------- running


@contextlib.contextmanager
def _logging_to(path: Path, stream: TextIO | None) -> Iterator[None]:
    """The `gear.app.suite` logger also writes to `path` (appended: a resumed suite's lines follow
    the stopped one's) and to `stream`, while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    if stream is not None:
        handlers.append(logging.StreamHandler(stream))
    form = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
    level = log.level
    log.setLevel(logging.INFO)
    for h in handlers:
        h.setFormatter(form)
        log.addHandler(h)
    try:
        yield
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()
        log.setLevel(level)


def record_settings(p: Planned, s: Settings, model_id: str) -> dict[str, Any]:
    """What determines a benchmark's result: a kept result is reused only where these match."""
    return {
        "model": model_id,
        "benchmark": p.bench.name,
        "task": p.bench.task,
        "split": SPLIT,
        "data": p.path,
        "problems": p.problems,
        "n_problems": p.n_problems,
        "limit": s.limit,
        "seed": s.seed,
        "template": p.template,
        "chat_template_kwargs": s.chat_template_kwargs,
        "samples": s.k if p.bench.sampled else 1,
        "temperature": s.temperature if p.bench.sampled else 0.0,
        "max_new_tokens": s.max_new_tokens,
    }


def _kept(path: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The result kept at `path` when its settings are `wanted`; None otherwise (with a note
    where a result is there but cannot be reused)."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        kept = record["settings"]
        if not all(isinstance(record.get(k), dict) for k in ("settings", "metrics", "per_problem")):
            raise ValueError("not a suite result")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.info("%s: unreadable (%s); scored again", path, e)
        return None
    changed = sorted(k for k in wanted.keys() | kept.keys() if kept.get(k) != wanted.get(k))
    if changed:
        log.info("%s: kept with other settings (%s); scored again", path, ", ".join(changed))
        return None
    return record


def _load(model_path: str) -> tuple[Any, Any]:
    """The model (float32, on the GPU where there is one) and its tokenizer."""
    import torch

    from gear.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path)
    if torch.cuda.is_available():
        model.to("cuda")
    return model, tokenizer


def _progress(what: str, start: float) -> Callable[[int, int], None]:
    """evaluate's progress callback: one log line per batch, with the time taken and left."""

    def progress(done: int, total: int) -> None:
        took = time.monotonic() - start
        left = took / done * (total - done) if done else math.nan
        log.info("%s: %d/%d problems, %.0f s, ~%.0f s left", what, done, total, took, left)

    return progress


def score_model(
    label: str, model_path: str, planned: list[Planned], s: Settings, root: Path
) -> dict[str, dict[str, Any]]:
    """Each benchmark's result for one model, read back where it was kept with the same
    settings, else scored (the model loaded once, when first needed) and written at once."""
    import torch

    from gear.models import model_identity

    model_id = model_identity(model_path) or model_path
    model = tokenizer = None
    results = {}
    for p in planned:
        path = root / label / f"{p.bench.name}.json"
        wanted = record_settings(p, s, model_id)
        kept = _kept(path, wanted)
        if kept is not None:
            log.info(
                "%s %s: kept from an earlier run (%s), not scored again", label, p.bench.name, path
            )
            results[p.bench.name] = kept
            continue
        if model is None:
            log.info("%s: loading %s", label, model_path)
            model, tokenizer = _load(model_path)
        samples, temperature = wanted["samples"], wanted["temperature"]
        what = "greedy" if temperature == 0 else f"{samples} samples at T={temperature:g}"
        log.info("%s %s: %d problems, %s, max_new_tokens %d", label, p.bench.name,
                 p.n_problems, what, s.max_new_tokens)  # fmt: skip
        start = time.monotonic()
        result = evaluate(
            model,
            tokenizer,
            p.task,
            split=SPLIT,
            n=s.limit,
            samples=samples,
            temperature=temperature,
            max_new_tokens=s.max_new_tokens,
            batch_size=s.batch_size,
            seed=s.seed,
            progress=_progress(f"{label} {p.bench.name} ({what})", start),
            chat_template_kwargs=s.chat_template_kwargs,
        )
        per_problem = scores(p.bench, result.rows, s.k)
        record = {
            "benchmark": p.bench.name,
            "title": p.bench.title,
            "model_path": model_path,
            "settings": wanted,
            "metrics": {m: summarise(v) for m, v in per_problem.items()},
            "pass_at": {str(k): v for k, v in result.pass_at.items()},
            "per_problem": per_problem,
            "wall_s": round(time.monotonic() - start, 1),
            "device": str(next(model.parameters()).device),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rows": result.rows,
        }
        write_json(path, record, indent=1)  # atomic: a stop never leaves half a result
        line = ", ".join(f"{m} {v['value']:.3f}" for m, v in record["metrics"].items())
        log.info("%s %s: %s (%.0f s); wrote %s", label, p.bench.name, line, record["wall_s"], path)
        results[p.bench.name] = record
    del model, tokenizer
    gc.collect()
    return results


def run(
    model_path: str,
    settings: Settings,
    out_dir: str | os.PathLike,
    base: str | None = None,
    planned: list[Planned] | None = None,
    log_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Score `model_path` (and `base`, the model it was trained from, where given) on the suite
    and write the table (`OUT/suite_<suite>.json` and `.md`); returns the table. `planned`: the
    suite's `plan`, when the caller checked it already."""
    out_dir = Path(out_dir)
    root = out_dir / f"suite_{settings.suite}"
    planned = plan(settings) if planned is None else planned
    with _logging_to(root / "suite.log", log_stream):
        log.info("suite %s: %s%s -> %s", settings.suite, model_path,
                 f" beside its base {base}" if base else "", out_dir)  # fmt: skip
        models = {"model": model_path} | ({"base": base} if base else {})
        results = {label: score_model(label, path, planned, settings, root)
                   for label, path in reversed(models.items())}  # fmt: skip
        result = table(planned, settings, results, models)
        write_json(out_dir / f"suite_{settings.suite}.json", result, indent=1)
        write_text(out_dir / f"suite_{settings.suite}.md", markdown(result))
        log.info(
            "suite %s: wrote %s and .md", settings.suite, out_dir / f"suite_{settings.suite}.json"
        )
    return result


# ---------------------------------------------------------------- the table


def table(
    planned: list[Planned],
    s: Settings,
    results: dict[str, dict[str, dict[str, Any]]],
    models: dict[str, str],
) -> dict[str, Any]:
    """The suite's table: a row per benchmark and metric, the model's score and the base's
    beside it with the paired difference, each with its settings."""
    rows = []
    for p in planned:
        mine = results["model"][p.bench.name]
        theirs = results.get("base", {}).get(p.bench.name)
        for metric, value in mine["metrics"].items():
            row = {
                "benchmark": p.bench.name,
                "title": p.bench.title,
                "metric": metric,
                "n": value["n"],
                "model": value,
            }
            if theirs is not None:
                row["base"] = theirs["metrics"][metric]
                row["difference"] = difference(
                    mine["per_problem"][metric], theirs["per_problem"][metric]
                )
            for key in ("template", "chat_template_kwargs", "samples", "temperature",
                        "max_new_tokens", "data", "limit", "seed"):  # fmt: skip
                row[key] = mine["settings"][key]
            rows.append(row)
    return {
        "suite": s.suite,
        "model": models["model"],
        "base": models.get("base"),
        "settings": {k: v for k, v in asdict(s).items() if k not in ("paths",)},
        "intervals": "95%: Wilson score interval over the problems for each score; paired "
        "t-interval over the problems for model - base",
        "rows": rows,
    }


def _ci(ci: list[float], signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    if any(not math.isfinite(x) for x in ci):
        return "[n/a]"
    return "[" + ", ".join(f.format(x) for x in ci) + "]"


def markdown(result: dict[str, Any]) -> str:
    """The table as Markdown: a row per benchmark and metric, then the templates it names."""
    base = result.get("base")
    head = f"# `gear eval --suite {result['suite']}`: `{result['model']}`"
    lines = [head + (f" beside its base `{base}`" if base else ""), ""]
    cols = ["benchmark", "metric", "n"] + (["base [95%]"] if base else []) + ["model [95%]"]
    cols += (["model − base, paired [95%]"] if base else []) + ["T", "max_new_tokens", "template"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    templates: dict[str, str] = {}
    for row in result["rows"]:
        tid = templates.setdefault(row["template"], f"t{len(templates) + 1}")
        cells = [row["title"], row["metric"], str(row["n"])]
        if base:
            cells.append(f"{row['base']['value']:.3f} {_ci(row['base']['ci'])}")
        cells.append(f"{row['model']['value']:.3f} {_ci(row['model']['ci'])}")
        if base:
            d = row["difference"]
            same = d["n"] >= 2 and d["sd"] == 0  # a t-interval of width 0 says nothing more
            spread = "(no problem differs)" if same else _ci(d["ci"], signed=True)
            cells.append(f"{d['mean']:+.3f} {spread}")
        cells += [f"{row['temperature']:g}", str(row["max_new_tokens"]), tid]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", result["intervals"] + "."]
    kwargs = result["settings"].get("chat_template_kwargs")
    if kwargs:
        lines.append(f"Chat template kwargs: `{json.dumps(kwargs)}`.")
    lines += ["", "Prompt templates (the problem goes where the braces say):", ""]
    for text, tid in templates.items():
        lines += [f"- {tid}:", "", "  ```", *("  " + t for t in text.splitlines()), "  ```"]
    return "\n".join(lines) + "\n"

"""BFCL v4 single-turn function calling (simple_python, multiple, parallel), AST-style reward.

Data: ``data_dir`` holds ``BFCL_v4_<category>.json`` and ``possible_answer/BFCL_v4_<category>.json``
(JSON lines, as shipped in the PyPI package ``bfcl-eval``). Without ``data_dir`` the ``data/``
folder of an installed ``bfcl_eval`` package is used. Rows are split train/test by a hash of their
id (20% test), so the split never changes.

Prompt: a system message listing the functions (OpenAI-style JSON schemas; BFCL's "dict" becomes
"object", "float" "number", "tuple" "array") and the output format, then the user question. The
prompt is self-contained: chat templates without tool support (SmolLM2's) work, so do not also pass
the ``tools`` column to a template that renders tools, or they appear twice. Output format::

    <tool_call>[{"name": "func", "arguments": {"a": 1}}, ...]</tool_call>

Parsing is lenient: one or several ``<tool_call>`` blocks holding a JSON object or list, a bare JSON
object/list, Python-literal dicts, OpenAI ``{"function": {...}}`` objects, BFCL ``{"func": {...}}``
objects, Python call syntax ``[func(a=1), g(b="x")]``, or messages with ``tool_calls``.

Reward (1.0 / 0.0), BFCL's AST checker semantics: same number of calls as the reference; parallel
calls matched in any order; function names equal (``.`` and ``_`` interchangeable, as BFCL's
underscore/dot conversion); no argument outside the reference; a reference argument may be missing
only if ``""`` is among its accepted values; each value must equal one accepted value: numbers
int/float tolerant (bool is not a number), strings compared after BFCL's ``standardize_string``
(lowercase, spaces and ``,./-_*^`` removed, ``'`` -> ``"``), lists element-wise in order, dicts key by
key (their values are again lists of accepted values).

Columns: ``prompt``, ``ground_truth`` (the reference calls in the output format, first accepted value
of each argument), ``answer`` (JSON of BFCL's ``ground_truth`` list), ``tools`` (list of
``{"type": "function", "function": {...}}``), ``id``, ``category``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import re
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, Json, List, Value

from gear.tasks.base import (
    PROMPT_FEATURE,
    Task,
    check_n,
    check_split,
    make_dataset,
    stable_fraction,
)

CATEGORIES = ("simple_python", "multiple", "parallel")
TEST_FRACTION = 0.2
TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array"}
SYSTEM = (
    "You are an expert in composing function calls. You are given a question and a set of "
    "possible functions. Based on the question, make the function call(s) that answer it.\n\n"
    "You have access to these functions:\n<tools>\n{tools}\n</tools>\n\n"
    "Reply with the call(s) only: a JSON list inside <tool_call></tool_call> tags, like this:\n"
    '<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>'
)
FEATURES = Features(
    {
        "prompt": PROMPT_FEATURE,
        "ground_truth": Value("string"),
        "answer": Value("string"),
        "tools": List(Json()),
        "id": Value("string"),
        "category": Value("string"),
    }
)

Call = tuple[str, dict]


# ---------------------------------------------------------------- schemas and rendering


def to_json_schema(schema: dict) -> dict:
    """A BFCL parameter schema as standard JSON Schema (types mapped, "optional" dropped)."""
    out = {}
    for key, value in schema.items():
        if key == "type":
            if value != "any":  # no "type" = any value
                out["type"] = TYPE_MAP.get(value, value)
        elif key == "properties":
            out[key] = {name: to_json_schema(s) for name, s in value.items()}
        elif key == "items":
            out[key] = to_json_schema(value)
        elif key != "optional":
            out[key] = value
    return out


def to_tool(function: dict) -> dict:
    """A BFCL function doc as an OpenAI-style tool ``{"type": "function", "function": {...}}``."""
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": to_json_schema(function.get("parameters", {"type": "dict"})),
        },
    }


def _options(accepted: Any) -> list:
    return accepted if isinstance(accepted, list) else [accepted]


def _first(accepted: Any) -> tuple[bool, Any]:
    """(present, value): the first accepted value that is not the "optional" marker ``""``."""
    for option in _options(accepted):
        if option != "":
            return True, concrete(option)
    return False, None


def concrete(value: Any) -> Any:
    """One concrete value from a possible-answer value (dict values are lists of options)."""
    if isinstance(value, dict):
        out = {}
        for key, accepted in value.items():
            present, chosen = _first(accepted)
            if present:
                out[key] = chosen
        return out
    if isinstance(value, list):
        return [concrete(v) for v in value]
    return value


def reference_calls(ground_truth: list[dict]) -> list[dict]:
    """BFCL ground truth -> ``[{"name", "arguments"}]`` using each argument's first option."""
    calls = []
    for call in ground_truth:
        ((name, params),) = call.items()
        calls.append({"name": name, "arguments": concrete(params)})
    return calls


def render_calls(calls: list[dict]) -> str:
    """Calls ``[{"name", "arguments"}]`` in the output format the prompt asks for."""
    return "<tool_call>" + json.dumps(calls, ensure_ascii=False) + "</tool_call>"


# ---------------------------------------------------------------- parsing


def _calls_from_json(obj: Any) -> list[Call] | None:
    if isinstance(obj, list):
        calls = []
        for item in obj:
            sub = _calls_from_json(item)
            if sub is None:
                return None
            calls += sub
        return calls
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        return _calls_from_json(obj["function"])
    if isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return [(obj["name"], args)] if isinstance(args, dict) else None
    if len(obj) == 1:
        ((name, args),) = obj.items()
        if isinstance(args, dict):
            return [(name, args)]
    return None


def _dotted_name(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _calls_from_python(text: str) -> list[Call] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, SyntaxError, TypeError):
            return None
        if name is None or None in args:
            return None
        calls.append((name, args))
    return calls


def _parse_block(text: str) -> list[Call] | None:
    text = re.sub(r"^```\w*\s*|\s*```$", "", text.strip())
    try:
        return _calls_from_json(json.loads(text))
    except json.JSONDecodeError:
        pass
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    if start >= 0:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            calls = _calls_from_json(obj)
            if calls is not None:
                return calls
        except json.JSONDecodeError:
            pass
    try:
        calls = _calls_from_json(ast.literal_eval(text))
        if calls is not None:
            return calls
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return _calls_from_python(text)


TOOL_CALL = r"<tool_call>(.*?)(?:</tool_call>|$)"


def parse_calls(text: str) -> list[Call] | None:
    """Function calls ``[(name, arguments)]`` in a completion text, or None if unparseable."""
    blocks = re.findall(TOOL_CALL, text, flags=re.S)
    calls = []
    for block in blocks or [text]:
        parsed = _parse_block(block)
        if parsed is None:
            return None
        calls += parsed
    return calls


# ---------------------------------------------------------------- checking


def standardize_string(text: str) -> str:
    """BFCL's string normalisation: drop spaces and ``,./-_*^``, lowercase, ``'`` -> ``"``."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def value_equal(value: Any, option: Any) -> bool:
    """Whether a model value equals one accepted option (recursively, BFCL semantics)."""
    if isinstance(option, dict):
        return args_match(value, option)
    if isinstance(option, list):
        return (
            isinstance(value, list | tuple)
            and len(value) == len(option)
            and all(value_equal(v, o) for v, o in zip(value, option, strict=True))
        )
    if isinstance(option, bool) or isinstance(value, bool):
        return value is option
    if isinstance(option, int | float):
        return isinstance(value, int | float) and abs(value - option) <= 1e-9 * max(
            1.0, abs(value), abs(option)
        )
    if isinstance(option, str):
        return isinstance(value, str) and standardize_string(value) == standardize_string(option)
    return value == option  # None


def args_match(args: Any, expected: dict) -> bool:
    """Arguments vs ``{param: [accepted values]}``: no extra params, missing ones optional."""
    if not isinstance(args, dict):
        return False
    for key, value in args.items():
        options = _options(expected.get(key, []))
        if key not in expected or not (
            (value == "" and "" in options)
            or any(value_equal(value, o) for o in options if not (isinstance(o, str) and o == ""))
        ):
            return False
    return all("" in _options(options) for key, options in expected.items() if key not in args)


def _norm_name(name: str) -> str:
    return name.replace(".", "_")


def call_matches(call: Call, expected: dict) -> bool:
    """One call ``(name, args)`` vs one BFCL ground-truth entry ``{name: {param: options}}``."""
    ((name, params),) = expected.items()
    return _norm_name(call[0]) == _norm_name(name) and args_match(call[1], params)


def calls_match(calls: list[Call] | None, ground_truth: list[dict]) -> bool:
    """All reference calls matched one-to-one by the model's calls, in any order."""
    if calls is None or len(calls) != len(ground_truth):
        return False

    def assign(i: int, used: frozenset[int]) -> bool:
        if i == len(ground_truth):
            return True
        return any(
            j not in used and call_matches(call, ground_truth[i]) and assign(i + 1, used | {j})
            for j, call in enumerate(calls)
        )

    return assign(0, frozenset())


# ---------------------------------------------------------------- task


def default_data_dir() -> Path | None:
    """The ``data/`` folder of an installed ``bfcl_eval`` package (never imported), if any."""
    spec = importlib.util.find_spec("bfcl_eval")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "data" / "possible_answer").is_dir():
            return Path(location) / "data"
    return None


def _read_json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"bfcl data file not found: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read bfcl data file {path}: {e}") from e


class BFCLTask(Task):
    """BFCL v4 single-turn function calling with a BFCL-style AST checker as reward."""

    name = "bfcl"
    hint_kind = "tool"

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        categories: str | list[str] | tuple[str, ...] = CATEGORIES,
    ):
        if isinstance(categories, str):
            categories = [c.strip() for c in categories.split(",")]
        bad = [c for c in categories if c not in CATEGORIES]
        if bad or not categories:
            raise ValueError(f"unknown bfcl categories {bad}; valid: {list(CATEGORIES)}")
        self.categories = tuple(categories)
        if data_dir is None:
            data_dir = default_data_dir()
            if data_dir is None:
                raise ValueError(
                    "bfcl needs data_dir=...: a directory with BFCL_v4_<category>.json and "
                    "possible_answer/ (e.g. the data/ folder of the PyPI package bfcl-eval)"
                )
        self.data_dir = Path(data_dir).expanduser()
        self._rows: list[dict] | None = None

    def rows(self) -> list[dict]:
        """All raw rows of the chosen categories, with their ``ground_truth`` attached."""
        if self._rows is None:
            rows = []
            for category in self.categories:
                name = f"BFCL_v4_{category}.json"
                questions = _read_json_lines(self.data_dir / name)
                answers = {
                    a["id"]: a for a in _read_json_lines(self.data_dir / "possible_answer" / name)
                }
                for q in questions:
                    if q["id"] not in answers:
                        raise ValueError(
                            f"{self.data_dir / 'possible_answer' / name}: no answer for {q['id']}"
                        )
                    rows.append(
                        {
                            **q,
                            "category": category,
                            "ground_truth": answers[q["id"]]["ground_truth"],
                        }
                    )
            self._rows = rows
        return self._rows

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows of ``split`` (hash of the id), shuffled by ``seed``, the first ``n``."""
        check_split(split)
        check_n(n)
        rows = [
            r
            for r in self.rows()
            if (stable_fraction("bfcl:" + r["id"]) < TEST_FRACTION) == (split == "test")
        ]
        random.Random(seed).shuffle(rows)
        out = []
        for r in rows[:n]:
            tools = [to_tool(f) for f in r["function"]]
            listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
            messages = [{"role": "system", "content": SYSTEM.format(tools=listing)}]
            messages += [{"role": m["role"], "content": m["content"]} for m in r["question"][0]]
            out.append(
                {
                    "prompt": messages,
                    "ground_truth": render_calls(reference_calls(r["ground_truth"])),
                    "answer": json.dumps(r["ground_truth"], ensure_ascii=False),
                    "tools": tools,
                    "id": r["id"],
                    "category": r["category"],
                }
            )
        return make_dataset(out, FEATURES)

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """The completion's calls match the BFCL reference ``answer`` (JSON)."""
        return calls_match(parse_calls(completion_text), json.loads(answer))

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """The calls `parse_calls` reads: from the first ``<tool_call>`` block's content to the
        last one's (without the tags), or the whole stripped text where there is no block;
        None where the calls do not parse."""
        if parse_calls(completion_text) is None:
            return None
        blocks = list(re.finditer(TOOL_CALL, completion_text, flags=re.S))
        start, end = (
            (blocks[0].start(1), blocks[-1].end(1)) if blocks else (0, len(completion_text))
        )
        inner = completion_text[start:end]
        start += len(inner) - len(inner.lstrip())
        return start, start + len(inner.strip())

    def reference_text(self, answer: Any) -> str | None:
        """The reference calls (the first option of each argument) as the prompt asks for them."""
        return render_calls(reference_calls(json.loads(answer)))

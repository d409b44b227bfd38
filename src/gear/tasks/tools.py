"""Multi-turn tool use: a store's stock lookup plus a calculator, with known solution calls.

Problems (procedural, seeded; train/test disjoint by a hash of the problem):

- ``calc``: "What is 347 * 29 - 118?" -> ``calculator(expression="347 * 29 - 118")``.
- ``lookup``: "How many apples and pears does the store have in stock altogether?" or "Each apple
  costs 3 dollars. What is the stock of apples worth?" -> ``lookup(item=...)`` for each item, then
  ``calculator``. Stock counts are drawn per row (column ``state``, JSON), so they must be looked up.

The reward (1.0 / 0.0) reads the final answer ("Answer: N", lenient) of the last assistant message;
tool calls and tool results are ignored, and a rollout that ends on a tool call scores 0.
``ground_truth`` shows the reference calls, each with its result, in the Hermes/Qwen format the
model is asked to use, then "Answer: N".

Training with TRL 1.16 (``GRPOTrainer`` runs the tool loop itself)::

    task = get_task("tools")
    tokenizer = task.prepare_tokenizer(tokenizer)  # tool-capable chat template if needed
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[task.reward],
                          train_dataset=task.dataset("train"),
                          args=GRPOConfig(..., max_tool_calling_iterations=4),
                          **task.trainer_kwargs())  # {"environment_factory": ToolEnv}

TRL creates one ``ToolEnv`` per rollout, calls ``reset(**row)`` (which loads the row's stock) and
exposes its public methods ``calculator`` and ``lookup`` as tools: it renders their JSON schemas
into the prompt through the chat template (``tools=``), parses ``<tool_call>`` JSON from the
generated text with the tokenizer's response template, runs the call, appends the result as a
``tool`` message and generates again; tool-result tokens get ``tool_mask`` = 0 (no loss).

TRL requires a chat template that renders tool calls and tool messages, and a response parser for
it. SmolLM2's template has neither (it only prints ``message['content']``), so TRL would refuse it;
``prepare_tokenizer`` then installs TRL's copy of the Qwen2.5 ChatML template, which uses the same
``<|im_start|>``/``<|im_end|>`` tokens SmolLM2 was trained with, renders the tools in the system
message, and for which TRL knows the parser (``<tool_call>{json}</tool_call>``). The rows always
carry a system message, so Qwen's default system text never appears. The ``tools`` column holds the
same schemas TRL renders (``transformers.utils.get_json_schema`` of the methods), for the teacher
prompt.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

from datasets import Dataset, Features, Json, List, Value

from gear.tasks.base import (
    PROMPT_FEATURE,
    Completion,
    Task,
    check_n,
    check_split,
    final_answer,
    final_answer_span,
    last_assistant_text,
    make_dataset,
    numbers_equal,
    parse_mix,
    stable_fraction,
    to_number,
)

KINDS = ("calc", "lookup")
TOOL_BLOCK = r"<tool_(call|response)>.*?(</tool_\1>|$)"  # what the reward ignores
DEFAULT_MIX = {"calc": 0.5, "lookup": 0.5}
TEST_FRACTION = 0.2
DEFAULT_SIZE = {"train": 2000, "test": 200}
ITEMS = (
    "apples", "pears", "plums", "lemons", "melons", "onions", "carrots", "potatoes", "eggs",
    "candles", "pencils", "notebooks", "batteries", "lamps", "towels", "cups", "plates", "spoons",
    "socks", "gloves",
)  # fmt: skip
SYSTEM = (
    "You are a helpful assistant for a store. Use the tools to look up stock and to do "
    'arithmetic. When you know the result, reply with "Answer: <number>".'
)
FEATURES = Features(
    {
        "prompt": PROMPT_FEATURE,
        "ground_truth": Value("string"),
        "answer": Value("string"),
        "tools": List(Json()),
        "state": Value("string"),
        "kind": Value("string"),
    }
)

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def safe_eval(expression: str) -> float | int:
    """Value of an arithmetic expression (numbers, + - * / // %, parentheses); ValueError else."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expression.replace("×", "*"), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from e


def format_number(value: float | int) -> str:
    """An int as is, a float rounded to 6 decimals without trailing zeros."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


class ToolEnv:
    """TRL tool environment: a store's stock (set per row by ``reset``) and a calculator.

    TRL makes one instance per rollout; its public methods are the tools the model may call.
    ``calls`` records the calls made since the last reset as ``(tool, arguments, result)``.
    """

    def __init__(self) -> None:
        self.stock: dict[str, int] = {}
        self.calls: list[tuple[str, dict, str]] = []

    def reset(self, state: str = "{}", **row: Any) -> None:
        """Start a rollout: load the row's stock (JSON ``state``) and forget past calls."""
        self.stock = json.loads(state) if state else {}
        self.calls = []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers combined with + - * / and parentheses, e.g. "12 * (3 + 4)".

        Returns:
            The value of the expression.
        """
        result = format_number(safe_eval(expression))
        self.calls.append(("calculator", {"expression": expression}, result))
        return result

    def lookup(self, item: str) -> str:
        """Look up how many units of an item the store has in stock.

        Args:
            item: The item name, e.g. "apples".

        Returns:
            The number of units in stock.
        """
        key = item.strip().lower()
        if key not in self.stock:
            raise ValueError(f"unknown item {item!r}; the store has {sorted(self.stock)}")
        result = str(self.stock[key])
        self.calls.append(("lookup", {"item": item}, result))
        return result


def tool_schemas() -> list[dict]:
    """JSON schemas of ``ToolEnv``'s tools, exactly as TRL renders them into the prompt."""
    from transformers.utils import get_json_schema

    env = ToolEnv()
    return [get_json_schema(env.calculator), get_json_schema(env.lookup)]


def make_problem(kind: str, rng: random.Random) -> dict:
    """One problem: ``key`` (fixes its split), ``question``, ``stock`` and the reference ``calls``."""
    if kind == "calc":
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(1, 999)
        expr = f"{a} * {b} - {c}" if rng.random() < 0.5 else f"{a} * {b} + {c}"
        return {
            "key": expr,
            "question": f"What is {expr}?",
            "stock": {},
            "calls": [("calculator", {"expression": expr})],
        }
    items = rng.sample(ITEMS, 3)  # the third one is a distractor
    stock = {item: rng.randint(10, 500) for item in items}
    x, y = items[0], items[1]
    if rng.random() < 0.5:
        question = f"How many {x} and {y} does the store have in stock altogether?"
        calls = [("lookup", {"item": x}), ("lookup", {"item": y})]
        calls.append(("calculator", {"expression": f"{stock[x]} + {stock[y]}"}))
    else:
        price = rng.randint(2, 20)
        question = (
            f"Each of the store's {x} sells for {price} dollars. "
            f"How much is the store's whole stock of {x} worth, in dollars?"
        )
        calls = [("lookup", {"item": x}), ("calculator", {"expression": f"{stock[x]} * {price}"})]
    key = question + json.dumps(stock, sort_keys=True)
    return {"key": key, "question": question, "stock": stock, "calls": calls}


def solve(problem: dict) -> tuple[str, str]:
    """(ground truth text, answer) by running the reference calls in a fresh ``ToolEnv``."""
    env = ToolEnv()
    env.reset(json.dumps(problem["stock"]))
    parts = []
    for name, args in problem["calls"]:
        result = getattr(env, name)(**args)
        call = json.dumps({"name": name, "arguments": args})
        parts.append(
            f"<tool_call>\n{call}\n</tool_call>\n<tool_response>\n{result}\n</tool_response>"
        )
    answer = env.calls[-1][2]
    return "\n".join(parts) + f"\nAnswer: {answer}", answer


def split_of(key: str) -> str:
    """The split a problem belongs to (fixed by a hash of its key)."""
    return "test" if stable_fraction("tools:" + key) < TEST_FRACTION else "train"


class ToolsTask(Task):
    """Multi-turn tool use with ``ToolEnv``; reward on the final answer."""

    name = "tools"
    hint_kind = "tool"

    def __init__(self, mix: str | dict[str, float] | None = None):
        self.mix = parse_mix(mix if mix is not None else DEFAULT_MIX, KINDS, "tools problem kind")

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """``n`` problems (default 2000 train / 200 test) of ``split``; same seed, same rows."""
        check_split(split)
        n = DEFAULT_SIZE[split] if check_n(n) is None else n
        rng = random.Random(f"tools/{split}/{seed}")
        kinds, weights = list(self.mix), list(self.mix.values())
        schemas = tool_schemas()
        rows = []
        for _ in range(n):
            kind = rng.choices(kinds, weights)[0]
            problem = make_problem(kind, rng)
            while split_of(problem["key"]) != split:
                problem = make_problem(kind, rng)
            ground_truth, answer = solve(problem)
            rows.append(
                {
                    "prompt": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": problem["question"]},
                    ],
                    "ground_truth": ground_truth,
                    "answer": answer,
                    "tools": schemas,
                    "state": json.dumps(problem["stock"]),
                    "kind": kind,
                }
            )
        return make_dataset(rows, FEATURES)

    def completion_text(self, completion: Completion) -> str:
        """The last assistant message (a final message that calls a tool gives "")."""
        if isinstance(completion, list | dict):
            messages = [completion] if isinstance(completion, dict) else completion
            last = [m for m in messages if m.get("role", "assistant") == "assistant"][-1:]
            if not last or last[0].get("tool_calls"):
                return ""
        return last_assistant_text(completion)

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """The final answer, outside tool calls and tool responses, equals ``answer``."""
        text = re.sub(TOOL_BLOCK, " ", completion_text, flags=re.S)
        return numbers_equal(to_number(final_answer(text)), to_number(answer))

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """Where `is_correct` reads the final answer: `final_answer_span` with the tool calls and
        tool responses blanked (spaces of the same length, so the offsets stay the text's)."""
        blank = re.sub(TOOL_BLOCK, lambda m: " " * len(m.group()), completion_text, flags=re.S)
        return final_answer_span(blank)

    def prepare_tokenizer(self, tokenizer: Any) -> Any:
        """Give a ChatML tokenizer without tool support (SmolLM2) TRL's Qwen2.5 template."""
        from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

        if supports_tool_calling(tokenizer):
            return tokenizer
        vocab = tokenizer.get_vocab()
        if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
            raise ValueError(
                "the tools task needs a chat template with tool-call support; this tokenizer's "
                "template has none and is not ChatML (<|im_start|>/<|im_end|>), so it cannot be patched"
            )
        tokenizer.chat_template = qwen2_5_chat_template
        return tokenizer

    def trainer_kwargs(self) -> dict[str, Any]:
        """``{"environment_factory": ToolEnv}`` for ``trl.GRPOTrainer``."""
        return {"environment_factory": ToolEnv}

"""Environments that own the data (TRL 1.16's agent API): `environment_factory=` with no
`train_dataset`, or a dataset of `reset()` kwargs only. Each episode's ground truth comes from
its environment (an attribute named `ground_truth_column`, set by `reset()`) and reaches the
teacher hint exactly as a dataset column does.

TRL's own scenarios (`test_train_with_environment_owned_data`, `..._owned_reward`,
`test_environment_owned_reward_coexists_with_reward_funcs`, `test_train_with_environment_factory`)
are re-created here with GEAR's own credit method, plus a multi-turn tool environment that owns
its data, a `dict` factory, and the rows-without-ground-truth fallback. Model turns that call a
tool are scripted (a random tiny model never writes a valid call); the others are generated.
"""

from __future__ import annotations

import importlib.resources
import itertools
import json
import random
import re
import types

import pytest
import torch
from datasets import Dataset

import gear.integrations.trl.credit as trl_credit
from _trl_helpers import byte_tokenizer, fast_config, hash_reward, parameters, tiny_model
from gear.integrations.trl import GEARTrainer

DRAW = itertools.count()  # problems differ across rollouts and tests


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def qwen_tokenizer():
    """The byte tokenizer with TRL's Qwen2.5 template (TRL renders and parses tool calls with
    it; `environment_factory` needs a template that supports tools)."""
    tok = byte_tokenizer()
    tok.chat_template = (
        importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja"
    ).read_text()
    return tok


def env_trainer(tmp_path, environment_factory, data=None, reward_funcs=hash_reward, **overrides):
    """A GEARTrainer (credit_method 'gear', one step) on an environment; no dataset by default."""
    tok = qwen_tokenizer()
    overrides.setdefault("max_completion_length", 200)
    trainer = GEARTrainer(
        model=tiny_model(tok),
        reward_funcs=reward_funcs,
        args=fast_config(tmp_path, **overrides),
        train_dataset=data,
        processing_class=tok,
        environment_factory=environment_factory,
    )
    trainer.accelerator.free_memory = lambda *objects: list(objects)
    return trainer


def script_turns(monkeypatch, trainer, turn):
    """Model turns from `turn(row, prompt text) -> text` instead of generation."""
    tok = trainer.processing_class

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        texts = [turn(i, tok.decode(p)) for i, p in enumerate(prompt_ids)]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts], None

    monkeypatch.setattr(trainer, "_generate_single_turn", types.MethodType(scripted, trainer))


def spy(monkeypatch, trainer):
    """Record each batch's built teacher prompts (decoded, with their ground truths and hint
    flags) and the credit (kwargs, details) of each batch."""
    tok = trainer.processing_class
    seen = {"teacher": [], "credit": []}
    real_prompts, real_details = trainer._teacher_prompts, trl_credit.credit_details

    def teacher_prompts(prompts, ground_truths):
        built = real_prompts(prompts, ground_truths)
        texts = [tok.decode(ids) for ids in built.ids]
        seen["teacher"].append((texts, list(ground_truths), list(built.has_hint)))
        return built

    def credit_details(*args, **kwargs):
        details = real_details(*args, **kwargs)
        seen["credit"].append((args, kwargs, details))
        return details

    monkeypatch.setattr(trainer, "_teacher_prompts", teacher_prompts)
    monkeypatch.setattr(trl_credit, "credit_details", credit_details)
    return seen


def train_one_step(trainer):
    before = parameters(trainer.model)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = [n for n, p in before.items() if not torch.equal(p, after[n])]
    assert changed, "no parameter changed"
    return trainer.state.log_history


def assert_weights_follow_kl(seen, hinted):
    """GEAR's weights differ from 1 on rows with a hint, a non-zero advantage and a varying
    KL; rows without a hint (`hinted` False) keep weight 1 on every token."""
    (advantages, valid), kwargs, details = seen["credit"][0]
    weighted = 0
    for i, has_hint in enumerate(hinted):
        w, v = details.weights[i], valid[i]
        if not has_hint:
            assert bool(details.fallback_rows[i]) and (w == 1).all()
            continue
        kl = kwargs["kl"][i][v]
        assert torch.isfinite(kl).all() and not bool(details.fallback_rows[i])
        if advantages[i] != 0 and kl.max() - kl.min() > 1e-6:
            assert not torch.allclose(w[v], torch.ones_like(w[v]))
            weighted += 1
    assert weighted > 0, "no row with a hint, an advantage and a varying KL"


# ----------------------------------------------------------------------------- environments


class Arithmetic:
    """Owns its data: `reset()` draws a sum, returns it as the prompt and sets the ground truth."""

    ground_truth: str | None = None

    def reset(self, **kwargs):
        rng = random.Random(next(DRAW))
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        self.ground_truth = f"{self.a} + {self.b} = {self.a + self.b}"
        return f"What is {self.a} + {self.b}?"


def sum_of(text):
    """The (a, b) of the last 'What is a + b?' in a rendered prompt."""
    return tuple(map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]))


def test_environment_owned_data(tmp_path, monkeypatch):
    """TRL's test_train_with_environment_owned_data: no train_dataset, reset() returns the
    prompt; the ground truth it sets is in that rollout's teacher prompt."""
    trainer = env_trainer(tmp_path, Arithmetic, hint_kind="math")
    seen = spy(monkeypatch, trainer)
    logs = train_one_step(trainer)

    texts, gts, hinted = seen["teacher"][0]
    assert len(texts) == 4 and all(hinted)
    for text, gt in zip(texts, gts, strict=True):
        a, b = sum_of(text)  # the student's prompt, after reset()
        assert gt == f"{a} + {b} = {a + b}"
        assert f"Here is a reference solution:\n{gt}\n" in text
    assert len(set(gts)) == 4  # one environment instance per rollout
    assert logs[0]["gear/rows_without_ground_truth"] == 0
    assert_weights_follow_kl(seen, hinted)


class ArithmeticWithAnswer(Arithmetic):
    """Also sets the episode's final answer, for the answer teacher contexts."""

    answer: str | None = None

    def reset(self, **kwargs):
        prompt = super().reset(**kwargs)
        self.answer = str(self.a + self.b)
        return prompt


@pytest.mark.parametrize("context", ["answer_only", "contrast"])
def test_an_environment_supplies_the_answer_of_the_answer_contexts(tmp_path, monkeypatch, context):
    """teacher_context 'answer_only' / 'contrast' read the environment's attribute named
    `answer_column`; contrast's second teacher is shown a wrong answer in the same template."""
    trainer = env_trainer(tmp_path, ArithmeticWithAnswer, teacher_context=context)
    seen = spy(monkeypatch, trainer)
    logs = train_one_step(trainer)
    texts, answers, hinted = seen["teacher"][0]
    assert len(texts) == 4 and all(hinted)
    for text, answer in zip(texts, answers, strict=True):
        a, b = sum_of(text)
        assert answer == str(a + b)
        assert f"The final answer is {a + b}." in text and "reference solution" not in text
    assert ("gear/time_contrast" in logs[0]) == (context == "contrast")
    if context == "contrast":
        texts, wrong, _ = seen["teacher"][1]
        for text, w, answer in zip(texts, wrong, answers, strict=True):
            assert w != answer and f"The final answer is {w}." in text


def test_an_answer_context_without_the_answer_attribute_fails_at_start_up(tmp_path):
    with pytest.raises(
        ValueError, match=r"answer_column \(teacher_context='answer_only'\): no episode can have"
    ):
        env_trainer(tmp_path, Arithmetic, teacher_context="answer_only")


class Counter:
    """TRL's counter environment (`reset()` returns None: the prompt stays TRL's placeholder),
    with the episode's reference call as its ground truth."""

    ground_truth: str | None = None

    def reset(self, **kwargs):
        self._counter = 0
        self._step = next(DRAW) % 3 + 1
        self.ground_truth = json.dumps([{"name": "increment", "arguments": {"step": self._step}}])

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class ScoredCounter(Counter):
    def get_reward(self) -> float:
        return float(self._counter)


def counted(environments, **kwargs):
    return [float(e._counter) for e in environments]


def counter_turns(i, prompt):
    if prompt.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"):
        return "Done!<|im_end|>"
    call = {"name": "increment", "arguments": {"step": i + 1}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"


@pytest.mark.parametrize(
    "reward",
    [
        "reward_funcs",  # test_train_with_environment_factory
        "environment",  # test_train_with_environment_owned_reward
        "both",  # test_environment_owned_reward_coexists_with_reward_funcs
    ],
)
def test_tool_environment_without_dataset(tmp_path, monkeypatch, reward):
    """TRL's environment_factory scenarios: a tool environment, no train_dataset, the reward
    from reward_funcs, the environment's get_reward, or both."""
    env = Counter if reward == "reward_funcs" else ScoredCounter
    funcs = None if reward == "environment" else counted
    trainer = env_trainer(tmp_path, env, reward_funcs=funcs)
    names = {"reward_funcs": ["counted"], "environment": ["ScoredCounter"]}
    assert trainer.reward_func_names == names.get(reward, ["counted", "ScoredCounter"])
    assert "ground_truth" not in [t.__name__ for t in trainer.tools]
    script_turns(monkeypatch, trainer, counter_turns)
    seen = spy(monkeypatch, trainer)
    logs = train_one_step(trainer)

    texts, gts, hinted = seen["teacher"][0]
    assert all(hinted) and len(set(gts)) > 1
    for text, gt in zip(texts, gts, strict=True):
        assert f"Reference tool calls: {gt}" in text and '"name": "increment"' in text
    # the ground truth was read right after reset(), from each rollout's own instance
    assert [e.ground_truth for e in trainer.environments] == gts
    assert logs[0]["gear/rows_without_ground_truth"] == 0
    assert logs[0]["tools/call_frequency"] == 1
    assert_weights_follow_kl(seen, hinted)


class AddTool:
    """A multi-turn tool environment that owns its data: `reset()` draws the problem."""

    ground_truth: str | None = None

    def reset(self, **kwargs):
        rng = random.Random(next(DRAW))
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        self.ground_truth = json.dumps([{"name": "add", "arguments": {"a": self.a, "b": self.b}}])
        return f"What is {self.a} + {self.b}? Use the add tool."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum.
        """
        return a + b


def add_turns(i, prompt):
    """Row i calls add(a, b + i % 2) on its own problem, then answers with the tool's result."""
    if prompt.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"):
        result = re.findall(r"<tool_response>\n?(\d+)", prompt)[-1]
        return f"It is {result}.<|im_end|>"
    a, b = sum_of(prompt)
    call = {"name": "add", "arguments": {"a": a, "b": b + i % 2}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"


def correct(completions, environments, **kwargs):
    return [
        float(f"It is {e.a + e.b}." in c[-1]["content"])
        for c, e in zip(completions, environments, strict=True)
    ]


def test_multi_turn_tool_environment_owns_its_data(tmp_path, monkeypatch):
    trainer = env_trainer(tmp_path, AddTool, reward_funcs=correct)
    script_turns(monkeypatch, trainer, add_turns)
    seen = spy(monkeypatch, trainer)
    logs = train_one_step(trainer)

    texts, gts, hinted = seen["teacher"][0]
    assert all(hinted)
    for text, gt in zip(texts, gts, strict=True):
        a, b = sum_of(text)
        assert json.loads(gt) == [{"name": "add", "arguments": {"a": a, "b": b}}]
        assert f"Use the add tool.\n\nReference tool calls: {gt}" in text
        assert '"name": "add"' in text.split("Reference tool calls")[0]  # the tool schema
    assert logs[0]["rewards/correct/mean"] == 0.5
    (_, valid), kwargs, details = seen["credit"][0]
    assert (kwargs["turn_starts"].sum(dim=1) == 1).all()  # the answer follows the tool output
    assert (details.weights[~valid] == 1).all()
    assert_weights_follow_kl(seen, hinted)


# ----------------------------------------------------------------------------- dict factory


class Guess:
    """A second environment for a dict factory, driven by its row's kwargs."""

    def __init__(self):
        self.ground_truth = None

    def reset(self, word="crane", **kwargs):
        self.ground_truth = word
        return f"Guess the {len(word)}-letter word."

    def guess(self, word: str) -> str:
        """
        Submit a guess.

        Args:
            word: The guessed word.

        Returns:
            Feedback about the guess.
        """
        return "yes" if word == self.ground_truth else "no"


def test_dict_factory_reads_each_rollouts_environment(tmp_path, monkeypatch):
    """A dataset of routing rows and reset() kwargs only (no ground-truth column): each row's
    teacher prompt has its own environment's ground truth and tools."""
    data = Dataset.from_dict(
        {"environment": ["add", "guess"], "word": ["-", "apple"]}  # `word`: reset() kwargs
    )
    trainer = env_trainer(
        tmp_path, {"add": AddTool, "guess": Guess}, data=data, max_completion_length=8
    )
    seen = spy(monkeypatch, trainer)
    train_one_step(trainer)

    texts, gts, hinted = seen["teacher"][0]
    assert all(hinted)
    routed = [type(e).__name__ for e in trainer.environments]
    assert sorted(routed) == ["AddTool", "AddTool", "Guess", "Guess"]
    for text, gt, name in zip(texts, gts, routed, strict=True):
        assert f"Reference tool calls: {gt}" in text
        if name == "Guess":
            assert gt == "apple" and "Guess the 5-letter word." in text
            assert '"name": "guess"' in text and '"name": "add"' not in text
        else:
            a, b = sum_of(text)
            assert json.loads(gt)[0]["arguments"] == {"a": a, "b": b}
            assert '"name": "add"' in text and '"name": "guess"' not in text
    assert_weights_follow_kl(seen, hinted)


def test_the_environment_wins_over_the_column(tmp_path, monkeypatch):
    """reset() gets the row (ground-truth column included); what it sets is the episode's
    ground truth. A row whose environment holds none keeps its column's value."""

    class Override(Arithmetic):
        def reset(self, ground_truth=None, **kwargs):
            prompt = super().reset()
            if ground_truth == "keep":
                self.ground_truth = None  # no value of its own: the column's is used
            return prompt

    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": ""}]] * 2, "ground_truth": ["stale", "keep"]}
    )
    trainer = env_trainer(tmp_path, Override, data=data, hint_kind="math", max_completion_length=8)
    seen = spy(monkeypatch, trainer)
    train_one_step(trainer)
    texts, gts, hinted = seen["teacher"][0]
    assert all(hinted) and gts.count("keep") == 2 and "stale" not in gts
    for text, gt in zip(texts, gts, strict=True):
        if gt != "keep":
            a, b = sum_of(text)
            assert gt == f"{a} + {b} = {a + b}" and f"solution:\n{gt}" in text


# ----------------------------------------------------------------------------- no ground truth


class Plain:
    """An environment that supplies no ground truth."""

    def reset(self, **kwargs):
        return "Say something."

    def noop(self) -> str:
        """
        Do nothing.

        Returns:
            Nothing.
        """
        return ""


class Sometimes(Arithmetic):
    """Supplies a ground truth for every other episode only (None for the others)."""

    episodes = itertools.count()

    def reset(self, **kwargs):
        prompt = super().reset()
        self.hinted = next(Sometimes.episodes) % 2 == 0
        if not self.hinted:
            self.ground_truth = None
        return prompt


def test_rows_without_ground_truth_get_weight_one(tmp_path, monkeypatch):
    """Rows whose environment supplies none (and no column) fall back to weight 1 and are
    counted; a start-up warning names the environment that can never supply one."""
    data = Dataset.from_dict({"environment": ["math", "plain"]})
    with pytest.warns(UserWarning, match=r"Plain have no attribute 'ground_truth'"):
        trainer = env_trainer(
            tmp_path,
            {"math": Sometimes, "plain": Plain},
            data=data,
            max_completion_length=8,
            per_device_train_batch_size=8,
            num_generations=4,
        )
    seen = spy(monkeypatch, trainer)
    logs = train_one_step(trainer)

    texts, _, hinted = seen["teacher"][0]
    routed = [type(e).__name__ for e in trainer.environments]
    expected = [
        n == "Sometimes" and e.hinted for n, e in zip(routed, trainer.environments, strict=True)
    ]
    assert hinted == expected and any(hinted) and not all(hinted)
    for text, has_hint in zip(texts, hinted, strict=True):
        assert ("reference solution" in text or "Reference" in text) == has_hint
    assert logs[0]["gear/rows_without_ground_truth"] == hinted.count(False)
    assert_weights_follow_kl(seen, hinted)


class NoTruth:
    def reset(self, **kwargs):
        return "Guess the 5-letter word."


class TruthAsMethod:
    def reset(self, **kwargs):
        return "Guess."

    def ground_truth(self) -> str:
        """
        The answer.

        Returns:
            The answer.
        """
        return "crane"


def test_no_episode_can_have_a_ground_truth_is_one_start_up_error(tmp_path):
    with pytest.raises(ValueError, match=r"no episode can have a ground truth .* reset\(\)"):
        env_trainer(tmp_path, NoTruth)
    with pytest.raises(ValueError, match=r"no episode can have a ground truth"):
        env_trainer(
            tmp_path,
            {"a": NoTruth, "b": Plain},
            data=Dataset.from_dict({"environment": ["a", "b"]}),
        )
    # a method would be a tool the student could call to read the answer
    with pytest.raises(ValueError, match=r"'ground_truth' must be an attribute or a @property"):
        env_trainer(tmp_path, TruthAsMethod)
    # methods without a teacher need no ground truth
    env_trainer(tmp_path, NoTruth, credit_method="grpo")
    env_trainer(tmp_path, NoTruth, credit_method="entropy_top")


class Lazy:
    """Sets its ground truth in a helper that reset() calls, without declaring it."""

    def reset(self, **kwargs):
        self._draw()
        return "Guess the word."

    def _draw(self):
        self.ground_truth = "crane"


def test_an_undeclared_attribute_set_in_a_method_is_accepted(tmp_path, monkeypatch):
    trainer = env_trainer(tmp_path, Lazy, hint_kind="math", max_completion_length=8)
    seen = spy(monkeypatch, trainer)
    train_one_step(trainer)
    texts, gts, _ = seen["teacher"][0]
    assert gts == ["crane"] * 4 and all("solution:\ncrane" in t for t in texts)

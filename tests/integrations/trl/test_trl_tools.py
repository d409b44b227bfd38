"""Multi-turn rollouts: tool / environment observation tokens take no part in GEAR's credit.

Two ways in: a `rollout_func` that returns TRL's `env_mask` (0 on observation tokens), and TRL's
own `tools=` loop (which `environment_factory=` shares) with scripted model turns, since a random
tiny model never writes a valid tool call. Both end in TRL's `tool_mask`.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import types

import pytest
import torch

import gear.integrations.trl.credit as trl_credit
from _trl_helpers import byte_tokenizer, make_trainer
from gear.integrations.trl.prompts import trainer_hint_template

OBSERVATION = "<tool_response>42</tool_response>"
FIRST, SECOND = 4, 5  # policy tokens before and after the observation


def rollout(prompts, trainer):
    """Policy tokens, a tool observation, policy tokens again; one completion per prompt."""
    tok = trainer.processing_class
    gen = torch.Generator().manual_seed(1234)
    observation = tok(OBSERVATION, add_special_tokens=False)["input_ids"]
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for prompt in prompts:
        ids = tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        first = torch.randint(3, len(tok), (FIRST,), generator=gen).tolist()
        second = torch.randint(3, len(tok), (SECOND,), generator=gen).tolist()
        out["prompt_ids"].append(ids["input_ids"])
        out["completion_ids"].append(first + observation + second)
        out["logprobs"].append([0.0] * (FIRST + len(observation) + SECOND))
        out["env_mask"].append([1] * FIRST + [0] * len(observation) + [1] * SECOND)
    return out


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def test_tool_tokens_are_masked_out_of_signals_weights_and_segments(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    trainer = make_trainer(tmp_path, tok, rollout_func=rollout, credit_log_rows=4)
    n_obs = len(tok(OBSERVATION, add_special_tokens=False)["input_ids"])
    obs = slice(FIRST, FIRST + n_obs)
    calls, forwards, losses = [], [], []
    real_details, real_hidden, real_loss = (
        trl_credit.credit_details,
        trainer._final_hidden,
        trainer._compute_loss,
    )

    def spy_details(*args, **kwargs):
        calls.append((args, kwargs, real_details(*args, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(trl_credit, "credit_details", spy_details)
    monkeypatch.setattr(
        trainer,
        "_final_hidden",
        lambda m, ids, *a, **k: forwards.append(ids) or real_hidden(m, ids, *a, **k),
    )
    monkeypatch.setattr(trainer, "_compute_loss", lambda m, x: losses.append(x) or real_loss(m, x))
    trainer.train()

    (_, valid), kwargs, details = calls[0]
    B, T = valid.shape
    assert FIRST + n_obs + SECOND == T
    assert not valid[:, obs].any() and valid[:, :FIRST].all() and valid[:, obs.stop :].all()
    starts = kwargs["turn_starts"]
    assert starts[:, obs.stop].all() and starts.sum() == B  # the policy's second turn
    # no segment crosses the observation; observation tokens hold no segment and weight 1
    for row in details.segment_ids.tolist():
        assert set(row[:FIRST]) & set(row[obs.stop :]) <= {-1}
    assert (details.segment_ids[:, obs] == -1).all() and (details.weights[:, obs] == 1).all()
    kl = kwargs["kl"]
    assert details.stats["gear/kl_mean"] == pytest.approx(float(kl[valid].mean()), rel=1e-5)
    # the advantages that reach TRL's loss are 0 on observation tokens
    adv = losses[0]["advantages"]
    assert adv.shape == (B, T) and (adv[:, obs] == 0).all() and adv[:, :FIRST].abs().sum() > 0
    assert (losses[0]["tool_mask"][:, obs] == 0).all()
    # the teacher scored the full completion, observation included
    completions = losses[0]["completion_ids"].tolist()
    teacher = [
        f for f in forwards if "Reference" in tok.decode(f[0]) or "reference" in tok.decode(f[0])
    ]
    assert teacher and sorted(teacher[0][:, -T:].tolist()) == sorted(completions)
    # the credit record keeps the observation, marked invalid
    lines = (tmp_path / "credit" / "step_000001.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert len(record["tokens"]) == T and record["valid"][obs] == [False] * n_obs


def test_the_tool_hint_is_chosen_for_tool_rollouts_when_asked(tmp_path):
    trainer = make_trainer(tmp_path, byte_tokenizer(), rollout_func=rollout, hint_kind="tool")
    assert trainer_hint_template(trainer).startswith("Reference tool calls:")
    trainer = make_trainer(tmp_path, byte_tokenizer(), rollout_func=rollout)
    assert trainer_hint_template(trainer).startswith(
        "Here is a reference solution"
    )  # auto: no tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


def answer_reward(completions, **kwargs):
    """The last number of the final assistant message."""
    return [float(re.findall(r"\d+", c[-1]["content"])[-1]) for c in completions]


class Calculator:
    """An environment for `environment_factory`: its public methods are the tools."""

    def reset(self, **kwargs):
        return "\nThe calculator is ready."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum.
        """
        return a + b


def _tool_trainer(tmp_path, monkeypatch, **kwargs):
    """A trainer with TRL's Qwen2.5 template (which TRL can render and parse tool calls with)
    whose model turns are scripted: a call to `add`, then the answer after the tool response."""
    tok = byte_tokenizer()
    template = importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja"
    tok.chat_template = template.read_text()
    trainer = make_trainer(
        tmp_path, tok, reward_funcs=answer_reward, max_completion_length=200, **kwargs
    )
    call = (
        '<tool_call>\n{{"name": "add", "arguments": {{"a": {}, "b": 2}}}}\n</tool_call><|im_end|>'
    )

    def scripted(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        texts = [
            f"It is {i + 2}.<|im_end|>"
            if tok.decode(p).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
            else call.format(i)
            for i, p in enumerate(prompt_ids)
        ]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts], None

    monkeypatch.setattr(trainer, "_generate_single_turn", types.MethodType(scripted, trainer))
    return trainer, tok


@pytest.mark.parametrize("way", ["tools", "environment_factory"])
def test_tool_calls_through_trl_mask_the_tool_response(tmp_path, monkeypatch, way):
    kwargs = {"tools": [add]} if way == "tools" else {"environment_factory": Calculator}
    trainer, tok = _tool_trainer(tmp_path, monkeypatch, **kwargs)
    calls, forwards = [], []
    real_details, real_hidden = trl_credit.credit_details, trainer._final_hidden
    monkeypatch.setattr(
        trl_credit, "credit_details", lambda *a, **k: calls.append(k) or real_details(*a, **k)
    )
    monkeypatch.setattr(
        trainer,
        "_final_hidden",
        lambda m, ids, *a, **k: forwards.append(ids) or real_hidden(m, ids, *a, **k),
    )
    trainer.model.train()
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))

    completion = out["completion_mask"].bool()
    policy = out["tool_mask"].bool() & completion
    observation = completion & ~policy
    assert observation.any(dim=1).all()  # every row called the tool
    assert "<tool_response>" in tok.decode(out["completion_ids"][0][observation[0]])
    adv = out["advantages"]
    assert (adv[observation] == 0).all() and adv[policy].abs().sum() > 0
    assert (calls[0]["turn_starts"].sum(dim=1) == 1).all()  # the answer opens a new turn
    teacher = tok.decode(forwards[-1][0])
    assert "Reference tool calls:" in teacher and '"name": "add"' in teacher  # hint and schema
    if way == "environment_factory":  # the teacher prompt is the prompt after reset()
        assert "The calculator is ready." in teacher

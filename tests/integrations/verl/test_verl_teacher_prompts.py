"""The teacher's prompts of the verl integration (gear.integrations.verl.teacher_inputs): the
hint, the answer-only context, and verl's own renderer and tools behind the trainer's.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import dataclasses

import pytest

from _verl_helpers import CONFIGS, fake_render, verl_cfg
from gear.integrations.verl.config import GearConfigError, GearVerlConfig, validate_verl_config
from gear.integrations.verl.teacher_inputs import MissingGroundTruthError, build_teacher_prompts


def test_teacher_prompts():
    cfg = GearVerlConfig(ground_truth_field="reward_model.ground_truth")
    rows = [
        {
            "raw_prompt": [{"role": "user", "content": "2+2?"}],
            "reward_model": {"ground_truth": "4"},
        },
        {
            "raw_prompt": [{"role": "user", "content": "3+3?"}],
            "reward_model": {"ground_truth": None},
        },
        {
            "raw_prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
            "reward_model": {"ground_truth": "call"},
        },
        {"raw_prompt": [{"role": "user", "content": "pad"}], "reward_model": {"ground_truth": "9"}},
    ]
    student = [fake_render(r["raw_prompt"], None) for r in rows]
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    out = build_teacher_prompts(
        rows,
        student,
        cfg,
        fake_render,
        tools_for_row=lambda row: tools if row["reward_model"]["ground_truth"] == "call" else None,
        skip=[False, False, False, True],
    )
    hint = "Here is a reference solution:\n4\n\nUse it"
    assert out.ids[0] == fake_render(
        [
            {
                "role": "user",
                "content": "2+2?\n\n"
                + hint
                + " to check your own reasoning, then solve the problem yourself.",
            }
        ],
        None,
    )
    assert (
        out.ids[1] == student[1] and out.without_ground_truth == 1
    )  # no reference: the student's prompt
    assert out.ids[2] == fake_render(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "x\n\nReference tool calls: call"},
        ],
        tools,
    )
    assert out.ids[3] == student[3]  # verl's synthetic padding rows are left alone
    with pytest.raises(MissingGroundTruthError, match=r"'reward_model\.ground_truth'"):
        build_teacher_prompts(
            [{"raw_prompt": rows[0]["raw_prompt"]}], student[:1], cfg, fake_render
        )


def test_answer_only_teacher_prompts_show_the_answer_field_and_not_the_solution(tmp_path):
    cfg = GearVerlConfig(
        ground_truth_field="extra_info.ground_truth", teacher_context="answer_only"
    )
    row = {
        "raw_prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "extra_info": {"ground_truth": "2 + 2 = 4. The answer is 4."},
    }
    out = build_teacher_prompts([row], [fake_render(row["raw_prompt"], None)], cfg, fake_render)
    expected = [{"role": "user", "content": "2+2?\n\nThe final answer is 4."}]
    assert out.ids[0] == fake_render(expected, None)  # tools or not: the answer template
    worked = dataclasses.replace(cfg, teacher_context="worked_solution")
    solution = build_teacher_prompts([row], [[]], worked, fake_render).ids[0]
    assert solution != out.ids[0] and solution == fake_render(
        [
            {
                "role": "user",
                "content": "2+2?\n\n"
                + worked.math_hint_template.replace(
                    "{ground_truth}", "2 + 2 = 4. The answer is 4."
                ),
            }
        ],
        None,
    )
    # a row without the answer field, at run time and (local parquet) before anything starts
    with pytest.raises(MissingGroundTruthError, match=r"gear\.answer_field='reward_model\.answer'"):
        build_teacher_prompts(
            [row], [[]], dataclasses.replace(cfg, answer_field="reward_model.answer"), fake_render
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "reward_model": {"style": "r"}}]), path)
    with pytest.raises(GearConfigError, match=r"gear\.answer_field=.*no field 'ground_truth'"):
        validate_verl_config(
            verl_cfg(**{"data.train_files": str(path), "gear.teacher_context": "answer_only"})
        )


def test_trainer_renders_teacher_prompts_like_the_agent_loop():
    """verl's Continuous Token renderer (the agent loop's) and verl's tool loading, for real."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    from gear.integrations.verl.trainer import GearPPOTrainer
    from gear.models import byte_tokenizer
    from gear.tasks.tools import tool_schemas

    tok = byte_tokenizer()
    trainer = object.__new__(GearPPOTrainer)
    trainer.config = OmegaConf.create(
        {
            "data": {"apply_chat_template_kwargs": {}},
            "actor_rollout_ref": {
                "rollout": {
                    "multi_turn": {"tool_config_path": str(CONFIGS / "tools" / "gear_tools.yaml")},
                    "agent": {"default_agent_loop": "single_turn_agent"},
                }
            },
        }
    )
    trainer.tokenizer, trainer.processor = tok, None
    trainer._gear_hf_model_type, trainer._gear_render, trainer._gear_tool_schemas = None, None, None
    render = trainer._gear_renderer()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert render(messages, None) == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert trainer._tools_for_row({"agent_name": "single_turn_agent"}) is None
    from verl.tools.schemas import OpenAIFunctionToolSchema

    verl_view = [  # what verl's agent loop renders: its schema model drops TRL's "return" entry
        OpenAIFunctionToolSchema.model_validate(s).model_dump(exclude_unset=True, exclude_none=True)
        for s in tool_schemas()
    ]
    assert trainer._tools_for_row({"agent_name": "tool_agent"}) == verl_view
    only = trainer._tools_for_row(
        {"agent_name": "tool_agent", "extra_info": {"tool_selection": ["lookup"]}}
    )
    assert [t["function"]["name"] for t in only] == ["lookup"]

    row = {"raw_prompt": messages, "reward_model": {"ground_truth": "four " * 40}}
    kwargs = dict(
        tokenize=lambda s: tok(s, add_special_tokens=False)["input_ids"],
        detokenize=lambda ids: tok.decode(ids),
    )
    full = build_teacher_prompts(
        [row], [render(messages, None)], GearVerlConfig(), render, **kwargs
    )
    budget = len(full.ids[0]) - 100  # cut 100 of the ground truth's 200 tokens
    cfg = GearVerlConfig(teacher_max_prompt_length=budget)
    out = build_teacher_prompts([row], [render(messages, None)], cfg, render, **kwargs)
    assert (full.truncated, out.truncated) == (0, 1) and len(out.ids[0]) <= budget
    assert "[...]" in tok.decode(out.ids[0])

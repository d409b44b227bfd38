"""GEAR on verl (gear.integrations.verl), on CPU.

Without verl: config validation, GRPO per uid, the estimator against gear.credit, teacher prompts.
With verl (pytest.importorskip): registration in verl's registry (idempotent, distinct names, the
``verl.plugins`` entry point in a fresh interpreter), verl's stock ``compute_advantage`` on a
DataProto built like verl's, GEAR's v1 trainer with an in-memory TransferQueue and the real
`GearActorRolloutRefWorker` over verl's CPU inference path on 2 "ranks" (`_verl_helpers`), the
example Hydra configs, and the tools of the multi-turn example. The teacher pass itself against a
full-logits oracle: tests/test_verl_worker.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from _verl_helpers import gear_worker, verl_on_cpu
from gear.credit import CreditParams, token_advantages
from gear.credit.signals import signals_from_logits
from gear.integrations.verl.config import (
    VERL_ESTIMATORS,
    GearConfigError,
    GearVerlConfig,
    answer_values,
    check_ground_truth_field,
    default_gear_section,
    validate_verl_config,
)
from gear.integrations.verl.estimators import (
    ESTIMATOR_FNS,
    SIGNAL_FIELDS,
    GearBatch,
    gear_batch,
    grpo_advantages,
    register_estimators,
)
from gear.integrations.verl.teacher_inputs import (
    MissingGroundTruthError,
    build_teacher_prompts,
    get_field,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "verl"
V = 64  # vocabulary of the tiny model


def verl_cfg(**over):
    cfg = {
        "algorithm": {"adv_estimator": "gear", "norm_adv_by_std_in_grpo": True},
        "trainer": {"use_v1": True, "v1": {"trainer_mode": "gear_sync"}},
        "actor_rollout_ref": {
            "actor": {"strategy": "fsdp", "ulysses_sequence_parallel_size": 1},
            "model": {"use_fused_kernels": False},
            "rollout": {"n": 4},
        },
        "data": {},
    }
    for path, value in over.items():
        node = cfg
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


# ------------------------------------------------------------------------------------- config


def test_random_shape_needs_what_its_candidate_reads():
    def settings(shape: str):
        over = {
            "algorithm.adv_estimator": "gear_random_shape",
            "gear.credit": {"shape_method": shape},
        }
        return validate_verl_config(verl_cfg(**over))

    assert settings("rlsd").needs_teacher
    entropy = settings("entropy_top")  # the student's entropy alone: no teacher pass
    assert entropy.needs_signals and not entropy.needs_teacher
    with pytest.raises(GearConfigError, match="influence"):
        settings("oar_g")  # verl computes no answer influence yet, for oar_g or its placebo
    with pytest.raises(GearConfigError, match=r"one forward per masked token.*collective"):
        settings("oar_p")  # OAR-P's data-dependent forwards would desynchronise sharded ranks
    with pytest.raises(GearConfigError, match="step checker"):
        settings("first_error")  # nor a step checker's mask
    with pytest.raises(GearConfigError, match=r"lambda_grpo.*response token ids"):
        settings("lambda_grpo")  # nor each row's response ids for the group prefix tree


def test_lambda_grpo_is_refused_with_the_reason():
    with pytest.raises(GearConfigError, match=r"gear_lambda_grpo.*compute_advantage passes only"):
        validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_lambda_grpo"}))


def test_random_methods_draw_anew_each_step():
    pytest.importorskip("verl")
    from gear.integrations.verl import trainer as gear_trainer

    for estimator in ("gear_random", "gear_random_shape"):
        trainer = object.__new__(gear_trainer.GearPPOTrainer)
        over = {"algorithm.adv_estimator": estimator, "gear.credit": {"seed": 3}}
        trainer.gear_settings = validate_verl_config(verl_cfg(**over))
        seeds = set()
        for step in range(3):
            trainer.global_steps = step
            seeds.add(trainer._batch_credit_params().seed)
        assert seeds == {3, 4, 5}, estimator


def test_config_validation_errors(tmp_path):
    s = validate_verl_config(verl_cfg())
    assert (s.estimator, s.method, s.needs_teacher) == ("gear", "gear", True)
    assert (
        validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_turn"})).method == "turn"
    )
    grpo = validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_grpo"}))
    assert not grpo.needs_teacher and not grpo.needs_signals
    entropy = validate_verl_config(verl_cfg(**{"algorithm.adv_estimator": "gear_entropy_top"}))
    assert entropy.needs_signals and not entropy.needs_teacher  # the student's entropy alone
    cases = {
        "algorithm.adv_estimator": ("grpo", "algorithm.adv_estimator: expected one of"),
        "trainer.v1.trainer_mode": ("sync", "trainer.v1.trainer_mode: expected 'gear_sync'"),
        "trainer.use_v1": (False, "trainer.use_v1"),
        "actor_rollout_ref.actor.strategy": ("megatron", "actor_rollout_ref.actor.strategy"),
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
            2,
            "ulysses_sequence_parallel_size",
        ),
        "actor_rollout_ref.model.use_fused_kernels": (True, "use_fused_kernels"),
        "actor_rollout_ref.rollout.n": (1, "actor_rollout_ref.rollout.n"),
        "gear.colour": ("red", "gear: unknown key(s) ['colour']"),
        "gear.credit": ({"method": "gear"}, "algorithm.adv_estimator"),
        "gear.kl_estimator": ("exact", "gear.kl_estimator"),
        "gear.hint_kind": ("poem", "gear.hint_kind"),
        "gear.math_hint_template": ("no placeholder", "gear.math_hint_template"),
        "gear.teacher": ("ema", "gear.teacher"),
        "gear.teacher_micro_batch_size_per_gpu": (0, "gear.teacher_micro_batch_size_per_gpu"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(GearConfigError, match=re.escape(message)):
            validate_verl_config(verl_cfg(**{key: value}))
    with pytest.raises(GearConfigError, match=r"gear\.credit: CreditParams\.tau_onset"):
        validate_verl_config(verl_cfg(**{"gear.credit": {"tau_onset": 2.0}}))

    # a missing ground-truth field, found in the parquet schema before anything starts
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "q", "reward_model": {"ground_truth": "4"}}]), path
    )
    check_ground_truth_field("reward_model.ground_truth", [str(path)])
    with pytest.raises(
        GearConfigError, match=r"reward_model in .* has no field 'solution'.*\['ground_truth'\]"
    ):
        validate_verl_config(
            verl_cfg(
                **{
                    "data.train_files": str(path),
                    "gear.ground_truth_field": "reward_model.solution",
                }
            )
        )
    with pytest.raises(
        GearConfigError,
        match=r"has no field 'extra_info'; fields present: \['prompt', 'reward_model'\]",
    ):
        check_ground_truth_field("extra_info.ground_truth", [str(path)])
    # ... and at run time, per row
    with pytest.raises(
        MissingGroundTruthError, match=r"reward_model has no field 'ground_truth'.*\['style'\]"
    ):
        get_field({"reward_model": {"style": "rule"}}, "reward_model.ground_truth")


def test_gear_defaults_yaml_matches_code():
    section = yaml.safe_load((CONFIGS / "gear_defaults.yaml").read_text())["gear"]
    assert section == default_gear_section()
    assert (
        GearVerlConfig(**{**section, "credit": section["credit"]}).credit_params("gear")
        == CreditParams()
    )


# ------------------------------------------------------------------------------------- estimators


def loop_grpo(scores, uids, eps, norm=True):
    out = []
    for i, u in enumerate(uids):
        group = torch.tensor(
            [float(scores[j]) for j in range(len(uids)) if uids[j] == u], dtype=torch.float64
        )
        mean, std = (
            (group.mean(), group.std())
            if len(group) > 1
            else (torch.tensor(0.0), torch.tensor(1.0))
        )
        out.append((float(scores[i]) - mean) / (std + eps) if norm else float(scores[i]) - mean)
    return torch.tensor(out, dtype=torch.float32)


def test_grpo_advantages_vectorised():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (11,), generator=g).float()
    uids = ["a", "b", "a", "c", "b", "a", "b", "d", "c", "a", "b"]  # "d" is a group of one
    for norm in (True, False):
        got = grpo_advantages(scores, uids, epsilon=1e-4, norm_adv_by_std=norm)
        torch.testing.assert_close(got, loop_grpo(scores, uids, 1e-4, norm), rtol=0, atol=1e-6)
    # sessions: only each session's final output counts; its advantage is shared
    sessions = ["a0", "a0", "a1", "b0", "b1"]
    final = torch.tensor([False, True, True, True, True])
    s = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    got = grpo_advantages(s, ["a", "a", "a", "b", "b"], final=final, sessions=sessions)
    want = loop_grpo(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"], 1e-4)
    torch.testing.assert_close(got, torch.stack([want[0], want[0], want[1], want[2], want[3]]))


def verl_like_batch(seed=0):
    """Rows like verl's batch: responses right-padded, a tool observation (mask 0) mid-row,
    the reward on the last valid token, uids in groups of 3."""
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 12
    lengths = [12, 9, 5, 12, 7, 10]
    mask = torch.zeros(n, t, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    mask[0, 4:7] = 0  # tool observation tokens
    mask[3, 2:4] = 0
    rewards = torch.zeros(n, t)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    for i, length in enumerate(lengths):
        rewards[i, length - 1] = scores[i]
    signals = {
        "gear_kl": torch.rand(n, t, generator=g) * 3,
        "gear_entropy": torch.rand(n, t, generator=g) * 2,
        "gear_student_logprobs": -torch.rand(n, t, generator=g) * 4,
        "gear_teacher_logprobs": -torch.rand(n, t, generator=g) * 4,
    }
    uids = ["p0"] * 3 + ["p1"] * 3
    return rewards, mask, uids, signals


def expected_token_advantages(rewards, mask, uids, signals, method, eps=1e-4, norm=True):
    seq = grpo_advantages(rewards.sum(-1), uids, epsilon=eps, norm_adv_by_std=norm)
    return token_advantages(
        seq,
        mask.bool(),
        kl=signals["gear_kl"],
        entropy=signals["gear_entropy"],
        student_logprobs=signals["gear_student_logprobs"],
        teacher_logprobs=signals["gear_teacher_logprobs"],
        params=CreditParams(method=method),
    )


#: estimators whose signals verl's trainer computes (OAR's answer influence and a step
#: checker's mask it does not yet: `check_gear_config` refuses those, and a direct call names the
#: missing signal, tested below)
COMPUTED = sorted(
    n
    for n, m in VERL_ESTIMATORS.items()
    if not {"influence", "perturbation", "error_mask", "prefix_count"}
    & set(CreditParams(method=m).required_signals)
)


def test_estimator_without_its_signal_names_it():
    rewards, mask, uids, signals = verl_like_batch()
    with pytest.raises(ValueError, match="influence"):
        ESTIMATOR_FNS["gear_oar_g"](
            token_level_rewards=rewards,
            response_mask=mask,
            config={"norm_adv_by_std_in_grpo": True},
            index=uids,
            **signals,
        )


@pytest.mark.parametrize("name", COMPUTED)
def test_estimator_equals_gear_credit(name):
    rewards, mask, uids, signals = verl_like_batch()
    fn = ESTIMATOR_FNS[name]
    adv, returns = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        config={"norm_adv_by_std_in_grpo": True},
        index=uids,
        **signals,
    )
    want = expected_token_advantages(rewards, mask, uids, signals, VERL_ESTIMATORS[name])
    torch.testing.assert_close(adv, want)
    assert returns is adv
    assert bool((adv[mask == 0] == 0).all())  # tool observations and padding get nothing
    # the same through the trainer's context instead of keyword arguments
    with gear_batch(GearBatch(signals=signals, response_mask=mask.bool())) as ctx:
        adv2, _ = fn(token_level_rewards=rewards, response_mask=mask, index=uids)
    torch.testing.assert_close(adv2, want)
    assert ctx.details is not None and "gear/mass_error" in ctx.details.stats


def test_estimator_errors_and_registration_without_verl():
    rewards, mask, uids, signals = verl_like_batch()
    with pytest.raises(
        ValueError, match=r"needs the per-token signals \['gear_kl', 'gear_entropy'\].*gear_sync"
    ):
        ESTIMATOR_FNS["gear"](token_level_rewards=rewards, response_mask=mask, index=uids)
    with pytest.raises(ValueError, match="gear_kl: expected the response mask's shape"):
        ESTIMATOR_FNS["gear"](
            token_level_rewards=rewards,
            response_mask=mask,
            index=uids,
            gear_kl=signals["gear_kl"][:, :5],
            gear_entropy=signals["gear_entropy"],
        )
    registry: dict = {}
    assert register_estimators(registry) == register_estimators(registry) == list(VERL_ESTIMATORS)
    assert registry == ESTIMATOR_FNS
    registry["gear"] = lambda **kw: None  # someone else's estimator under our name
    with pytest.raises(ValueError, match="'gear' is already registered"):
        register_estimators(registry)


# ------------------------------------------------------------------------------------- teacher inputs


def fake_render(messages, tools):
    """Deterministic 'chat template': one id per character of each message, 2..V-1."""
    ids = [1]
    for m in messages:
        ids += [2 + (ord(c) % (V - 2)) for c in f"<{m['role']}>{m['content']}"]
    if tools is not None:
        ids += [3] * (1 + len(tools))
    return [*ids, 1]


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


@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


def reference_signals(model, prompt, teacher_prompt, response, temperature):
    """Unpadded, one row at a time: logits at positions P-1 .. P+R-2 of each full sequence."""

    def logits(p):
        ids = torch.tensor([list(p) + list(response)])
        return model(input_ids=ids, use_cache=False).logits[
            :, len(p) - 1 : len(p) - 1 + len(response)
        ]

    with torch.no_grad():
        return signals_from_logits(
            logits(prompt),
            logits(teacher_prompt),
            torch.tensor([list(response)]),
            temperature=temperature,
        )


def tq_row(uid, prompt, response, mask, score, raw_prompt, ground_truth):
    """One rollout row as verl's TransferQueue holds it (the reward on the last token)."""
    rm = torch.zeros(len(response))
    rm[-1] = score
    return {
        "uid": uid,
        "prompts": torch.tensor(prompt),
        "responses": torch.tensor(response),
        "input_ids": torch.tensor(prompt + response),
        "position_ids": torch.arange(len(prompt) + len(response)),
        "response_mask": mask,
        "loss_mask": mask,
        "rm_scores": rm,
        "old_log_probs": torch.zeros(len(response)),
        "raw_prompt": raw_prompt,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
    }


def random_rows(seed, n=5):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(
            2, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g
        ).tolist()

    prompts = [ids(3, 9) for _ in range(n)]
    teachers = [p + ids(2, 6) for p in prompts]  # a longer prompt: the hint
    responses = [ids(1, 8) for _ in range(n)]
    return prompts, teachers, responses


# ------------------------------------------------------------------------------------- with verl


def test_registration_in_verl_idempotent_and_distinct():
    pytest.importorskip("verl")
    import importlib

    from verl.trainer.ppo import core_algos

    from gear.integrations.verl import estimators, plugin

    names = plugin.register(trainer=False)
    assert plugin.register(trainer=False) == names == list(VERL_ESTIMATORS)
    builtin = {e.value for e in core_algos.AdvantageEstimator}
    assert not set(names) & builtin
    for name in names:
        assert core_algos.get_adv_estimator_fn(name) is estimators.ESTIMATOR_FNS[name]
    fresh = importlib.reload(estimators)  # new function objects: still idempotent
    fresh.register_estimators()
    assert core_algos.get_adv_estimator_fn("gear") is fresh.ESTIMATOR_FNS["gear"]
    importlib.reload(estimators)
    plugin.register(trainer=False)


def test_verl_plugin_entry_point_in_a_fresh_process(tmp_path):
    """verl imports the ``verl.plugins`` entry point (as pyproject declares it) at `import verl`."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    dist = tmp_path / "gear_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gear-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\ngear = gear.integrations.verl.plugin\n")
    code = textwrap.dedent("""
        import verl
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
        from verl.trainer.ppo.v1 import get_trainer_cls
        print(sorted(k for k in ADV_ESTIMATOR_REGISTRY if k.startswith("gear")), get_trainer_cls("gear_sync").__name__)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{sorted(VERL_ESTIMATORS)} GearPPOTrainer" in out.stdout


def test_stock_compute_advantage_on_a_verl_batch():
    pytest.importorskip("verl")
    import numpy as np
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    register_estimators()
    rewards, mask, uids, signals = verl_like_batch()
    algo = OmegaConf.create({"adv_estimator": "gear", "norm_adv_by_std_in_grpo": True})

    def batch():
        return DataProto.from_dict(
            tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone()},
            non_tensors={"uid": np.array(uids, dtype=object)},
        )

    for name in ("gear", "gear_turn", "gear_rlsd", "gear_entropy_top"):
        with gear_batch(GearBatch(signals=signals, response_mask=mask.bool())):
            out = compute_advantage(batch(), adv_estimator=name, config=algo)
        want = expected_token_advantages(rewards, mask, uids, signals, VERL_ESTIMATORS[name])
        torch.testing.assert_close(out.batch["advantages"], want)
        torch.testing.assert_close(out.batch["returns"], want)
    with pytest.raises(ValueError, match="needs the per-token signals"):
        compute_advantage(batch(), adv_estimator="gear", config=algo)
    # gear_grpo is verl's GRPO (same epsilon) on the same batch
    with gear_batch(GearBatch(epsilon=1e-6)):
        ours = compute_advantage(batch(), adv_estimator="gear_grpo", config=algo).batch[
            "advantages"
        ]
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        rewards, mask, np.array(uids, dtype=object)
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def compose(name, overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides))


def test_example_configs_compose_and_validate():
    pytest.importorskip("verl")
    pytest.importorskip("hydra")
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    for name in ("qwen3_4b_gsm8k", "qwen3_4b_math", "qwen3_4b_tools_multiturn"):
        cfg = compose(name)
        s = validate_verl_config(cfg)
        assert (s.estimator, s.gear.ground_truth_field) == ("gear", "extra_info.ground_truth")
        validate_config(
            cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
        )
    math = compose("qwen3_4b_math")  # its own data and lengths over the shared settings
    assert math.data.train_files.endswith("gear_math/train.parquet")
    assert (math.data.max_response_length, math.actor_rollout_ref.model.path) == (
        4096,
        "Qwen/Qwen3-4B",
    )
    cfg = compose("qwen3_4b_tools_multiturn", ["algorithm.adv_estimator=gear_turn"])
    assert (
        cfg.actor_rollout_ref.rollout.multi_turn.enable
        and validate_verl_config(cfg).method == "turn"
    )
    with pytest.raises(GearConfigError, match=r"algorithm\.adv_estimator"):
        validate_verl_config(compose("qwen3_4b_gsm8k", ["algorithm.adv_estimator=grpo"]))


def test_launcher_validates_registers_and_runs_verl(monkeypatch):
    pytest.importorskip("verl")
    pytest.importorskip("hydra")
    pytest.importorskip("transfer_queue")
    from verl.trainer.main_ppo import TaskRunnerV1

    from gear.integrations.verl import main

    calls = []
    monkeypatch.setattr(
        main, "run_ppo", lambda config, task_runner_class: calls.append((config, task_runner_class))
    )
    cfg = compose("qwen3_4b_tools_multiturn", ["algorithm.adv_estimator=gear_rlsd"])
    main.run(cfg)
    ((config, runner),) = calls
    assert runner is main.GearTaskRunner
    assert issubclass(runner.__ray_actor_class__, TaskRunnerV1.__ray_actor_class__)
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == main.PLUGIN_MODULE
    main.add_plugin_env(config)  # idempotent
    assert env.VERL_USE_EXTERNAL_MODULES == main.PLUGIN_MODULE
    with pytest.raises(GearConfigError, match=r"trainer\.v1\.trainer_mode"):
        main.run(compose("qwen3_4b_gsm8k", ["trainer.v1.trainer_mode=sync"]))
    assert len(calls) == 1


# ---------------------------------------------------------------- trainer plumbing, fake worker


class FakeTQ:
    """An in-memory TransferQueue with the key-value calls verl's v1 trainer makes."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        for name in fields.keys():  # noqa: SIM118 (iterating a TensorDict gives rows)
            value = fields.get(name)
            if isinstance(value, NonTensorData):
                items = [value.data] * len(keys)
            elif isinstance(value, NonTensorStack):
                items = value.tolist()
            else:
                items = list(value.unbind()) if value.is_nested else list(value)
            for key, item in zip(keys, items, strict=True):
                self.rows.setdefault(key, {})[name] = item
        from transfer_queue import KVBatchMeta

        return KVBatchMeta(
            keys=list(keys), tags=tags or [{} for _ in keys], partition_id=partition_id
        )

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from tensordict import TensorDict
        from tensordict.tensorclass import NonTensorStack

        names = select_fields or list(self.rows[keys[0]])
        out = {}
        for name in names:
            if name not in self.rows[keys[0]]:
                continue
            items = [self.rows[k][name] for k in keys]
            if all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in items):
                out[name] = torch.nested.as_nested_tensor(items, layout=torch.jagged)
            elif all(isinstance(x, torch.Tensor) for x in items):
                out[name] = torch.stack(items)
            else:
                out[name] = NonTensorStack(*items)
        return TensorDict(out, batch_size=[len(keys)])


class FakeActorWorkerGroup:
    """Stands for verl's RayWorkerGroup: splits rows over 2 'ranks' and runs the real
    `GearActorRolloutRefWorker` (verl's TrainingWorker and engine on CPU) on each, as verl's tq
    bridge would: fetch the meta's fields, attach extra_info, write the outputs back."""

    def __init__(self, tq, module):
        self.tq, self.calls = tq, 0
        self.worker = gear_worker(module, True, True, max_token_len=256)
        self.asked: list[tuple[str, list | None, dict]] = []  # (method, fields, GEAR's options)

    def compute_log_prob(self, meta):
        self.calls += 1
        return self._run(meta, self.worker.compute_log_prob)

    def compute_gear_signals(self, meta):  # rollout correction's bypass mode
        return self._run(meta, self.worker.compute_gear_signals)

    def _run(self, meta, method):
        from verl.utils import tensordict_utils as tu

        options = {k: v for k, v in meta.extra_info.items() if k.startswith("gear_")}
        self.asked.append((method.__name__, meta.fields, options))
        half = (len(meta.keys) + 1) // 2
        for keys in (meta.keys[:half], meta.keys[half:]):
            td = self.tq.kv_batch_get(keys, meta.partition_id, meta.fields)
            tu.assign_non_tensor(td, **meta.extra_info)
            with verl_on_cpu():
                out = method(td)
            tensors = [k for k in out.keys() if isinstance(out.get(k), torch.Tensor)]  # noqa: SIM118
            self.tq.kv_batch_put(keys, meta.partition_id, out.select(*tensors))
        return meta


class BridgedActorWorkerGroup:
    """The real worker method behind verl's real tq bridge (its @register wraps it)."""

    def __init__(self, module):
        self.calls = 0
        self.worker = gear_worker(module, True, True, max_token_len=256)

    def compute_log_prob(self, meta):
        self.calls += 1
        with verl_on_cpu():
            return self.worker.compute_log_prob(meta)


def verl_old_log_prob(self, batch, metrics):
    """verl's v1 ``_compute_old_log_prob``, reduced to its call of the actor workers."""
    batch.extra_info.update({"calculate_entropy": True, "compute_loss": False, "temperature": 0.8})
    self.actor_rollout_wg.compute_log_prob(batch)
    return batch


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows):
        return [" ".join(map(str, r)) for r in rows]

    def decode(self, ids):
        return " ".join(map(str, ids))


def run_trainer_plumbing(tq, worker_group, model, monkeypatch, run_dir, partition="train"):
    """GEAR's trainer steps on 7 rows: 2 prompts x 3 sessions and one verl padding row.

    Row 1 is multi-turn (a tool observation, response_mask 0), row 4 has no ground truth (the
    teacher is the student). Checks the teacher prompts, the signals against an unpadded
    single-row forward, and the advantages against gear.credit on the same signals, where row 4
    has no teacher (spec §4): weight 1, its sequence advantage on every token, counted as the one
    fallback row (the padding row is not)."""
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import trainer as gear_trainer

    register_estimators()
    _, _, responses = random_rows(3, n=7)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)] + ["pad0_0_0"]
    uids = [k.split("_")[0] for k in keys]
    responses[1] = responses[1] + [7, 8, 9, 10, 11]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[1][2:4] = 0
    masks[-1] = torch.zeros(len(responses[-1]), dtype=torch.long)
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    raw = [[{"role": "user", "content": f"question {i}"}] for i in range(7)]
    student_prompts = [fake_render(m, None) for m in raw]
    rows = [
        tq_row(
            uids[i], student_prompts[i], responses[i], masks[i], scores[i], raw[i],
            None if i == 4 else f"answer {i}",
        )
        for i in range(7)
    ]  # fmt: skip
    tags = [{"status": "success"}] * 7
    tq.kv_batch_put(
        keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(rows), tags=tags
    )
    batch = KVBatchMeta(
        keys=keys, tags=[{}] * 6 + [{"is_padding": True}], partition_id=partition, extra_info={}
    )

    overrides = {
        "gear.teacher_micro_batch_size_per_gpu": 2,
        "gear.signal_chunk_size": 5,
        "gear.credit_log_steps": 1,
        "gear.credit_log_dir": str(run_dir),
    }
    config = OmegaConf.create({**verl_cfg(**overrides), "data": {"apply_chat_template_kwargs": {}}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render = fake_render
    trainer._gear_tool_schemas = {}
    trainer._gear_next_record_step = 0
    trainer.global_steps = 3
    trainer.tokenizer = Tok()
    trainer.processor = None
    trainer.actor_rollout_wg = worker_group
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)

    metrics: dict = {}
    assert trainer._compute_old_log_prob(batch, metrics) is batch  # verl's pass, then GEAR's
    assert worker_group.calls == 1
    assert metrics["gear/rows_without_ground_truth"] == 1.0

    names = ["gear_teacher_prompts", "gear_has_hint", "gear_scored", *SIGNAL_FIELDS.values()]
    got = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=names)
    # verl's padding row (reward 0, a group of its own: advantage 0) gets no teacher pass
    assert got["gear_scored"].tolist() == [True] * 6 + [False]
    cfg = trainer.gear_settings.gear
    for i in range(7):
        teacher_prompt = (
            student_prompts[i]
            if i == 6
            else build_teacher_prompts([rows[i]], [student_prompts[i]], cfg, fake_render).ids[0]
        )
        assert got["gear_teacher_prompts"][i].tolist() == teacher_prompt
        ref = reference_signals(model, student_prompts[i], teacher_prompt, responses[i], 0.8)
        for name, field in SIGNAL_FIELDS.items():
            want = getattr(ref, name)[0] * (i != 6)  # zeros for the skipped row
            torch.testing.assert_close(got[field][i], want, rtol=1e-4, atol=1e-5)
    assert float(got["gear_kl"][4].abs().max()) < 1e-5  # no hint: teacher = student
    assert got["gear_has_hint"].tolist() == [True] * 4 + [False, True, False]

    metrics = {}
    trainer._compute_advantage(batch, metrics)
    assert 0 <= metrics["gear/frac_tokens_in_segments"] <= 1 and "gear/mass_error" in metrics
    assert metrics["gear/rows_skipped"] == 0.0  # the padding row is not the batch's

    width = max(len(r) for r in responses)

    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r.float(), (0, width - len(r))) for r in rows])

    sig = {f: pad(list(got[f].unbind())) for f in SIGNAL_FIELDS.values()}
    for f in ("gear_kl", "gear_teacher_logprobs"):  # row 4 has no teacher: gear.credit's fallback
        sig[f][4] = torch.nan
    rewards = pad([r["rm_scores"] for r in rows])
    want = expected_token_advantages(rewards, pad(masks).long(), uids, sig, "gear")
    seq = grpo_advantages(rewards.sum(-1), uids)
    assert metrics["gear/fallback_rows"] == 1.0
    adv = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=["advantages"])[
        "advantages"
    ]
    for i in range(7):
        torch.testing.assert_close(adv[i], want[i, : len(responses[i])])
    assert bool((adv[1][masks[1] == 0] == 0).all())  # tool observation tokens: no credit
    assert bool((adv[6] == 0).all())  # verl's padding row
    torch.testing.assert_close(adv[4], seq[4].expand(len(responses[4])))  # weight 1 (GRPO)
    record = run_dir / "credit" / "step_000003.jsonl"
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["row"] for r in lines] == [0, 1, 2, 3] and lines[1]["valid"][2:4] == [False, False]
    return trainer


def test_trainer_plumbing_with_a_fake_worker(monkeypatch, tiny_lm, tmp_path):
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from verl.trainer.ppo.v1 import trainer_base

    from gear.integrations.verl import trainer as gear_trainer
    from gear.integrations.verl.worker import GearActorRolloutRefWorker

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer = run_trainer_plumbing(
        tq, FakeActorWorkerGroup(tq, tiny_lm), tiny_lm, monkeypatch, tmp_path
    )

    # the actor role runs GEAR's worker
    trainer.config = compose("qwen3_4b_gsm8k")
    trainer._init_resource_pool_mgr()
    actors = [
        getattr(c, "__ray_actor_class__", c)
        for r, c in trainer.role_worker_mapping.items()
        if "actor" in str(r).lower()
    ]
    assert actors == [GearActorRolloutRefWorker]


def test_contrast_runs_a_second_teacher_shown_a_wrong_answer(monkeypatch, tiny_lm):
    """teacher_context: contrast through GEAR's trainer and the real worker (fake TransferQueue):
    each row's contrast prompt shows a wrong answer (the numeric default: the answer plus a
    nonzero offset) in the answer template, its KL equals an unpadded oracle's, and the
    advantages are gear.credit's with `contrast_kl`."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    register_estimators()
    _, _, responses = random_rows(5, n=6)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)]
    uids = [k.split("_")[0] for k in keys]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    raw = [[{"role": "user", "content": f"question {i // 3}"}] for i in range(6)]
    student = [fake_render(m, None) for m in raw]
    answers = [str(10 + i // 3) for i in range(6)]
    rows = [
        tq_row(uids[i], student[i], responses[i], masks[i], scores[i], raw[i], answers[i])
        for i in range(6)
    ]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    batch = KVBatchMeta(keys=keys, tags=[{}] * 6, partition_id="train", extra_info={})
    config = OmegaConf.create(
        {
            **verl_cfg(**{"gear.teacher_context": "contrast", "gear.signal_chunk_size": 5}),
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render, trainer._gear_tool_schemas = fake_render, {}
    trainer._gear_next_record_step, trainer._gear_answer_pool = 0, []
    trainer.global_steps, trainer.tokenizer, trainer.processor = 1, Tok(), None
    trainer.actor_rollout_wg = FakeActorWorkerGroup(tq, tiny_lm)
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    trainer._compute_old_log_prob(batch, {})
    assert trainer.actor_rollout_wg.asked[0][2]["gear_contrast"] is True

    names = ["gear_teacher_prompts", "gear_contrast_prompts", "gear_contrast_kl", "gear_kl"]
    got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=names)

    def hinted(i, answer):
        hint = f"The final answer is {answer}."
        return fake_render([{"role": "user", "content": f"{raw[i][0]['content']}\n\n{hint}"}], None)

    for i in range(6):
        assert got["gear_teacher_prompts"][i].tolist() == hinted(i, answers[i])
        shown = [
            int(answers[i]) + d
            for d in (-3, -2, -1, 1, 2, 3)
            if hinted(i, int(answers[i]) + d) == got["gear_contrast_prompts"][i].tolist()
        ]
        assert len(shown) == 1  # a wrong answer, in the same template
        ref = reference_signals(tiny_lm, student[i], hinted(i, shown[0]), responses[i], 0.8)
        torch.testing.assert_close(got["gear_contrast_kl"][i], ref.kl[0], rtol=1e-4, atol=1e-5)

    metrics = {}
    trainer._compute_advantage(batch, metrics)
    width = max(len(r) for r in responses)

    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r.float(), (0, width - len(r))) for r in rows])

    fields = [*SIGNAL_FIELDS.values(), "gear_contrast_kl"]
    sig = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=fields)
    sig = {f: pad(list(sig[f].unbind())) for f in fields}
    rewards = pad([r["rm_scores"] for r in rows])
    want = token_advantages(
        grpo_advantages(rewards.sum(-1), uids),
        pad(masks).bool(),
        kl=sig["gear_kl"],
        entropy=sig["gear_entropy"],
        contrast_kl=sig["gear_contrast_kl"],
        params=CreditParams(contrast=True),
    )
    adv = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])
    for i in range(6):
        torch.testing.assert_close(adv["advantages"][i], want[i, : len(responses[i])])
    plain = token_advantages(
        grpo_advantages(rewards.sum(-1), uids),
        pad(masks).bool(),
        kl=sig["gear_kl"],
        entropy=sig["gear_entropy"],
        params=CreditParams(),
    )
    assert not torch.allclose(want, plain)  # the contrast changed the credit


def test_contrast_without_any_wrong_answer_in_the_training_files_fails_before_start(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    table = [{"prompt": "q", "reward_model": {"ground_truth": a}} for a in ("4", "seven", "8")]
    pq.write_table(pa.Table.from_pylist(table), path)
    cfg = verl_cfg(**{"data.train_files": str(path), "gear.teacher_context": "contrast"})
    assert answer_values("reward_model.ground_truth", [str(path)]) == ["4", "seven", "8"]
    assert validate_verl_config(cfg).params.contrast  # "seven" is shown "4" or "8"
    pq.write_table(pa.Table.from_pylist(table[1:2] * 3), path)
    with pytest.raises(GearConfigError, match=r"gear\.teacher_context='contrast': no wrong answer"):
        validate_verl_config(cfg)


@pytest.mark.skipif(
    os.environ.get("GEAR_TEST_RAY") != "1",
    reason="starts a local Ray + TransferQueue (~15 s); set GEAR_TEST_RAY=1",
)
def test_trainer_plumbing_with_a_real_transfer_queue(monkeypatch, tiny_lm, tmp_path):
    pytest.importorskip("verl")
    ray = pytest.importorskip("ray")
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        run_trainer_plumbing(tq, BridgedActorWorkerGroup(tiny_lm), tiny_lm, monkeypatch, tmp_path)
    finally:
        tq.close()
        ray.shutdown()


@pytest.mark.parametrize("bypass", [False, True], ids=["fused", "bypass"])
@pytest.mark.parametrize("estimator", ["gear_entropy_top", "gear_grpo"])
def test_a_method_without_a_teacher_builds_no_teacher_prompt_and_runs_no_teacher_forward(
    monkeypatch, tiny_lm, estimator, bypass
):
    """GEAR's trainer on 6 rows that all have a ground truth: for gear_entropy_top (the
    student's entropy alone) and gear_grpo (no signal) no teacher prompt is built or stored and
    no teacher forward runs; entropy_top's worker pass is told so (``gear_teacher=False``, no
    teacher-prompt field in bypass mode) and still writes the student's signals, which equal a
    plain forward's; gear_grpo leaves verl's pass as it is. The advantages are gear.credit's."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import teacher_pass
    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setattr(
        gear_trainer, "build_teacher_prompts", lambda *a, **k: pytest.fail("a teacher prompt")
    )
    monkeypatch.setattr(
        teacher_pass, "teacher_signals", lambda *a, **k: pytest.fail("a teacher forward ran")
    )
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    register_estimators()
    prompts, _, responses = random_rows(4, n=6)
    keys = [f"{u}_{s}_0" for u in ("uidA", "uidB") for s in range(3)]
    uids = [k.split("_")[0] for k in keys]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    rows = [
        tq_row(
            uids[i], prompts[i], responses[i], torch.ones(len(responses[i]), dtype=torch.long),
            scores[i], [{"role": "user", "content": f"question {i}"}], f"answer {i}",
        )
        for i in range(6)
    ]  # fmt: skip
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    batch = KVBatchMeta(keys=keys, tags=[{}] * 6, partition_id="train", extra_info={})
    config = OmegaConf.create({**verl_cfg(**{"algorithm.adv_estimator": estimator}), "data": {}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    if bypass:
        config.algorithm.rollout_correction = {"bypass_mode": True}
    config.actor_rollout_ref.rollout.update({"temperature": 0.8, "multi_turn": {}, "agent": {}})
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_next_record_step = 0
    trainer.global_steps = 1
    trainer.tokenizer, trainer.processor = Tok(), None
    trainer.actor_rollout_wg = group = FakeActorWorkerGroup(tq, tiny_lm)

    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    stored = set(tq.rows[keys[0]])
    assert not {"gear_teacher_prompts", "gear_has_hint"} & stored
    assert not {"gear/rows_without_ground_truth", "timing_s/gear_teacher_prompts"} & set(metrics)
    written = {name for name, field in SIGNAL_FIELDS.items() if field in stored}
    if estimator == "gear_grpo":
        assert written == set()
        assert group.asked == [("compute_log_prob", None, {})]  # verl's pass, nothing of GEAR's
    else:
        assert written == {"entropy", "student_logprobs"}
        gear_pass = group.asked[-1]
        assert gear_pass[0] == ("compute_gear_signals" if bypass else "compute_log_prob")
        assert gear_pass[2]["gear_teacher"] is False
        if bypass:
            assert "gear_teacher_prompts" not in gear_pass[1]
        got = tq.kv_batch_get(keys, "train", [SIGNAL_FIELDS[n] for n in written])
        for i in range(6):
            ref = reference_signals(tiny_lm, prompts[i], prompts[i], responses[i], 0.8)
            for name in written:
                torch.testing.assert_close(
                    got[SIGNAL_FIELDS[name]][i], getattr(ref, name)[0], rtol=1e-4, atol=1e-5
                )

    trainer._compute_advantage(batch, metrics)
    width = max(len(r) for r in responses)

    def pad(values):
        return torch.stack(
            [torch.nn.functional.pad(v.float(), (0, width - len(v))) for v in values]
        )

    mask = pad([r["response_mask"] for r in rows]).long()
    signals = {f: torch.zeros(6, width) for f in SIGNAL_FIELDS.values()}  # read by neither method
    for name in written:
        signals[SIGNAL_FIELDS[name]] = pad(list(got[SIGNAL_FIELDS[name]].unbind()))
    method = VERL_ESTIMATORS[estimator]
    want = expected_token_advantages(
        pad([r["rm_scores"] for r in rows]), mask, uids, signals, method
    )
    adv = tq.kv_batch_get(keys, "train", ["advantages"])["advantages"]
    for i in range(6):
        torch.testing.assert_close(adv[i], want[i, : len(responses[i])])


# ---------------------------------------------------------------- no teacher work on tied rows

#: 3 prompts, interleaved (so that the teacher forwards group other rows with the skip on than
#: off): uidA mixed (a session of two outputs, tool tokens), uidB tied at 1 (a session of two
#: outputs whose first, non-final output scored 0.3: only final outputs enter GRPO), uidC tied at
#: 0, and one verl padding row; the uidA rows carry advantage, the others do not
SKIP_KEYS = [
    "uidA_0_0", "uidB_0_0", "uidC_0_0", "uidA_1_0", "uidB_1_0", "uidA_1_1",
    "uidC_1_0", "uidB_1_1", "uidA_2_0", "uidB_2_0", "uidC_2_0", "padX_0_0",
]  # fmt: skip
SKIP_SCORES = [1.0, 1.0, 0.0, 0.0, 0.3, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
SKIP_SCORED = [k.startswith("uidA") for k in SKIP_KEYS]


def run_with_skip(
    monkeypatch, model, run_dir, estimator, skip, bypass=False, context=None, teacher_rows=1
):
    """GEAR's trainer (fake TransferQueue, the real worker on 2 'ranks') on the SKIP_KEYS rows,
    `teacher_rows` rows per teacher forward. Returns the per-row advantages, the metrics, the
    stored rows, the row counts of every teacher forward and of every student forward of GEAR's
    own, and the credit record."""
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from gear.integrations.verl import teacher_pass
    from gear.integrations.verl import trainer as gear_trainer

    tq = FakeTQ()
    monkeypatch.setattr(gear_trainer, "tq", tq)
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setattr(trainer_sync.PPOTrainerSync, "_compute_old_log_prob", verl_old_log_prob)
    forwards: dict[str, list[int]] = {"teacher": [], "student": []}
    for name, who in (("teacher_signals", "teacher"), ("forward_hidden", "student")):
        real = getattr(teacher_pass, name)
        real = getattr(real, "__wrapped__", real)  # an earlier run's counter

        def counted(module, seqs, *a, _real=real, _who=who, **k):
            forwards[_who].append(len(seqs))
            return _real(module, seqs, *a, **k)

        counted.__wrapped__ = real
        monkeypatch.setattr(teacher_pass, name, counted)
    register_estimators()
    n = len(SKIP_KEYS)
    _, _, responses = random_rows(7, n=n)
    responses[3] = responses[3] + [7, 8, 9, 10]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[3][1:3] = 0  # tool output
    raw = [[{"role": "user", "content": f"question {k[3]}"}] for k in SKIP_KEYS]
    prompts = [fake_render(m, None) for m in raw]
    rows = [
        tq_row(
            k.split("_")[0], prompts[i], responses[i], masks[i], SKIP_SCORES[i], raw[i],
            str(10 + ord(k[3]) % 7),
        )
        for i, k in enumerate(SKIP_KEYS)
    ]  # fmt: skip
    tq.kv_batch_put(keys=SKIP_KEYS, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    tags = [{}] * (n - 1) + [{"is_padding": True}]
    batch = KVBatchMeta(keys=list(SKIP_KEYS), tags=tags, partition_id="train", extra_info={})
    overrides = {
        "algorithm.adv_estimator": estimator,
        "gear.skip_zero_advantage_rows": skip,
        "gear.signal_chunk_size": 5,
        "gear.teacher_micro_batch_size_per_gpu": teacher_rows,
        "gear.credit_log_steps": 1,
        "gear.credit_log_rows": n,
        "gear.credit_log_dir": str(run_dir),
    }
    if context:
        overrides["gear.teacher_context"] = context
    config = OmegaConf.create({**verl_cfg(**overrides), "data": {"apply_chat_template_kwargs": {}}})
    config.algorithm.update({"use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0})
    if bypass:
        config.algorithm.rollout_correction = {"bypass_mode": True}
    config.actor_rollout_ref.rollout.update(
        {"temperature": 0.8, "n": 3, "multi_turn": {}, "agent": {}}
    )
    trainer = object.__new__(gear_trainer.GearPPOTrainer)
    trainer.config = config
    trainer.gear_settings = validate_verl_config(config)
    trainer._gear_render, trainer._gear_tool_schemas = fake_render, {}
    trainer._gear_next_record_step, trainer._gear_answer_pool = 0, []
    trainer.global_steps, trainer.tokenizer, trainer.processor = 2, Tok(), None
    trainer.actor_rollout_wg = FakeActorWorkerGroup(tq, model)
    metrics: dict = {}
    trainer._compute_old_log_prob(batch, metrics)
    trainer._compute_advantage(batch, metrics)
    adv = list(tq.kv_batch_get(SKIP_KEYS, "train", ["advantages"])["advantages"].unbind())
    record = run_dir / "credit" / "step_000002.jsonl"
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return adv, metrics, tq.rows, forwards, lines


@pytest.mark.parametrize(
    ("estimator", "bypass", "context"),
    [
        ("gear", False, None),
        ("gear_token", False, None),
        ("gear_rlsd", False, None),
        ("gear_departure", True, None),
        ("gear_turn", False, "contrast"),
    ],
)
def test_tied_rows_get_no_teacher_work_and_the_advantages_are_bit_identical(
    monkeypatch, tiny_lm, tmp_path, estimator, bypass, context
):
    """gear.skip_zero_advantage_rows: rows whose GRPO sequence advantage is 0 (tied groups, a
    session of a tied group, verl's padding row), decided before the old-log-prob pass from
    verl's rewards and uids, get no teacher or contrast forward (nor GEAR's own student forward
    in bypass mode) and zero signals; the token advantages equal the unskipped run's bit for
    bit; gear/rows_skipped counts the batch's skipped rows; the credit record marks them.

    Bit for bit needs a row's signals not to depend on the rows it shares a teacher forward and
    a kernel chunk with: one row per teacher forward here. With several, the skip changes the
    company, which moves the signals by float rounding, as changing
    gear.teacher_micro_batch_size_per_gpu does (next test)."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    on = run_with_skip(monkeypatch, tiny_lm, tmp_path / "on", estimator, True, bypass, context)
    off = run_with_skip(monkeypatch, tiny_lm, tmp_path / "off", estimator, False, bypass, context)
    adv_on, metrics_on, stored_on, forwards_on, record_on = on
    adv_off, metrics_off, stored_off, forwards_off, record_off = off
    for a, b in zip(adv_on, adv_off, strict=True):
        assert torch.equal(a, b)  # bit-identical
    assert all(bool(a.ne(0).any()) == s for a, s in zip(adv_on, SKIP_SCORED, strict=True))
    assert [bool(stored_on[k]["gear_scored"]) for k in SKIP_KEYS] == SKIP_SCORED
    assert "gear_scored" not in stored_off[SKIP_KEYS[0]]
    assert metrics_on["gear/rows_skipped"] == 7.0 and metrics_off["gear/rows_skipped"] == 0.0
    # teacher forwards: the 4 advantaged rows only, one per forward
    passes = 2 if context == "contrast" else 1
    assert forwards_on["teacher"] == [1] * 4 * passes
    assert forwards_off["teacher"] == [1] * len(SKIP_KEYS) * passes
    assert sum(forwards_on["student"]) == (4 if bypass else 0)
    for k, s in zip(SKIP_KEYS, SKIP_SCORED, strict=True):  # zero signals, no work
        assert "gear_teacher_prompts" in stored_on[k]  # built for every row
        for field in SIGNAL_FIELDS.values():
            assert bool(stored_on[k][field].eq(0).all()) != s
    assert [r.get("skipped", False) for r in record_on] == [not s for s in SKIP_SCORED[:-1]]
    assert all(r["kl"][0] is None for r in record_on if r.get("skipped"))
    assert not any(r.get("skipped") for r in record_off)
    for a, b in zip(record_on, record_off, strict=True):
        assert a["token_advantage"] == b["token_advantage"]


def test_with_several_rows_per_teacher_forward_the_skip_agrees_to_float_rounding(
    monkeypatch, tiny_lm, tmp_path
):
    """Groups of 2 rows per teacher forward: the skip regroups the advantaged rows (fewer
    forwards), which moves their signals by float rounding; gear_token's weights are continuous
    in the KL, so the advantages agree to that rounding."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    on = run_with_skip(monkeypatch, tiny_lm, tmp_path / "on", "gear_token", True, teacher_rows=2)
    off = run_with_skip(monkeypatch, tiny_lm, tmp_path / "off", "gear_token", False, teacher_rows=2)
    assert sum(on[3]["teacher"]) == 4 and sum(off[3]["teacher"]) == len(SKIP_KEYS)
    assert len(on[3]["teacher"]) < len(off[3]["teacher"])
    for a, b in zip(on[0], off[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_skip_is_off_where_a_method_reads_every_row_or_the_reward_changes_later(
    monkeypatch, tiny_lm, tmp_path
):
    """gear_entropy_top ranks every row of the batch, and with algorithm.use_kl_in_reward the
    reward (hence the ties) is known only after the pass: both score every row."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    _, metrics, stored, _, _ = run_with_skip(
        monkeypatch, tiny_lm, tmp_path, "gear_entropy_top", True
    )
    assert "gear_scored" not in stored[SKIP_KEYS[0]] and metrics["gear/rows_skipped"] == 0.0
    assert all(bool(stored[k]["gear_entropy"].ne(0).any()) for k in SKIP_KEYS)
    cfg = verl_cfg(**{"algorithm.use_kl_in_reward": True})
    assert validate_verl_config(verl_cfg()).skips_tied_rows
    assert not validate_verl_config(cfg).skips_tied_rows
    off = verl_cfg(**{"gear.skip_zero_advantage_rows": False})
    assert not validate_verl_config(off).skips_tied_rows
    with pytest.raises(GearConfigError, match=r"gear\.skip_zero_advantage_rows.*true or false"):
        validate_verl_config(verl_cfg(**{"gear.skip_zero_advantage_rows": "yes"}))


def test_the_estimator_refuses_a_skipped_row_that_carries_advantage():
    """If the rewards changed after the tie decision, the estimator says so instead of leaving
    a row with advantage unscored."""
    rewards, mask, uids, signals = verl_like_batch(0)
    scored = torch.ones(rewards.shape[0], dtype=torch.bool)
    scored[0] = False
    with pytest.raises(ValueError, match=r"gear_scored: .* gear\.skip_zero_advantage_rows=false"):
        ESTIMATOR_FNS["gear"](
            token_level_rewards=rewards, response_mask=mask, index=uids, gear_scored=scored,
            **signals,
        )  # fmt: skip


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


# ------------------------------------------------------------------------------------- data, tools


def test_data_rows_reward_and_tools(tmp_path):
    from gear.integrations.verl.data import verl_rows, write_parquet
    from gear.integrations.verl.rewards import compute_score

    rows = verl_rows("tools", "train", n=4)
    path = write_parquet(rows, tmp_path / "train.parquet")
    check_ground_truth_field("extra_info.ground_truth", [str(path)])
    with pytest.raises(GearConfigError, match="has no field 'solution'"):
        check_ground_truth_field("extra_info.solution", [str(path)])
    row = rows[0]
    assert row["agent_name"] == "tool_agent" and row["data_source"] == "gear/tools"
    answer = row["reward_model"]["ground_truth"]
    assert (
        compute_score(row["data_source"], f"<tool_call>x</tool_call>\nAnswer: {answer}", answer)
        == 1.0
    )
    assert compute_score(row["data_source"], "Answer: -1", answer) == 0.0

    pytest.importorskip("verl")
    from gear.integrations.verl.tools import GearCalculatorTool, GearLookupTool

    state = json.loads(row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["state"])

    async def run():
        lookup, calc = GearLookupTool({"type": "native"}), GearCalculatorTool({"type": "native"})
        assert (lookup.name, calc.name) == ("lookup", "calculator")
        results = []
        if state:
            item, count = next(iter(state.items()))
            iid, _ = await lookup.create(create_kwargs={"state": json.dumps(state)})
            results.append(((await lookup.execute(iid, {"item": item}))[0].text, str(count)))
            await lookup.release(iid)
        iid, _ = await calc.create(create_kwargs={})
        results.append(((await calc.execute(iid, {"expression": "12 * (3 + 4)"}))[0].text, "84"))
        return results

    for got, want in asyncio.run(run()):
        assert got == want


def test_every_registered_credit_method_is_a_verl_estimator():
    """The verl estimator names come from the credit registry, one per method, none of them
    verl's own ("grpo"): a method registered in gear.credit needs no second list."""
    from gear.credit import METHODS

    assert sorted(VERL_ESTIMATORS.values()) == sorted(METHODS)
    assert all(name.startswith("gear") for name in VERL_ESTIMATORS)
    assert VERL_ESTIMATORS["gear_grpo"] == "grpo" and VERL_ESTIMATORS["gear_turn"] == "turn"

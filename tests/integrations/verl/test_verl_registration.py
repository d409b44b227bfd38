"""GEAR in verl itself (pytest.importorskip): registration in verl's registry (idempotent,
distinct names, the ``verl.plugins`` entry point in a fresh interpreter), verl's stock
``compute_advantage`` on a DataProto built like verl's, the example Hydra configs and the
launcher.

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _verl_helpers import ROOT, compose, expected_token_advantages, verl_like_batch
from gear.integrations.verl.config import VERL_ESTIMATORS, GearConfigError, validate_verl_config
from gear.integrations.verl.estimators import GearBatch, gear_batch, register_estimators


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

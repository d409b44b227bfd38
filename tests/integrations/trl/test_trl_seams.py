"""The trainer's seams: the private methods tests and scripts patch are documented (trainer.py's
module docstring, docs/trl.md "Seams"), exist on `GEARTrainer`, and a patch of one reaches what
the trainer computes, because the batch orchestration calls each through `self`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import gear.integrations.trl.trainer as trainer_module
from _trl_helpers import byte_tokenizer, dataset, make_trainer
from gear.integrations.trl import GEARTrainer

ROOT = Path(__file__).resolve().parents[3]


def _names(text: str) -> set[str]:
    return set(re.findall(r"`(_[a-z][a-z_]*)`", text))


def _docstring_seams() -> set[str]:
    doc = trainer_module.__doc__ or ""
    return _names(doc[doc.index("Seams:") :])


def _docs_seams() -> set[str]:
    text = (ROOT / "docs" / "trl.md").read_text()
    section = text[text.index("\n## Seams\n") :]
    end = section.find("\n## ", 1)
    return _names(section if end < 0 else section[:end])


def _patched_in_tests() -> set[str]:
    """Private trainer methods some test replaces: `setattr(obj, "_name", ...)` or
    `trainer._name = ...`, kept where `GEARTrainer` has a method of that name."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r"setattr\(\s*[\w.]+,\s*\"(_[a-z]\w*)\"", text))
        found |= set(re.findall(r"\btrainer\.(_[a-z]\w*)\s*=(?!=)", text))
    return {name for name in found if callable(getattr(GEARTrainer, name, None))}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _advantages(trainer) -> torch.Tensor:
    """(B, T) token advantages of one generation batch, generated from a fixed seed."""
    inputs = [dict(row) for row in dataset(2) for _ in range(trainer.args.num_generations)]
    trainer.model.train()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(inputs)["advantages"]


def test_every_documented_seam_is_a_method_of_the_trainer():
    seams = _docstring_seams()
    assert {"_teacher_pass", "_final_hidden", "_credit", "_token_signals"} <= seams
    assert seams == _docs_seams()  # the module and the user docs list the same seams
    missing = sorted(name for name in seams if not callable(getattr(GEARTrainer, name, None)))
    assert missing == []


def test_every_method_a_test_patches_is_a_documented_seam():
    patched = _patched_in_tests()
    assert "_teacher_pass" in patched  # the scan found the patches (test_teacher_skip's)
    assert patched - _docstring_seams() == set()


def test_a_patched_teacher_pass_reaches_the_signals_and_the_advantages(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, prefix_sharing=False, skip_zero_advantage_rows=False)
    plain = _advantages(trainer)
    assert torch.equal(plain, _advantages(trainer))  # the batch is reproducible
    real, teachers, calls = trainer._teacher_pass, [], []
    real_signals = trainer._signals
    trainer._teacher_pass = lambda *a: calls.append(a) or torch.zeros_like(real(*a))
    trainer._signals = lambda s, t, ids, **k: teachers.append(t) or real_signals(s, t, ids, **k)
    patched = _advantages(trainer)
    assert len(calls) == 1 and all(float(t.abs().max()) == 0.0 for t in teachers)
    assert not torch.equal(plain, patched)  # a uniform teacher gives other KLs, other weights


def test_a_patch_on_the_class_reaches_the_teacher_forward(tmp_path, tok, monkeypatch):
    trainer = make_trainer(tmp_path, tok, skip_zero_advantage_rows=False)
    seen, built = [], []
    real, real_inputs = GEARTrainer._final_hidden, trainer._teacher_inputs
    monkeypatch.setattr(
        GEARTrainer,
        "_final_hidden",
        lambda self, m, ids, *a, **k: seen.append((m, ids)) or real(self, m, ids, *a, **k),
    )
    trainer._teacher_inputs = lambda *a: built.append(real_inputs(*a)) or built[-1]
    _advantages(trainer)
    assert len(built) == 1
    teacher_ids = built[0][0]
    assert any(m is trainer._teacher() and torch.equal(ids, teacher_ids) for m, ids in seen)


def test_a_patched_credit_sets_the_token_advantages(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, prefix_sharing=False)
    plain = _advantages(trainer)
    real = trainer._credit

    def doubled(*args, **kwargs):
        details = real(*args, **kwargs)
        return dataclasses.replace(details, token_advantages=2 * details.token_advantages)

    trainer._credit = doubled
    torch.testing.assert_close(_advantages(trainer), 2 * plain, rtol=0, atol=0)


def test_the_oar_kernel_is_looked_up_in_the_trainer_module(tmp_path, tok, monkeypatch):
    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(tmp_path, tok, data=data, credit_method="oar_g", prefix_sharing=False)
    plain = _advantages(trainer)
    calls = []

    def constant(forwards, model, ids, *args):
        calls.append(ids.shape[0])
        return torch.ones(ids.shape, dtype=torch.float32)

    monkeypatch.setattr(trainer_module, "answer_influence", constant)
    patched = _advantages(trainer)
    assert calls and not torch.equal(plain, patched)

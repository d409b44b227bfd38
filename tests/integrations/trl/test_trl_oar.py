"""OAR-G through GEARTrainer: a step needs no teacher and no ground truth (nor does its
shape-matched placebo), its answer span comes from the answer parser or the appended reference
(rows without one counted), and the influence of a left-padded batch equals a plain per-row
full-logit oracle of phi under the raw logits (the authors', not the sampling temperature's)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import yaml

from _trl_helpers import byte_tokenizer, dataset, make_trainer, parameters, tiny_model
from gear.credit.attribution import answer_span
from gear.integrations.trl.forwards import Forwards, answer_influence, answer_perturbation
from gear.modeling import LogitConventions


def test_oar_g_trains_without_a_teacher_or_a_ground_truth(tmp_path):
    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(tmp_path, data=data, credit_method="oar_g", credit_oar_answer_len=3)
    assert trainer.credit_params.oar_answer_len == 3
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logs = trainer.state.log_history[0]
    assert logs["gear/time_influence"] > 0 and logs["gear/fallback_rows"] == 0
    assert 0 <= logs["gear/oar_span_fallback"] <= 4  # rows without a number in them


@pytest.mark.parametrize(("found", "fallback"), [((0, 1), 0.0), (None, 4.0)])
def test_rows_whose_answer_is_not_found_are_counted(tmp_path, found, fallback):
    """The task's parser (`answer_span=`) places the span; rows where it finds nothing fall back
    to the last k tokens and are counted in gear/oar_span_fallback (4 rows in the batch)."""
    seen = []

    def locate(text):
        seen.append(text)
        return found if text else None

    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(
        tmp_path, data=data, credit_method="oar_g", answer_span=locate, max_completion_length=4
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    assert len(seen) == 4 and logs["gear/oar_span_fallback"] == fallback


def test_the_reference_is_appended_the_authors_way(tmp_path):
    """`credit_oar_span='reference'`: the answer column's value, as `reference_text` writes it,
    follows each completion; the step trains and no row falls back."""
    texts = []

    def reference_text(answer):
        texts.append(answer)
        return f" {answer}"

    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(
        tmp_path, data=data, credit_method="oar_g", credit_oar_span="reference",
        reference_text=reference_text,
    )  # fmt: skip
    before = parameters(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in parameters(trainer.model).items())
    assert len(texts) == 4 and set(texts) <= set(dataset()["answer"])  # each row's own
    assert trainer.state.log_history[0]["gear/oar_span_fallback"] == 0


def test_the_reference_way_needs_the_answer_column(tmp_path):
    data = dataset().remove_columns(["answer"])
    with pytest.raises(ValueError, match="answer_column='answer', which the dataset does not"):
        make_trainer(tmp_path, data=data, credit_method="oar_g", credit_oar_span="reference")


def test_oar_gs_placebo_trains_without_a_teacher_or_a_ground_truth(tmp_path):
    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(
        tmp_path, data=data, credit_method="random_shape", credit_shape_method="oar_g"
    )
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logs = trainer.state.log_history[0]
    assert logs["gear/time_influence"] > 0 and "gear/time_teacher" not in logs
    assert logs["gear/fallback_rows"] == 0


def test_influence_of_a_padded_batch_equals_a_per_row_oracle():
    tok = byte_tokenizer()
    model = tiny_model(tok).eval()
    g = torch.Generator().manual_seed(0)
    B, P, T, k, temperature = 3, 5, 6, 2, 0.7
    ids = torch.randint(3, 200, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[1, :2] = 0  # left-padded prompt
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[2, 4:] = False  # completion ends early: its span is columns 2, 3
    span = answer_span(valid, k)
    span[0] = False
    span[0, 1:4] = True  # a parsed answer inside the completion, 3 tokens
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, autocast=nullcontext)
    forwards = Forwards(accelerator, LogitConventions(), temperature, "full", 1, 64, False)
    got = answer_influence(forwards, model, ids, mask, span, batch_size=2)

    def oracle(i, temperature):
        keep = mask[i].bool()
        row = ids[i][keep][None]
        cols = span[i].nonzero().flatten() + (row.shape[1] - T)  # columns in the row
        e = model.get_input_embeddings()(row).detach().requires_grad_(True)
        logp = torch.log_softmax(model(inputs_embeds=e).logits[0].float() / temperature, -1)
        phi = logp[cols - 1, row[0, cols]].mean()
        (grad,) = torch.autograd.grad(phi, e)
        return (grad * e).sum(-1).abs()[0, -T:].detach()

    for i in range(B):
        # phi from the raw logits (the authors'): the sampling temperature is not applied
        torch.testing.assert_close(got[i], oracle(i, 1.0), atol=1e-6, rtol=1e-4)
        assert not torch.allclose(got[i], oracle(i, temperature), atol=1e-4, rtol=1e-3)
    assert torch.all(got[0, 3:] == 0)  # the last span token and what follows cannot move phi


# ----------------------------------------------------------------------------- OAR-P


@pytest.mark.parametrize(
    "options",
    [{}, {"credit_oar_span": "reference", "credit_oar_pfinal": "last"}],
    ids=["answer_joint", "reference-last"],
)
def test_oar_p_trains_without_a_teacher_on_its_scored_rows_only(tmp_path, monkeypatch, options):
    """`oar_p`: a step needs no teacher and no ground truth; its masked-copy pass runs on the
    rows with a non-zero advantage only (the tied group's rows are skipped) and the weights
    change the parameters."""
    import gear.integrations.trl.trainer as trainer_module
    from gear.testing import tied_reward

    seen = []

    def recorded(*args, **kwargs):
        seen.append((args[2].shape[0], args[7]))  # rows, oar_pfinal
        return answer_perturbation(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "answer_perturbation", recorded)
    data = dataset().remove_columns(["ground_truth"])
    trainer = make_trainer(tmp_path, data=data, credit_method="oar_p",
                           reward_funcs=tied_reward(0.5), **options)  # fmt: skip
    before = parameters(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in parameters(trainer.model).items())
    logs = trainer.state.log_history[0]
    assert logs["gear/time_influence"] > 0 and "gear/time_teacher" not in logs
    assert logs["gear/fallback_rows"] == 0
    skipped = logs["gear/rows_skipped"]
    assert seen == [(4 - skipped, options.get("credit_oar_pfinal", "answer_joint"))]


@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("mode", ["answer_joint", "answer_mean", "last"])
def test_perturbation_of_a_padded_batch_equals_the_authors_loop(sharing, mode):
    """The TRL pass (`answer_perturbation`: unwrapped model, chunks of masked copies with or
    without the shared prefix) on a left-padded batch equals the authors' rule, one masked copy
    and one full forward at a time, from the raw logits (not the sampling temperature's)."""
    from gear.credit.attribution import tokens_before
    from gear.testing import perturbation_loop

    tok = byte_tokenizer()
    model = tiny_model(tok, layers=2).eval()
    g = torch.Generator().manual_seed(0)
    B, P, T = 3, 5, 8
    ids = torch.randint(3, 200, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[1, :2] = 0  # left-padded prompt
    mask[2, P + 6 :] = 0  # completion ends early
    span = torch.zeros(B, T, dtype=torch.bool)
    span[0, 5:7], span[1, 6:], span[2, 4:6] = True, True, True
    scored = tokens_before(span, mask[:, P:].bool())
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, autocast=nullcontext)
    forwards = Forwards(accelerator, LogitConventions(), 0.7, "full", 1, 64, sharing)
    got = answer_perturbation(forwards, model, ids, mask, span, scored, 2, mode, 30)
    for i in range(B):
        at = (mask[i].cumsum(0) - 1)[-T:]
        want = perturbation_loop(model, ids[i][mask[i].bool()].tolist(),
                                 at[scored[i]].tolist(), at[span[i]].tolist(), 2, mode)  # fmt: skip
        torch.testing.assert_close(got[i][scored[i]].double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-6)  # fmt: skip
        assert torch.all(got[i][~scored[i]] == 0)


def test_gear_train_runs_oar_p(tmp_path):
    """`gear train --method oar_p`: the task's answer parser places the span, a step trains
    and logs the masked-copy pass's time."""
    from typer.testing import CliRunner

    from gear.app.cli import app
    from gear.testing import save_tiny_model, tiny_run_args

    model = save_tiny_model(tmp_path / "tiny", vocab="bytes")
    out = tmp_path / "run"
    args = ["train", "--method", "oar_p", "--model", str(model), "--output-dir", str(out),
            "--steps", "1", "--set", "credit_oar_pfinal=answer_mean", *tiny_run_args(eval_n=0)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["gear/time_influence"] > 0 and "gear/time_teacher" not in step
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["credit_method"] == "oar_p"

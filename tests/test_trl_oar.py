"""OAR-G through GEARTrainer: a step needs no teacher and no ground truth (nor does its
shape-matched placebo), and the influence of a left-padded batch equals a plain per-row
full-logit oracle."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from _trl_helpers import byte_tokenizer, dataset, make_trainer, parameters, tiny_model
from gear.integrations.trl.forwards import Forwards, answer_influence
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
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, autocast=nullcontext)
    forwards = Forwards(accelerator, LogitConventions(), temperature, "full", 1, 64, False)
    got = answer_influence(forwards, model, ids, mask, valid, k, batch_size=2)
    for i in range(B):
        keep = mask[i].bool()
        row = ids[i][keep][None]
        span = valid[i].nonzero().flatten()[-k:] + (row.shape[1] - T)  # columns in the row
        e = model.get_input_embeddings()(row).detach().requires_grad_(True)
        logp = torch.log_softmax(model(inputs_embeds=e).logits[0].float() / temperature, -1)
        phi = logp[span - 1, row[0, span]].mean()
        (grad,) = torch.autograd.grad(phi, e)
        ref = (grad * e).sum(-1).abs()[0, -T:]
        torch.testing.assert_close(got[i], ref.detach(), atol=1e-6, rtol=1e-4)

"""GEAR's signal passes in TRL: the LM-head projections follow the run's precision (issue 29)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gear.credit.signals import signals_from_hidden
from gear.integrations.trl.forwards import Forwards
from gear.modeling.model import LogitConventions


class Head(nn.Module):
    def __init__(self, V: int, H: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.5)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def forwards(mixed_precision: str) -> Forwards:
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, mixed_precision=mixed_precision)
    return Forwards(accelerator, LogitConventions(), 1.0, "full", 64, 7, False)


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_signal_projections_run_in_the_runs_precision_and_reduce_in_float32(mixed_precision):
    torch.manual_seed(0)
    model = Head(V=300, H=16)
    hs, ht = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    ids = torch.randint(0, 300, (2, 9))
    got = forwards(mixed_precision).signals(model, None, hs, ht, ids)
    w = model.lm_head.weight
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    want = signals_from_hidden(hs.to(dtype), ht.to(dtype), w.to(dtype), ids, chunk_size=7)
    for name in ("kl", "entropy", "student_logprobs", "teacher_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    exact = signals_from_hidden(hs, ht, w, ids, chunk_size=7)  # float32 projections
    torch.testing.assert_close(got.kl, exact.kl, atol=0.05, rtol=0.02)

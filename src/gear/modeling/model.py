"""A causal LM as GEAR reads it: backbone, LM head, captured final hidden states, logit rules.

A `*ForCausalLM` computes logits = conventions(head(h)) from the final hidden states h (B, L, H)
of its backbone. GEAR never asks for (B, L, V) logits: a forward hook on the backbone keeps the
h it needs, and `gear.credit.signals` applies the head and the conventions chunk by chunk. The
backbone is transformers' own `get_decoder()`: the module the causal LM calls (Llama: `model`;
OPT: `model.decoder`, which `OPTForCausalLM` calls directly, bypassing `model`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / DeepSpeed / FSDP1 (`.module`), `torch.compile`
    (`._orig_mod`) and PEFT (`get_base_model()`) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    if hasattr(model, "get_base_model"):  # PEFT (and TRL's adapter teacher, which delegates)
        model = model.get_base_model()
    return model


def backbone(model: nn.Module) -> nn.Module:
    """The module whose output is the final (normed) hidden state the LM head reads."""
    model = unwrap(model)
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return model.base_model


def lm_head(model: nn.Module) -> nn.Module:
    """The LM head (a hook on it runs while FSDP1 holds its full weight)."""
    head = unwrap(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(unwrap(model)).__name__} has no output embeddings (LM head)")
    while isinstance(getattr(head, "module", None), nn.Module):  # FSDP1 wraps the head
        head = head.module
    return head


def takes_position_ids(model: nn.Module) -> bool:
    """Whether the model's forward (its class's, not a per-instance patch) names `position_ids`."""
    params = inspect.signature(type(unwrap(model)).forward).parameters
    return "position_ids" in params


@contextmanager
def capture_final_hidden(
    model: nn.Module, keep: Callable[[Tensor], Tensor]
) -> Iterator[list[Tensor]]:
    """While open, every backbone forward of `model` appends `keep(h)` to the yielded list,
    h (B, L, H) its final hidden states. `keep` should copy what it keeps (`h[:, -1:].clone()`)
    so that the whole output is freed."""
    captured: list[Tensor] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured.append(keep(h))

    body = backbone(model)
    handle = body.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def only_capture(captured: list[Tensor], model: nn.Module) -> Tensor:
    """The last capture of one forward, or a clear error if the backbone never ran."""
    if not captured:
        raise RuntimeError(
            f"{type(unwrap(model)).__name__}'s forward did not call its backbone "
            f"{type(backbone(model)).__name__} (`get_decoder()`): no final hidden states"
        )
    return captured[-1]


# ----------------------------------------------------------------------------------- logits


def logit_scale(text_config: Any) -> float:
    """The factor s a model multiplies its logits by: Cohere `logit_scale`, `output_multiplier`,
    Falcon-H1 `lm_head_multiplier`; Granite divides by `logits_scaling` (HyperCLOVA X multiplies)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def logit_softcap(text_config: Any) -> float | None:
    """The final-logit softcap c (Gemma 2/3: logits <- c * tanh(logits / c)), or None."""
    value = getattr(text_config, "final_logit_softcapping", None)
    return float(value) if value else None


@dataclass(frozen=True)
class LogitConventions:
    """How a model turns its LM head's output z = h W^T + b into logits:
    softcap(scale * z), softcap(x) = c * tanh(x / c) when `softcap` is c, else x."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> LogitConventions:
        """The conventions declared by `model`'s (text) config."""
        config = unwrap(model).config.get_text_config()
        return cls(scale=logit_scale(config), softcap=logit_softcap(config))

    def signal_kwargs(self, temperature: float) -> dict[str, Any]:
        """`temperature` and `softcap` for `gear.credit.signals`, which compute
        softmax(softcap(z) / temperature): the scale folds into the temperature,
        softmax(scale * z / T) = softmax(z / (T / scale))."""
        if self.softcap is not None and self.scale != 1.0:
            raise NotImplementedError(
                "a model with both final_logit_softcapping and a logit scale is not supported "
                "(the scale sits inside the softcap; the signal kernels take no scale)"
            )
        return {"temperature": temperature / self.scale, "softcap": self.softcap}

"""No-grad forwards of a PEFT LoRA model at the cost of the plain model's forward.

An unmerged LoRA layer runs its base linear and then x -> B(A(dropout(x))) * scale, a few small
ops per layer: on gear train's recipe (SmolLM2-135M, rank 16, every linear) the teacher pass of
a LoRA policy cost 1.29x the same model's plain forward per token (BENCHMARKS). Merging the
adapter into the base weights (peft's `merge_adapter`) removes that, but changes the trained
base weights in place, and `unmerge_adapter` subtracts again: W + d - d is not W in floating
point, so every step would drift the frozen weights.

`merged_lora(model)` instead gives each plain LoRA linear, for the duration of its own forward,
a fresh tensor W + B A * scale (float32 sum, cast to W's dtype) in place of W, and with
`lora_bias` b + b_B * scale in place of the base bias b, and puts their own storage back right
after: one layer's merged weight exists at a time, and the weights are untouched bit for bit.
The forward's result equals the unmerged one's up to the rounding of the merged sum (float32:
~1e-6; bf16: bf16 rounding); tests/modeling/test_lora_merge.py checks this for each variant peft offers.
Layers it cannot merge exactly run unmerged as before, decided at each forward: DoRA and the
other LoRA variants, `lora_bias` over a base without a bias, LoRA dropout in training mode,
disabled adapters, rows naming their own adapters (`adapter_names`), non-`nn.Linear` bases
(GPT-2's Conv1D, embeddings, quantised 4-bit / 8-bit), sharded weights (DeepSpeed ZeRO-3, FSDP),
layers already merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def _mergeable(layer: nn.Module) -> bool:
    """Whether `layer`'s forward, as it stands now, equals one linear with merged weights: a
    plain (vanilla) peft LoRA `Linear` over an unsharded float `nn.Linear`, unmerged, adapters
    enabled, no LoRA dropout in training mode (random: merging would drop it) and, where an
    adapter has a bias (`lora_bias`), a base bias to merge it into."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    if type(layer) is not LoraLinear or layer.merged or layer.disable_adapters:
        return False
    base = layer.get_base_layer()
    weight = getattr(base, "weight", None)
    if type(base) is not nn.Linear or not isinstance(weight, Tensor):
        return False
    sharded = hasattr(weight, "ds_id") or hasattr(weight, "full_tensor") or weight.is_meta
    if sharded or not weight.is_floating_point():
        return False
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    variants = getattr(layer, "lora_variant", {})
    if not active or any(a in variants for a in active):
        return False
    if base.bias is None and any(layer.lora_B[a].bias is not None for a in active):
        return False
    dropout = [layer.lora_dropout[a] for a in active]
    return not any(d.training and not isinstance(d, nn.Identity) for d in dropout)


def _merged(layer: nn.Module, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The base linear's weight (out, in) and bias (out,) or None with every active adapter
    merged in: W + B A * scale (transposed for fan_in_fan_out), b + b_B * scale (`lora_bias`:
    lora_B's own bias, which the unmerged forward scales with B A x), each summed in float32
    and cast back to its dtype."""
    total = weight.float()
    total_bias = None if bias is None else bias.float()
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a = layer.lora_A[name].weight.float()
        b = layer.lora_B[name].weight.float()
        delta = b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        total = total + delta.to(total.device) * layer.scaling[name]
        b_bias = layer.lora_B[name].bias
        if b_bias is not None:  # _mergeable saw to it that the base has a bias
            total_bias = total_bias + b_bias.float().to(total.device) * layer.scaling[name]
    return total.to(weight.dtype), None if bias is None else total_bias.to(bias.dtype)


def _restore(layer: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    base = layer.get_base_layer()
    base.weight.data = weight
    if bias is not None:
        base.bias.data = bias
    layer._disable_adapters = False


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[int]:
    """Within the block, no-grad forwards of `model` run each mergeable LoRA linear as one
    linear with merged weights (see the module docstring). Yields the number of such layers
    on entry (0: nothing changes, e.g. no PEFT; each forward checks again). Refuses to run with gradients enabled, which would
    differentiate through the swapped weights."""
    if torch.is_grad_enabled():
        raise RuntimeError("merged_lora: for no-grad forwards only; use torch.no_grad()")
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = ()
    if not isinstance(model, PeftModel):
        # not a PEFT model itself: a plain model, or a wrapper that runs the policy its own way
        # (gear's AdapterTeacher disables or swaps the adapter inside its forward, and peft's
        # `disable_adapter` would not re-enable layers it found disabled)
        yield 0
        return
    layers = [m for m in model.modules() if _mergeable(m)]
    swapped: dict[nn.Module, tuple[Tensor, Tensor | None]] = {}
    per_row: list[bool] = []  # per model call: rows name their own adapters
    handles: list[Any] = []

    def call(model: nn.Module, args: Any, kwargs: dict) -> None:
        # peft routes each row through its own adapters (`adapter_names`), unmerged
        per_row.append(kwargs.get("adapter_names") is not None)

    def called(model: nn.Module, args: Any, output: Any) -> None:
        per_row.pop()

    def before(layer: nn.Module, args: Any) -> None:
        # checked at each forward: the block may disable adapters, switch modes, etc.
        if (per_row and per_row[-1]) or not _mergeable(layer):
            return
        base = layer.get_base_layer()
        bias = None if base.bias is None else base.bias.data
        swapped[layer] = (base.weight.data, bias)
        base.weight.data, merged_bias = _merged(layer, base.weight.data, bias)
        if merged_bias is not None:
            base.bias.data = merged_bias
        layer._disable_adapters = True  # the base linear alone (now merged) runs

    def after(layer: nn.Module, args: Any, output: Any) -> None:
        if layer in swapped:
            _restore(layer, *swapped.pop(layer))

    try:
        handles.append(model.register_forward_pre_hook(call, with_kwargs=True))
        handles.append(model.register_forward_hook(called, always_call=True))
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(before))
            handles.append(layer.register_forward_hook(after, always_call=True))
        yield len(layers)
    finally:
        for handle in handles:
            handle.remove()
        for layer, original in swapped.items():  # a safety net: `after` runs even on a raise
            _restore(layer, *original)

"""No-grad forwards of a PEFT LoRA model at the cost of the plain model's forward.

An unmerged LoRA layer runs its base linear and then x -> B(A(dropout(x))) * scale, a few small
ops per layer: on gear train's recipe (SmolLM2-135M, rank 16, every linear) the teacher pass of
a LoRA policy cost 1.29x the same model's plain forward per token (BENCHMARKS). Merging the
adapter into the base weights (peft's `merge_adapter`) removes that, but changes the trained
base weights in place, and `unmerge_adapter` subtracts again: W + d - d is not W in floating
point, so every step would drift the frozen weights.

`merged_lora(model)` instead gives each plain LoRA linear, for the duration of its own forward,
a fresh tensor W + B A * scale (float32 sum, cast to W's dtype) in place of W, and puts W's own
storage back right after: one layer's merged weight exists at a time, and the weights are
untouched bit for bit. The forward's result equals the unmerged one's up to the rounding of
the merged sum (float32: ~1e-6; bf16: bf16 rounding).
Layers it cannot merge exactly run unmerged as before: DoRA and other LoRA variants, quantised
(4-bit / 8-bit) bases, sharded weights (DeepSpeed ZeRO-3, FSDP), layers already merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def _mergeable(layer: nn.Module) -> bool:
    """A plain (vanilla) peft LoRA `Linear` over an unsharded float `nn.Linear`, unmerged."""
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
    return bool(active) and not any(a in variants for a in active)


def _merged_weight(layer: nn.Module, weight: Tensor) -> Tensor:
    """W + sum over active adapters of (B A) * scale (transposed for fan_in_fan_out), summed in
    float32 and cast to W's dtype. (out, in)."""
    total = weight.float()
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a = layer.lora_A[name].weight.float()
        b = layer.lora_B[name].weight.float()
        delta = b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        total = total + delta.to(total.device) * layer.scaling[name]
    return total.to(weight.dtype)


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[int]:
    """Within the block, no-grad forwards of `model` run each mergeable LoRA linear as one
    linear with merged weights (see the module docstring). Yields the number of such layers
    (0: nothing changes, e.g. no PEFT). Refuses to run with gradients enabled, which would
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
    swapped: dict[nn.Module, Tensor] = {}
    handles: list[Any] = []

    def before(layer: nn.Module, args: Any) -> None:
        weight = layer.get_base_layer().weight
        swapped[layer] = weight.data
        weight.data = _merged_weight(layer, weight.data)

    def after(layer: nn.Module, args: Any, output: Any) -> None:
        layer.get_base_layer().weight.data = swapped.pop(layer)

    try:
        for layer in layers:
            layer._disable_adapters = True  # the base linear alone (now merged) runs
            handles.append(layer.register_forward_pre_hook(before))
            handles.append(layer.register_forward_hook(after))
        yield len(layers)
    finally:
        for handle in handles:
            handle.remove()
        for layer, original in swapped.items():  # a forward that raised left these merged
            layer.get_base_layer().weight.data = original
        for layer in layers:
            layer._disable_adapters = False

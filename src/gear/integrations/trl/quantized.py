"""A QLoRA policy (bitsandbytes 4-bit base) on an AVX512-BF16 CPU: keep gradients flowing.

bitsandbytes 0.50 (`Linear4bit.forward`) repacks a layer's 4-bit weight into a CPU-specific
layout (`_convert_weight_packed_for_cpu`: `quant_state.packing_format_for_cpu`, absmax in
bfloat16) the first time the layer runs in eval mode on an input without gradient, on a CPU with
AVX512-BF16 (`Linear4bit.support_avx512bf16_for_cpu`). From then on every forward, training
included, goes through `gemv_4bit`, which has no autograd kernel: the gradient through the layer
is silently zero (PyTorch only warns "bitsandbytes::gemv_4bit: an autograd kernel was not
registered"). GEAR runs such passes on the policy itself (the teacher pass of a PEFT teacher is
the policy with its adapter disabled or swapped, eval-mode student forwards), so after the first
batch no LoRA adapter before a 4-bit layer would learn: measured on the tiny QLoRA test model,
`grad_norm` 0 at every step. AVX2 CPUs and GPUs never take that path.

`keep_4bit_layers_trainable(model)` turns the repacking off for the policy's 4-bit layers and
puts an already repacked weight back into the standard layout (bitsandbytes' own inverse, which
it runs itself before saving a state dict). A separate frozen teacher is left alone: it is never
trained, so the fast inference layout is right for it.
"""

from __future__ import annotations

import sys

from torch import nn


def keep_4bit_layers_trainable(model: nn.Module) -> int:
    """Turn bitsandbytes' CPU inference repacking off for every `Linear4bit` of `model` (see the
    module docstring). Returns how many layers had it on. bitsandbytes is not imported here: a
    model holding its layers has imported it already."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return 0
    changed = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            unpack = getattr(bnb.functional, "_convert_weight_packed_for_cpu_inverse", None)
            if unpack is None:
                raise RuntimeError(
                    "a 4-bit layer of the policy was repacked for CPU inference before training "
                    "(gradients through it would be zero) and this bitsandbytes cannot undo it; "
                    "pass the model before running it in eval mode"
                )
            weight.data, weight.quant_state = unpack(weight.data, state)
    return changed

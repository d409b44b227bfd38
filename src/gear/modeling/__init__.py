"""What gear knows about models, in one framework-neutral layer (transformers + torch only).

Every GEAR signal starts from a causal LM's *final hidden states* (the LM head's input) and its
LM head; the integrations (TRL's states and teacher pass, verl's teacher pass, the shared-prefix
forward) take all of it from here:

- `model`: `unwrap` (DDP / DeepSpeed / FSDP1 / compile / PEFT), `backbone` (the module whose
  output is the final hidden state), `lm_head`, `capture_final_hidden` (one forward hook), and
  `LogitConventions` (how head outputs become logits: logit scale, final-logit softcap).
- `positions`: `position_ids` that make a row's states independent of its padding, and whether
  a shared-prefix forward is exact for a model's position scheme (`prefix_sharing_blocker`).
"""

from gear.modeling.model import (
    LogitConventions,
    backbone,
    capture_final_hidden,
    lm_head,
    logit_scale,
    logit_softcap,
    takes_position_ids,
    unwrap,
)
from gear.modeling.positions import padding_free_positions, prefix_sharing_blocker

__all__ = [
    "LogitConventions",
    "backbone",
    "capture_final_hidden",
    "lm_head",
    "logit_scale",
    "logit_softcap",
    "padding_free_positions",
    "prefix_sharing_blocker",
    "takes_position_ids",
    "unwrap",
]

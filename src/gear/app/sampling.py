"""Sampling for evaluation: each prompt's completions drawn from their own seeds.

`sample` decodes with a KV cache like `model.generate`, with three differences that evaluation
needs:

- **Noise fixed per (prompt seed, sample, position).** Sample j of a prompt with seed s takes
  the argmax of `logits / T + Gumbel(U)`, U drawn from a generator seeded by (s, j) (the
  Gumbel-max trick: an exact draw from softmax(logits / T)). The same problem, evaluated by two
  models or at two time points, uses the same uniforms whatever else is in the batch, so their
  difference is not swamped by sampling noise (common random numbers).
- **Each prompt is prefilled once** and its cache repeated for its k samples (`generate`
  prefills every copy).
- **A finished row leaves the batch** (the cache keeps only unfinished rows), so a batch costs
  what its rows generate, not k x its longest row.

T = 0 is greedy decoding (no noise). Tokens after the first eos are not produced; the eos is not
part of the returned ids.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

#: What evaluation draws and scores, as a number: bump it when `sample`'s draws, `gear.app.evaluate`
#: or a task's `is_correct` change, so cached before-training scores
#: (`gear.app.evaluate.eval_cache_key`) are not reused. tests/app/test_sampling.py pins the draws of this version.
EVAL_VERSION = 1


def row_seed(prompt_seed: int, sample: int) -> int:
    """The seed of sample `sample` of a prompt whose seed is `prompt_seed` (a 63-bit hash)."""
    digest = hashlib.blake2b(f"{prompt_seed}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def text_seed(text: str, seed: int = 0) -> int:
    """A prompt's seed from its text and an evaluation seed: fixed per problem, whatever the
    batch, the order or the model."""
    digest = hashlib.blake2b(f"{seed}/{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def sample(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    seeds: list[int],
    *,
    k: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
) -> list[list[list[int]]]:
    """Completion token ids, `k` per prompt: out[i][j] is sample j of prompts[i].

    Args:
        prompts: P prompt texts (already chat-templated; no special tokens are added).
        seeds: P prompt seeds (`text_seed`); sample j of prompt i uses `row_seed(seeds[i], j)`.
        temperature: T > 0 samples from softmax(logits / T); T = 0 is greedy (then k must be 1).
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: expected one per prompt ({len(prompts)}), got {len(seeds)}")
    if k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k}")
    if temperature <= 0 and k > 1:
        raise ValueError("k > 1 needs temperature > 0 (greedy decoding repeats itself)")
    if not prompts:
        return []
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in enc)
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc], device=device)  # left pad
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    cache, logits = out.past_key_values, out.logits[:, -1].float()  # (P, V)
    if k > 1:  # every sample of a prompt continues from the prompt's one prefill
        cache.batch_repeat_interleave(k)
        logits, mask = logits.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
        positions = positions.repeat_interleave(k, 0)
    rows = len(prompts) * k
    generators = []
    for i in range(rows):
        g = torch.Generator(device="cpu")
        g.manual_seed(row_seed(seeds[i // k], i % k))
        generators.append(g)
    eos = _eos_ids(tokenizer)
    done: list[list[int]] = [[] for _ in range(rows)]
    active = torch.arange(rows)  # the rows still generating, in cache order
    position = positions[:, -1:]  # (A, 1) position of each active row's last token
    for _ in range(max_new_tokens):
        if temperature > 0:
            uniforms = torch.stack(
                [torch.rand(logits.shape[-1], generator=generators[r]) for r in active.tolist()]
            ).to(logits.device)
            gumbel = -torch.log(-torch.log(uniforms.clamp(1e-20, 1.0 - 1e-7)))
            tokens = (logits / temperature + gumbel).argmax(-1)
        else:
            tokens = logits.argmax(-1)
        finished = torch.tensor([t in eos for t in tokens.tolist()], device=tokens.device)
        for r, t, f in zip(active.tolist(), tokens.tolist(), finished.tolist(), strict=True):
            if not f:
                done[r].append(t)
        keep = (~finished).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < active.numel():  # finished rows leave the batch and the cache
            cache.batch_select_indices(keep)
            active, mask, position = active[keep.cpu()], mask[keep], position[keep]
            tokens = tokens[keep]
        mask = torch.cat([mask, mask.new_ones(len(keep), 1)], dim=-1)
        position = position + 1
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    return [done[i * k : (i + 1) * k] for i in range(len(prompts))]


def _eos_ids(tokenizer: Any) -> set[int]:
    eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list | tuple) else {eos}

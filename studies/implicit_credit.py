"""Where credit can matter (issue 67, item 1): the credit GRPO already assigns through shared
prefixes, measured with no training on the regimes a headroom study could use. Run from the
repository root; each regime is kept once measured (resumable).

    python -m studies.implicit_credit measure --regime recipe      # one regime (REGIMES)
    python -m studies.implicit_credit measure                      # every regime not yet kept
    python -m studies.implicit_credit table                        # -> docs table + JSON

Per regime: PROMPTS test problems x GROUP samples at the regime's temperature, scored by the
task's reward; GRPO's advantages per group; the arithmetic checker's first wrong token (its
default form) where the mix is solved in steps; the teacher's signals under the worked-solution
hint (the `math` template holding the row's ground truth). `gear.credit.implicit` then gives the
prefix tree's statistics, and for every method of the headroom family the sum of its token
advantages on shared prefix nodes beside GRPO's. Results: studies/results/implicit_credit.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from gear.evidence import head_commit, write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "studies" / "results" / "implicit_credit.json"
RUNS = ROOT / "runs" / "implicit_credit"
PROMPTS, GROUP, MAX_NEW_TOKENS, PROMPTS_PER_CALL = 24, 8, 96, 4
SHARP = dict(modulation="exp", beta=5.0, w_min=0.0, w_max=100.0)
#: name -> (model, arithmetic mix, temperature); models: the base, issue 51's SFT checkpoint
#: (step 32), the same SFT run stopped at step 16
REGIMES = {
    "recipe": ("base", "1digit:0.8,2digit:0.2", 0.7),
    "sft32-T0.7": ("sft32", "chain:1", 0.7),
    "sft32-T1.0": ("sft32", "chain:1", 1.0),
    "sft16-T0.7": ("sft16", "chain:1", 0.7),
    "sft16-T1.0": ("sft16", "chain:1", 1.0),
}
#: the headroom family (issue 67, item 4): name -> (method, params, KL signal)
METHODS = {
    "lambda_grpo": ("lambda_grpo", {}, None),
    "first_error": ("first_error", SHARP, None),
    "gear_token_k1": ("gear_token", {}, "k1"),
    "gear": ("gear", {}, "full"),
}


def model_path(name: str) -> str:
    """The base model's name, or the SFT adapter directory (rebuilt where missing)."""
    if name == "base":
        return "smollm2"
    if name == "sft32":
        from studies import headroom

        path = headroom.checkpoint_dir(0)
        if not (path / "adapter_model.safetensors").is_file():
            headroom.restore()
        return str(path)
    step = int(name.removeprefix("sft"))
    path = RUNS / f"sft{step}-seed0"
    if not (path / "adapter_model.safetensors").is_file():
        from studies import after_format

        model, tok, _ = after_format.train_sft(0, step, log=lambda m: print(m, flush=True))
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def measure(regime: str) -> dict[str, Any]:
    """One regime's statistics (module docstring)."""
    from gear.credit import CreditParams, credit_details, signals_from_hidden
    from gear.credit.implicit import implicit_credit_stats, prefix_counts
    from gear.gym.train import group_advantages
    from gear.models import load_model_and_tokenizer
    from gear.spans import error_token_mask
    from gear.tasks.arithmetic import ArithmeticTask
    from studies import onpolicy

    name, mix, temperature = REGIMES[regime]
    t0, commit = time.time(), head_commit(ROOT)
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(model_path(name), dtype=torch.float32)
    model.eval()
    task = ArithmeticTask(mix=mix)
    rows = task.dataset("test", n=PROMPTS, seed=0)
    ids_rows, groups, rewards, truths, kl, k1, ent = [], [], [], [], [], [], []
    lm = model.get_output_embeddings()
    for k in range(0, PROMPTS, PROMPTS_PER_CALL):
        part = list(range(k, min(k + PROMPTS_PER_CALL, PROMPTS)))
        torch.manual_seed(1000 + part[0])
        prompts = [onpolicy.render(tok, rows[j]["prompt"]) for j in part]
        sampled = onpolicy.sample_groups(model, tok, prompts, GROUP, MAX_NEW_TOKENS, temperature)
        for j, group in zip(part, sampled, strict=True):
            row = rows[j]
            hs = onpolicy.completion_hidden(model, prompts[j - part[0]], group)
            teacher = onpolicy.teacher_ids(tok, row["prompt"], row["ground_truth"])
            ht = onpolicy.completion_hidden(model, teacher, group)
            T = hs.shape[1]
            ids = torch.zeros(len(group), T, dtype=torch.long)
            mask = torch.zeros(len(group), T, dtype=torch.bool)
            for b, r in enumerate(group):
                ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), True
            sig = signals_from_hidden(
                hs, ht, lm.weight, ids, lm_head_bias=lm.bias, mask=mask, chunk_size=128,
                temperature=temperature,
            )  # fmt: skip
            for b, r in enumerate(group):
                n = len(r)
                ids_rows.append(r)
                groups.append(j)
                text = tok.decode(r, skip_special_tokens=True)
                rewards.append(float(task.is_correct(text, row["answer"])))
                truths.append(row["ground_truth"])
                kl.append(sig.kl[b, :n])
                k1.append((sig.student_logprobs - sig.teacher_logprobs)[b, :n])
                ent.append(sig.entropy[b, :n])
        print(f"{regime}: {part[-1] + 1}/{PROMPTS} prompts, {time.time() - t0:.0f} s", flush=True)
    N, T = len(ids_rows), max(map(len, ids_rows))
    ids = torch.full((N, T), int(tok.pad_token_id), dtype=torch.long)
    mask = torch.zeros(N, T, dtype=torch.bool)
    pad = {name: torch.zeros(N, T, dtype=torch.float64) for name in ("kl", "k1", "entropy")}
    for i, r in enumerate(ids_rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        for key, src in (("kl", kl), ("k1", k1), ("entropy", ent)):
            pad[key][i, : len(r)] = src[i].double()
    group_ids = torch.tensor(groups)
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, GROUP)
    adv = group_advantages(r.view(-1), GROUP)
    checker = task.step_checker()
    error = None if checker is None else error_token_mask(tok, ids, mask, checker, truths) & mask
    counts = prefix_counts(ids, mask, group_ids)
    out: dict[str, Any] = {
        "regime": regime, "model": name, "mix": mix, "temperature": temperature,
        "prompts": PROMPTS, "group": GROUP, "max_new_tokens": MAX_NEW_TOKENS,
        "pass_rate": float(r.mean()), "mixed_groups": float((r.std(1) > 0).float().mean()),
        "mean_tokens": float(mask.sum(1).double().mean()),
        "checker": checker is not None,
        "grpo": implicit_credit_stats(ids, mask, mask, group_ids, adv, None, error),
    }  # fmt: skip
    if error is not None:
        failed = adv < 0
        out["failed_rows"], out["placed"] = int(failed.sum()), int((failed & error.any(1)).sum())
    for label, (method, params, signal) in METHODS.items():
        if method == "first_error" and error is None:
            continue
        d = credit_details(
            adv, mask, kl=None if signal is None else pad["kl" if signal == "full" else "k1"],
            entropy=pad["entropy"], error_mask=error, prefix_count=counts.double(),
            params=CreditParams(method=method, **params),
        )  # fmt: skip
        stats = implicit_credit_stats(ids, mask, mask, group_ids, adv, d.token_advantages)
        out[label] = {k: v for k, v in stats.items() if k.startswith("gear/shared_sum")}
    out.update(
        wall_s=time.time() - t0, commit=commit, threads=torch.get_num_threads(),
        capability=torch.backends.cpu.get_cpu_capability(),
    )  # fmt: skip
    return out


def gym_regime() -> dict[str, Any]:
    """The credit gym's regime: its default task, model and warm start, GROUP rollouts of
    PROMPTS held-out problems at T 1.0; the first wrong token is exact (one right solution)."""
    from gear.credit import CreditParams, credit_details
    from gear.credit.implicit import implicit_credit_stats, prefix_counts
    from gear.gym.model import ModelConfig, WarmStart, build_model, cache_dir, sample, warm_start
    from gear.gym.task import ChainTask
    from gear.gym.train import error_token_or_step, eval_problems, group_advantages

    t0, commit = time.time(), head_commit(ROOT)
    torch.set_num_threads(1)
    task, cfg = ChainTask(), ModelConfig()
    state, _ = warm_start(task, cfg, WarmStart(), cache=cache_dir(), log=print)
    model = build_model(cfg, task)
    model.load_state_dict(state)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    problems = eval_problems(task, PROMPTS).repeat_interleave(GROUP, dim=0)
    with torch.no_grad():
        comp = sample(model, task.prompts(problems), task.completion_len, gen, 1.0)
    rewards = task.rewards(problems, comp)
    adv = group_advantages(rewards, GROUP).double()
    mask = torch.ones_like(comp, dtype=torch.bool)
    error = error_token_or_step(task, problems, comp, "token")
    group_ids = torch.arange(len(comp)) // GROUP
    r = rewards.view(-1, GROUP)
    out: dict[str, Any] = {
        "regime": "gym", "model": "gym warm start", "mix": f"chain length {task.length}",
        "temperature": 1.0, "prompts": PROMPTS, "group": GROUP,
        "pass_rate": float(r.mean()), "mixed_groups": float((r.std(1) > 0).float().mean()),
        "mean_tokens": float(comp.shape[1]), "checker": True,
        "failed_rows": int((adv < 0).sum()), "placed": int(((adv < 0) & error.any(1)).sum()),
        "grpo": implicit_credit_stats(comp, mask, mask, group_ids, adv, None, error),
    }  # fmt: skip
    counts = prefix_counts(comp, mask, group_ids)
    for label, method, params in (("lambda_grpo", "lambda_grpo", {}),
                                  ("first_error", "first_error", SHARP)):  # fmt: skip
        d = credit_details(
            adv, mask, error_mask=error, prefix_count=counts.double(),
            params=CreditParams(method=method, **params),
        )  # fmt: skip
        stats = implicit_credit_stats(comp, mask, mask, group_ids, adv, d.token_advantages)
        out[label] = {k: v for k, v in stats.items() if k.startswith("gear/shared_sum")}
    out.update(wall_s=time.time() - t0, commit=commit,
               capability=torch.backends.cpu.get_cpu_capability())  # fmt: skip
    return out


#: the rule's regime choice (docs/evidence/2026-12-02-headroom2-rule.md): candidates, eligibility
CANDIDATES = ("sft32-T0.7", "sft32-T1.0", "sft16-T0.7", "sft16-T1.0")
MIN_ROWS, MIN_MIXED, PASS_BAND, TIE = 30, 0.5, (0.15, 0.85), 0.10


def excess_blame(r: dict[str, Any]) -> float:
    """The rule's score: mean tokens from branch point to first error over the placed failed
    rows with a successful sibling, 0 for an error at or before its branch point."""
    g = r["grpo"]
    after, gap = g.get("gear/branch_error_after"), g.get("gear/branch_to_error_tokens")
    if after is None or after != after:
        return float("nan")
    return after * gap if after > 0 else 0.0


def eligible(r: dict[str, Any]) -> bool:
    return (
        r["grpo"].get("gear/branch_rows", 0) >= MIN_ROWS
        and r["mixed_groups"] >= MIN_MIXED
        and PASS_BAND[0] <= r["pass_rate"] <= PASS_BAND[1]
    )


def choose_regime(data: dict[str, Any]) -> dict[str, Any]:
    """The rule's choice among `CANDIDATES` (all must be measured)."""
    regs = {n: data["regimes"][n] for n in CANDIDATES}
    ok = {n: excess_blame(r) for n, r in regs.items() if eligible(r)}
    if not ok:
        best = max(regs, key=lambda n: regs[n]["mixed_groups"])
        return {"regime": best, "eligible": [], "why": "none eligible: the most mixed groups"}
    top = max(ok.values())
    near = [n for n, v in ok.items() if v >= (1 - TIE) * top]
    # ties: T 1.0 first, then the earlier SFT step
    pick = sorted(near, key=lambda n: (REGIMES[n][2] != 1.0, REGIMES[n][0] != "sft16"))[0]
    return {"regime": pick, "eligible": sorted(ok), "scores": ok, "within_tie": near}


def kept() -> dict[str, Any]:
    return json.loads(OUT.read_text()) if OUT.is_file() else {"regimes": {}}


def table(data: dict[str, Any]) -> str:
    """The markdown table of every kept regime, a column each."""
    names = [n for n in [*REGIMES, "gym"] if n in data["regimes"]]
    regs = [data["regimes"][n] for n in names]

    def cell(v: Any, fmt: str = "{:.3f}") -> str:
        return "n/a" if v is None or v != v else fmt.format(v)

    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, get: Any, fmt: str = "{:.3f}") -> None:
        lines.append(f"| {label} | " + " | ".join(cell(get(r), fmt) for r in regs) + " |")

    row("temperature", lambda r: r["temperature"], "{:.1f}")
    row("pass rate", lambda r: r["pass_rate"])
    row("groups GRPO learns from (mixed rewards)", lambda r: r["mixed_groups"])
    row("mean completion tokens", lambda r: r["mean_tokens"], "{:.1f}")
    row("tokens on a prefix shared by >= 2 rows", lambda r: r["grpo"]["gear/prefix_shared_frac"])
    row(
        "rows sharing a token's prefix (mean)",
        lambda r: r["grpo"]["gear/prefix_rows_mean"],
        "{:.2f}",
    )
    row("failed rows (A < 0)", lambda r: r.get("failed_rows"), "{:.0f}")
    row("... placed by the checker", lambda r: r.get("placed"), "{:.0f}")
    row("... with a successful sibling", lambda r: r["grpo"].get("gear/branch_rows"), "{:.0f}")
    for rel in ("before", "at", "after"):
        row(
            f"first error {rel} the branch point",
            lambda r, rel=rel: r["grpo"].get(f"gear/branch_error_{rel}"),
        )
    row("excess blame tokens per failed row (the rule's score)", excess_blame, "{:.2f}")
    row(
        "tokens from branch point to error (after)",
        lambda r: r["grpo"].get("gear/branch_to_error_tokens"),
        "{:.1f}",
    )
    row("GRPO's mean abs sum on shared nodes", lambda r: r["grpo"]["gear/shared_sum_abs_grpo"])
    for label in METHODS:
        row(
            f"{label}: change of that sum (relative)",
            lambda r, m=label: r.get(m, {}).get("gear/shared_sum_diff"),
        )
    row("wall s", lambda r: r["wall_s"], "{:.0f}")
    return "\n".join(lines)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.implicit_credit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--regime", choices=[*REGIMES, "gym"], action="append")
    sub.add_parser("table")
    sub.add_parser("choose")
    args = ap.parse_args(argv)
    if args.cmd == "choose":
        print(choose_regime(kept()))
        return
    data = kept()
    if args.cmd == "measure":
        for regime in args.regime or [*REGIMES, "gym"]:
            if regime in data["regimes"]:
                print(f"{regime}: kept", flush=True)
                continue
            result = gym_regime() if regime == "gym" else measure(regime)
            data = kept()  # another process may have kept a regime meanwhile
            data["regimes"][regime] = result
            write_json(OUT, data)
            print(f"{regime}: kept ({result['wall_s']:.0f} s)", flush=True)
    print(table(kept()))


if __name__ == "__main__":
    main()

"""ARCHIVED (issue 38): issue 28's real-LM comparison of credit methods, retired because its
regime (full fine-tuning at lr 1e-5, no warmup) never learned -- every arm, GRPO included, lost
held-out log-probability -- so it could not tell credit methods apart. Superseded by
`studies/lm_recipe.py` (issue 35, a recipe that learns, through `gear train`) and the
comparison of issue 37 on it. What it found: studies/archive/README.md.

Its kept runs (results/lm_credit_runs/) cannot be re-keyed: each key digests this file's
training code, `onpolicy.py`, `localization.py` and `src/gear/credit/*.py` as they were up to
commit 76ff785 (issue 36 then changed the credit core; issue 38 moved and split the two study
modules). This script still imports and runs (tests/studies/test_lm_credit.py), but a rerun computes
new keys and reruns every run; to read the 60 kept runs back by key, check out 76ff785.

Issue 28: learning evidence on a real LM that can tell credit methods apart.

SmolLM2-135M-Instruct (embedded) on 2- and 3-step arithmetic chains, whose first error the
checker finds (`onpolicy.check_rollout`), warm-started by a short SFT on worked solutions of
training problems (the embedded model is right ~2.5% of the time, too rarely for GRPO's groups to
carry an advantage; the gym warm-starts for the same reason). A compact GRPO loop like the gym's, through gear's own
pieces: batched sampling (`onpolicy.sample_groups`), the hinted teacher prompt
(`onpolicy.teacher_ids`, i.e. `gear.teacher`), `gear.credit.signals_from_logits`,
`gear.credit.token_advantages` and TRL's `dapo` loss (`gear.gym.train.dapo_loss`).

- **Metric (low noise):** the mean teacher-forced log-probability of the reference worked
  solution (the task's `ground_truth`) under the policy, without the hint, on `eval_n` held-out
  problems; sampled pass@1 (one sample at temperature 1) on the same problems beside it.
- **Pairing:** the prompts of step k and the sampling seed of step k depend on (seed, k) only, so
  two arms of one seed see the same prompts and the same random numbers.
- **Positive control:** `oracle` (and `oracle_sharp`) feed the stated result of the checker's
  first wrong equation, as token indicator, to `gear_token` in place of the KL on failed rows:
  the negative weight lands on it; correct rows stay plain GRPO.
- **Resumable:** each finished (arm, seed) run is a JSON under studies/archive/results/lm_credit_runs/
  (kept in the repository), keyed by everything that determines it (`gear.evidence.RunStore`); a
  rerun reads it back (`reused_runs`). `--workers 2` spreads the runs over processes, one thread
  each.

    OMP_NUM_THREADS=1 python -m studies.archive.lm_credit --arms grpo oracle_sharp --seeds 0 1 --steps 12
    python -m studies.archive.lm_credit --tiny ...   # a tiny random model (tests)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gear import evidence
from gear.evidence import mde, n_for_power, power_at
from gear.evidence import paired as paired_diff
from studies import onpolicy  # the named arms' rows

HERE = Path(__file__).parent

RESULTS = HERE / "results"
#: finished runs are kept in the repository (a few kB each) so that the grid resumes across
#: sessions and machines; the warm start's weights (*.pt, git-ignored) are recomputed when absent
RUNS = RESULTS / "lm_credit_runs"


@dataclass(frozen=True)
class LMConfig:
    """One run's settings (everything but the arm and the seed)."""

    steps: int = 12
    prompts: int = 4  # per step
    group: int = 8  # rollouts per prompt
    max_new_tokens: int = 48
    lr: float = 1e-5
    eval_n: int = 300
    temperature: float = 1.0
    epsilon: float = 0.2
    tiny: bool = False
    read_at: tuple[int, ...] = ()  # extra steps where the log-probabilities (no pass@1) are read
    # warm start: a short SFT on worked solutions of training problems, so that RL has groups
    # with mixed rewards (the embedded model is right ~2.5% of the time on this set)
    warm_steps: int = 20
    warm_batch: int = 16
    warm_lr: float = 1e-5


def load(tiny: bool) -> tuple[Any, Any]:
    """The embedded weights (float32), or a tiny random model."""
    if tiny:
        from gear.testing import tiny_model_and_tokenizer

        model, tok = tiny_model_and_tokenizer()
        return model.float(), tok
    return onpolicy.load_model()


#: arm names -> specs: the first-departure issue's candidates (the recommended one included)
NAMED_ARMS: dict[str, str] = {}


def arm_spec(arm: str) -> str:
    if not NAMED_ARMS:
        from studies import credit_confirm

        NAMED_ARMS.update(credit_confirm.CANDIDATES)
    return NAMED_ARMS.get(arm, arm)


def sft_loss(model: Any, tok: Any, rows: list[dict]) -> torch.Tensor:
    """Mean token NLL of the rows' worked solutions after their prompts (completion tokens only)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    seqs, spans = [], []
    for r in rows:
        p, c = onpolicy.render(tok, r["prompt"]), onpolicy.completion_ids(tok, r["ground_truth"])
        seqs.append(p + c)
        spans.append((len(p), len(c)))
    ids, mask = padded(seqs, pad)
    logits = model(input_ids=ids, attention_mask=mask.long()).logits
    nll = [
        -torch.log_softmax(logits[j, p - 1 : p - 1 + n].float(), -1)
        .gather(1, ids[j, p : p + n, None])
        .sum()
        for j, (p, n) in enumerate(spans)
    ]
    return torch.stack(nll).sum() / sum(n for _, n in spans)


def warm_model(cfg: LMConfig, runs: Path | None = None, log: Any = print) -> tuple[Any, Any]:
    """The embedded model after `warm_steps` SFT steps on worked solutions of training problems
    (their own seed stream, not the RL prompts'); the weights are kept in `runs`, keyed."""
    model, tok = load(cfg.tiny)
    if cfg.warm_steps == 0:
        return model, tok
    only = LMConfig(steps=0, eval_n=1, tiny=cfg.tiny, warm_steps=cfg.warm_steps,
                    warm_batch=cfg.warm_batch, warm_lr=cfg.warm_lr)  # fmt: skip
    path = None if runs is None else runs / f"warm-{run_key('<warm>', 0, only)}.pt"
    if path is not None and path.is_file():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model, tok
    from gear.tasks.arithmetic import ArithmeticTask

    rows = list(ArithmeticTask(mix=onpolicy.NATURAL_MIX).dataset("train", n=2000, seed=2))
    g = torch.Generator().manual_seed(12_345)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warm_lr)
    model.train()
    for step in range(1, cfg.warm_steps + 1):
        batch = [rows[int(i)] for i in torch.randint(0, len(rows), (cfg.warm_batch,), generator=g)]
        loss = sft_loss(model, tok, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log(f"lm_credit: warm start step {step}/{cfg.warm_steps} loss {float(loss.detach()):.3f}",
            flush=True)  # fmt: skip
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with evidence.replacing(path) as tmp:
            torch.save(model.state_dict(), tmp)
    return model, tok


def task_rows(cfg: LMConfig) -> tuple[Any, list[dict], list[dict]]:
    """The task, its training rows and the held-out rows (disjoint by the task's split)."""
    from gear.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(mix=onpolicy.NATURAL_MIX)
    train = list(task.dataset("train", n=2000, seed=0))
    test = list(task.dataset("test", n=cfg.eval_n, seed=1))
    return task, train, test


def step_prompts(train: list[dict], seed: int, step: int, n: int) -> list[dict]:
    """The prompts of `step`: a function of (seed, step) only, never of the arm."""
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    return [train[int(i)] for i in torch.randint(0, len(train), (n,), generator=g)]


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) ids and mask."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


def completion_logits(model: Any, prompt: list[int], comps: list[list[int]], pad: int) -> Any:
    """(G, T, V) logits predicting each completion token after one shared prompt."""
    ids, mask = padded([prompt + c for c in comps], pad)
    logits = model(input_ids=ids, attention_mask=mask.long()).logits
    T = max(len(c) for c in comps)
    return logits[:, len(prompt) - 1 : len(prompt) - 1 + T]


def first_error_mask(tok: Any, text: str, ids: list[int], task: Any, answer: str) -> list[bool]:
    """Tokens of the stated result of the checker's first wrong equation in a failed completion
    (none if it has no checkable error or is correct). The result, not the whole equation: its
    operands restate the prompt correctly (the pilot's equation-wide oracle pushed them down)."""
    check = onpolicy.check_rollout(text, answer, task)
    out = [False] * len(ids)
    if check["error"] is None:
        return out
    e = check["error"]
    start = e["number_end"] - len(e["stated"])
    lo, hi = onpolicy.char_to_token_span(onpolicy.token_offsets(tok, ids), start, e["number_end"])
    for t in range(lo, min(hi, len(ids))):
        out[t] = True
    return out


#: the second positive control: a failed row's advantage only on the checker's wrong result
ERROR_ONLY = "oracle_error_only"


def arm_params(arm: str) -> tuple[Any, str, bool]:
    """(CreditParams, estimator, oracle) of an arm spec (the gym's `parse_arm` syntax), or of
    `oracle_error_only` (GRPO's advantages, then `error_only_advantages`)."""
    from gear.credit import CreditParams
    from gear.gym.train import parse_arm

    if arm == ERROR_ONLY:
        return CreditParams(method="grpo"), "full", True
    a = parse_arm(arm_spec(arm))
    return a.params(0), a.estimator, a.oracle


def error_only_advantages(adv_tok: torch.Tensor, a: torch.Tensor, flagged: torch.Tensor):
    """(G, T) advantages of `oracle_error_only`: a failed row with flagged tokens (the stated
    result of its first wrong equation) keeps its advantage A on them and 0 on every other
    token, so that GRPO's push down on the row's correct tokens is gone (not moved: the row's
    total weight shrinks); every other row keeps `adv_tok`."""
    flagged = flagged & (a < 0)[:, None]
    return torch.where(
        flagged.any(1, keepdim=True), a[:, None] * flagged.to(adv_tok.dtype), adv_tok
    )


def rl_step(model, tok, opt, task, rows, arm, cfg: LMConfig, sample_seed: int) -> dict:
    """One GRPO step on `rows` (prompts x group rollouts). Returns metrics and what it saw."""
    from gear.credit import token_advantages
    from gear.credit.signals import signals_from_logits
    from gear.gym.train import dapo_loss, group_advantages, token_logprobs

    params, estimator, oracle = arm_params(arm)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [onpolicy.render(tok, r["prompt"]) for r in rows]
    torch.manual_seed(sample_seed)
    model.eval()
    groups = onpolicy.sample_groups(model, tok, prompts, cfg.group, cfg.max_new_tokens,
                                    cfg.temperature)  # fmt: skip
    model.train()
    texts = [[tok.decode(c, skip_special_tokens=True) for c in g] for g in groups]
    rewards = torch.tensor(
        [
            float(task.is_correct(t, r["answer"]))
            for r, ts in zip(rows, texts, strict=True)
            for t in ts
        ]
    )
    adv = group_advantages(rewards, cfg.group)
    seen = {"prompts": [r["prompt"][-1]["content"] for r in rows], "first": groups[0][0]}
    out = {"reward": float(rewards.mean()), "updated": 0.0, "seen": seen}
    if not bool(adv.abs().gt(0).any()):
        return out
    n_tokens = sum(len(c) for g in groups for c in g)
    opt.zero_grad(set_to_none=True)
    for k, (r, comps) in enumerate(zip(rows, groups, strict=True)):
        a = adv[k * cfg.group : (k + 1) * cfg.group]
        if not bool(a.abs().gt(0).any()):
            continue
        ids, mask = padded(comps, pad)
        s_logits = completion_logits(model, prompts[k], comps, pad)
        with torch.no_grad():
            t_logits = completion_logits(
                model, onpolicy.teacher_ids(tok, r["prompt"], r["ground_truth"]), comps, pad
            )
            sig = signals_from_logits(s_logits.detach(), t_logits, ids, estimator=estimator,
                                      temperature=cfg.temperature, mask=mask)  # fmt: skip
            old = token_logprobs(s_logits.detach(), ids, cfg.temperature)
        kl = sig.kl
        if oracle:  # the checker's first wrong equation on failed rows, nothing elsewhere
            ind = [first_error_mask(tok, texts[k][j], comps[j], task, r["answer"])
                   for j in range(len(comps))]  # fmt: skip
            kl = padded([[float(x) for x in m] for m in ind], 0)[0].float()
            kl = torch.where(mask, kl, 0.0) * (a < 0).float()[:, None]
        adv_tok = token_advantages(
            a, mask, kl=kl, entropy=sig.entropy, student_logprobs=sig.student_logprobs,
            teacher_logprobs=sig.teacher_logprobs, params=params,
        )  # fmt: skip
        if arm == ERROR_ONLY:
            adv_tok = error_only_advantages(adv_tok, a, kl > 0)
        # dapo: summed over tokens, divided by the batch's token count (not this group's)
        loss = dapo_loss(s_logits, old, ids, adv_tok.to(s_logits.dtype), cfg.epsilon,
                         cfg.temperature) * ids.numel() / n_tokens  # fmt: skip
        loss = torch.where(torch.isfinite(loss), loss, 0.0)
        loss.backward()
    opt.step()
    out["updated"] = 1.0
    return out


def summary(logps: list[float]) -> dict[str, Any]:
    """The primary metric (mean log-probability of the reference solution), the mean probability
    (the gym's expected accuracy, not dominated by a few problems whose log-probability falls)
    and the per-problem values (4 decimals) for any later paired-by-problem reading."""
    return {
        "logp": sum(logps) / len(logps),
        "prob": sum(math.exp(x) for x in logps) / len(logps),
        "logp_each": [round(x, 4) for x in logps],
    }


@torch.no_grad()
def evaluate(
    model, tok, task, test: list[dict], seed: int, batch: int = 16, pass1: bool = True
) -> dict[str, float]:
    """Mean teacher-forced log-probability of the reference solution (no hint) and, if `pass1`,
    sampled pass@1 (one sample at temperature 1, seeded)."""
    model.eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    logps = []
    for i in range(0, len(test), batch):
        for r in test[i : i + batch]:
            prompt = onpolicy.render(tok, r["prompt"])
            ref = onpolicy.completion_ids(tok, r["ground_truth"])
            logits = completion_logits(model, prompt, [ref], pad)[0]
            lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ref)[:, None])
            logps.append(float(lp.sum()))
    if not pass1:
        model.train()
        return summary(logps)
    torch.manual_seed(seed)
    right = 0
    prompts = [onpolicy.render(tok, r["prompt"]) for r in test]
    for i in range(0, len(test), batch):
        outs = onpolicy.sample_groups(model, tok, prompts[i : i + batch], 1, 48)
        for r, g in zip(test[i : i + batch], outs, strict=True):
            right += bool(task.is_correct(tok.decode(g[0], skip_special_tokens=True), r["answer"]))
    model.train()
    return {**summary(logps), "pass1": right / len(test)}


#: the functions whose source determines a run's numbers; the key hashes these (and the modules
#: below), not this whole file, so editing the analysis, the figure or the CLI does not discard a
#: grid's finished runs, while editing the training or the evaluation reruns them
RUN_CODE = ("LMConfig", "load", "arm_spec", "sft_loss", "warm_model", "task_rows",
            "step_prompts", "padded", "completion_logits", "first_error_mask", "arm_params",
            "error_only_advantages", "rl_step", "summary", "evaluate", "base_eval", "train_arm")  # fmt: skip


@functools.cache
def code_digest() -> str:
    """SHA-256 over `RUN_CODE`'s source and the modules a run imports from gear's benchmarks
    and credit core (`gear.evidence.code_digest`). Computed once a process, so a running grid
    keeps its keys if the file is edited under it."""
    files = [HERE.parent / "onpolicy.py"]  # until 76ff785: benchmarks/onpolicy.py, localization.py
    files += sorted((HERE.parent.parent / "src" / "gear" / "credit").glob("*.py"))
    return evidence.code_digest([globals()[name] for name in RUN_CODE], files)


def run_params(arm: str, seed: int, cfg: LMConfig) -> dict[str, Any]:
    """Everything but the code that determines one (arm, seed) run."""
    return {"arm": arm, "seed": seed, "cfg": asdict(cfg), "torch": torch.__version__}


def store(runs: Path) -> evidence.RunStore:
    """The finished (arm, seed) runs kept in `runs` (`gear.evidence.RunStore`)."""
    return evidence.RunStore(runs, code_digest())


def run_key(arm: str, seed: int, cfg: LMConfig) -> str:
    return evidence.run_key(run_params(arm, seed, cfg), code_digest())


def base_eval(seed: int, cfg: LMConfig, runs: Path | None = None) -> dict[str, float]:
    """The step-0 evaluation of `seed`: every arm starts from the same weights and reads
    pass@1 with the same sampling seed, so it is computed once per seed (kept in `runs`)."""
    path = None
    if runs is not None:
        only = LMConfig(steps=0, eval_n=cfg.eval_n, tiny=cfg.tiny, warm_steps=cfg.warm_steps,
                        warm_batch=cfg.warm_batch, warm_lr=cfg.warm_lr)  # fmt: skip
        path = runs / f"base-{run_key('<base>', seed, only)}.json"
        if path.is_file():
            return json.loads(path.read_text())
    model, tok = warm_model(cfg, runs)
    task, _, test = task_rows(cfg)
    out = evaluate(model, tok, task, test, seed=7_919 + seed)
    if path is not None:
        evidence.write_json(path, out)  # atomic, as every kept result
    return out


def train_arm(
    arm: str, seed: int, cfg: LMConfig, log: Any = print, runs: Path | None = None
) -> dict[str, Any]:
    """One (arm, seed) run from the embedded weights; paired by (seed, step)."""
    t0 = time.perf_counter()
    curve = [{"step": 0, **base_eval(seed, cfg, runs)}]
    model, tok = warm_model(cfg, runs, log)
    task, train, test = task_rows(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    seen, rewards, updated = [], [], []
    for step in range(1, cfg.steps + 1):
        rows = step_prompts(train, seed, step, cfg.prompts)
        m = rl_step(model, tok, opt, task, rows, arm, cfg, sample_seed=100_003 * seed + step)
        seen.append(m.pop("seen"))
        rewards.append(m["reward"])
        updated.append(m["updated"])
        log(f"lm_credit: {arm} seed {seed} step {step}/{cfg.steps} reward {m['reward']:.3f} "
            f"{(time.perf_counter() - t0) / step:.1f} s/step", flush=True)  # fmt: skip
        if step in cfg.read_at and step != cfg.steps:
            curve.append({"step": step, **evaluate(model, tok, task, test, 0, pass1=False)})
            log(
                f"lm_credit: {arm} seed {seed} step {step} logp {curve[-1]['logp']:.3f}", flush=True
            )
    curve.append({"step": cfg.steps, **evaluate(model, tok, task, test, seed=7_919 + seed)})
    log(f"lm_credit: {arm} seed {seed} done: logp {curve[0]['logp']:.3f} -> {curve[-1]['logp']:.3f}"
        f", pass@1 {curve[0]['pass1']:.3f} -> {curve[-1]['pass1']:.3f}", flush=True)  # fmt: skip
    machine = {"cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
               "torch": torch.__version__}  # fmt: skip
    return {"arm": arm, "seed": seed, "machine": machine, "curve": curve, "rewards": rewards, "updated": updated, "seen": seen,
            "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _job(job: tuple[str, int, LMConfig, Path]) -> dict[str, Any]:
    """One (arm, seed) run, read back if it finished before (a worker process's unit)."""
    arm, seed, cfg, runs = job
    torch.set_num_threads(1)  # one core per worker; the workers fill the machine
    kept = store(runs).get(run_params(arm, seed, cfg))
    if kept is not None:
        return {**kept, "reused": True}
    # atomic: a killed run leaves no half-written result
    return store(runs).put(run_params(arm, seed, cfg), train_arm(arm, seed, cfg, runs=runs))


def _base_job(job: tuple[int, LMConfig, Path]) -> dict[str, float]:
    torch.set_num_threads(1)
    return base_eval(*job)


#: the primary metrics a grid can register (BENCHMARKS amendments 3 and 5), as they are written
METRICS = {
    "logp": "mean teacher-forced log-probability of the reference solution (no hint)",
    "prob": "mean teacher-forced probability of the reference solution (no hint), the gym's "
    "expected accuracy",
}


def run(
    arms: list[str], seeds: list[int], cfg: LMConfig, runs: Path = RUNS, workers: int = 1,
    primary: str = "logp", gate: str | None = None,
    planned: tuple[float, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every (arm, seed), kept on disk as it finishes; paired statistics over seeds (all three
    metrics; the power table and the readings at `cfg.read_at` on `primary`). With
    `workers` > 1 the warm start runs first, then the seeds' step-0 evaluations and the runs
    are spread over spawned processes (one thread each); the numbers do not depend on it."""
    if primary not in METRICS:
        raise ValueError(f"primary: expected one of {sorted(METRICS)}, got {primary!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: each seed once (a repeated seed counts twice), got {seeds}")
    if gate is not None and (gate not in arms or gate == "grpo"):
        raise ValueError(f"gate: expected one of the arms other than grpo, got {gate!r}")
    t0 = time.perf_counter()
    runs.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed, cfg, runs) for seed in seeds for arm in arms]
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        warm_model(cfg, runs)  # once, before the workers need it
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_base_job, [(s, cfg, runs) for s in seeds]))
            done = list(pool.map(_job, jobs))
    else:
        done = [_job(j) for j in jobs]
    results = {(j[0], j[1]): r for j, r in zip(jobs, done, strict=True)}
    reused = [f"{a}/seed{s}" for (a, s), r in results.items() if r.pop("reused", False)]
    final = {k: v["curve"][-1] for k, v in results.items()}
    paired = paired_final(final, arms, seeds, primary)
    at_steps: dict[str, Any] = {}
    for arm in arms:
        if arm == "grpo":
            continue
        for step in sorted(set(cfg.read_at) - {cfg.steps}):
            at = {k: {c["step"]: c[primary] for c in v["curve"]} for k, v in results.items()}
            t = paired_diff(
                [at[(arm, s)][step] for s in seeds], [at[("grpo", s)][step] for s in seeds]
            )
            at_steps.setdefault(f"{arm}-grpo", {})[str(step)] = {
                "mean": t["mean"], "ci": t["ci"], "sd": t["sd"], "n": t["n"]}  # fmt: skip
    result = {
        "arms": arms, "seeds": seeds, "steps": cfg.steps, "eval_n": cfg.eval_n,
        "config": asdict(cfg),
        "primary": primary,
        "metric": f"{METRICS[primary]} on {cfg.eval_n} held-out problems (primary); beside it "
        + ", ".join(f"{k}: {v}" for k, v in METRICS.items() if k != primary)
        + "; pass1: one sample at temperature 1",
        "final": {f"{a}/seed{s}": {k: x for k, x in v.items() if k != "logp_each"}
                  for (a, s), v in final.items()},
        "paired": paired, "paired_at_step": at_steps,
        "power": power_table(paired, primary, planned, len(seeds)),
        "reused_runs": reused, "workers": workers,
        # the grid's own cost, summed over its runs (wall_s below is this invocation's)
        "runs_wall_s": round(sum(r["wall_s"] for r in results.values()), 1),
        # a grid spread over sessions may run on both CPU classes: each run's own capability
        "run_machines": {f"{a}/seed{s}": v["machine"]["cpu_capability"]
                         for (a, s), v in results.items()},
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"platform": platform.platform(),
                    "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
    }  # fmt: skip
    classes = {s: {result["run_machines"][f"{a}/seed{s}"] for a in arms} for s in seeds}
    result["seeds_on_two_cpu_classes"] = [s for s, c in classes.items() if len(c) > 1]
    # BENCHMARKS' rule for a grid spread over CPU classes: the intervals over all seeds, and
    # beside them over each class's own seeds (a seed whose arms ran on two classes is in none)
    by_class: dict[str, list[int]] = {}
    for s, c in classes.items():
        if len(c) == 1:
            by_class.setdefault(next(iter(c)), []).append(s)
    result["paired_by_cpu_class"] = {
        c: {"seeds": ss, "paired": paired_final(final, arms, ss, primary) if len(ss) >= 2 else {}}
        for c, ss in sorted(by_class.items())
    }
    if gate is not None:  # the registered rule (BENCHMARKS, issue 28), applied by code
        g = paired[f"{gate}-grpo"]
        result["gate"] = {
            "arm": gate, "metric": primary, "mean": g["mean"], "ci": g["ci"],
            "passed": g["ci"][0] > 0,
            "rule": f"the grid counts only if {gate} - grpo has a 95% paired-t lower bound above "
                    f"0 on the primary metric ({primary})",
        }  # fmt: skip
    return result


def paired_final(
    final: dict[tuple[str, int], dict[str, float]], arms: list[str], seeds: list[int],
    primary: str = "logp",
) -> dict[str, Any]:  # fmt: skip
    """Each arm - grpo at the last step over `seeds`: 95% paired t per metric, and the issue's
    `{"mean", "ci"}` of the `primary` beside them. `final[(arm, seed)]` maps metric -> value."""
    paired: dict[str, Any] = {}
    for arm in arms:
        if arm == "grpo":
            continue
        out = paired[f"{arm}-grpo"] = {}
        for metric in ("logp", "prob", "pass1"):
            t = paired_diff([final[(arm, s)][metric] for s in seeds],
                            [final[("grpo", s)][metric] for s in seeds])  # fmt: skip
            out[metric] = {"mean": t["mean"], "ci": t["ci"], "sd": t["sd"], "n": t["n"]}
        out.update(mean=out[primary]["mean"], ci=out[primary]["ci"])
    return paired


def status(arms: list[str], seeds: list[int], cfg: LMConfig, runs: Path = RUNS) -> str:
    """A seeds x arms table of kept runs ("x") and missing ones ("."); reads names, not numbers."""
    kept = store(runs)
    lines = [f"{'seed':>6}  " + "  ".join(arms)]
    for seed in seeds:
        marks = ["x" if kept.path(run_params(arm, seed, cfg)).is_file() else "." for arm in arms]
        cells = (f"{m:>{len(a)}}" for m, a in zip(marks, arms, strict=True))
        lines.append(f"{seed:>6}  " + "  ".join(cells))
    done = kept.status(run_params(a, s, cfg) for s in seeds for a in arms)["kept"]
    lines.append(f"{done} of {len(arms) * len(seeds)} runs kept in {runs}")
    return "\n".join(lines)


def power(sd: float, n_needed_for: float, alpha: float = 0.05, target: float = 0.8) -> int:
    """Seeds (3 to 500; 500 if none less) for `target` power to detect a paired mean of
    `n_needed_for` with SD `sd` (`gear.evidence.n_for_power`)."""
    return n_for_power(n_needed_for, sd, alpha, target, start=3, stop=500) or 500


def power_table(
    paired: dict[str, Any], primary: str = "logp", planned: tuple[float, float] | None = None,
    n: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Per arm, on the `primary` metric: the paired SD, the MDE at this n (80%, alpha 0.05), the
    power this n had for the observed mean (post hoc: it adds nothing to the interval; the n
    that 80% power at that mean would need is the useful part). With `planned` = (effect, SD)
    from a pilot, also the power the design had before it ran (`planned`, at `n` seeds)."""
    out: dict[str, Any] = {}
    if planned is not None:
        effect, sd = planned
        out["planned"] = {
            "effect": effect, "sd": sd, "n": n, "power": power_at(abs(effect), sd, n),
            "mde_80": mde(sd, n), "n_for_80": power(sd, effect),
        }  # fmt: skip
    for name, d in paired.items():
        m = d[primary]
        if m["n"] < 2 or not m["sd"] > 0:
            continue
        out[name] = {
            "sd": m["sd"],
            "n": m["n"],
            "mde_80": mde(m["sd"], m["n"]),
            "power_at_observed_mean": power_at(abs(m["mean"]), m["sd"], m["n"]),
            "n_for_80_at_observed_mean": power(m["sd"], m["mean"]) if m["mean"] else None,
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Each arm minus `grpo`, paired over seeds, with 95% intervals: primary metric and pass@1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["paired"])
    primary = result.get("primary", "logp")
    what = {"logp": "log-prob", "prob": "probability"}[primary]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(names) + 1.6))
    for ax, metric, label in zip(
        axes, (primary, "pass1"),
        (f"{what} of the right solution (primary)", "sampled pass@1"), strict=True,
    ):  # fmt: skip
        for i, name in enumerate(names):
            d = result["paired"][name][metric]
            ax.errorbar(d["mean"], i, xerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]],
                        fmt="o", capsize=3)  # fmt: skip
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names))
        ax.locator_params(axis="x", nbins=5)
        ax.set_xlabel(f"arm − grpo:\n{label}")
    model = "a tiny random model" if result["config"]["tiny"] else "SmolLM2-135M"
    fig.suptitle(f"{model}, {result['steps']} RL steps, n = {len(result['seeds'])} seeds, "
                 f"{result['eval_n']} held-out problems, 95% paired t")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--arms", nargs="+", default=["grpo", "oracle_sharp"],
                    help="arm names or gym arm specs, space-separated (a spec's options use commas)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--planned", type=float, nargs=2, metavar=("EFFECT", "SD"), default=None,
                    help="the pilot's paired mean and SD on the primary: the design's power "
                         "at this n, written to the JSON's power.planned")  # fmt: skip
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--eval-n", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warm-steps", type=int, default=LMConfig.warm_steps,
                    help="SFT steps of the warm start (0: the embedded weights as they are)")  # fmt: skip
    ap.add_argument("--read-at", type=int, nargs="*", default=[],
                    help="extra steps where the log-probabilities (no pass@1) are read")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    ap.add_argument("--out", type=Path, default=RESULTS / "lm_credit.json")
    ap.add_argument("--runs", type=Path, default=RUNS)
    ap.add_argument("--workers", type=int, default=1, help="processes, one thread each")
    ap.add_argument("--primary", choices=sorted(METRICS), default="logp",
                    help="the registered primary metric: power table and --read-at readings")  # fmt: skip
    ap.add_argument("--plot", type=Path, default=None, help="write the paired figure here")
    ap.add_argument("--gate", default=None,
                    help="the positive control: the grid counts only if ARM - grpo's 95%% lower "
                         "bound on the primary metric is above 0 (written to the JSON)")  # fmt: skip
    ap.add_argument("--status", action="store_true",
                    help="list which (arm, seed) runs are kept, without their numbers, and exit "
                         "(a grid spread over sessions is not read before it is complete)")  # fmt: skip
    a = ap.parse_args(argv)
    for name in ("steps", "prompts", "eval_n"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an integer >= 1")
    if len(set(a.seeds)) != len(a.seeds):
        ap.error("--seeds: a seed given twice would be counted twice; give each once")
    if a.planned is not None and not a.planned[1] > 0:
        ap.error("--planned: expected EFFECT SD with SD > 0")
    if a.workers < 1:
        ap.error("--workers: expected an integer >= 1")
    if a.warm_steps < 0:
        ap.error("--warm-steps: expected an integer >= 0")
    if a.group < 2:
        ap.error("--group: expected an integer >= 2 (GRPO's std needs two)")
    arms = [x for item in a.arms for x in ([item] if "@" in item else item.split(",")) if x]
    if "grpo" not in arms:
        ap.error("--arms: grpo is the reference every arm is paired with; include it")
    for arm in arms:
        arm_params(arm)  # a bad arm fails now, not mid-grid
    if any(not 1 <= k <= a.steps for k in a.read_at):
        ap.error(f"--read-at: expected steps in 1..{a.steps}")
    cfg = LMConfig(steps=a.steps, prompts=a.prompts, group=a.group, eval_n=a.eval_n, lr=a.lr,
                   tiny=a.tiny, read_at=tuple(sorted(set(a.read_at))),
                   warm_steps=a.warm_steps)  # fmt: skip
    if a.gate is not None and (a.gate not in arms or a.gate == "grpo"):
        ap.error(f"--gate: expected one of the arms other than grpo, got {a.gate!r}")
    if a.status:
        print(status(arms, a.seeds, cfg, a.runs))
        return 0
    result = run(
        arms,
        a.seeds,
        cfg,
        a.runs,
        workers=a.workers,
        primary=a.primary,
        gate=a.gate,
        planned=a.planned,
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in result["paired"].items():
        print(k, {m: f"{v[m]['mean']:+.3f} [{v[m]['ci'][0]:+.3f}, {v[m]['ci'][1]:+.3f}]"
                  for m in ("logp", "prob", "pass1")})  # fmt: skip
    if "gate" in result:
        g = result["gate"]
        print(
            f"gate ({g['arm']} - grpo, {g['metric']}): {g['mean']:+.3f} "
            f"[{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}] -> {'passed' if g['passed'] else 'FAILED'}"
        )
    if a.plot is not None and len(a.seeds) >= 2:
        plot(result, a.plot)
    print(f"wrote {a.out} ({result['wall_s']} s, {result['machine']['cpu_capability']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

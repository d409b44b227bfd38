"""Arms and the RL loop of the gym.

The loop is a compact plain-PyTorch GRPO over the tiny model (TRL's trainer costs more per step
than this whole step; a grid of 20 seeds x 10 arms must fit in an hour on two cores). Everything
that makes an arm an arm goes through gear's own code: the teacher pass scores the same tokens
with the ground-truth hint, `gear.credit.signals.signals_from_logits` gives KL (any estimator),
entropy and log-probs, `gear.credit.token_advantages` gives the per-token advantages, and the
loss is TRL's `dapo` loss: the per-token ratio-clipped policy gradient summed over tokens and
divided by the number of tokens in the batch. One gradient step per batch (TRL's default
`num_iterations=1`), so the ratio is 1 and the clip is inert, as there.

An arm is a credit method plus overrides: `gear`, `gear@estimator=k1`,
`gear@tau_onset=0.05`, `mymod:my_method@alpha=0.3` (imports `mymod`, whose import registers
`my_method` with `gear.credit.register_method`). The oracle arm feeds the checker's first
wrong step as the signal of `gear_token`: the same modulation as GEAR, with its extra negative
weight exactly on the first wrong step.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from gear.constraints import Check, check_fields, checked, field_checks
from gear.credit import METHODS, CreditParams, token_advantages
from gear.credit.attribution import (
    answer_span,
    input_gradient_influence,
    perturbation_influence,
    span_logprob,
    span_positions,
    tokens_before,
)
from gear.credit.implicit import prefix_counts
from gear.credit.signals import ESTIMATORS, signals_from_logits
from gear.gym.model import ModelConfig, build_model, completion_logits, evaluate, sample
from gear.gym.task import BOS, RESULT_OFFSET, STEP_LEN, ChainTask
from gear.modeling import lm_head
from gear.prefix import prefix_shared_hidden

#: a sharp modulation: a negative row's weight goes almost all to its flagged tokens (raw
#: exp(5) = 148 vs 1, mass-preserved: a flagged step of 6 tokens in 24 gets 3.92 a token and
#: 98% of the row's weight, the rest 0.026; w_max=100 so that the clip, applied after mass
#: preservation, never binds). GEAR's default (linear, alpha 0.5) gives 1.33 and 0.89: a third.
SHARP = "modulation=exp,beta=5,w_min=0,w_max=100"

#: the default arms: name -> spec
DEFAULT_ARMS = {
    "grpo": "grpo",
    "gear": "gear",
    "gear_k1": "gear@estimator=k1",
    "gear_token": "gear_token",
    "rlsd": "rlsd",
    "random": "random",
    "fixed": f"fixed@fixed_len={STEP_LEN}",
    "oracle": "oracle",
    "oracle_sharp": f"oracle@{SHARP}",
    "gear_sharp": f"gear@{SHARP}",
}
# arm-level overrides; every other key is a CreditParams field
ARM_KEYS = ("estimator", "lr", "error_span")
#: what `first_error` blames in a failed rollout: its first wrong token, or its whole first wrong
#: step (the form the gym's winning `oracle` arms blame)
ERROR_SPANS = ("token", "step")


@dataclass(frozen=True)
class Arm:
    """One arm: a credit method, its `CreditParams` overrides, the KL estimator and, if set,
    its own learning rate (`lr`, in place of `RLConfig.lr`: GRPO at several rates)."""

    name: str
    method: str
    estimator: str = "full"
    overrides: tuple[tuple[str, Any], ...] = ()
    oracle: bool = False
    spec: str = ""  # what `parse_arm` read (a worker process parses it again)
    lr: float | None = None
    error_span: str = "token"

    def params(self, seed: int) -> CreditParams:
        return CreditParams(method=self.method, seed=seed, **dict(self.overrides))


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_arm(spec: str, name: str | None = None) -> Arm:
    """`[module:]method[@key=value,...]` -> `Arm`. A `module:` part is imported first (so a
    user's module can register its method); the method must then be in `gear.credit.METHODS`.
    `oracle` is the checker's positive control."""
    if name is None:
        name = spec
    original = spec
    if spec in DEFAULT_ARMS and DEFAULT_ARMS[spec] != spec:
        spec = DEFAULT_ARMS[spec]
    base, _, opts = spec.partition("@")
    if ":" in base:
        module, _, base = base.rpartition(":")
        importlib.import_module(module)
    overrides: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"arm {spec!r}: expected key=value after '@', got {item!r}")
        overrides[key.strip()] = _value(value.strip())
    estimator = str(overrides.pop("estimator", "full"))
    if estimator not in ESTIMATORS:
        raise ValueError(f"arm {spec!r}: estimator must be one of {ESTIMATORS}, got {estimator!r}")
    lr = overrides.pop("lr", None)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or lr <= 0):
        raise ValueError(f"arm {spec!r}: lr must be a number > 0, got {lr!r}")
    error_span = str(overrides.pop("error_span", "token"))
    if error_span not in ERROR_SPANS:
        raise ValueError(
            f"arm {spec!r}: error_span must be one of {ERROR_SPANS}, got {error_span!r}"
        )
    oracle = base == "oracle"  # `oracle_sharp` was mapped to `oracle@...` above
    method = "gear_token" if oracle else base
    if method not in METHODS:
        raise ValueError(
            f"arm {spec!r}: unknown credit method {base!r}; registered: {sorted(METHODS)} "
            "(a method in your own module: 'package.module:method')"
        )
    valid = {f.name for f in fields(CreditParams)} - {"method", "seed"}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"arm {spec!r}: unknown option(s) {unknown}; valid: {sorted(valid)}")
    arm = Arm(
        name, method, estimator, tuple(sorted(overrides.items())), oracle, original,
        None if lr is None else float(lr), error_span,
    )  # fmt: skip
    arm.params(0)  # validates the values now, not mid-grid
    return arm


@dataclass(frozen=True)
class RLConfig:
    """The RL loop's settings; bad values are refused on construction, naming the field."""

    steps: int = checked(60, "RL steps of a run.", Check(ge=1, integer=True))
    prompts: int = checked(16, "Prompts per step.", Check(ge=1, integer=True))
    group: int = checked(
        8, "Rollouts per prompt (GRPO's std needs two).", Check(ge=2, integer=True)
    )
    lr: float = checked(
        3e-4, "Adam's learning rate (1e-3 collapsed the warm start: 0.45 -> 0.17 in 30 steps).",
        Check(gt=0),
    )  # fmt: skip
    epsilon: float = checked(0.2, "Ratio clip (inert with one update per batch).", Check(ge=0))
    temperature: float = checked(1.0, "Sampling temperature.", Check(gt=0))
    eval_every: int = checked(10, "Evaluate every this many steps.", Check(ge=1, integer=True))
    eval_n: int = checked(256, "Held-out problems per evaluation.", Check(ge=1, integer=True))

    def __post_init__(self) -> None:
        check_fields("RLConfig", self, field_checks(RLConfig))


def group_advantages(rewards: Tensor, group: int) -> Tensor:
    """(N,) GRPO advantages (r - group mean) / (group std + 1e-4), spec §1."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.view(-1)


def credit(
    arm: Arm,
    task: ChainTask,
    problems: Tensor,
    completions: Tensor,
    advantages: Tensor,
    student_logits: Tensor,
    teacher_logits: Tensor,
    seed: int,
    temperature: float = 1.0,
    contrast_logits: Tensor | None = None,
    influence: Tensor | None = None,
    group: int | None = None,
) -> Tensor:
    """(N, T) per-token advantages of `arm` through `gear.credit` (no gradient).

    `contrast_logits`: the contrast teacher's (a wrong hint), needed when the arm's
    `CreditParams.contrast` is on. `influence`: (N, T) `answer_influence`, for `oar_g` and
    `oar_p` (its answer span: `oar_span`). `group`: rows per problem, each group's rows in a
    row (None: a group is a run of equal problems), for `lambda_grpo`'s prefix tree."""
    mask = torch.ones_like(completions, dtype=torch.bool)
    params = arm.params(seed)
    answer_mask = None
    oar = next((s for s in ("influence", "perturbation") if s in params.required_signals), None)
    if oar is not None:
        answer_mask = oar_span(params, task, problems, completions)[2]

    def signals(teacher: Tensor) -> Any:
        return signals_from_logits(
            student_logits.detach(),
            teacher,
            completions,
            temperature=temperature,
            estimator=arm.estimator,
        )

    sig = signals(teacher_logits)
    contrast_kl = None
    if params.contrast:
        if contrast_logits is None:
            raise ValueError(f"arm {arm.name!r}: contrast=true needs the contrast teacher's logits")
        contrast_kl = signals(contrast_logits).kl
    kl = sig.kl
    error_mask = prefix_count = None
    if "error_mask" in params.required_signals:  # first_error: the checker's token or step
        error_mask = error_token_or_step(task, problems, completions, arm.error_span)
    if "prefix_count" in params.required_signals:
        prefix_count = prefix_counts(completions, mask, group_labels(problems, group)).to(
            advantages.dtype
        )
    if arm.oracle:  # the first wrong step of failed rows only: a correct row stays plain GRPO
        wrong = error_token_or_step(task, problems, completions, "step").float()
        kl = wrong * (advantages < 0).to(wrong.dtype)[:, None]
    return token_advantages(
        advantages,
        mask,
        kl=kl,
        entropy=sig.entropy,
        student_logprobs=sig.student_logprobs,
        teacher_logprobs=sig.teacher_logprobs,
        contrast_kl=contrast_kl,
        influence=influence if oar == "influence" else None,
        perturbation=influence if oar == "perturbation" else None,
        answer_mask=answer_mask,
        error_mask=error_mask,
        prefix_count=prefix_count,
        params=params,
    )


def error_token_or_step(
    task: ChainTask, problems: Tensor, completions: Tensor, span: str = "token"
) -> Tensor:
    """(N, T) bool: each rollout's first wrong token (`ChainTask.first_error`: the first token
    that differs from the one right solution), or with `span='step'` the 6 tokens of the step
    that holds it; none in a flawless rollout."""
    if span == "step":
        return task.step_mask(task.first_wrong_step(problems, completions))
    first = task.first_error(problems, completions)
    cols = torch.arange(completions.shape[1], device=completions.device)
    return (cols[None, :] == first[:, None]) & (first[:, None] >= 0)


def group_labels(problems: Tensor, group: int | None) -> Tensor:
    """(N,) group label of each row: rows // `group`, or (None) a new label wherever the problem
    differs from the previous row's."""
    n = problems.shape[0]
    if group is not None:
        return torch.arange(n, device=problems.device) // group
    new = torch.ones(n, dtype=torch.long, device=problems.device)
    new[1:] = (problems[1:] != problems[:-1]).any(dim=1).long()
    return new.cumsum(0) - 1


def oar_span(
    params: CreditParams, task: ChainTask, problems: Tensor, completions: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """OAR-G's answer span in the gym (`CreditParams.oar_span`, docs/spec.md).

    'answer': the last step's result digit, the one the reward reads (the ";" after it ends a
    step, not the answer, so it is not part of the span, as no end token is on a real LM);
    'reference': the true final digit appended after the completion (the authors' way);
    'last': the last `oar_answer_len` tokens (the last "r;" at k = 2). Every gym completion has
    its answer at the same place, so no row falls back.

    Returns (N, T') the ids after the prompt that the influence pass reads (the completion,
    plus the reference under 'reference'), (N, T') bool the span phi scores, and (N, T) bool
    the span inside the completion (`credit_details`' `answer_mask`)."""
    T = completions.shape[1]
    if params.oar_span == "reference":
        ids = torch.cat([completions, task.results(problems)[:, -1:]], dim=1)
        span = torch.zeros_like(ids, dtype=torch.bool)
        span[:, -1] = True
        return ids, span, torch.zeros_like(completions, dtype=torch.bool)
    if params.oar_span == "last":
        span = answer_span(torch.ones_like(completions, dtype=torch.bool), params.oar_answer_len)
    else:
        span = torch.zeros_like(completions, dtype=torch.bool)
        span[:, T - STEP_LEN + RESULT_OFFSET] = True
    return completions, span, span


def answer_influence(
    model: Any,
    arm: Arm,
    task: ChainTask,
    problems: Tensor,
    completions: Tensor,
    scored: Tensor | None = None,
) -> Tensor | None:
    """(N, T) influence of each completion token on the answer span (`oar_span`;
    `gear.credit.attribution`) under the model's raw logits (the authors' phi: no sampling
    temperature): OAR-G's input gradient of its log-probability, or OAR-P's change of it when
    the token is masked (`oar_pfinal`; the gym has no pad token, so a masked token becomes
    "<bos>", the one id that is no content). None when the arm's method reads neither.
    `scored`: (N,) bool, the rows OAR-P runs on (the others' advantage is 0; None: all)."""
    params = arm.params(0)
    if not {"influence", "perturbation"} & set(params.required_signals):
        return None
    ids, span, answer = oar_span(params, task, problems, completions)
    prompts = task.prompts(problems)
    P, T = prompts.shape[1], completions.shape[1]
    if "perturbation" in params.required_signals:
        masked = tokens_before(answer, torch.ones_like(answer))  # what OAR reshapes
        if scored is not None:
            masked &= scored[:, None]
        full = torch.cat([prompts, ids], dim=1)
        with torch.no_grad():
            return perturbation_influence(
                lambda x, n: prefix_shared_hidden(model, x, torch.ones_like(x), n),
                lm_head(model),
                full,
                torch.ones_like(full),
                span,
                torch.nn.functional.pad(masked, (0, ids.shape[1] - T)),
                BOS,
                params.oar_pfinal,
            )[:, :T]
    idx, real = span_positions(span)

    def score(embeds: Tensor) -> Tensor:  # the gym's vocabulary is 16: full logits are cheap
        z = model(inputs_embeds=embeds, use_cache=False).logits[:, P - 1 : -1]
        z = z.gather(1, idx[..., None].expand(-1, -1, z.shape[-1]))
        return span_logprob(z, ids.gather(1, idx), real)

    embeds = model.get_input_embeddings()(torch.cat([prompts, ids], dim=1))
    return input_gradient_influence(score, embeds)[:, P : P + T]


@torch.no_grad()
def teacher_logits(
    model: Any, arm: Arm, task: ChainTask, problems: Tensor, completions: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The teacher pass (current weights, hinted prompt, the same completion ids; spec §4) and,
    for a `contrast` arm, a second one with a wrong hint. Returns (N, T, V) logits each."""
    teacher = completion_logits(model, task.teacher_prompts(problems), completions)
    if not arm.params(0).contrast:
        return teacher, None
    return teacher, completion_logits(model, task.contrast_teacher_prompts(problems), completions)


def token_logprobs(logits: Tensor, completions: Tensor, temperature: float) -> Tensor:
    """(N, T) log-probabilities of the sampled tokens under logits / temperature (as TRL)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(2, completions[..., None]).squeeze(2)


def dapo_loss(
    logits: Tensor,
    old_logp: Tensor,
    completions: Tensor,
    adv: Tensor,
    eps: float,
    temperature: float,
) -> Tensor:
    """TRL's `dapo` loss: -min(ratio * A_t, clip(ratio) * A_t) summed over tokens / token count."""
    logp = token_logprobs(logits, completions, temperature)
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return per_token.sum() / completions.numel()


def rl_step(
    model: Any,
    opt: torch.optim.Optimizer,
    arm: Arm,
    task: ChainTask,
    cfg: RLConfig,
    problems: Tensor,
    gen: torch.Generator,
    credit_seed: int,
) -> dict[str, float]:
    """One GRPO step on `problems` (each repeated `cfg.group` times). Returns step metrics."""
    rep = problems.repeat_interleave(cfg.group, dim=0)
    prompts = task.prompts(rep)
    comp = sample(model, prompts, task.completion_len, gen, cfg.temperature)
    rewards = task.rewards(rep, comp)
    adv = group_advantages(rewards, cfg.group)
    out = {"reward": float(rewards.mean()), "updated": 0.0}
    if not bool(adv.abs().gt(0).any()):
        return out  # every group uniform: no signal, as in GRPO
    logits = completion_logits(model, prompts, comp)
    teacher, contrast = teacher_logits(model, arm, task, rep, comp)
    with torch.no_grad():
        old_logp = token_logprobs(logits, comp, cfg.temperature)
    influence = answer_influence(model, arm, task, rep, comp, scored=adv != 0)
    adv_tok = credit(
        arm, task, rep, comp, adv, logits, teacher, credit_seed, cfg.temperature, contrast,
        influence, cfg.group,
    )  # fmt: skip
    loss = dapo_loss(logits, old_logp, comp, adv_tok.to(logits.dtype), cfg.epsilon, cfg.temperature)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    out.update(loss=loss.item(), updated=1.0)
    return out


def eval_problems(task: ChainTask, n: int, held_out: int = 0) -> Tensor:
    """The held-out problems every seed and arm of one warm start is evaluated on; `held_out`
    (the warm start's index) draws another set, so a grid over warm starts also varies it."""
    return task.problems(n, torch.Generator().manual_seed(20_000 + held_out), "test")


def train_arm(
    arm: Arm,
    seed: int,
    task: ChainTask,
    model_cfg: ModelConfig,
    state: dict[str, Tensor],
    cfg: RLConfig,
    log: Any = print,
    held_out: int = 0,
) -> dict[str, Any]:
    """Train one arm for one seed from the warm start; paired: the prompts and the random
    numbers of sampling and evaluation depend on (seed, step) only, never on the arm.
    `held_out`: which held-out set (`eval_problems`). The arm's own `lr`, if set, replaces
    `cfg.lr`.

    Returns {arm, seed, curve: [{step, accuracy, exact}], rewards, wall_s}."""
    t0 = time.perf_counter()
    model = build_model(model_cfg, task)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr if arm.lr is None else arm.lr)
    prompt_gen = torch.Generator().manual_seed(1_000 + seed)
    problems_out = eval_problems(task, cfg.eval_n, held_out)
    eval_seed = 7_919 + seed * 100_003  # not the seeds training samples with
    curve = [{"step": 0, **evaluate(model, task, problems_out, seed=eval_seed)}]
    rewards = []
    for step in range(1, cfg.steps + 1):
        problems = task.problems(cfg.prompts, prompt_gen)
        gen = torch.Generator().manual_seed(seed * 100_003 + step)
        m = rl_step(model, opt, arm, task, cfg, problems, gen, credit_seed=seed * 100_003 + step)
        rewards.append(m["reward"])
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve.append(
                {"step": step, **evaluate(model, task, problems_out, seed=eval_seed + step)}
            )
            log(
                f"gym: {arm.name} seed {seed} step {step}/{cfg.steps}  reward {m['reward']:.3f}  "
                f"held-out {curve[-1]['accuracy']:.3f} (exact {curve[-1]['exact']:.3f})  "
                f"{(time.perf_counter() - t0) / step:.2f} s/step"
            )
    return {
        "arm": arm.name,
        "seed": seed,
        "curve": curve,
        "rewards": rewards,
        "wall_s": round(time.perf_counter() - t0, 2),
    }

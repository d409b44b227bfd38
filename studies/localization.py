"""Credit localisation: on completions whose first error is known, where does each credit method
put the blame?

Injected errors (exact ground truth): correct worked solutions -- GSM8K train reference solutions
(their ``<<a*b=c>>`` results) and the arithmetic task's multistep worked solutions -- get one
calculation result replaced by a wrong number; the rest of the text is unchanged. The student
scores question -> corrupted solution; the teacher scores question + hint (the correct
reference, `gear.teacher.teacher_prompt` with the math hint template) -> the same tokens. Each
corrupted solution is a failed rollout (A = -1); each uncorrupted solution is scored as a
successful one (A = +1).

Natural errors (on-policy): completions sampled from the embedded model on multistep arithmetic
that got the answer wrong; the first equation ``X op Y = Z`` whose stated result is wrong marks
the error.

Per method (`gear.credit.credit_details`): hit@1 (the highest-weight token of an A < 0 row lies
in the erroneous step; ties share the hit), the share of extra blame sum(max(w - 1, 0)) on the
erroneous step and after it, the per-row AUROC of w for "token at or after the first error",
and on A > 0 rows the weight spread. Means carry 95% bootstrap intervals over cases.

Two stages: ``signals`` runs the model once and caches the per-token signals (resumable);
``metrics`` computes every method, the sweeps, the JSON, the figure and the viewer records from
the cache in seconds.

    nice -n 5 .venv/bin/python benchmarks/localization.py signals       # ~1 h on the shared CPU
    nice -n 5 .venv/bin/python benchmarks/localization.py natural       # on-policy errors
    .venv/bin/python benchmarks/localization.py metrics
    .venv/bin/gear inspect benchmarks/results/localization_records --out /tmp/localization.html
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import onpolicy
from onpolicy import EQUATION, first_difference

HERE = Path(__file__).parent
RESULTS = HERE / "results"
GSM8K_TRAIN = HERE.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
CACHE = HERE.parent / "runs" / "localization"
METHODS = (
    "gear", "gear_token", "gear_kl_only", "gear_entropy_only", "turn", "fixed", "random",
    "entropy_top", "rlsd", "grpo",
)  # fmt: skip
RANDOM_SEEDS = (0, 1, 2, 3, 4)
#: the on-policy failures: 2- and 3-step problems
NATURAL_MIX = {"multistep": 0.5, "chain": 0.5}
#: the placebo's extra prompts: one-equation 1- and 2-digit problems the model gets right more often, so
#: their correct rollouts give the placebo enough rows (on NATURAL_MIX it is right 2.5% of the time)
PLACEBO_MIX = {"1digit": 0.5, "2digit": 0.5}
NUMBER = r"\d[\d,]*(?:\.\d+)?"

# --------------------------------------------------------------------------- cases (pure)


@dataclass
class Case:
    """One scored completion with its error location in characters of `completion`.

    `error_char` is the first character that differs from the correct text (None for a clean,
    successful row); `number_end` the end of the wrong number; `step` the (start, end) character
    span of the erroneous step (a GSM8K solution line, an arithmetic equation clause).
    """

    source: str  # "gsm8k" | "arithmetic" | "natural"
    group: str  # rows of one group share prompt and reference
    prompt: list[dict[str, str]]
    reference: str
    completion: str
    error_char: int | None = None
    number_end: int | None = None
    step: tuple[int, int] | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _to_float(s: str) -> float:
    return float(s.replace(",", ""))


def gsm8k_results(answer: str) -> tuple[str, list[tuple[int, int]]]:
    """Reference text of a GSM8K answer and the character spans of its calculation results.

    Args:
        answer: the raw GSM8K ``answer`` field (``<<48/2=24>>24`` annotations, ``#### 72``).
    Returns:
        (text, spans): text equals `gear.tasks.gsm8k.split_solution(answer)[0]` (annotations
        removed, last line "The answer is N."); spans are the (start, end) characters of each
        visible result that follows an annotation and equals the annotated value.
    """
    from gear.tasks.gsm8k import split_solution

    steps = answer.rsplit("####", 1)[0]
    pieces, spans, pos, cursor = [], [], 0, 0
    for m in re.finditer(r"<<([^=>]*)=([^>]*)>>", steps):
        pieces.append(steps[cursor : m.start()])
        pos += m.start() - cursor
        cursor = m.end()
        after = re.match(NUMBER, steps[cursor:])
        try:
            same = after is not None and math.isclose(
                _to_float(after.group()), _to_float(m.group(2)), rel_tol=1e-9
            )
        except ValueError:
            same = False
        if same:
            spans.append((pos, pos + len(after.group())))
    pieces.append(steps[cursor:])
    raw = "".join(pieces)
    text, _final = split_solution(answer)
    lead = len(raw) - len(raw.lstrip())  # split_solution strips the steps
    spans = [(a - lead, b - lead) for a, b in spans]
    if not text.startswith(raw.strip()):
        raise ValueError("gsm8k_results: reconstructed text differs from split_solution's")
    return text, [s for s in spans if s[0] >= 0 and s[1] <= len(raw.strip())]


def arithmetic_results(solution: str) -> list[tuple[int, int]]:
    """Character spans of the results of the equations ``a op b = r`` in a worked solution."""
    return [m.span(4) for m in EQUATION.finditer(solution) if m.group(4)]


def first_wrong_equation(text: str) -> tuple[int, int] | None:
    """Span of the stated result of the first equation whose result is arithmetically wrong."""
    found = onpolicy.first_wrong_equation(text)
    return None if found is None else found[1].span(4)


def wrong_number(correct: str, rng: random.Random) -> str:
    """A different number in the same style: integer +- 1..9 (never negative); decimals keep
    their decimal places; thousands separators are dropped."""
    value = _to_float(correct)
    decimals = len(correct.split(".", 1)[1]) if "." in correct else 0
    for _ in range(100):
        delta = rng.choice([d for d in range(-9, 10) if d != 0])
        new = value + delta
        if new >= 0:
            out = f"{new:.{decimals}f}"
            if out != correct.replace(",", ""):
                return out
    raise ValueError(f"wrong_number: no replacement for {correct!r}")


def step_span(text: str, pos: int, separators: Sequence[str]) -> tuple[int, int]:
    """(start, end) of the step holding character `pos`: between the nearest separators."""
    starts = [text.rfind(s, 0, pos) for s in separators]
    start = max([i + len(s) for i, s in zip(starts, separators, strict=True) if i >= 0] or [0])
    ends = [text.find(s, pos) for s in separators]
    end = min([i for i in ends if i >= 0] or [len(text)])
    return start, end


def corrupt(
    text: str, span: tuple[int, int], rng: random.Random, separators: Sequence[str]
) -> tuple[str, int, int, tuple[int, int], str]:
    """Replace the number at `span` by a wrong one; nothing else changes.

    Returns (corrupted text, first differing character, end of the new number, step span,
    the new number).
    """
    a, b = span
    new = wrong_number(text[a:b], rng)
    out = text[:a] + new + text[b:]
    # first differing character of the whole texts: when the new number is a prefix of the old
    # one ("10" -> "1") it is the character after the number
    err = a + first_difference(text[a:], out[a:])
    return out, err, max(a + len(new), err + 1), step_span(out, a, separators), new


def injected_cases(
    n_gsm8k: int, n_arithmetic: int, seed: int = 0, per_problem: int = 5, variants: int = 2
) -> list[Case]:
    """Corrupted and clean cases from GSM8K train (short solutions) and multistep arithmetic.

    Each problem yields one clean row and corrupted rows: GSM8K one per result (at most
    `per_problem`), arithmetic `variants` different wrong numbers per result (the rows of one
    problem share its prompt pass; the intervals resample problems, not rows). Sources
    alternate so that a partial run covers both.
    """
    from gear.tasks.arithmetic import ArithmeticTask
    from gear.tasks.gsm8k import PROMPT as GSM8K_PROMPT

    rng = random.Random(seed)
    gsm: list[list[Case]] = []
    lines = GSM8K_TRAIN.read_text(encoding="utf-8").splitlines()
    order = list(range(len(lines)))
    rng.shuffle(order)
    for i in order:
        if len(gsm) >= n_gsm8k:
            break
        row = json.loads(lines[i])
        if len(row["answer"]) > 220 or len(row["question"]) > 300:
            continue  # keep the forward passes short on the shared CPU
        text, spans = gsm8k_results(row["answer"])
        if not spans:
            continue
        prompt = [{"role": "user", "content": GSM8K_PROMPT.format(question=row["question"])}]
        gsm.append(_group("gsm8k", f"gsm8k-{i}", prompt, text, spans, rng, ("\n",), per_problem, 1))
    arith: list[list[Case]] = []
    rows = ArithmeticTask(mix={"multistep": 1.0}).dataset("train", n=n_arithmetic, seed=seed)
    for j, row in enumerate(rows):
        text = row["ground_truth"]
        spans = arithmetic_results(text)
        arith.append(
            _group(
                "arithmetic",
                f"arith-{j}",
                row["prompt"],
                text,
                spans,
                rng,
                (", ", ". "),
                9,
                variants,
            )
        )
    out: list[Case] = []
    for k in range(max(len(gsm), len(arith))):
        for groups in (arith, gsm):
            if k < len(groups):
                out.extend(groups[k])
    return out


def _group(
    source: str,
    group: str,
    prompt: list[dict[str, str]],
    text: str,
    spans: list[tuple[int, int]],
    rng: random.Random,
    separators: tuple[str, ...],
    per_problem: int,
    variants: int,
) -> list[Case]:
    cases = [Case(source, group, prompt, text, text)]
    for span in rng.sample(spans, min(per_problem, len(spans))):
        seen: set[str] = set()
        for _ in range(20 * variants):
            if len(seen) == variants:
                break
            bad, err, end, step, new = corrupt(text, span, rng, separators)
            if new in seen:
                continue
            seen.add(new)
            cases.append(
                Case(
                    source, group, prompt, text, bad, err, end, step,
                    {"original": text[span[0] : span[1]], "new": new,
                     "result_index": spans.index(span)},
                )
            )  # fmt: skip
    return cases


# --------------------------------------------------------------------------- tokens (pure)


def token_offsets(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) characters of each token in ``tokenizer.decode(ids)``, by cumulative decoding
    (works for sampled ids too). Special tokens decode to their text."""
    out, prev = [], 0
    for k in range(1, len(ids) + 1):
        n = len(tokenizer.decode(list(ids[:k])))
        out.append((prev, n))
        prev = n
    return out


def char_to_token_span(offsets: Sequence[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens that overlap characters [lo, hi) (hi > lo)."""
    hit = [k for k, (a, b) in enumerate(offsets) if a < hi and b > lo]
    if not hit:
        raise ValueError(f"no token overlaps characters [{lo}, {hi})")
    return hit[0], hit[-1] + 1


# --------------------------------------------------------------------------- metrics (pure)


def hit_at_1(w: Tensor, lo: int, hi: int) -> float:
    """Share of the highest-weight tokens (ties share) that lie in [lo, hi). w: (T,) valid only."""
    top = w >= w.max() - 1e-9
    idx = top.nonzero().squeeze(1)
    return float(((idx >= lo) & (idx < hi)).double().mean())


def blame_after_share(w: Tensor, start: int) -> float:
    """sum(max(w - 1, 0)) on tokens >= start over the whole row; NaN when no extra blame."""
    extra = (w.double() - 1).clamp(min=0)
    total = float(extra.sum())
    return float(extra[start:].sum()) / total if total > 1e-12 else float("nan")


def mass_after_share(w: Tensor, start: int) -> float:
    """sum(w) on tokens >= start over sum(w) (defined for every method; flat = token share)."""
    w = w.double()
    total = float(w.sum())
    return float(w[start:].sum()) / total if total > 1e-12 else float("nan")


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Mann-Whitney AUROC (ties count 1/2); NaN when one class is empty. Both (T,)."""
    pos, neg = scores[labels].double(), scores[~labels].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().sum()
    ties = (pos[:, None] == neg[None, :]).double().sum()
    return float((greater + 0.5 * ties) / (pos.numel() * neg.numel()))


def row_metrics(w: Tensor, error: int, step: tuple[int, int]) -> dict[str, float]:
    """All per-row localisation metrics of one failed row.

    Args:
        w: (T,) weights of the row's valid tokens.
        error: index of the first wrong token. step: [start, end) tokens of the erroneous step.
    """
    pos = torch.arange(w.numel())
    return {
        "hit1": hit_at_1(w, *step),
        "hit1_token": hit_at_1(w, error, step[1]),
        "blame_after_share": blame_after_share(w, step[0]),
        "mass_after_share": mass_after_share(w, step[0]),
        "auroc": auroc(w, pos >= error),
    }


def bootstrap_ci(
    values: Sequence[float],
    groups: Sequence[str] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, list[float], int]:
    """(mean, [2.5%, 97.5%] bootstrap interval, n) over the finite values.

    With `groups`, whole groups are resampled (rows of one problem are not independent) and
    each resample's mean is over all rows of the drawn groups.
    """
    groups = list(range(len(values))) if groups is None else list(groups)
    keep = [(v, g) for v, g in zip(values, groups, strict=True) if math.isfinite(v)]
    if not keep:
        return float("nan"), [float("nan"), float("nan")], 0
    index = {g: k for k, g in enumerate(dict.fromkeys(g for _, g in keep))}
    sums = torch.zeros(len(index), dtype=torch.float64)
    counts = torch.zeros(len(index), dtype=torch.float64)
    for v, g in keep:
        sums[index[g]] += v
        counts[index[g]] += 1
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(index), (n_boot, len(index)), generator=gen)
    means = sums[idx].sum(dim=1) / counts[idx].sum(dim=1)
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return float(sums.sum() / counts.sum()), [lo, hi], len(keep)


# --------------------------------------------------------------------------- model pass


@torch.no_grad()
def completion_hidden(
    model: Any, prompt_ids: Sequence[int], rows: Sequence[Sequence[int]]
) -> Tensor:
    """Final hidden states that predict each completion token, after one shared prompt.

    The prompt is run once; its KV cache is repeated for the B completions (right-padded, so
    padding only follows real tokens and needs no mask).

    Returns:
        (B, T, H) float32: position t predicts rows[b][t]; T = the longest row.
    """
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    p = torch.tensor([list(prompt_ids)])
    out = body(input_ids=p, use_cache=True)
    last = out.last_hidden_state[:, -1:]
    T = max(len(r) for r in rows)
    if T == 1:
        return last.expand(len(rows), 1, -1).clone()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.full((len(rows), T - 1), int(pad), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r) - 1] = torch.tensor(list(r[:-1]), dtype=torch.long)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(rows))
    rest = body(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([last.expand(len(rows), 1, -1), rest], dim=1)


def render(tokenizer: Any, prompt: list[dict[str, str]]) -> list[int]:
    """Prompt -> ids with the chat template and generation prompt, as the TRL trainer does."""
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def teacher_ids(tokenizer: Any, prompt: list[dict[str, str]], reference: str) -> list[int]:
    """Teacher prompt ids: gear.teacher's hint (math template) on the student's prompt."""
    from gear.teacher import HINT_TEMPLATES, fit_teacher_prompt

    ids, _ = fit_teacher_prompt(
        lambda p: render(tokenizer, p),
        prompt,
        reference,
        HINT_TEMPLATES["math"],
        None,
        tokenize=lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
        detokenize=lambda ids: tokenizer.decode(ids),
    )
    return ids


def completion_ids(tokenizer: Any, text: str) -> list[int]:
    """The completion's ids as the policy would emit them: the text, then EOS."""
    return [*list(tokenizer(text, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]


@torch.no_grad()
def group_signals(
    model: Any, tokenizer: Any, cases: list[Case], ids: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    """Per-token signals of the rows of one group (shared prompt and reference).

    Returns one dict per case: ids, kl, entropy, student/teacher log-probs (lists, length T_row),
    the first error token, the error-number token end and the step's token span.
    """
    from gear.credit import signals_from_hidden

    prompt, reference = cases[0].prompt, cases[0].reference
    ids = ids or [completion_ids(tokenizer, c.completion) for c in cases]
    hs = completion_hidden(model, render(tokenizer, prompt), ids)
    ht = completion_hidden(model, teacher_ids(tokenizer, prompt, reference), ids)
    T = hs.shape[1]
    tok = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for b, r in enumerate(ids):
        tok[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = True
    lm = model.get_output_embeddings()
    sig = signals_from_hidden(
        hs, ht, lm.weight, tok, lm_head_bias=lm.bias, mask=mask, chunk_size=128
    )
    out = []
    for b, (case, r) in enumerate(zip(cases, ids, strict=True)):
        n = len(r)
        rec: dict[str, Any] = {
            "case": asdict(case),
            "ids": list(r),
            "kl": sig.kl[b, :n].tolist(),
            "entropy": sig.entropy[b, :n].tolist(),
            "lp_s": sig.student_logprobs[b, :n].tolist(),
            "lp_t": sig.teacher_logprobs[b, :n].tolist(),
        }
        if case.error_char is not None:
            offsets = token_offsets(tokenizer, r)
            e0, e1 = char_to_token_span(offsets, case.error_char, case.number_end)
            s0, s1 = char_to_token_span(offsets, *case.step)
            rec.update(error=e0, error_end=e1, step=[s0, max(s1, e1)])
        out.append(rec)
    return out


def _load_model() -> tuple[Any, Any]:
    from gear.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    model.eval()
    return model, tok


def _load_cache(path: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(path, weights_only=False) if path.is_file() else {}


def _save_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


def run_signals(args: argparse.Namespace) -> None:
    """Stage 1: signals of every injected case, cached per group (resumable)."""
    torch.set_num_threads(args.threads)
    cases = injected_cases(args.gsm8k, args.arithmetic, seed=args.seed)
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)
    cache = Path(args.cache)
    path = cache / ("injected.reverse.pt" if args.reverse else "injected.pt")
    done = _load_cache(path)

    def elsewhere() -> set[str]:  # groups a second worker (--reverse) has finished
        return {g for f in cache.glob("injected*.pt") if f != path for g in _load_cache(f)}

    order = list(groups)[::-1] if args.reverse else list(groups)
    n_bad = sum(c.error_char is not None for c in cases)
    print(f"{len(groups)} groups, {n_bad} corrupted + {len(groups)} clean rows", flush=True)
    model, tok = _load_model()
    t0, n = time.time(), 0
    for g in order:
        if g in done or g in elsewhere():
            continue
        done[g] = group_signals(model, tok, groups[g])
        _save_cache(path, done)
        n += 1
        print(f"{n} groups ({len(done)} in {path.name}), {time.time() - t0:.0f} s", flush=True)


def run_natural(args: argparse.Namespace) -> None:
    """Stage 1b, on-policy: sample groups of completions on 2- and 3-step arithmetic (`multistep`,
    `chain`) from the embedded model, grade them with the checker (`onpolicy.check_rollout`) and
    cache the signals of every failed row with a checked first error and every correct row (the
    placebo). Resumable: one cache entry per prompt; `--natural-prompts` can grow between runs."""
    from gear.tasks.arithmetic import ArithmeticTask
    from onpolicy import check_rollout, equation_spans, sample_groups

    torch.set_num_threads(args.threads)
    if args.placebo_set:  # easier prompts whose correct rollouts feed the placebo only
        task, n, name = ArithmeticTask(mix=PLACEBO_MIX), args.placebo_prompts, "placebo"
    else:
        task, n, name = ArithmeticTask(mix=NATURAL_MIX), args.natural_prompts, "natural"
    rows = task.dataset("test", n=n, seed=args.seed)
    model, tok = _load_model()
    path = Path(args.cache) / f"{name}.pt"
    done = _load_cache(path)
    todo = [j for j in range(len(rows)) if f"{name}-{j}" not in done]
    t0 = time.time()
    print(f"{name}: {len(done)} prompts cached, {len(todo)} to sample "
          f"({args.samples} samples, <= {args.max_new_tokens} tokens)", flush=True)  # fmt: skip
    for k in range(0, len(todo), args.prompts_per_call):
        part = todo[k : k + args.prompts_per_call]
        # each call's seed is fixed by its prompts, so a resumed run samples what a fresh one would
        torch.manual_seed(args.seed * 100003 + part[0])
        groups = sample_groups(
            model, tok, [render(tok, rows[j]["prompt"]) for j in part],
            args.samples, args.max_new_tokens,
        )  # fmt: skip
        for j, gen in zip(part, groups, strict=True):
            row, g = rows[j], f"{name}-{j}"
            ids, cases = [], []
            for r in gen:
                text = tok.decode(r, skip_special_tokens=True)
                check = check_rollout(text, row["answer"], task)
                if not check["correct"] and (check["error"] is None or args.placebo_set):
                    continue  # failed without a checkable first error, or a placebo-set failure
                case = Case("natural", g, row["prompt"], row["ground_truth"], text)
                case.detail = {"level": row["level"], "truncated": tok.eos_token_id not in r}
                if check["error"] is not None:
                    e = check["error"]
                    case.error_char, case.number_end = e["error_char"], e["number_end"]
                    case.step = tuple(e["step"])
                    case.detail.update(equation=e["equation"], stated=e["stated"],
                                       correct=e["right"])  # fmt: skip
                else:  # placebo candidates: every equation's (start, result start, result end)
                    case.detail["equations"] = equation_spans(text)
                ids.append(r)
                cases.append(case)
            recs = group_signals(model, tok, cases, ids) if cases else []
            for rec, r in zip(recs, ids, strict=True):
                if "equations" in rec["case"]["detail"]:
                    offsets = token_offsets(tok, r)
                    rec["equations"] = [
                        [*char_to_token_span(offsets, a, c), *char_to_token_span(offsets, b, c)]
                        for a, b, c in rec["case"]["detail"]["equations"]
                    ]  # [step start, step end, result start, result end) in tokens
            done[g] = recs
        _save_cache(path, done)
        all_recs = [r for v in done.values() for r in v]
        n_fail = sum("error" in r for r in all_recs)
        print(
            f"{name}: {len(done)}/{len(rows)} prompts, {n_fail} failed rows with a checked error, "
            f"{len(all_recs) - n_fail} correct rows, {time.time() - t0:.0f} s",
            flush=True,
        )


# --------------------------------------------------------------------------- stage 2: metrics


def sampled_token_signal(lp_s: Tensor, lp_t: Tensor, estimator: str) -> Tensor:
    """A divergence of the sampled token only (the full KL at t ignores y_t: it depends on y<t).

    "k1": log pi_S(y_t) - log pi_T(y_t), high where the teacher finds y_t less likely;
    "k3": r - 1 - log r with r = pi_T(y_t) / pi_S(y_t) (large mostly where r >> 1).
    """
    if estimator == "k1":
        return lp_s - lp_t
    if estimator == "k3":
        log_ratio = lp_t - lp_s
        return log_ratio.exp() - 1 - log_ratio
    raise ValueError(f"estimator: expected 'k1' or 'k3', got {estimator!r}")


def _batch(recs: list[dict[str, Any]], signal: str = "full") -> dict[str, Tensor]:
    """Pad records into (N, T) tensors. signal: "full" (the spec's KL), or "k1" / "k3" from the
    sampled token's log-probabilities (`sampled_token_signal`) in place of the KL."""
    N, T = len(recs), max(len(r["ids"]) for r in recs)
    out = {k: torch.zeros(N, T) for k in ("kl", "entropy", "lp_s", "lp_t")}
    valid = torch.zeros(N, T, dtype=torch.bool)
    for i, r in enumerate(recs):
        n = len(r["ids"])
        valid[i, :n] = True
        for k in out:
            out[k][i, :n] = torch.tensor(r[k])
    if signal != "full":
        kl = sampled_token_signal(out["lp_s"].double(), out["lp_t"].double(), signal)
        out["kl"] = torch.where(valid, kl, 0.0).float()
    out["valid"] = valid
    return out


def method_weights(
    recs: list[dict[str, Any]], advantage: float, params: Any, signal: str = "full", batch: int = 16
) -> list[Tensor]:
    """Weights w of each record (its valid tokens) under `params`, in training-sized batches."""
    from gear.credit import credit_details

    out = []
    for k in range(0, len(recs), batch):
        part = recs[k : k + batch]
        b = _batch(part, signal)
        d = credit_details(
            torch.full((len(part),), float(advantage)),
            b["valid"],
            kl=b["kl"],
            entropy=b["entropy"],
            student_logprobs=b["lp_s"],
            teacher_logprobs=b["lp_t"],
            params=params,
        )
        out.extend(d.weights[i, : len(r["ids"])].double() for i, r in enumerate(part))
    return out


def evaluate_method(
    bad: list[dict[str, Any]], good: list[dict[str, Any]], name: str, signal: str = "full",
    **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """Per-row metrics of method `name` (random: averaged over RANDOM_SEEDS per row)."""
    from gear.credit import CreditParams

    seeds = RANDOM_SEEDS if name == "random" else (0,)
    per_seed = []
    for s in seeds:
        p = CreditParams(method=name, seed=s, **overrides)
        w_bad = method_weights(bad, -1.0, p, signal)
        rows = [
            row_metrics(w, r["error"], tuple(r["step"])) for w, r in zip(w_bad, bad, strict=True)
        ]
        w_good = method_weights(good, 1.0, p, signal) if good else []
        spread = [float(w.std(unbiased=False)) for w in w_good]
        per_seed.append((rows, spread))
    keys = per_seed[0][0][0].keys() if bad else []
    rows = [{k: _nanmean([ps[0][i][k] for ps in per_seed]) for k in keys} for i in range(len(bad))]
    spread = [_nanmean([ps[1][i] for ps in per_seed]) for i in range(len(good))]
    return {
        "rows": rows,
        "spread": spread,
        "per_seed": per_seed if len(seeds) > 1 else None,
        "groups": [r["case"]["group"] for r in bad],
        "good_groups": [r["case"]["group"] for r in good],
    }


def _nanmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(ev: dict[str, Any]) -> dict[str, Any]:
    """Means and problem-level bootstrap intervals of an `evaluate_method` result."""
    out: dict[str, Any] = {}
    for key in ("hit1", "hit1_token", "blame_after_share", "mass_after_share", "auroc"):
        mean, ci, n = bootstrap_ci([r[key] for r in ev["rows"]], ev.get("groups"))
        out[key], out[f"{key}_ci"] = mean, ci
        if key == "blame_after_share":
            out["blame_rows"] = n  # rows with any extra blame
    mean, ci, _ = bootstrap_ci(ev["spread"], ev.get("good_groups"))
    out["weight_spread_pos"], out["weight_spread_pos_ci"] = mean, ci
    if ev["per_seed"]:
        out["hit1_per_seed"] = [_nanmean([r["hit1"] for r in ps[0]]) for ps in ev["per_seed"]]
    return out


def paired(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, Any]:
    """Mean and problem-level bootstrap CI of the per-row difference a - b (two evaluations)."""
    d = [x[key] - y[key] for x, y in zip(a["rows"], b["rows"], strict=True)]
    mean, ci, n = bootstrap_ci(d, a["groups"])
    return {"mean": mean, "ci": ci, "n": n}


def profile(recs: list[dict[str, Any]], key: str, radius: int = 6) -> list[float]:
    """Mean of per-row min-max-normalised signal `key` at offsets -radius..radius from the error."""
    sums, counts = [0.0] * (2 * radius + 1), [0] * (2 * radius + 1)
    for r in recs:
        x = torch.tensor(r[key], dtype=torch.float64)
        lo, hi = float(x.min()), float(x.max())
        x = (x - lo) / (hi - lo) if hi - lo > 1e-8 else torch.zeros_like(x)
        for j, off in enumerate(range(-radius, radius + 1)):
            t = r["error"] + off
            if 0 <= t < len(x):
                sums[j] += float(x[t])
                counts[j] += 1
    return [s / c if c else float("nan") for s, c in zip(sums, counts, strict=True)]


def _with_signal(recs: list[dict[str, Any]], estimator: str) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        lp_s = torch.tensor(r["lp_s"], dtype=torch.float64)
        lp_t = torch.tensor(r["lp_t"], dtype=torch.float64)
        out.append({**r, estimator: sampled_token_signal(lp_s, lp_t, estimator).tolist()})
    return out


def _clean_aligned(bad: list[dict[str, Any]], good: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each corrupted row, its problem's clean row with the corrupted row's error index
    (tokens before the error are identical, so the KL there is too)."""
    clean = {r["case"]["group"]: r for r in good}
    return [
        {**clean[r["case"]["group"]], "error": r["error"], "step": r["step"]}
        for r in bad
        if r["case"]["group"] in clean
    ]


def run_metrics(args: argparse.Namespace) -> None:
    from gear.credit import CreditParams

    inj = {}
    for f in sorted(Path(args.cache).glob("injected*.pt")):  # one file per worker
        inj.update(_load_cache(f))
    nat = _load_cache(Path(args.cache) / "natural.pt")
    recs = [r for g in inj.values() for r in g]
    bad = [r for r in recs if "error" in r]
    good = [r for r in recs if "error" not in r]
    if not bad:
        sys.exit(f"no injected signals in {args.cache}; run the 'signals' stage first")
    print(f"injected: {len(bad)} corrupted rows, {len(good)} clean rows")
    payload: dict[str, Any] = {
        "cases": len(bad),
        "clean_rows": len(good),
        "model": "SmolLM2-135M-Instruct (embedded, float32, eval)",
        "signals": "full-vocabulary reverse KL(student || teacher) and student entropy, "
        "gear.credit.signals_from_hidden, temperature 1",
        "advantages": "corrupted rows A = -1, clean rows A = +1",
        "defaults": {k: v for k, v in CreditParams().to_dict().items() if k != "method"},
        "random_seeds": list(RANDOM_SEEDS),
        "sources": {s: sum(r["case"]["source"] == s for r in bad) for s in ("arithmetic", "gsm8k")},
        "chance": _chance(bad),
        "methods": {},
    }
    evs: dict[str, dict] = {}
    for name in METHODS:
        evs[name] = evaluate_method(bad, good, name)
        payload["methods"][name] = summarise(evs[name])
        for src in ("arithmetic", "gsm8k"):
            idx = [i for i, r in enumerate(bad) if r["case"]["source"] == src]
            sub = {
                "rows": [evs[name]["rows"][i] for i in idx],
                "groups": [evs[name]["groups"][i] for i in idx],
                "spread": [],
                "per_seed": None,
            }
            s = summarise(sub)
            payload["methods"][name][f"by_source_{src}"] = {
                k: s[k] for k in ("hit1", "hit1_ci", "auroc", "auroc_ci", "blame_after_share")
            }
        m = payload["methods"][name]
        print(f"{name:18s} hit1 {m['hit1']:.3f} [{m['hit1_ci'][0]:.3f}, {m['hit1_ci'][1]:.3f}]"
              f"  auroc {m['auroc']:.3f}  blame_after {m['blame_after_share']:.3f}"
              f"  spread+ {m['weight_spread_pos']:.3f}", flush=True)  # fmt: skip
    payload["paired"] = {
        f"gear-{b}": {k: paired(evs["gear"], evs[b], k) for k in ("hit1", "auroc")}
        for b in ("random", "gear_token", "grpo", "rlsd", "turn")
    }
    # Variants: a sampled-token divergence (k1, k3) in place of the full-vocabulary KL.
    payload["variants"] = {
        "note": "kl replaced by k1 = log pi_S(y_t) - log pi_T(y_t) or k3 = r - 1 - log r, "
        "r = pi_T(y_t)/pi_S(y_t), from the same two passes; everything else as the spec",
    }
    for est in ("k1", "k3"):
        payload["variants"][est] = {}
        for name in ("gear", "gear_token", "gear_kl_only", "random"):
            ev = evaluate_method(bad, good, name, signal=est)
            s = {k: v for k, v in summarise(ev).items() if not k.startswith("by_")}
            payload["variants"][est][name] = s
            if est == "k1" and name == "gear":
                payload["paired"]["gear_k1-gear"] = {
                    k: paired(ev, evs["gear"], k) for k in ("hit1", "auroc")
                }
                payload["paired"]["gear_k1-random"] = {
                    k: paired(ev, evs["random"], k) for k in ("hit1", "auroc")
                }
            print(f"[{est}] {name:14s} hit1 {s['hit1']:.3f} {s['hit1_ci']}  auroc {s['auroc']:.3f}")
    # Placebo: each corrupted row's clean twin scored as if failed (A = -1), error index kept.
    # Whatever a method "finds" there is where the reference helps, not the error.
    placebo = _clean_aligned(bad, good)
    payload["placebo_clean_rows"] = {"note": "clean twin of each corrupted row, A = -1"}
    for name in ("gear", "gear_token", "random", "grpo"):
        s = summarise(evaluate_method(placebo, [], name))
        payload["placebo_clean_rows"][name] = {
            k: s[k] for k in ("hit1", "hit1_ci", "auroc", "auroc_ci", "blame_after_share")
        }
        print(f"[placebo] {name:10s} hit1 {s['hit1']:.3f} {s['hit1_ci']}  auroc {s['auroc']:.3f}")
    payload["sweep"] = _sweep(bad)
    payload["profile"] = {
        "offsets": list(range(-6, 7)),
        "kl_norm": profile(bad, "kl"),
        "kl_norm_clean_row": profile(_clean_aligned(bad, good), "kl"),
        "entropy_norm": profile(bad, "entropy"),
        "k1_norm": profile(_with_signal(bad, "k1"), "k1"),
        "k3_norm": profile(_with_signal(bad, "k3"), "k3"),
    }
    payload["natural"] = _natural(nat)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "localization.json"
    path.write_text(json.dumps(_clean(payload), indent=1))
    print(f"wrote {path}")
    plot(payload, RESULTS / "localization.png")
    write_records(bad, good, RESULTS / "localization_records")


def _chance(bad: list[dict[str, Any]]) -> dict[str, float]:
    """What a flat weighting gets: the step's share of tokens and the share at/after the step."""
    step = [(r["step"][1] - r["step"][0]) / len(r["ids"]) for r in bad]
    after = [(len(r["ids"]) - r["step"][0]) / len(r["ids"]) for r in bad]
    return {"step_token_share": _nanmean(step), "after_step_token_share": _nanmean(after)}


def _sweep(bad: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tau in (0.05, 0.1, 0.2, 0.3, 0.5):
        for delta in (0.05, 0.1, 0.2, 0.5, 1.0):
            ev = evaluate_method(bad, [], "gear", tau_onset=tau, delta_entropy=delta)
            s = summarise(ev)
            out.append({"tau_onset": tau, "delta_entropy": delta, "hit1": s["hit1"],
                        "hit1_ci": s["hit1_ci"], "auroc": s["auroc"],
                        "blame_after_share": s["blame_after_share"]})  # fmt: skip
    return out


NATURAL_METHODS = ("gear", "gear_token", "random", "fixed")  # read a KL signal
NATURAL_PLAIN = ("rlsd", "grpo", "oracle")  # read none (oracle: the checker's first error)
NATURAL_SIGNALS = ("full", "k1", "k3")
TOP_K = 3


def top_k_share(w: Tensor, token: int, k: int = TOP_K) -> float:
    """P(token is among the k highest weights) with ties broken at random. w: (T,)."""
    above = int((w > w[token] + 1e-9).sum())
    tied = int(((w - w[token]).abs() <= 1e-9).sum())
    return 0.0 if above >= k else min(1.0, (k - above) / tied)


def blame_shares(w: Tensor, lo: int, hi: int) -> tuple[float, float, float]:
    """Extra blame sum(max(w - 1, 0)) before [lo, hi), on it and after it, as shares (NaN when
    there is none)."""
    extra = (w.double() - 1).clamp(min=0)
    total = float(extra.sum())
    if total <= 1e-12:
        return math.nan, math.nan, math.nan
    return (float(extra[:lo].sum()) / total, float(extra[lo:hi].sum()) / total,
            float(extra[hi:].sum()) / total)  # fmt: skip


def natural_row_metrics(w: Tensor, error: int, step: Sequence[int]) -> dict[str, float]:
    """Per-row metrics of the on-policy set. w: (T,); error: first wrong token; step:
    [start, end) tokens of the erroneous equation."""
    lo, hi = step
    before, at, after = blame_shares(w, lo, hi)
    return {
        "L": hit_at_1(w, lo, min(hi + 1, w.numel())),  # the rule's metric: step or next token
        "hit1_step": hit_at_1(w, lo, hi),
        "exact_top3": top_k_share(w, error),
        "blame_before": before,
        "blame_at": at,
        "blame_after": after,
    }


def placebo_rows(nat: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Correct rollouts as pseudo-failures: the pseudo-error is the result of the equation with
    the index of the first failed row of the same prompt (the last equation if fewer)."""
    out = []
    for recs in nat.values():
        failed = [r for r in recs if "error" in r]
        if not failed:
            continue
        k = failed[0]["case"]["detail"]["equation"]
        for r in recs:
            if "error" in r or not r.get("equations"):
                continue
            s0, _, e0, e1 = r["equations"][min(k, len(r["equations"]) - 1)]
            out.append({**r, "error": e0, "error_end": e1, "step": [s0, e1], "placebo": True})
    return out


def natural_weights(recs: list[dict[str, Any]], name: str, signal: str, seed: int) -> list[Tensor]:
    """A = -1 weights of each row under method `name` with `signal` (oracle: gear_token on the
    indicator of the checker's first wrong equation, which a placebo row does not have)."""
    from gear.credit import CreditParams

    if name != "oracle":
        return method_weights(recs, -1.0, CreditParams(method=name, seed=seed), signal)
    ind = []
    for r in recs:
        x = [0.0] * len(r["ids"])
        if not r.get("placebo"):
            x[r["step"][0] : r["step"][1]] = [1.0] * (r["step"][1] - r["step"][0])
        ind.append({**r, "kl": x})
    return method_weights(ind, -1.0, CreditParams(method="gear_token"), "full")


def natural_eval(recs: list[dict[str, Any]], name: str, signal: str) -> list[dict[str, float]]:
    """Per-row metrics (random: averaged over RANDOM_SEEDS)."""
    seeds = RANDOM_SEEDS if name == "random" else (0,)
    per_seed = [
        [natural_row_metrics(w, r["error"], r["step"])
         for w, r in zip(natural_weights(recs, name, signal, s), recs, strict=True)]
        for s in seeds
    ]  # fmt: skip
    keys = per_seed[0][0].keys() if recs else []
    return [{k: _nanmean([ps[i][k] for ps in per_seed]) for k in keys} for i in range(len(recs))]


def _per_prompt(rows: list[dict[str, float]], recs: list[dict[str, Any]], key: str) -> dict:
    by: dict[str, list[float]] = {}
    for m, r in zip(rows, recs, strict=True):
        if math.isfinite(m[key]):
            by.setdefault(r["case"]["group"], []).append(m[key])
    return {g: sum(v) / len(v) for g, v in by.items()}


def _natural(nat: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The on-policy set: every metric per signal x method on the failed rows (real) and on the
    placebo rows, real - placebo per prompt, and the rule's D_loc (bootstrap over prompts)."""
    recs = [r for g in nat.values() for r in g]
    bad = [r for r in recs if "error" in r]
    good = [r for r in recs if "error" not in r]
    plc = placebo_rows(nat)
    out: dict[str, Any] = {
        "note": "on-policy failed rollouts (A = -1) of SmolLM2-135M-Instruct, temperature 1, "
        "arithmetic multistep + chain; first error = first arithmetically wrong equation; "
        "placebo = correct rollouts of the same prompts, A = -1, pseudo-error on the equation of "
        "the same index; intervals: 95% bootstrap over prompts",
        "prompts": len(nat),
        "rows": len(bad),
        "correct_rows": len(good),
        "placebo_rows": len(plc),
        "placebo_prompts": len({r["case"]["group"] for r in plc}),
        "levels": {
            lv: sum(r["case"]["detail"].get("level") == lv for r in bad)
            for lv in ("multistep", "chain")
        },
        "error_equation_index": {
            str(k): sum(r["case"]["detail"]["equation"] == k for r in bad) for k in range(4)
        },
        "truncated_rows": sum(bool(r["case"]["detail"].get("truncated")) for r in bad),
        "chance": _chance(bad),
        "methods": {},
        "placebo": {},
        "corrected": {},
    }
    if not bad:
        return out
    keys = ("L", "hit1_step", "exact_top3", "blame_before", "blame_at", "blame_after")
    combos = [(n, s) for s in NATURAL_SIGNALS for n in NATURAL_METHODS]
    combos += [(n, "full") for n in NATURAL_PLAIN]
    diffs: dict[str, dict[str, float]] = {}
    reals: dict[str, list[dict[str, float]]] = {}
    for name, signal in combos:
        label = name if signal == "full" or name in NATURAL_PLAIN else f"{name}[{signal}]"
        real, fake = natural_eval(bad, name, signal), natural_eval(plc, name, signal)
        reals[label] = real
        for target, rows, rr in ((out["methods"], real, bad), (out["placebo"], fake, plc)):
            target[label] = {}
            for k in keys:
                m, ci, n = bootstrap_ci([x[k] for x in rows], [r["case"]["group"] for r in rr])
                target[label][k], target[label][f"{k}_ci"] = m, ci
        pr, pp = _per_prompt(real, bad, "L"), _per_prompt(fake, plc, "L")
        diffs[label] = {g: pr[g] - pp[g] for g in pr if g in pp}
        m, ci, n = bootstrap_ci(list(diffs[label].values()))
        out["corrected"][label] = {"L": m, "L_ci": ci, "prompts": n}
        print(f"natural {label:18s} L {out['methods'][label]['L']:.3f} "
              f"placebo {out['placebo'][label]['L']:.3f}  real-placebo {m:+.3f} "
              f"[{ci[0]:+.3f}, {ci[1]:+.3f}] ({n} prompts)", flush=True)  # fmt: skip
    # Descriptive, on every failed row (no placebo, so positional effects are not removed):
    # paired per row, bootstrap over prompts.
    groups = [r["case"]["group"] for r in bad]
    out["paired_real"] = {}
    for a, b in (
        ("gear", "grpo"),
        ("gear", "random"),
        ("gear", "gear_token"),
        ("gear[k1]", "gear"),
        ("gear_token[k1]", "gear_token"),
        ("gear", "rlsd"),
        ("gear[k1]", "random[k1]"),
    ):
        out["paired_real"][f"{a}-{b}"] = {}
        for k in ("L", "exact_top3"):
            d = [x[k] - y[k] for x, y in zip(reals[a], reals[b], strict=True)]
            m, ci, _ = bootstrap_ci(d, groups)
            out["paired_real"][f"{a}-{b}"][k], out["paired_real"][f"{a}-{b}"][f"{k}_ci"] = m, ci
    shared = [g for g in diffs["gear"] if g in diffs["gear[k1]"]]
    m, ci, n = bootstrap_ci([diffs["gear[k1]"][g] - diffs["gear"][g] for g in shared])
    out["decision_input"] = {"failed_rows": len(bad), "d_loc": {"mean": m, "ci": ci, "prompts": n}}
    print(f"D_loc = gear[k1] - gear, placebo-corrected L: {m:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]")
    out["profile"] = {"offsets": list(range(-6, 7)), "kl_norm": profile(bad, "kl")}
    return out


def run_natural_metrics(args: argparse.Namespace) -> None:
    """Recompute only `natural` of localization.json from the on-policy cache."""
    nat = _load_cache(Path(args.cache) / "natural.pt")
    if not nat:
        sys.exit(f"no on-policy signals in {args.cache}; run the 'natural' stage first")
    path = RESULTS / "localization.json"
    payload = json.loads(path.read_text()) if path.is_file() else {}
    payload["natural"] = _natural(nat)
    path.write_text(json.dumps(_clean(payload), indent=1))
    print(f"wrote {path} (natural: {payload['natural']['rows']} failed rows)")


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Three panels: hit@1 and AUROC per method with 95% CIs, and the signals around the error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["methods"])
    ms = payload["methods"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for a, key, ref, title in (
        (ax[0], "hit1", payload["chance"]["step_token_share"], "hit@1 (top token in error step)"),
        (ax[1], "auroc", 0.5, "AUROC of w for 'at/after first error'"),
    ):
        y = [ms[n][key] for n in names]
        err = [[y[i] - ms[n][f"{key}_ci"][0] for i, n in enumerate(names)],
               [ms[n][f"{key}_ci"][1] - y[i] for i, n in enumerate(names)]]  # fmt: skip
        colors = ["tab:red" if n.startswith("gear") else "tab:gray" for n in names]
        a.bar(names, y, yerr=err, color=colors, capsize=3)
        a.axhline(ref, color="k", ls="--", lw=1, label="flat / chance")
        a.set_title(title)
        a.tick_params(axis="x", rotation=60)
        a.legend(fontsize=8)
    pr = payload["profile"]
    for key, label in (("kl_norm", "full KL (spec)"),
                       ("kl_norm_clean_row", "full KL, same problem's clean row"),
                       ("k1_norm", "k1 = log pS(y) - log pT(y)"),
                       ("entropy_norm", "student entropy")):  # fmt: skip
        ax[2].plot(pr["offsets"], pr[key], marker="o", label=label)
    ax[2].axvline(0, color="k", lw=1, ls=":")
    ax[2].set_xlabel("token offset from the first wrong token")
    ax[2].set_ylabel("per-row min-max normalised value")
    ax[2].set_title("signals around the injected error")
    ax[2].legend(fontsize=8)
    fig.suptitle(f"Credit localisation, {payload['cases']} injected errors, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def write_records(bad: list[dict], good: list[dict], run_dir: Path, n: int = 6) -> Path:
    """A sample as credit records (gear.viz.record) for `gear inspect`: step k = method k of
    (gear, gear_token, rlsd); rows = n corrupted (half per source) + 2 clean."""
    from gear.credit import CreditParams, credit_details
    from gear.models import smollm2_tokenizer
    from gear.viz.record import credit_record_path, credit_rows, write_credit_record

    tok = smollm2_tokenizer()
    pick = [r for r in bad if r["case"]["source"] == "arithmetic"][: n // 2]
    pick += [r for r in bad if r["case"]["source"] == "gsm8k"][: n - len(pick)]
    pick += good[:2]
    adv = torch.tensor([-1.0 if "error" in r else 1.0 for r in pick])
    b = _batch(pick)
    tokens = [[tok.decode([i]) for i in r["ids"]] for r in pick]
    for step, name in enumerate(("gear", "gear_token", "rlsd")):
        d = credit_details(adv, b["valid"], kl=b["kl"], entropy=b["entropy"],
                           student_logprobs=b["lp_s"], teacher_logprobs=b["lp_t"],
                           params=CreditParams(method=name))  # fmt: skip
        prompts = []
        for r in pick:
            c = r["case"]
            note = (f"[injected: {c['detail']['original']} -> {c['detail']['new']} at token "
                    f"{r['error']}, step tokens {r['step']}] " if "error" in r else "[clean] ")  # fmt: skip
            prompts.append(note + c["prompt"][-1]["content"])
        rows = credit_rows(
            d, tokens=tokens, rewards=[0.0 if "error" in r else 1.0 for r in pick],
            advantages=adv, prompts=prompts, completions=[r["case"]["completion"] for r in pick],
            step=step, method=name, kl=b["kl"], entropy=b["entropy"],
            token_ids=[r["ids"] for r in pick],
        )  # fmt: skip
        write_credit_record(credit_record_path(run_dir, step), rows)
    print(f"wrote credit records to {run_dir}/credit (gear inspect {run_dir})")
    return run_dir


def _ci(m: dict[str, Any], key: str) -> str:
    v, ci = m.get(key), m.get(f"{key}_ci")
    if v is None:
        return "n/a"
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and ci[0] is not None else f"{v:.3f}"


def run_table(args: argparse.Namespace) -> None:
    """Print the Markdown tables of BENCHMARKS.md from benchmarks/results/localization.json."""
    r = json.loads((RESULTS / "localization.json").read_text())
    print(f"{r['cases']} injected errors ({r['sources']}), {r['clean_rows']} clean rows\n")
    print("| method | hit@1 (step) | hit@1 (wrong number) | extra blame on/after step | "
          "AUROC at/after error | weight std, A > 0 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, m in r["methods"].items():
        print(f"| `{name}` | {_ci(m, 'hit1')} | {_ci(m, 'hit1_token')} | "
              f"{_ci(m, 'blame_after_share')} | {_ci(m, 'auroc')} | "
              f"{_ci(m, 'weight_spread_pos')} |")  # fmt: skip
    c = r["chance"]
    print(f"\nflat: step token share {c['step_token_share']:.3f}, "
          f"at/after-step token share {c['after_step_token_share']:.3f}\n")  # fmt: skip
    for est in ("k1", "k3"):
        for name, m in r["variants"][est].items():
            print(f"| `{name}` [{est}] | {_ci(m, 'hit1')} | {_ci(m, 'hit1_token')} | "
                  f"{_ci(m, 'blame_after_share')} | {_ci(m, 'auroc')} | "
                  f"{_ci(m, 'weight_spread_pos')} |")  # fmt: skip
    print()
    for k, v in r["paired"].items():
        print(f"{k}: " + ", ".join(f"{m} {d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
                                   for m, d in v.items()))  # fmt: skip
    print()
    for src in ("arithmetic", "gsm8k"):
        print(src, {n: (m[f"by_source_{src}"]["hit1"], m[f"by_source_{src}"]["auroc"])
                    for n, m in r["methods"].items()})  # fmt: skip
    best = sorted(r["sweep"], key=lambda x: -(x["hit1"] or 0))[:5]
    print("\nsweep best hit1:", best)
    print("sweep default:", [x for x in r["sweep"] if x["tau_onset"] == 0.1
                             and x["delta_entropy"] == 0.1])  # fmt: skip
    nat = r["natural"]
    print("\nnatural:", {k: v for k, v in nat.items() if k not in ("methods", "profile")})
    for name, m in nat.get("methods", {}).items():
        print(f"| `{name}` | {_ci(m, 'hit1')} | {_ci(m, 'hit1_token')} | "
              f"{_ci(m, 'blame_after_share')} | {_ci(m, 'auroc')} | "
              f"{_ci(m, 'weight_spread_pos')} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["signals", "natural", "natural-metrics", "metrics", "table"])
    ap.add_argument("--gsm8k", type=int, default=45, help="GSM8K problems (<= 5 errors each).")
    ap.add_argument("--arithmetic", type=int, default=150, help="Multistep problems (2 x 2 each).")
    ap.add_argument("--natural-prompts", type=int, default=40)
    ap.add_argument(
        "--placebo-set", action="store_true",
        help="natural: sample the placebo set (easier 1- and 2-digit prompts, correct rows only used).",
    )  # fmt: skip
    ap.add_argument("--placebo-prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="Samples per natural prompt.")
    ap.add_argument("--prompts-per-call", type=int, default=8, help="Prompts per generate call.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="1: faster than 2 on the shared CPU.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reverse", action="store_true", help="signals: a second worker, from the other end."
    )
    ap.add_argument("--cache", default=str(CACHE), help="Signal cache directory.")
    args = ap.parse_args()
    stages = {
        "signals": run_signals,
        "natural": run_natural,
        "natural-metrics": run_natural_metrics,
        "metrics": run_metrics,
    }
    stages["table"] = run_table
    stages[args.stage](args)


if __name__ == "__main__":
    main()

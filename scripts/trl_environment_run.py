"""GEAR on an environment that owns its data (TRL's `environment_factory`, no `train_dataset`).

    python scripts/trl_environment_run.py --steps 3                   # tiny random model, seconds
    python scripts/trl_environment_run.py --model smollm2 --steps 3   # SmolLM2-135M-Instruct

`Arithmetic.reset()` draws a sum, returns it as the prompt and sets `self.ground_truth`, which
GEARTrainer reads for that rollout's teacher hint (docs/trl.md, "Environments that own the
data"). GRPO compares the completions of a group, so the environment gives the
`num_generations` rollouts of a group the same problem (TRL resets the rollouts of a batch in
order, a group's rollouts one after the other); every other episode (`--unhinted-every`) can be
left without a ground truth to show the fallback (weight 1, counted in
gear/rows_without_ground_truth). Prints the first teacher prompt, then one JSON line per step.
The tiny model and tokenizer are built in code (`gear.testing`); SmolLM2 comes from gear's
cache (`scripts/setup.sh`); no download either way.
"""

from __future__ import annotations

import argparse
import importlib.resources
import itertools
import json
import os
import random
import re
import tempfile
import time
import warnings

from gear.integrations.trl import GEARConfig, GEARTrainer
from gear.testing import byte_tokenizer, fast_kwargs, tiny_model


class Arithmetic:
    """An environment that owns its data: each episode is a sum of two random integers."""

    ground_truth: str | None = None  # this episode's ground truth, set by reset()
    num_generations = 4  # rollouts per problem (set from the config below)
    unhinted_every = 0  # every n-th problem has no ground truth (0: none)
    _episodes = itertools.count()  # shared by every instance: the batch's reset order

    def reset(self, **kwargs) -> str:
        problem = next(Arithmetic._episodes) // self.num_generations
        rng = random.Random(problem)
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        self.answer = self.a + self.b
        unhinted = self.unhinted_every and problem % self.unhinted_every == self.unhinted_every - 1
        self.ground_truth = None if unhinted else f"{self.a} + {self.b} = {self.answer}"
        return f"What is {self.a} + {self.b}? Reply with the number only."


def closeness(completions, environments, **kwargs):
    """1 for the right sum, less the further the last number is from it, 0 without a number."""
    rewards = []
    for completion, env in zip(completions, environments, strict=True):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        guess = int(numbers[-1]) if numbers else None
        rewards.append(0.0 if guess is None else 1 / (1 + abs(guess - env.answer) / env.answer))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--problems", type=int, default=2, help="problems per step")
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--unhinted-every", type=int, default=0)
    parser.add_argument("--method", default="gear")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)

    if args.model == "tiny":
        tok = byte_tokenizer()
        model = tiny_model(tok, hidden=32, layers=2)
    else:
        from gear.models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer("smollm2")
        tok.padding_side = "left"
    # environment_factory needs a template that renders tool calls: TRL's Qwen2.5 (ChatML, as
    # SmolLM2's own)
    templates = importlib.resources.files("trl") / "chat_templates"
    tok.chat_template = (templates / "qwen2_5.jinja").read_text()
    Arithmetic.num_generations = args.generations
    Arithmetic.unhinted_every = args.unhinted_every

    with tempfile.TemporaryDirectory() as out:
        config = GEARConfig(
            **fast_kwargs(
                out,
                max_steps=args.steps,
                per_device_train_batch_size=args.problems * args.generations,
                num_generations=args.generations,
                max_completion_length=args.completion_length,
                learning_rate=5e-2 if args.model == "tiny" else 1e-5,
                shuffle_dataset=False,
            ),
            credit_method=args.method,
            hint_kind="math",  # 'auto' picks the tool hint whenever there is an environment
            credit_log_steps=0,
        )
        trainer = GEARTrainer(
            model=model,
            reward_funcs=closeness,
            args=config,
            processing_class=tok,
            environment_factory=Arithmetic,  # no train_dataset: the environment owns the data
        )
        trainer.accelerator.free_memory = lambda *objects: list(objects)
        real = trainer._teacher_prompts
        shown = []

        def show_first(prompts, ground_truths):
            built = real(prompts, ground_truths)
            if not shown:
                shown.append(tok.decode(built.ids[0]))
                print("first teacher prompt:\n" + shown[0] + "\n", flush=True)
            return built

        trainer._teacher_prompts = show_first
        t0 = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - t0

    keys = (
        "reward",
        "loss",
        "gear/kl_mean",
        "gear/weight_std_pos",
        "gear/weight_std_neg",
        "gear/frac_tokens_in_segments",
        "gear/rows_without_ground_truth",
        "gear/fallback_rows",
    )
    for log in trainer.state.log_history:
        if "step" in log and "loss" in log:
            # None: nothing measured that step (e.g. gear/kl_mean when every row tied)
            kept = {k: log[k] if log[k] is None else round(log[k], 4) for k in keys if k in log}
            row = {"step": log["step"]} | kept
            print("STEP " + json.dumps(row), flush=True)
    print(f"{args.steps} steps in {elapsed:.1f} s", flush=True)


if __name__ == "__main__":
    main()

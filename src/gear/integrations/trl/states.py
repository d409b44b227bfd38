"""The student's final hidden states of a generation batch: where they come from.

The signals (spec §1) need, at every completion position, the student's final hidden state (the
LM head's input). One `StudentStates` object per trainer decides, once per generation batch,
which of three sources gives them, and holds what it captured until the trainer takes it:

- "generation": read off transformers `generate`, one decoding step at a time (the states the
  tokens were sampled from): no extra forward.
- "trl_pass": read off TRL's own no-grad student pass (its `old_per_token_logps`), when TRL runs
  one anyway.
- "forward": one no-grad student forward on prompt + completion, run by the trainer
  (`forwards.Forwards.hidden`) when `take` has nothing captured.

The signals have eval-mode semantics: with active dropout the states of generation and of
TRL's pass (train mode) are not the student's, so the forward runs instead, in eval mode, as
the teacher's does. A capture that turns out unusable (the decoding loop did not make exactly
one call per completion token after the prompt, as with assisted generation) falls back to the
forward; every process takes the same decision, so sharded forwards pair up. A chunked prefill
(`prefill_chunk_size`) is fine: only the call that ends at the prompt's last token predicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gear.modeling import capture_final_hidden

if TYPE_CHECKING:
    from trl import GRPOTrainer

GENERATION, TRL_PASS, FORWARD = "generation", "trl_pass", "forward"
# generation settings under which `generate` does not make one call per sampled token
ASSISTED = ("assistant_model", "assistant_early_exit", "use_mtp", "prompt_lookup_num_tokens")


class StudentStates:
    """Captures the student's (B, T, H) final hidden states of one batch.

    Reads TRL's generation settings off the `GRPOTrainer` it serves (never GEAR's). Usage,
    per generation batch::

        with states.capturing(need=True):   # decides the source
            output = ...                      # TRL generates; `generate` / `trl_pass` capture
        hidden = states.take(output)          # captured, or None: run the student forward
    """

    def __init__(self, trainer: GRPOTrainer) -> None:
        self._trainer = trainer
        self.source: str | None = None  # the source of the batch being generated
        self._captured: Tensor | None = None

    # ----------------------------------------------------------------------------- decide

    def plan(self, need: bool) -> str | None:
        """The source for the next batch: None when no signal is needed."""
        t = self._trainer
        if not need:
            return None
        if dropout_active(t.accelerator.unwrap_model(t.model)):
            return FORWARD  # generation and TRL's pass ran in train mode
        generate_every = t.args.steps_per_generation * t.num_iterations
        trl_runs_student = t.args.gradient_accumulation_steps % generate_every != 0 or (
            t.use_vllm and t.vllm_importance_sampling_correction
        )
        if trl_runs_student:
            return TRL_PASS
        if self.reads_generation():
            return GENERATION
        return FORWARD

    def reads_generation(self) -> bool:
        """Whether `_generate_single_turn` is the plain transformers `generate` of whole
        completions, whose per-step final hidden states are the student's."""
        t = self._trainer
        return (
            t.args.student_hidden_from_generation
            and not t.use_vllm
            and not t.use_transformers_continuous_batching
            and t.rollout_func is None
            and not t.tools
            and t.environment_factories is None
            and not t._is_vlm
            and (getattr(t.generation_config, "num_beams", None) or 1) == 1
            and not any(getattr(t.generation_config, k, None) for k in ASSISTED)
            and not any((t.args.generation_kwargs or {}).get(k) for k in ASSISTED)
        )

    @contextmanager
    def capturing(self, need: bool) -> Iterator[None]:
        """Arm the capture of one batch's states for the duration of TRL's generation."""
        self._captured = None
        self.source = self.plan(need)
        try:
            yield
        finally:
            self.source = None  # captured states wait in `_captured` for `take`

    # ----------------------------------------------------------------------------- capture

    def generate(self, prompt_ids: list, run: Callable[[], Any]) -> Any:
        """Run TRL's single-turn generation (`run()`) of the prompt ids `prompt_ids`, keeping
        its per-step states when armed."""
        t = self._trainer
        if self.source != GENERATION or self._captured is not None:
            return run()
        with capture_hidden(t.accelerator, t.model, 1, detach=True, next_token=True) as steps:
            out = run()
        # One (B, 1, H) per model call: its last position predicts the next token. The prefill
        # (one call, or one per `prefill_chunk_size` chunk) ends at the padded prompt width P;
        # then one call per token. With synced_gpus (ZeRO-3 / FSDP) a finished rank keeps
        # stepping until all are done: its own steps come first. All ranks take the same path,
        # or sharded forwards would not pair up.
        completion_ids = out[0]
        longest = max((len(c) for c in completion_ids), default=0)
        first = _first_decoding_call(steps.lengths, self._prompt_width(prompt_ids))
        usable = (
            first is not None
            and 0 < longest <= len(steps) - first
            and all(n == 1 for n in steps.lengths[first + 1 : first + longest])
            and steps[0].shape[0] == len(completion_ids)
        )
        if self.on_every_process(usable):
            self._captured = torch.cat(steps[first : first + longest], dim=1)
        return out

    def _prompt_width(self, prompt_ids: list) -> int:
        """The width TRL left-pads a generation batch's prompts to (`pad_to_multiple_of`)."""
        width = max((len(p) for p in prompt_ids), default=0)
        multiple = getattr(self._trainer, "pad_to_multiple_of", None)
        return -(-width // multiple) * multiple if multiple else width

    def captures_trl_pass(self, model: nn.Module) -> bool:
        """Whether `trl_pass` on `model` now would read the student states off it."""
        return self.source == TRL_PASS and self._captured is None and model is self._trainer.model

    def trl_pass(self, model: nn.Module, logits_to_keep: int, run: Callable[[], Any]) -> Any:
        """Run TRL's per-token log-prob pass (`run()`); the first one on the policy, when armed,
        also gives the student states."""
        t = self._trainer
        if not self.captures_trl_pass(model):
            return run()
        with capture_hidden(t.accelerator, model, logits_to_keep, detach=True) as hidden:
            out = run()
        self._captured = torch.cat(hidden)
        return out

    def on_every_process(self, flag: bool) -> bool:
        """`flag` where every process holds it (a vote; one process: `flag`)."""
        accelerator = self._trainer.accelerator
        if accelerator.num_processes == 1:
            return flag
        votes = accelerator.gather(torch.tensor([float(flag)], device=accelerator.device))
        return bool(votes.min() > 0)

    # ----------------------------------------------------------------------------- take

    def take(self, output: dict[str, Any]) -> Tensor | None:
        """(B, T, H) captured student states of the batch `output`, padded to TRL's completion
        width T (`pad_to_multiple_of`); None when nothing was captured (source "forward")."""
        captured, self._captured = self._captured, None
        if captured is None:
            return None
        width = output["completion_ids"].shape[1]
        return torch.nn.functional.pad(captured, (0, 0, 0, width - captured.shape[1]))


# --------------------------------------------------------------------------------- capture


class Captured(list):
    """The states captured from each forward (a list of (B, n, H) tensors), and `lengths`:
    each forward's input length."""

    lengths: list[int]


@contextmanager
def capture_hidden(
    accelerator: Any, model: nn.Module, n_keep: int, detach: bool, next_token: bool = False
) -> Iterator[Captured]:
    """Collect, from each forward, the final hidden states that predict its last `n_keep`
    tokens (or, with `next_token`, the one that predicts the token after the input)."""
    captured = Captured()
    captured.lengths = []
    positions = slice(-1, None) if next_token else slice(-n_keep - 1, -1)

    def keep(hidden: Tensor) -> Tensor:
        captured.lengths.append(hidden.shape[1])
        # a copy of the slice: a view would keep the whole (B, P + C, H) output alive
        hidden = hidden[:, positions]
        captured.append(hidden.detach().clone() if detach else hidden.clone())
        return captured[-1]

    with capture_final_hidden(accelerator.unwrap_model(model), keep):
        yield captured


def _first_decoding_call(lengths: list[int], prompt_width: int) -> int | None:
    """Index of the call whose last position predicts the first completion token: the one
    where the prefill's calls add up to the prompt width; None when no call ends there."""
    total = 0
    for i, n in enumerate(lengths):
        total += n
        if total == prompt_width:
            return i
        if total > prompt_width:
            return None
    return None


def dropout_active(model: nn.Module) -> bool:
    """Whether a forward of `model` now would drop anything (train mode and a dropout > 0)."""
    if not model.training:
        return False
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training:
            return True
        for name in ("attention_dropout", "attn_dropout", "dropout_rate"):  # functional dropout
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0 and module.training:
                return True
    return False


# Sampling settings that reshape the distribution tokens are drawn from (TRL's config fields and
# keys of `generation_kwargs`, which override them), with their neutral values. GEAR's pi_S is
# softmax(logits / T) over the whole vocabulary (spec §1), so under any of these the signals
# describe a distribution the tokens were not sampled from (docs/vllm.md).
SAMPLING_SHAPERS: dict[str, tuple] = {
    "top_p": (1.0, None),
    "top_k": (0, -1, None),
    "min_p": (0.0, None),
    "repetition_penalty": (1.0, None),
    "typical_p": (1.0, None),
    "presence_penalty": (0.0, None),
    "frequency_penalty": (0.0, None),
    "no_repeat_ngram_size": (0, None),
}


def sampling_shapers(args: Any) -> dict[str, Any]:
    """The settings in effect (`generation_kwargs` over the config's fields) that change the
    sampling distribution away from softmax(logits / T): name -> value, empty when none."""
    overrides = args.generation_kwargs or {}
    found = {}
    for name, neutral in SAMPLING_SHAPERS.items():
        value = overrides.get(name, getattr(args, name, None))
        if value not in neutral:
            found[name] = value
    return found


def sampling_temperature(trainer: Any) -> float:
    """The temperature generation sampled with: `generation_kwargs` override the config's
    `temperature`; greedy decoding (`do_sample=False`, or temperature 0 in vLLM) is scored at
    temperature 1, the model's own distribution."""
    overrides = trainer.args.generation_kwargs or {}
    temperature = overrides.get("temperature", trainer.temperature)
    greedy = overrides.get("do_sample", True) is False and not trainer.use_vllm
    if greedy or temperature is None or temperature == 0:
        return 1.0
    return float(temperature)

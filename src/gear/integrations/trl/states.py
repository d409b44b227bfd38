"""The student's final hidden states of a generation batch: where they come from.

The signals (spec §1) need, at every completion position, the student's final hidden state (the
LM head's input). One `StudentStates` object per trainer decides, once per generation batch,
which of three sources gives them, and holds what it captured until the trainer takes it:

- "generation": read off transformers `generate`, one decoding step at a time (the states the
  tokens were sampled from): no extra forward.
- "trl_pass": read off TRL's own no-grad student pass (its `old_per_token_logps`), when TRL runs
  one anyway.
- "forward": one no-grad student forward on prompt + completion (`final_hidden`).

A capture that turns out unusable (the decoding loop did not make one call per token) falls
back to the forward; every process takes the same decision, so sharded forwards pair up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from trl.models.utils import disable_gradient_checkpointing

if TYPE_CHECKING:
    from gear.integrations.trl.trainer import GEARTrainer

GENERATION, TRL_PASS, FORWARD = "generation", "trl_pass", "forward"


class StudentStates:
    """Captures (or computes) the student's (B, T, H) final hidden states of one batch.

    Usage, per generation batch::

        with states.capturing(need=True):   # decides the source
            output = ...                      # TRL generates; `generate` / `trl_pass` capture
        hidden = states.take(output, batch_size)   # captured, or one forward
    """

    def __init__(self, trainer: GEARTrainer) -> None:
        self._trainer = trainer
        self.source: str | None = None  # the source of the batch being generated
        self._captured: Tensor | None = None

    # ----------------------------------------------------------------------------- decide

    def plan(self, need: bool) -> str | None:
        """The source for the next batch: None when no signal is needed."""
        t = self._trainer
        if not need:
            return None
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
            and getattr(t.generation_config, "prompt_lookup_num_tokens", None) is None
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

    def generate(self, run: Callable[[], Any]) -> Any:
        """Run TRL's single-turn generation (`run()`), keeping its per-step states when armed."""
        t = self._trainer
        if self.source != GENERATION or self._captured is not None:
            return run()
        with capture_hidden(t.accelerator, t.model, 1, detach=True, next_token=True) as steps:
            out = run()
        # One (B, 1, H) per decoding step, position t predicting completion token t. With
        # synced_gpus (ZeRO-3 / FSDP) a finished rank keeps stepping until all are done: its own
        # steps come first. All ranks take the same path, or sharded forwards would not pair up.
        completion_ids = out[0]
        longest = max((len(c) for c in completion_ids), default=0)
        usable = 0 < longest <= len(steps) and steps[0].shape[0] == len(completion_ids)
        if self._on_every_process(usable):
            self._captured = torch.cat(steps[:longest], dim=1)
        return out

    def trl_pass(self, model: nn.Module, logits_to_keep: int, run: Callable[[], Any]) -> Any:
        """Run TRL's per-token log-prob pass (`run()`); the first one on the policy, when armed,
        also gives the student states."""
        t = self._trainer
        if self.source != TRL_PASS or self._captured is not None or model is not t.model:
            return run()
        with capture_hidden(t.accelerator, model, logits_to_keep, detach=True) as hidden:
            out = run()
        self._captured = torch.cat(hidden)
        return out

    def _on_every_process(self, flag: bool) -> bool:
        accelerator = self._trainer.accelerator
        if accelerator.num_processes == 1:
            return flag
        votes = accelerator.gather(torch.tensor([float(flag)], device=accelerator.device))
        return bool(votes.min() > 0)

    # ----------------------------------------------------------------------------- take

    def take(self, output: dict[str, Any], batch_size: int) -> tuple[Tensor, bool]:
        """(B, T, H) student states of the batch `output`, and whether a forward computed them.

        Captured states are padded to TRL's completion width (`pad_to_multiple_of`)."""
        t = self._trainer
        captured, self._captured = self._captured, None
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        width = completion_ids.shape[1]
        if captured is not None:
            return torch.nn.functional.pad(captured, (0, 0, 0, width - captured.shape[1])), False
        hidden = t._final_hidden(
            t.model,
            torch.cat([output["prompt_ids"], completion_ids], dim=1),
            torch.cat([output["prompt_mask"], completion_mask], dim=1),
            width,
            batch_size,
        )
        return hidden, True


# --------------------------------------------------------------------------------- forwards


@contextmanager
def capture_hidden(
    accelerator: Any, model: nn.Module, n_keep: int, detach: bool, next_token: bool = False
) -> Iterator[list[Tensor]]:
    """Collect, from each forward, the final hidden states that predict its last `n_keep`
    tokens (or, with `next_token`, the one that predicts the token after the input)."""
    captured: list[Tensor] = []
    positions = slice(-1, None) if next_token else slice(-n_keep - 1, -1)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        hidden = hidden[:, positions]
        if next_token:  # a copy: a view would keep the prefill's (B, P, H) states alive
            hidden = hidden.clone()
        captured.append(hidden.detach() if detach else hidden)

    handle = backbone(accelerator.unwrap_model(model)).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def final_hidden(
    accelerator: Any,
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    n_keep: int,
    batch_size: int | None = None,
    grad: bool = False,
    gradient_checkpointing_kwargs: dict | None = None,
) -> Tensor:
    """(B, n_keep, H) final hidden states at the positions predicting the last n_keep tokens.

    Runs the root module (so DDP / DeepSpeed / PEFT hooks fire) with `logits_to_keep=1`
    and reads the backbone's output; rows go in chunks of `batch_size`, like TRL's passes.
    """
    batch_size = batch_size or input_ids.size(0)
    unwrapped = accelerator.unwrap_model(model)
    no_checkpointing = (
        disable_gradient_checkpointing(unwrapped, gradient_checkpointing_kwargs)
        if not grad and checkpointing(unwrapped)
        else nullcontext()
    )
    chunks = []
    with no_checkpointing:
        for start in range(0, input_ids.size(0), batch_size):
            stop = start + batch_size
            with (
                capture_hidden(accelerator, model, n_keep, detach=not grad) as hidden,
                accelerator.autocast(),
            ):
                model(
                    input_ids=input_ids[start:stop],
                    attention_mask=attention_mask[start:stop],
                    logits_to_keep=1,
                    use_cache=False,
                )
            chunks.append(hidden[-1])
    return torch.cat(chunks)


def backbone(model: nn.Module) -> nn.Module:
    """The decoder whose output is the final hidden state (as TRL's fused LM head reads it)."""
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model.base_model


def checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, without transformers' rename warning."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)

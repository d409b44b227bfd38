"""GEAR's actor worker: verl's `ActorRolloutRefWorker` with the teacher pass inside the actor
process (where the FSDP shards live).

Two entry points, both running verl's own micro-batching (`TrainingWorker.infer_batch`:
``use_dynamic_bsz`` with ``log_prob_max_token_len_per_gpu``, else
``log_prob_micro_batch_size_per_gpu``; ``use_remove_padding``; the same number of micro-batches
on every data-parallel rank) with GEAR's step hooked into each micro-batch:

- ``compute_log_prob`` (verl's old-log-prob pass): when the batch carries ``gear_signals=True``
  (GEAR's trainer sets it), each micro-batch's student forward is verl's own; a hook on the
  model's backbone keeps only the final hidden states that predict response tokens, and one
  teacher forward (teacher prompt ⊕ the same response ids) follows. No second student forward.
- ``compute_gear_signals``: where verl runs no old-log-prob forward (rollout correction's bypass
  mode), one student forward of ours per micro-batch, then the teacher forward.

With ``gear_contrast=True`` (``teacher_context: contrast``) the rows also carry
``gear_contrast_prompts`` (each row's prompt with a wrong answer) and a second group of teacher
forwards follows the first in each micro-batch; its KL lands as ``gear_contrast_kl``.

Rows the trainer marks unscored (``gear_scored`` False: their sequence advantage is 0, every
completion of the prompt tied, `skip_zero_advantage_rows`) get no teacher or contrast forward,
none of our student forwards and no signal kernel; their signals are written as zeros. The
number of teacher forwards is still agreed across data-parallel ranks (one-token dummies).

A method that reads no teacher signal (``gear_entropy_top``) sends ``gear_teacher=False`` and no
teacher prompts: no teacher forward runs, and only ``gear_entropy`` and ``gear_student_logprobs``
are written.

Either way the signals come from final hidden states and the LM head, a chunk of logits at a time
(`gear.integrations.verl.teacher_pass`), and land in the batch as ``gear_kl``, ``gear_entropy``,
``gear_student_logprobs``, ``gear_teacher_logprobs`` (jagged float32 over each response).

Supported: FSDP / FSDP2 actors, text-only models. Ulysses sequence parallelism is rejected with
an error (`validate_verl_config` before Ray starts; here again for a worker configured otherwise):
its forwards hold a shard of each sequence's hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker, _with_routing_replay_flag

from gear.integrations.verl.estimators import OUTPUT_FIELDS
from gear.integrations.verl.teacher_pass import (
    FUSED_KEY,
    TeacherPassOptions,
    _rows,
    micro_batch_signals,
    nested,
)

#: batch key (non-tensor) -> TeacherPassOptions field
OPTION_KEYS = {
    "teacher": "gear_teacher",
    "contrast": "gear_contrast",
    "temperature": "gear_temperature",
    "estimator": "gear_estimator",
    "topk": "gear_topk",
    "chunk_size": "gear_chunk_size",
    "micro_batch_size": "gear_micro_batch_size",
    "pad_token_id": "gear_pad_token_id",
}
INPUT_FIELDS = ("input_ids", "prompts", "responses")
TEACHER_FIELD = "gear_teacher_prompts"  # with options.teacher only
CONTRAST_FIELD = "gear_contrast_prompts"  # with options.contrast only
#: (N,) bool, the rows the credit method reads (absent: every row); the trainer's tie decision
SCORED_FIELD = "gear_scored"


def _get(data: Any, key: str, default: Any = None) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get(data, key, default)


def options_from(data: Any, max_token_len: int | None = None) -> TeacherPassOptions:
    """The teacher-pass options carried in the batch's non-tensor data."""
    defaults = TeacherPassOptions()
    values = {name: _get(data, key, getattr(defaults, name)) for name, key in OPTION_KEYS.items()}
    return TeacherPassOptions(
        teacher=bool(values["teacher"]),
        contrast=bool(values["contrast"]),
        temperature=float(values["temperature"]),
        estimator=str(values["estimator"]),
        topk=int(values["topk"]),
        chunk_size=int(values["chunk_size"]),
        micro_batch_size=int(values["micro_batch_size"]),
        pad_token_id=int(values["pad_token_id"]),
        max_token_len=max_token_len,
    )


def _check_inputs(data: Any, teacher: bool, contrast: bool = False) -> None:
    needed = (
        *INPUT_FIELDS,
        *([TEACHER_FIELD] if teacher else []),
        *([CONTRAST_FIELD] if contrast else []),
    )
    missing = [k for k in needed if k not in data]
    if missing:
        raise KeyError(
            f"GEAR teacher pass: the batch lacks {missing}; fields present: {sorted(data.keys())}"
        )


def max_over_ranks(n: int, group: Any, device: Any) -> int:
    """The largest n over the data-parallel group (n itself outside torch.distributed)."""
    if group is None or not torch.distributed.is_initialized():
        return n
    count = torch.tensor([n], dtype=torch.long, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(count.item())


@contextlib.contextmanager
def gear_micro_batches(
    engine: Any, options: TeacherPassOptions, student_from_verl: bool
) -> Iterator[None]:
    """While open, each micro-batch step of verl's `engine` (``forward_step``) also computes
    GEAR's signals for its rows and adds them to the step's ``model_output`` (verl then
    concatenates the micro-batches and undoes dynamic batching's reordering, as for log-probs).

    student_from_verl: run verl's own forward (old log-probs) and capture its final hidden
        states; else one student forward of ours (``logits_to_keep=1``) replaces verl's step.
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    from gear.integrations.verl.teacher_pass import capture_rows, model_inputs, response_index

    if getattr(engine, "use_ulysses_sp", False):
        raise NotImplementedError(
            "GEAR's verl teacher pass does not support Ulysses sequence parallelism "
            "(ulysses_sequence_parallel_size > 1): set it to 1"
        )
    module = engine.module
    original = engine.forward_step
    group = engine.get_data_parallel_group() if hasattr(engine, "get_data_parallel_group") else None
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)

    def autocast() -> contextlib.AbstractContextManager:
        device_type = torch.device(get_device_name()).type
        if dtype == torch.float32 or device_type == "cpu":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=dtype)

    def sync(n: int) -> int:
        return max_over_ranks(n, group, get_device_id())

    def forward_step(micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if not forward_only:
            raise RuntimeError("GEAR's teacher pass runs in forward-only (inference) passes")
        remove_padding = bool(
            tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        )
        ids = micro_batch["input_ids"]
        seqs, responses = _rows(ids), _rows(micro_batch["responses"])
        teacher_prompts = _rows(micro_batch[TEACHER_FIELD]) if options.teacher else None
        contrast_prompts = _rows(micro_batch[CONTRAST_FIELD]) if options.contrast else None
        scored = (
            micro_batch[SCORED_FIELD].reshape(-1).bool() if SCORED_FIELD in micro_batch else None
        )
        r_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
        prompts = [s[: s.numel() - r.numel()] for s, r in zip(seqs, responses, strict=True)]
        if student_from_verl:
            # verl packs (use_remove_padding) or right-pads the rows exactly like model_inputs
            layout = model_inputs(seqs, remove_padding, 0) if seqs else None
            index = (
                response_index(layout.starts, layout.lengths, r_len)
                if layout is not None
                else torch.zeros(0, dtype=torch.long)
            )
            with capture_rows(module, index) as student:
                loss, output = original(micro_batch, loss_function, forward_only)
            if len(student) != 1:
                raise RuntimeError(
                    f"GEAR teacher pass: expected one backbone forward per micro-batch in verl's "
                    f"step, saw {len(student)}"
                )
            hidden = student[0]
        else:
            hidden = None
            loss = torch.tensor(1.0)
            output = {"model_output": {}, "loss": 1.0, "metrics": {}}
        signals = micro_batch_signals(
            module,
            hidden,
            prompts,
            teacher_prompts,
            responses,
            options,
            remove_padding,
            device=get_device_id(),
            autocast=autocast,
            sync=sync,
            contrast_prompts=contrast_prompts,
            scored=scored,
        )
        if responses:
            for name, values in signals.items():  # without a teacher: entropy, log-probs
                output["model_output"][OUTPUT_FIELDS[name]] = nested(values)
        return loss, output

    engine.forward_step = forward_step  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        del engine.forward_step


def gear_infer(training_worker: Any, data: Any, student_from_verl: bool) -> Any:
    """verl's `TrainingWorker.infer_batch` with GEAR's step in every micro-batch."""
    engine = training_worker.engine
    options = options_from(data, _max_tokens_of(training_worker, data))
    _check_inputs(data, options.teacher, options.contrast)
    with gear_micro_batches(engine, options, student_from_verl):
        return training_worker.infer_batch(data)


def _max_tokens_of(training_worker: Any, data: Any) -> int | None:
    """verl's per-forward token budget for this inference pass (None without dynamic bsz)."""
    cfg = training_worker.engine_config
    dynamic = _get(data, "use_dynamic_bsz", cfg.use_dynamic_bsz)
    if not dynamic:
        return None
    budget = _get(data, "max_token_len_per_gpu", cfg.infer_max_token_len_per_gpu)
    return int(budget) if budget is not None else None


class GearActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker with GEAR's teacher pass (see the module doc)."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    @_with_routing_replay_flag(enabled=True)
    def compute_log_prob(self, data: Any) -> Any:
        """verl's old-log-prob pass; with ``gear_signals=True`` also GEAR's signals, from the
        final hidden states of the very same student forwards."""
        if bool(_get(data, FUSED_KEY, False)):
            output = gear_infer(self.actor, data, student_from_verl=True)
        else:
            output = self.actor.infer_batch(data)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_gear_signals(self, data: Any) -> Any:
        """GEAR's signals with one student forward of ours (verl ran no old-log-prob pass)."""
        from verl.utils import tensordict_utils as tu

        if self.actor is None:
            raise RuntimeError("compute_gear_signals: this worker has no actor model")
        tu.assign_non_tensor(data, compute_loss=False, calculate_entropy=False)
        output = gear_infer(self.actor, data, student_from_verl=False)
        if output is None:
            return None
        return output.select(*(k for k in OUTPUT_FIELDS.values() if k in output)).cpu()

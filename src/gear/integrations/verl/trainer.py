"""GEAR's verl trainer: verl's synchronous v1 PPO trainer (`PPOTrainerSync`) plus the teacher pass
and the plumbing of the per-token signals into the advantage estimator.

Registered as ``trainer.v1.trainer_mode=gear_sync``. It behaves as verl's ``sync`` mode (the
instance's ``trainer_mode`` is set back to ``sync`` so verl's replay buffer and checkpoint logic
are unchanged) with four small, documented overrides:

- ``_init_tokenizer``: also keeps the model's ``model_type`` (selects verl's prompt renderer).
- ``_init_resource_pool_mgr``: the actor role runs `GearActorRolloutRefWorker` instead of verl's
  `ActorRolloutRefWorker` (its ``compute_log_prob`` can run the teacher pass, plus
  ``compute_gear_signals``).
- ``_compute_old_log_prob``: marks the rows whose GRPO sequence advantage is 0 (a tied group,
  from verl's rewards and uids, final before this pass) as ``gear_scored`` = False: no teacher
  work is done on them (``gear.skip_zero_advantage_rows``); builds each row's teacher prompt
  (prompt + hint with the ground truth, same renderer, same tools), then runs verl's pass with
  ``gear_signals=True``: the actor
  workers capture the final hidden states of verl's own student forwards and run one teacher
  forward per micro-batch (rollout correction's bypass mode, where verl runs no forward:
  ``compute_gear_signals``, one student forward of GEAR's). The signals land in the batch as
  ``gear_kl``, ``gear_entropy``, ``gear_student_logprobs``, ``gear_teacher_logprobs``. With
  ``gear.teacher_context: contrast`` each row also gets a prompt showing a wrong answer, a second
  teacher forward runs on it, and its KL lands as ``gear_contrast_kl``.
- ``_compute_advantage``: opens a `gear_batch` context with those signals (padded exactly like
  the batch verl builds) around verl's own ``_compute_advantage``, whose estimator call then finds
  them (rows without a hint, marked by ``gear_has_hint``, get NaN teacher signals: weight 1,
  counted in ``gear/fallback_rows``, spec §4) and the rows scored; logs the spec §5 statistics
  (over the scored rows; ``gear/rows_skipped`` counts the others, verl's padding rows aside)
  and, when due, writes a credit record (skipped rows marked).

Tool observation tokens (``response_mask`` = 0 in verl's agent loop) are part of both forwards
(the teacher scores exactly the rollout's tokens) and excluded from every statistic and weight by
the mask, as spec §1-2 say.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import torch
import transfer_queue as tq
from omegaconf import open_dict
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker

from gear.credit.methods import STEP_SEEDED
from gear.credit.signals import without_teacher
from gear.integrations.verl.config import (
    TRAINER_MODE,
    answer_values,
    train_files,
    validate_verl_config,
)
from gear.integrations.verl.estimators import (
    OUTPUT_FIELDS,
    SIGNAL_FIELDS,
    GearBatch,
    gear_batch,
    grpo_advantages,
)
from gear.integrations.verl.teacher_inputs import TOOL_AGENT, as_messages, build_teacher_prompts
from gear.integrations.verl.teacher_pass import FUSED_KEY, _rows, nested
from gear.teacher import check_wrong_answers, offset_answer, wrong_answers

logger = logging.getLogger(__name__)
TEACHER_PROMPTS_FIELD = "gear_teacher_prompts"
#: the contrast teacher's prompts (a wrong answer), with teacher_context: contrast only
CONTRAST_PROMPTS_FIELD = "gear_contrast_prompts"
#: (N,) bool, False for rows whose teacher prompt has no hint (no ground truth, or padding)
HAS_HINT_FIELD = "gear_has_hint"
#: (N,) bool, the rows the pass scores: a non-zero sequence advantage (skip_zero_advantage_rows)
SCORED_FIELD = "gear_scored"
#: what GEAR's own student + teacher pass reads (verl's bypass mode)
GEAR_INPUT_FIELDS = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "prompts",
    "responses",
    TEACHER_PROMPTS_FIELD,
)
TRAINER_MARK = "__gear_trainer__"


def _non_tensor(td: Any, key: str, n: int) -> list[Any]:
    """Field `key` of n rows as a list (a value shared by all rows is repeated)."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    raw = td.get(key)
    if isinstance(raw, NonTensorData):
        return [raw.data] * n
    value = raw.tolist() if isinstance(raw, NonTensorStack) else raw
    if isinstance(value, torch.Tensor):
        return list(value.unbind()) if value.is_nested else list(value)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return list(value)


def _tags(batch: Any) -> list[dict]:
    """Each row's tag (verl marks its padding rows ``is_padding``); {} where the batch has none."""
    return list(batch.tags) if batch.tags else [{}] * len(batch.keys)


def session_info(keys: list[str]) -> tuple[list[str], torch.Tensor]:
    """Session label and final-output flag of each row, from v1 keys ``{uid}_{session}_{index}``.

    verl's agent loops may write several outputs per session; only the last one enters GRPO's
    group statistics (as in verl's own GRPO path), and its advantage is shared by the session.
    """
    sessions, indices = [], []
    for key in keys:
        parts = key.rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            return list(keys), torch.ones(len(keys), dtype=torch.bool)
        sessions.append(f"{parts[0]}_{parts[1]}")
        indices.append(int(parts[2]))
    last: dict[str, int] = {}
    for s, i in zip(sessions, indices, strict=True):
        last[s] = max(last.get(s, i), i)
    final = torch.tensor(
        [last[s] == i for s, i in zip(sessions, indices, strict=True)], dtype=torch.bool
    )
    return sessions, final


class GearPPOTrainer(PPOTrainerSync):
    """verl's sync v1 trainer with GEAR's teacher pass and credit assignment (see module doc)."""

    def __init__(self, config: Any):
        self.gear_settings = validate_verl_config(config, check_files=False)
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"  # verl's sync behaviour; the class is ours
        self._gear_hf_model_type: str | None = None
        self._gear_render: Any = None
        self._gear_tool_schemas: dict[str, dict] | None = None
        self._gear_next_record_step = 0
        # teacher_context: contrast: the training files' answers, a wrong answer's pool
        g = self.gear_settings.gear
        self._gear_answer_pool = (
            check_wrong_answers(answer_values(g.hint_field, train_files(config)))
            if self.gear_settings.params.contrast
            else []
        )
        super().__init__(config)

    # --------------------------------------------------------------------- setup overrides

    def _init_tokenizer(self) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        model_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.model)
        self.tokenizer = model_config.tokenizer
        self.processor = model_config.processor
        model_type = getattr(model_config.hf_config, "model_type", None)
        self._gear_hf_model_type = model_type if isinstance(model_type, str) else None

    def _init_resource_pool_mgr(self) -> None:
        # imported here: worker.py imports verl, whose plugin hook imports this module
        from gear.integrations.verl.worker import GearActorRolloutRefWorker

        super()._init_resource_pool_mgr()
        for role, cls in list(self.role_worker_mapping.items()):
            inner = getattr(cls, "__ray_actor_class__", cls)
            if inner is ActorRolloutRefWorker and "actor" in str(role).lower():
                self.role_worker_mapping[role] = ray.remote(GearActorRolloutRefWorker)

    # --------------------------------------------------------------------- teacher pass

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if not self.gear_settings.needs_signals:
            return super()._compute_old_log_prob(batch, metrics)
        teacher = self.gear_settings.needs_teacher  # entropy_top: the student's signals alone
        skip = self.gear_settings.skips_tied_rows
        if skip:  # rows whose advantage is 0 whatever the signals: no teacher work on them
            self._put_scored_rows(batch, metrics)
        if teacher:  # every row's (the contrast's wrong answers are drawn in row order)
            self._put_teacher_prompts(batch, metrics)
        options = self._gear_pass_options(teacher)
        t0 = time.perf_counter()
        rollout_corr = self.config.algorithm.get("rollout_correction", None)
        if rollout_corr and rollout_corr.get("bypass_mode", False):
            # verl runs no old-log-prob forward: GEAR runs one student forward of its own
            batch = super()._compute_old_log_prob(batch, metrics)
            contrast = self.gear_settings.params.contrast
            meta = dataclasses.replace(
                batch,
                fields=[f for f in GEAR_INPUT_FIELDS if teacher or f != TEACHER_PROMPTS_FIELD]
                + ([CONTRAST_PROMPTS_FIELD] if contrast else [])
                + ([SCORED_FIELD] if skip else []),
                extra_info={**(batch.extra_info or {}), **options},
            )
            self.actor_rollout_wg.compute_gear_signals(meta)
            metrics["timing_s/gear_teacher_pass"] = time.perf_counter() - t0
        else:
            # verl's old-log-prob forwards are the student's: the worker captures their final
            # hidden states and runs the teacher forward micro-batch by micro-batch
            batch.extra_info.update({**options, FUSED_KEY: True})
            try:
                out = super()._compute_old_log_prob(batch, metrics)
            finally:
                for key in (*options, FUSED_KEY):  # not for verl's later passes (ref log-probs)
                    batch.extra_info.pop(key, None)
            if out is not batch and getattr(out, "extra_info", None):
                for key in (*options, FUSED_KEY):
                    out.extra_info.pop(key, None)
            batch = out
            # one pass: verl's old log-probs with GEAR's teacher forwards interleaved
            metrics["timing_s/gear_old_log_prob_and_teacher_pass"] = time.perf_counter() - t0
        return batch

    def _put_scored_rows(self, batch: Any, metrics: dict) -> None:
        """Decide which rows the pass scores and put it into the batch as ``gear_scored``: those
        whose GRPO sequence advantage is not 0. verl's rewards are final here: ``rm_scores`` is
        written at sampling time (its reward loop) or by its colocated reward step, both before
        the old-log-prob pass; later only ``algorithm.use_kl_in_reward`` changes the reward
        (then every row is scored: `skips_tied_rows`), while rollout correction changes the
        response mask only. The advantage is computed as GEAR's estimator will compute it, on
        the same inputs (`_sequence_advantages`), so the rows of a tied group (every completion
        of the prompt scored alike; a session's rows share its final output's advantage) and
        verl's padding rows (reward 0, a group of their own) are skipped, and no row with a
        non-zero advantage is (the estimator checks it)."""
        t0 = time.perf_counter()
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "rm_scores"]
        )
        uids = _non_tensor(data, "uid", len(batch.keys))
        scored = self._sequence_advantages(data["rm_scores"], uids, batch) != 0
        tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict({SCORED_FIELD: scored}, batch_size=[len(batch.keys)]),
        )
        metrics["timing_s/gear_scored_rows"] = time.perf_counter() - t0

    def _sequence_advantages(self, rm_scores: torch.Tensor, uids: list[Any], batch: Any) -> Any:
        """(N,) the GRPO sequence advantages GEAR's estimator computes from verl's batch: the
        (N, R) rewards padded as verl pads them (its ``token_level_rewards`` without a KL
        penalty), summed per row, grouped by uid and session (`grpo_advantages`)."""
        rewards = rm_scores.to_padded_tensor(0.0) if rm_scores.is_nested else rm_scores
        sessions, final = self._sessions(batch)
        s = self.gear_settings
        return grpo_advantages(
            rewards.sum(dim=-1),
            uids,
            epsilon=s.gear.grpo_epsilon,
            norm_adv_by_std=s.norm_adv_by_std,
            final=final,
            sessions=sessions,
        )

    @staticmethod
    def _sessions(batch: Any) -> tuple[list[str] | None, torch.Tensor | None]:
        """The rows' sessions and final-output flags (`session_info`), None when every row is
        its session's final output."""
        sessions, final = session_info(list(batch.keys))
        return (None, None) if bool(final.all()) else (sessions, final)

    def _gear_renderer(self) -> Any:
        """(messages, tools) -> prompt ids, through the renderer verl's agent loops use."""
        if self._gear_render is None:
            if self.processor is not None:
                raise NotImplementedError(
                    "GEAR's verl integration supports text-only models (this model has a multimodal processor)"
                )
            from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

            kwargs = dict(self.config.data.get("apply_chat_template_kwargs", {}) or {})
            builder = create_continuous_token_builder(
                self.tokenizer, hf_model_type=self._gear_hf_model_type, chat_template_kwargs=kwargs
            )

            def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
                return list(builder.build_initial_tokens(messages, tools=tools))

            self._gear_render = render
        return self._gear_render

    def _gear_tools(self) -> dict[str, dict]:
        """Tool name -> schema, loaded the way verl's agent loop loads them."""
        if self._gear_tool_schemas is None:
            multi_turn = self.config.actor_rollout_ref.rollout.multi_turn
            tool_path, fn_path = (
                multi_turn.get("tool_config_path"),
                multi_turn.get("function_tool_path"),
            )
            schemas: dict[str, dict] = {}
            if tool_path or fn_path:
                from verl.tools.tool_registry import load_all_tools
                from verl.utils.import_utils import resolve_config_path

                for tool in load_all_tools(
                    tool_config_path=resolve_config_path(tool_path) if tool_path else None,
                    function_tool_path=resolve_config_path(fn_path) if fn_path else None,
                ):
                    schemas[tool.name] = tool.tool_schema.model_dump(
                        exclude_unset=True, exclude_none=True
                    )
            self._gear_tool_schemas = schemas
        return self._gear_tool_schemas

    def _tools_for_row(self, row: Mapping[str, Any]) -> list[dict] | None:
        """The schemas verl's agent loop rendered for this row (None for the single-turn loop)."""
        default = self.config.actor_rollout_ref.rollout.agent.get(
            "default_agent_loop", "single_turn_agent"
        )
        if (row.get("agent_name") or default) != TOOL_AGENT:
            return None
        schemas = self._gear_tools()
        selection = ((row.get("extra_info") or {}) or {}).get("tool_selection")
        if selection and schemas:
            return [schemas[name] for name in selection if name in schemas]
        return list(schemas.values())

    def _gear_row_fields(self) -> list[str]:
        root = self.gear_settings.gear.hint_field.split(".")[0]
        fields = ["prompts", "responses", "raw_prompt", root]
        multi_turn = self.config.actor_rollout_ref.rollout.multi_turn
        if multi_turn.get("tool_config_path") or multi_turn.get("function_tool_path"):
            fields += ["agent_name", "extra_info"]
        return list(dict.fromkeys(fields))

    def _fetch(self, batch: Any, fields: list[str]) -> TensorDict:
        try:
            return tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
            )
        except Exception as e:
            present = sorted(
                tq.kv_batch_get(keys=batch.keys[:1], partition_id=batch.partition_id).keys()
            )
            missing = [f for f in fields if f not in present]
            if not missing:
                raise
            g = self.gear_settings.gear
            raise KeyError(
                f"GEAR needs the batch fields {missing} (gear.{g.hint_setting}={g.hint_field!r}); "
                f"fields present: {present}"
            ) from e

    def _put_teacher_prompts(self, batch: Any, metrics: dict) -> None:
        """Build each row's teacher prompt (here, in the task runner) and put it into the batch
        as ``gear_teacher_prompts`` (and whether it has a hint as ``gear_has_hint``)."""
        g = self.gear_settings.gear
        t0 = time.perf_counter()
        data = self._fetch(batch, self._gear_row_fields())
        names = [f for f in self._gear_row_fields() if f not in ("prompts", "responses")]
        columns = {name: _non_tensor(data, name, len(batch.keys)) for name in names}
        rows = [{name: columns[name][i] for name in names} for i in range(len(batch.keys))]
        prompts = [p.tolist() for p in _rows(data["prompts"])]
        skip = [bool(tag.get("is_padding", False)) for tag in batch.tags] if batch.tags else None
        tok = self.tokenizer
        build = functools.partial(  # the right-hint teacher's prompts; the contrast's below
            build_teacher_prompts,
            rows,
            prompts,
            g,
            self._gear_renderer(),
            tools_for_row=self._tools_for_row,
            tokenize=lambda s: tok(s, add_special_tokens=False)["input_ids"],
            detokenize=lambda ids: tok.decode(ids),
            skip=skip,
        )
        built = build()
        teacher = nested([torch.tensor(ids, dtype=torch.long) for ids in built.ids])
        fields = {
            TEACHER_PROMPTS_FIELD: teacher,
            HAS_HINT_FIELD: torch.tensor(built.has_hint, dtype=torch.bool),
        }
        if self.gear_settings.params.contrast:  # the same rows, shown a wrong answer
            rng = random.Random(f"{g.credit.get('seed', 0)}:{getattr(self, 'global_steps', 0)}")
            contrast = build(
                answers=lambda truths: wrong_answers(
                    truths, rng, offset_answer, self._gear_answer_pool
                )
            )
            fields[CONTRAST_PROMPTS_FIELD] = nested(
                [torch.tensor(ids, dtype=torch.long) for ids in contrast.ids]
            )
        tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict(fields, batch_size=[len(batch.keys)]),
        )
        metrics.update(
            {
                "gear/teacher_prompts_truncated": float(built.truncated),
                "gear/rows_without_ground_truth": float(built.without_ground_truth),
                "timing_s/gear_teacher_prompts": time.perf_counter() - t0,
            }
        )

    def _gear_pass_options(self, teacher: bool) -> dict[str, Any]:
        """The worker's signal-pass options (`worker.OPTION_KEYS`); `teacher`: whether the rows
        carry teacher prompts and a teacher forward runs."""
        g = self.gear_settings.gear
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return {
            "gear_teacher": teacher,
            "gear_contrast": bool(teacher and self.gear_settings.params.contrast),
            "gear_temperature": float(self.config.actor_rollout_ref.rollout.temperature),
            "gear_estimator": g.kl_estimator,
            "gear_topk": g.kl_topk,
            "gear_chunk_size": g.signal_chunk_size,
            "gear_micro_batch_size": g.teacher_micro_batch_size_per_gpu,
            "gear_pad_token_id": int(pad),
        }

    # --------------------------------------------------------------------- advantages

    def _gear_context(self, batch: Any) -> GearBatch:
        s = self.gear_settings
        required = self._required_signals()
        if s.params.contrast:
            required = (*required, "contrast_kl")
        needed = [OUTPUT_FIELDS[name] for name in required]
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id=batch.partition_id,
            select_fields=[
                "response_mask",
                *needed,
                *([HAS_HINT_FIELD] if s.needs_teacher else []),
                *([SCORED_FIELD] if s.skips_tied_rows else []),
            ],
        )
        padded = data.to_padded_tensor()  # the same padding verl applies to the batch it builds
        signals = {name: padded[OUTPUT_FIELDS[name]].float() for name in required}
        if (
            s.needs_teacher
        ):  # spec §4: a real row without a hint has no teacher -> weight 1, counted
            padding = torch.tensor(
                [bool(t.get("is_padding", False)) for t in batch.tags or [{}] * len(batch.keys)]
            )
            has_teacher = padded[HAS_HINT_FIELD].bool().reshape(-1).cpu() | padding
            signals = without_teacher(signals, has_teacher.to(padded["response_mask"].device))
        sessions, final = self._sessions(batch)
        return GearBatch(
            signals={OUTPUT_FIELDS[name]: v for name, v in signals.items()},
            response_mask=padded["response_mask"].bool(),
            params=self._batch_credit_params(),
            epsilon=s.gear.grpo_epsilon,
            norm_adv_by_std=s.norm_adv_by_std,
            sessions=sessions,
            final=final,
            scored=padded[SCORED_FIELD].bool().reshape(-1) if s.skips_tied_rows else None,
        )

    def _required_signals(self) -> tuple[str, ...]:
        return self.gear_settings.params.required_signals

    def _batch_credit_params(self) -> Any:
        p = self.gear_settings.params
        if p.method in STEP_SEEDED:  # a new draw every step
            p = dataclasses.replace(p, seed=p.seed + int(getattr(self, "global_steps", 0)))
        return p

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        ctx = self._gear_context(batch)
        t0 = time.perf_counter()
        rows = batch  # keys and tags (padding flags) of the rows, for the credit record
        with gear_batch(ctx):
            batch = super()._compute_advantage(batch, metrics)
        if ctx.details is None:
            raise RuntimeError(
                f"algorithm.adv_estimator={self.config.algorithm.adv_estimator!r} did not reach GEAR's "
                "estimator; check that the gear estimators are registered (gear.integrations.verl.plugin)"
            )
        metrics.update(ctx.details.stats)
        if ctx.details.skipped_rows is not None:  # the batch's rows, not verl's padding rows
            padding = torch.tensor([bool(t.get("is_padding", False)) for t in _tags(rows)])
            skipped = ctx.details.skipped_rows.cpu() & ~padding
            metrics["gear/rows_skipped"] = float(skipped.sum())
        metrics["timing_s/gear_credit"] = time.perf_counter() - t0
        self._maybe_write_credit_record(rows, ctx)
        return batch

    def _maybe_write_credit_record(self, batch: Any, ctx: GearBatch) -> None:
        g = self.gear_settings.gear
        step = int(getattr(self, "global_steps", 0))
        if g.credit_log_steps <= 0 or g.credit_log_rows <= 0 or step < self._gear_next_record_step:
            return
        self._gear_next_record_step = step + g.credit_log_steps
        try:
            from gear.viz.record import credit_record_path, credit_rows, write_credit_record

            rows = [
                i
                for i, tag in enumerate(batch.tags or [{}] * len(batch.keys))
                if not tag.get("is_padding")
            ]
            rows = rows[: g.credit_log_rows]
            data = tq.kv_batch_get(
                keys=batch.keys,
                partition_id=batch.partition_id,
                select_fields=["responses", "raw_prompt"],
            )
            responses = [r.tolist() for r in _rows(data["responses"])]
            tokens = [
                self.tokenizer.batch_decode([[t] for t in r]) if i in rows else []
                for i, r in enumerate(responses)
            ]
            completions = [
                self.tokenizer.decode(r) if i in rows else "" for i, r in enumerate(responses)
            ]
            prompts = [as_messages(p) for p in _non_tensor(data, "raw_prompt", len(responses))]
            width = ctx.details.valid.shape[1]
            ids = torch.zeros(len(responses), width, dtype=torch.long)
            real = torch.zeros(len(responses), width, dtype=torch.bool)
            for i, r in enumerate(responses):
                ids[i, : len(r)] = torch.tensor(r[:width], dtype=torch.long)
                real[i, : len(r)] = True
            records = credit_rows(
                ctx.details,
                tokens=tokens,
                rewards=ctx.scores,
                advantages=ctx.sequence_advantages,
                prompts=prompts,
                completions=completions,
                step=step,
                method=self.gear_settings.method,
                rows=rows,
                kl=ctx.signals.get(SIGNAL_FIELDS["kl"]),
                entropy=ctx.signals.get(SIGNAL_FIELDS["entropy"]),
                token_ids=ids,
                completion_mask=real,
            )
            run_dir = g.credit_log_dir or self.config.trainer.default_local_dir
            write_credit_record(credit_record_path(os.path.expanduser(run_dir), step), records)
        except Exception:  # a record is a diagnostic: never stop training for it
            logger.exception("GEAR: writing the credit record of step %d failed", step)


setattr(GearPPOTrainer, TRAINER_MARK, TRAINER_MODE)


def register_gear_trainer() -> str:
    """Register `GearPPOTrainer` as ``trainer.v1.trainer_mode=gear_sync`` (idempotent)."""
    existing = TRAINER_REGISTRY.get(TRAINER_MODE)
    if existing is GearPPOTrainer:
        return TRAINER_MODE
    if existing is not None and getattr(existing, TRAINER_MARK, None) != TRAINER_MODE:
        raise ValueError(
            f"verl trainer mode {TRAINER_MODE!r} is already registered to {existing!r}"
        )
    if existing is None:
        register_trainer(TRAINER_MODE)(GearPPOTrainer)
    else:
        TRAINER_REGISTRY[TRAINER_MODE] = GearPPOTrainer  # our class from an earlier import
    return TRAINER_MODE

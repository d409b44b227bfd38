"""`GEARTrainer`: TRL's GRPO trainer whose sequence advantages become GEAR token advantages.

Only TRL overrides and the orchestration of one batch live here (spec §1-5): the student states
come from `states.StudentStates`, the forwards and signal kernels from `forwards.Forwards`
(built once here), the frozen / EMA teacher from `teacher_model`, the teacher prompts from
`prompts` (`gear.teacher`), the credit of the batch from `credit` (`gear.credit`), the OPSD
loss from `self_distill`, logging from `records`. This is the only module that knows
`GEARTrainer`: the others take TRL's `GRPOTrainer`, a `Forwards`, or plain values.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import trl
from packaging.version import Version
from torch import Tensor, nn
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from gear.credit import CreditDetails, CreditParams, TokenSignals
from gear.credit.attribution import tokens_before
from gear.credit.methods import STEP_SEEDED
from gear.credit.signals import TEACHER_SIGNALS
from gear.integrations.trl.config import GEARConfig
from gear.integrations.trl.credit import (
    ContrastSignals,
    batch_credit,
    scored_rows,
    without_unhinted_rows,
)
from gear.integrations.trl.forwards import (
    Forwards,
    answer_influence,
    answer_perturbation,
    eval_mode,
    loss_prefix_blocker,
    shared_prompt_logps,
)
from gear.integrations.trl.prompts import (
    batch_ground_truths,
    check_ground_truth_sources,
    column_setting,
    contrast_answers,
    contrast_pool,
    environment_ground_truths,
    ground_truths_of,
    teacher_inputs,
    teacher_prompts,
)
from gear.integrations.trl.quantized import keep_4bit_layers_trainable
from gear.integrations.trl.records import local_rewards, log_stats, write_batch_record
from gear.integrations.trl.self_distill import no_reward, self_distill_loss
from gear.integrations.trl.states import StudentStates, sampling_shapers, sampling_temperature
from gear.integrations.trl.teacher_model import (
    EMATeacherUpdate,
    build_teacher,
    load_teacher,
    save_teacher,
    update_ema,
)
from gear.integrations.trl.vllm_sync import keep_vllm_weights_updatable
from gear.integrations.trl.vllm_teacher import (
    TeacherLogprobs,
    max_logprobs,
    score_rows,
    teacher_logprobs,
    teacher_sequences,
)
from gear.modeling import LogitConventions
from gear.spans import LocateAnswer, answer_spans, error_token_mask, mask_token_id
from gear.tasks.base import final_answer_span
from gear.tasks.steps import StepChecker
from gear.teacher import TeacherPrompts, WrongAnswer, ground_truth_text, offset_answer

TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))  # [min, max): the range the tests run on
if not TESTED_TRL[0] <= Version(trl.__version__) < TESTED_TRL[1]:
    warnings.warn(
        f"gear.integrations.trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}; "
        f"found trl {trl.__version__}. GEARTrainer overrides private GRPOTrainer methods.",
        stacklevel=2,
    )


class GEARTrainer(GRPOTrainer):
    """[`GRPOTrainer`] whose sequence advantages are reshaped into GEAR token advantages.

    Same constructor and datasets as `GRPOTrainer`; a credit method that needs the teacher (all
    but `grpo` and `entropy_top`) or `loss_mode="self_distill"` needs a ground-truth column
    (`GEARConfig.ground_truth_column`) or, when an environment owns the data, an environment
    attribute of that name set by `reset()` (docs/trl.md); the answer teacher contexts
    (`teacher_context='answer_only'` or `'contrast'`) read `GEARConfig.answer_column` instead.
    Two extra keyword arguments select a separate frozen teacher (`teacher="frozen"` only):
    `teacher_model` (model or path) and `teacher_processing_class`, whose vocabulary must equal
    the policy's. A third, `wrong_answer` (`teacher_context='contrast'` only), is the hook
    `(answer, rng) -> str | None` that gives the contrast teacher its wrong answer (a task's
    `Task.wrong_answer`; default `gear.teacher.offset_answer`: a number plus a nonzero offset;
    where it gives None, another answer of the dataset or batch). OAR-G (`credit_method='oar_g'`)
    takes two more: `answer_span(completion_text) -> (start, end) | None`, where the completion's
    final answer lies (`credit_oar_span='answer'`; a task's `Task.answer_span`; default
    `gear.tasks.base.final_answer_span`: the last \\boxed{}, "Answer: N", else the last number),
    and `reference_text(answer) -> str | None`, the text appended for the `answer_column` value
    (`credit_oar_span='reference'`; default the value as text). `credit_method='first_error'`
    needs `step_checker(completion_text, ground_truth) -> (start, end) | None`: the characters
    of a completion's first wrong step (`gear.tasks.steps.StepChecker`; a task's
    `Task.step_checker`); the ground truth is the row's `ground_truth_column` value, or None
    where the row has none. Given with any other method, the checker places the errors for the
    `gear/branch_*` diagnostics only. Every step also logs the group prefix tree's statistics
    (`gear/prefix_*`, `gear/shared_sum_*`: `gear.credit.implicit`), and `credit_method=
    'lambda_grpo'` divides each token's advantage by the rows of its group that share its prefix.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "grpo", "gear"]
    _name = "GEAR"
    _paper: ClassVar[dict[str, str]] = {
        "title": "GEAR: Granularity-adaptivE Advantage Reweighting",
        "id": "2605.11853",
        "citation": "@article{gear2026,\n    title  = {{GEAR: Granularity-adaptivE Advantage Reweighting}},\n"
        "    year   = 2026,\n    eprint = {arXiv:2605.11853},\n}",
    }

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GEARConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
        *,
        teacher_model: PreTrainedModel | str | None = None,
        teacher_processing_class: Any = None,
        wrong_answer: WrongAnswer | None = None,
        answer_span: LocateAnswer | None = None,
        reference_text: Callable[[Any], str | None] | None = None,
        step_checker: StepChecker | None = None,
    ) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GEARConfig(f"{str(name).split('/')[-1] or 'model'}-GEAR")
        elif not isinstance(args, GEARConfig):
            raise TypeError(
                f"args: expected a GEARConfig, got {type(args).__name__}; use GEARConfig(...) "
                "in place of GRPOConfig(...), with the same arguments"
            )
        if args.loss_mode == "self_distill" and not reward_funcs:
            reward_funcs = [no_reward]  # TRL needs a reward source; OPSD uses none
        if args.teacher != "frozen" and (
            teacher_model is not None or teacher_processing_class is not None
        ):
            raise ValueError(
                f"teacher_model / teacher_processing_class: only used with teacher='frozen', "
                f"got teacher={args.teacher!r}"
            )
        if args.credit_method == "first_error" and step_checker is None:
            raise ValueError(
                "credit_method='first_error' blames each failed row's first wrong step as a step "
                "checker places it: pass step_checker=... to GEARTrainer, a callable "
                "(completion_text, ground_truth) -> (start, end) characters or None "
                "(gear.tasks.steps; `gear train` takes the task's own)"
            )
        if step_checker is not None and not callable(step_checker):
            raise TypeError(
                f"step_checker: expected a callable (completion_text, ground_truth) -> "
                f"(start, end) | None, got {type(step_checker).__name__}"
            )
        if wrong_answer is not None and args.teacher_context != "contrast":
            raise ValueError(
                f"wrong_answer: only used with teacher_context='contrast', got "
                f"teacher_context={args.teacher_context!r}"
            )

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        keep_4bit_layers_trainable(self.model)  # bitsandbytes' AVX512 repacking drops grads
        keep_vllm_weights_updatable(self)  # vLLM's CPU kernels may hold the weights
        if args.teacher_engine == "vllm" and args.kl_estimator == "topk":
            limit = max_logprobs(self.vllm_generation)
            if limit is not None and args.kl_topk > limit:
                raise ValueError(
                    f"kl_topk={args.kl_topk}: teacher_engine='vllm' asks vLLM for the teacher's "
                    f"top-{args.kl_topk} prompt log-probs, more than its max_logprobs={limit}; "
                    f"set kl_topk <= {limit}"
                )
        self._gear_warned_no_sampling_logprobs = False
        if self._is_vlm:
            raise NotImplementedError(
                "GEARTrainer supports text-only models (the teacher pass has no image inputs)"
            )
        conventions = LogitConventions.of(self.model)
        conventions.signal_kwargs(1.0)  # refuses softcap + logit scale now, not at a batch
        if args.loss_mode == "self_distill" and self.is_deepspeed_enabled:
            raise NotImplementedError(
                "loss_mode='self_distill' reads lm_head.weight outside the forward, which "
                "DeepSpeed ZeRO-3 does not allow; use DDP or FSDP"
            )
        if args.loss_mode == "self_distill" and self.beta != 0.0:
            warnings.warn(
                "loss_mode='self_distill' ignores beta (no reference KL term)", stacklevel=2
            )

        self.credit_params = args.credit_params
        requires = self.credit_params.required_signals
        self_distill = args.loss_mode == "self_distill"
        # what this run computes: student signals (any requirement), a teacher (KL or its log-probs),
        # the answer influence, from its own pass, no signal pass: OAR-G's input gradient or
        # OAR-P's masked copies
        self._influence_signal = next(
            (s for s in ("influence", "perturbation") if s in requires), None
        )
        self._needs_influence = self._influence_signal is not None
        if self._needs_influence and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            how = (
                "the unwrapped model with an input gradient"
                if self._influence_signal == "influence"
                else "one forward per masked token on the unwrapped model, a number that "
                "differs by row and process where sharded forwards are collective"
            )
            raise NotImplementedError(
                f"credit_method={self.credit_params.method!r}: its influence pass runs {how}, "
                "which DeepSpeed and FSDP do not allow; use DDP or one process"
            )
        if self._needs_influence and self.credit_params.oar_span == "reference":
            columns = getattr(train_dataset, "column_names", None)
            if columns is not None and args.answer_column not in columns:
                raise ValueError(
                    f"credit_oar_span='reference' appends each row's reference answer from "
                    f"answer_column={args.answer_column!r}, which the dataset does not have; "
                    f"columns present: {sorted(columns)}"
                )
        self._gear_answer_span = answer_span or final_answer_span
        self._gear_reference_text = reference_text or ground_truth_text
        self._gear_step_checker = step_checker
        # inputs without a signal pass: OAR's influence has its own, a checker's mask and the
        # group prefix tree's counts (`batch_credit`) need none
        own_pass = {"influence", "perturbation", "error_mask", "prefix_count"}
        self._needs_signals = self_distill or bool(set(requires) - own_pass)
        self._needs_teacher = self_distill or bool(set(requires) & set(TEACHER_SIGNALS))
        if self._needs_signals and (shapers := sampling_shapers(args)):
            named = ", ".join(f"{k}={v!r}" for k, v in shapers.items())
            warnings.warn(
                f"GEARTrainer: {named} change the distribution completions are sampled from, "
                "but the student signals use pi_S = softmax(logits / temperature) over the whole "
                "vocabulary (spec §1), so KL, entropy and log-probs describe the unshaped "
                "distribution; see docs/vllm.md",
                stacklevel=2,
            )
        if self._needs_teacher and rollout_func is None:  # TRL's own checks ran first
            check_ground_truth_sources(self, train_dataset, eval_dataset)
        # teacher_context='contrast': the wrong-answer hook, checked on every answer up front
        self._gear_wrong_answer = wrong_answer or offset_answer
        self._gear_answer_pool = (
            contrast_pool(train_dataset, args.hint_column, self._gear_wrong_answer, args.seed)
            if self.credit_params.contrast
            else []
        )
        self._forwards = Forwards(
            accelerator=self.accelerator,
            conventions=conventions,
            temperature=sampling_temperature(self),
            estimator=args.kl_estimator,
            topk=args.kl_topk,
            chunk_size=args.signal_chunk_size,
            prefix_sharing=args.prefix_sharing,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            merge_lora=args.merge_lora_passes,
        )
        self._student = StudentStates(self)
        self.teacher_model = build_teacher(self, teacher_model, teacher_processing_class)
        if args.teacher == "ema":
            # looked up at each step: a run may wrap `update_ema_teacher` (scripts time it)
            self.add_callback(EMATeacherUpdate(lambda: self.update_ema_teacher()))
        self._gear_prompts: list | None = None  # prompts of the batch being generated
        self._gear_env_ground_truths: list | None = None  # its environments' ground truths
        self._gear_rewards: Tensor | None = None  # (all rows, reward funcs), gathered
        self._gear_next_record_step = 0

    # ------------------------------------------------------------------------------- teacher

    def update_ema_teacher(self) -> None:
        """theta_T <- decay * theta_T + (1 - decay) * theta (after each optimizer step)."""
        update_ema(
            self.teacher_model, self.accelerator.unwrap_model(self.model), self.args.ema_decay
        )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.teacher_model is not None:  # every rank: gathering a sharded teacher is collective
            folder = os.path.join(
                self._get_output_dir(trial=trial),
                f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
            )
            save_teacher(self.teacher_model, folder, write=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.teacher_model is not None:
            load_teacher(
                self.accelerator.unwrap_model(self.teacher_model),
                checkpoint,
                str(self.accelerator.device),
                self.args.teacher,
            )

    # ------------------------------------------------------------------------------- generation

    def _generate(self, prompts: list) -> Any:
        # the prompts after environment resets: exactly what the student is prompted with
        self._gear_prompts = copy.deepcopy(prompts)
        # each rollout's ground truth as its environment holds it right after reset(), before a
        # tool call can change the environment's state. getattr: this override needs no state
        # TRL's own `_generate` does not read (TRL's dispatch tests build the trainer with
        # object.__new__ and no environment_factories)
        self._gear_env_ground_truths = (
            environment_ground_truths(self.environments, self.args.hint_column)
            if getattr(self, "environment_factories", None) is not None and self.environments
            else None
        )
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        return self._student.generate(
            prompt_ids,
            lambda: super(GEARTrainer, self)._generate_single_turn(prompt_ids, *args, **kwargs),
        )

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Tensor:
        self._gear_rewards = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        return self._gear_rewards

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def plain() -> Any:
            return super(GEARTrainer, self)._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )

        def run() -> Any:
            if not self._shares_loss_prompts(model, input_ids, logits_to_keep, args, kwargs):
                return plain()
            out = shared_prompt_logps(
                self.accelerator,
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                kwargs.get("batch_size"),
                kwargs.get("compute_entropy", False),
            )
            return plain() if out is None else (*out, None)

        # a pass the student states are read off runs plain: the capture reads whole rows
        capturing = self._student.captures_trl_pass(model)
        return self._student.trl_pass(model, logits_to_keep, plain if capturing else run)

    def _shares_loss_prompts(
        self, model: Any, input_ids: Tensor, logits_to_keep: int, args: tuple, kwargs: dict
    ) -> bool:
        """Whether TRL's log-prob pass over these rows runs with shared prompts
        (`loss_prefix_sharing`); every process decides alike (sharded forwards pair up)."""
        text_only = not args and all(
            kwargs.get(k) is None
            for k in kwargs
            if k not in ("batch_size", "compute_entropy", "compute_aux_loss")
        )
        share = (
            self.args.loss_prefix_sharing
            and text_only
            and not kwargs.get("compute_aux_loss", False)
            and loss_prefix_blocker(model, input_ids.size(1), logits_to_keep + 1) is None
        )
        return self._student.on_every_process(share)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        if self._needs_teacher and self.rollout_func is None and self.environment_factories is None:
            # fail before generating
            ground_truths_of(inputs, self.args.hint_column, column_setting(self.args))
        rl = self.args.loss_mode == "rl"
        with self._student.capturing(rl and self._needs_signals):
            output = super()._generate_and_score_completions(inputs)

        stats: dict[str, float] = {}
        signals = credit_signals = None
        valid, turn_starts = _response_mask(output)
        teacher = contrast = None
        if self._needs_teacher:
            t0 = time.perf_counter()
            gts = batch_ground_truths(inputs, self.args.hint_column, self._gear_env_ground_truths)
            teacher = self._teacher_inputs(self._gear_prompts, gts, output, stats)
            if self.credit_params.contrast:
                contrast = self._contrast_inputs(self._gear_prompts, gts, output, mode)
            stats["gear/time_teacher_prompts"] = time.perf_counter() - t0
            if not rl:  # self_distill: the teacher pass runs in the loss, on each micro-batch
                (
                    output["gear_teacher_input_ids"],
                    output["gear_teacher_attention_mask"],
                    output["gear_has_hint"],
                ) = teacher
                log_stats(self.accelerator, self._metrics[mode], stats)
                return output
        # the rows the credit method reads: tied rows (advantage 0) get no teacher, contrast,
        # influence or signal pass (`skip_zero_advantage_rows`)
        scored = scored_rows(
            output["advantages"],
            self.credit_params,
            self.args.skip_zero_advantage_rows,
            self.accelerator,
        )
        if self._needs_signals:
            signals = self._token_signals(output, teacher, valid, mode, stats, contrast, scored)
            credit_signals = (
                signals if teacher is None else without_unhinted_rows(signals, teacher[2])
            )

        influence = perturbation = answer_mask = error_mask = None
        if self._needs_influence:
            found, answer_mask = self._influence(inputs, output, valid, mode, stats, scored)
            if self._influence_signal == "perturbation":
                perturbation = found
            else:
                influence = found
        # a checker's mask: first_error's blame, and for any method where GRPO's implicit credit
        # puts a failed row's blame (`gear/branch_*`)
        if self._gear_step_checker is not None:
            error_mask = self._error_mask(inputs, output, valid, stats)
        t0 = time.perf_counter()
        sequence_advantages = output["advantages"]
        details = self._credit(
            sequence_advantages,
            valid,
            turn_starts,
            credit_signals,
            influence,
            answer_mask=answer_mask,
            scored=scored,
            error_mask=error_mask,
            perturbation=perturbation,
            completion_ids=output["completion_ids"],
            completion_mask=output["completion_mask"],
            group_size=self.num_generations if mode == "train" else self.num_generations_eval,
        )
        output["advantages"] = details.token_advantages.to(sequence_advantages.dtype)
        stats["gear/time_credit"] = time.perf_counter() - t0
        log_stats(self.accelerator, self._metrics[mode], stats)
        for key, value in details.stats.items():  # already over the whole generation batch
            self._metrics[mode][key].append(value)
        if mode == "train":
            self._maybe_write_credit_record(output, details, signals, sequence_advantages)
        return output

    def _maybe_write_credit_record(
        self,
        output: dict[str, Any],
        details: CreditDetails,
        signals: TokenSignals | None,
        advantages: Tensor,
    ) -> None:
        """`output_dir/credit/step_XXXXXX.jsonl` every `credit_log_steps` steps (main process,
        its first `credit_log_rows` rows; `records.write_batch_record`). XXXXXX is the step these
        rollouts train, 1-based: the step metrics.jsonl and the progress line give it."""
        every, n_rows = self.args.credit_log_steps, self.args.credit_log_rows
        step = self.state.global_step + 1  # global_step counts the steps done before this one
        if every == 0 or n_rows == 0 or step < self._gear_next_record_step:
            return
        self._gear_next_record_step = step + every
        if not self.accelerator.is_main_process:
            return
        n = output["completion_ids"].size(0)
        write_batch_record(
            self.args.output_dir,
            step,
            self._tokenizer,
            output,
            details,
            signals,
            advantages,
            local_rewards(
                self._gear_rewards, self.reward_weights, self.accelerator.process_index, n
            ),
            self._gear_prompts,
            self.credit_params.method,
            n_rows,
        )

    @torch.no_grad()
    def _token_signals(
        self,
        output: dict[str, Any],
        teacher: tuple[Tensor, Tensor, Tensor] | None,
        valid: Tensor,
        mode: str,
        stats: dict[str, float],
        contrast: tuple[Tensor, Tensor] | None = None,
        scored: Tensor | None = None,
    ) -> TokenSignals:
        """One student pass (or the states of generation or of TRL's pass, captured) and, given
        `teacher` = (ids, mask, has_hint), one teacher pass (eval mode, like the student's);
        then the chunked signals at the (B, T) `valid` policy tokens. Given `contrast` = (ids,
        mask) of the contrast teacher (a wrong answer), one more teacher pass and its (B, T) KL
        by the same kernel, returned as `ContrastSignals.contrast_kl` (`gear/time_contrast`:
        that pass and its signals). Given `scored` (B,) bool, every pass runs on those rows
        only; the other rows' signals are 0."""
        student_hidden = self._student.take(output)
        if scored is not None:
            rows = scored.nonzero().squeeze(1)
            if rows.numel() == 0:  # every row tied: nothing to score, every pass took 0 s
                for name in ("time_student", "time_teacher", "time_signals", "teacher_tokens"):
                    stats[f"gear/{name}"] = 0.0
                if contrast is not None:
                    stats["gear/time_contrast"] = 0.0
                return _unscored_signals(valid, with_teacher=teacher is not None, contrast=contrast)
            signals = self._scored_signals(
                _rows_of(output, rows),
                None if teacher is None else tuple(x[rows] for x in teacher),
                valid[rows],
                mode,
                stats,
                None if contrast is None else tuple(x[rows] for x in contrast),
                None if student_hidden is None else student_hidden[rows],
            )
            return _signals_in_rows(signals, rows, valid.shape[0])
        return self._scored_signals(output, teacher, valid, mode, stats, contrast, student_hidden)

    @torch.no_grad()
    def _scored_signals(
        self,
        output: dict[str, Any],
        teacher: tuple[Tensor, ...] | None,
        valid: Tensor,
        mode: str,
        stats: dict[str, float],
        contrast: tuple[Tensor, ...] | None,
        student_hidden: Tensor | None,
    ) -> TokenSignals:
        """`_token_signals` of every row of `output`, the student's states given (or None)."""
        completion_ids = output["completion_ids"]
        n_keep = completion_ids.size(1)
        batch_size = self._micro_batch(mode)
        t0 = time.perf_counter()
        forward = student_hidden is None
        if forward:
            with eval_mode(self.accelerator.unwrap_model(self.model)):
                student_hidden = self._final_hidden(
                    self.model,
                    torch.cat([output["prompt_ids"], completion_ids], dim=1),
                    torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                    n_keep,
                    batch_size,
                )
        t1 = time.perf_counter()
        scored = None
        if teacher is not None:
            scored = self._teacher_pass(teacher[0], teacher[1], output, batch_size)
        t2 = time.perf_counter()
        signals = self._teacher_signals(student_hidden, scored, output, valid)
        stats["gear/time_student"] = t1 - t0 if forward else 0.0
        stats["gear/time_teacher"], stats["gear/time_signals"] = t2 - t1, time.perf_counter() - t2
        # the tokens the teacher pass read (its input rows, prompts included): its cost per token
        stats["gear/teacher_tokens"] = 0.0 if teacher is None else float(teacher[1].sum())
        if contrast is not None:
            t3 = time.perf_counter()
            scored = self._teacher_pass(contrast[0], contrast[1], output, batch_size)
            contrast_kl = self._teacher_signals(student_hidden, scored, output, valid).kl
            signals = ContrastSignals(**vars(signals), contrast_kl=contrast_kl)
            stats["gear/time_contrast"] = time.perf_counter() - t3
        return signals

    def _influence(
        self,
        inputs: list[dict[str, Any]],
        output: dict[str, Any],
        valid: Tensor,
        mode: str,
        stats: dict[str, float],
        scored: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(B, T) influence of each completion token on the row's answer span
        (`gear.spans.answer_spans` under `credit_oar_span`), eval mode: OAR-G's input gradient
        of its log-probability (`forwards.answer_influence`) or OAR-P's change of it when the
        token is replaced by the pad token (`forwards.answer_perturbation`, `credit_oar_pfinal`),
        and the (B, T) bool answer span inside the completions. Given `scored` (B,) bool, the
        influence pass runs on those rows only (the others' influence is 0). Scored rows whose
        answer is not found (scored on their last `credit_oar_answer_len` tokens) are counted in
        `gear/oar_span_fallback`; the seconds go to `gear/time_influence`."""
        t0 = time.perf_counter()
        references = None
        if self.credit_params.oar_span == "reference":
            column = self.args.answer_column
            references = [self._gear_reference_text(row.get(column)) for row in inputs]
        spans = answer_spans(
            self.credit_params,
            self._tokenizer,
            output["completion_ids"],
            output["completion_mask"],
            valid,
            self._gear_answer_span,
            references,
        )
        ids = torch.cat([output["prompt_ids"], spans.completion_ids], dim=1)
        mask = torch.cat([output["prompt_mask"], spans.completion_mask], dim=1)
        rows = None if scored is None else scored.nonzero().squeeze(1)
        influence = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        if rows is None or rows.numel() > 0:
            keep = slice(None) if rows is None else rows
            with eval_mode(self.accelerator.unwrap_model(self.model)):
                if self._influence_signal == "perturbation":
                    masked = tokens_before(spans.answer_mask, valid)  # the tokens OAR reshapes
                    masked = torch.nn.functional.pad(
                        masked, (0, spans.span.shape[1] - valid.shape[1])
                    )
                    part = answer_perturbation(
                        self._forwards,
                        self.model,
                        ids[keep],
                        mask[keep],
                        spans.span[keep],
                        masked[keep],
                        mask_token_id(self._tokenizer),
                        self.credit_params.oar_pfinal,
                        self._micro_batch(mode) * ids.shape[1],  # a training forward's tokens
                    )
                else:
                    part = answer_influence(
                        self._forwards,
                        self.model,
                        ids[keep],
                        mask[keep],
                        spans.span[keep],
                        self._micro_batch(mode),
                    )
            influence[keep] = part[:, : valid.shape[1]].to(influence.dtype)
        fallback = (
            spans.fallback if scored is None else spans.fallback & scored.to(spans.fallback.device)
        )
        stats["gear/oar_span_fallback"] = float(fallback.sum())
        stats["gear/time_influence"] = time.perf_counter() - t0
        return influence, spans.answer_mask

    def _error_mask(
        self,
        inputs: list[dict[str, Any]],
        output: dict[str, Any],
        valid: Tensor,
        stats: dict[str, float],
    ) -> Tensor:
        """(B, T) bool: each row's first wrong step in tokens, as the step checker places it in
        the completion's text (`gear.spans.error_token_mask`), policy tokens only. Failed rows
        (advantage < 0) it places are counted in `gear/first_error_placed`, those it cannot in
        `gear/first_error_unplaced` (they keep GRPO's advantage); seconds in
        `gear/time_step_checker`."""
        t0 = time.perf_counter()
        column = self.args.ground_truth_column
        truths = self._gear_env_ground_truths or [row.get(column) for row in inputs]
        mask = error_token_mask(
            self._tokenizer,
            output["completion_ids"],
            output["completion_mask"],
            self._gear_step_checker,  # type: ignore[arg-type]
            truths,
        ) & valid.to(output["completion_ids"].device)
        failed = output["advantages"] < 0
        placed = mask.any(dim=1).to(failed.device)
        stats["gear/first_error_placed"] = float((failed & placed).sum())
        stats["gear/first_error_unplaced"] = float((failed & ~placed).sum())
        stats["gear/time_step_checker"] = time.perf_counter() - t0
        return mask

    def _teacher_pass(
        self, ids: Tensor, mask: Tensor, output: dict[str, Any], batch_size: int
    ) -> Tensor | TeacherLogprobs:
        """The teacher on its (B, L) input `ids` / `mask`: its (B, T, H) final hidden states
        (`teacher_engine='trainer'`, eval mode), or its log-probs of the completion tokens scored
        by TRL's vLLM engine (`'vllm'`: one prefill per row, `vllm_teacher`)."""
        if self.args.teacher_engine == "vllm":
            k = self.args.kl_topk if self.args.kl_estimator == "topk" else 0
            sequences, starts = teacher_sequences(ids, mask, output["completion_mask"])
            scored = score_rows(self.vllm_generation, self.accelerator, sequences, starts, k)
            return teacher_logprobs(scored, output["completion_mask"], k)
        with eval_mode(self.accelerator.unwrap_model(self._teacher())):
            n_keep = output["completion_ids"].size(1)
            return self._final_hidden(self._teacher(), ids, mask, n_keep, batch_size)

    def _teacher_signals(
        self,
        student_hidden: Tensor,
        teacher: Tensor | TeacherLogprobs | None,
        output: dict[str, Any],
        valid: Tensor,
    ) -> TokenSignals:
        """Signals at the (B, T) `valid` tokens from the student's (B, T, H) states and the
        teacher's states or vLLM log-probs (`_teacher_pass`; None: the student's alone). With
        vLLM's log-probs the student side of k1 / k3 is vLLM's too: the log-probs it sampled
        the tokens with (TRL's `sampling_per_token_logps`), so the two engines' numerics do not
        enter the KL (docs/spec.md, 'Teacher engines')."""
        completion_ids = output["completion_ids"]
        if not isinstance(teacher, TeacherLogprobs):
            return self._signals(student_hidden, teacher, completion_ids, mask=valid)
        sampled = output.get("sampling_per_token_logps")
        if sampled is None and not self._gear_warned_no_sampling_logprobs:
            self._gear_warned_no_sampling_logprobs = True
            warnings.warn(
                "teacher_engine='vllm': the batch has no vLLM sampling log-probs "
                "(sampling_per_token_logps; a rollout_func that returns none?), so the KL "
                "compares the trainer's student log-probs with vLLM's teacher log-probs",
                stacklevel=2,
            )
        return self._forwards.logprob_signals(
            self.model, student_hidden, completion_ids, teacher, sampled, mask=valid
        )

    def _credit(
        self,
        advantages: Tensor,
        valid: Tensor,
        turn_starts: Tensor | None,
        signals: TokenSignals | None,
        influence: Tensor | None = None,
        answer_mask: Tensor | None = None,
        scored: Tensor | None = None,
        error_mask: Tensor | None = None,
        perturbation: Tensor | None = None,
        completion_ids: Tensor | None = None,
        completion_mask: Tensor | None = None,
        group_size: int | None = None,
    ) -> CreditDetails:
        """`gear.credit.credit_details` of this process's rows, on the whole generation batch,
        with the group prefix tree's statistics (`batch_credit`)."""
        return batch_credit(
            self.accelerator,
            advantages,
            valid,
            turn_starts,
            signals,
            self._batch_credit_params(),
            influence,
            answer_mask,
            scored,
            error_mask,
            perturbation,
            completion_ids,
            completion_mask,
            group_size,
        )

    def _micro_batch(self, mode: str) -> int:
        """Rows per forward of the extra passes (teacher, student, influence): the run's own
        per-device batch of that mode."""
        if mode == "train":
            return self.args.per_device_train_batch_size
        return self.args.per_device_eval_batch_size

    def _teacher(self) -> nn.Module:
        return self.model if self.teacher_model is None else self.teacher_model

    def _batch_credit_params(self) -> CreditParams:
        """`credit_params`, with a random method's seed varied per step (`STEP_SEEDED`)."""
        p = self.credit_params
        return (
            dataclasses.replace(p, seed=p.seed + self.state.global_step)
            if p.method in STEP_SEEDED
            else p
        )

    def _teacher_inputs(
        self, prompts: list, ground_truths: list, output: dict[str, Any], stats: dict[str, float]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher inputs (ids, mask, has_hint) of the batch (`prompts.teacher_inputs`);
        counts rows whose hint was truncated and rows without a ground truth into `stats`."""
        built = self._teacher_prompts(prompts, ground_truths)
        stats["gear/teacher_prompts_truncated"] = float(built.truncated)
        stats["gear/rows_without_ground_truth"] = float(built.without_ground_truth)
        return teacher_inputs(built, output, self._tokenizer.pad_token_id)

    def _teacher_prompts(self, prompts: list, ground_truths: list) -> TeacherPrompts:
        return teacher_prompts(self, prompts, ground_truths)

    def _contrast_inputs(
        self, prompts: list, answers: list, output: dict[str, Any], mode: str
    ) -> tuple[Tensor, Tensor]:
        """Teacher inputs (ids, mask) of the contrast teacher: each row's prompt with a wrong
        answer in the same hint template (`prompts.contrast_answers`; drawn from a generator
        seeded by the run's seed, the step, the process and the mode)."""
        rng = random.Random(
            f"{self.args.seed}:{self.state.global_step}:{self.accelerator.process_index}:{mode}"
        )
        wrong = contrast_answers(answers, rng, self._gear_wrong_answer, self._gear_answer_pool)
        built = self._teacher_prompts(prompts, wrong)
        ids, mask, _ = teacher_inputs(built, output, self._tokenizer.pad_token_id)
        return ids, mask

    # ------------------------------------------------------------------------------- forwards

    def _final_hidden(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        n_keep: int,
        batch_size: int | None = None,
        grad: bool = False,
    ) -> Tensor:
        """(B, n_keep, H) final hidden states predicting the last n_keep tokens (`Forwards.hidden`)."""
        return self._forwards.hidden(model, input_ids, attention_mask, n_keep, batch_size, grad)

    def _signals(
        self,
        student_hidden: Tensor,
        teacher_hidden: Tensor | None,
        token_ids: Tensor,
        mask: Tensor | None = None,
    ) -> TokenSignals:
        """Per-token KL / entropy / log-probs from the (B, T, H) final hidden states (spec §1),
        computed at the (B, T) `mask` positions only (policy tokens; 0 elsewhere)."""
        return self._forwards.signals(
            self.model, self.teacher_model, student_hidden, teacher_hidden, token_ids, mask=mask
        )

    # ------------------------------------------------------------------------------- loss

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        if self.args.loss_mode != "self_distill":
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        accumulation = (
            self.current_gradient_accumulation_steps / self.args.steps_per_generation
            if mode == "train"
            else 1.0
        )
        loss, stats = self_distill_loss(
            self._forwards,
            model,
            self._teacher(),
            inputs,
            accumulation,
            separate_teacher=self.teacher_model is not None,
        )
        for key, value in stats.items():
            self._metrics[mode][key].append(value)
        return loss


# ----------------------------------------------------------------------------------- helpers


def _rows_of(output: dict[str, Any], rows: Tensor) -> dict[str, Any]:
    """The batch `output` restricted to `rows`: every (B, ...) tensor indexed, the rest kept."""
    B = output["completion_ids"].size(0)
    return {
        k: v[rows] if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == B else v
        for k, v in output.items()
    }


def _signals_in_rows(signals: TokenSignals, rows: Tensor, n: int) -> TokenSignals:
    """(len(rows), T) signals placed at `rows` of (n, T) ones, 0 in the other rows."""

    def place(v: Tensor | None) -> Tensor | None:
        if v is None:
            return None
        return v.new_zeros(n, *v.shape[1:]).index_copy_(0, rows, v)

    return dataclasses.replace(
        signals, **{f.name: place(getattr(signals, f.name)) for f in dataclasses.fields(signals)}
    )


def _unscored_signals(
    valid: Tensor, with_teacher: bool, contrast: tuple[Tensor, ...] | None
) -> TokenSignals:
    """The signals of a batch none of whose rows is scored: 0 everywhere."""
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    teacher = zeros if with_teacher else None
    signals = TokenSignals(
        kl=teacher, entropy=zeros, student_logprobs=zeros, teacher_logprobs=teacher
    )
    if contrast is not None:
        return ContrastSignals(**vars(signals), contrast_kl=zeros)
    return signals


def _response_mask(output: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """(B, T) policy tokens (completion minus tool output) and turn starts (a policy token right
    after tool output), or None without tools."""
    valid = output["completion_mask"].bool()
    tool_mask = output.get("tool_mask")
    if tool_mask is None:
        return valid, None
    policy = tool_mask.bool()
    valid = valid & policy
    after_tool = torch.zeros_like(valid)
    after_tool[:, 1:] = ~policy[:, :-1]
    return valid, valid & after_tool


__all__ = ["TESTED_TRL", "GEARTrainer", "no_reward"]

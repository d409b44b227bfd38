"""`GEARTrainer`: TRL's GRPO trainer whose sequence advantages become GEAR token advantages.

Only TRL overrides and the orchestration of one batch live here (spec §1-5): the refusals at
construction come from `checks`, the scoring passes (signals, teacher, influence, a checker's
mask) and the batch they fill (`CreditBatch`) from `passes`, the student states from
`states.StudentStates`, the forwards and signal kernels from `forwards.Forwards` (built once
here), the frozen / EMA teacher from `teacher_model`, the teacher prompts from `prompts`
(`gear.teacher`), the credit of the batch from `credit` (`gear.credit`), the OPSD loss from
`self_distill`, logging from `records`. This is the only module that knows `GEARTrainer`: the
others take TRL's `GRPOTrainer`, the trainer as a plain object, a `Forwards`, or plain values.

Seams: private methods that tests, benchmarks and scripts patch or call, kept as methods and
called through `self`, so a patch on the trainer (or the class) reaches every pass
(docs/trl.md, "Seams"): `_generate_and_score_completions` (one batch, end to end),
`_teacher_inputs` / `_teacher_prompts` (the teacher's prompts), `_token_signals` (the signal
pass), `_teacher_pass` (one teacher forward), `_final_hidden` (every signal forward),
`_signals` (the signal kernel), `_influence` (OAR's pass; its kernels `answer_perturbation` /
`answer_influence` are looked up in this module), `_credit` (the credit core's inputs and
output), `_batch_credit_params`, `_teacher`, `_maybe_write_credit_record`, and TRL's own
`_compute_loss`, `_generate`, `_generate_single_turn`, `_calculate_rewards`, `_save_checkpoint`,
`_load_optimizer_and_scheduler`.
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

import trl
from packaging.version import Version
from torch import Tensor, nn
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from gear.credit import CreditDetails, CreditParams, TokenSignals
from gear.credit.methods import STEP_SEEDED
from gear.credit.registry import PASS_SIGNALS, TEACHER_SIGNALS
from gear.integrations.trl.checks import check_arguments, check_built, check_passes
from gear.integrations.trl.config import GEARConfig
from gear.integrations.trl.credit import batch_credit, scored_rows
from gear.integrations.trl.forwards import (
    Forwards,
    answer_influence,
    answer_perturbation,
    loss_prompts_shareable,
    shared_prompt_logps,
)
from gear.integrations.trl.passes import (
    CreditBatch,
    error_mask,
    influence,
    teacher_pass,
    token_signals,
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
from gear.integrations.trl.states import StudentStates, sampling_temperature
from gear.integrations.trl.teacher_model import (
    EMATeacherUpdate,
    build_teacher,
    load_teacher,
    save_teacher,
    update_ema,
)
from gear.integrations.trl.vllm_sync import keep_vllm_weights_updatable
from gear.integrations.trl.vllm_teacher import TeacherLogprobs
from gear.modeling import LogitConventions
from gear.spans import LocateAnswer
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
        check_arguments(args, teacher_model, teacher_processing_class, wrong_answer, step_checker)
        if args.loss_mode == "self_distill" and not reward_funcs:
            reward_funcs = [no_reward]  # TRL needs a reward source; OPSD uses none

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
        check_built(self, args)
        self._gear_warned_no_sampling_logprobs = False

        self.credit_params = args.credit_params
        requires = set(self.credit_params.required_signals)
        self_distill = args.loss_mode == "self_distill"
        # what this run computes: the signal pass (student signals, a teacher's KL or log-probs;
        # `PASS_SIGNALS`), a teacher, and the answer influence from its own pass: OAR-G's input
        # gradient or OAR-P's masked copies. A checker's mask and the group prefix tree's
        # counts (`batch_credit`) need no pass.
        self._influence_signal = next(
            (s for s in ("influence", "perturbation") if s in requires), None
        )
        self._needs_influence = self._influence_signal is not None
        self._needs_signals = self_distill or bool(requires & set(PASS_SIGNALS))
        self._needs_teacher = self_distill or bool(requires & set(TEACHER_SIGNALS))
        check_passes(self, args, self._influence_signal, self._needs_signals, train_dataset)
        if self._needs_teacher and rollout_func is None:  # TRL's own checks ran first
            check_ground_truth_sources(self, train_dataset, eval_dataset)
        self._gear_answer_span = answer_span or final_answer_span
        self._gear_reference_text = reference_text or ground_truth_text
        self._gear_step_checker = step_checker
        # teacher_context='contrast': the wrong-answer hook, checked on every answer up front
        self._gear_wrong_answer = wrong_answer or offset_answer
        self._gear_answer_pool = (
            contrast_pool(train_dataset, args.hint_column, self._gear_wrong_answer, args.seed)
            if self.credit_params.contrast
            else []
        )
        self._forwards = Forwards(
            accelerator=self.accelerator,
            conventions=LogitConventions.of(self.model),
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
            share = self.args.loss_prefix_sharing and loss_prompts_shareable(
                model, input_ids.size(1), logits_to_keep, args, kwargs
            )
            if not self._student.on_every_process(share):  # sharded forwards pair up
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

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        if self._needs_teacher and self.rollout_func is None and self.environment_factories is None:
            # fail before generating
            ground_truths_of(inputs, self.args.hint_column, column_setting(self.args))
        rl = self.args.loss_mode == "rl"
        with self._student.capturing(rl and self._needs_signals):
            output = super()._generate_and_score_completions(inputs)

        stats: dict[str, float] = {}
        batch = CreditBatch.of(output)
        if self._needs_teacher:
            t0 = time.perf_counter()
            gts = batch_ground_truths(inputs, self.args.hint_column, self._gear_env_ground_truths)
            batch.teacher = self._teacher_inputs(self._gear_prompts, gts, output, stats)
            if self.credit_params.contrast:
                batch.contrast = self._contrast_inputs(self._gear_prompts, gts, output, mode)
            stats["gear/time_teacher_prompts"] = time.perf_counter() - t0
            if not rl:  # self_distill: the teacher pass runs in the loss, on each micro-batch
                (
                    output["gear_teacher_input_ids"],
                    output["gear_teacher_attention_mask"],
                    output["gear_has_hint"],
                ) = batch.teacher
                log_stats(self.accelerator, self._metrics[mode], stats)
                return output
        # the rows the credit method reads: tied rows (advantage 0) get no teacher, contrast,
        # influence or signal pass (`skip_zero_advantage_rows`)
        batch.scored = scored_rows(
            output["advantages"],
            self.credit_params,
            self.args.skip_zero_advantage_rows,
            self.accelerator,
        )
        if self._needs_signals:
            batch.signals = self._token_signals(
                output, batch.teacher, batch.valid, mode, stats, batch.contrast, batch.scored
            )
        if self._needs_influence:
            found, batch.answer_mask = self._influence(
                inputs, output, batch.valid, mode, stats, batch.scored
            )
            if self._influence_signal == "perturbation":
                batch.perturbation = found
            else:
                batch.influence = found
        # a checker's mask: first_error's blame, and for any method where GRPO's implicit credit
        # puts a failed row's blame (`gear/branch_*`)
        if self._gear_step_checker is not None:
            batch.error_mask = error_mask(self, inputs, output, batch.valid, stats)
        t0 = time.perf_counter()
        sequence_advantages = output["advantages"]
        details = self._credit(
            sequence_advantages,
            batch.valid,
            batch.turn_starts,
            batch.credit_signals,
            batch.influence,
            answer_mask=batch.answer_mask,
            scored=batch.scored,
            error_mask=batch.error_mask,
            perturbation=batch.perturbation,
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
            self._maybe_write_credit_record(output, details, batch.signals, sequence_advantages)
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

    # ------------------------------------------------------------------------------- seams

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
        """The signal pass of the batch: (B, T) signals at the `valid` tokens from the student's
        states and, given `teacher` = (ids, mask, has_hint), one teacher pass; given `contrast`,
        a contrast teacher's KL; given `scored` (B,) bool, those rows only (`passes.token_signals`)."""
        return token_signals(self, output, teacher, valid, mode, stats, contrast, scored)

    def _teacher_pass(
        self, ids: Tensor, mask: Tensor, output: dict[str, Any], batch_size: int
    ) -> Tensor | TeacherLogprobs:
        """The teacher on its (B, L) input `ids` / `mask`: its (B, T, H) final hidden states or
        vLLM's log-probs of the completion tokens (`passes.teacher_pass`)."""
        return teacher_pass(self, ids, mask, output, batch_size)

    def _influence(
        self,
        inputs: list[dict[str, Any]],
        output: dict[str, Any],
        valid: Tensor,
        mode: str,
        stats: dict[str, float],
        scored: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(B, T) influence of each completion token on its row's answer and the (B, T) bool
        answer span (`passes.influence`). The kernel is looked up in this module at each call,
        so patching `answer_perturbation` / `answer_influence` here reaches the pass."""
        oar_p = self._influence_signal == "perturbation"
        kernel = answer_perturbation if oar_p else answer_influence
        return influence(self, inputs, output, valid, mode, stats, scored, kernel)

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
            self.accelerator, advantages, valid, turn_starts, signals, self._batch_credit_params(),
            influence, answer_mask, scored, error_mask, perturbation, completion_ids,
            completion_mask, group_size,
        )  # fmt: skip

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


__all__ = ["TESTED_TRL", "GEARTrainer", "no_reward"]

"""GEAR in Hugging Face TRL: `GEARConfig` / `GEARTrainer`, drop-in for `GRPOConfig` / `GRPOTrainer`.

Switching from GRPO to GEAR is changing the two class names::

    from gear.integrations.trl import GEARConfig, GEARTrainer

    args = GEARConfig(output_dir="out", credit_method="gear", teacher="current")
    trainer = GEARTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds)
    trainer.train()

The trainer only wires TRL's batch to `gear.credit` and the teacher (spec §1-5):

1. TRL generates, scores and computes the sequence advantages A_i as usual (`super()`).
2. Teacher prompts (the student's prompt with a ground-truth hint, `gear.teacher`) are rendered
   with the same tokenizer, chat template and tool schemas as generation.
3. One no-grad teacher pass on teacher prompt + the completion ids gives final hidden states.
   The student's are read off generation (single-turn transformers path), or off TRL's own
   student pass when it runs one (for `old_per_token_logps`); otherwise one no-grad student
   pass on prompt + completion computes them.
4. `gear.credit.signals_from_hidden` turns them into per-token KL / entropy / log-probs, chunk
   by chunk, and `gear.credit.credit_details` into (B, T) token advantages, which replace TRL's
   (B,) advantages; every TRL loss type accepts (B, T) advantages.

Tool / environment observation tokens (TRL's `tool_mask`, or `env_mask` of a `rollout_func`)
are excluded from every statistic and weight, and a policy token that follows them starts a new
continuation, so no segment crosses them.

`loss_mode="self_distill"` replaces the policy-gradient loss by the per-token reverse
KL(student || detached teacher) over the full vocabulary (OPSD, arXiv 2601.18734); no reward is
needed. The teacher pass then runs inside the loss, under no_grad, on the current micro-batch, so
the "current" teacher is exactly the weights being trained.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import trl
from packaging.version import Version
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.models import prepare_deepspeed
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import (
    create_model_from_path,
    disable_dropout_in_model,
    maybe_gather_lm_head_ctx,
    pad,
)

from gear.credit import CreditDetails, CreditParams, TokenSignals, credit_details
from gear.credit.methods import METHODS
from gear.credit.signals import DEFAULT_CHUNK, ESTIMATORS, signals_from_hidden
from gear.teacher import HINT_TEMPLATES, fit_teacher_prompt
from gear.viz.record import credit_record_path, credit_rows, write_credit_record

TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))  # [min, max): the range the tests run on
if not TESTED_TRL[0] <= Version(trl.__version__) < TESTED_TRL[1]:
    warnings.warn(
        f"gear.integrations.trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}; "
        f"found trl {trl.__version__}. GEARTrainer overrides private GRPOTrainer methods.",
        stacklevel=2,
    )

TEACHERS = ("current", "frozen", "ema")
LOSS_MODES = ("rl", "self_distill")
HINT_KINDS = ("auto", "math", "tool")
TEACHER_FILE = "gear_teacher.safetensors"  # frozen / ema teacher weights inside a checkpoint
SUMMED_STATS = ("gear/teacher_prompts_truncated", "gear/rows_without_ground_truth")

_CREDIT_FIELDS = {f.name: f for f in dataclasses.fields(CreditParams)}


def _credit_field(name: str) -> Any:
    """A config field mirroring `CreditParams.<name>`: same default, same help."""
    f = _CREDIT_FIELDS[name]
    return field(
        default=f.default, metadata={"help": f"{f.metadata['help']} (CreditParams.{name})"}
    )


@dataclass
class GEARConfig(GRPOConfig):
    r"""Configuration of [`GEARTrainer`]: every [`GRPOConfig`] field plus GEAR's.

    The credit method's hyper-parameters are `CreditParams` fields with a `credit_` prefix
    (`credit_method`, `credit_tau_onset`, ...), since several names (`beta`, `seed`) already mean
    something else in `GRPOConfig`. `credit_params` returns them as a `CreditParams`.
    """

    # Credit (spec §2-3)
    credit_method: str = _credit_field("method")
    credit_tau_onset: float = _credit_field("tau_onset")
    credit_delta_entropy: float = _credit_field("delta_entropy")
    credit_max_segment_len: int = _credit_field("max_segment_len")
    credit_modulation: str = _credit_field("modulation")
    credit_alpha: float = _credit_field("alpha")
    credit_beta: float = _credit_field("beta")
    credit_preserve_mass: bool = _credit_field("preserve_mass")
    credit_w_min: float = _credit_field("w_min")
    credit_w_max: float = _credit_field("w_max")
    credit_tau_entropy: float = _credit_field("tau_entropy")
    credit_fixed_len: int = _credit_field("fixed_len")
    credit_rlsd_lambda: float = _credit_field("rlsd_lambda")
    credit_rlsd_eps: float = _credit_field("rlsd_eps")
    credit_rho: float = _credit_field("rho")
    credit_seed: int = field(
        default=_CREDIT_FIELDS["seed"].default,
        metadata={
            "help": "Seed of the 'random' method; the generation batch of step s uses seed + s, so "
            "boundaries differ across steps. (CreditParams.seed)"
        },
    )

    # Teacher (spec §4)
    teacher: str = field(
        default="current",
        metadata={
            "help": "'current': the policy's weights; 'frozen': the initial weights (or `teacher_model`); "
            "'ema': an exponential moving average of the policy, updated after each optimizer step."
        },
    )
    ema_decay: float = field(
        default=0.99, metadata={"help": "Decay of the 'ema' teacher, in [0, 1)."}
    )
    ground_truth_column: str = field(
        default="ground_truth",
        metadata={"help": "Dataset column whose value fills the teacher hint's {ground_truth}."},
    )
    hint_kind: str = field(
        default="auto",
        metadata={
            "help": "Which hint template the teacher gets: 'math', 'tool', or 'auto' ('tool' when the "
            "trainer has tools or an environment, else 'math')."
        },
    )
    math_hint_template: str = field(
        default=HINT_TEMPLATES["math"],
        metadata={"help": "Teacher hint for math; holds {ground_truth}."},
    )
    tool_hint_template: str = field(
        default=HINT_TEMPLATES["tool"],
        metadata={"help": "Teacher hint for tool use; holds {ground_truth}."},
    )
    teacher_max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of a teacher prompt; longer ones lose the middle of the ground truth "
            "(counted as gear/teacher_prompts_truncated). None: no limit."
        },
    )

    # Signals
    kl_estimator: str = field(
        default="full", metadata={"help": "KL estimator: 'full' (exact), 'topk', 'k1' or 'k3'."}
    )
    kl_topk: int = field(default=64, metadata={"help": "k of the 'topk' KL estimator."})
    student_hidden_from_generation: bool = field(
        default=True,
        metadata={
            "help": "Read the student's final hidden states off transformers generation (the "
            "states the tokens were sampled from) instead of a second no-grad student forward. "
            "Used on the single-turn transformers path only; vLLM, continuous batching, tools, "
            "environments, rollout_func, VLMs, beam search and prompt-lookup decoding run the "
            "forward."
        },
    )
    signal_chunk_size: int = field(
        default=DEFAULT_CHUNK,
        metadata={
            "help": "Tokens per chunk when forming logits for the signals and the self-distill loss."
        },
    )

    # Logging
    credit_log_steps: int = field(
        default=50,
        metadata={
            "help": "Write a credit record (output_dir/credit/step_XXXXXX.jsonl) every this many "
            "steps; 0: never."
        },
    )
    credit_log_rows: int = field(default=4, metadata={"help": "Rows per credit record."})

    # Loss
    loss_mode: str = field(
        default="rl",
        metadata={
            "help": "'rl': TRL's loss (any loss_type) with GEAR's token advantages; 'self_distill': "
            "per-token reverse KL(student || detached teacher), no reward (OPSD baseline)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.credit_params  # noqa: B018  (validates every credit_* field)

        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"GEARConfig.{name}: expected {expected}, got {getattr(self, name)!r}"
            )

        if self.teacher not in TEACHERS:
            raise bad("teacher", f"one of {list(TEACHERS)}")
        if not 0 <= self.ema_decay < 1:
            raise bad("ema_decay", "a number in [0, 1)")
        if self.loss_mode not in LOSS_MODES:
            raise bad("loss_mode", f"one of {list(LOSS_MODES)}")
        if self.hint_kind not in HINT_KINDS:
            raise bad("hint_kind", f"one of {list(HINT_KINDS)}")
        for name in ("math_hint_template", "tool_hint_template"):
            if "{ground_truth}" not in getattr(self, name):
                raise bad(name, "a template with a '{ground_truth}' placeholder")
        if self.kl_estimator not in ESTIMATORS:
            raise bad("kl_estimator", f"one of {list(ESTIMATORS)}")
        if self.teacher_max_prompt_length is not None and self.teacher_max_prompt_length < 1:
            raise bad("teacher_max_prompt_length", "None or an integer >= 1")
        for name in ("kl_topk", "signal_chunk_size"):
            if getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        for name in ("credit_log_steps", "credit_log_rows"):
            if getattr(self, name) < 0:
                raise bad(name, "an integer >= 0")

    @property
    def credit_params(self) -> CreditParams:
        """The `credit_*` fields as a validated `CreditParams`."""
        return CreditParams(**{name: getattr(self, f"credit_{name}") for name in _CREDIT_FIELDS})


def no_reward(completions: list, **kwargs: Any) -> list[float]:
    """Reward 0 for every completion: the reward source of `loss_mode="self_distill"` runs."""
    return [0.0] * len(completions)


class _EMATeacherUpdate(TrainerCallback):
    """Moves the EMA teacher towards the policy after every optimizer step."""

    def __init__(self, trainer: GEARTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.update_ema_teacher()


class GEARTrainer(GRPOTrainer):
    """[`GRPOTrainer`] whose sequence advantages are reshaped into GEAR token advantages.

    Same constructor and datasets as `GRPOTrainer`; the dataset needs a ground-truth column
    (`GEARConfig.ground_truth_column`). Two extra keyword arguments select a separate frozen
    teacher (`teacher="frozen"` only): `teacher_model` (model or path) and
    `teacher_processing_class`, whose vocabulary must equal the policy's.
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
        if rollout_func is None:  # a rollout_func may supply the column as an extra field
            for ds in (train_dataset, *(_datasets(eval_dataset))):
                columns = getattr(ds, "column_names", None)
                if columns is not None:
                    _require_column(args.ground_truth_column, list(columns))
            if train_dataset is None and environment_factory is not None:
                # TRL then trains on a placeholder dataset that has only a "prompt" column
                _require_column(args.ground_truth_column, ["prompt"])

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
        if self._is_vlm:
            raise NotImplementedError(
                "GEARTrainer supports text-only models (the teacher pass has no image inputs)"
            )
        text_config = self.model.config.get_text_config()
        if getattr(text_config, "final_logit_softcapping", None):
            raise NotImplementedError(
                "GEARTrainer: models with final_logit_softcapping are not supported yet "
                "(gear.credit.signals_from_hidden has no softcap)"
            )
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
        self._credit_requires = METHODS[self.credit_params.method].requires
        self._logit_scale = _logit_scale(text_config)
        self.teacher_model = self._build_teacher(teacher_model, teacher_processing_class)
        if args.teacher == "ema":
            self.add_callback(_EMATeacherUpdate(self))
        self._gear_prompts: list | None = None  # prompts of the batch being generated
        self._gear_rewards: Tensor | None = None  # (all rows, reward funcs), gathered
        self._gear_capture: list[Tensor] | None = None  # armed: capture the student hidden states
        self._gear_generation: list[Tensor] | None = None  # armed: capture generation states
        self._gear_next_record_step = 0

    # ------------------------------------------------------------------------------- teacher

    def _build_teacher(
        self, teacher_model: PreTrainedModel | str | None, teacher_tokenizer: Any
    ) -> nn.Module | None:
        """None for the current teacher, else a no-grad eval copy (frozen / ema) on the device."""
        if self.args.teacher == "current":
            return None
        if self.is_fsdp_enabled:
            raise NotImplementedError(
                f"teacher={self.args.teacher!r} with FSDP is not supported yet; "
                "use teacher='current' or DDP / DeepSpeed"
            )
        if self.args.teacher == "ema" and self.is_deepspeed_enabled:
            raise NotImplementedError(
                "teacher='ema' with DeepSpeed is not supported yet (the EMA update "
                "needs unpartitioned parameters); use teacher='frozen' or DDP"
            )
        if teacher_model is None:
            teacher = _without_fused_forward(
                copy.deepcopy(self.accelerator.unwrap_model(self.model))
            )
        else:
            if isinstance(teacher_model, str):
                if teacher_tokenizer is None:
                    teacher_tokenizer = AutoTokenizer.from_pretrained(
                        teacher_model, trust_remote_code=self.args.trust_remote_code
                    )
                kwargs = dict(self.args.model_init_kwargs or {})
                kwargs.setdefault("dtype", self.model.dtype)
                teacher = create_model_from_path(teacher_model, **kwargs)
            else:
                teacher = teacher_model
            self._check_teacher_vocabulary(teacher, teacher_tokenizer)
        teacher.eval()
        teacher.requires_grad_(False)
        disable_dropout_in_model(teacher)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(teacher, self.accelerator)
        return teacher.to(self.accelerator.device)

    def _check_teacher_vocabulary(self, teacher: nn.Module, tokenizer: Any) -> None:
        """A separate teacher must score the same token ids: same vocabulary, same head size."""
        if tokenizer is not None:
            ours, theirs = self._tokenizer.get_vocab(), tokenizer.get_vocab()
            if ours != theirs:
                diff = sorted(set(ours.items()) ^ set(theirs.items()))[:5]
                raise ValueError(
                    f"teacher_processing_class: the teacher's tokenizer differs from the policy's "
                    f"({len(theirs)} vs {len(ours)} tokens; e.g. differing entries {diff}); "
                    "GEAR scores the student's token ids with the teacher, so both must share "
                    "one vocabulary"
                )
        ours_v = self.accelerator.unwrap_model(self.model).get_output_embeddings().weight.shape[0]
        theirs_v = teacher.get_output_embeddings().weight.shape[0]
        if ours_v != theirs_v:
            raise ValueError(
                f"teacher_model: its LM head has {theirs_v} rows, the policy's {ours_v}; the "
                "teacher must use the policy's tokenizer"
            )
        if _logit_scale(teacher.config.get_text_config()) != self._logit_scale:
            raise ValueError(
                "teacher_model: its logit scale differs from the policy's, which is not supported"
            )

    @torch.no_grad()
    def update_ema_teacher(self) -> None:
        """theta_T <- decay * theta_T + (1 - decay) * theta (after each optimizer step)."""
        decay = self.args.ema_decay
        policy = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        for name, t in self.teacher_model.named_parameters():
            t.lerp_(policy[name].detach().to(t.dtype), 1.0 - decay)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.teacher_model is not None and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial),
                f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
            )
            save_model(
                self.accelerator.unwrap_model(self.teacher_model),
                os.path.join(folder, TEACHER_FILE),
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.teacher_model is None:
            return
        path = os.path.join(checkpoint, TEACHER_FILE)
        if os.path.isfile(path):
            load_model(
                self.accelerator.unwrap_model(self.teacher_model),
                path,
                device=str(self.accelerator.device),
            )
        else:
            warnings.warn(
                f"{path} not found: the {self.args.teacher} teacher keeps its current weights "
                "(the checkpoint was not written by GEARTrainer)",
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------- generation

    def _generate(self, prompts: list) -> Any:
        # the prompts after environment resets: exactly what the student is prompted with
        self._gear_prompts = copy.deepcopy(prompts)
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        sink = self._gear_generation
        if sink is None:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with self._capture_hidden(self.model, 1, detach=True, next_token=True) as steps:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        # One (B, 1, H) per decoding step, position t predicting completion token t. With
        # synced_gpus (ZeRO-3 / FSDP) a finished rank keeps stepping until all are done: its own
        # steps come first. All ranks take the same path, or sharded forwards would not pair up.
        completion_ids = out[0]
        longest = max((len(c) for c in completion_ids), default=0)
        usable = 0 < longest <= len(steps) and steps[0].shape[0] == len(completion_ids)
        if self._on_every_process(usable):
            sink.append(torch.cat(steps[:longest], dim=1))
        return out

    def _on_every_process(self, flag: bool) -> bool:
        if self.accelerator.num_processes == 1:
            return flag
        votes = self.accelerator.gather(torch.tensor([float(flag)], device=self.accelerator.device))
        return bool(votes.min() > 0)

    def _reads_generation_hidden(self) -> bool:
        """Whether `_generate_single_turn` is the plain transformers `generate` of whole
        completions, whose per-step final hidden states are the student's."""
        return (
            self.args.student_hidden_from_generation
            and not self.use_vllm
            and not self.use_transformers_continuous_batching
            and self.rollout_func is None
            and not self.tools
            and self.environment_factories is None
            and not self._is_vlm
            and (getattr(self.generation_config, "num_beams", None) or 1) == 1
            and getattr(self.generation_config, "prompt_lookup_num_tokens", None) is None
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
        capture, self._gear_capture = self._gear_capture, None  # only TRL's first (old-logp) pass
        if capture is None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        with self._capture_hidden(model, logits_to_keep, detach=True) as hidden:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        capture.extend(hidden)
        return out

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        if self.rollout_func is None:
            _ground_truths(inputs, self.args.ground_truth_column)  # fail before generating
        rl = self.args.loss_mode == "rl"
        need_signals = rl and bool(self._credit_requires)
        capture: list[Tensor] = []
        generate_every = self.args.steps_per_generation * self.num_iterations
        trl_runs_student = self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )
        self._gear_capture = capture if need_signals and trl_runs_student else None
        from_generation = need_signals and not trl_runs_student and self._reads_generation_hidden()
        self._gear_generation = [] if from_generation else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._gear_capture = None
            generated, self._gear_generation = self._gear_generation, None
        if generated:  # (B, longest, H); TRL may pad completions further (pad_to_multiple_of)
            hidden = generated[0]
            width = output["completion_ids"].shape[1]
            capture.append(torch.nn.functional.pad(hidden, (0, 0, 0, width - hidden.shape[1])))

        stats: dict[str, float] = {}
        signals = None
        valid, turn_starts = _response_mask(output)
        if need_signals or not rl:
            t0 = time.perf_counter()
            gts = _ground_truths(inputs, self.args.ground_truth_column)
            teacher_ids, teacher_mask = self._teacher_inputs(self._gear_prompts, gts, output, stats)
            stats["gear/time_teacher_prompts"] = time.perf_counter() - t0
            if not rl:  # self_distill: the teacher pass runs in the loss, on each micro-batch
                output["gear_teacher_input_ids"], output["gear_teacher_attention_mask"] = (
                    teacher_ids,
                    teacher_mask,
                )
                self._log_stats(mode, stats)
                return output
            signals = self._token_signals(
                output, capture, teacher_ids, teacher_mask, valid, mode, stats
            )

        t0 = time.perf_counter()
        sequence_advantages = output["advantages"]
        details = self._credit(sequence_advantages, valid, turn_starts, signals)
        output["advantages"] = details.token_advantages.to(sequence_advantages.dtype)
        stats["gear/time_credit"] = time.perf_counter() - t0
        self._log_stats(mode, stats)
        for key, value in details.stats.items():  # already over the whole generation batch
            self._metrics[mode][key].append(value)
        if mode == "train":
            self._maybe_write_credit_record(
                output, details, signals, sequence_advantages, self._gear_prompts
            )
        return output

    @torch.no_grad()
    def _token_signals(
        self,
        output: dict[str, Any],
        capture: list[Tensor],
        teacher_ids: Tensor,
        teacher_mask: Tensor,
        valid: Tensor,
        mode: str,
        stats: dict[str, float],
    ) -> TokenSignals:
        """One student pass (or the states of generation or of TRL's pass, captured) and one
        teacher pass, then the chunked signals at the (B, T) `valid` policy tokens."""
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        n_keep = completion_ids.size(1)
        batch_size = (
            self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size
        )
        t0 = time.perf_counter()
        if capture:
            student_hidden = torch.cat(capture)
        else:
            student_hidden = self._final_hidden(
                self.model,
                torch.cat([output["prompt_ids"], completion_ids], dim=1),
                torch.cat([output["prompt_mask"], completion_mask], dim=1),
                n_keep,
                batch_size,
            )
        t1 = time.perf_counter()
        teacher_hidden = self._final_hidden(
            self._teacher(), teacher_ids, teacher_mask, n_keep, batch_size
        )
        t2 = time.perf_counter()
        signals = self._signals(student_hidden, teacher_hidden, completion_ids, mask=valid)
        stats["gear/time_student"] = 0.0 if capture else t1 - t0
        stats["gear/time_teacher"], stats["gear/time_signals"] = t2 - t1, time.perf_counter() - t2
        return signals

    def _credit(
        self,
        advantages: Tensor,
        valid: Tensor,
        turn_starts: Tensor | None,
        signals: TokenSignals | None,
    ) -> CreditDetails:
        """`gear.credit.credit_details` of this process's rows, computed on the generation batch
        of all processes: exact batch statistics, and batch-level methods (`entropy_top`) see
        the whole batch, as in one process."""
        inputs = {
            "valid": valid,
            "turn_starts": turn_starts,
            **{
                k: None if signals is None else getattr(signals, k)
                for k in ("kl", "entropy", "student_logprobs", "teacher_logprobs")
            },
        }
        world = self.accelerator.num_processes
        B, T = valid.shape
        if world > 1:  # pad every process's (B, T_p) to the longest T, gather the rows
            advantages = self.accelerator.gather(advantages)
            inputs = {
                k: None
                if v is None
                else self.accelerator.gather(
                    self.accelerator.pad_across_processes(v.float(), dim=1, pad_index=0)
                )
                for k, v in inputs.items()
            }
            inputs["valid"] = inputs["valid"].bool()
            inputs["turn_starts"] = (
                None if inputs["turn_starts"] is None else inputs["turn_starts"].bool()
            )
        details = credit_details(
            advantages, inputs.pop("valid"), **inputs, params=self._batch_credit_params()
        )
        if world == 1:
            return details
        rows = slice(self.accelerator.process_index * B, (self.accelerator.process_index + 1) * B)
        local = {
            f.name: getattr(details, f.name)[rows]
            if f.name == "fallback_rows"
            else getattr(details, f.name)[rows, :T]
            for f in dataclasses.fields(details)
            if f.name != "stats"
        }
        return CreditDetails(**local, stats=details.stats)

    def _teacher(self) -> nn.Module:
        return self.model if self.teacher_model is None else self.teacher_model

    def _batch_credit_params(self) -> CreditParams:
        """`credit_params`, with the 'random' method's seed varied per step."""
        p = self.credit_params
        return (
            dataclasses.replace(p, seed=p.seed + self.state.global_step)
            if p.method == "random"
            else p
        )

    def _hint_template(self) -> str:
        kind = self.args.hint_kind
        if kind == "auto":
            kind = "tool" if self.tools else "math"
        return self.args.tool_hint_template if kind == "tool" else self.args.math_hint_template

    def _render_prompt(self, prompt: Any, tools: list | None) -> list[int]:
        """Prompt -> ids exactly as TRL renders generation prompts (template, tools, kwargs)."""
        if isinstance(prompt, str):
            return list(self.processing_class(text=prompt)["input_ids"])
        ids = self.processing_class.apply_chat_template(
            conversation=prompt,
            tools=tools or None,  # as TRL: some templates render tool boilerplate for tools=[]
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.chat_template_kwargs,
        )["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def _teacher_inputs(
        self, prompts: list, ground_truths: list, output: dict[str, Any], stats: dict[str, float]
    ) -> tuple[Tensor, Tensor]:
        """Teacher prompt (left-padded) + the student's completion ids: ids and mask, (B, P_T + T).

        Counts rows whose hint was truncated and rows without a ground truth into `stats`."""
        prompt_ids, truncated, no_hint = self._teacher_prompts(prompts, ground_truths)
        tok = self._tokenizer
        device = output["completion_ids"].device
        ids = pad(
            [torch.tensor(r, dtype=torch.long) for r in prompt_ids],
            padding_value=tok.pad_token_id,
            padding_side="left",
        ).to(device)
        mask = pad(
            [torch.ones(len(r), dtype=torch.long) for r in prompt_ids],
            padding_value=0,
            padding_side="left",
        ).to(device)
        stats["gear/teacher_prompts_truncated"] = float(truncated)
        stats["gear/rows_without_ground_truth"] = float(no_hint)
        return (
            torch.cat([ids, output["completion_ids"]], dim=1),
            torch.cat([mask, output["completion_mask"]], dim=1),
        )

    def _teacher_prompts(
        self, prompts: list, ground_truths: list
    ) -> tuple[list[list[int]], int, int]:
        """Teacher prompt ids per row (spec §4), the number truncated, the number without a hint."""
        tok = self._tokenizer
        template = self._hint_template()
        rows, truncated, no_hint = [], 0, 0
        for i, (prompt, gt) in enumerate(zip(prompts, ground_truths, strict=True)):
            if self.environment_factories is not None:
                tools = self._env_tools[self._batch_environments[i]]
            else:
                tools = self.tools
            if gt is None:  # no reference for this row: the teacher sees the student's prompt
                rows.append(self._render_prompt(prompt, tools))
                no_hint += 1
                continue
            ids, cut = fit_teacher_prompt(
                lambda p, tools=tools: self._render_prompt(p, tools),
                prompt,
                str(gt),
                template,
                self.args.teacher_max_prompt_length,
                tokenize=lambda s: tok(s, add_special_tokens=False)["input_ids"],
                detokenize=lambda ids: tok.decode(ids),
            )
            rows.append(ids)
            truncated += int(cut)
        return rows, truncated, no_hint

    # ------------------------------------------------------------------------------- forwards

    @contextmanager
    def _capture_hidden(
        self, model: nn.Module, n_keep: int, detach: bool, next_token: bool = False
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

        handle = _backbone(self.accelerator.unwrap_model(model)).register_forward_hook(hook)
        try:
            yield captured
        finally:
            handle.remove()

    def _final_hidden(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        n_keep: int,
        batch_size: int | None = None,
        grad: bool = False,
    ) -> Tensor:
        """(B, n_keep, H) final hidden states at the positions predicting the last n_keep tokens.

        Runs the root module (so DDP / DeepSpeed / PEFT hooks fire) with `logits_to_keep=1`
        and reads the backbone's output; rows go in chunks of `batch_size`, like TRL's passes.
        """
        batch_size = batch_size or input_ids.size(0)
        unwrapped = self.accelerator.unwrap_model(model)
        no_checkpointing = (
            disable_gradient_checkpointing(unwrapped, self.args.gradient_checkpointing_kwargs)
            if not grad and _checkpointing(unwrapped)
            else nullcontext()
        )
        chunks = []
        with no_checkpointing:
            for start in range(0, input_ids.size(0), batch_size):
                stop = start + batch_size
                with (
                    self._capture_hidden(model, n_keep, detach=not grad) as hidden,
                    self.accelerator.autocast(),
                ):
                    model(
                        input_ids=input_ids[start:stop],
                        attention_mask=attention_mask[start:stop],
                        logits_to_keep=1,
                        use_cache=False,
                    )
                chunks.append(hidden[-1])
        return torch.cat(chunks)

    @contextmanager
    def _heads(self) -> Iterator[tuple[Tensor, Tensor | None, Tensor, Tensor | None]]:
        """(W_S, b_S, W_T, b_T) of the student and teacher LM heads, gathered if sharded."""
        student = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        teacher = (
            student
            if self.teacher_model is None
            else self._unwrapped_teacher().get_output_embeddings()
        )
        with maybe_gather_lm_head_ctx(student.weight, student.bias, teacher.weight, teacher.bias):
            yield (*_full(student.weight, student.bias), *_full(teacher.weight, teacher.bias))

    def _unwrapped_teacher(self) -> nn.Module:
        t = self.teacher_model
        return t.module if hasattr(t, "module") else t  # a DeepSpeed engine wraps the module

    @property
    def _signal_temperature(self) -> float:
        """Sampling temperature, folded with the model's logit scale (logits * s / T)."""
        return self.temperature / self._logit_scale

    def _signals(
        self,
        student_hidden: Tensor,
        teacher_hidden: Tensor,
        token_ids: Tensor,
        mask: Tensor | None = None,
    ) -> TokenSignals:
        """Per-token KL / entropy / log-probs from the final hidden states (spec §1), computed
        at the `mask` positions only (policy tokens; 0 elsewhere)."""
        kwargs = dict(
            temperature=self._signal_temperature,
            estimator=self.args.kl_estimator,
            topk=self.args.kl_topk,
            chunk_size=self.args.signal_chunk_size,
            mask=mask,
        )
        with self._heads() as (ws, bs, wt, bt):
            hs, ht = student_hidden.to(ws.dtype), teacher_hidden.to(wt.dtype)
            separate = wt is not ws or bt is not bs
            return signals_from_hidden(
                hs,
                ht,
                ws,
                token_ids,
                lm_head_bias=bs,
                teacher_lm_head_weight=wt if separate else None,
                teacher_lm_head_bias=bt if separate else None,
                **kwargs,
            )

    # ------------------------------------------------------------------------------- loss

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        if self.args.loss_mode == "self_distill":
            return self._self_distill_loss(model, inputs)
        return super()._compute_loss(model, inputs)

    def _self_distill_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        """OPSD: sum over valid tokens of KL(pi_S || sg(pi_T)), full vocabulary, divided by the
        generation batch's valid-token count per accumulation window (TRL's 'dapo' normaliser),
        so the gradient is that of the token-mean KL whatever the accumulation."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        n_keep = completion_ids.size(1)
        with torch.no_grad():
            teacher_hidden = self._final_hidden(
                self._teacher(),
                inputs["gear_teacher_input_ids"],
                inputs["gear_teacher_attention_mask"],
                n_keep,
            )
        student_hidden = self._final_hidden(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
            n_keep,
            grad=True,
        )
        valid = mask.bool()
        with self._heads() as (ws, bs, wt, bt):
            kl_valid, entropy_valid = _reverse_kl(
                student_hidden[valid].to(ws.dtype),
                teacher_hidden[valid].to(wt.dtype),
                ws,
                bs,
                wt.detach(),
                None if bt is None else bt.detach(),
                1.0 / self._signal_temperature,
                self.args.signal_chunk_size,
            )
        mode = "train" if self.model.training else "eval"
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = (
                normalizer
                * self.current_gradient_accumulation_steps
                / self.args.steps_per_generation
            )
        # `0 * student_hidden.sum()` keeps the graph connected when no token of the micro-batch is valid
        loss = kl_valid.sum() / normalizer + 0.0 * student_hidden.sum()
        totals = self.accelerator.reduce(
            torch.stack([kl_valid.detach().sum(), entropy_valid.sum(), valid.sum().float()]),
            reduction="sum",
        )
        count = totals[2].clamp(min=1.0)
        self._metrics[mode]["gear/kl_mean"].append((totals[0] / count).item())
        self._metrics[mode]["gear/entropy_mean"].append((totals[1] / count).item())
        return loss

    # ------------------------------------------------------------------------------- logging

    def _log_stats(self, mode: str, stats: dict[str, float]) -> None:
        """Append per-process gear/* values (timings, prompt counts) to TRL's metrics: the mean
        over processes, except counts, which are summed."""
        keys = sorted(stats)
        local = torch.tensor(
            [stats[k] for k in keys], dtype=torch.float32, device=self.accelerator.device
        )
        every = self.accelerator.gather(local).view(-1, len(keys))
        for key, column in zip(keys, every.unbind(1), strict=True):
            value = column.sum() if key in SUMMED_STATS else column.mean()
            self._metrics[mode][key].append(value.item())

    def _maybe_write_credit_record(
        self,
        output: dict[str, Any],
        details: CreditDetails,
        signals: TokenSignals | None,
        advantages: Tensor,
        prompts: list,
    ) -> None:
        """Write `output_dir/credit/step_XXXXXX.jsonl` (main process, its first rows) when due."""
        every, n_rows = self.args.credit_log_steps, self.args.credit_log_rows
        step = self.state.global_step
        if every == 0 or n_rows == 0 or step < self._gear_next_record_step:
            return
        self._gear_next_record_step = step + every
        if not self.accelerator.is_main_process:
            return
        ids = output["completion_ids"].cpu()
        real = output["completion_mask"].bool().cpu() | details.valid.cpu()
        rows = list(range(min(n_rows, ids.size(0))))
        tokens: list[list[str]] = [[] for _ in range(ids.size(0))]
        completions: list[str] = [""] * ids.size(0)
        for i in rows:
            nz = real[i].nonzero()
            row_ids = ids[i, : int(nz[-1]) + 1 if len(nz) else 0].tolist()
            tokens[i] = self._tokenizer.batch_decode([[t] for t in row_ids])
            completions[i] = self._tokenizer.decode(row_ids)
        records = credit_rows(
            details,
            tokens=tokens,
            rewards=self._local_rewards(ids.size(0)),
            advantages=advantages,
            prompts=prompts,
            completions=completions,
            step=step,
            method=self.credit_params.method,
            rows=rows,
            kl=None if signals is None else signals.kl,
            entropy=None if signals is None else signals.entropy,
            token_ids=ids,
            completion_mask=output["completion_mask"],
        )
        write_credit_record(credit_record_path(self.args.output_dir, step), records)

    def _local_rewards(self, n: int) -> Tensor:
        """(n,) weighted reward of this process's rows (NaN where no reward function applied)."""
        per_func = self._gear_rewards
        start = self.accelerator.process_index * n
        local = per_func[start : start + n].float().cpu()
        total = (local * self.reward_weights.cpu()[None]).nansum(dim=1)
        return torch.where(torch.isnan(local).all(dim=1), torch.nan, total)


# ----------------------------------------------------------------------------------- helpers


def _datasets(eval_dataset: Any) -> list:
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def _require_column(column: str, present: list[str]) -> None:
    if column not in present:
        raise ValueError(
            f"ground_truth_column: the teacher hint needs column {column!r}, which the dataset does not have; "
            f"columns present: {sorted(present)}. Set GEARConfig.ground_truth_column to one of them "
            "(and keep remove_unused_columns=False)."
        )


def _ground_truths(inputs: list[dict[str, Any]], column: str) -> list[Any]:
    for row in inputs:
        if column not in row:
            _require_column(column, list(row))
    return [row[column] for row in inputs]


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


def _backbone(model: nn.Module) -> nn.Module:
    """The decoder whose output is the final hidden state (as TRL's fused LM head reads it)."""
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model.base_model


def _without_fused_forward(model: nn.Module) -> nn.Module:
    """Undo TRL's `add_fused_lm_head` on a deep copy of the policy.

    TRL sets `forward` per instance to a closure over the model it patched, so a copy would keep
    running the *policy*; deleting the instance attribute restores the class's `forward`."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            del module.__dict__["forward"]
    return model


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, without transformers' rename warning."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def _full(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """FSDP2 exposes sharded DTensors; the signals need plain full tensors."""
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    return weight, bias


def _logit_scale(text_config: Any) -> float:
    """The factor a model applies to its logits (mirrors TRL's fused LM head)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def _kl_chunk(
    hs: Tensor,
    ht: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    wt: Tensor,
    bt: Tensor | None,
    inv_t: float,
) -> tuple[Tensor, Tensor]:
    """KL(pi_S || pi_T) with gradient through the student, and the student entropy (detached)."""
    logp_s = (F.linear(hs, ws, bs).float() * inv_t).log_softmax(-1)
    with torch.no_grad():
        logp_t = (F.linear(ht, wt, bt).float() * inv_t).log_softmax(-1)
    p_s = logp_s.exp()
    kl = (p_s * (logp_s - logp_t)).sum(-1)
    entropy = -(p_s * logp_s).sum(-1)
    return kl, entropy.detach()


def _reverse_kl(
    hs: Tensor,
    ht: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    wt: Tensor,
    bt: Tensor | None,
    inv_t: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """(M,) reverse KL and entropy of M positions, one checkpointed chunk of logits at a time."""
    kls, entropies = [], []
    for start in range(0, hs.size(0), chunk_size):
        stop = start + chunk_size
        kl, ent = checkpoint(
            _kl_chunk, hs[start:stop], ht[start:stop], ws, bs, wt, bt, inv_t, use_reentrant=False
        )
        kls.append(kl)
        entropies.append(ent)
    if not kls:
        empty = hs.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(kls), torch.cat(entropies)


__all__ = ["TEACHER_FILE", "TESTED_TRL", "GEARConfig", "GEARTrainer", "no_reward"]

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
   pass on prompt + completion computes them (`states.StudentStates`).
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

Modules: `config` (GEARConfig), `trainer` (TRL overrides and the orchestration of a batch; the
only module that knows `GEARTrainer`), `forwards` (final hidden states, LM heads and the signal
kernel, with what they need in one `Forwards` built by the trainer), `states` (where the
student's hidden states come from), `teacher_model` (frozen / EMA teacher),
`prompts` (a batch's teacher prompts, via `gear.teacher`), `credit` (the credit of this
process's rows on the whole generation batch), `self_distill` (the OPSD loss), `records`
(gear/* metrics and credit records).
"""

from gear.integrations.trl.config import GEARConfig
from gear.integrations.trl.teacher_model import TEACHER_FILE
from gear.integrations.trl.trainer import TESTED_TRL, GEARTrainer, no_reward

__all__ = ["TEACHER_FILE", "TESTED_TRL", "GEARConfig", "GEARTrainer", "no_reward"]

"""GEARTrainer end to end on a tiny random Llama (CPU, one step each, no download)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import trl
from datasets import Dataset

import gear.integrations.trl.credit as trl_credit
import gear.integrations.trl.forwards as trl_forwards
from _trl_helpers import (
    byte_tokenizer,
    dataset,
    hash_reward,
    make_trainer,
    method_options,
    parameters,
    tiny_model,
)
from gear.credit import METHODS, CreditParams, credit_details, signals_from_logits
from gear.integrations.trl import GEARTrainer
from gear.teacher import HINT_TEMPLATES, teacher_prompt

SPEC_METRICS = (  # spec §5, weight_std split by the sign of A
    "gear/kl_mean", "gear/entropy_mean", "gear/onsets_per_row", "gear/frac_tokens_in_segments",
    "gear/mean_segment_len", "gear/weight_std_pos", "gear/weight_std_neg", "gear/mass_error",
    "gear/fallback_rows",
)  # fmt: skip
RECORD_KEYS = {  # docs/contracts.md, credit record
    "step", "row", "method", "prompt", "completion", "reward", "advantage", "tokens", "token_ids",
    "valid", "kl", "entropy", "kl_norm", "entropy_norm", "onset", "segment_id", "weight",
    "token_advantage",
}  # fmt: skip
TIMINGS = {"gear/time_student", "gear/time_teacher", "gear/time_signals", "gear/time_credit"}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _changed(before: dict, model: torch.nn.Module) -> bool:
    after = parameters(model)
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("mode", [*sorted(METHODS), "self_distill"])
def test_a_step_of_every_method_changes_parameters_and_logs_metrics(tmp_path, tok, mode):
    options = (
        {"loss_mode": "self_distill", "reward_funcs": None}
        if mode == "self_distill"
        else method_options(mode)
    )
    trainer = make_trainer(tmp_path, tok, **options)
    before = parameters(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"])
    expected = ("gear/kl_mean", "gear/entropy_mean") if mode == "self_distill" else SPEC_METRICS
    # a signal the method never computes has no mean: None in the logs, never 0
    unmeasured = {"grpo": ("gear/kl_mean", "gear/entropy_mean"), "entropy_top": ("gear/kl_mean",)}
    no_pass = ("grpo", "oar_g", "oar_p", "first_error", "lambda_grpo")  # no signal pass
    for name in no_pass[1:]:
        unmeasured[name] = unmeasured["grpo"]
    for key in expected:
        assert key in logs, key
        none = key in unmeasured.get(mode, ())
        assert (logs[key] is None) if none else math.isfinite(logs[key]), key
    if mode not in (*no_pass, "self_distill"):
        assert logs["gear/entropy_mean"] > 0
        assert set(logs) >= TIMINGS
    if mode not in (*no_pass, "self_distill", "entropy_top"):
        assert logs["gear/kl_mean"] > 0
    if mode != "self_distill":  # the group prefix tree, whatever the method (issue 67)
        assert 0 <= logs["gear/prefix_shared_frac"] <= 1 and logs["gear/prefix_rows_mean"] >= 1
    if mode == "oar_g":  # no teacher, no signal pass: its own influence pass
        assert trainer.teacher_model is None and not trainer._needs_signals
        assert logs["gear/time_influence"] > 0 and "gear/time_teacher" not in logs
    if mode == "self_distill":
        assert logs["gear/kl_mean"] > 0 and logs["rewards/no_reward/mean"] == 0.0


@pytest.mark.parametrize("method", ["gear_departure_point", "gear_departure_blame"])
def test_first_departure_methods_train_with_the_sampled_token_kl(tmp_path, tok, method):
    """The variants the gym recommends for study (issue 27) run in TRL with `kl_estimator: k1`."""
    trainer = make_trainer(tmp_path, tok, credit_method=method, kl_estimator="k1")
    assert trainer.args.credit_params.method == method
    before = parameters(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    logs = trainer.state.log_history[0]
    for key in SPEC_METRICS:
        assert key in logs and math.isfinite(logs[key]), key
    assert logs["gear/onsets_per_row"] > 0


def _rows_by_prompt(tok, data):
    """Rendered prompt ids -> dataset row."""
    out = {}
    for row in data:
        ids = tok.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        out[tuple(ids["input_ids"])] = row
    return out


def test_token_advantages_reaching_the_loss_equal_gear_credit_of_the_batch(
    tmp_path, tok, monkeypatch
):
    """Oracle: full-logit forwards of student and teacher (built independently from the
    dataset row), gear.credit on them; the trainer's (B, T) advantages must match."""
    data = dataset()
    trainer = make_trainer(tmp_path, tok, data=data, credit_log_rows=2)
    rows = _rows_by_prompt(tok, data)
    sequence_advantages = {}
    original = trl.GRPOTrainer._generate_and_score_completions

    def spy_generate(self, inputs):
        out = original(self, inputs)
        for ids, adv in zip(out["completion_ids"], out["advantages"], strict=True):
            sequence_advantages[tuple(ids.tolist())] = float(adv)
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", spy_generate)
    forwards = []
    real_final_hidden = trainer._final_hidden
    monkeypatch.setattr(
        trainer,
        "_final_hidden",
        lambda m, ids, mask, *a, **k: (
            forwards.append(ids.clone()) or real_final_hidden(m, ids, mask, *a, **k)
        ),
    )
    checked = []
    real_loss = trainer._compute_loss

    def spy_loss(model, inputs):
        checked.append(_oracle_check(trainer, tok, rows, inputs, sequence_advantages, forwards))
        return real_loss(model, inputs)

    monkeypatch.setattr(trainer, "_compute_loss", spy_loss)
    trainer.train()
    assert checked == [True]

    # the credit record of the step follows the contract
    path = tmp_path / "credit" / "step_000001.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert set(r) - {"skipped"} == RECORD_KEYS and r["method"] == "gear"
        assert r.get("skipped", False) == (r["advantage"] == 0)
        n = len(r["tokens"])
        assert n > 0 and all(
            len(r[k]) == n for k in ("token_ids", "valid", "kl", "weight", "token_advantage")
        )
        assert tok.decode(r["token_ids"]) == r["completion"]
        assert r["tokens"] == [tok.decode([t]) for t in r["token_ids"]]


@torch.no_grad()
def _oracle_check(trainer, tok, rows, inputs, sequence_advantages, forwards) -> bool:
    model = trainer.model
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    T = completion_ids.size(1)
    student, teacher, adv = [], [], []
    for i in range(completion_ids.size(0)):
        prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
        row = rows[tuple(prompt)]
        messages = teacher_prompt(row["prompt"], row["ground_truth"], HINT_TEMPLATES["math"])
        t_prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        completion = completion_ids[i].tolist()
        student.append(model(torch.tensor([prompt + completion])).logits[:, -T - 1 : -1])
        teacher.append(model(torch.tensor([t_prompt + completion])).logits[:, -T - 1 : -1])
        adv.append(sequence_advantages[tuple(completion)])
        # the teacher pass saw the hinted prompt and exactly the student's completion ids
        teacher_rows = [
            f[j] for f in forwards for j in range(f.size(0)) if f[j, -T:].tolist() == completion
        ]
        hinted = [r for r in teacher_rows if row["ground_truth"] in tok.decode(r)]
        if adv[-1] != 0:  # a tied row (advantage 0) gets no teacher pass: the skip
            assert hinted and "reference solution" in tok.decode(hinted[0])
    signals = signals_from_logits(
        torch.cat(student), torch.cat(teacher), completion_ids, temperature=trainer.temperature
    )
    expected = credit_details(
        torch.tensor(adv),
        completion_mask.bool(),
        kl=signals.kl,
        entropy=signals.entropy,
        params=CreditParams(),
    ).token_advantages
    got = inputs["advantages"]
    assert got.shape == completion_ids.shape
    assert torch.count_nonzero(got) > 0
    torch.testing.assert_close(got, expected.to(got.dtype), atol=1e-5, rtol=1e-4)
    return True


SOURCES = {  # where the student's hidden states come from -> trainer overrides
    "generation": {},
    "generation_padded": {"pad_to_multiple_of": 8},  # TRL pads completions past the longest
    "trl_pass": {"steps_per_generation": 2, "per_device_train_batch_size": 2},
    "own_forward": {"student_hidden_from_generation": False},
    # beams: generation's states are not one row per completion, so GEAR runs the forward
    "beam_search": {"generation_kwargs": {"num_beams": 2}},
    # a chunked prefill makes several calls before the first token: only the last one predicts
    "prefill_chunks": {"generation_kwargs": {"prefill_chunk_size": 3}},
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_student_hidden_states_come_from_one_pass(tmp_path, tok, monkeypatch, source):
    """GEAR runs no student forward of its own when generation (single-turn transformers path)
    or TRL (old log-probs, here with steps_per_generation=2) already computed those states; the
    states it reads equal those of a plain student pass over the same rows."""
    data = dataset()  # prompts of different lengths: generation left-pads them
    data = data.map(
        lambda row, i: {
            "prompt": [{"role": "user", "content": "Hm, " * i + row["prompt"][0]["content"]}]
        },
        with_indices=True,
    )
    # every row's passes (no teacher skip: the test follows the states of all rows)
    trainer = make_trainer(
        tmp_path, tok, data=data, skip_zero_advantage_rows=False, **SOURCES[source]
    )
    calls, hidden = [], []
    real, real_signals = trainer._final_hidden, trainer._signals
    monkeypatch.setattr(
        trainer, "_final_hidden", lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    )
    monkeypatch.setattr(
        trainer, "_signals", lambda s, t, ids, **k: hidden.append(s) or real_signals(s, t, ids, **k)
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(batch)
    own_pass = source in ("own_forward", "beam_search")
    assert len(calls) == (2 if own_pass else 1)  # student + teacher, or teacher only
    assert inputs["advantages"].dim() == 2
    assert ("old_per_token_logps" in inputs) == (source == "trl_pass")
    with torch.no_grad():
        own = real(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1),
        )
    valid = inputs["completion_mask"].bool()  # generation's states after EOS are of padding
    assert hidden[0].shape == own.shape
    torch.testing.assert_close(hidden[0][valid], own[valid], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def generated(tok, tmp_path_factory):
    """One trainer and one generated GEAR batch, shared by the loss-type tests."""
    trainer = make_trainer(tmp_path_factory.mktemp("generated"), tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer, trainer._generate_and_score_completions(
        next(iter(trainer.get_train_dataloader()))
    )


@pytest.mark.parametrize(
    "loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
)
def test_every_trl_loss_type_accepts_the_token_advantages(generated, loss_type, monkeypatch):
    trainer, inputs = generated
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    if loss_type == "luspo":
        monkeypatch.setattr(trainer, "importance_sampling_level", "sequence")
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    assert inputs["advantages"].shape == inputs["completion_ids"].shape
    assert torch.isfinite(loss)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and any(torch.count_nonzero(g) for g in grads)


def test_missing_ground_truth_column_names_the_column_and_the_columns_present(tmp_path, tok):
    data = dataset().remove_columns("ground_truth")
    with pytest.raises(ValueError, match=r"'reference'.*\['answer', 'prompt'\]"):
        make_trainer(tmp_path, tok, data=data, ground_truth_column="reference")


def test_a_grpo_config_is_refused_with_a_pointer_to_gear_config(tmp_path, tok):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(TypeError, match="GEARConfig"):
        GEARTrainer(
            model=tiny_model(tok),
            reward_funcs=hash_reward,
            args=args,
            train_dataset=dataset(),
            processing_class=tok,
        )


def test_teacher_prompts_over_budget_are_truncated_in_the_hint_and_counted(
    tmp_path, tok, monkeypatch
):
    long_truth = " ".join(f"step {k}: add {k} to the total." for k in range(40))
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Sum the steps {i}."}] for i in range(4)],
            "ground_truth": [f"{long_truth} Answer: {i}" for i in range(4)],
        }
    )
    budget = 300
    trainer = make_trainer(tmp_path, tok, data=data, teacher_max_prompt_length=budget)
    seen = []
    real = trainer._teacher_prompts
    monkeypatch.setattr(trainer, "_teacher_prompts", lambda *a: seen.append(real(*a)) or seen[-1])
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    rows, truncated = seen[0].ids, seen[0].truncated
    assert truncated == 4 and max(len(r) for r in rows) <= budget
    text = tok.decode(rows[0])
    assert (
        " [...] " in text and "step 0:" in text and text.rstrip().endswith("<|im_start|>assistant")
    )
    assert trainer._metrics["train"]["gear/teacher_prompts_truncated"] == [4.0]
    assert inputs["advantages"].shape == inputs["completion_ids"].shape


def test_rows_with_non_finite_signals_fall_back_to_grpo_and_training_continues(
    tmp_path, tok, monkeypatch
):
    real_signals, real_details = trl_forwards.signals_from_hidden, trl_credit.credit_details

    def poisoned(*args, **kwargs):
        signals = real_signals(*args, **kwargs)
        signals.kl[0, 1] = float("nan")  # row 0 of the generation batch
        return signals

    details = []
    monkeypatch.setattr(trl_forwards, "signals_from_hidden", poisoned)
    monkeypatch.setattr(
        trl_credit,
        "credit_details",
        lambda *a, **k: details.append(real_details(*a, **k)) or details[-1],
    )
    trainer = make_trainer(tmp_path, tok)
    before = parameters(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    assert trainer.state.log_history[0]["gear/fallback_rows"] == 1.0
    d = details[0]
    assert d.fallback_rows.tolist() == [True] + [False] * (d.fallback_rows.numel() - 1)
    assert (d.weights[0] == 1).all()  # GRPO's advantage on every token of the row
    assert torch.isfinite(d.token_advantages).all()


@pytest.mark.parametrize("method", ["random", "random_shape"])
def test_random_methods_draw_anew_each_step(tmp_path, tok, method):
    trainer = make_trainer(tmp_path, tok, credit_method=method, credit_seed=3)
    seeds = set()
    for step in range(3):
        trainer.state.global_step = step
        seeds.add(trainer._batch_credit_params().seed)
    assert len(seeds) == 3 and min(seeds) == 3


def test_credit_records_are_written_every_credit_log_steps(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, max_steps=3, credit_log_steps=2, credit_log_rows=1)
    trainer.train()
    files = sorted(os.listdir(tmp_path / "credit"))
    # one numbering everywhere: the step the rollouts train, 1-based, as the logs (and
    # metrics.jsonl, the progress line) call it
    assert files == ["step_000001.jsonl", "step_000003.jsonl"]
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]
    lines = [(tmp_path / "credit" / f).read_text().splitlines()[0] for f in files]
    assert [json.loads(line)["step"] for line in lines] == [1, 3]


def test_evaluation_runs_gear_and_reports_its_metrics(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, eval_dataset=dataset(2), per_device_eval_batch_size=4)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_gear/kl_mean"] > 0 and "eval_gear/onsets_per_row" in metrics
    assert not (tmp_path / "credit").exists()  # credit records are for training steps


def _student_forward(trainer, inputs):
    """(B, T, H) eval-mode student states of the batch by a plain forward (the oracle)."""
    model = trainer.model
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return trainer._final_hidden(
                model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )
    finally:
        model.train(was)


def test_assisted_generation_falls_back_to_a_student_forward(tmp_path, tok):
    """Assisted generation (here early exit; likewise use_mtp, an assistant model) verifies
    several candidate tokens per call and calls the model for the draft too: its per-call
    states are not one per completion token, so the student states come from a forward."""
    trainer = make_trainer(
        tmp_path, tok, model=tiny_model(tok, layers=2),
        generation_kwargs={"assistant_early_exit": 1},
    )  # fmt: skip
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
        tokenize=True, return_dict=True,
    )["input_ids"]  # fmt: skip
    trainer.model.train()
    with trainer._student.capturing(True):  # transformers assists batches of one row only
        completions, _ = trainer._generate_single_turn([prompt], None, {}, 1)
    inputs = {
        "prompt_ids": torch.tensor([prompt]),
        "prompt_mask": torch.ones(1, len(prompt), dtype=torch.long),
        "completion_ids": torch.tensor(completions),
        "completion_mask": torch.ones(1, len(completions[0]), dtype=torch.long),
    }
    assert trainer._student.take(inputs) is None  # nothing captured: the trainer runs a forward


@pytest.mark.parametrize(
    ("generation_kwargs", "expected"),
    [({"temperature": 0.5}, 0.5), ({"do_sample": False}, 1.0), ({}, 0.7)],
    ids=["temperature", "greedy", "config"],
)
def test_signals_use_the_temperature_generation_sampled_with(
    tmp_path, tok, monkeypatch, generation_kwargs, expected
):
    """A temperature (or greedy decoding) in generation_kwargs overrides the sampler's: pi_S
    is the distribution the tokens were drawn from (greedy: the model's own, T = 1)."""
    trainer = make_trainer(
        tmp_path,
        tok,
        temperature=0.7,
        generation_kwargs=generation_kwargs,
        skip_zero_advantage_rows=False,  # greedy completions tie: every row's signals here
    )
    assert trainer.generation_config.temperature == generation_kwargs.get("temperature", 0.7)
    seen = []
    real = trl_forwards.signals_from_hidden
    monkeypatch.setattr(
        trl_forwards, "signals_from_hidden", lambda *a, **k: seen.append(k) or real(*a, **k)
    )
    trainer.model.train()
    trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert seen and seen[0]["temperature"] == pytest.approx(expected)


def test_signals_have_eval_mode_semantics_with_dropout(tmp_path, tok, monkeypatch):
    """With dropout > 0 generation runs in train mode, so its states are not the student's:
    the student and the (current) teacher states that reach the signals are both the
    eval-mode forwards of their inputs."""
    trainer = make_trainer(tmp_path, tok, model=tiny_model(tok, attention_dropout=0.5))
    seen, teacher_inputs = [], []
    real_signals, real_inputs = trainer._signals, trainer._teacher_inputs
    monkeypatch.setattr(
        trainer,
        "_signals",
        lambda s, t, ids, **k: seen.append((s, t)) or real_signals(s, t, ids, **k),
    )
    monkeypatch.setattr(
        trainer,
        "_teacher_inputs",
        lambda *a: teacher_inputs.append(real_inputs(*a)) or teacher_inputs[-1],
    )
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert trainer.model.training  # the signal passes restored the mode
    student, teacher = seen[0]
    valid = inputs["completion_mask"].bool()
    torch.testing.assert_close(
        student[valid], _student_forward(trainer, inputs)[valid], atol=1e-5, rtol=1e-4
    )
    ids, mask = teacher_inputs[0][:2]
    trainer.model.eval()
    with torch.no_grad():
        own_teacher = trainer._final_hidden(trainer.model, ids, mask, valid.size(1))
    torch.testing.assert_close(teacher[valid], own_teacher[valid], atol=1e-5, rtol=1e-4)


def test_captured_states_keep_only_their_slice_not_the_whole_output(tmp_path, tok):
    """The hook copies the (B, n, H) slice it needs: a view would keep each forward's whole
    (B, P + C, H) output alive until the batch's signals are computed."""
    from gear.integrations.trl.states import capture_hidden

    trainer = make_trainer(tmp_path, tok)
    ids = torch.randint(3, 200, (2, 12))
    for next_token in (False, True):
        with (
            torch.no_grad(),
            capture_hidden(
                trainer.accelerator, trainer.model, 4, detach=True, next_token=next_token
            ) as captured,
        ):
            trainer.model(input_ids=ids, use_cache=False)
        (h,) = captured
        assert h.shape[1] == (1 if next_token else 4)
        assert h.untyped_storage().nbytes() == h.numel() * h.element_size()


def test_trls_own_argument_errors_come_before_gears(tmp_path, tok):
    """GEARTrainer lets GRPOTrainer validate its arguments first (here reward_weights), so a
    GRPO user sees TRL's message, not a GEAR one about the dataset."""
    data = dataset().remove_columns("ground_truth")
    with pytest.raises(ValueError, match="Number of reward weights"):
        make_trainer(tmp_path, tok, data=data, reward_weights=[1.0, 2.0])


def test_rows_without_ground_truth_keep_grpo_weights_and_are_counted(tmp_path, tok, monkeypatch):
    """A row whose ground truth is None has no teacher (the teacher prompt is the student's):
    its KL is numerical noise, which per-row normalisation would stretch to [0, 1]. It keeps
    weight 1 (plain GRPO) and is counted."""
    data = dataset().map(
        lambda row, i: {"ground_truth": None if i == 0 else row["ground_truth"]}, with_indices=True
    )
    details = []
    real = trl_credit.credit_details
    monkeypatch.setattr(
        trl_credit, "credit_details", lambda *a, **k: details.append(real(*a, **k)) or details[-1]
    )
    trainer = make_trainer(tmp_path, tok, data=data)
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    no_truth = torch.tensor([row["ground_truth"] is None for row in batch])
    assert no_truth.sum() == 2  # one prompt, num_generations=2
    d = details[0]
    valid = inputs["completion_mask"].bool()
    assert d.fallback_rows.tolist() == no_truth.tolist()
    assert (d.weights[no_truth][valid[no_truth]] == 1).all()
    metrics = trainer._metrics["train"]
    assert metrics["gear/rows_without_ground_truth"] == [2.0]
    assert metrics["gear/fallback_rows"] == [2.0]


@pytest.mark.parametrize("position", ["before", "after"])
def test_plain_text_prompts_get_the_hint_where_the_prompt_still_ends_as_before(
    tmp_path, tok, monkeypatch, position
):
    """A plain-text prompt ending in a cue ("Answer:") must still end with it in the teacher
    prompt, so the completion continues the same text: the hint goes before it by default."""
    data = Dataset.from_dict(
        {
            "prompt": [f"Question: what is {i} + 3?\nAnswer:" for i in range(4)],
            "ground_truth": [f"{i} + 3 = {i + 3}" for i in range(4)],
        }
    )
    trainer = make_trainer(tmp_path, tok, data=data, text_hint_position=position)
    built = []
    real = trainer._teacher_prompts
    monkeypatch.setattr(trainer, "_teacher_prompts", lambda *a: built.append(real(*a)) or built[-1])
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    trainer._generate_and_score_completions(batch)
    for row, ids in zip(batch, built[0].ids, strict=True):
        text = tok.decode(ids)
        hint = HINT_TEMPLATES["math"].replace("{ground_truth}", row["ground_truth"])
        if position == "before":
            assert text == f"{hint}\n\n{row['prompt']}"
        else:
            assert text == f"{row['prompt']}\n\n{hint}"


@pytest.mark.parametrize("method", ["grpo", "entropy_top"])
def test_methods_without_a_teacher_need_no_ground_truth_and_run_no_teacher(
    tmp_path, tok, monkeypatch, method
):
    """`grpo` needs no signal and `entropy_top` only the student's entropy: neither needs a
    ground-truth column, builds teacher prompts, or runs a teacher forward."""
    data = dataset().remove_columns("ground_truth")
    trainer = make_trainer(tmp_path, tok, data=data, credit_method=method)
    forwards = []
    real = trainer._final_hidden
    monkeypatch.setattr(
        trainer,
        "_final_hidden",
        lambda m, ids, *a, **k: forwards.append(ids) or real(m, ids, *a, **k),
    )
    monkeypatch.setattr(
        trainer, "_teacher_prompts", lambda *a: pytest.fail("teacher prompts built")
    )
    before = parameters(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    assert forwards == []  # entropy_top: the student states come from generation
    logs = trainer.state.log_history[0]
    assert "gear/time_teacher_prompts" not in logs
    if method == "entropy_top":
        assert logs["gear/entropy_mean"] > 0


def test_a_method_that_needs_the_teacher_still_names_the_missing_column(tmp_path, tok):
    data = dataset().remove_columns("ground_truth")
    with pytest.raises(ValueError, match=r"ground_truth_column.*'ground_truth'"):
        make_trainer(tmp_path, tok, data=data, credit_method="gear_kl_only")
    with pytest.raises(ValueError, match=r"ground_truth_column.*'ground_truth'"):
        make_trainer(tmp_path, tok, data=data, loss_mode="self_distill", reward_funcs=None)


def test_self_distill_has_no_loss_on_rows_without_ground_truth(tmp_path, tok, monkeypatch):
    """OPSD follows the teacher; a row without ground truth has none, so none of its tokens
    enters the KL."""
    import gear.integrations.trl.self_distill as self_distill

    data = dataset().map(
        lambda row, i: {"ground_truth": None if i == 0 else row["ground_truth"]}, with_indices=True
    )
    trainer = make_trainer(tmp_path, tok, data=data, loss_mode="self_distill", reward_funcs=None)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    assert inputs["gear_has_hint"].tolist() == [row["ground_truth"] is not None for row in batch]
    rows = []
    real = self_distill.reverse_kl_from_hidden
    monkeypatch.setattr(
        self_distill,
        "reverse_kl_from_hidden",
        lambda s, *a, **k: rows.append(len(s)) or real(s, *a, **k),
    )
    trainer.compute_loss(trainer.model, inputs).backward()
    hinted = inputs["completion_mask"].bool() & inputs["gear_has_hint"][:, None]
    assert rows == [int(hinted.sum())] and 0 < rows[0] < int(inputs["completion_mask"].sum())


def test_self_distill_logs_no_kl_for_a_micro_batch_it_measured_nothing_in(tmp_path, tok):
    """No row of the micro-batch has a hint: no token enters the KL, so its means are NaN (TRL
    logs them as None), not 0 (issue 59, item 14)."""
    trainer = make_trainer(tmp_path, tok, loss_mode="self_distill", reward_funcs=None)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    inputs["gear_has_hint"] = torch.zeros_like(inputs["gear_has_hint"])
    trainer._metrics["train"].clear()
    trainer.compute_loss(trainer.model, inputs).backward()
    logged = trainer._metrics["train"]
    assert math.isnan(logged["gear/kl_mean"][-1]) and math.isnan(logged["gear/entropy_mean"][-1])

"""Teacher contexts through GEARTrainer (issue 36): what each context shows the teacher, a step of
each, contrast's advantages against an oracle, and the settings refused at start-up."""

from __future__ import annotations

import math

import pytest
import torch

import gear.integrations.trl.credit as trl_credit
from _trl_helpers import byte_tokenizer, dataset, make_trainer, parameters
from gear.credit import CreditParams, credit_details, signals_from_logits
from gear.integrations.trl import GEARConfig
from gear.teacher import ANSWER_HINT_TEMPLATE, teacher_prompt


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _plus_100(answer, rng):
    return str(int(answer) + 100)


def _batch(trainer):
    trainer.model.train()
    return next(iter(trainer.get_train_dataloader()))


def _teacher_texts(trainer, tok, monkeypatch):
    """Generate and score one batch; the decoded prompts of each teacher-prompt build (the
    right-hint teacher's first, then the contrast teacher's, if any) and the batch."""
    built, real = [], trainer._teacher_prompts
    monkeypatch.setattr(trainer, "_teacher_prompts", lambda *a: built.append(real(*a)) or built[-1])
    batch = _batch(trainer)
    inputs = trainer._generate_and_score_completions(batch)
    return [[tok.decode(ids) for ids in b.ids] for b in built], batch, inputs


def test_answer_only_shows_the_final_answer_and_not_the_worked_solution(tmp_path, tok, monkeypatch):
    trainer = make_trainer(tmp_path, tok, teacher_context="answer_only")
    (texts,), batch, _ = _teacher_texts(trainer, tok, monkeypatch)
    for text, row in zip(texts, batch, strict=True):
        assert ANSWER_HINT_TEMPLATE.format(ground_truth=row["answer"]) in text
        assert row["ground_truth"] not in text and "reference solution" not in text
        assert text.rstrip().endswith("<|im_start|>assistant")  # the student's own format


def test_worked_solution_is_the_default_and_shows_the_ground_truth(tmp_path, tok, monkeypatch):
    trainer = make_trainer(tmp_path, tok)
    assert trainer.args.teacher_context == "worked_solution"
    (texts,), batch, _ = _teacher_texts(trainer, tok, monkeypatch)
    for text, row in zip(texts, batch, strict=True):
        assert row["ground_truth"] in text and "reference solution" in text


def test_contrast_shows_its_second_teacher_a_wrong_answer_in_the_same_template(
    tmp_path, tok, monkeypatch
):
    trainer = make_trainer(tmp_path, tok, teacher_context="contrast")  # default hook: offsets
    (right, wrong), batch, _ = _teacher_texts(trainer, tok, monkeypatch)
    for r, w, row in zip(right, wrong, batch, strict=True):
        assert ANSWER_HINT_TEMPLATE.format(ground_truth=row["answer"]) in r
        shown = w.split("The final answer is ")[1].split(".")[0]
        assert shown != row["answer"] and abs(int(shown) - int(row["answer"])) <= 3
        hint = ANSWER_HINT_TEMPLATE.format
        assert r.replace(hint(ground_truth=row["answer"]), hint(ground_truth=shown)) == w


@pytest.mark.parametrize("context", ["worked_solution", "answer_only", "contrast"])
def test_a_step_of_each_context_changes_parameters(tmp_path, tok, context):
    trainer = make_trainer(tmp_path, tok, teacher_context=context)
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["gear/kl_mean"] > 0
    assert ("gear/time_contrast" in logs) == (context == "contrast")


@torch.no_grad()
def test_contrast_advantages_equal_the_credit_core_on_the_two_kls(tmp_path, tok, monkeypatch):
    """Oracle: full-logit forwards of the student, the right-answer teacher and the wrong-answer
    teacher (prompts built independently from the dataset row and the hook), then
    `credit_details(..., contrast_kl=..., CreditParams(contrast=True))`."""
    data = dataset()
    trainer = make_trainer(
        tmp_path, tok, data=data, teacher_context="contrast", wrong_answer=_plus_100
    )
    assert trainer.credit_params == CreditParams(contrast=True)
    rows = {}
    for row in data:
        ids = tok.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        rows[tuple(ids)] = row
    seen, real = [], trl_credit.credit_details
    monkeypatch.setattr(
        trl_credit, "credit_details", lambda *a, **k: seen.append((a, k)) or real(*a, **k)
    )
    inputs = trainer._generate_and_score_completions(_batch(trainer))
    (advantages, _), kwargs = seen[0]
    assert kwargs["contrast_kl"] is not None

    def render(messages):
        return tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]

    model, ids = trainer.model, inputs["completion_ids"]
    T = ids.size(1)
    logits = {"student": [], "right": [], "wrong": []}
    for i in range(ids.size(0)):
        prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
        row = rows[tuple(prompt)]
        prompts = {
            "student": prompt,
            "right": render(teacher_prompt(row["prompt"], row["answer"], ANSWER_HINT_TEMPLATE)),
            "wrong": render(
                teacher_prompt(row["prompt"], _plus_100(row["answer"], None), ANSWER_HINT_TEMPLATE)
            ),
        }
        for name, p in prompts.items():
            logits[name].append(model(torch.tensor([p + ids[i].tolist()])).logits[:, -T - 1 : -1])
    student = torch.cat(logits["student"])
    right = signals_from_logits(
        student, torch.cat(logits["right"]), ids, temperature=trainer.temperature
    )
    wrong = signals_from_logits(
        student, torch.cat(logits["wrong"]), ids, temperature=trainer.temperature
    )
    mask = inputs["completion_mask"].bool()

    def oracle(contrast):
        return credit_details(
            advantages,
            mask,
            kl=right.kl,
            entropy=right.entropy,
            contrast_kl=wrong.kl if contrast else None,
            params=CreditParams(contrast=contrast),
        ).token_advantages

    got = inputs["advantages"]
    assert torch.count_nonzero(got) > 0
    torch.testing.assert_close(got, oracle(True).to(got.dtype), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, oracle(False).to(got.dtype), atol=1e-4)  # contrast mattered
    # the rows with advantage 0 got no teacher pass (the skip): their KLs are 0, not computed
    scored = kwargs["scored"].bool()[:, None] & mask
    torch.testing.assert_close(
        kwargs["contrast_kl"][scored], wrong.kl[scored], atol=1e-5, rtol=1e-4
    )
    assert bool((kwargs["contrast_kl"][mask & ~scored] == 0).all())


# ----------------------------------------------------------------------------- refused settings


def test_an_unknown_context_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"GEARConfig\.teacher_context: got 'hints'"):
        GEARConfig(output_dir=str(tmp_path), use_cpu=True, teacher_context="hints")


@pytest.mark.parametrize("context", ["answer_only", "contrast"])
def test_an_answer_context_without_the_answer_column_fails_at_start_up(tmp_path, tok, context):
    data = dataset().remove_columns("answer")
    with pytest.raises(
        ValueError, match=rf"answer_column \(teacher_context='{context}'\).*'answer'"
    ):
        make_trainer(tmp_path, tok, data=data, teacher_context=context)


def test_worked_solution_needs_no_answer_column(tmp_path, tok):
    make_trainer(tmp_path, tok, data=dataset().remove_columns("answer"))


def test_contrast_without_any_wrong_answer_fails_at_start_up(tmp_path, tok):
    """Non-numeric answers with nothing else to show: the default hook gives None and the
    dataset holds one answer only."""
    data = dataset().map(lambda row: {"answer": "seven"})
    with pytest.raises(ValueError, match=r"teacher_context='contrast': no wrong answer"):
        make_trainer(tmp_path, tok, data=data, teacher_context="contrast")
    # a hook that returns the right answer is refused too
    with pytest.raises(ValueError, match=r"teacher_context='contrast'.*right answer"):
        make_trainer(
            tmp_path, tok, teacher_context="contrast", wrong_answer=lambda answer, rng: answer
        )


def test_contrast_takes_another_answer_of_the_dataset_for_non_numbers(tmp_path, tok, monkeypatch):
    data = dataset().map(lambda row, i: {"answer": f"word{i}"}, with_indices=True)
    trainer = make_trainer(tmp_path, tok, data=data, teacher_context="contrast")
    (_, wrong), batch, _ = _teacher_texts(trainer, tok, monkeypatch)
    answers = set(data["answer"])
    for w, row in zip(wrong, batch, strict=True):
        shown = w.split("The final answer is ")[1].split(".")[0]
        assert shown in answers and shown != row["answer"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"credit_method": "grpo"}, r"teacher_context.*reads no KL"),
        ({"credit_method": "rlsd"}, r"teacher_context.*reads no KL"),
        ({"loss_mode": "self_distill"}, r"teacher_context.*self_distill"),
    ],
)
def test_contrast_is_refused_where_there_is_no_kl_credit(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        GEARConfig(output_dir=str(tmp_path), use_cpu=True, teacher_context="contrast", **options)


def test_a_wrong_answer_hook_is_refused_without_contrast(tmp_path, tok):
    with pytest.raises(
        ValueError, match=r"wrong_answer: only used with teacher_context='contrast'"
    ):
        make_trainer(tmp_path, tok, wrong_answer=_plus_100)


class TwoRanks:
    """An accelerator of rank `index` among two: `gather` puts this rank's tensor next to the
    other rank's (taken, in call order, from `other`), `pad_across_processes` pads to the longer."""

    num_processes = 2

    def __init__(self, index, other):
        self.process_index, self.other = index, list(other)

    def pad_across_processes(self, v, dim, pad_index):
        width = max(v.size(1), self.other[0].size(1))
        return torch.nn.functional.pad(v, (0, width - v.size(1)), value=pad_index)

    def gather(self, v):
        theirs = self.other.pop(0).to(v.dtype)
        if v.dim() == 2:
            theirs = torch.nn.functional.pad(theirs, (0, v.size(1) - theirs.size(1)))
        return torch.cat([v, theirs] if self.process_index == 0 else [theirs, v])


def test_the_contrast_kl_is_gathered_with_the_other_signals_across_processes():
    """With two processes each one's rows are credited on the whole generation batch: the
    contrast KL travels with the signals (`ContrastSignals`) and is gathered like them."""
    from gear.integrations.trl.credit import ContrastSignals, batch_credit

    g = torch.Generator().manual_seed(0)
    names = ("kl", "entropy", "contrast_kl")

    def rank(T):  # (advantages, valid, signals) of one process's 3 rows
        signals = {k: torch.rand(3, T, generator=g) for k in names}
        return torch.tensor([1.0, -1.0, 0.5]), torch.rand(3, T, generator=g) > 0.2, signals

    def wide(x):  # padded to the longer process's 6 tokens
        return torch.nn.functional.pad(x, (0, 6 - x.size(1)))

    ranks = [rank(4), rank(6)]
    params = CreditParams(contrast=True)
    whole = credit_details(
        torch.cat([r[0] for r in ranks]),
        torch.cat([wide(r[1]) for r in ranks]),
        **{k: torch.cat([wide(r[2][k]) for r in ranks]) for k in names},
        params=params,
    )
    for i, (adv, valid, sig) in enumerate(ranks):
        theirs_adv, theirs_valid, theirs = ranks[1 - i]
        # what batch_credit gathers, in its order: advantages, valid, kl, entropy, contrast_kl
        other = [theirs_adv, theirs_valid.float(), *(theirs[k] for k in names)]
        signals = ContrastSignals(sig["kl"], sig["entropy"], None, None, sig["contrast_kl"])
        got = batch_credit(TwoRanks(i, other), adv, valid, None, signals, params)
        want = whole.token_advantages[3 * i : 3 * i + 3, : valid.size(1)]
        torch.testing.assert_close(got.token_advantages, want)
    without = credit_details(
        torch.cat([r[0] for r in ranks]),
        torch.cat([wide(r[1]) for r in ranks]),
        **{k: torch.cat([wide(r[2][k]) for r in ranks]) for k in names[:2]},
    )
    assert not torch.allclose(whole.token_advantages, without.token_advantages)

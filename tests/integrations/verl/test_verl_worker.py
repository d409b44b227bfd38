"""GEAR's verl teacher pass from final hidden states, on CPU, against a naive full-logits oracle.

Without verl: `micro_batch_signals` (packed and right-padded layouts, token-budget groups, dummy
forwards that keep ranks in step, an empty micro-batch). With verl: the real
`GearActorRolloutRefWorker.compute_log_prob` (verl's old-log-prob pass with the teacher pass in
each micro-batch) and ``compute_gear_signals`` (GEAR's own student forward) over verl's own
`TrainingWorker` / `FSDPEngineWithLMHead` inference path (`_verl_helpers`), with
``use_remove_padding`` and ``use_dynamic_bsz`` on and off.
"""

from __future__ import annotations

import pytest
import torch

from _verl_helpers import count_forwards, gear_worker, verl_batch, verl_on_cpu
from gear.credit.signals import signals_from_logits
from gear.integrations.verl.estimators import SIGNAL_FIELDS
from gear.integrations.verl.teacher_pass import TeacherPassOptions, groups, micro_batch_signals

V = 61


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
        initializer_range=0.2,
    )
    return LlamaForCausalLM(cfg).eval()


def rows(seed, n=5):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(2, V, (k,), generator=g).tolist()

    prompts = [ids(3, 9) for _ in range(n)]
    teachers = [p + ids(2, 6) for p in prompts]  # the hint makes the teacher prompt longer
    responses = [ids(1, 8) for _ in range(n)]
    return prompts, teachers, responses


def oracle(model, prompt, teacher_prompt, response, temperature):
    """Naive: each sequence alone, full (1, L, V) logits, sliced at the response positions."""

    def logits(p):
        ids = torch.tensor([list(p) + list(response)])
        return model(input_ids=ids).logits[:, len(p) - 1 : len(p) - 1 + len(response)]

    with torch.no_grad():
        return signals_from_logits(
            logits(prompt),
            logits(teacher_prompt),
            torch.tensor([list(response)]),
            temperature=temperature,
        )


def assert_oracle(model, got, prompts, teachers, responses, temperature):
    """got: field or signal name -> per-row (R_i,) tensors."""
    for i in range(len(prompts)):
        ref = oracle(model, prompts[i], teachers[i], responses[i], temperature)
        for name, field in SIGNAL_FIELDS.items():
            value = got[field][i] if field in got else got[name][i]
            torch.testing.assert_close(value, getattr(ref, name)[0], rtol=1e-4, atol=1e-5)


def test_groups_honour_rows_and_tokens():
    assert groups([5, 5, 5, 5], 2, None) == [[0, 1], [2, 3]]
    assert groups([5, 5, 5, 5], 4, 12) == [[0, 1], [2, 3]]
    assert groups([20, 3, 3], 4, 12) == [[0], [1, 2]]  # too long alone: its own forward
    assert groups([], 4, 12) == []


@pytest.mark.parametrize("remove_padding", [True, False])
def test_micro_batch_signals_equal_full_logits(model, remove_padding):
    prompts, teachers, responses = rows(1)
    t = [torch.tensor(x) for x in teachers]
    p, r = [torch.tensor(x) for x in prompts], [torch.tensor(x) for x in responses]
    opts = TeacherPassOptions(temperature=0.7, chunk_size=3, micro_batch_size=2, max_token_len=30)
    parts = groups([len(a) + len(b) for a, b in zip(teachers, responses, strict=True)], 2, 30)
    with count_forwards(model) as calls:
        out = micro_batch_signals(model, None, p, t, r, opts, remove_padding, sync=lambda n: n + 2)
    # one student forward, one per teacher group, two dummies asked for by the "other ranks"
    assert calls[0] == 1 + len(parts) + 2 and len(parts) >= 3
    assert_oracle(model, out, prompts, teachers, responses, 0.7)
    assert float(torch.cat(out["kl"]).max()) > 1e-3
    same = micro_batch_signals(model, None, p, p, r, opts, remove_padding)  # teacher = student
    assert float(torch.cat(same["kl"]).abs().max()) < 1e-5


@pytest.mark.parametrize("remove_padding", [True, False])
def test_the_contrast_teachers_kl_is_a_second_pass_of_the_same_kernel(model, remove_padding):
    """teacher_context: contrast: a second group of teacher forwards over the contrast prompts
    (a wrong answer); its KL equals the full-logits oracle's, the other signals are unchanged."""
    prompts, teachers, responses = rows(2)
    others, other_teachers, _ = rows(3)
    # each student prompt with another hint (of another length): the contrast teacher's prompt
    contrasts = [p + t[len(o) :] for p, t, o in zip(prompts, other_teachers, others, strict=True)]
    p, r = [torch.tensor(x) for x in prompts], [torch.tensor(x) for x in responses]
    t, c = [torch.tensor(x) for x in teachers], [torch.tensor(x) for x in contrasts]
    opts = TeacherPassOptions(temperature=0.7, chunk_size=3, micro_batch_size=2, contrast=True)
    with count_forwards(model) as calls:
        out = micro_batch_signals(model, None, p, t, r, opts, remove_padding, contrast_prompts=c)
    assert calls[0] == 1 + 2 * 3  # the student, 3 teacher groups, 3 contrast groups
    plain = micro_batch_signals(model, None, p, t, r, opts, remove_padding)
    for name in SIGNAL_FIELDS:
        for a, b in zip(out[name], plain[name], strict=True):
            torch.testing.assert_close(a, b)
    for i in range(len(prompts)):
        ref = oracle(model, prompts[i], contrasts[i], responses[i], 0.7)
        torch.testing.assert_close(out["contrast_kl"][i], ref.kl[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="expected 5 contrast teacher prompts"):
        micro_batch_signals(model, None, p, t, r, opts, remove_padding, contrast_prompts=c[:2])


def test_empty_micro_batch_still_runs_the_forwards(model):
    with count_forwards(model) as calls:
        out = micro_batch_signals(
            model, None, [], [], [], TeacherPassOptions(), True, sync=lambda n: 2
        )
    assert calls[0] == 1 + 2 and out["kl"] == []  # student dummy + two teacher dummies


def test_micro_batch_signals_errors(model):
    p, r = [torch.tensor([3, 4])], [torch.tensor([5, 6, 7])]
    with pytest.raises(ValueError, match="student_hidden: expected 3 rows"):
        micro_batch_signals(model, torch.zeros(2, 32), p, p, r, TeacherPassOptions(), True)
    with pytest.raises(ValueError, match="prompt of at least one token"):
        micro_batch_signals(model, None, [torch.tensor([])], p, r, TeacherPassOptions(), True)


# ---------------------------------------------------------------- the real worker over verl


def batch(prompts, teachers, responses, remove_padding, dynamic, fused, mbs=1):
    return verl_batch(
        prompts,
        responses,
        teachers,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=24,
        micro_batch_size_per_gpu=mbs,
        calculate_entropy=True,
        compute_loss=False,
        temperature=0.7,
        gear_temperature=0.7,
        gear_chunk_size=3,
        gear_micro_batch_size=2,
        **({"gear_signals": True} if fused else {}),
    )


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("dynamic", [True, False])
def test_worker_signals_equal_full_logits(model, remove_padding, dynamic):
    pytest.importorskip("verl")
    prompts, teachers, responses = rows(2, n=5)
    with verl_on_cpu():
        worker = gear_worker(model, remove_padding, dynamic, max_token_len=24, mbs=1)
        with count_forwards(model) as fused_forwards:
            fused = worker.compute_log_prob(
                batch(prompts, teachers, responses, remove_padding, dynamic, fused=True)
            )
        with count_forwards(model) as own_forwards:
            own = worker.compute_gear_signals(
                batch(prompts, teachers, responses, remove_padding, dynamic, fused=False)
            )
    assert sorted(own.keys()) == sorted(SIGNAL_FIELDS.values())
    assert_oracle(model, fused, prompts, teachers, responses, 0.7)
    assert_oracle(model, own, prompts, teachers, responses, 0.7)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        # verl's own old log-probs (its full logits) = GEAR's student log-probs (hidden states)
        verl_lp = fused["log_probs"][i][len(p) - 1 : len(p) - 1 + len(r)]
        torch.testing.assert_close(fused["gear_student_logprobs"][i], verl_lp, rtol=1e-4, atol=1e-5)
    # the same micro-batches; the fused pass reuses verl's student forward instead of its own
    assert fused_forwards == own_forwards
    if not dynamic:  # verl: one row per micro-batch -> its forward + one teacher forward
        assert fused_forwards[0] == 2 * len(prompts)


def test_worker_keeps_ranks_in_step_and_plain_log_prob(model, monkeypatch):
    pytest.importorskip("verl")
    from gear.integrations.verl import worker as worker_mod

    prompts, teachers, responses = rows(3, n=4)
    monkeypatch.setattr(worker_mod, "max_over_ranks", lambda n, group, device: n + 1)
    with verl_on_cpu():
        worker = gear_worker(model, True, False)
        td = batch(prompts, teachers, responses, True, False, fused=True, mbs=2)
        with count_forwards(model) as calls:
            out = worker.compute_log_prob(td)
        # 2 verl micro-batches x (verl's forward + 1 teacher forward + 1 dummy for a busier rank)
        assert calls[0] == 2 * 3
        assert_oracle(model, out, prompts, teachers, responses, 0.7)
        with count_forwards(model) as calls:
            plain = worker.compute_log_prob(
                batch(prompts, teachers, responses, True, False, fused=False)
            )
        assert calls[0] == 4 and "gear_kl" not in plain  # verl's pass alone


def test_worker_errors(model):
    pytest.importorskip("verl")
    prompts, teachers, responses = rows(4, n=2)
    with verl_on_cpu():
        worker = gear_worker(model, True, False, mbs=1)
        td = batch(prompts, teachers, responses, True, False, fused=True)
        del td["gear_teacher_prompts"]
        with pytest.raises(KeyError, match="gear_teacher_prompts"):
            worker.compute_log_prob(td)
        worker.actor.engine.use_ulysses_sp = True
        with pytest.raises(NotImplementedError, match="Ulysses"):
            worker.compute_log_prob(batch(prompts, teachers, responses, True, False, fused=True))


@pytest.mark.parametrize("fused", [True, False])
def test_entropy_top_runs_no_teacher_forward_and_still_gets_the_entropy(model, monkeypatch, fused):
    """A method that reads the student's entropy alone (gear_entropy_top) sends no teacher
    prompts and ``gear_teacher=False``: no teacher forward runs (only a one-token forward that
    holds the LM head for the kernel), and entropy / student log-probs equal the oracle's."""
    pytest.importorskip("verl")
    from verl.utils import tensordict_utils as tu

    from gear.integrations.verl import teacher_pass

    monkeypatch.setattr(
        teacher_pass, "teacher_signals", lambda *a, **k: pytest.fail("a teacher forward ran")
    )
    prompts, _, responses = rows(5, n=4)
    td = batch(prompts, None, responses, True, False, fused=fused)
    tu.assign_non_tensor(td, gear_teacher=False)  # the runner's option for such a method
    widths = []
    with verl_on_cpu():
        worker = gear_worker(model, True, False, mbs=1)
        handle = model.register_forward_pre_hook(
            lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
        )
        try:
            out = (worker.compute_log_prob if fused else worker.compute_gear_signals)(td)
        finally:
            handle.remove()
    student = {"entropy", "student_logprobs"}
    assert sorted(k for k in SIGNAL_FIELDS.values() if k in out) == sorted(
        SIGNAL_FIELDS[name] for name in student
    )
    for i in range(len(prompts)):
        ref = oracle(model, prompts[i], prompts[i], responses[i], 0.7)
        for name in student:
            torch.testing.assert_close(
                out[SIGNAL_FIELDS[name]][i], getattr(ref, name)[0], rtol=1e-4, atol=1e-5
            )
    # per micro-batch (one row): the student's forward (verl's or ours), then one token
    assert widths[1::2] == [1] * len(prompts)
    assert widths[0::2] == [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]


# ---------------------------------------------------------------- rows left unscored (tied)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_unscored_rows_get_no_forward_and_zero_signals(model, remove_padding):
    """`scored`: only those rows enter GEAR's student forward, the teacher and contrast
    forwards and the kernel (their signals equal the oracle's); the others' are zeros; the
    ranks' teacher forwards are still agreed by `sync` (here: two more asked for)."""
    prompts, teachers, responses = rows(6, n=6)
    p, r = [torch.tensor(x) for x in prompts], [torch.tensor(x) for x in responses]
    t = [torch.tensor(x) for x in teachers]
    scored = [True, False, False, True, True, False]
    keep = [i for i, s in enumerate(scored) if s]
    opts = TeacherPassOptions(temperature=0.7, chunk_size=3, micro_batch_size=2, contrast=True)
    seen = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        out = micro_batch_signals(
            model, None, p, t, r, opts, remove_padding, sync=lambda n: n + 2,
            contrast_prompts=t, scored=scored,
        )  # fmt: skip
    finally:
        handle.remove()
    # 1 student forward (3 rows), 2 teacher groups + 2 dummies, the same for the contrast
    assert len(seen) == 1 + 2 * (2 + 2) and seen.count(1) == 4
    real = [n for n in seen if n > 1]
    width = max(len(prompts[i]) + len(responses[i]) for i in keep)
    assert real[0] == (
        sum(len(prompts[i]) + len(responses[i]) for i in keep) if remove_padding else 3 * width
    )
    assert_oracle(
        model,
        {k: [out[k][i] for i in keep] for k in out},
        [prompts[i] for i in keep],
        [teachers[i] for i in keep],
        [responses[i] for i in keep],
        0.7,
    )
    for i, s in enumerate(scored):
        for k in (*SIGNAL_FIELDS, "contrast_kl"):
            assert out[k][i].shape == (len(responses[i]),)
            assert bool(out[k][i].eq(0).all()) != s
    with pytest.raises(ValueError, match="scored: expected 6 flags"):
        micro_batch_signals(model, None, p, t, r, opts, remove_padding, scored=scored[:2])


def test_a_micro_batch_with_no_scored_row_keeps_ranks_in_step(model):
    """Every row tied: one-token forwards only (GEAR's student forward, as many teacher forwards
    as the busiest rank runs); every signal is 0; and the student-only path (no teacher) too."""
    prompts, teachers, responses = rows(7, n=3)
    p, r = [torch.tensor(x) for x in prompts], [torch.tensor(x) for x in responses]
    t = [torch.tensor(x) for x in teachers]
    none = [False] * 3
    with count_forwards(model) as calls:
        out = micro_batch_signals(
            model, None, p, t, r, TeacherPassOptions(), True, sync=lambda n: 2, scored=none
        )
    assert calls[0] == 1 + 2
    assert all(
        bool(v.eq(0).all()) and v.numel() == len(x) for v, x in zip(out["kl"], r, strict=True)
    )
    opts = TeacherPassOptions(teacher=False)
    with count_forwards(model) as calls:
        out = micro_batch_signals(model, None, p, None, r, opts, True, scored=none)
    assert calls[0] == 2 and sorted(out) == ["entropy", "student_logprobs"]
    assert all(bool(v.eq(0).all()) for v in out["entropy"])


@pytest.mark.parametrize("dynamic", [True, False])
def test_worker_scores_only_the_rows_marked_scored(model, monkeypatch, dynamic):
    """verl's old-log-prob pass with ``gear_scored``: verl's forward runs on every row (its old
    log-probs), the teacher forward on the scored rows only, whose signals equal the oracle's
    (the student's hidden states picked out of verl's capture); the others' are zeros."""
    pytest.importorskip("verl")
    from gear.integrations.verl import teacher_pass

    prompts, teachers, responses = rows(8, n=6)
    scored = torch.tensor([False, True, False, False, True, True])
    td = batch(prompts, teachers, responses, True, dynamic, fused=True, mbs=3)
    td["gear_scored"] = scored
    teacher_rows = []
    real = teacher_pass.teacher_signals

    def counted(module, seqs, *a, **k):
        teacher_rows.extend(s.tolist() for s in seqs)
        return real(module, seqs, *a, **k)

    monkeypatch.setattr(teacher_pass, "teacher_signals", counted)
    with verl_on_cpu():
        out = gear_worker(model, True, dynamic, max_token_len=24, mbs=3).compute_log_prob(td)
    keep = scored.nonzero().squeeze(1).tolist()
    assert sorted(teacher_rows) == sorted(teachers[i] + responses[i] for i in keep)
    assert_oracle(
        model,
        {k: [out[k][i] for i in keep] for k in SIGNAL_FIELDS.values()},
        [prompts[i] for i in keep],
        [teachers[i] for i in keep],
        [responses[i] for i in keep],
        0.7,
    )
    for i in scored.logical_not().nonzero().squeeze(1).tolist():
        assert all(bool(out[f][i].eq(0).all()) for f in SIGNAL_FIELDS.values())
        assert out["log_probs"][i].numel() > 0  # verl's own pass ran on the row

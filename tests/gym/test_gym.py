"""The credit gym (issue 20): checker, oracle weights, user methods, the RL step, the JSON."""

from __future__ import annotations

import json
import random
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from gear.gym import run
from gear.gym.model import ModelConfig, WarmStart, build_model, sample
from gear.gym.task import ID, STEP_LEN, ChainTask
from gear.gym.train import RLConfig, answer_influence, credit, oar_span, parse_arm, rl_step

TINY = ModelConfig(hidden=16, layers=1, heads=2)
MICRO_WARM = WarmStart(target=1.0, max_steps=10, check_every=5, eval_n=16, batch=16)
MICRO_RL = RLConfig(prompts=4, group=4, eval_every=1, eval_n=16)


def loop_first_wrong_step(start: int, operands: list[int], text: str) -> int:
    """Plain loop: walk the steps 'p+x=r;' and return the first that is not the right one."""
    value = start
    for k, x in enumerate(operands):
        right = f"{value}+{x}={(value + x) % 10};"
        if text[STEP_LEN * k : STEP_LEN * (k + 1)] != right:
            return k
        value = (value + x) % 10
    return -1


def step_until_update(model, arm: str, task, tries: int) -> dict:
    """One `rl_step` per seed until one updates (an untrained model can draw groups of equal
    reward, which give no update; a later draw will not); the last step's stats."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    problems = task.problems(4, torch.Generator().manual_seed(3))
    for seed in range(tries):
        out = rl_step(
            model, opt, parse_arm(arm), task, MICRO_RL, problems,
            torch.Generator().manual_seed(seed), credit_seed=seed,
        )  # fmt: skip
        if out["updated"]:
            break
    return out


def test_checker_finds_the_first_wrong_step_like_a_plain_loop():
    task, rng = ChainTask(5), random.Random(0)
    problems = task.problems(300, torch.Generator().manual_seed(0))
    comp = task.references(problems).clone()
    for row in comp:  # corrupt 0-3 random tokens per row with random vocabulary ids
        for _ in range(rng.randint(0, 3)):
            row[rng.randrange(len(row))] = rng.randrange(15)
    got = task.first_wrong_step(problems, comp).tolist()
    want = [
        loop_first_wrong_step(int(p[0]), p[1:].tolist(), task.decode(c))
        for p, c in zip(problems, comp, strict=True)
    ]
    assert got == want
    assert -1 in got and any(g >= 0 for g in got)
    # the outcome reward reads only the final result
    assert task.rewards(problems, task.references(problems)).eq(1).all()


def test_rl_settings_are_checked_before_any_work():
    with pytest.raises(ValueError, match=r"RLConfig\.group: got 1, expected an integer >= 2"):
        RLConfig(group=1)
    with pytest.raises(ValueError, match=r"RLConfig\.eval_every"):
        RLConfig(eval_every=0)
    with pytest.raises(ValueError, match="gym: seeds"):
        run(["grpo"], seeds=0, log=lambda _: None)
    with pytest.raises(ValueError, match="gym: workers"):
        run(["grpo"], seeds=1, workers=0, log=lambda _: None)


def test_the_loss_and_the_signals_use_the_sampling_temperature(monkeypatch):
    """TRL scores tokens under logits / temperature; the gym's loop must too."""
    import gear.gym.train as train

    seen = []
    real = train.signals_from_logits
    monkeypatch.setattr(
        train,
        "signals_from_logits",
        lambda *a, **kw: seen.append(kw["temperature"]) or real(*a, **kw),
    )
    task = ChainTask(2)
    model = build_model(TINY, task)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    problems = task.problems(4, torch.Generator().manual_seed(3))
    for seed in range(10):
        out = rl_step(
            model, opt, parse_arm("gear"), task, replace(MICRO_RL, temperature=0.7), problems,
            torch.Generator().manual_seed(seed), credit_seed=seed,
        )  # fmt: skip
        if out["updated"]:
            break
    assert seen == [0.7]
    logits = torch.randn(2, 3, 16)
    comp = torch.randint(0, 16, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(2, comp[..., None]).squeeze(2)
    assert torch.allclose(train.token_logprobs(logits, comp, 0.7), expected)


def test_the_run_key_changes_with_the_code_of_a_users_method(tmp_path):
    """A kept run is reused only for the same code: editing your own method reruns it."""
    from gear.credit.methods import METHODS
    from gear.gym import run_key

    mod = tmp_path / "gym_key_methods.py"
    mod.write_text(textwrap.dedent('''
        import torch
        from gear.credit import MethodOutput, register_method

        @register_method("gym_key_test", requires=("kl",))
        def m(x, p):
            return MethodOutput(weights=torch.ones_like(x.kl))
    '''))  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    try:
        arm = parse_arm("gym_key_methods:gym_key_test")
        key = run_key(arm, 0, RLConfig(), "w")
        assert run_key(arm, 0, RLConfig(), "w") == key
        assert run_key(arm, 1, RLConfig(), "w") != key
        assert run_key(arm, 0, RLConfig(lr=1e-3), "w") != key
        assert run_key(arm, 0, RLConfig(), "other warm start") != key
        assert (
            run_key(parse_arm("gym_key_methods:gym_key_test@alpha=0.3"), 0, RLConfig(), "w") != key
        )
        mod.write_text(mod.read_text() + "\n# edited\n")
        assert run_key(arm, 0, RLConfig(), "w") != key
    finally:
        sys.path.remove(str(tmp_path))
        METHODS.pop("gym_key_test", None)
        sys.modules.pop("gym_key_methods", None)


def test_train_and_test_problems_are_disjoint():
    task = ChainTask(3)
    train = task.problems(500, torch.Generator().manual_seed(1), "train")
    test = task.problems(500, torch.Generator().manual_seed(1), "test")
    assert not set(map(tuple, train.tolist())) & set(map(tuple, test.tolist()))


@pytest.mark.parametrize("spec", ["oracle", "oracle_sharp"])
def test_oracle_weights_land_exactly_on_the_first_wrong_step(spec):
    task = ChainTask(4)
    problems = task.problems(8, torch.Generator().manual_seed(2))
    comp = task.references(problems).clone()
    wrong_steps = [0, 1, 2, 3, 1, -1, -1, 2]
    for i, k in enumerate(wrong_steps):
        if k >= 0:
            pos = STEP_LEN * k + 4  # the result digit
            comp[i, pos] = (comp[i, pos] + 1) % 10
    # row 6 reached the right answer through a flawed step (the operand copied wrong):
    # a positive advantage, so the oracle leaves it plain GRPO
    comp[6, STEP_LEN + 2] = (comp[6, STEP_LEN + 2] + 1) % 10
    assert task.first_wrong_step(problems, comp)[6] == 1 and task.rewards(problems, comp)[6] == 1
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, -0.5, 1.0, 0.5, -2.0])
    logits = torch.randn(8, task.completion_len, 16)
    w = credit(parse_arm(spec), task, problems, comp, adv, logits, logits, seed=0) / adv[:, None]
    for i, k in enumerate(wrong_steps):
        if k < 0:
            assert torch.allclose(w[i], torch.ones_like(w[i]))  # no error: plain GRPO
            continue
        top = (w[i] == w[i].max()).nonzero().flatten().tolist()
        assert top == list(range(STEP_LEN * k, STEP_LEN * (k + 1)))
        assert w[i].mean().item() == pytest.approx(1.0)  # mass preserved
        in_step = w[i, STEP_LEN * k : STEP_LEN * (k + 1)].sum() / w[i].sum()
        # GEAR's default modulation: 6 of 24 tokens at 1.5 vs 1 -> a third of the mass;
        # the sharp one: almost all of it
        assert in_step.item() == pytest.approx(1 / 3 if spec == "oracle" else 0.99, abs=0.01)


def test_one_rl_step_changes_the_parameters():
    task = ChainTask(3)
    model = build_model(TINY, task)
    before = [p.detach().clone() for p in model.parameters()]
    assert step_until_update(model, "gear", task, tries=5)["updated"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@torch.no_grad()
def plain_sample(model, prompts, length, generator):
    """Re-run the whole prefix for every token: the sampler without a KV cache."""
    ids = prompts
    for _ in range(length):
        probs = torch.softmax(model(input_ids=ids, use_cache=False).logits[:, -1].float(), -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids[:, prompts.shape[1] :]


def test_cached_sampling_draws_the_tokens_of_the_plain_sampler():
    task = ChainTask(3)
    model = build_model(ModelConfig(hidden=32, layers=2, heads=2), task).eval()
    prompts = task.prompts(task.problems(32, torch.Generator().manual_seed(0)))
    cached = sample(model, prompts, task.completion_len, torch.Generator().manual_seed(1))
    plain = plain_sample(model, prompts, task.completion_len, torch.Generator().manual_seed(1))
    assert cached.shape == (32, task.completion_len)
    assert torch.equal(cached, plain)


def test_arm_specs_are_checked():
    arm = parse_arm("gear@estimator=k1,tau_onset=0.2")
    assert (arm.method, arm.estimator, arm.params(0).tau_onset) == ("gear", "k1", 0.2)
    with pytest.raises(ValueError, match="unknown credit method"):
        parse_arm("no_such_method")
    with pytest.raises(ValueError, match="unknown option"):
        parse_arm("gear@nope=1")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A micro run: two default arms and a method registered in a user's own module."""
    root = tmp_path_factory.mktemp("gym")
    (root / "gym_user_methods.py").write_text(
        textwrap.dedent(
            """
            import torch
            from gear.credit import MethodOutput, register_method

            @register_method("gym_test_last_step", requires=("kl",))
            def last_step(x, p):
                w = torch.ones_like(x.kl)
                w[:, -6:] = 2.0
                return MethodOutput(weights=torch.where(x.valid, w, 1.0))
            """
        )
    )
    sys.path.insert(0, str(root))
    try:
        result = run(
            ["grpo", "oracle", "gym_user_methods:gym_test_last_step"],
            seeds=2,
            steps=2,
            length=3,
            rl=MICRO_RL,
            model_cfg=TINY,
            warm=MICRO_WARM,
            loc_prompts=4,
            cache=root / "cache",
            out=root / "gym.json",
            plot_dir=root / "plots",
            log=lambda _: None,
        )
    finally:
        sys.path.remove(str(root))
    yield root, result
    # the user's method must not outlive this module's tests: other tests read the registry
    from gear.credit.methods import METHODS

    METHODS.pop("gym_test_last_step", None)
    sys.modules.pop("gym_user_methods", None)


def test_a_stopped_grid_resumes_with_the_same_numbers(micro):
    """Each finished (arm, seed) run is kept: a second run reads them back, recomputes only
    the missing one (as if the grid had been stopped there) and gets identical results."""
    root, first = micro
    saved = sorted((root / "cache" / "runs").glob("*.json"))
    assert len(saved) == 3 * 2  # three arms x two seeds
    kept = {p.name for p in saved}
    # which file holds grpo seed 1: the one whose content says so
    victim = next(
        p for p in saved if json.loads(p.read_text())["arm"] == "grpo"
        and json.loads(p.read_text())["seed"] == 1
    )  # fmt: skip
    victim.unlink()
    again = run(
        ["grpo", "oracle"], seeds=2, steps=2, length=3, rl=MICRO_RL, model_cfg=TINY,
        warm=MICRO_WARM, loc_prompts=4, cache=root / "cache", log=lambda _: None,
    )  # fmt: skip
    assert sorted(again["reused_runs"]) == ["grpo/seed0", "oracle/seed0", "oracle/seed1"]
    assert {p.name for p in (root / "cache" / "runs").glob("*.json")} == kept
    for arm in ("grpo", "oracle"):
        assert again["arms"][arm]["per_seed"] == first["arms"][arm]["per_seed"]


def test_a_user_registered_method_runs_through_the_gym(micro):
    _, result = micro
    arm = result["arms"]["gym_user_methods:gym_test_last_step"]
    assert len(arm["per_seed"]) == 2 and len(arm["curve"]) == 3  # steps 0, 1, 2


def test_the_json_has_the_documented_fields(micro):
    root, _ = micro
    data = json.loads((root / "gym.json").read_text())
    for key in ("task", "model_params", "seeds", "steps", "wall_s", "machine", "arms", "paired",
                "sweep", "localisation"):  # fmt: skip
        assert key in data
    assert data["seeds"] == [0, 1] and data["steps"] == 2
    for arm in data["arms"].values():
        assert {"final", "final_ci", "curve"} <= set(arm)
    assert {"mean", "ci"} <= set(data["paired"]["oracle-grpo"])
    assert data["localisation"]["arms"]["oracle"]["real"]["hit_step"] == pytest.approx(1.0)
    assert (root / "plots" / "gym_curves.png").is_file()
    assert (root / "plots" / "gym_paired.png").is_file()


def test_gear_gym_command_passes_its_options_and_refuses_bad_counts(monkeypatch):
    """`gear gym` hands its options to gear.gym.run (stubbed here) and checks counts first."""
    from typer.testing import CliRunner

    import gear.gym
    from gear.app.cli import app

    seen = {}

    def fake_run(methods, **kw):
        seen.update(methods=methods, **kw)
        return {}

    monkeypatch.setattr(gear.gym, "run", fake_run)
    monkeypatch.setattr(gear.gym, "table", lambda result: "TABLE")
    res = CliRunner().invoke(
        app, ["gym", "--methods", "grpo", "--methods", "mymod:m", "--seeds", "4", "--quick"]
    )
    assert res.exit_code == 0, res.output
    assert "TABLE" in res.output
    assert seen["methods"] == ["grpo", "mymod:m"] and seen["seeds"] == 4 and seen["quick"]
    seen.clear()
    res = CliRunner().invoke(app, ["gym", "--seeds", "0"])
    assert res.exit_code != 0 and "--seeds" in res.output and not seen


def _result_with_names(names):
    arm = {"final": 0.5, "final_ci": [0.4, 0.6], "final_accuracy": 0.5,
           "steps_to_threshold": {"reached": 3, "of": 3}}  # fmt: skip
    pair = {"mean": 0.01, "ci": [-0.01, 0.03], "wins": 2, "n": 3}
    loc = {"real": {"hit_step": 0.3, "hit_step_or_next": 0.3, "hit_token": 0.1, "mass_lift": 1.0},
           "placebo": {"hit_step": 0.25, "hit_step_or_next": 0.3}}  # fmt: skip
    return {
        "arms": {n: arm for n in names},
        "paired": {f"{n}-grpo": pair for n in names if n != "grpo"},
        "localisation": {
            "failures": 9,
            "placebo_rows": 4,
            "chance_hit_step": 0.25,
            "arms": {n: loc for n in names},
        },
    }


def test_tables_stay_aligned_with_a_users_long_arm_name(monkeypatch):
    """One line per arm, every line of a section as long as its header, and `gear gym`
    prints it unwrapped (issue 29: columns shifted and a value wrapped onto a new line)."""
    from typer.testing import CliRunner

    import gear.gym
    from gear.app.cli import app
    from gear.gym import table

    names = ["grpo", "mycredit:first_spike@tau_onset=0.05,estimator=k1"]
    text = table(_result_with_names(names))
    sections = [s.splitlines() for s in text.split("\n\n")]
    assert [len(s) for s in sections] == [3, 2, 4]  # header + one line per arm (per pair)
    for lines in (sections[0], sections[1], sections[2][1:]):
        assert len({len(line) for line in lines}) == 1, lines
    # each value starts in the column of its header (the numbers line up under "final")
    col = sections[0][0].index("final") + len("final")
    assert all(line[col - 5 : col] == "0.500" for line in sections[0][1:])

    monkeypatch.setattr(gear.gym, "run", lambda methods, **kw: _result_with_names(names))
    res = CliRunner().invoke(app, ["gym", "--methods", "grpo"], terminal_width=60)
    assert res.exit_code == 0, res.output
    assert text in res.output  # not wrapped at the terminal's width


def test_oar_g_trains_in_the_gym_from_the_answer_influence():
    """`oar_g` reads no teacher: one input-gradient pass gives its influence, which is zero on
    the answer (the last result digit) and the ";" after it, and the credit reshapes the
    tokens before the answer."""
    task = ChainTask(3)
    model = build_model(TINY, task)
    arm = parse_arm("oar_g")
    problems = task.problems(4, torch.Generator().manual_seed(3))
    comp = torch.randint(
        0, 10, (4, task.completion_len), generator=torch.Generator().manual_seed(1)
    )
    infl = answer_influence(model, arm, task, problems, comp)
    assert infl.shape == comp.shape and torch.all(infl[:, -2:] == 0) and bool(infl.gt(0).any())
    assert not any(p.grad is not None for p in model.parameters())  # no parameter gradients
    assert answer_influence(model, parse_arm("grpo"), task, problems, comp) is None
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    logits = torch.zeros(*comp.shape, 16)
    w = credit(arm, task, problems, comp, adv, logits, logits, 0, influence=infl) / adv[:, None]
    assert torch.allclose(w[:, -2:], torch.ones(4, 2)) and not torch.allclose(w, torch.ones_like(w))
    assert torch.allclose(w[:, :-2].mean(dim=1), torch.ones(4, dtype=w.dtype))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for seed in range(5):
        out = rl_step(
            model, opt, arm, task, MICRO_RL, problems,
            torch.Generator().manual_seed(seed), credit_seed=seed,
        )  # fmt: skip
        if out["updated"]:
            break
    assert out["updated"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("spec", ["oar_p", "oar_p@oar_span=reference,oar_pfinal=last"])
def test_oar_p_trains_in_the_gym_from_masked_copies(spec):
    """`oar_p` as a gym arm: each token before the answer replaced by <bos> (the gym has no pad
    token) gives the authors' score (`gear.testing.perturbation_loop`), only on the rows `scored`
    (a tied row runs no copy); the credit keeps the answer and what follows at w = 1, and a step
    changes the parameters."""
    from gear.gym.task import BOS
    from gear.testing import perturbation_loop

    task = ChainTask(3)
    model = build_model(TINY, task).eval()
    arm = parse_arm(spec)
    problems = task.problems(4, torch.Generator().manual_seed(3))
    comp = torch.randint(
        0, 10, (4, task.completion_len), generator=torch.Generator().manual_seed(1)
    )
    scored = torch.tensor([True, True, False, True])
    got = answer_influence(model, arm, task, problems, comp, scored=scored)
    ids, span, _ = oar_span(arm.params(0), task, problems, comp)
    P, T = task.prompts(problems).shape[1], task.completion_len
    n = T if "reference" in spec else T - 2  # tokens before the answer
    mode = arm.params(0).oar_pfinal
    for i in range(4):
        row = torch.cat([task.prompts(problems)[i], ids[i]]).tolist()
        want = [0.0] * T
        if scored[i]:
            span_pos = [P + int(c) for c in span[i].nonzero().flatten()]
            want[:n] = perturbation_loop(model, row, list(range(P, P + n)), span_pos, BOS, mode)
        torch.testing.assert_close(got[i].double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-6)  # fmt: skip
    adv = torch.tensor([1.0, -1.0, 0.0, -0.5])
    logits = torch.zeros(*comp.shape, 16)
    w = credit(arm, task, problems, comp, adv, logits, logits, 0, influence=got)
    w = w[[0, 1, 3]] / adv[[0, 1, 3], None]
    assert torch.allclose(w[:, n:], torch.ones(3, T - n)) and not torch.allclose(
        w, torch.ones_like(w)
    )
    assert torch.allclose(w[:, :n].mean(dim=1), torch.ones(3, dtype=w.dtype))
    out = step_until_update(model.train(), spec, task, tries=5)
    assert out["updated"] == 1.0


def test_oar_g_spans_in_the_gym():
    """'answer': the last result digit (the reward's), without the ";" after it; 'last': the
    last "r;" (k = 2, gear before issue 53); 'reference': the true final digit appended, the
    completion all reshaped."""
    task = ChainTask(2)
    problems = task.problems(3, torch.Generator().manual_seed(0))
    comp = task.references(problems)
    T = task.completion_len
    for spec, appended, span_cols, answer_cols in (
        ("oar_g", 0, [T - 2], [T - 2]),
        ("oar_g@oar_span=last", 0, [T - 2, T - 1], [T - 2, T - 1]),
        ("oar_g@oar_span=reference", 1, [T], []),
    ):
        ids, span, answer = oar_span(parse_arm(spec).params(0), task, problems, comp)
        assert ids.shape == (3, T + appended) and torch.equal(ids[:, :T], comp)
        assert all(span[i].nonzero().flatten().tolist() == span_cols for i in range(3))
        assert all(answer[i].nonzero().flatten().tolist() == answer_cols for i in range(3))
    ids, *_ = oar_span(parse_arm("oar_g@oar_span=reference").params(0), task, problems, comp)
    assert torch.equal(ids[:, -1], task.results(problems)[:, -1])


# ----------------------------------------------------------------------------- teacher contexts


def test_the_answer_only_teacher_is_shown_the_final_result_alone():
    """answer_only: <bos> rL : prompt; its contrast shows rL + 5 mod 10 in the same format;
    all_steps (the default) keeps every result."""
    full, short = ChainTask(4), ChainTask(4, hint="answer_only")
    problems = full.problems(64, torch.Generator().manual_seed(0))
    student, final = full.prompts(problems), full.results(problems)[:, -1]
    hinted = short.teacher_prompts(problems)
    assert hinted.shape == (64, student.shape[1] + 2)
    assert torch.equal(hinted[:, 1], final) and torch.all(hinted[:, 2] == ID[":"])
    assert torch.equal(hinted[:, :1], student[:, :1]) and torch.equal(hinted[:, 3:], student[:, 1:])
    wrong = short.contrast_teacher_prompts(problems)
    assert torch.equal(wrong[:, 1], (final + 5) % 10)
    assert torch.equal(wrong[:, 2:], hinted[:, 2:]) and torch.equal(wrong[:, 0], hinted[:, 0])
    every = full.teacher_prompts(problems)
    assert torch.equal(every[:, 1 : 1 + full.length], full.results(problems))
    with pytest.raises(ValueError, match=r"ChainTask\.hint"):
        ChainTask(4, hint="worked_solution")


def test_the_run_key_and_the_warm_start_key_differ_by_teacher_context():
    from gear.gym import run_key
    from gear.gym.model import warm_start_key

    arm, rl = parse_arm("gear"), RLConfig()
    full, short = ChainTask(4), ChainTask(4, hint="answer_only")
    assert run_key(arm, 0, rl, "w", full) != run_key(arm, 0, rl, "w", short)
    assert run_key(arm, 0, rl, "w", full) == run_key(arm, 0, rl, "w")  # the default context
    assert warm_start_key(full, ModelConfig(), WarmStart()) != warm_start_key(
        short, ModelConfig(), WarmStart()
    )
    both = WarmStart(hints="both", teacher_steps=10)  # one warm start for both contexts
    assert warm_start_key(full, ModelConfig(), both) == warm_start_key(short, ModelConfig(), both)
    assert warm_start_key(full, ModelConfig(), both) != warm_start_key(
        full, ModelConfig(), WarmStart()
    )
    with pytest.raises(ValueError, match=r"WarmStart\.hints"):
        WarmStart(hints="answer_only", teacher_steps=1)
    with pytest.raises(ValueError, match=r"WarmStart\.teacher_steps"):
        WarmStart(hints="both")


def test_an_answer_only_run_trains_and_records_its_context(tmp_path):
    """End to end with the final-answer teacher: the warm start learns from answer-only hints,
    a gear arm's update moves the parameters, and the JSON says which context ran."""
    import gear.gym.model as gym_model

    seen = []
    real = gym_model.completion_logits

    def spy(model, prompts, completions):
        seen.append(prompts.shape[1])
        return real(model, prompts, completions)

    task = ChainTask(3, hint="answer_only")
    gym_model.completion_logits = spy
    try:
        state, _ = gym_model.warm_start(task, TINY, MICRO_WARM, cache=tmp_path, log=lambda _: None)
    finally:
        gym_model.completion_logits = real
    assert task.teacher_prompts(task.problems(1, torch.Generator())).shape[1] in seen
    model = build_model(TINY, task)
    model.load_state_dict(state)
    arm = "gear_departure_blame@estimator=k1"
    assert step_until_update(model, arm, task, tries=10)["updated"] == 1.0
    assert any(not torch.equal(state[k], v) for k, v in model.state_dict().items())
    result = run(
        ["grpo", "gear"], seeds=1, steps=2, length=3, hint="answer_only", rl=MICRO_RL,
        model_cfg=TINY, warm=MICRO_WARM, loc_prompts=4, cache=tmp_path, log=lambda _: None,
    )  # fmt: skip
    assert result["task"]["hint"] == "answer_only"
    assert len(result["arms"]["gear"]["per_seed"]) == 1


# ----------------------------------------------------------------------------- fairness


def test_an_arm_can_carry_its_own_learning_rate(tmp_path):
    """`grpo@lr=...`: GRPO at several rates as arms; the rate keys the run and is used."""
    from gear.gym import run_key
    from gear.gym.model import warm_start
    from gear.gym.train import train_arm

    arm = parse_arm("grpo@lr=1e-3")
    assert (arm.method, arm.lr, dict(arm.overrides)) == ("grpo", 1e-3, {})
    assert parse_arm("grpo").lr is None
    assert run_key(arm, 0, RLConfig(), "w") != run_key(parse_arm("grpo"), 0, RLConfig(), "w")
    with pytest.raises(ValueError, match="lr must be a number > 0"):
        parse_arm("grpo@lr=0")
    task = ChainTask(3)
    state, _ = warm_start(task, TINY, MICRO_WARM, cache=tmp_path, log=lambda _: None)
    rl = replace(MICRO_RL, steps=3, lr=1e-2)
    frozen = train_arm(parse_arm("grpo@lr=1e-12"), 0, task, TINY, state, rl, log=lambda _: None)
    moving = train_arm(parse_arm("grpo"), 0, task, TINY, state, rl, log=lambda _: None)
    start = frozen["curve"][0]["exact"]
    assert abs(frozen["curve"][-1]["exact"] - start) <= 1e-4 * start  # (tiny: start ~1e-21)
    assert abs(moving["curve"][-1]["exact"] - start) > 1e-2 * start


def test_seeds_spread_over_warm_starts_and_the_summary_reports_both_spreads(tmp_path):
    """warm_starts=3: seed i trains from warm start i mod 3 (its own initialisation, data
    and held-out set); each arm reports its change vs the warm start, the worst seed and the
    SD within and between warm starts."""
    result = run(
        ["grpo", "grpo@lr=1e-2"], seeds=6, steps=2, length=3, warm_starts=3, rl=MICRO_RL,
        model_cfg=TINY, warm=MICRO_WARM, loc_prompts=4, cache=tmp_path, log=lambda _: None,
    )  # fmt: skip
    assert [w["warm"] for w in result["warm_starts"]] == [0, 1, 2]
    assert len({w["key"] for w in result["warm_starts"]}) == 3
    assert {r["seed"]: r["warm"] for r in result["runs"]} == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    starts = {r["warm"]: r["curve"][0]["exact"] for r in result["runs"] if r["arm"] == "grpo"}
    assert len(set(starts.values())) == 3  # three different warm starts
    assert result["arm_lr"] == {"grpo": MICRO_RL.lr, "grpo@lr=1e-2": 1e-2}
    for arm in result["arms"].values():
        rows = arm["seed_table"]
        assert [r["seed"] for r in rows] == list(range(6))
        assert all(r["change"] == pytest.approx(r["final"] - r["start"]) for r in rows)
        assert arm["change"] == pytest.approx(sum(r["change"] for r in rows) / 6)
        assert arm["worst_seed"]["change"] == min(r["change"] for r in rows)
        assert arm["below_warm_start"] == sum(r["change"] < 0 for r in rows)
        spread = arm["warm_spread"]
        means = [sum(r["change"] for r in rows if r["warm"] == w) / 2 for w in range(3)]
        assert list(spread["mean_by_warm"].values()) == pytest.approx(means)
        pooled = sum((r["change"] - means[r["warm"]]) ** 2 for r in rows) / 3
        assert spread["within_sd"] == pytest.approx(pooled**0.5)


def test_the_teacher_phase_teaches_both_formats_and_anchors_the_student(monkeypatch, tmp_path):
    """hints="both": the default warm start (all-steps hints, cached under its own key), then
    `teacher_steps` steps whose hinted rows are trained in both formats while the unhinted rows
    are held to the student phase's own predictions."""
    import gear.gym.model as gym_model

    seen = []
    real = gym_model.completion_logits
    monkeypatch.setattr(
        gym_model, "completion_logits", lambda m, p, c: seen.append(p.shape[1]) or real(m, p, c)
    )
    short = ChainTask(3, hint="answer_only")
    warm = replace(MICRO_WARM, hints="both", teacher_steps=4)
    _, info = gym_model.warm_start(short, TINY, warm, cache=tmp_path, log=lambda _: None)
    base = gym_model.warm_start_key(ChainTask(3), TINY, MICRO_WARM)
    assert info["student_phase"]["key"] == base and (tmp_path / f"warm-{base}.pt").is_file()
    assert info["steps"] == MICRO_WARM.max_steps + 4
    assert set(info["hinted_accuracy_by_hint"]) == {"all_steps", "answer_only"}
    # prompt lengths: student 9, answer-only teacher 11, all-steps teacher 13. The student
    # phase trains 13 and 9 each step; each teacher step: 13, 11, then 9 twice (the model and
    # its frozen anchor on the unhinted rows)
    assert seen[-4 * 4 - 1 : -1] == [13, 11, 9, 9] * 4  # the last: the info's exact accuracy


def test_the_anchor_holds_the_unhinted_rows_to_the_frozen_model():
    """With the frozen anchor equal to the model, the unhinted rows add no gradient."""
    import gear.gym.model as gym_model

    task = ChainTask(3)
    model = build_model(TINY, task)
    frozen = build_model(TINY, task)
    problems = task.problems(8, torch.Generator().manual_seed(0))
    rows = torch.ones(8, dtype=torch.bool)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = gym_model._supervised_step(
        model, opt, task, problems, [], anchor=(frozen, task.prompts(problems), rows)
    )
    assert loss == pytest.approx(0.0, abs=1e-6)
    assert all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(before, model.parameters(), strict=True)
    )


def test_runs_kept_before_the_run_store_are_still_found(tmp_path):
    """The gym keeps its runs in a `gear.evidence.RunStore` (issue 50): the key and file name
    are the ones it wrote by hand before (16 hex digits of SHA-256 over the parameters plus the
    code digest, as `<key>.json` under the cache's runs/), so a kept run is read back, not
    rerun."""
    import hashlib
    import importlib
    import inspect
    from dataclasses import asdict
    from pathlib import Path

    gym_run = importlib.import_module("gear.gym.run")  # `import gear.gym.run` is the function
    from gear.credit.methods import METHODS
    from gear.evidence import RunStore, code_digest

    arm, rl, task = parse_arm("gear@tau_onset=0.1"), RLConfig(), ChainTask(3)
    here = Path(gym_run.__file__).parent  # the digest the gym computed by hand
    files = [here / n for n in ("task.py", "model.py", "train.py")]
    files += sorted((here.parent / "credit").glob("*.py"))
    files.append(Path(inspect.getsourcefile(METHODS[arm.method].fn)))
    params = {
        "task": asdict(task), "warm": "w", "method": arm.method, "estimator": arm.estimator,
        "oracle": arm.oracle, "lr": arm.lr, "held_out": 1, "params": asdict(arm.params(2)),
        "seed": 2, "rl": asdict(rl), "torch": torch.__version__,
        "code": code_digest(files=dict.fromkeys(files))[:16],
    }  # fmt: skip
    old_key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    assert gym_run.run_key(arm, 2, rl, "w", task, held_out=1) == old_key

    store = RunStore(tmp_path, gym_run.run_code(arm))
    kept = {"seed": 2, "curve": [], "final": 0.25}
    (tmp_path / f"{old_key}.json").write_text(json.dumps(kept))
    job = (arm.name, arm.spec, 2, task, TINY, None, rl, 1, store, gym_run.run_params(
        arm, 2, rl, "w", task, held_out=1))  # fmt: skip
    assert gym_run._job(job) == kept | {"arm": arm.name, "warm": 1, "reused": True}


def test_gear_gym_run_is_the_function_and_its_module_is_importable():
    """`gear.gym.run` names the function users call (`from gear.gym import run`); the module
    that holds it, gear/gym/run.py, is reached by `importlib.import_module` or `from gear.gym.run
    import NAME` (`import gear.gym.run as m` gives the function: the package attribute wins)."""
    import importlib

    import gear.gym

    module = importlib.import_module("gear.gym.run")
    assert callable(run) and run is gear.gym.run is module.run
    assert gear.gym.table is module.table and gear.gym.run_key is module.run_key
    from gear.gym.run import table

    assert table is module.table

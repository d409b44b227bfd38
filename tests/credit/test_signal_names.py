"""The per-token signal names are declared once (`gear.credit.registry.SIGNAL_SPECS`); every other
list of them is derived from it or agrees with it, and every built-in method is registered
whenever the credit core is imported."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

from gear.credit import CreditInputs, TokenSignals, credit_details, token_advantages
from gear.credit import registry as reg

#: credit_details' keywords that are not per-token signals
NOT_SIGNALS = ("turn_starts", "answer_mask", "params", "scored")


def test_credit_details_takes_every_declared_signal_and_no_other():
    keywords = [
        name
        for name, p in inspect.signature(credit_details).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert sorted(set(keywords) - set(NOT_SIGNALS)) == sorted(reg.CREDIT_SIGNALS)


def test_token_advantages_shows_credit_details_signature():
    details = inspect.signature(credit_details).parameters
    assert list(inspect.signature(token_advantages).parameters) == list(details)


def test_every_signal_a_method_may_read_is_a_field_of_the_credit_inputs():
    fields = {f.name for f in dataclasses.fields(CreditInputs)}
    assert set(reg.SIGNALS) <= fields
    assert reg.CONTRAST_KL not in reg.SIGNALS  # folded into kl by CreditParams.contrast


def test_the_signal_pass_signals_are_the_fields_of_token_signals():
    assert tuple(f.name for f in dataclasses.fields(TokenSignals)) == reg.PASS_SIGNALS
    assert set(reg.TEACHER_SIGNALS) <= set(reg.PASS_SIGNALS)


def test_the_trainers_derive_their_lists_from_the_declaration():
    from gear.credit import signals
    from gear.integrations.trl import credit as trl_credit
    from gear.integrations.verl import estimators

    assert trl_credit.SIGNAL_NAMES == reg.PASS_SIGNALS
    assert signals.TEACHER_SIGNALS == reg.TEACHER_SIGNALS == ("kl", "teacher_logprobs")
    assert {n: f"gear_{n}" for n in reg.PASS_SIGNALS} == estimators.SIGNAL_FIELDS
    assert estimators.OUTPUT_FIELDS == {
        **estimators.SIGNAL_FIELDS,
        "contrast_kl": "gear_contrast_kl",
    }


def test_the_names_are_those_of_before_the_declaration():
    assert reg.SIGNALS == (
        "kl",
        "entropy",
        "student_logprobs",
        "teacher_logprobs",
        "influence",
        "perturbation",
        "error_mask",
        "prefix_count",
    )
    assert reg.MASK_SIGNALS == ("error_mask",)


def test_every_method_requires_declared_signals():
    assert reg.METHODS
    for method in reg.METHODS.values():
        assert set(method.requires) <= set(reg.SIGNALS), method.name


def test_the_builtin_methods_are_registered_whichever_credit_module_comes_first():
    """A fresh interpreter: importing params (or the registry) alone registers every built-in,
    so a CreditParams can check its method's name."""
    code = (
        "from gear.credit.params import CreditParams\n"
        "CreditParams(method='gear'); CreditParams(method='lambda_grpo')\n"
        "from gear.credit.registry import METHODS\n"
        "import gear.credit.methods as m\n"
        "assert m.METHODS is METHODS and m.register_method is not None\n"
        "print(len(METHODS))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == len(reg.METHODS)


def test_the_split_modules_keep_every_name_importable_from_where_it_was():
    """`gear.credit.signals` keeps its public names after the kernels got their own modules
    (`chunk`, `distill`), and `gear.credit.methods` the registry's (`registry`)."""
    from gear.credit import methods, signals

    for name in (
        "DEFAULT_CHUNK",
        "ESTIMATORS",
        "KERNELS",
        "LOGPROB_ESTIMATORS",
        "TEACHER_SIGNALS",
        "TokenSignals",
        "reverse_kl_from_hidden",
        "signals_from_hidden",
        "signals_from_logits",
        "signals_from_teacher_logprobs",
        "use_fold",
        "without_teacher",
    ):
        assert hasattr(signals, name), name
    for name in (
        "METHODS",
        "ROWS",
        "SIGNALS",
        "STEP_SEEDED",
        "CreditInputs",
        "Method",
        "MethodFn",
        "MethodOutput",
        "register_method",
    ):
        assert hasattr(methods, name), name
    assert methods.METHODS is reg.METHODS and methods.CreditInputs is reg.CreditInputs

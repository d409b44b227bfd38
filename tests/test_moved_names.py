"""Names that moved out of `gear.run` and `gear.run_callbacks` (issue 50: one module, one job)
still import from their old module, with a DeprecationWarning that names the new import, and
are the very objects of their new home (so code that imports them the old way runs the same)."""

from __future__ import annotations

import importlib
import warnings

import pytest

MOVED = [
    ("gear.run", "RunConfig", "gear.app.config"),
    ("gear.run", "resolve_config", "gear.app.config"),
    ("gear.run", "resolve_values", "gear.app.config"),
    ("gear.run", "resume_config", "gear.app.config"),
    ("gear.run", "recipe_names", "gear.app.config"),
    ("gear.run", "trainer_args", "gear.app.config"),
    ("gear.run", "checkpointing_field", "gear.app.config"),
    ("gear.run", "CONFIG_DIR", "gear.app.config"),
    ("gear.run", "cached_eval_before", "gear.app.evaluate"),
    ("gear.run", "store_eval_before", "gear.app.evaluate"),
    ("gear.run", "eval_cache_key", "gear.app.evaluate"),
    ("gear.run", "RunStopped", "gear.app.callbacks"),
    ("gear.run", "stop_signals", "gear.app.callbacks"),
    ("gear.run_callbacks", "evaluate_now", "gear.app.evaluate"),
    ("gear.run_callbacks", "EvalCallback", "gear.app.evaluate"),
    ("gear.run", "write_summary", "gear.app.rundir"),
    ("gear.run", "learning_lines", "gear.app.rundir"),
    ("gear.run", "lora_config", "gear.app.preflight"),
    ("gear.run_callbacks", "read_metrics", "gear.app.rundir"),
    ("gear.run_callbacks", "truncate_run_logs", "gear.app.rundir"),
    ("gear.run_callbacks", "last_checkpoint", "gear.app.rundir"),
    ("gear.inputs", "InputError", "gear.io"),
    ("gear.inputs", "read_json", "gear.io"),
    ("gear.inputs", "resume_checkpoint", "gear.app.rundir"),
    ("gear.inputs", "evaluation_target", "gear.app.rundir"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_a_moved_name_imports_from_its_old_module_with_a_warning(old, name, new):
    with pytest.warns(DeprecationWarning, match=f"import it as `from {new} import {name}`"):
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(new), name)


def test_names_that_stayed_do_not_warn_and_unknown_names_still_fail():
    import gear.run
    import gear.run_callbacks

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from gear.run import build_trainer, load_model_and_data, train  # noqa: F401
        from gear.run_callbacks import SignalStop, atomic_checkpoints  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gear.run.nope  # noqa: B018
    with pytest.raises(ImportError):
        from gear.run_callbacks import nope  # noqa: F401

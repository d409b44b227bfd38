"""The credit gym: a small task where credit assignment matters and the first error is known,
a tiny model that learns it on a CPU, and paired seeds for real intervals (issue 20).

`run(...)` is the entry point (`gear/gym/run.py`): warm start (cached), localisation of blame on
natural failures, then every arm x seed from the same warm start, then paired statistics, JSON
and plots. Components: `task` (the chain task and its checker), `model` (tiny Llama, sampling,
warm start), `train` (arms, the RL loop through `gear.credit`), `report` (statistics,
localisation, plots). See docs/gym.md.
"""

from gear._moved import moved
from gear.gym.run import QUICK, run_key, table
from gear.gym.run import _finite as _finite  # NaN -> None; studies write their JSON with it
from gear.gym.run import run as run  # the function, not the module gear.gym.run: see below
from gear.gym.task import ChainTask
from gear.gym.train import DEFAULT_ARMS, RLConfig, parse_arm

# `from gear.gym.run import run` binds `gear.gym.run` to the function, over the submodule that
# the import system sets there first: `gear.gym.run(...)` and `from gear.gym import run` give
# the function users call, as before the orchestrator had a file of its own. The module is
# `sys.modules["gear.gym.run"]`; `from gear.gym.run import table` reads it from there.

__all__ = ["DEFAULT_ARMS", "QUICK", "ChainTask", "RLConfig", "parse_arm", "run", "run_key", "table"]

# What this file imported for the orchestrator before it moved (issue 50): still importable from
# here, with a DeprecationWarning naming the module that defines it.
__getattr__ = moved(
    __name__,
    dict.fromkeys(["state_hash", "sweep_arms"], "gear.gym.run")
    | dict.fromkeys(
        ["ModelConfig", "WarmStart", "build_model", "cache_dir", "n_params", "warm_start"],
        "gear.gym.model",
    )
    | dict.fromkeys(["localisation", "plots", "summarise"], "gear.gym.report")
    | dict.fromkeys(["Arm", "train_arm"], "gear.gym.train"),
)

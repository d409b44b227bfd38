"""The `gear` program: the recipes that wire the components (`gear.credit`, `gear.tasks`, the
trainers of `gear.integrations`, ...) into commands, as torchtune's recipes do.

- `cli`: the commands; `config` and `configs/`: the run config and the shipped recipes;
- `preflight`: what a run checks before its model loads; `train` and `callbacks`: a run;
- `evaluate`, `sampling`, `suite`: held-out evaluation; `inspect_run`: the credit viewer;
- `compare`: a study of methods x seeds (`rule`, `runs`, `report`);
- `precision`, `threads`: how a run uses this machine.

Only the application, the studies, the benchmarks and the scripts import this package: a
component never does (tests/test_app_layout.py).
"""

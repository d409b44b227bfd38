"""The `gear` program: the recipes that wire the components (`gear.credit`, `gear.tasks`, the
trainers of `gear.integrations`, ...) into commands, as torchtune's recipes do.

- `cli`: the commands; `config` and `configs/`: the run config and the shipped recipes;
- `preflight`: what a run checks before its model loads; `train` and `callbacks`: a run;
- `rundir`: the run directory, the one module that knows its layout (checkpoints,
  metrics.jsonl, summary.*, config.yaml);
- `evaluate`, `sampling`, `suite`, `eval_target`: held-out evaluation and `gear eval`;
  `inspect_run`: `gear inspect`, the credit viewer;
- `compare`: a study of methods x seeds (`rule`, `runs`, `report`);
- `precision`, `threads`, `unused_packages`: how a run uses this machine.

Only the application, the studies, the benchmarks and the scripts import this package: a
component never does (tests/app/test_app_layout.py).
"""

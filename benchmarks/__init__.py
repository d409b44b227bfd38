"""Speed and memory benchmarks (results in benchmarks/results/). Run from the repository root as
modules, `python -m benchmarks.<name>`; not shipped in the wheel."""

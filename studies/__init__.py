"""The studies: scripts that produce gear's evidence (results in studies/results/). Run from the
repository root as modules, `python -m studies.<name>`; not shipped in the wheel."""

"""Retired studies, kept runnable for their committed results (studies/archive/results/). Run from
the repository root as `python -m studies.archive.<name>`; not shipped in the wheel."""

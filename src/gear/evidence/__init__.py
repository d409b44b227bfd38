"""Evidence: what gear's studies share. The statistics (paired t-intervals, power, MDE, seeds
needed, Bonferroni levels, bootstrap intervals over prompts), the run store (finished runs kept
under a key of the code that determines them; a stopped grid resumes), the pre-registration
record (the rule's commit, checked to precede the results it governs) and the learning gate
every real-LM comparison checks first (does the baseline learn at all?), and the comparison of
credit methods against a baseline that `gear compare` and the studies share (`compare_arms`)."""

from gear.evidence.compare import compare_arms, seeds_to_plan, verdict
from gear.evidence.gate import learning_gate, slope
from gear.evidence.prereg import first_commit, preregistered
from gear.evidence.stats import (
    bonferroni,
    bootstrap,
    bootstrap_difference,
    mde,
    n_for_power,
    paired,
    power_at,
    t_interval,
)
from gear.evidence.store import RunStore, code_digest, run_key, write_json, write_text

__all__ = [
    "RunStore",
    "bonferroni",
    "bootstrap",
    "bootstrap_difference",
    "code_digest",
    "compare_arms",
    "first_commit",
    "learning_gate",
    "mde",
    "n_for_power",
    "paired",
    "power_at",
    "preregistered",
    "run_key",
    "seeds_to_plan",
    "slope",
    "t_interval",
    "verdict",
    "write_json",
    "write_text",
]

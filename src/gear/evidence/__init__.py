"""Evidence: what gear's studies share. The statistics (paired t-intervals, power, MDE, seeds
needed, Bonferroni levels, bootstrap intervals over prompts), the run store (finished runs kept
under a key of the code that determines them, or by name; a stopped grid resumes), written
through `gear.io`'s atomic writer (re-exported here), the pre-registration record (the rule's
commit, checked to precede the results it governs, and the git helpers every study records its
commit with) and the learning gate every real-LM comparison checks first (does the baseline learn at all?), and the comparison of
credit methods against a baseline that `gear compare` and the studies share (`compare_arms`)."""

from gear.evidence.compare import compare_arms, seeds_to_plan, verdict
from gear.evidence.gate import learning_gate, slope
from gear.evidence.prereg import first_commit, git, head_commit, preregistered, uncommitted
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
from gear.evidence.store import RecordStore, RunStore, code_digest, run_key
from gear.io import replacing, write_json, write_text  # the atomic writer, for the studies

__all__ = [
    "RecordStore",
    "RunStore",
    "bonferroni",
    "bootstrap",
    "bootstrap_difference",
    "code_digest",
    "compare_arms",
    "first_commit",
    "git",
    "head_commit",
    "learning_gate",
    "mde",
    "n_for_power",
    "paired",
    "power_at",
    "preregistered",
    "replacing",
    "run_key",
    "seeds_to_plan",
    "slope",
    "t_interval",
    "uncommitted",
    "verdict",
    "write_json",
    "write_text",
]

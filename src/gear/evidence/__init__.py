"""Evidence: the statistics gear's studies share (paired t-intervals, power, MDE, seeds needed,
Bonferroni levels) and the learning gate every real-LM comparison checks first (does the
baseline learn at all?)."""

from gear.evidence.gate import learning_gate, slope
from gear.evidence.stats import bonferroni, mde, n_for_power, paired, power_at, t_interval

__all__ = [
    "bonferroni",
    "learning_gate",
    "mde",
    "n_for_power",
    "paired",
    "power_at",
    "slope",
    "t_interval",
]

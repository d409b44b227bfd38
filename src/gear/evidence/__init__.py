"""Evidence: the statistics gear's studies share (paired t-intervals, power, MDE) and the learning
gate every real-LM comparison checks first (does the baseline learn at all?)."""

from gear.evidence.gate import learning_gate, slope
from gear.evidence.stats import mde, paired, power_at, t_interval

__all__ = ["learning_gate", "mde", "paired", "power_at", "slope", "t_interval"]

"""GEAR: credit assignment for RL post-training of LLMs.

The components a trainer may import (`gear.credit`, `gear.tasks`, `gear.teacher`, ...) sit at
this level; the program (`gear train`, `gear eval`, `gear compare`, ...) is `gear.app`, which
nothing here imports. Modules that moved into it keep their old paths for one release
(`gear._moved`).
"""

from gear import _moved

_moved.install()

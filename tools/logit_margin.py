"""A logits row's best two ids and the margin between them: what makes a divergence a near-tie.

Shared by tools/bench/divergence.py (AR against verify passes), tools/bench/loadgen.py and tools/cluster/soak.py
(a fleet's off-record ids); it imports nothing of theirs, so they import it without a cycle.
"""

from __future__ import annotations

import numpy as np


def top2(row: np.ndarray) -> tuple[int, int, float, float]:
    """(best id, second id, best logit, margin best - second) of a logits row [vocab]."""
    two = np.argpartition(row, -2)[-2:]
    a, b = (two[1], two[0]) if row[two[1]] >= row[two[0]] else (two[0], two[1])
    return int(a), int(b), float(row[a]), float(row[a] - row[b])

"""`trimmed-mean`: coordinate-wise, over the m = 1 + |R_k| contributions of fragment k (the node's own included):
drop the b smallest and the b largest values of every coordinate and average the rest. `trim` >= 1 is b itself
(an integer); 0 < `trim` < 0.5 is a fraction: b = floor(trim * m). Too few contributions to trim b per side
(m < 2b + 1): b becomes floor((m - 1) / 2), i.e. the coordinate-wise median of all m (for m = 2 that is their
mean; for m = 1 the node's own values). So a fragment with a single received contribution is averaged with it.
Sums run in float64 in ascending value order per coordinate, so the result does not depend on arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .rule import FragmentRule

# A received fragment counts as "trimmed" when at least this share of its coordinates was cut away. An honest
# contribution among m is cut in about 2b/m of them (2/3 for m = 3, b = 1), a value far out in nearly all.
TRIMMED_SHARE = 0.9


@dataclass(frozen=True)
class TrimmedMean(FragmentRule):
    name = "trimmed-mean"
    help = "coordinate-wise, --trim"
    cuts = "trimmed"  # received fragments cut in at least TRIMMED_SHARE of their coordinates

    trim: float = 1.0

    def fragment(self, mine: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        return trimmed_fragment(mine, parts, self.trim)


def trim_count(trim: float, contributions: int) -> int:
    """Values dropped per side of each coordinate among `contributions` values (own included)."""
    b = int(trim) if trim >= 1 else math.floor(trim * contributions)
    return max(0, min(b, (contributions - 1) // 2))


def trimmed_fragment(mine: np.ndarray, parts: Sequence[np.ndarray], trim: float) -> tuple[np.ndarray, int]:
    """Coordinate-wise trimmed mean of own and `parts`; and how many parts were cut in at least TRIMMED_SHARE of
    their coordinates (a value equal to the lowest or highest kept one does not count as cut)."""
    m = 1 + len(parts)
    b = trim_count(trim, m)
    # one row per coordinate, its m values side by side: sorting along the contiguous last axis is the fast way
    stack = np.empty((len(mine), m), dtype=np.float64)
    stack[:, 0] = mine
    for j, values in enumerate(parts, start=1):
        stack[:, j] = values
    if b == 0:
        return (stack.sum(axis=1) / m).astype(np.float32), 0
    ranked = np.sort(stack, axis=1)
    kept = ranked[:, b:m - b].sum(axis=1) / (m - 2 * b)
    size = len(mine)
    if not size:
        return kept.astype(np.float32), 0
    low, high = ranked[:, b:b + 1], ranked[:, m - b - 1:m - b]
    cut = np.count_nonzero((stack[:, 1:] < low) | (stack[:, 1:] > high), axis=0)
    return kept.astype(np.float32), int(np.count_nonzero(cut >= TRIMMED_SHARE * size))

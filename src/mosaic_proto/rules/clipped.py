"""`clipped`: self-centred clipping (ClippedGossip, He, Karimireddy and Jaggi 2022) with equal weights
1 / (1 + m): x = own + sum_j clip(x_j - own, tau) / (1 + m), where clip(z, tau) = z * min(1, tau / ||z||).
The radius is relative to the node's own fragment: tau_k = `clip_radius` * ||own_k|| (L2 in float64, summed by
numpy, not BLAS). It depends on nothing another sender sent, so a lone liar cannot raise it, and a sender moves a
fragment by at most tau_k / (1 + m) per round. The default 0.1 is above what honest fragments differ by, so it
leaves them alone (docs/security.md gives the measurement). Sums run in float64 in ascending sender order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .rule import FragmentRule


@dataclass(frozen=True)
class Clipped(FragmentRule):
    name = "clipped"
    help = "self-centred, --clip-radius"
    cuts = "clipped"  # received fragments whose difference to the node's own was clipped

    clip_radius: float = 0.1

    def fragment(self, mine: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        return clipped_fragment(mine, parts, self.clip_radius)


def _norm(x: np.ndarray) -> float:
    """L2 norm by numpy's own pairwise sum, not BLAS (np.linalg.norm): the same bits whatever the BLAS library, its
    threads or the machine's load, which clipping needs (the norm scales the values)."""
    return math.sqrt(float(np.add.reduce(x * x)))


def clipped_fragment(mine: np.ndarray, parts: Sequence[np.ndarray], radius: float) -> tuple[np.ndarray, int]:
    """own + sum_j clip(x_j - own, radius * ||own||) / (1 + m), summed in the order of `parts`; and how many
    parts were clipped."""
    base = np.asarray(mine, dtype=np.float64)
    tau = radius * _norm(base)
    acc = np.zeros_like(base)
    clipped = 0
    for values in parts:
        diff = np.asarray(values, dtype=np.float64) - base
        norm = _norm(diff)
        if norm > tau:
            clipped += 1
            diff *= tau / norm
        acc += diff
    return (base + acc / (1 + len(parts))).astype(np.float32), clipped

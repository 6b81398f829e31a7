"""Robust aggregation per fragment: what a node does with the fragments it received when some senders may lie.

Three rules, chosen by the run's `aggregator` setting (identical on every node, so `simulate` == `cluster`):

- `mean`: today's count-based averaging (`aggregation.aggregate`), bit for bit.
- `trimmed-mean`: coordinate-wise, over the m = 1 + |R_k| contributions of fragment k (the node's own included):
  drop the b smallest and the b largest values of every coordinate and average the rest. `trim` >= 1 is b itself
  (an integer); 0 < `trim` < 0.5 is a fraction: b = floor(trim * m). Too few contributions to trim b per side
  (m < 2b + 1): b becomes floor((m - 1) / 2), i.e. the coordinate-wise median of all m (for m = 2 that is their
  mean; for m = 1 the node's own values). So a fragment with a single received contribution is averaged with it.
- `clipped`: self-centred clipping (ClippedGossip, He, Karimireddy and Jaggi 2022) with equal weights
  1 / (1 + m): x = own + sum_j clip(x_j - own, tau) / (1 + m), where clip(z, tau) = z * min(1, tau / ||z||).
  The radius is relative to the node's own fragment: tau_k = `clip_radius` * ||own_k|| (L2 in float64, summed by
  numpy, not BLAS). It depends on nothing another sender sent, so a lone liar cannot raise it, and a sender moves a
  fragment by at most tau_k / (1 + m) per round. The default 0.1 is above what honest fragments differ by, so it
  leaves them alone (docs/security.md gives the measurement).

Every rule is deterministic: sums run in float64 in ascending sender order (clipped) or in ascending value order
per coordinate (trimmed-mean), so the result does not depend on arrival order. Each also counts what its rule cut
(`Aggregator.aggregate`'s Counter): received fragments clipped, and received fragments trimmed in nearly all of their
coordinates (TRIMMED_SHARE).

With --compress topk a received fragment carries some coordinates only: the robust rules read the receiver's own
value in the others, or with error feedback the newest value it heard of them (`compression.densify`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .aggregation import aggregate
from .compression import densify
from .fragmentation import Fragmentation

# A received fragment counts as "trimmed" when at least this share of its coordinates was cut away. An honest
# contribution among m is cut in about 2b/m of them (2/3 for m = 3, b = 1), a value far out in nearly all.
TRIMMED_SHARE = 0.9


class AggregatorKind(StrEnum):
    MEAN = "mean"
    TRIMMED_MEAN = "trimmed-mean"
    CLIPPED = "clipped"


def trim_count(trim: float, contributions: int) -> int:
    """Values dropped per side of each coordinate among `contributions` values (own included)."""
    b = int(trim) if trim >= 1 else math.floor(trim * contributions)
    return max(0, min(b, (contributions - 1) // 2))


@dataclass(frozen=True)
class Aggregator:
    """One node's rule for fragment-wise aggregation (the run's `aggregator`, `trim`, `clip_radius`)."""

    kind: AggregatorKind = AggregatorKind.MEAN
    trim: float = 1.0
    clip_radius: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", AggregatorKind(self.kind))
        if not (0 < self.trim < 0.5 or (self.trim >= 1 and float(self.trim).is_integer())):
            raise ValueError(f"trim must be a whole number >= 1 or a fraction in (0, 0.5), got {self.trim}")
        if not (self.clip_radius > 0 and math.isfinite(self.clip_radius)):
            raise ValueError(f"clip_radius must be > 0, got {self.clip_radius}")

    def aggregate(self, own: np.ndarray, fragmentation: Fragmentation,
                  received: Mapping[int, Mapping[int, np.ndarray]],
                  own_fragments: Sequence[np.ndarray] | None = None,
                  stand_in: np.ndarray | None = None) -> tuple[np.ndarray, Counter]:
        """The new vector and what the rule cut: {"clipped": n} or {"trimmed": n} (received fragments). `stand_in`:
        what a sparse message's missing coordinates read (else the node's own values)."""
        if self.kind is AggregatorKind.MEAN:
            return aggregate(own, fragmentation, received, own_fragments=own_fragments, stand_in=stand_in), Counter()
        own = np.asarray(own, dtype=np.float32)
        out = np.array(own, copy=True)
        cut: Counter = Counter()
        for f, ix in enumerate(fragmentation.indices):
            senders = sorted(s for s, frags in received.items() if f in frags)
            if not senders:
                continue
            mine = own[ix] if own_fragments is None else np.asarray(own_fragments[f])
            fill = mine if stand_in is None else stand_in[ix]  # what a sparse message's missing coordinates read
            parts = [densify(received[s][f], fill) for s in senders]
            if self.kind is AggregatorKind.CLIPPED:
                out[ix], n = clipped_fragment(mine, parts, self.clip_radius)
                cut["clipped"] += n
            else:
                out[ix], n = trimmed_fragment(mine, parts, self.trim)
                cut["trimmed"] += n
        return out, +cut


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

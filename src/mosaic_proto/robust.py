"""The run's aggregation rule: what a node does with the fragments it received when some senders may lie.

`Aggregator` is the run's `aggregator`, `trim` and `clip_radius` settings (identical on every node, so
`simulate` == `cluster`), checked, and the rule they name from the registry in `rules/` (one file per rule:
`mean`, `trimmed-mean`, `clipped`). A name no rule is registered as is refused, never read as another rule.
Each rule counts what it cut (`Aggregator.aggregate`'s Counter): received fragments clipped, and received
fragments trimmed in nearly all of their coordinates (`rules.TRIMMED_SHARE`).

With --compress topk a received fragment carries some coordinates only: the robust rules read the receiver's own
value in the others, or with error feedback the newest value it heard of them (`compression.densify`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .fragmentation import Fragmentation
from .rules import AggregationRule, rule_named


@dataclass(frozen=True)
class Aggregator:
    """One node's rule for fragment-wise aggregation (the run's `aggregator`, `trim`, `clip_radius`)."""

    kind: str = "mean"
    trim: float = 1.0
    clip_radius: float = 0.1
    rule: AggregationRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cls = rule_named(self.kind)  # an unknown name: ValueError, before anything runs
        object.__setattr__(self, "kind", cls.name)
        if not (0 < self.trim < 0.5 or (self.trim >= 1 and float(self.trim).is_integer())):
            raise ValueError(f"trim must be a whole number >= 1 or a fraction in (0, 0.5), got {self.trim}")
        if not (self.clip_radius > 0 and math.isfinite(self.clip_radius)):
            raise ValueError(f"clip_radius must be > 0, got {self.clip_radius}")
        object.__setattr__(self, "rule", cls.of(trim=self.trim, clip_radius=self.clip_radius))

    def aggregate(self, own: np.ndarray, fragmentation: Fragmentation,
                  received: Mapping[int, Mapping[int, np.ndarray]],
                  own_fragments: Sequence[np.ndarray] | None = None,
                  stand_in: np.ndarray | None = None) -> tuple[np.ndarray, Counter]:
        """The new vector and what the rule cut: {"clipped": n} or {"trimmed": n} (received fragments). `stand_in`:
        what a sparse message's missing coordinates read (else the node's own values)."""
        return self.rule.aggregate(own, fragmentation, received, own_fragments=own_fragments, stand_in=stand_in)

"""`mean`: the paper's count-based averaging (`aggregation.aggregate`), bit for bit: (own + sum R_k) / m."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..aggregation import aggregate
from ..fragmentation import Fragmentation
from .rule import AggregationRule


@dataclass(frozen=True)
class Mean(AggregationRule):
    name = "mean"
    help = "the paper's"
    batchable = True

    def aggregate(self, own: np.ndarray, fragmentation: Fragmentation,
                  received: Mapping[int, Mapping[int, np.ndarray]],
                  own_fragments: Sequence[np.ndarray] | None = None,
                  stand_in: np.ndarray | None = None) -> tuple[np.ndarray, Counter]:
        return aggregate(own, fragmentation, received, own_fragments=own_fragments, stand_in=stand_in), Counter()

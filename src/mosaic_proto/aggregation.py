"""Fragment-wise, count-based averaging (spec step 6)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .fragmentation import Fragmentation


def aggregate(own: np.ndarray, fragmentation: Fragmentation,
              received: Mapping[int, Mapping[int, np.ndarray]]) -> np.ndarray:
    """x[C==k] = (own[C==k] + sum of received k-values) / (1 + their count), for every fragment k.

    `received` maps sender -> fragment -> values. Sums run in ascending sender order in float64, so the
    result is the same bit for bit whatever order the messages arrived in. A fragment nobody sent keeps
    the node's own values.
    """
    out = np.array(own, dtype=np.float32, copy=True)
    for f, ix in enumerate(fragmentation.indices):
        senders = sorted(s for s, frags in received.items() if f in frags)
        if not senders:
            continue
        acc = own[ix].astype(np.float64)
        for s in senders:
            acc += received[s][f]
        acc /= 1 + len(senders)
        out[ix] = acc
    return out

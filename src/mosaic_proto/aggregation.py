"""Fragment-wise, count-based averaging (spec step 6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .compression import Compressed, sparse_average, stand_in_average
from .fragmentation import PACK_FROM, Fragmentation

# Coordinates summed at a time: the float64 accumulator (256 KiB) and the blocks it reads stay in the CPU's
# cache while every sender's values are added, instead of streaming a d-long float64 array once per sender.
BLOCK = 1 << 15
# Below this many coordinates per fragment (on average), numpy's per-call cost outweighs the work: the fragments'
# values are scattered into one accumulator in a single `np.add.at` instead (the paper's quadratic: d=16, K=16).
SCATTER_BELOW = 16


def aggregate(own: np.ndarray, fragmentation: Fragmentation,
              received: Mapping[int, Mapping[int, np.ndarray]], *, block: int = BLOCK,
              own_fragments: Sequence[np.ndarray] | None = None, stand_in: np.ndarray | None = None) -> np.ndarray:
    """x[C==k] = (own[C==k] + sum of received k-values) / (1 + their count), for every fragment k.

    `received` maps sender -> fragment -> values. Sums run in ascending sender order in float64, so the
    result is the same bit for bit whatever order the messages arrived in. A fragment nobody sent keeps
    the node's own values.

    Each coordinate goes through exactly the same float64 operations in the same order as the plain
    `acc = own.astype(float64); acc += r_1; ...; acc /= 1 + count` (so the bits are those of that
    reference), but block by block, and a fragment that is one contiguous range (K=1, the contiguous
    strategy) is read and written as a slice instead of gathered and scattered. `block`: coordinates per step
    (the result does not depend on it). `own_fragments`: `own`'s fragments as `fragmentation.views(own)` gave
    them (the node gathered them to send them), so that they are not gathered again. A model of fewer than
    `SCATTER_BELOW` coordinates per fragment goes through `scattered` instead (the same bits).

    Sparse messages (--compress topk) are averaged by `_sparse`: with `stand_in` (the newest values the node heard,
    `Compressor.stand_in`) read where a message is silent, else over the messages that carry each coordinate.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if own_fragments is not None and [len(v) for v in own_fragments] != list(fragmentation.sizes):
        raise ValueError("own_fragments must be own's K fragments, in fragment order")
    own = np.asarray(own)
    if any(isinstance(values, Compressed) for frags in received.values() for values in frags.values()):
        return _sparse(own, fragmentation, received, own_fragments, stand_in)
    if fragmentation.dim < SCATTER_BELOW * fragmentation.k:
        return scattered(own, fragmentation, received)
    parts_of: list[list[np.ndarray]] = [[] for _ in range(fragmentation.k)]
    for sender in sorted(received):  # one pass over what came, in ascending sender order
        for f, values in received[sender].items():
            parts_of[f].append(values)
    plan = list(enumerate(parts_of))
    if fragmentation.k > 1 and fragmentation.dim >= PACK_FROM and all(span is None for span in fragmentation.spans):
        return _packed(own, fragmentation, plan, own_fragments, block)  # random fragments, a large model
    if all(parts for _, parts in plan):
        out = np.empty(own.shape, dtype=np.float32)  # every coordinate is written below
    else:
        out = np.array(own, dtype=np.float32, copy=True)
    acc = np.empty(min(block, max(fragmentation.sizes, default=0)), dtype=np.float64)
    for f, parts in plan:
        if not parts:
            continue
        span = fragmentation.spans[f]
        if span is not None:
            mine, target = own[span[0]:span[1]], out[span[0]:span[1]]
        else:
            ix = fragmentation.indices[f]
            mine = own[ix] if own_fragments is None else own_fragments[f]
            target = np.empty(len(ix), dtype=np.float32)
        _average(mine, parts, target, acc, block)
        if span is None:
            out[ix] = target
    return out


def _average(mine: np.ndarray, parts: Sequence[np.ndarray], target: np.ndarray, acc: np.ndarray,
             block: int) -> None:
    """target = (mine + parts[0] + parts[1] + ...) / (1 + len(parts)), summed in float64 in that order, a block
    of coordinates at a time (`acc`: the float64 accumulator of at least a block)."""
    count = 1 + len(parts)
    for lo in range(0, len(mine), block):
        hi = min(lo + block, len(mine))
        buf = acc[:hi - lo]
        np.add(mine[lo:hi], parts[0][lo:hi], out=buf, dtype=np.float64)
        for values in parts[1:]:
            np.add(buf, values[lo:hi], out=buf)
        np.divide(buf, count, out=target[lo:hi], casting="same_kind")


def _packed(own: np.ndarray, fragmentation: Fragmentation, plan: list, own_fragments: Sequence[np.ndarray] | None,
            block: int) -> np.ndarray:
    """`aggregate` where no fragment is a contiguous range: each fragment's average (or the node's own values,
    where nobody sent it) written to its slice of one array laid out fragment after fragment, which
    `Fragmentation.unpack` puts back in coordinate order in one gather, instead of K scatters through the index
    arrays. The same float64 operations per coordinate, so the same bits."""
    starts = fragmentation.starts
    mine_all = fragmentation.packed(own) if own_fragments is None else None
    averaged = np.empty(fragmentation.dim, dtype=np.float32)
    acc = np.empty(min(block, max(fragmentation.sizes, default=0)), dtype=np.float64)
    for f, parts in plan:
        target = averaged[starts[f]:starts[f + 1]]
        mine = mine_all[starts[f]:starts[f + 1]] if own_fragments is None else own_fragments[f]
        if parts:
            _average(mine, parts, target, acc, block)
        else:
            target[...] = mine
    return fragmentation.unpack(averaged)


def scattered(own: np.ndarray, fragmentation: Fragmentation,
              received: Mapping[int, Mapping[int, np.ndarray]]) -> np.ndarray:
    """`aggregate`'s result, bit for bit, in a few numpy calls whatever K: every received value is added into one
    float64 copy of `own` by `np.add.at`, which adds in index order, here ascending sender order (a sender sends a
    coordinate at most once), so each coordinate sees the same float64 sums in the same order; then each is divided
    by 1 + its count and rounded to float32 once (a coordinate nobody sent is own / 1: unchanged)."""
    index, values = [], []
    for sender in sorted(received):
        for f, part in received[sender].items():
            index.append(fragmentation.indices[f])
            values.append(part)
    if not index:
        return np.array(own, dtype=np.float32, copy=True)
    at = np.concatenate(index)
    acc = own.astype(np.float64)
    np.add.at(acc, at, np.concatenate(values))
    return (acc / (np.bincount(at, minlength=fragmentation.dim) + 1.0)).astype(np.float32)


def _sparse(own: np.ndarray, fragmentation: Fragmentation,
            received: Mapping[int, Mapping[int, np.ndarray | Compressed]],
            own_fragments: Sequence[np.ndarray] | None, stand_in: np.ndarray | None = None) -> np.ndarray:
    """`aggregate` where messages carry some coordinates only (--compress topk), in ascending sender order: each
    fragment averaged over the node's own values and every message, `stand_in` read where one is silent
    (`stand_in_average`); without it each coordinate over the messages that carry it (`sparse_average`)."""
    out = np.array(own, dtype=np.float32, copy=True)
    for f, ix in enumerate(fragmentation.indices):
        parts = [received[s][f] for s in sorted(received) if f in received[s]]
        if parts:
            mine = own[ix] if own_fragments is None else own_fragments[f]
            out[ix] = sparse_average(mine, parts) if stand_in is None else stand_in_average(mine, parts, stand_in[ix])
    return out

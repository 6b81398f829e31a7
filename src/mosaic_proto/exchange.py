"""One round's gossip among in-memory nodes that all keep to the protocol, as arrays: `InMemoryNetwork`'s batched path.

When no node lies, none refuses by --max-norm and every one averages (the mean rule), each message is accepted as it
was sent, so a round follows from the plans alone: which fragments each node sends whom. `exchange_round` draws every
plan of the round at once (`PeerSampler.table`), averages what each node receives in a few numpy calls, with the same
float64 sums in the same ascending sender order as `aggregation.aggregate` (the same models, bit for bit), and counts
each node's report from the sizes `encode` would give its messages. The per-message path encodes, decodes and checks
every message in Python: at K=16 that is ~12x K=1's messages, and it made a round cost 5x K=1's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .fragmentation import Fragmentation
from .round import RoundReport
from .sampling import PeerSampler
from .wire import encoded_sizes

# Fragments of this many values or more on average are averaged fragment by fragment (`_per_node`: a few adds of
# whole fragments per rank of sender); smaller ones all at once through index arrays (`_scattered`), whose cost is
# per value; the threshold is where the two cross (bench/scale.py; bench/README.md, "Figures behind design choices").
SCATTER_BELOW_FRAGMENT = 96
SCATTER_CHUNK = 1 << 20  # values (own and received) in one bincount: bounds the index arrays' memory
# `_per_node` averages a band of a fragment's coordinates at a time, all nodes' float64 accumulators of the band
# within PER_NODE_BAND_BYTES, which stay in the CPU's cache while every rank is added; but a band is never narrower
# than PER_NODE_MIN_BAND coordinates, where numpy's cost per call would outweigh the cache's gain (1,000 nodes;
# bench/exchange.py; bench/README.md, "Figures behind design choices")
PER_NODE_BAND_BYTES = 1 << 20
PER_NODE_MIN_BAND = 1024
# ... and, within a band, a block of accumulators at a time (receivers, most-received first): every rank's adds, the
# division and the cast of PER_NODE_BLOCK_BYTES of them while they are in the cache, a block never fewer than
# PER_NODE_MIN_BLOCK receivers (a thousand nodes' bands are wider than the cache: bench/README.md, issue 59)
PER_NODE_BLOCK_BYTES = 1 << 18
PER_NODE_MIN_BLOCK = 16
# models of rows up to PER_NODE_STAGED_ROW_BYTES put their index-array fragments back at once, through a copy of
# the models: only models of up to PER_NODE_STAGED_BYTES (a simulation of 100,000 nodes keeps its memory)
PER_NODE_STAGED_ROW_BYTES = 1 << 17
PER_NODE_STAGED_BYTES = 1 << 27


def exchange_round(round: int, members: Sequence[int], trained: Mapping[int, np.ndarray],
                   fragmentation: Fragmentation, sampler: PeerSampler,
                   run_id: str) -> tuple[dict[int, np.ndarray], dict[int, RoundReport]]:
    """The models and reports after `round` of the nodes in `trained` (node -> its trained float32 model), among
    `members`: what their `RoundState`s give when each sends its plan's messages to the others in `trained` (a member
    not in it is absent: what it would be sent is unsent) and each finishes with the mean rule."""
    if not trained:
        return {}, {}
    present = np.array(sorted(trained), dtype=np.int64)
    models = np.stack([np.ascontiguousarray(trained[int(i)], dtype=np.float32) for i in present])
    k, count = fragmentation.k, len(present)
    table = sampler.table(round, present.tolist(), k, members)
    fanout = table.shape[2]
    sender = np.repeat(np.arange(count), k * fanout)  # one row per (sender, fragment, receiver), sender-major
    fragment = np.tile(np.repeat(np.arange(k), fanout), count)
    receiver_id = table.reshape(-1)
    at = np.minimum(np.searchsorted(present, receiver_id), count - 1)
    delivered = present[at] == receiver_id
    receiver = np.where(delivered, at, -1)

    base = int(receiver_id.max(initial=0)) + 1
    message, of_row = np.unique(sender * base + receiver_id, return_inverse=True)  # one per (sender, receiver)
    framing, items, heads = encoded_sizes(run_id, round, k, fragmentation.fingerprint, present.tolist(),
                                          fragmentation.sizes)
    size = framing[message // base] + heads[np.bincount(of_row, minlength=len(message))] + np.bincount(
        of_row, weights=items[fragment], minlength=len(message)).astype(np.int64)
    message_sender, message_receiver = np.zeros(len(message), dtype=np.int64), np.zeros(len(message), dtype=np.int64)
    message_sender[of_row], message_receiver[of_row] = sender, receiver
    raw = 4 * np.asarray(fragmentation.sizes, dtype=np.int64)[fragment]  # each row's float32 bytes
    reports = _reports(round, count, sender, receiver, message_sender, message_receiver, size, raw)

    rows = np.flatnonzero(delivered)
    if fragmentation.dim < SCATTER_BELOW_FRAGMENT * k:
        averaged = _scattered(models, fragmentation, sender[rows], receiver[rows], fragment[rows])
    else:
        averaged = _per_node(models, fragmentation, sender[rows], receiver[rows], fragment[rows])
    return ({int(node): averaged[p] for p, node in enumerate(present)},
            {int(node): reports[p] for p, node in enumerate(present)})


def _reports(round: int, count: int, sender: np.ndarray, receiver: np.ndarray, message_sender: np.ndarray,
             message_receiver: np.ndarray, size: np.ndarray, raw: np.ndarray) -> list[RoundReport]:
    """Each node's counts, as `RoundState` keeps them: what it sent to absent members is unsent, not sent."""
    sent, message_sent = receiver >= 0, message_receiver >= 0

    def per_node(at: np.ndarray, weights: np.ndarray | None = None) -> list[int]:
        return np.bincount(at, weights=weights, minlength=count).astype(np.int64).tolist()

    columns = zip(per_node(message_sender[message_sent]), per_node(sender[sent]),
                  per_node(message_sender[message_sent], size[message_sent]),
                  per_node(message_receiver[message_sent]), per_node(receiver[sent]),
                  per_node(message_receiver[message_sent], size[message_sent]), per_node(sender[~sent]),
                  per_node(sender[sent], raw[sent]), strict=True)
    return [RoundReport(round, messages_out=m_out, fragments_out=f_out, bytes_out=b_out, messages_in=m_in,
                        fragments_in=f_in, bytes_in=b_in, fragments_unsent=unsent, raw_bytes_out=raw_out)
            for m_out, f_out, b_out, m_in, f_in, b_in, unsent, raw_out in columns]


def _scattered(models: np.ndarray, fragmentation: Fragmentation, sender: np.ndarray, receiver: np.ndarray,
               fragment: np.ndarray) -> np.ndarray:
    """Every node's mean at once, receivers in groups of about `SCATTER_CHUNK` values: per group, one weighted
    `np.bincount` over the group's own models first, then every value they received, each receiver's rows in
    ascending sender order. bincount adds in input order into float64 from 0, so each coordinate sees
    own + r_1 + r_2 ... in `aggregate`'s order (0 + own is own): the same bits; then each is divided by its count
    (1 + the values received)."""
    count, dim = models.shape
    sizes = np.asarray(fragmentation.sizes, dtype=np.int64)
    order = fragmentation.order
    starts = np.asarray(fragmentation.starts[:-1], dtype=np.int64)
    by_receiver = np.argsort(receiver, kind="stable")  # a receiver's rows stay in ascending sender order
    sender, receiver, fragment = sender[by_receiver], receiver[by_receiver], fragment[by_receiver]
    row_end = np.searchsorted(receiver, np.arange(count), side="right")  # rows of receivers < r + 1
    cum = np.cumsum(np.bincount(receiver, weights=sizes[fragment], minlength=count) + dim)
    out = np.empty_like(models)
    lo = 0
    while lo < count:
        hi = min(count, max(lo + 1, int(np.searchsorted(cum, (cum[lo - 1] if lo else 0) + SCATTER_CHUNK,
                                                        side="right"))))
        a, b = (int(row_end[lo - 1]) if lo else 0), int(row_end[hi - 1])
        lengths = sizes[fragment[a:b]]
        first = np.cumsum(lengths) - lengths  # where each row's values start among the group's
        coordinate = order[np.repeat(starts[fragment[a:b]] - first, lengths) + np.arange(int(lengths.sum()))]
        target = np.concatenate([np.arange((hi - lo) * dim), np.repeat(receiver[a:b] - lo, lengths) * dim
                                 + coordinate])
        values = np.concatenate([models[lo:hi].reshape(-1), models[np.repeat(sender[a:b], lengths), coordinate]])
        sums = np.bincount(target, weights=values, minlength=(hi - lo) * dim)
        out[lo:hi] = (sums / np.bincount(target, minlength=(hi - lo) * dim)).astype(np.float32).reshape(hi - lo, dim)
        lo = hi
    return out


def _per_node(models: np.ndarray, fragmentation: Fragmentation, sender: np.ndarray, receiver: np.ndarray,
              fragment: np.ndarray) -> np.ndarray:
    """Every node's mean, fragment by fragment, in `aggregate`'s float64 order without a call per node: the rows of
    each (receiver, fragment) ranked by ascending sender, then for rank 0, 1, ... one vectorised add of every
    receiver's rank-th values into its float64 accumulator (own + r_1 + r_2 ...: the same bits), divided by its count.
    The accumulators are kept most-received first, so the receivers of rank r are the first ones: each add is one
    contiguous slice, not a gather and scatter. A wide fragment is averaged a band of its coordinates at a time
    (`PER_NODE_BAND_BYTES`), as `aggregate` does a block at a time, so that the accumulators stay in the cache: at
    8 nodes of 11M values, K=1, a round's averaging went from 0.77 to 0.21 s. Each band's coordinates are copied
    out as one contiguous array, so that every gather copies whole rows; one that is a contiguous range
    (`Fragmentation.spans`: K=1, the contiguous strategy) is read and written as a slice of the models. Within a
    band the accumulators go a block of receivers at a time (`PER_NODE_BLOCK_BYTES`), each block's adds, division
    and cast while it stays in the cache. Rows are gathered with `np.take` into one reused buffer, and each mean is
    cast to float32 before it is put back in node order: in short rows of models that are not too large
    (`PER_NODE_STAGED_ROW_BYTES`), fragments of index arrays as blocks of columns in fragment order, then all
    coordinates at once, one gather."""
    count = len(models)
    key = np.unique((receiver * fragmentation.k + fragment) * count + sender)  # sorted: receiver, fragment, sender
    pair, sender = np.divmod(key, count)
    receiver, fragment = np.divmod(pair, fragmentation.k)
    result = np.empty_like(models)
    # fragments of index arrays in models of short rows: each mean written as a block of columns in fragment order,
    # then one gather puts every coordinate in its place (a scatter of columns per fragment cost more; in long rows,
    # which leave the cache, the gather costs more)
    staged = None in fragmentation.spans and models.shape[1] * models.itemsize <= PER_NODE_STAGED_ROW_BYTES \
        and models.nbytes <= PER_NODE_STAGED_BYTES
    band = max(PER_NODE_MIN_BAND, PER_NODE_BAND_BYTES // (8 * count))
    width = min(band, max(fragmentation.sizes))
    block = max(PER_NODE_MIN_BLOCK, PER_NODE_BLOCK_BYTES // (8 * width))
    gathered_buffer = np.empty(count * width, dtype=models.dtype)  # each rank's received rows, then the band's mean
    acc_buffer = np.empty(count * width, dtype=np.float64)
    for f, span in enumerate(fragmentation.spans):
        mine = fragment == f
        to, frm = receiver[mine], sender[mine]
        rank = np.arange(len(to)) - np.searchsorted(to, to)  # rows of one receiver are adjacent
        degree = np.bincount(to, minlength=count)
        by_degree = np.argsort(-degree, kind="stable")  # accumulator a holds receiver by_degree[a]
        position = np.empty(count, dtype=np.int64)
        position[by_degree] = np.arange(count)
        received = frm[np.argsort(rank * count + position[to])]  # senders by rank, then accumulator
        per_rank = np.bincount(rank).tolist()  # the m receivers of rank r are accumulators 0..m-1
        divisor = (1 + degree[by_degree])[:, None]
        size = fragmentation.sizes[f]
        for lo in range(0, size, band):
            hi = min(size, lo + band)
            if span is not None:
                ix: slice | np.ndarray = slice(span[0] + lo, span[0] + hi)
                part = models[:, ix]
            else:
                ix = fragmentation.indices[f][lo:hi]
                part = np.take(models, ix, axis=1)
            gathered = gathered_buffer[:part.size].reshape(part.shape)
            acc = acc_buffer[:part.size].reshape(part.shape)
            rowwise = part.flags.c_contiguous  # np.take copies a strided one (a band of a range) whole, every call
            if rowwise:
                for a in range(0, count, block):  # a block of accumulators at a time: it stays in the cache
                    b = min(count, a + block)
                    np.take(part, by_degree[a:b], axis=0, out=gathered[a:b])
                    acc[a:b] = gathered[a:b]
                    row = 0
                    for m in per_rank:  # m does not grow with the rank: the block's receivers of this rank
                        if m <= a:
                            break
                        end = min(m, b)
                        np.take(part, received[row + a:row + end], axis=0, out=gathered[a:end])
                        np.add(acc[a:end], gathered[a:end], out=acc[a:end])
                        row += m
                    acc[a:b] /= divisor[a:b]
                    gathered[a:b] = acc[a:b]  # the block's mean, cast first: half the bytes to move
            else:
                acc[...] = part[by_degree]
                row = 0
                for m in per_rank:
                    acc[:m] += part[received[row:row + m]]
                    row += m
                acc /= divisor
                gathered[...] = acc
            mean = gathered
            if staged:
                at = fragmentation.starts[f]  # the fragment's place in `order`
                result[:, at + lo:at + hi] = np.take(mean, position, axis=0)
            elif span is not None and rowwise:  # whole rows (K=1 in one band): written in place, no copy between
                np.take(mean, position, axis=0, out=result[:, ix])
            else:
                result[:, ix] = np.take(mean, position, axis=0)
    if staged:  # laid out as `order`: back in coordinate order by its inverse
        return result[:, fragmentation.positions]
    return result

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

from .aggregation import aggregate
from .fragmentation import Fragmentation
from .round import RoundReport
from .sampling import PeerSampler
from .wire import encoded_sizes

# Above this many received values in a round (all nodes together), each node aggregates on its own (`aggregate`:
# slices, blocks) instead of all at once through index arrays, which cost ~20 ns a value (measured: d=16 and K=16,
# n=50: 2.6 ms a round at once, 9.4 one by one; d=14890, K=4, n=16, 953k values: 21.8 against 3.9).
SCATTER_MAX_VALUES = 1 << 17


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
    sizes = np.asarray(fragmentation.sizes, dtype=np.int64)
    if int(sizes[fragment[rows]].sum()) <= SCATTER_MAX_VALUES:
        averaged = _scattered(models, fragmentation, sender[rows], receiver[rows], fragment[rows])
    else:
        averaged = _per_node(models, fragmentation, sender[rows], receiver[rows], fragment[rows], present)
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
    """Every node's mean at once: each received value added into a float64 copy of all models by `np.add.at`, in
    the rows' order (ascending sender: each coordinate's sum is `aggregate`'s), then divided by 1 + its count."""
    count, dim = models.shape
    sizes = np.asarray(fragmentation.sizes, dtype=np.int64)
    order = np.concatenate(fragmentation.indices)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    lengths = sizes[fragment]
    first = np.cumsum(lengths) - lengths  # where each row's values start among all of them
    coordinate = order[np.repeat(starts[fragment] - first, lengths) + np.arange(int(lengths.sum()))]
    target = np.repeat(receiver, lengths) * dim + coordinate
    acc = models.astype(np.float64).reshape(-1)
    np.add.at(acc, target, models[np.repeat(sender, lengths), coordinate].astype(np.float64))  # 25x float32 ones
    return (acc / (np.bincount(target, minlength=count * dim) + 1.0)).astype(np.float32).reshape(count, dim)


def _per_node(models: np.ndarray, fragmentation: Fragmentation, sender: np.ndarray, receiver: np.ndarray,
              fragment: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Each node's mean by `aggregate`, from views of the senders' fragments (a large model: no index arrays)."""
    views = [fragmentation.views(model) for model in models]
    received: list[dict[int, dict[int, np.ndarray]]] = [{} for _ in models]
    for s, r, f in zip(sender.tolist(), receiver.tolist(), fragment.tolist(), strict=True):
        received[r].setdefault(int(present[s]), {})[f] = views[s][f]
    return np.stack([aggregate(model, fragmentation, got, own_fragments=own)
                     for model, got, own in zip(models, received, views, strict=True)])

"""How a data set is split across n nodes (numpy only, deterministic in the run seed).

`partition(groups, n, kind, seed, ...)` returns n sorted int64 index arrays; node `rank` trains on
`result[rank]`. `groups` holds one entry per training sample: its label (iid, dirichlet, shards) or its
client id (natural: a LEAF speaking role, a MovieLens user).

Every random draw comes from `keyed_rng(seed, Purpose.DATA, round=attempt, fragment=stream)` where
`stream` is a `DataStream` value, so the partition of a run is the same on every host and in every process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import IntEnum

import numpy as np

from mosaic_proto import Purpose, keyed_rng
from mosaicd.settings import Partition

__all__ = ["DataStream", "PartitionError", "data_rng", "partition", "supported_message"]


class DataStream(IntEnum):
    """Sub-streams of Purpose.DATA (passed as the `fragment` key part)."""

    IID = 1
    DIRICHLET = 2
    SHARDS = 3
    NATURAL = 4
    DIGITS_SPLIT = 10
    MOVIELENS_SPLIT = 11


class PartitionError(ValueError):
    """An impossible partition request, worded for the person who typed the flags."""


def data_rng(seed: int, stream: DataStream, attempt: int = 0) -> np.random.Generator:
    return keyed_rng(seed, Purpose.DATA, round=attempt, fragment=int(stream))


def supported_message(task: str, kind: str, supported: Sequence[str]) -> str:
    return (f"--partition {kind}: task {task} supports --partition "
            f"{', '.join(str(s) for s in supported)}")


def _by_node(node_of: np.ndarray, n: int) -> list[np.ndarray]:
    """Sorted sample indices of each node, from the node of every sample."""
    order = np.argsort(node_of, kind="stable").astype(np.int64)
    counts = np.bincount(node_of, minlength=n)
    return [part for part in np.split(order, np.cumsum(counts)[:-1])]


def partition(groups: Sequence | np.ndarray, n: int, kind: Partition | str, seed: int, *, alpha: float = 1.0,
              shards_per_node: int = 2, min_samples: int = 1, max_attempts: int = 100) -> list[np.ndarray]:
    """Split samples 0..len(groups)-1 across n nodes; see the module docstring for `groups`.

    - iid: a seeded permutation cut into n near-equal parts (sizes differ by at most one).
    - dirichlet: for every label, its samples are shuffled and cut by proportions drawn from
      Dirichlet(alpha, ..., alpha) over the nodes (small alpha: each node sees few labels). A draw that
      leaves a node with fewer than `min_samples` is redrawn (up to `max_attempts` keyed attempts); if
      none succeeds, the largest nodes hand their highest-index samples to the short ones.
    - shards: samples sorted by label (stable), cut into n * shards_per_node near-equal shards, dealt
      out by a seeded permutation, shards_per_node shards per node.
    - natural: the distinct clients are shuffled with the seed and dealt round-robin to the nodes.
    """
    kind = Partition(kind)
    groups = np.asarray(groups)
    if groups.ndim != 1:
        raise PartitionError(f"partition needs one label or client id per sample, got shape {groups.shape}")
    total = len(groups)
    if n < 1:
        raise PartitionError(f"partition needs at least one node, got {n}")
    if kind is Partition.IID:
        if total < n:
            raise PartitionError(f"--partition iid: {total} samples cannot give each of {n} nodes one")
        perm = data_rng(seed, DataStream.IID).permutation(total)
        return [np.sort(part).astype(np.int64) for part in np.array_split(perm, n)]
    if kind is Partition.DIRICHLET:
        return _dirichlet(groups, n, seed, alpha, min_samples, max_attempts)
    if kind is Partition.SHARDS:
        return _shards(groups, n, seed, shards_per_node)
    return _natural(groups, n, seed)


def _dirichlet(labels: np.ndarray, n: int, seed: int, alpha: float, min_samples: int,
               max_attempts: int) -> list[np.ndarray]:
    total = len(labels)
    if not alpha > 0:
        raise PartitionError(f"--alpha must be > 0, got {alpha}")
    if total < n * min_samples:
        raise PartitionError(f"--partition dirichlet: {total} samples cannot give each of {n} nodes "
                             f"--min-samples {min_samples}")
    classes, inverse = np.unique(labels, return_inverse=True)
    members = _by_node(inverse.reshape(-1), len(classes))  # sample indices of every class
    attempts = max(1, max_attempts)
    for attempt in range(attempts):  # a draw's sizes only: most draws of many small nodes are redrawn
        sizes = sum((np.diff(bounds, prepend=0) for _, bounds in _dirichlet_draw(members, n, seed, alpha, attempt)),
                    np.zeros(n, dtype=np.int64))
        if sizes.min() >= min_samples:
            break
    node_of = np.zeros(total, dtype=np.int64)
    for idx, bounds in _dirichlet_draw(members, n, seed, alpha, attempt):  # the kept draw again, placed this time
        # node of position j: the number of cumulative bounds <= j
        node_of[idx] = np.searchsorted(bounds, np.arange(len(idx)), side="right")
    if sizes.min() < min_samples:
        _rebalance(node_of, n, min_samples)
    return _by_node(node_of, n)


def _dirichlet_draw(members: list[np.ndarray], n: int, seed: int, alpha: float,
                    attempt: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Attempt `attempt`'s draw, class by class: the class's samples shuffled, and the cumulative bounds of each
    node's share of them (Dirichlet(alpha) proportions)."""
    rng = data_rng(seed, DataStream.DIRICHLET, attempt)
    for idx in members:
        idx = rng.permutation(idx)
        p = rng.dirichlet(np.full(n, float(alpha)))
        p = np.nan_to_num(p, nan=0.0)
        if p.sum() <= 0:  # tiny alpha can underflow every component: give the class to one node
            p = np.eye(n)[rng.integers(n)]
        bounds = np.floor(np.cumsum(p) / p.sum() * len(idx)).astype(np.int64)
        bounds[-1] = len(idx)
        yield idx, bounds


def _rebalance(node_of: np.ndarray, n: int, min_samples: int) -> None:
    """Move samples from the largest nodes to the short ones until all have min_samples (in place)."""
    sizes = np.bincount(node_of, minlength=n)
    for short in np.flatnonzero(sizes < min_samples):
        while sizes[short] < min_samples:
            donor = int(np.argmax(sizes))  # lowest index among the largest
            take = int(min(min_samples - sizes[short], sizes[donor] - min_samples))
            mine = np.flatnonzero(node_of == donor)[-take:]
            node_of[mine] = short
            sizes[donor] -= take
            sizes[short] += take


def _shards(labels: np.ndarray, n: int, seed: int, per_node: int) -> list[np.ndarray]:
    count = n * per_node
    if per_node < 1:
        raise PartitionError(f"--shards-per-node must be >= 1, got {per_node}")
    if count > len(labels):
        raise PartitionError(f"--partition shards: {len(labels)} samples cannot be cut into {n} nodes x "
                             f"--shards-per-node {per_node} = {count} shards")
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, count)
    perm = data_rng(seed, DataStream.SHARDS).permutation(count)
    return [np.sort(np.concatenate([shards[s] for s in perm[i * per_node:(i + 1) * per_node]])).astype(np.int64)
            for i in range(n)]


def _natural(clients: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    ids, inverse = np.unique(clients, return_inverse=True)
    if len(ids) < n:
        raise PartitionError(f"--partition natural: the data has {len(ids)} clients, fewer than --nodes {n}; "
                             f"use at most {len(ids)} nodes or another partition")
    perm = data_rng(seed, DataStream.NATURAL).permutation(len(ids))
    node_of_client = np.empty(len(ids), dtype=np.int64)
    node_of_client[perm] = np.arange(len(ids)) % n
    return _by_node(node_of_client[inverse.reshape(-1)], n)

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaicd.learning.partition import PartitionError, partition
from mosaicd.settings import Partition

FAST = settings(max_examples=40, deadline=None)


def _check_cover(parts: list[np.ndarray], total: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == total
    assert np.array_equal(np.sort(joined), np.arange(total))
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)


@st.composite
def labelled(draw, min_total: int = 1):
    n = draw(st.integers(1, 12))
    classes = draw(st.integers(1, 10))
    total = draw(st.integers(max(n, min_total), 400))
    labels = np.asarray(draw(st.lists(st.integers(0, classes - 1), min_size=total, max_size=total)))
    return labels, n, draw(st.integers(0, 2**32))


@FAST
@given(labelled())
def test_iid_covers_and_balances(case):
    labels, n, seed = case
    parts = partition(labels, n, "iid", seed)
    assert len(parts) == n
    _check_cover(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = partition(labels, n, Partition.IID, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@FAST
@given(labelled(), st.integers(1, 4))
def test_shards_cover_and_are_deterministic(case, per_node):
    labels, n, seed = case
    if n * per_node > len(labels):
        with pytest.raises(PartitionError, match="shards"):
            partition(labels, n, "shards", seed, shards_per_node=per_node)
        return
    parts = partition(labels, n, "shards", seed, shards_per_node=per_node)
    _check_cover(parts, len(labels))
    assert all(len(p) > 0 for p in parts)
    again = partition(labels, n, "shards", seed, shards_per_node=per_node)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@FAST
@given(st.integers(1, 10), st.integers(0, 40), st.integers(0, 2**32), st.data())
def test_natural_deals_whole_clients(n, extra, seed, data):
    clients_count = n + extra
    total = data.draw(st.integers(clients_count, 300))
    clients = np.concatenate([np.arange(clients_count),
                              data.draw(st.lists(st.integers(0, clients_count - 1), min_size=total - clients_count,
                                                 max_size=total - clients_count))]).astype(np.int64)
    clients = np.random.default_rng(seed).permutation(clients) * 7 + 3  # arbitrary ids
    parts = partition(clients, n, "natural", seed)
    _check_cover(parts, total)
    owner = {}
    for node, p in enumerate(parts):
        assert len(p) > 0
        for c in np.unique(clients[p]):
            assert owner.setdefault(int(c), node) == node  # a client lives on exactly one node
    counts = np.bincount([owner[int(c)] for c in np.unique(clients)], minlength=n)
    assert counts.max() - counts.min() <= 1  # round-robin


def test_natural_with_string_clients_and_too_few_clients():
    users = np.array(["ROMEO", "JULIET", "ROMEO", "NURSE", "JULIET"])
    parts = partition(users, 3, "natural", 1)
    assert sorted(len(p) for p in parts) == [1, 2, 2]
    with pytest.raises(PartitionError, match="3 clients, fewer than --nodes 4"):
        partition(users, 4, "natural", 1)


@FAST
@given(labelled(min_total=10), st.floats(0.01, 10.0), st.integers(1, 6))
def test_dirichlet_covers_and_honours_min_samples(case, alpha, min_samples):
    labels, n, seed = case
    if len(labels) < n * min_samples:
        with pytest.raises(PartitionError, match="min-samples"):
            partition(labels, n, "dirichlet", seed, alpha=alpha, min_samples=min_samples)
        return
    parts = partition(labels, n, "dirichlet", seed, alpha=alpha, min_samples=min_samples)
    _check_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= min_samples
    again = partition(labels, n, "dirichlet", seed, alpha=alpha, min_samples=min_samples)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_dirichlet_rebalances_when_redraws_fail():
    labels = np.repeat(np.arange(2), 50)
    parts = partition(labels, 10, "dirichlet", 3, alpha=0.001, min_samples=10, max_attempts=1)
    _check_cover(parts, 100)
    assert [len(p) for p in parts] == [10] * 10


@pytest.mark.parametrize(("alpha", "min_samples", "digest"), [
    (0.3, 1, "3bdef1c00056ce16"),  # the first draw kept
    (0.3, 8, "c3175fcefc9b3fcd"),  # redrawn ten times, the eleventh kept
    (0.01, 30, "2c18d7d6eb71de66"),  # every draw short: the last one rebalanced
])
def test_dirichlet_partition_is_the_seed_s_own(alpha: float, min_samples: int, digest: str) -> None:
    """The same seed gives the same nodes' samples from one version to the next (the models depend on it): these
    digests are the partitions as drawn before redraws stopped placing the samples of the draws they reject."""
    labels = np.random.default_rng(0).integers(0, 10, 3200)
    parts = partition(labels, 100, "dirichlet", 7, alpha=alpha, min_samples=min_samples, max_attempts=20)
    got = hashlib.sha256(b"".join(p.astype("<i8").tobytes() + b"|" for p in parts)).hexdigest()[:16]
    assert got == digest


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not():
    labels = np.repeat(np.arange(10), 500)

    def top2_share(alpha: float) -> float:
        parts = partition(labels, 20, "dirichlet", 7, alpha=alpha, min_samples=8)
        shares = [np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts]
        return float(np.median(shares))

    assert top2_share(0.1) > 0.8  # most nodes are dominated by at most two labels
    assert top2_share(100.0) < 0.35  # close to 2/10 for near-uniform mixes


def test_seed_changes_the_partition():
    labels = np.repeat(np.arange(10), 30)
    for kind in ("iid", "dirichlet", "shards"):
        a = partition(labels, 5, kind, 1)
        b = partition(labels, 5, kind, 2)
        assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True)), kind


def test_impossible_requests_are_explained():
    with pytest.raises(PartitionError, match="iid: 3 samples"):
        partition(np.zeros(3), 4, "iid", 0)
    with pytest.raises(PartitionError, match="one label or client id per sample"):
        partition(np.zeros((3, 2)), 2, "iid", 0)
    with pytest.raises(ValueError):
        partition(np.zeros(3), 2, "nonsense", 0)

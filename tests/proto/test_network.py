"""InMemoryNetwork: whole gossip rounds of n RoundStates exchanging real bytes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import (
    Fragmentation,
    InMemoryNetwork,
    Layout,
    PeerSampler,
    Quadratic,
    aggregate,
    consensus_distance,
    consensus_error,
)

SETTINGS = settings(max_examples=12, deadline=None)
KINDS = ["local", "oracle", "static"]


def initial(n: int, d: int, seed: int, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(d) * scale).astype(np.float32) for _ in range(n)]


def network(vectors: list[np.ndarray], k: int, kind: str, s: int, seed: int = 0, train=None) -> InMemoryNetwork:
    fr = Fragmentation.build(Layout.flat(len(vectors[0])), k, seed)
    return InMemoryNetwork(vectors, fr, PeerSampler(kind, s, seed), train)


@SETTINGS
@given(st.sampled_from(KINDS), st.sampled_from([1, 4, 16]), st.integers(3, 12), st.integers(0, 2**32),
       st.integers(-20, 20))
def test_identical_models_are_a_fixed_point(kind: str, k: int, n: int, seed: int, exponent: int) -> None:
    v = initial(1, 40, seed, scale=2.0**exponent)[0]
    net = network([v.copy() for _ in range(n)], k, kind, s=min(3, n - 1), seed=seed)
    net.run(3)
    for x in net.vectors:
        assert np.array_equal(x.view(np.uint32), v.view(np.uint32))
    assert consensus_error(net.matrix()) == 0.0


@SETTINGS
@given(st.sampled_from(["oracle", "static"]), st.sampled_from([1, 2, 4, 8]), st.integers(4, 16), st.data())
def test_oracle_and_static_preserve_the_network_mean(kind: str, k: int, n: int, data: st.DataObject) -> None:
    s = data.draw(st.integers(1, min(4, n - 1)))
    seed = data.draw(st.integers(0, 2**32))
    net = network(initial(n, 32, seed), k, kind, s, seed)
    mean0 = net.matrix().astype(np.float64).mean(axis=0)
    err0 = consensus_error(net.matrix())
    for record in net.run(4):
        for report in record.reports:
            assert report.fragments_in == s * k  # every fragment from exactly s senders
            assert report.fragments_out == s * k and not report.refused
    np.testing.assert_allclose(net.matrix().astype(np.float64).mean(axis=0), mean0, rtol=0, atol=1e-5)
    assert consensus_error(net.matrix()) < err0


@pytest.mark.parametrize("kind", ["oracle", "static"])
@pytest.mark.parametrize("k", [1, 4])
def test_every_node_gets_each_fragment_from_exactly_s_senders(kind: str, k: int) -> None:
    n, s = 10, 3
    sampler = PeerSampler(kind, s, seed=5)
    members = list(range(n))
    for t in range(5):
        senders = Counter((peer, f) for node in members
                          for peer, frags in sampler.plan(t, node, k, members).items() for f in frags)
        assert senders == {(node, f): s for node in members for f in range(k)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_round_is_the_spec_computed_without_the_wire(kind: str) -> None:
    """The bytes on the wire change nothing: one step equals plan + aggregate computed directly."""
    n, d, k, s = 9, 50, 4, 2
    vectors = initial(n, d, 3)
    net = network([v.copy() for v in vectors], k, kind, s, seed=3)
    members = list(range(n))
    received: dict[int, dict[int, dict[int, np.ndarray]]] = {i: {} for i in members}
    for node in members:
        for peer, frags in net.sampler.plan(0, node, k, members).items():
            received[peer][node] = {f: net.fragmentation.take(vectors[node], f) for f in frags}
    expected = [aggregate(vectors[i], net.fragmentation, received[i]) for i in members]
    net.step()
    for got, want in zip(net.vectors, expected, strict=True):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
def test_reports_balance_over_the_network(kind: str) -> None:
    n, d, k, s = 12, 64, 8, 3
    net = network(initial(n, d, 1), k, kind, s, seed=1)
    for record in net.run(3):
        reports = record.reports
        assert sum(r.fragments_in for r in reports) == sum(r.fragments_out for r in reports) == n * s * k
        assert sum(r.messages_in for r in reports) == sum(r.messages_out for r in reports)
        assert sum(r.bytes_in for r in reports) == sum(r.bytes_out for r in reports)
        assert all(r.bytes_out > 4 * s * d for r in reports)


def test_runs_are_reproducible_bit_for_bit() -> None:
    def run() -> np.ndarray:
        task = Quadratic.build(15, 16, "correlated", seed=4, heterogeneous=True)
        net = network([task.initial(i) for i in range(15)], 4, "local", 2, seed=4, train=task.train)
        records = net.run(6)
        assert all(np.isfinite(r.losses).all() for r in records)
        return net.matrix()

    assert np.array_equal(run().view(np.uint32), run().view(np.uint32))


def test_a_diagonal_curvature_is_kept_as_its_diagonal_and_trains_as_the_matrix_does() -> None:
    """d floats, not d^2 (a large --dim trains), and the same vectors and losses as the d x d matrix, bit for bit."""
    diagonal = Quadratic.build(6, 40, "diagonal", seed=3, heterogeneous=True, local_steps=3)
    matrix = Quadratic(np.diag(diagonal.a), diagonal.targets, diagonal.seed, diagonal.lr, diagonal.local_steps)
    assert diagonal.a.shape == (40,) and diagonal.dim == matrix.dim == 40
    x = y = diagonal.initial(2)
    for t in range(10):
        (x, loss_x), (y, loss_y) = diagonal.train(2, t, x), matrix.train(2, t, y)
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)) and loss_x == loss_y
    assert Quadratic.build(2, 1_000_000, "diagonal", seed=0).a.nbytes == 8_000_000


@pytest.mark.parametrize("k", [1, 4])
def test_local_gossip_drives_consensus(k: int) -> None:
    n, d = 20, 16
    task = Quadratic.build(n, d, "correlated", seed=2)
    net = network([task.initial(i) for i in range(n)], k, "local", 2, seed=2, train=task.train)
    err0 = consensus_error(net.matrix())
    net.run(20)
    assert consensus_error(net.matrix()) < 0.01 * err0


def test_consensus_metrics() -> None:
    x = np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0], [1.0, -3.0]])  # mean (1, 0)
    assert consensus_error(x) == pytest.approx(1 + 1 + 9 + 9)
    assert consensus_distance(x) == pytest.approx((1 + 1 + 3 + 3) / 4)
    assert consensus_error(np.ones((5, 3))) == 0.0


@pytest.mark.parametrize(("n", "d"), [(1, 5), (3, 1), (8, 1000), (5, 70_001)])
def test_consensus_distance_row_by_row_is_the_stacked_formula_to_the_bit(n: int, d: int) -> None:
    """Row by row (two float64 rows held, not n), the same value as over the float64 stack at once."""
    rows = [np.random.default_rng([n, d, i]).standard_normal(d).astype(np.float32) * 10 ** (i % 3) for i in range(n)]
    v = np.asarray(np.stack(rows), dtype=np.float64)
    stacked = float(np.linalg.norm(v - v.mean(axis=0), axis=1).mean())
    assert consensus_distance(rows) == stacked
    assert consensus_distance(np.stack(rows)) == stacked

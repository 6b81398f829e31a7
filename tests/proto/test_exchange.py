"""`InMemoryNetwork`'s batched rounds (`exchange.exchange_round`) against its per-message rounds: the same models,
reports, losses and barrier decisions; and the parts that make it: the plans' table and the messages' sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import (
    Aggregator,
    Attack,
    BarrierState,
    Fragmentation,
    FragmentBatch,
    InMemoryNetwork,
    Layout,
    PeerSampler,
    Quadratic,
    encode,
    keyed_choice,
)
from mosaic_proto.keyed_choice import keyed_choices, keyed_table, matches_scalar
from mosaic_proto.rng import Purpose, key_parts, keyed_raws, keyed_rng
from mosaic_proto.wire import encoded_sizes


def network(messages: bool, n: int, d: int, k: int, kind: str, fanout: int, strategy: str = "random", *,
            barrier: bool = False, **options: object) -> InMemoryNetwork:
    task = Quadratic.build(n, d, "diagonal", 5, lr=0.05, local_steps=1)
    state = BarrierState(rounds=6, round_deadline=1.0, drop_after=2, expected=n) if barrier else None
    return InMemoryNetwork([task.initial(i) for i in range(n)], Fragmentation.build(Layout.flat(d), k, 1, strategy),
                           PeerSampler(kind, fanout, 9), task.train, run_id="exchange", barrier=state,
                           messages=messages, **options)


def rounds(net: InMemoryNetwork, absent: list[tuple[int, ...]]) -> list:
    out = []
    for gone in absent:
        record = net.step(gone)
        out.append((record.nodes, record.losses, [r.to_json() for r in record.reports],
                    None if record.release is None else record.release.members))
    return out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 14), d=st.integers(1, 60), k=st.integers(1, 20), kind=st.sampled_from(["local", "oracle",
       "static"]), strategy=st.sampled_from(["random", "contiguous"]), data=st.data())
def test_batched_rounds_are_the_message_rounds(n: int, d: int, k: int, kind: str, strategy: str, data) -> None:
    k = min(k, d)
    fanout = data.draw(st.integers(1, n - 1))
    absent = data.draw(st.lists(st.sets(st.integers(0, n - 1), max_size=n).map(tuple), min_size=1, max_size=4))
    batched, messages = (network(m, n, d, k, kind, fanout, strategy) for m in (False, True))
    assert batched.batched and not messages.batched
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


def test_batched_rounds_follow_the_barrier_when_a_node_is_gone() -> None:
    """Node 2 misses rounds 1-3: it straggles, is dropped, and the plans of later rounds leave it out, alike."""
    absent = [(), (2,), (2,), (2,), (), ()]
    batched, messages = (network(m, 8, 24, 4, "local", 3, barrier=True) for m in (False, True))
    ours, theirs = rounds(batched, absent), rounds(messages, absent)
    assert ours == theirs
    assert 2 not in ours[-1][3]  # dropped: the members left it out
    assert batched.finish() == messages.finish()
    assert np.array_equal(batched.matrix(), messages.matrix())


def test_a_large_model_is_averaged_node_by_node_with_the_same_bits() -> None:
    """Fragments of SCATTER_BELOW_FRAGMENT values or more: each node aggregates on its own (`aggregate`, in blocks)."""
    absent = [(), (1,), ()]
    batched, messages = (network(m, 5, 1 << 18, 3, "local", 2) for m in (False, True))
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["local", "oracle", "static"]), fanout=st.integers(1, 9), data=st.data())
def test_many_senders_per_node_are_averaged_node_by_node_with_the_same_bits(kind: str, fanout: int, data) -> None:
    """The per-node path (fragments of 100 values) with uneven numbers received per node (up to many ranks), some
    nodes absent: every rank's add in the same float64 order as `aggregate`."""
    absent = data.draw(st.lists(st.sets(st.integers(0, 29), max_size=5).map(tuple), min_size=1, max_size=3))
    batched, messages = (network(m, 30, 400, 4, kind, fanout) for m in (False, True))
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


@pytest.mark.parametrize(("k", "strategy"), [(1, "random"), (4, "contiguous"), (2, "random")])
def test_fragments_that_are_ranges_are_averaged_as_slices_with_the_same_bits(k: int, strategy: str) -> None:
    """The per-node path where each fragment is one contiguous range (K=1, the contiguous strategy: read and written
    as slices of the models, not gathered through the index arrays), and where none is (K=2 random), a node absent."""
    absent = [(), (2,), ()]
    batched, messages = (network(m, 9, 600, k, "local", 3, strategy) for m in (False, True))
    assert batched.fragmentation.spans[0] is not None or strategy == "random" and k > 1
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


@pytest.mark.parametrize(("k", "strategy"), [(1, "random"), (4, "contiguous"), (2, "random"), (3, "random")])
def test_wide_fragments_are_averaged_a_band_of_coordinates_at_a_time_with_the_same_bits(monkeypatch, k: int,
                                                                                          strategy: str) -> None:
    """The per-node path with every fragment cut into bands of 37 coordinates (as a fragment too wide for the cache
    is): ranges and index arrays alike, the last band shorter, a node absent; each band put back in place, as in
    large models (the other tests' small ones put fragments of index arrays back all at once)."""
    from mosaic_proto import exchange

    monkeypatch.setattr(exchange, "PER_NODE_BAND_BYTES", 8 * 9 * 37)
    monkeypatch.setattr(exchange, "PER_NODE_MIN_BAND", 1)
    monkeypatch.setattr(exchange, "PER_NODE_STAGED_BYTES", 0)
    absent = [(), (2,), ()]
    batched, messages = (network(m, 9, 600, k, "local", 3, strategy) for m in (False, True))
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


@pytest.mark.parametrize(("k", "strategy"), [(1, "random"), (4, "contiguous"), (2, "random")])
def test_receivers_are_averaged_a_block_at_a_time_with_the_same_bits(monkeypatch, k: int, strategy: str) -> None:
    """The per-node path with its accumulators a block of two receivers at a time (as a thousand nodes' are, each
    block small enough for the cache): the last block shorter, ranks that end inside a block, a node absent."""
    from mosaic_proto import exchange

    monkeypatch.setattr(exchange, "PER_NODE_BLOCK_BYTES", 1)
    monkeypatch.setattr(exchange, "PER_NODE_MIN_BLOCK", 2)
    absent = [(), (2,), ()]
    batched, messages = (network(m, 9, 600, k, "local", 3, strategy) for m in (False, True))
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


def test_small_fragments_are_averaged_in_groups_of_receivers_with_the_same_bits(monkeypatch) -> None:
    """The all-at-once path in many groups (a tiny SCATTER_CHUNK: a group is a node or a few), a node absent."""
    from mosaic_proto import exchange

    monkeypatch.setattr(exchange, "SCATTER_CHUNK", 50)
    absent = [(), (3,), (), ()]
    batched, messages = (network(m, 12, 24, 4, "local", 3) for m in (False, True))
    assert rounds(batched, absent) == rounds(messages, absent)
    assert np.array_equal(batched.matrix(), messages.matrix())


def test_rounds_that_need_a_message_view_go_message_by_message() -> None:
    """A liar, --max-norm or a robust rule refuse or cut messages one by one: those networks never batch."""
    assert network(False, 4, 8, 2, "local", 2).batched
    assert network(False, 4, 8, 2, "local", 2, aggregator=Aggregator("mean")).batched
    assert not network(False, 4, 8, 2, "local", 2, aggregator=Aggregator("trimmed-mean")).batched
    assert not network(False, 4, 8, 2, "local", 2, max_norm=3.0).batched
    assert not network(False, 4, 8, 2, "local", 2, attacks={0: Attack.of("sign-flip", 1, 0, 4, 1)}).batched


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**40), round=st.integers(0, 3000), nodes=st.lists(st.integers(0, 5000), min_size=1,
       max_size=6), k=st.integers(1, 40), population=st.integers(1, 400), data=st.data())
def test_the_table_picks_what_keyed_choice_picks(seed: int, round: int, nodes: list[int], k: int, population: int,
                                                 data) -> None:
    size = data.draw(st.integers(0, min(population, 30)))
    prefixes = [[seed, 2, round + 1, node + 1] for node in nodes]
    table = keyed_table(prefixes, k, population, size)
    assert table.shape == (len(nodes), k, size)
    assert [[frozenset(row.tolist()) for row in rows] for rows in table] == [
        keyed_choices(key, range(k), population, size) for key in prefixes]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**70), purpose=st.sampled_from(list(Purpose)), round=st.integers(-1, 3000),
       nodes=st.lists(st.integers(-1, 2**33), max_size=6))
def test_keyed_raws_are_the_generators_first_draws(seed: int, purpose: Purpose, round: int, nodes: list[int]) -> None:
    """A round's per-node first outputs at once, in lanes or (a node past 32 bits) through numpy's generators."""
    raws = keyed_raws(seed, purpose, round, nodes)
    assert raws.dtype == np.uint64 and raws.shape == (len(nodes),)
    assert raws.tolist() == [keyed_rng(seed, purpose, round, node).bit_generator.random_raw() for node in nodes]


def test_the_table_checks_itself_and_falls_back_where_numpy_draws_differently(monkeypatch) -> None:
    """Its lanes are checked against `keyed_choices` (which is checked against numpy); a population numpy shuffles
    instead of sampling by Floyd's method, or a numpy that draws differently, go through numpy's own generators."""
    assert matches_scalar()

    def numpy_picks(population: int, size: int) -> list[list[frozenset[int]]]:
        return [[frozenset(keyed_rng(3, Purpose.SAMPLING, 1, node, f).choice(population, size=size, replace=False)
                           .tolist()) for f in range(3)] for node in (2, 7)]

    def table(population: int, size: int) -> list[list[frozenset[int]]]:
        prefixes = [key_parts(3, Purpose.SAMPLING, 1, node)[:-1] for node in (2, 7)]
        return [[frozenset(row.tolist()) for row in rows] for rows in keyed_table(prefixes, 3, population, size)]

    drawn = []
    real = keyed_choice._numpy_choices
    monkeypatch.setattr(keyed_choice, "_numpy_choices", lambda *a: drawn.append(a) or real(*a))
    assert table(20000, 401) == numpy_picks(20000, 401)  # numpy shuffles
    assert len(drawn) == 2
    assert table(20000, 400) == numpy_picks(20000, 400)  # Floyd's, in the lanes
    assert len(drawn) == 2
    monkeypatch.setattr(keyed_choice, "matches_numpy", lambda: False)
    assert table(49, 2) == numpy_picks(49, 2)
    assert len(drawn) == 4


@settings(max_examples=60, deadline=None)
@given(run_id=st.text(max_size=40), round=st.integers(0, 2**31 - 1), sender=st.integers(0, 2**31 - 1),
       k=st.integers(1, 300), data=st.data())
def test_message_sizes_are_what_encode_writes(run_id: str, round: int, sender: int, k: int, data) -> None:
    floats = data.draw(st.lists(st.integers(0, 70000), min_size=k, max_size=k))
    chosen = sorted(data.draw(st.sets(st.integers(0, k - 1), max_size=30)))
    batch = FragmentBatch(run_id, round, sender, k, b"\x01" * 8,
                          {f: np.zeros(floats[f], dtype=np.float32) for f in chosen})
    framing, items, heads = encoded_sizes(run_id, round, k, b"\x01" * 8, [sender], floats)
    assert int(framing[0] + heads[len(chosen)] + items[chosen].sum()) == len(encode(batch))

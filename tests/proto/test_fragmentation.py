"""The fragment map C: a balanced partition of [0, d), derived from (layout, K, seed, strategy) alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mosaic_proto import Fragmentation, Layout, Strategy
from mosaic_proto.fragmentation import PACK_FROM

SETTINGS = settings(max_examples=40, deadline=None)

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn, min_dim: int = 1) -> Layout:
    tensors = draw(st.lists(shapes, min_size=1, max_size=6))
    layout = Layout.from_pairs([(f"t{i}", shape) for i, shape in enumerate(tensors)])
    assume(layout.dim >= min_dim)
    return layout


@st.composite
def fragmentations(draw: st.DrawFn, strategy: Strategy | None = None) -> Fragmentation:
    layout = draw(layouts())
    k = draw(st.integers(1, min(layout.dim, 20)))
    seed = draw(st.integers(0, 2**32))
    strategy = strategy or draw(st.sampled_from(list(Strategy)))
    return Fragmentation.build(layout, k, seed, strategy)


def check_partition(fr: Fragmentation) -> None:
    d = fr.dim
    assert len(fr.indices) == fr.k
    assert fr.assignment.shape == (d,)
    assert sum(fr.sizes) == d
    every = np.sort(np.concatenate(fr.indices)) if d else np.zeros(0, np.int64)
    assert np.array_equal(every, np.arange(d))  # disjoint and covering [0, d)
    for k, ix in enumerate(fr.indices):
        assert np.all(fr.assignment[ix] == k)
        assert np.all(np.diff(ix) > 0)  # ascending, so a fragment's order is the flat vector's order


@SETTINGS
@given(fragmentations())
def test_fragments_partition_the_coordinates(fr: Fragmentation) -> None:
    check_partition(fr)


@SETTINGS
@given(fragmentations(Strategy.RANDOM))
def test_random_sizes_differ_by_at_most_the_number_of_tensors(fr: Fragmentation) -> None:
    sizes = fr.sizes
    assert max(sizes) - min(sizes) <= len(fr.layout.names)
    # layer-stratified: inside every tensor the K parts differ by at most one coordinate
    for lo, hi in zip(fr.layout.offsets[:-1], fr.layout.offsets[1:], strict=True):
        part = np.bincount(fr.assignment[lo:hi], minlength=fr.k)
        assert part.max() - part.min() <= 1


@SETTINGS
@given(fragmentations(Strategy.CONTIGUOUS))
def test_contiguous_fragments_are_balanced_slices(fr: Fragmentation) -> None:
    sizes = fr.sizes
    assert max(sizes) - min(sizes) <= 1
    assert np.all(np.diff(fr.assignment) >= 0)  # fragment k is one slice, after fragment k-1
    start = 0
    for ix in fr.indices:
        assert np.array_equal(ix, np.arange(start, start + len(ix)))
        start += len(ix)


@SETTINGS
@given(layouts(), st.integers(1, 20), st.integers(0, 2**40), st.sampled_from(list(Strategy)))
def test_same_seed_gives_the_same_map_on_independent_builds(layout: Layout, k: int, seed: int,
                                                            strategy: Strategy) -> None:
    k = min(k, layout.dim)
    a = Fragmentation.build(layout, k, seed, strategy)
    # an independent build, from a layout rebuilt from its JSON form (as another host would)
    b = Fragmentation.build(Layout.from_json(layout.to_json()), k, seed, strategy.value)
    assert np.array_equal(a.assignment, b.assignment)
    assert all(np.array_equal(x, y) for x, y in zip(a.indices, b.indices, strict=True))
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 8


@SETTINGS
@given(st.integers(32, 5000), st.integers(2, 16), st.integers(0, 2**40), st.integers(1, 2**20))
def test_different_seed_gives_a_different_map(d: int, k: int, seed: int, delta: int) -> None:
    layout = Layout.flat(d)
    a = Fragmentation.build(layout, k, seed)
    b = Fragmentation.build(layout, k, seed + delta)
    assert not np.array_equal(a.assignment, b.assignment)
    assert a.fingerprint != b.fingerprint
    assert a.sizes == b.sizes  # the sizes only depend on (layout, K)


@SETTINGS
@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_different_seed_gives_a_different_map_for_a_multi_tensor_layout(seed: int, delta: int) -> None:
    layout = Layout.from_pairs([("conv.weight", (8, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 8))])
    a = Fragmentation.build(layout, 4, seed)
    b = Fragmentation.build(layout, 4, seed + delta)
    assert not np.array_equal(a.assignment, b.assignment)
    assert a.fingerprint != b.fingerprint


def test_fingerprint_depends_on_k_strategy_and_layout() -> None:
    layout = Layout.flat(64)
    prints = {
        Fragmentation.build(layout, 2, 0).fingerprint,
        Fragmentation.build(layout, 4, 0).fingerprint,
        Fragmentation.build(layout, 4, 0, Strategy.CONTIGUOUS).fingerprint,
        Fragmentation.build(Layout.flat(64, name="y"), 4, 0).fingerprint,
        Fragmentation.build(Layout.from_pairs([("x", (8, 8))]), 4, 0).fingerprint,
    }
    assert len(prints) == 5


def test_contiguous_map_does_not_depend_on_the_seed() -> None:
    a = Fragmentation.build(Layout.flat(100), 7, 1, Strategy.CONTIGUOUS)
    b = Fragmentation.build(Layout.flat(100), 7, 2, Strategy.CONTIGUOUS)
    assert np.array_equal(a.assignment, b.assignment) and a.fingerprint == b.fingerprint


@SETTINGS
@given(fragmentations(), st.integers(0, 2**32))
def test_split_merge_round_trip(fr: Fragmentation, seed: int) -> None:
    v = np.random.default_rng(seed).standard_normal(fr.dim).astype(np.float32)
    parts = fr.split(v)
    assert [len(p) for p in parts] == list(fr.sizes)
    back = fr.merge(parts)
    assert back.dtype == np.float32
    assert np.array_equal(back.view(np.uint32), v.view(np.uint32))
    for k in range(fr.k):
        assert np.array_equal(fr.take(v, k), parts[k])
        assert np.array_equal(parts[k], v[fr.assignment == k])
    # split returns copies: writing to a fragment leaves the vector alone
    if fr.dim:
        parts[0][:] = 7
        assert np.array_equal(fr.merge(fr.split(v)).view(np.uint32), v.view(np.uint32))


@SETTINGS
@given(fragmentations(), st.integers(0, 2**32))
def test_put_writes_exactly_one_fragment(fr: Fragmentation, seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(fr.dim).astype(np.float32)
    k = int(rng.integers(fr.k))
    w = v.copy()
    fr.put(w, k, np.full(fr.sizes[k], 3.0, np.float32))
    assert np.all(w[fr.assignment == k] == 3.0)
    assert np.array_equal(w[fr.assignment != k], v[fr.assignment != k])
    with pytest.raises(ValueError):
        fr.put(w, k, np.zeros(fr.sizes[k] + 1, np.float32))


def test_k1_is_the_whole_vector() -> None:
    fr = Fragmentation.build(Layout.from_pairs([("a", (3, 4)), ("b", (5,))]), 1, 9)
    assert fr.sizes == (17,)
    assert np.array_equal(fr.indices[0], np.arange(17))


def test_build_rejects_bad_k_and_split_rejects_bad_vectors() -> None:
    layout = Layout.flat(10)
    with pytest.raises(ValueError):
        Fragmentation.build(layout, 0, 0)
    with pytest.raises(ValueError):
        Fragmentation.build(layout, 11, 0)
    fr = Fragmentation.build(layout, 3, 0)
    with pytest.raises(ValueError):
        fr.split(np.zeros(9, np.float32))
    with pytest.raises(ValueError):
        fr.split(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError):
        fr.merge(fr.split(np.zeros(10, np.float32))[:2])


def test_maps_are_read_only() -> None:
    fr = Fragmentation.build(Layout.flat(10), 3, 0)
    with pytest.raises(ValueError):
        fr.assignment[0] = 1
    with pytest.raises(ValueError):
        fr.indices[0][0] = 1


def test_layout_validation_and_json() -> None:
    layout = Layout.from_pairs([("w", (2, 3)), ("b", (3,)), ("s", ())])
    assert layout.sizes == (6, 3, 1)
    assert layout.offsets == (0, 6, 9, 10)
    assert layout.dim == 10
    assert Layout.from_json(layout.to_json()) == layout
    assert layout.digest() == Layout.from_json(layout.to_json()).digest()
    with pytest.raises(ValueError):
        Layout(("a", "a"), ((1,), (2,)))
    with pytest.raises(ValueError):
        Layout(("a",), ((1,), (2,)))
    with pytest.raises(ValueError):
        Layout.from_pairs([("a", (-1,))])


@SETTINGS
@given(fragmentations(), st.integers(0, 2**32))
def test_spans_and_views_agree_with_the_index_arrays(fr: Fragmentation, seed: int) -> None:
    vector = np.random.default_rng(seed).standard_normal(fr.dim).astype(np.float32)
    for ix, span, view, piece in zip(fr.indices, fr.spans, fr.views(vector), fr.split(vector), strict=True):
        if span is not None:
            assert np.array_equal(ix, np.arange(*span))
            assert not view.flags.writeable and (len(ix) == 0 or np.shares_memory(view, vector))
        else:
            assert len(ix) > 1 and np.any(np.diff(ix) > 1)
        assert np.array_equal(view, piece)
    if fr.strategy is Strategy.CONTIGUOUS or fr.k == 1:
        assert all(span is not None for span in fr.spans)


@pytest.mark.parametrize("layout, k", [(Layout.flat(PACK_FROM + 1234), 16),
                                       (Layout.from_pairs([("w", (300, 250)), ("b", (PACK_FROM,))]), 5)])
def test_a_large_random_fragmentation_gathers_its_fragments_in_one_pass(layout: Layout, k: int) -> None:
    fr = Fragmentation.build(layout, k, 3)
    vector = np.random.default_rng(0).standard_normal(fr.dim).astype(np.float32)
    views, packed = fr.views(vector), fr.packed(vector)
    assert all(span is None for span in fr.spans)
    assert fr.order is fr.indices[0].base  # the array the index arrays are slices of: not a copy
    assert [len(v) for v in views] == list(fr.sizes) and fr.starts[-1] == fr.dim
    for f, (view, piece) in enumerate(zip(views, fr.split(vector), strict=True)):
        assert np.array_equal(view, piece) and view.base is views[0].base is not None
        assert np.array_equal(packed[fr.starts[f]:fr.starts[f + 1]], piece)
    assert np.array_equal(fr.unpack(packed), vector)
    assert np.array_equal(fr.order[fr.positions], np.arange(fr.dim)) and not fr.positions.flags.writeable


@pytest.mark.parametrize(("k", "strategy", "kept"), [(1, "random", False), (4, "contiguous", False),
                                                     (4, "random", True)])
def test_index_arrays_are_held_only_where_a_round_gathers_through_them(k: int, strategy: str, kept: bool) -> None:
    """Where every fragment is a range (K=1, contiguous) a round reads `sizes` and `spans` only: a node holds no
    index arrays (12 bytes a coordinate) through its rounds, and one that asks for them gets what a kept map has."""
    from mosaic_proto import FragmentBatch, aggregate, decode, encode

    layout = Layout.from_pairs([("w", (300, 40)), ("b", (40,))])
    fr = Fragmentation.build(layout, k, 7, strategy)
    own = np.arange(fr.dim, dtype=np.float32)
    views = fr.views(own)
    batch = decode(encode(FragmentBatch("run", 0, 1, k, fr.fingerprint, dict(enumerate(views)))), fr)
    averaged = aggregate(own, fr, {1: batch.fragments})
    assert np.array_equal(averaged, own)
    assert ("indices" in vars(fr), "assignment" in vars(fr)) == (kept, False)
    twin = Fragmentation.build(layout, k, 7, strategy)
    assert [ix.tolist() for ix in fr.indices] == [ix.tolist() for ix in twin.indices]
    assert np.array_equal(fr.assignment, twin.assignment) and not fr.assignment.flags.writeable
    assert fr.sizes == tuple(len(ix) for ix in fr.indices) and fr.fingerprint == twin.fingerprint

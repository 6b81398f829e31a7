"""Peer samplers: EL-Local, EL-Oracle (a fresh s-regular graph per round and fragment) and the static graph."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import PeerSampler, SamplerKind, SamplingError, keyed_choice, keyed_rng, regular_digraph
from mosaic_proto.rng import Purpose, keyed_picks

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def memberships(draw: st.DrawFn, min_size: int = 2) -> list[int]:
    """A sorted member list of distinct node ids (not necessarily 0..n-1)."""
    return sorted(draw(st.sets(st.integers(0, 500), min_size=min_size, max_size=30)))


@st.composite
def setups(draw: st.DrawFn, kind: SamplerKind) -> tuple[PeerSampler, list[int]]:
    members = draw(memberships())
    s = draw(st.integers(1, len(members) - 1))
    return PeerSampler(kind, s, draw(st.integers(0, 2**32))), members


@SETTINGS
@given(setups(SamplerKind.LOCAL), st.integers(0, 10**6), st.integers(0, 63), st.data())
def test_local_picks_s_distinct_others(setup: tuple[PeerSampler, list[int]], round: int, fragment: int,
                                       data: st.DataObject) -> None:
    sampler, members = setup
    node = data.draw(st.sampled_from(members))
    picks = sampler.receivers(round, node, fragment, members)
    assert len(picks) == sampler.fanout
    assert len(set(picks)) == sampler.fanout
    assert node not in picks
    assert set(picks) <= set(members)
    assert list(picks) == sorted(picks)


@SETTINGS
@given(setups(SamplerKind.LOCAL), st.integers(0, 10**6), st.integers(0, 63), st.data())
def test_local_is_reproducible_for_the_same_key(setup: tuple[PeerSampler, list[int]], round: int,
                                                fragment: int, data: st.DataObject) -> None:
    sampler, members = setup
    node = data.draw(st.sampled_from(members))
    again = PeerSampler(SamplerKind.LOCAL, sampler.fanout, sampler.seed)  # an independent instance
    assert sampler.receivers(round, node, fragment, members) == again.receivers(round, node, fragment, members)
    assert sampler.plan(round, node, 4, members) == again.plan(round, node, 4, list(reversed(members)))


def test_local_draws_fresh_peers_per_round_and_fragment() -> None:
    sampler = PeerSampler("local", 2, seed=5)
    members = list(range(20))
    draws = {sampler.receivers(t, 3, f, members) for t in range(10) for f in range(10)}
    assert len(draws) > 50  # 100 keys over C(19, 2) = 171 possible pairs


def test_local_is_roughly_uniform() -> None:
    sampler = PeerSampler("local", 3, seed=11)
    members = list(range(10))
    counts = Counter(p for t in range(600) for p in sampler.receivers(t, 4, 0, members))
    assert set(counts) == set(members) - {4}
    expected = 600 * 3 / 9
    assert all(abs(c - expected) < 0.25 * expected for c in counts.values())


@SETTINGS
@given(memberships(min_size=1), st.integers(0, 2**32))
def test_asking_for_more_receivers_than_other_members_raises(members: list[int], seed: int) -> None:
    for kind in SamplerKind:
        sampler = PeerSampler(kind, len(members), seed)  # one more than the others
        with pytest.raises(SamplingError):
            sampler.receivers(0, members[0], 0, members)
        with pytest.raises(SamplingError):
            sampler.plan(0, members[0], 3, members)


def test_bad_fanout_and_non_member_raise() -> None:
    with pytest.raises(SamplingError):
        PeerSampler("local", 0, 0)
    with pytest.raises(ValueError):
        PeerSampler("gossip", 1, 0)
    with pytest.raises(SamplingError):
        PeerSampler("local", 1, 0).receivers(0, 99, 0, [0, 1, 2])
    assert issubclass(SamplingError, ValueError)


def in_degrees(graph: dict[int, tuple[int, ...]]) -> Counter:
    return Counter(p for peers in graph.values() for p in peers)


@SETTINGS
@given(memberships(), st.integers(0, 2**32), st.data())
def test_regular_digraph_is_s_regular(members: list[int], seed: int, data: st.DataObject) -> None:
    s = data.draw(st.integers(1, len(members) - 1))
    graph = regular_digraph(members, s, keyed_rng(seed, Purpose.GRAPH))
    assert sorted(graph) == members
    for node, peers in graph.items():
        assert len(set(peers)) == s and node not in peers and set(peers) <= set(members)
    assert all(in_degrees(graph)[m] == s for m in members)


@SETTINGS
@given(setups(SamplerKind.ORACLE), st.integers(0, 10**6), st.integers(0, 63))
def test_oracle_graph_is_s_regular_and_agreed_by_every_node(setup: tuple[PeerSampler, list[int]], round: int,
                                                            fragment: int) -> None:
    sampler, members = setup
    # every node derives its own receivers independently, with its own sampler instance
    graph = {m: PeerSampler("oracle", sampler.fanout, sampler.seed).receivers(round, m, fragment, members)
             for m in members}
    for node, peers in graph.items():
        assert len(set(peers)) == sampler.fanout and node not in peers
    indeg = in_degrees(graph)
    assert all(indeg[m] == sampler.fanout for m in members)  # every node receives from exactly s senders


def test_oracle_graph_changes_with_round_and_fragment() -> None:
    sampler = PeerSampler("oracle", 2, seed=3)
    members = list(range(12))

    def graph(t: int, f: int) -> tuple:
        return tuple(sampler.receivers(t, m, f, members) for m in members)

    assert len({graph(t, f) for t in range(4) for f in range(4)}) == 16


def test_static_graph_is_fixed_and_carries_every_fragment() -> None:
    sampler = PeerSampler("static", 3, seed=3)
    members = list(range(12))
    first = {m: sampler.receivers(0, m, 0, members) for m in members}
    assert all(in_degrees(first)[m] == 3 for m in members)
    for t in range(5):
        for m in members:
            for f in range(4):
                assert sampler.receivers(t, m, f, members) == first[m]
            assert sampler.plan(t, m, 4, members) == {p: [0, 1, 2, 3] for p in first[m]}


@SETTINGS
@given(st.sampled_from(list(SamplerKind)), memberships(), st.integers(1, 16), st.integers(0, 1000),
       st.integers(0, 2**32), st.data())
def test_plan_sends_every_fragment_to_s_peers(kind: SamplerKind, members: list[int], k: int, round: int,
                                              seed: int, data: st.DataObject) -> None:
    s = data.draw(st.integers(1, len(members) - 1))
    node = data.draw(st.sampled_from(members))
    sampler = PeerSampler(kind, s, seed)
    plan = sampler.plan(round, node, k, members)
    assert list(plan) == sorted(plan) and node not in plan
    per_fragment = Counter(f for frags in plan.values() for f in frags)
    assert per_fragment == {f: s for f in range(k)}
    for peer, frags in plan.items():
        assert frags == sorted(set(frags))
        for f in frags:
            assert peer in sampler.receivers(round, node, f, members)


def test_keyed_rng_is_keyed() -> None:
    a = keyed_rng(1, Purpose.SAMPLING, 2, 3, 4).integers(2**62, size=4)
    assert np.array_equal(a, keyed_rng(1, Purpose.SAMPLING, 2, 3, 4).integers(2**62, size=4))
    for other in [(2, Purpose.SAMPLING, 2, 3, 4), (1, Purpose.GRAPH, 2, 3, 4), (1, Purpose.SAMPLING, 3, 3, 4),
                  (1, Purpose.SAMPLING, 2, 4, 4), (1, Purpose.SAMPLING, 2, 3, 5), (1, Purpose.SAMPLING, 2, 3, -1)]:
        assert not np.array_equal(a, keyed_rng(*other).integers(2**62, size=4))
    with pytest.raises(ValueError):
        keyed_rng(-1, Purpose.SAMPLING)
    with pytest.raises(ValueError):
        keyed_rng(0, Purpose.SAMPLING, round=-2)


def reference_plan(sampler: PeerSampler, round: int, node: int, k: int, members: list[int]) -> dict[int, list[int]]:
    """The plan from one `receivers` call per fragment (the definition, with nothing kept)."""
    fresh = PeerSampler(sampler.kind, sampler.fanout, sampler.seed)
    others = [m for m in members if m != node]
    out: dict[int, list[int]] = {}
    for f in range(k if sampler.kind is not SamplerKind.STATIC else 1):
        if sampler.kind is SamplerKind.LOCAL:  # the spec's definition, straight from numpy's generator
            picks = keyed_rng(sampler.seed, Purpose.SAMPLING, round, node, f).choice(
                len(others), size=sampler.fanout, replace=False)
            receivers = sorted(others[i] for i in picks)
            assert tuple(receivers) == fresh.receivers(round, node, f, members)
        else:
            receivers = fresh.receivers(round, node, f, members)
        for peer in receivers:
            out.setdefault(peer, []).append(f)
    if sampler.kind is SamplerKind.STATIC:
        out = {peer: list(range(k)) for peer in out}
    return dict(sorted(out.items()))


@SETTINGS
@given(st.sampled_from(list(SamplerKind)), memberships(), st.integers(1, 16), st.integers(0, 30),
       st.integers(0, 2**32), st.data())
def test_kept_plans_are_the_drawn_plans(kind: SamplerKind, members: list[int], k: int, round: int, seed: int,
                                        data: st.DataObject) -> None:
    s = data.draw(st.integers(1, len(members) - 1))
    sampler = PeerSampler(kind, s, seed)
    for t in (round, round + 1, round, round + 5, round):  # kept, evicted and drawn again
        for node in members:
            expected = reference_plan(sampler, t, node, k, members)
            assert sampler.plan(t, node, k, members) == expected
            for peer in members:
                assert sampler.share(t, node, k, members, peer) == tuple(expected.get(peer, []))


def test_a_plan_is_drawn_once_per_round_and_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    import mosaic_proto.sampling as sampling
    calls = Counter()

    def counting(seed: int, purpose: Purpose, round: int, node: int, fragments: list[int], *args: int):  # noqa: ANN202
        fragments = list(fragments)
        calls[(round, node)] += len(fragments)
        return keyed_picks(seed, purpose, round, node, fragments, *args)

    sampler, members, k = PeerSampler("local", 2, seed=1), list(range(10)), 16
    expected = reference_plan(sampler, 3, 4, k, members)
    monkeypatch.setattr(sampling, "keyed_picks", counting)
    first = sampler.plan(3, 4, k, members)
    first[next(iter(first))].append(99)  # a caller's copy: the kept plan is not changed
    for receiver in members:
        sampler.share(3, 4, k, members, receiver)
    assert sampler.plan(3, 4, k, tuple(members)) == expected
    assert calls == {(3, 4): k}
    for t in range(4, 4 + sampling.PLAN_ROUNDS + 2):
        sampler.plan(t, 4, k, members)
    assert set(sampler._plans) == set(range(6, 4 + sampling.PLAN_ROUNDS + 2))  # only the last rounds are kept


@SETTINGS
@given(st.integers(0, 2**70), st.sampled_from(list(Purpose)), st.integers(-1, 2**33), st.integers(-1, 2**33),
       st.lists(st.integers(0, 2**33), min_size=1, max_size=4), st.integers(1, 400), st.data())
def test_keyed_picks_are_numpys_choices(seed: int, purpose: Purpose, round: int, node: int, fragments: list[int],
                                        population: int, data: st.DataObject) -> None:
    """The plain-integer SeedSequence -> PCG64 -> Floyd path picks exactly what numpy's generators pick."""
    size = data.draw(st.integers(0, population))
    expected = [frozenset(keyed_rng(seed, purpose, round, node, f).choice(population, size=size, replace=False)
                          .tolist()) for f in fragments]
    assert keyed_picks(seed, purpose, round, node, fragments, population, size) == expected


def test_keyed_picks_fall_back_to_numpy_where_it_draws_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    """Numpy shuffles instead of Floyd's sampling for large populations, and a numpy that drew differently
    would fail the process's self-check: both go through numpy's own generators, with the same picks."""
    def expected(population: int, size: int) -> list[frozenset[int]]:
        return [frozenset(keyed_rng(3, Purpose.SAMPLING, 1, 2, f).choice(population, size=size, replace=False)
                          .tolist()) for f in range(3)]

    drawn = Counter()
    real = keyed_choice._numpy_choices
    monkeypatch.setattr(keyed_choice, "_numpy_choices", lambda *a: drawn.update(["numpy"]) or real(*a))
    assert keyed_picks(3, Purpose.SAMPLING, 1, 2, range(3), 20000, 401) == expected(20000, 401)
    assert drawn["numpy"] == 1
    assert keyed_picks(3, Purpose.SAMPLING, 1, 2, range(3), 20000, 400) == expected(20000, 400)
    assert drawn["numpy"] == 1  # Floyd's, computed here
    assert keyed_choice.matches_numpy()
    monkeypatch.setattr(keyed_choice, "matches_numpy", lambda: False)
    assert keyed_picks(3, Purpose.SAMPLING, 1, 2, range(3), 49, 2) == expected(49, 2)
    assert drawn["numpy"] == 2
    with pytest.raises(ValueError, match="cannot take 5 of 4"):
        keyed_picks(3, Purpose.SAMPLING, 1, 2, range(3), 4, 5)

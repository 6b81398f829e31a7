"""Robust aggregation per fragment (mosaic_proto.robust) and members that lie (mosaic_proto.attacks)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import (
    Aggregator,
    Attack,
    BarrierState,
    Fragmentation,
    InMemoryNetwork,
    Layout,
    PeerSampler,
    RoundState,
    aggregate,
    byzantine_ranks,
    decode,
)
from mosaic_proto.attacks import alie_z
from mosaic_proto.rules import clipped_fragment, trim_count, trimmed_fragment

SETTINGS = settings(max_examples=40, deadline=None)
D, K = 40, 4
FR = Fragmentation.build(Layout.flat(D), K, seed=5)
floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def bits(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float32).view(np.uint32)


def received_from(rng: np.random.Generator, senders: list[int], scale: float = 1.0) -> dict[int, dict[int, np.ndarray]]:
    """Each sender sends a random subset of the fragments."""
    out: dict[int, dict[int, np.ndarray]] = {}
    for s in senders:
        frags = [f for f in range(K) if rng.random() < 0.6]
        out[s] = {f: (scale * rng.standard_normal(len(FR.indices[f]))).astype(np.float32) for f in frags}
    return out


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 30), min_size=0, max_size=6, unique=True))
def test_mean_rule_is_todays_aggregate_bit_for_bit(seed: int, senders: list[int]) -> None:
    rng = np.random.default_rng(seed)
    own = rng.standard_normal(D).astype(np.float32)
    received = received_from(rng, senders)
    vector, cut = Aggregator("mean").aggregate(own, FR, received)
    assert np.array_equal(bits(vector), bits(aggregate(own, FR, received))) and not cut


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 30), min_size=1, max_size=7, unique=True),
       st.sampled_from(["trimmed-mean", "clipped"]), st.randoms())
def test_rules_do_not_depend_on_arrival_order(seed: int, senders: list[int], kind: str, shuffle) -> None:
    rng = np.random.default_rng(seed)
    own = rng.standard_normal(D).astype(np.float32)
    received = received_from(rng, senders)
    order = list(received)
    shuffle.shuffle(order)
    rule = Aggregator(kind, trim=1, clip_radius=0.5)
    a, cut_a = rule.aggregate(own, FR, received)
    b, cut_b = rule.aggregate(own, FR, {s: dict(reversed(list(received[s].items()))) for s in order})
    assert np.array_equal(bits(a), bits(b)) and cut_a == cut_b


@SETTINGS
@given(st.lists(st.lists(floats, min_size=3, max_size=3), min_size=1, max_size=9), st.sampled_from([1, 2, 0.2, 0.34]))
def test_trimmed_mean_is_the_sorted_middle_mean(rows: list[list[float]], trim: float) -> None:
    stack = np.array(rows, dtype=np.float32)
    got, _ = trimmed_fragment(stack[0], list(stack[1:]), trim)
    m = len(stack)
    b = trim_count(trim, m)
    want = np.sort(stack.astype(np.float64), axis=0)[b:m - b].mean(axis=0)
    assert np.allclose(got, want.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_too_few_contributions_fall_back_to_the_median() -> None:
    own = np.array([0.0, 10.0], dtype=np.float32)
    one = np.array([2.0, 30.0], dtype=np.float32)
    # m = 2 < 2b + 1: b drops to 0, the median of two values is their mean
    assert trim_count(1, 2) == 0 and np.array_equal(trimmed_fragment(own, [one], 1)[0], [1.0, 20.0])
    # m = 1: the node's own values
    assert np.array_equal(trimmed_fragment(own, [], 2)[0], own)
    # m = 4 < 2 * 2 + 1: b = 1 (the median of four: the mean of the middle two)
    parts = [one, np.array([4.0, -5.0], np.float32), np.array([100.0, 0.0], np.float32)]
    assert trim_count(2, 4) == 1 and np.array_equal(trimmed_fragment(own, parts, 2)[0], [3.0, 5.0])
    # a fraction: b = floor(0.25 * m)
    assert [trim_count(0.25, m) for m in (1, 3, 4, 8, 9)] == [0, 0, 1, 2, 2]


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(0, 6), st.floats(1e3, 1e30))
def test_trimmed_mean_stays_within_the_honest_values_when_liars_are_at_most_b(seed: int, b: int, extra: int,
                                                                               lie: float) -> None:
    rng = np.random.default_rng(seed)
    honest = rng.standard_normal((2 * b + 1 + extra - b, 8)).astype(np.float32)  # own is honest[0]
    liars = [np.full(8, lie * (-1) ** i, dtype=np.float32) for i in range(b)]
    got, trimmed = trimmed_fragment(honest[0], list(honest[1:]) + liars, b)
    assert np.all(got >= honest.min(axis=0) - 1e-6) and np.all(got <= honest.max(axis=0) + 1e-6)
    assert trimmed >= 1  # liars far out are cut in nearly every coordinate: counted


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.floats(0.01, 2.0))
def test_clipping_bounds_every_senders_pull(seed: int, m: int, radius: float) -> None:
    rng = np.random.default_rng(seed)
    own = rng.standard_normal(16).astype(np.float32)
    parts = [(rng.standard_normal(16) * 10 ** rng.uniform(-2, 3)).astype(np.float32) for _ in range(m)]
    got, clipped = clipped_fragment(own, parts, radius)
    tau = radius * np.linalg.norm(own.astype(np.float64))
    assert np.linalg.norm(got.astype(np.float64) - own) <= tau * m / (1 + m) * (1 + 1e-5) + 1e-5
    assert clipped == sum(np.linalg.norm(p.astype(np.float64) - own) > tau for p in parts)


def test_clipping_with_a_wide_radius_is_the_mean() -> None:
    rng = np.random.default_rng(1)
    own = rng.standard_normal(D).astype(np.float32)
    received = received_from(rng, [1, 2, 3])
    got, cut = Aggregator("clipped", clip_radius=1e6).aggregate(own, FR, received)
    assert np.allclose(got, aggregate(own, FR, received), rtol=1e-6, atol=1e-6) and not cut


def test_settings_are_checked() -> None:
    for bad in (dict(trim=0.5), dict(trim=1.5), dict(trim=0), dict(clip_radius=0), dict(kind="median")):
        with pytest.raises(ValueError):
            Aggregator(**bad)


# -- attackers -----------------------------------------------------------------------------------------------


def test_byzantine_ranks_are_drawn_from_the_seed() -> None:
    assert byzantine_ranks(3, 16, 0) == ()
    ranks = byzantine_ranks(3, 16, 2)
    assert ranks == byzantine_ranks(3, 16, 2) and len(set(ranks)) == 2 and all(0 <= r < 16 for r in ranks)
    assert len({byzantine_ranks(s, 16, 2) for s in range(20)}) > 5  # other seeds, other ranks
    with pytest.raises(ValueError):
        byzantine_ranks(0, 4, 5)


def test_crafted_fragments() -> None:
    x = np.array([1.0, -2.0, 3.0], dtype=np.float32)
    start = np.array([0.5, -1.0, 3.5], dtype=np.float32)
    assert np.array_equal(Attack.of("sign-flip", 0, 1, 16, 2).craft(4, 0, x, None), -x)
    assert np.array_equal(Attack.of("scale", 0, 1, 16, 2).craft(4, 0, x, None), 10 * x)
    noise = Attack.of("noise", 0, 1, 16, 2)
    assert np.array_equal(noise.craft(4, 2, x, None), noise.craft(4, 2, x, None))
    assert not np.array_equal(noise.craft(4, 2, x, None), noise.craft(5, 2, x, None))
    alie = Attack.of("alie", 0, 1, 16, 2)
    assert alie.scale == pytest.approx(alie_z(16, 2)) and 0.1 < alie.scale < 0.2
    assert np.allclose(alie.craft(4, 0, x, start), x - alie.scale * (x - start))
    assert np.array_equal(alie.craft(0, 0, x, None), x)  # nothing to craft from: honest
    huge = Attack.of("scale", 0, 1, 16, 2, scale=1e300).craft(0, 0, x, None)
    assert np.isfinite(huge).all()  # still a validly formed fragment


def test_an_attackers_messages_are_valid_and_crafted_while_its_own_model_stays_honest() -> None:
    members, sampler = list(range(5)), PeerSampler("local", 2, seed=1)
    attack = Attack.of("sign-flip", 1, 0, 5, 1)
    liar = RoundState(node=0, round=0, members=members, fragmentation=FR, sampler=sampler, run_id="r", attack=attack)
    x = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    receivers = {i: RoundState(node=i, round=0, members=members, fragmentation=FR, sampler=sampler, run_id="r",
                               planned_only=True) for i in members[1:]}
    for message in liar.outgoing(x):
        receivers[message.peer].receive(message.payload)  # planned, well formed: accepted
        for f, values in decode(message.payload, FR).fragments.items():
            assert np.array_equal(values, -FR.take(x, f))
    assert np.array_equal(liar.finish().vector, x)  # it received nothing: it keeps its honest model


def test_refusals_a_state_makes_on_its_own_are_told() -> None:
    """--max-norm refusals decided in outgoing() (the message came in while the node trained) and the fragments the
    aggregator cut reach `on_refused` as well as the report."""
    told: Counter = Counter()
    members, sampler = list(range(4)), PeerSampler("static", 3, seed=2)
    states = {i: RoundState(node=i, round=0, members=members, fragmentation=FR, sampler=sampler, run_id="r",
                            max_norm=10, aggregator=Aggregator("clipped", clip_radius=0.01),
                            attack=Attack.of("scale", 2, 3, 4, 1, scale=100.0) if i == 3 else None,
                            on_refused=(lambda why, n: told.update({why: n})) if i == 0 else None)
              for i in members}
    rng = np.random.default_rng(4)
    for i in (3, 1, 2, 0):  # node 0 trains last: node 3's message waits for its norms
        for message in states[i].outgoing(rng.standard_normal(D).astype(np.float32) + 5):
            try:
                states[message.peer].receive(message.payload)
            except Exception:  # refused at once by a node that knows its norms: counted in its report
                pass
    report = states[0].finish().report
    assert told["out_of_range"] == 1 and told["clipped"] == 2 * K  # nodes 1 and 2: all fragments clipped at 1%
    assert report.to_json()["refused"] == {"out_of_range": 1, "clipped": 2 * K}


@pytest.mark.parametrize("kind", ["mean", "trimmed-mean", "clipped"])
def test_in_memory_network_with_attackers_is_deterministic_and_attacked(kind: str) -> None:
    def run(byzantine: int) -> list[np.ndarray]:
        attacks = {r: Attack.of("alie", 7, r, 6, 2, scale=3.0) for r in byzantine_ranks(7, 6, byzantine)}
        start = [np.random.default_rng(i).standard_normal(D).astype(np.float32) for i in range(6)]
        net = InMemoryNetwork(start, FR, PeerSampler("local", 2, 7),
                              lambda i, t, x: (x * 0.9 + 0.1 * i, 0.0),
                              barrier=BarrierState(rounds=4, expected=6, round_deadline=1, drop_after=2),
                              aggregator=Aggregator(kind), attacks=attacks)
        net.run(4)
        return net.vectors

    attacked = run(2)
    assert all(np.array_equal(a, b) for a, b in zip(attacked, run(2), strict=True))
    honest = [i for i in range(6) if i not in byzantine_ranks(7, 6, 2)]
    clean = run(0)
    assert any(not np.array_equal(attacked[i], clean[i]) for i in honest)

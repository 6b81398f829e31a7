"""RoundState (one node's round, no I/O) and the fragment-wise aggregation it ends with."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import (
    Fragmentation,
    FragmentBatch,
    Layout,
    PeerSampler,
    Reason,
    Receipt,
    RoundOutcome,
    RoundState,
    WireError,
    aggregate,
    decode,
    encode,
)
from mosaic_proto.aggregation import scattered

SETTINGS = settings(max_examples=30, deadline=None)
N, D, K, S = 6, 48, 4, 2
MEMBERS = list(range(N))
RUN = "round-test"
FR = Fragmentation.build(Layout.flat(D), K, seed=3)
SAMPLER = PeerSampler("local", S, seed=3)


def vec(node: int, round: int = 0, d: int = D) -> np.ndarray:
    return np.random.default_rng([node, round, d]).standard_normal(d).astype(np.float32)


def new_state(node: int = 0, round: int = 1, members: list[int] = MEMBERS, **kwargs) -> RoundState:
    return RoundState(node=node, round=round, members=members, fragmentation=FR, sampler=SAMPLER, run_id=RUN,
                      **kwargs)


def msg(sender: int, round: int, frags: tuple[int, ...] = (0, 1, 2, 3), run: str = RUN) -> bytes:
    v = vec(sender, round)
    return encode(FragmentBatch(run, round, sender, K, FR.fingerprint, {f: FR.take(v, f) for f in frags}))


def bits(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float32).view(np.uint32)


def received_of(*messages: bytes) -> dict[int, dict[int, np.ndarray]]:
    out: dict[int, dict[int, np.ndarray]] = {}
    for m in messages:
        batch = decode(m, FR)
        out.setdefault(batch.sender, {}).update(batch.fragments)
    return out


def finish(state: RoundState, own: np.ndarray | None = None) -> RoundOutcome:
    state.outgoing(vec(state.node, state.round) if own is None else own)
    return state.finish()


# -- accepting, aggregating, reporting ------------------------------------------------------------------------

def test_finish_aggregates_what_arrived() -> None:
    state = new_state()
    good = [msg(1, 1, (0, 1)), msg(2, 1, (1, 3)), msg(4, 1, (1,))]
    assert [state.receive(m) for m in good] == [Receipt.ACCEPTED] * 3
    own = vec(0, 1)
    out = finish(state, own)
    expected = aggregate(own, FR, received_of(*good))
    assert np.array_equal(bits(out.vector), bits(expected))
    # and fragment by fragment, from the spec's formula
    recv = received_of(*good)
    for f in range(K):
        senders = sorted(s for s in recv if f in recv[s])
        want = (own[FR.indices[f]].astype(np.float64) + sum(recv[s][f].astype(np.float64) for s in senders))
        want = (want / (1 + len(senders))).astype(np.float32)
        assert np.array_equal(bits(FR.take(out.vector, f)), bits(want))
    assert np.array_equal(bits(FR.take(out.vector, 2)), bits(FR.take(own, 2)))  # nobody sent fragment 2
    report = out.report
    assert (report.round, report.messages_in, report.fragments_in) == (1, 3, 5)
    assert report.bytes_in == sum(len(m) for m in good)
    assert not report.refused and out.early == ()


def test_one_sender_may_split_its_fragments_over_messages() -> None:
    state = new_state()
    assert state.receive(msg(1, 1, (0,))) is Receipt.ACCEPTED
    assert state.receive(msg(1, 1, (2, 3))) is Receipt.ACCEPTED
    out = finish(state)
    assert out.report.fragments_in == 3 and out.report.messages_in == 2
    whole = aggregate(vec(0, 1), FR, received_of(msg(1, 1, (0, 2, 3))))
    assert np.array_equal(bits(out.vector), bits(whole))


def test_next_rounds_message_is_buffered_and_handed_on() -> None:
    state = new_state(round=1)
    early = msg(3, 2, (1, 2))
    assert state.receive(early) is Receipt.BUFFERED
    out = finish(state)
    assert out.report.messages_in == 0 and out.report.bytes_in == 0  # counted in the round it belongs to
    assert np.array_equal(bits(out.vector), bits(vec(0, 1)))  # it took no part in round 1
    assert len(out.early) == 1
    assert out.early[0].batch.round == 2 and out.early[0].batch.sender == 3 and out.early[0].nbytes == len(early)

    nxt = new_state(round=2, early=out.early)
    assert (nxt.report.messages_in, nxt.report.fragments_in, nxt.report.bytes_in) == (1, 2, len(early))
    own = vec(0, 2)
    got = finish(nxt, own)
    assert np.array_equal(bits(got.vector), bits(aggregate(own, FR, received_of(early))))


def test_window_buffers_up_to_two_rounds_ahead() -> None:
    state = new_state(round=1)
    two_ahead = msg(5, 3)
    assert state.receive(two_ahead) is Receipt.BUFFERED
    with pytest.raises(WireError) as info:
        state.receive(msg(5, 4))
    assert info.value.reason is Reason.FUTURE_ROUND
    r2 = new_state(round=2, early=finish(state).early)
    assert r2.report.messages_in == 0  # still early: passed on again
    r3 = new_state(round=3, early=finish(r2).early)
    assert r3.report.messages_in == 1 and r3.report.bytes_in == len(two_ahead)
    own = vec(0, 3)
    assert np.array_equal(bits(finish(r3, own).vector), bits(aggregate(own, FR, received_of(two_ahead))))


def test_buffered_message_of_a_departed_sender_is_refused_and_counted() -> None:
    state = new_state(round=1)
    state.receive(msg(5, 2))
    nxt = new_state(round=2, members=[0, 1, 2, 3], early=finish(state).early)
    assert nxt.report.messages_in == 0
    assert nxt.report.refused == {Reason.UNKNOWN_SENDER.value: 1}


# -- refusals leave the state as it was ---------------------------------------------------------------------

GOOD = [msg(1, 1, (0, 1)), msg(2, 1, (1, 3)), msg(3, 2, (0,))]

REFUSALS: list[tuple[str, Callable[[], bytes], Reason]] = [
    ("past_round", lambda: msg(4, 0), Reason.STALE_ROUND),
    ("long_past_round", lambda: msg(4, 0, (2,)), Reason.STALE_ROUND),
    ("too_far_ahead", lambda: msg(4, 4), Reason.FUTURE_ROUND),
    ("much_too_far_ahead", lambda: msg(4, 2**31 - 1), Reason.FUTURE_ROUND),
    ("non_member", lambda: msg(6, 1), Reason.UNKNOWN_SENDER),
    ("non_member_early", lambda: msg(99, 2), Reason.UNKNOWN_SENDER),
    ("from_itself", lambda: msg(0, 1), Reason.UNKNOWN_SENDER),
    ("same_fragment_again", lambda: msg(1, 1, (1, 2)), Reason.DUPLICATE_FRAGMENT),
    ("same_message_again", lambda: GOOD[1], Reason.DUPLICATE_FRAGMENT),
    ("same_sender_early_again", lambda: msg(3, 2, (3,)), Reason.DUPLICATE_FRAGMENT),
    ("wrong_run", lambda: msg(4, 1, run="another-run"), Reason.WRONG_RUN),
    ("garbage", lambda: b"\x00garbage", Reason.BAD_HEADER),  # an integer where a message's map opens
    ("cut_short", lambda: msg(4, 1)[:-1], Reason.MALFORMED),
]


def report_counts(state: RoundState) -> dict:
    return {k: v for k, v in state.report.to_json().items() if k != "refused"}


@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_refusal_leaves_the_state_unchanged(make: Callable[[], bytes], reason: Reason) -> None:
    baseline, state = new_state(), new_state()
    for m in GOOD:
        baseline.receive(m)
        state.receive(m)
    with pytest.raises(WireError) as info:
        state.receive(make())
    assert info.value.reason is reason
    assert state.report.refused == {reason.value: 1}
    assert report_counts(state) == report_counts(baseline)
    a, b = finish(baseline), finish(state)
    assert np.array_equal(bits(a.vector), bits(b.vector))
    assert [(e.batch.round, e.batch.sender, e.nbytes) for e in a.early] == \
           [(e.batch.round, e.batch.sender, e.nbytes) for e in b.early]
    assert b.report.refused == {reason.value: 1}


@pytest.mark.parametrize(("make", "reason"),
                         [c[1:] for c in REFUSALS if c[2] is not Reason.DUPLICATE_FRAGMENT],
                         ids=[c[0] for c in REFUSALS if c[2] is not Reason.DUPLICATE_FRAGMENT])
def test_refusal_first_does_not_block_the_good_messages(make: Callable[[], bytes], reason: Reason) -> None:
    baseline, state = new_state(), new_state()
    with pytest.raises(WireError) as info:
        state.receive(make())
    assert info.value.reason is reason
    for m in GOOD:
        assert baseline.receive(m) == state.receive(m)
    assert report_counts(state) == report_counts(baseline)
    assert np.array_equal(bits(finish(baseline).vector), bits(finish(state).vector))


def test_after_finish_the_round_is_closed() -> None:
    state = new_state(round=1)
    state.receive(GOOD[0])
    out = finish(state)
    with pytest.raises(WireError) as info:
        state.receive(msg(4, 1))
    assert info.value.reason is Reason.STALE_ROUND
    # a later round's message can no longer be handed on by this state: refused, not silently dropped
    with pytest.raises(WireError) as info:
        state.receive(msg(4, 2))
    assert info.value.reason is Reason.ROUND_CLOSED
    assert state.report.refused == {Reason.STALE_ROUND.value: 1, Reason.ROUND_CLOSED.value: 1}
    assert out.report.messages_in == 1


def test_finish_needs_outgoing_and_only_once() -> None:
    state = new_state()
    with pytest.raises(RuntimeError):
        state.finish()
    finish(state)
    assert state.finished
    with pytest.raises(RuntimeError):
        state.finish()
    with pytest.raises(ValueError):
        new_state(node=9)


# -- what a node sends ------------------------------------------------------------------------------------

def test_outgoing_messages_and_report() -> None:
    state = new_state(node=2, round=4)
    own = vec(2, 4)
    messages = state.outgoing(own)
    plan = state.plan()
    assert [m.peer for m in messages] == list(plan)
    report = state.report
    assert report.messages_out == len(messages) == len(plan)
    assert report.fragments_out == sum(len(m.fragments) for m in messages) == S * K
    assert report.bytes_out == sum(len(m.payload) for m in messages)
    for m in messages:
        assert list(m.fragments) == plan[m.peer]
        batch = decode(m.payload, FR, run_id=RUN)
        assert (batch.round, batch.sender, sorted(batch.fragments)) == (4, 2, list(m.fragments))
        for f, values in batch.fragments.items():
            assert np.array_equal(bits(values), bits(FR.take(own, f)))
    lost = messages[0]
    before = (report.messages_out, report.fragments_out, report.bytes_out)
    state.mark_unsent(lost)
    assert (report.messages_out, report.fragments_out, report.bytes_out) == \
           (before[0] - 1, before[1] - len(lost.fragments), before[2] - len(lost.payload))
    assert report.fragments_unsent == len(lost.fragments)


@pytest.mark.parametrize(("k", "kind"), [(1, "local"), (4, "static"), (4, "local")])
def test_peers_sent_the_same_fragments_share_one_encoding(k: int, kind: str) -> None:
    """A message names no receiver: every peer sent the same fragments gets the same bytes, encoded once."""
    fr = Fragmentation.build(Layout.flat(D), k, seed=3)
    state = RoundState(node=1, round=2, members=MEMBERS, fragmentation=fr, sampler=PeerSampler(kind, 3, seed=3),
                       run_id=RUN)
    messages = state.outgoing(vec(1, 2))
    assert len(messages) >= 3
    for a in messages:
        for b in messages:
            assert (a.payload is b.payload) == (a.fragments == b.fragments)
    assert state.report.bytes_out == sum(len(m.payload) for m in messages)
    for a in messages:
        for b in messages:
            assert (a.body is b.body) == (a.fragments == b.fragments)


@pytest.mark.parametrize(("k", "strategy"), [(1, "random"), (4, "random"), (4, "contiguous")])
def test_a_message_is_sent_as_pieces_that_view_the_values_and_join_to_its_encoding(k: int, strategy: str) -> None:
    """`OutgoingMessage.body.parts`: the framing and views of the fragments' values (no copy of them into a
    message), which join to `wire.encode`'s bytes of the same batch."""
    fr = Fragmentation.build(Layout.flat(D), k, seed=3, strategy=strategy)
    state = RoundState(node=1, round=2, members=MEMBERS, fragmentation=fr, sampler=PeerSampler("local", 3, seed=3),
                       run_id=RUN)
    local = vec(1, 2)
    views = fr.views(local)
    for m in state.outgoing(local):
        batch = FragmentBatch(RUN, 2, 1, k, fr.fingerprint, {f: views[f] for f in m.fragments})
        assert m.payload == encode(batch) and m.nbytes == len(m.payload) == m.body.nbytes
        values = [p for p in m.body.parts if len(p) >= 4 * min(fr.sizes)]
        assert len(values) == len(m.fragments)
        if k == 1 or strategy == "contiguous":
            assert all(np.shares_memory(np.frombuffer(p, np.uint8), local) for p in values)


def sent_by(node: int, k: int, d: int, n: int, s: int, kind: str = "local") -> tuple[int, int, int, int]:
    """(floats, bytes, messages, fragments) node sends in one round."""
    fr = Fragmentation.build(Layout.flat(d), k, seed=1)
    state = RoundState(node=node, round=3, members=list(range(n)), fragmentation=fr,
                       sampler=PeerSampler(kind, s, seed=1), run_id=RUN)
    messages = state.outgoing(vec(node, 3, d))
    floats = sum(decode(m.payload, fr).floats for m in messages)
    return floats, state.report.bytes_out, state.report.messages_out, state.report.fragments_out


@pytest.mark.parametrize("kind", ["local", "oracle", "static"])
def test_bytes_per_round_are_s_d_floats_plus_headers(kind: str) -> None:
    n, s, d = 20, 3, 1000
    totals = {}
    for k in (1, 8):
        for node in range(4):
            floats, nbytes, messages, fragments = sent_by(node, k, d, n, s, kind)
            assert floats == s * d  # fragmentation changes who gets what, not how much
            assert fragments == s * k
            headers = nbytes - 4 * s * d
            assert 0 < headers <= messages * (68 + len(RUN)) + fragments * 10  # framing only
            totals[k, node] = floats
    assert all(totals[1, i] == totals[8, i] for i in range(4))
    # K=8 may mean more messages (more peers), so more framing: a fixed cost, negligible for real models
    big = 100_000
    b1, b8 = sent_by(0, 1, big, n, s, kind)[1], sent_by(0, 8, big, n, s, kind)[1]
    assert abs(b8 - b1) < 0.01 * 4 * s * big


# -- aggregation -------------------------------------------------------------------------------------------

@st.composite
def rounds(draw: st.DrawFn, k: int | None = None) -> tuple[Fragmentation, np.ndarray, dict]:
    d = draw(st.integers(1, 200))
    k = draw(st.integers(1, min(d, 16))) if k is None else k
    fr = Fragmentation.build(Layout.flat(d), k, draw(st.integers(0, 2**32)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    scale = 10.0 ** rng.integers(-3, 4)
    own = (rng.standard_normal(d) * scale).astype(np.float32)
    senders = draw(st.sets(st.integers(0, 100), max_size=12))
    received = {}
    for sdr in senders:
        frags = [f for f in range(k) if rng.random() < 0.6]
        received[sdr] = {f: (rng.standard_normal(fr.sizes[f]) * scale).astype(np.float32) for f in frags}
    return fr, own, received


@SETTINGS
@given(rounds(k=1))
def test_k1_is_epidemic_learnings_plain_average(case: tuple[Fragmentation, np.ndarray, dict]) -> None:
    fr, own, received = case
    got = aggregate(own, fr, received)
    senders = sorted(s for s, frags in received.items() if 0 in frags)
    # (own + sum received) / (1 + count), directly on whole vectors, in float64, ascending sender order
    total = own.astype(np.float64)
    for sdr in senders:
        total = total + received[sdr][0]
    expected = (total / (1 + len(senders))).astype(np.float32)
    assert np.array_equal(bits(got), bits(expected))
    if senders:
        stack = np.stack([own] + [received[s][0] for s in senders]).astype(np.float64)
        np.testing.assert_allclose(got, stack.mean(axis=0), rtol=1e-6, atol=1e-6 * np.abs(stack).max())
    else:
        assert np.array_equal(bits(got), bits(own))


@SETTINGS
@given(rounds())
def test_aggregation_is_fragment_wise(case: tuple[Fragmentation, np.ndarray, dict]) -> None:
    fr, own, received = case
    got = aggregate(own, fr, received)
    assert got.dtype == np.float32 and got.shape == own.shape
    for f in range(fr.k):
        senders = sorted(s for s, frags in received.items() if f in frags)
        total = fr.take(own, f).astype(np.float64)
        for sdr in senders:
            total = total + received[sdr][f]
        assert np.array_equal(bits(fr.take(got, f)), bits((total / (1 + len(senders))).astype(np.float32)))


@SETTINGS
@given(rounds(), st.randoms(use_true_random=False))
def test_aggregation_does_not_depend_on_arrival_order(case: tuple[Fragmentation, np.ndarray, dict],
                                                      shuffler) -> None:
    fr, own, received = case
    reference = aggregate(own, fr, received)
    for _ in range(3):
        senders = list(received)
        shuffler.shuffle(senders)
        shuffled = {}
        for sdr in senders:
            frags = list(received[sdr])
            shuffler.shuffle(frags)
            shuffled[sdr] = {f: received[sdr][f] for f in frags}
        assert np.array_equal(aggregate(own, fr, shuffled).view(np.uint32), reference.view(np.uint32))


@SETTINGS
@given(st.integers(0, 2**32), st.randoms(use_true_random=False))
def test_round_state_result_does_not_depend_on_arrival_order(seed: int, shuffler) -> None:
    rng = np.random.default_rng(seed)
    messages = [msg(s, 1, tuple(f for f in range(K) if rng.random() < 0.7) or (0,)) for s in range(1, N)]
    messages += [msg(s, 2, (1,)) for s in (1, 4)]  # early ones mixed in
    results = []
    for _ in range(3):
        shuffler.shuffle(messages)
        state = new_state()
        for m in messages:
            state.receive(m)
        out = finish(state)
        results.append((out.vector.view(np.uint32), [(e.batch.sender, e.nbytes) for e in out.early]))
    assert all(np.array_equal(r[0], results[0][0]) and r[1] == results[0][1] for r in results)


def test_max_norm_refuses_wild_fragments_before_and_after_training() -> None:
    early = new_state(max_norm=10.0)
    wild = np.full(D, 3e38, dtype=np.float32)
    big = FragmentBatch(RUN, 1, 2, K, FR.fingerprint, {f: FR.take(wild, f) for f in (1,)})
    assert early.receive(encode(big)) is Receipt.ACCEPTED  # its own fragments are not known yet
    assert early.receive(msg(1, 1, (0, 1))) is Receipt.ACCEPTED
    out = finish(early, vec(0, 1))
    assert out.report.refused == {"out_of_range": 1}
    assert np.array_equal(out.vector, aggregate(vec(0, 1), FR, received_of(msg(1, 1, (0, 1)))))
    late = new_state(max_norm=10.0)
    late.outgoing(vec(0, 1))
    with pytest.raises(WireError) as err:
        late.receive(encode(big))
    assert err.value.reason is Reason.OUT_OF_RANGE and late.report.fragments_in == 0
    assert late.receive(msg(1, 1, (0, 1))) is Receipt.ACCEPTED  # ordinary values pass


def reference_aggregate(own: np.ndarray, fr: Fragmentation, received: dict) -> np.ndarray:
    """The plain aggregation (one d-long float64 accumulator per fragment, gathered and scattered): the bits
    that the blocked, in-place `aggregate` must reproduce."""
    out = np.array(own, dtype=np.float32, copy=True)
    for f, ix in enumerate(fr.indices):
        senders = sorted(s for s, frags in received.items() if f in frags)
        if not senders:
            continue
        acc = own[ix].astype(np.float64)
        for sdr in senders:
            acc += received[sdr][f]
        acc /= 1 + len(senders)
        out[ix] = acc
    return out


def cancelling(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice([1e20, -1e20, 3.0, -1.5, 0.7, 1e-20], n).astype(np.float32)


@st.composite
def wide_rounds(draw: st.DrawFn) -> tuple[Fragmentation, np.ndarray, dict]:
    """Multi-tensor layouts, both strategies, some fragments sent by nobody; values that cancel (+-1e20 next to
    small ones), so that a change in the order of the float64 sums changes the float32 results."""
    shapes = draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    layout = Layout.from_pairs([(f"t{i}", (n,)) for i, n in enumerate(shapes)])
    k = draw(st.integers(1, min(layout.dim, 8)))
    fr = Fragmentation.build(layout, k, draw(st.integers(0, 2**32)), draw(st.sampled_from(["random", "contiguous"])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))

    def values(n: int) -> np.ndarray:
        return cancelling(rng, n)

    everyone = draw(st.booleans())
    received = {sdr: {f: values(fr.sizes[f]) for f in range(k) if everyone or rng.random() < 0.6}
                for sdr in draw(st.sets(st.integers(0, 50), max_size=10))}
    return fr, values(layout.dim), received


@SETTINGS
@given(wide_rounds(), st.integers(1, 40))
def test_blocked_aggregation_matches_the_plain_one_bit_for_bit(case: tuple[Fragmentation, np.ndarray, dict],
                                                               block: int) -> None:
    fr, own, received = case
    expected = reference_aggregate(own, fr, received)
    assert np.array_equal(bits(aggregate(own, fr, received, block=block)), bits(expected))
    assert np.array_equal(bits(aggregate(own, fr, received)), bits(expected))
    # what RoundState.finish does: the own fragments gathered for sending are summed from, not gathered again
    assert np.array_equal(bits(aggregate(own, fr, received, block=block, own_fragments=fr.views(own))),
                          bits(expected))
    # a small model per fragment takes the scatter path; both must give the plain aggregation's bits
    assert np.array_equal(bits(scattered(own, fr, received)), bits(expected))


def test_aggregation_across_blocks_of_the_default_size() -> None:
    from mosaic_proto.aggregation import BLOCK

    for k, strategy in ((1, "random"), (3, "random"), (2, "contiguous")):
        fr = Fragmentation.build(Layout.flat(2 * BLOCK + 77), k, seed=5, strategy=strategy)
        assert (fr.spans[0] is not None) == (k == 1 or strategy == "contiguous")
        rng = np.random.default_rng(k)
        own = cancelling(rng, fr.dim)
        received = {s: {f: cancelling(rng, fr.sizes[f]) for f in range(k) if (s + f) % 4} for s in range(8)}
        assert np.array_equal(bits(aggregate(own, fr, received)), bits(reference_aggregate(own, fr, received)))
    with pytest.raises(ValueError, match="block"):
        aggregate(own, fr, received, block=0)
    with pytest.raises(ValueError, match="own_fragments"):
        aggregate(own, fr, received, own_fragments=fr.views(own)[:-1])


def test_outgoing_encodes_contiguous_fragments_straight_from_the_vector() -> None:
    """K=1 and the contiguous strategy send slices of the trained vector (no gather); the bytes are those of
    the fragments `split` gives."""
    for fr in (Fragmentation.build(Layout.flat(D), 1, seed=3), Fragmentation.build(Layout.flat(D), K, 3, "contiguous"),
               FR):
        state = RoundState(node=0, round=1, members=MEMBERS, fragmentation=fr, sampler=SAMPLER, run_id=RUN)
        local = vec(0, 1)
        for m in state.outgoing(local):
            pieces = fr.split(local)
            want = encode(FragmentBatch(RUN, 1, 0, fr.k, fr.fingerprint, {f: pieces[f] for f in m.fragments}))
            assert m.payload == want


@pytest.mark.parametrize("block", [1000, 1 << 15])
def test_a_large_model_of_random_fragments_is_averaged_fragment_after_fragment_to_the_same_bits(block: int) -> None:
    """From PACK_FROM coordinates on, random fragments are averaged into one array laid out fragment after fragment
    and put back in place by one gather (`Fragmentation.unpack`): the plain aggregation's bits, with and without the
    own fragments gathered for sending, and a fragment nobody sent keeps the node's own values."""
    from mosaic_proto.fragmentation import PACK_FROM

    fr = Fragmentation.build(Layout.from_pairs([("w", (PACK_FROM // 100, 100)), ("b", (999,))]), 6, seed=9)
    assert all(span is None for span in fr.spans)
    rng = np.random.default_rng(3)
    own = cancelling(rng, fr.dim)
    received = {s: {f: cancelling(rng, fr.sizes[f]) for f in range(fr.k) if f != 4 and (s + f) % 3} for s in (0, 2, 7)}
    expected = reference_aggregate(own, fr, received)
    for own_fragments in (None, fr.views(own)):
        got = aggregate(own, fr, received, block=block, own_fragments=own_fragments)
        assert np.array_equal(bits(got), bits(expected))
    assert np.array_equal(bits(fr.take(got, 4)), bits(fr.take(own, 4)))

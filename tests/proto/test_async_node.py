"""AsyncNodeState and AsyncNetwork: asynchronous Mosaic's core (docs/spec.md, "Asynchronous mode")."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic_proto import Attack, Fragmentation, FragmentBatch, Layout, PeerSampler, Quadratic, consensus_distance
from mosaic_proto.async_network import AsyncNetwork
from mosaic_proto.async_node import (
    ASYNC_TRANSITIONS,
    AsyncNodeState,
    AsyncOutcome,
    AsyncPhase,
    AsyncSend,
    AsyncStateError,
    Exchange,
    SendQueue,
)
from mosaic_proto.compression import Compressed, Compression, Compressor
from mosaic_proto.profiles import NodeProfile

FOUR = Fragmentation.build(Layout.flat(4), 2, 0, "contiguous")  # fragment 0: coordinates 0-1, fragment 1: 2-3


def batch(sender: int, step: int, fragments: dict[int, list[float]], fr: Fragmentation = FOUR) -> FragmentBatch:
    return FragmentBatch("mosaic", step, sender, fr.k, fr.fingerprint,
                         {f: np.asarray(v, np.float32) for f, v in fragments.items()})


def node(rank: int = 0, n: int = 3, iterations: int = 3, **kw) -> AsyncNodeState:
    return AsyncNodeState(rank, range(n), FOUR, PeerSampler("local", 1, 0), iterations, np.zeros(4, np.float32),
                          planned_only=False, **kw)


def test_the_newest_copy_per_sender_and_fragment_is_averaged_with_the_nodes_own() -> None:
    """The spec's rule on a case checked by hand: x[C==k] = (own + newest copy of each sender) / (1 + senders)."""
    state = node()
    assert state.receive(batch(2, 1, {0: [6, 6]}), now=0.1) is AsyncOutcome.TAKEN
    assert state.receive(batch(2, 0, {0: [3, 3]}), now=0.2) is AsyncOutcome.STALE  # older than the one held
    assert state.receive(batch(1, 0, {0: [0, 3], 1: [4, 4]}), now=0.3) is AsyncOutcome.TAKEN
    assert state.inbox_depth() == 3
    done = state.trained(np.asarray([0, 0, 1, 1], np.float32), now=1.0)
    # fragment 0: (own [0,0] + sender 1's [0,3] + sender 2's newest [6,6]) / 3; fragment 1: ([1,1] + [4,4]) / 2
    assert done.vector.tolist() == [2.0, 3.0, 2.5, 2.5]
    assert done.outcome is AsyncOutcome.ITERATED and state.step == 1 and state.inbox_depth() == 0
    assert (done.report.messages_in, done.report.fragments_in, done.report.fragments_out) == (2, 3, 2)
    again = state.trained(done.vector, now=2.0)  # nothing arrived since: the node keeps its model
    assert again.vector.tolist() == done.vector.tolist()


def test_arrival_order_does_not_change_the_aggregate() -> None:
    copies = [batch(1, 0, {0: [1e8, 1]}), batch(2, 0, {0: [1, 3]}), batch(1, 1, {1: [5, 7]})]
    results = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        state = node()
        for i in order:
            state.receive(copies[i], now=0.0)
        results.append(state.trained(np.asarray([1, 2, 3, 4], np.float32), now=1.0).vector.tobytes())
    assert len(set(results)) == 1


def test_the_queue_sends_the_newest_copy_and_drops_what_a_newer_one_replaced() -> None:
    queue = SendQueue()
    queue.put(1, 0, {0: "a0", 1: "a1"}, {0: 8, 1: 8})
    queue.put(2, 0, {0: "b0"}, {0: 8})
    queue.put(1, 1, {1: "c1"}, {1: 8})  # supersedes fragment 1 of the unsent step-0 message to peer 1
    queue.put(2, 1, {0: "d0"}, {0: 8})  # supersedes the whole step-0 message to peer 2
    assert queue.superseded == 2 and len(queue) == 3
    assert queue.pop() == (1, 0, {0: "a0"}, 8, False)
    assert queue.pop() == (1, 1, {1: "c1"}, 8, False)
    assert queue.pop() == (2, 1, {0: "d0"}, 8, False)
    assert queue.pop() is None


def test_a_message_of_another_run_or_an_unplanned_fragment_is_refused_and_nothing_changes() -> None:
    fr = FOUR
    state = AsyncNodeState(0, range(4), fr, PeerSampler("local", 1, 0), 2, np.zeros(4, np.float32))
    plan = PeerSampler("local", 1, 0).planned(0, 3, 2, (0, 1, 2, 3))
    mine = plan.get(0, ())
    other = [f for f in range(2) if f not in mine]
    assert state.receive(FragmentBatch("other-run", 0, 3, 2, fr.fingerprint, {}), now=0) is AsyncOutcome.REFUSED
    assert state.receive(batch(0, 0, {0: [1, 1]}), now=0) is AsyncOutcome.REFUSED  # from itself
    assert state.receive(batch(3, 0, {other[0]: [1, 1]}), now=0) is AsyncOutcome.REFUSED  # not its to send here
    assert state.receive(batch(3, 0, {0: [1, 1]}), now=0, sender=2) is AsyncOutcome.REFUSED  # not who sent it
    assert state.inbox_depth() == 0 and state.counts["refused"] == 4
    if mine:
        assert state.receive(batch(3, 0, {mine[0]: [1, 1]}), now=0) is AsyncOutcome.TAKEN


def test_a_finished_node_ignores_what_comes_and_refuses_to_train_again() -> None:
    state = node(iterations=1)
    done = state.trained(np.ones(4, np.float32), now=1.0)
    assert done.outcome is AsyncOutcome.DONE and state.phase is AsyncPhase.FINISHED
    assert state.receive(batch(1, 0, {0: [5, 5]}), now=1.5) is AsyncOutcome.IGNORED
    with pytest.raises(AsyncStateError):
        state.trained(np.zeros(4, np.float32), now=2.0)
    assert state.step == 1 and state.vector.tolist() == [1, 1, 1, 1]
    assert state.next_send(2.0) is not None  # its queue still drains
    assert set(ASYNC_TRANSITIONS) == set(AsyncPhase)


def test_pairwise_nodes_both_keep_the_average_and_a_training_under_way_applies_its_change_to_it() -> None:
    fr = Fragmentation.build(Layout.flat(1), 1, 0)
    states = [AsyncNodeState(i, range(2), fr, PeerSampler("local", 1, 0), 2, np.asarray([2.0 * i], np.float32),
                             exchange=Exchange.PAIRWISE) for i in range(2)]
    steps = {0: 1.0, 1: 10.0}  # a step adds this to the model

    def train(node: int, step: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        return vector + np.float32(steps[node]), 0.0

    network = AsyncNetwork(states, train, [NodeProfile(), NodeProfile(slowdown=1.5)], 1.0)
    network.run_until(1.0)  # node 0: 0 + 1 = 1, then pairs with node 1 (at 2): both 1.5
    assert [s.vector.tolist() for s in states] == [[1.5], [1.5]]
    network.run_until(1.5)  # node 1 trained from 2: its +10 goes onto the average: 11.5; pairs with node 0: 6.5
    assert [s.vector.tolist() for s in states] == [[6.5], [6.5]]
    network.run()  # node 0 at 2: 6.5 + 1, paired: 7, and it is done; node 1 at 3: 7 + 10, and node 0 takes no pair
    assert network.done and all(s.finished for s in states)
    assert [s.vector.tolist() for s in states] == [[7.0], [17.0]] and states[1].counts["ignored"] == 0
    assert states[0].counts["ignored"] == 1


def run_quadratic(n: int, profiles: list[NodeProfile], seed: int = 0, k: int = 4, iterations: int = 6,
                  exchange: Exchange = Exchange.PUSH) -> AsyncNetwork:
    q = Quadratic.build(n, 16, "correlated", seed)
    fr = Fragmentation.build(Layout.flat(16), 1 if exchange is Exchange.PAIRWISE else k, seed)
    sampler = PeerSampler("local", 1 if exchange is Exchange.PAIRWISE else 2, seed)
    states = [AsyncNodeState(i, range(n), fr, sampler, iterations, q.initial(i), exchange=exchange)
              for i in range(n)]
    network = AsyncNetwork(states, q.train, profiles, 1.0)
    network.run()
    return network


def test_the_same_inputs_give_the_same_models_bit_for_bit_and_another_seed_others() -> None:
    profiles = [NodeProfile(latency=0.05), NodeProfile(bandwidth=40.0), NodeProfile(slowdown=2.5, latency=0.3)]
    first, again = run_quadratic(12, profiles), run_quadratic(12, profiles)
    assert [v.tobytes() for v in first.vectors] == [v.tobytes() for v in again.vectors]
    assert sum(s.queue.superseded for s in first.states) > 0  # the slow link's queue was superseded
    other = run_quadratic(12, profiles, seed=1)
    assert [v.tobytes() for v in first.vectors] != [v.tobytes() for v in other.vectors]


def test_a_slow_node_does_not_slow_the_others_and_gossip_still_converges() -> None:
    alike = run_quadratic(10, [NodeProfile()])
    slowed = run_quadratic(10, [NodeProfile(slowdown=10.0)] + [NodeProfile()] * 9)
    assert slowed.finished_at[0] == 60.0
    assert {i: t for i, t in slowed.finished_at.items() if i} == {i: t for i, t in alike.finished_at.items() if i}
    start = consensus_distance(np.stack([Quadratic.build(10, 16, "correlated", 0).initial(i) for i in range(10)]))
    assert consensus_distance(np.stack(alike.vectors)) < start / 4


def test_ad_psgd_converges_too() -> None:
    network = run_quadratic(10, [NodeProfile()], exchange=Exchange.PAIRWISE, iterations=10)
    start = consensus_distance(np.stack([Quadratic.build(10, 16, "correlated", 0).initial(i) for i in range(10)]))
    assert consensus_distance(np.stack(network.vectors)) < start / 4
    assert all(s.counts["averaged"] >= 10 for s in network.states)  # its own 10 pairs, and those it was asked for


def test_the_status_counts_the_inbox_the_queue_and_the_staleness_of_the_last_aggregation() -> None:
    """`AsyncNodeStatus` on a case checked by hand: lag = the receiver's step less the copy's, wait = aggregation
    time less arrival time (docs/spec.md)."""
    state = node(rank=0, n=3)
    before = state.status(now=0.0)
    assert (before.steps, before.inbox, before.queue, before.last_aggregation) == (0, 0, 0, None)
    assert before.inbox_oldest_s is None and before.inbox_per_fragment == (0, 0)
    state.receive(batch(2, 1, {0: [6, 6]}), now=0.1)  # a sender one step ahead
    state.receive(batch(1, 0, {0: [0, 3], 1: [4, 4]}), now=0.3)
    waiting = state.status(now=0.5)
    assert (waiting.inbox, waiting.inbox_per_fragment) == (3, (2, 1))
    assert waiting.inbox_oldest_s == pytest.approx(0.4)
    state.trained(np.zeros(4, np.float32), now=1.0)
    after = state.status(now=1.0)
    assert (after.steps, after.inbox, after.inbox_oldest_s) == (1, 0, None)
    assert after.queue == 2 and after.queue_fragments == 2  # each fragment to one peer (fanout 1, local sampler)
    last = after.last_aggregation
    assert (last.step, last.copies, last.senders, last.lag_steps_max) == (0, 3, 2, 0)
    assert last.lag_steps_mean == pytest.approx(-1 / 3)
    assert (last.wait_s_mean, last.wait_s_max) == (pytest.approx((0.9 + 0.7 + 0.7) / 3), pytest.approx(0.9))
    state.trained(np.zeros(4, np.float32), now=2.0)  # nothing came: no copy, no age
    empty = state.status(now=2.0).last_aggregation
    assert (empty.step, empty.copies, empty.lag_steps_mean, empty.wait_s_max) == (1, 0, None, None)


def sent(state: AsyncNodeState) -> dict[int, dict[int, object]]:
    """What the node's queue holds, drained: receiver -> fragment -> what travels."""
    out: dict[int, dict[int, object]] = {}
    while (message := state.next_send(now=5.0)) is not None:
        out.setdefault(message.peer, {}).update(message.batch.fragments)
    return out


def inbox_of_two(state: AsyncNodeState) -> AsyncNodeState:
    state.receive(batch(2, 1, {0: [6, 6]}), now=0.1)
    state.receive(batch(1, 0, {0: [0, 3], 1: [4, 4]}), now=0.3)
    return state


def test_a_node_sends_its_trained_model_by_default_and_the_aggregate_with_async_send_aggregated() -> None:
    """--async-send (docs/spec.md, "Asynchronous mode", steps 2-3): the fragments queued are those of the model
    after the local steps (`trained`, the default), or of the aggregate (`aggregated`); either way the node keeps
    the aggregate as its model. The case of the first test: the aggregate is [2, 3, 2.5, 2.5]."""
    local = np.asarray([0, 0, 1, 1], np.float32)
    default, aggregated = inbox_of_two(node()), inbox_of_two(node(send=AsyncSend.AGGREGATED))
    assert default.send is AsyncSend.TRAINED
    kept = [default.trained(local, now=1.0).vector, aggregated.trained(local, now=1.0).vector]
    assert [v.tolist() for v in kept] == [[2.0, 3.0, 2.5, 2.5]] * 2
    assert default.vector.tolist() == aggregated.vector.tolist() == [2.0, 3.0, 2.5, 2.5]
    for state, model in ((default, local), (aggregated, kept[1])):
        queued = sent(state)
        assert sorted(f for frags in queued.values() for f in frags) == [0, 1]  # fanout 1: each fragment once
        for frags in queued.values():
            for f, values in frags.items():
                assert np.asarray(values).tolist() == FOUR.take(model, f).tolist(), (state.send, f)


def test_sending_the_trained_model_compresses_it_and_aggregates_with_the_stand_in_as_a_barrier_round_does() -> None:
    """topk with error feedback and `trained`: what travels is the top coordinates of the trained model (error
    feedback runs over the models sent, as in a barrier round), and the sparse copies that came are averaged with
    the stand-in (the newest value heard of each coordinate), whose coordinates the copies carried are theirs."""
    compressor = Compressor(Compression.parse("topk:0.5"), seed=0, node=0, error_feedback=True)
    state = node(compressor=compressor)
    copy = Compressor(Compression.parse("topk:0.5"), seed=0, node=1, error_feedback=True).compress(
        np.asarray([8, 0], np.float32), round=0, fragment=0)
    state.receive(FragmentBatch("mosaic", 0, 1, 2, FOUR.fingerprint, {0: copy}, "topk"), now=0.5)
    local = np.asarray([1, -3, 0.5, 2], np.float32)
    done = state.trained(local, now=1.0)
    queued = [values for frags in sent(state).values() for values in frags.values()]
    assert all(isinstance(v, Compressed) for v in queued)
    # each fragment's larger coordinate of the trained model: -3 (fragment 0), 2 (fragment 1)
    assert sorted(float(v.values[0]) for v in queued) == [-3.0, 2.0]
    # fragment 0: own [1, -3] and the copy [8, stand-in -3] -> [4.5, -3]; fragment 1 heard nothing: its own
    assert done.vector.tolist() == [4.5, -3.0, 0.5, 2.0]


def test_max_norm_refuses_a_message_with_a_fragment_over_the_bound_and_takes_one_under() -> None:
    """--max-norm acts on the inbox as on a barrier round: a message with a fragment whose norm is over max_norm times
    that fragment's of the node's model now is refused whole (OUT_OF_RANGE), counted, and never averaged."""
    state = AsyncNodeState(0, range(3), FOUR, PeerSampler("local", 1, 0), 3, np.ones(4, np.float32),
                           planned_only=False, max_norm=10.0)  # each fragment's own norm: sqrt(2); bound 14.1
    assert state.receive(batch(1, 0, {0: [9, 9]}), now=0.1) is AsyncOutcome.TAKEN  # norm 12.7: under
    assert state.receive(batch(2, 0, {0: [1, 1], 1: [15, 0]}), now=0.2) is AsyncOutcome.OUT_OF_RANGE  # 15: over
    assert state.inbox_depth() == 1 and state.counts["out_of_range"] == state.counts["refused"] == 1
    view = state.status(0.3)
    assert (view.refused, view.out_of_range) == (1, 1)
    done = state.trained(np.ones(4, np.float32), now=1.0)
    assert done.vector.tolist() == [5.0, 5.0, 1.0, 1.0]  # sender 2's fragments, the one under the bound too, left out
    assert done.report.refused == {"out_of_range": 1} and done.report.messages_in == 1
    # the bound follows the node's model: fragment 0 is now of norm 7.07, so 15 is under it, and 100 is over
    assert state.receive(batch(2, 1, {0: [15, 0]}), now=1.1) is AsyncOutcome.TAKEN
    assert state.receive(batch(1, 1, {0: [100, 0]}), now=1.2) is AsyncOutcome.OUT_OF_RANGE
    assert state.trained(done.vector, now=2.0).report.refused == {"out_of_range": 1}
    unguarded = node()
    assert unguarded.receive(batch(2, 0, {1: [1e9, 0]}), now=0.0) is AsyncOutcome.TAKEN  # none: nothing refused
    with pytest.raises(ValueError, match="max_norm needs exchange push"):
        AsyncNodeState(0, range(2), Fragmentation.build(Layout.flat(1), 1, 0), PeerSampler("local", 1, 0), 2,
                       np.zeros(1, np.float32), exchange=Exchange.PAIRWISE, max_norm=10.0)


def guarded_network(max_norm: float | None, attack: bool) -> AsyncNetwork:
    """10 nodes on the quadratic, node 3 sending its fragments scaled 1000x (with `attack`), each node's --max-norm."""
    q = Quadratic.build(10, 16, "correlated", 0)
    fr, sampler = Fragmentation.build(Layout.flat(16), 4, 0), PeerSampler("local", 2, 0)
    liar = Attack.of("scale", 0, 3, 10, 1, 1000.0) if attack else None
    states = [AsyncNodeState(i, range(10), fr, sampler, 6, q.initial(i), max_norm=max_norm,
                             attack=liar if i == 3 else None) for i in range(10)]
    network = AsyncNetwork(states, q.train, [NodeProfile(latency=0.05), NodeProfile(slowdown=1.5)], 1.0)
    network.run()
    return network


def test_max_norm_keeps_the_models_where_nothing_is_over_it_and_guards_them_against_a_scaling_attacker() -> None:
    def models(network: AsyncNetwork) -> list[bytes]:
        return [v.tobytes() for v in network.vectors]

    plain, loose = guarded_network(None, False), guarded_network(1e6, False)
    assert models(plain) == models(loose) and sum(s.counts["out_of_range"] for s in loose.states) == 0
    attacked, guarded, again = guarded_network(None, True), guarded_network(10.0, True), guarded_network(10.0, True)
    assert models(guarded) == models(again)  # deterministic, bit for bit
    refused = [s.counts["out_of_range"] for s in guarded.states]
    assert refused[3] == 0 and sum(refused) > 0  # the honest nodes refused the attacker's messages
    honest = [i for i in range(10) if i != 3]
    spread = [consensus_distance(np.stack([n.vectors[i] for i in honest])) for n in (plain, attacked, guarded)]
    assert spread[1] > 100 * spread[0] and spread[2] < 2 * spread[0]  # what the guard kept out moved the others

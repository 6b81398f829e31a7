"""NodeState (one node's side of the protocol over a run, no I/O): the phase table, refusals, and n NodeStates with
one BarrierState exchanging bytes in memory, which must give InMemoryNetwork's models bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mosaic_proto import (
    NODE_TRANSITIONS,
    SNAPSHOTS_KEPT,
    BarrierState,
    Fragmentation,
    InMemoryNetwork,
    Layout,
    NodeInput,
    NodeOutcome,
    NodePhase,
    NodeRefused,
    NodeReport,
    NodeState,
    NodeStateError,
    PeerSampler,
    Quadratic,
    Reason,
    ReportError,
    WireError,
)
from mosaic_proto.round import TRAFFIC, Traffic

N, D, K, S, ROUNDS = 6, 12, 3, 2, 8
FR = Fragmentation.build(Layout.flat(D), K, 4, "random")
SAMPLER = PeerSampler("local", S, 4)
Q = Quadratic.build(N, D, "correlated", seed=4, lr=0.05, local_steps=1)


def started(rank: int = 0, **kwargs: object) -> NodeState:
    state = NodeState(**kwargs)  # type: ignore[arg-type]
    state.registered(rank, [f"h:{i + 1}" for i in range(N)], range(N), 0, "node-test", 0.0)
    state.start(FR, SAMPLER, Q.initial(rank))
    return state


def test_every_phase_has_a_row_every_input_and_outcome_is_used_and_the_end_phases_lead_nowhere_else() -> None:
    assert set(NODE_TRANSITIONS) == set(NodePhase)
    assert {i for row in NODE_TRANSITIONS.values() for i in row} == set(NodeInput)
    assert {o for row in NODE_TRANSITIONS.values() for outcomes in row.values() for o in outcomes} == set(NodeOutcome)
    for end in (NodePhase.FINISHED, NodePhase.LEFT):
        assert {to for outcomes in NODE_TRANSITIONS[end].values() for to in outcomes.values()} == {end}
    reachable, frontier = {NodePhase.REGISTERING, NodePhase.REJOINING}, [NodePhase.REGISTERING, NodePhase.REJOINING]
    while frontier:
        for outcomes in NODE_TRANSITIONS[frontier.pop()].values():
            for to in outcomes.values():
                if to not in reachable:
                    reachable.add(to)
                    frontier.append(to)
    assert reachable == set(NodePhase)
    # an input that moves nothing (IGNORED, REFUSED) leaves the phase where it is
    assert all(to is phase for phase, row in NODE_TRANSITIONS.items() for outcomes in row.values()
               for outcome, to in outcomes.items() if outcome in (NodeOutcome.IGNORED, NodeOutcome.REFUSED))


def test_a_round_moves_through_its_phases_in_order() -> None:
    state = started(0)
    assert state.phase is NodePhase.TRAINING and state.round == 0
    sending = state.outgoing(Q.initial(0), 0.0)
    messages = sending.messages
    assert state.phase is NodePhase.SENDING and messages and sending.outcome is NodeOutcome.NOTED
    report = state.sent({m.peer: (len(m.fragments), len(m.payload)) for m in messages}, [], 1.5, loss=0.25,
                        train_s=0.1, aggregate_s=0.125)
    assert state.phase is NodePhase.WAITING
    assert (report.round, report.loss, report.send_s, report.train_s, report.aggregate_s) == (0, 0.25, 1.5, 0.1, 0.125)
    assert report.messages_out == len(messages) and set(report.delivered) == {m.peer for m in messages}
    advance = state.released(range(N), {}, [5], 4.0)
    assert state.phase is NodePhase.TRAINING and state.round == 1 and advance.outcome is NodeOutcome.AGGREGATED
    assert advance.report.wait_s == 2.5 and advance.report.stragglers == (5,)
    assert state.last_report == advance.report and state.model() == (0, advance.vector)


@pytest.mark.parametrize("call", ["released", "sent", "finished", "left", "dropped", "rejoining", "registered"])
def test_calls_out_of_order_are_refused_and_change_nothing(call: str) -> None:
    state = started()
    args = {"released": (range(N), {}, [], 0.0), "sent": ({}, [], 0.0),
            "registered": (4, ["h:1"], [4], 7, "other", 0.0)}.get(call, ())
    with pytest.raises((NodeStateError, AssertionError)):
        getattr(state, call)(*args)
    assert state.phase is NodePhase.TRAINING and state.round == 0 and state.rank == 0 and state.run_id == "node-test"
    assert not state.phases.allows(NodeInput(call if call != "rejoining" else "rejoin"))


def test_the_final_arrival_waits_in_its_own_phase_and_ends_finished_or_dropped() -> None:
    for end, phase in (("finished", NodePhase.FINISHED), ("dropped", NodePhase.DROPPED)):
        state = started()
        state.finishing()
        assert state.phase is NodePhase.FINISHING and not state.takes_fragments and not state.gone
        with pytest.raises(NodeStateError):
            state.released(range(N), {}, [], 0.0)
        getattr(state, end)()
        assert state.phase is phase


def test_a_release_that_says_the_run_failed_ends_the_node_finished_in_one_step() -> None:
    state = started()
    state.outgoing(Q.initial(0), 0.0)
    state.sent({}, [], 0.0)
    advance = state.released(range(N), {}, [], 0.0, failure="too few members")
    assert advance.outcome is NodeOutcome.FAILED and advance.failure == "too few members" and not advance.left_out
    assert state.phase is NodePhase.FINISHED and state.gone and state.round == 1 and state.model(0) is not None
    with pytest.raises(NodeRefused) as refused:
        state.receive(b"\xa0")
    assert refused.value.reason == "finished" and not refused.value.retry
    assert state.leaving() is NodeOutcome.IGNORED  # nothing to tell: the run is over
    assert state.dropped() is NodeOutcome.IGNORED
    assert state.phase is NodePhase.FINISHED


def test_outgoing_before_the_model_is_known_is_refused_as_a_decision_and_changes_nothing() -> None:
    state = NodeState()
    sending = state.outgoing(np.zeros(D, np.float32), 0.0)
    assert sending.outcome is NodeOutcome.REFUSED and not sending.messages and "registering" in sending.why
    assert state.phase is NodePhase.REGISTERING
    with pytest.raises(NodeStateError):
        state.start(FR, SAMPLER)  # before registered()


def test_a_node_not_yet_taking_fragments_refuses_with_a_retry_reason() -> None:
    registering, rejoining = NodeState(), NodeState(rejoining=True)
    for state, phase, reason in ((registering, NodePhase.REGISTERING, "not_ready"),
                                 (rejoining, NodePhase.REJOINING, "rejoining")):
        assert state.phase is phase
        with pytest.raises(NodeRefused) as refused:
            state.receive(b"\xa0")
        assert refused.value.reason == reason and refused.value.retry


@pytest.mark.parametrize("rejoining", [False, True])
def test_a_node_the_barrier_places_later_refuses_its_open_rounds_fragments_for_good(rejoining: bool) -> None:
    """Issue #61: a node started again with no state (or with its member note) that the barrier answers is a member's
    new incarnation sits out the open round: it refuses fragments with `rejoining`, not to be retried (409), so that
    senders who count it as starting (round 0) give them up too; then it registers from the next round."""
    state = NodeState(rejoining=rejoining)
    state.sitting_out()
    assert state.phase is NodePhase.SITTING_OUT and state.restarting
    with pytest.raises(NodeRefused) as refused:
        state.receive(b"\xa0")
    assert refused.value.reason == "rejoining" and not refused.value.retry
    assert state.refusal.reason == "rejoining" and not state.refusal.retry
    addresses = [f"h:{i + 1}" for i in range(N)]
    assert state.registered(2, addresses, range(N), 1, "node-test", 0.0) is NodeOutcome.NOTED
    assert state.phase is NodePhase.REJOINING and state.refusal.retry  # placed: starting in its round, as any member
    state.start(FR, SAMPLER, Q.initial(0))
    assert state.phase is NodePhase.TRAINING and state.round == 1


def test_a_checkpoint_found_by_a_node_of_a_run_at_round_0_is_an_earlier_runs_and_it_starts_anew() -> None:
    """A restarted node with a checkpoint refuses fragments at once (retry) until it is ready: they are of rounds it
    lost. A run at round 0 has lost none (its own checkpoints are of round 1 on): the node registers like the rest,
    and fragments wait for its model; refused, a slow starter's peers used up their retries and the run lost them."""
    addresses = [f"h:{i + 1}" for i in range(N)]
    fresh, late = NodeState(rejoining=True), NodeState(rejoining=True)
    assert fresh.registered(0, addresses, range(N), 0, "node-test", 0.0) is NodeOutcome.NEW_RUN
    assert late.registered(0, addresses, range(N), 3, "node-test", 0.0) is NodeOutcome.NOTED
    assert fresh.phase is NodePhase.REGISTERING and late.phase is NodePhase.REJOINING
    fresh.start(FR, SAMPLER, Q.initial(0))
    assert fresh.phase is NodePhase.TRAINING and fresh.round == 0


def test_a_finished_node_refuses_for_good() -> None:
    state = started()
    state.finishing()
    with pytest.raises(NodeRefused) as refused:
        state.receive(b"\xa0")
    assert refused.value.reason == "finished" and not refused.value.retry
    state.finished()
    assert state.phase is NodePhase.FINISHED
    with pytest.raises(NodeRefused) as refused:
        state.receive(b"\xa0")
    assert refused.value.reason == "finished" and not refused.value.retry


def test_a_refused_message_is_counted_in_the_next_report() -> None:
    state, sender = started(0), started(1)
    message = next(m for m in sender.outgoing(Q.initial(1), 0.0).messages if m.peer == 0)
    state.receive(message.payload)
    with pytest.raises(WireError) as refused:
        state.receive(message.payload)
    assert refused.value.reason is Reason.DUPLICATE_FRAGMENT
    state.outgoing(Q.initial(0), 0.0)
    report = state.sent({}, [], 0.0)
    assert report.refused == {"duplicate_fragment": 1} and report.messages_in == 1


def test_a_node_left_out_of_the_next_round_is_dropped_and_can_rejoin() -> None:
    state = started(2)
    state.outgoing(Q.initial(2), 0.0)
    state.sent({}, [], 0.0)
    advance = state.released([0, 1, 3, 4, 5], {}, [2], 0.0, failure="also failed")  # left out comes first
    assert advance.left_out and advance.outcome is NodeOutcome.LEFT_OUT
    assert state.phase is NodePhase.DROPPED
    with pytest.raises(NodeRefused):
        state.receive(b"\xa0")
    state.rejoining()
    assert state.phase is NodePhase.REJOINING and state.rank == -1
    assert state.leaving() is NodeOutcome.IGNORED and state.phase is NodePhase.REJOINING  # not registered: nobody
    outcome = state.registered(2, [f"h:{i + 1}" for i in range(N)], range(N), 3, "node-test", 0.0)
    assert outcome is NodeOutcome.READMITTED  # it has the model: it goes on at once
    assert state.phase is NodePhase.TRAINING and state.round == 3 and state.takes_fragments


def test_the_members_that_may_still_be_starting_are_those_placed_with_this_nodes_own_news() -> None:
    """`starting`: every member of the round a node registered at (all were answered at once), then the members a
    release names as joined: a sender waits within its budget for those that answer `rejoining`, and gives the
    others' fragments up at once (they came back, and are members from a later round)."""
    state = started(0)
    assert state.starting == frozenset(range(N))
    state.outgoing(Q.initial(0), 0.0)
    state.sent({}, [], 0.0)
    state.released(range(N), {3: "h:4"}, [], 0.0)
    assert state.starting == {3}
    state.outgoing(Q.initial(0), 0.0)
    state.sent({}, [], 0.0)
    state.released(range(N), {}, [], 0.0)
    assert state.starting == frozenset()


def test_leaving_is_possible_from_any_live_phase_and_final() -> None:
    for prepare in (lambda s: None, lambda s: s.outgoing(Q.initial(0), 0.0)):
        state = started()
        prepare(state)
        assert state.leaving() is NodeOutcome.NOTED
        assert state.dropped() is NodeOutcome.IGNORED and state.phase is NodePhase.LEAVING  # heard while leaving
        state.left()
        assert state.phase is NodePhase.LEFT
        assert state.leaving() is NodeOutcome.IGNORED  # a second signal changes nothing
        assert state.phase is NodePhase.LEFT
        assert state.outgoing(Q.initial(0), 0.0).outcome is NodeOutcome.REFUSED


def test_only_the_last_snapshots_are_kept() -> None:
    state = started()
    for _ in range(SNAPSHOTS_KEPT + 2):
        state.outgoing(state.vector if state.vector is not None else Q.initial(0), 0.0)
        state.sent({}, [], 0.0)
        state.released(range(N), {}, [], 0.0)
    assert sorted(state.snapshots) == list(range(2, SNAPSHOTS_KEPT + 2))
    assert state.model(0) is None and state.model(4) is not None


def test_reports_round_trip_through_json_and_malformed_ones_are_refused() -> None:
    report = NodeReport(3, loss=0.5, traffic=Traffic(messages_out=2), refused={"stale_round": 1},
                        delivered={4: (2, 100)}, wait_s=0.25, stragglers=(1,))
    again = NodeReport.from_json(report.to_json(), 3)
    assert again == report and again.messages_out == again.traffic.messages_out == 2
    assert list(report.to_json()) == ["round", "loss", *TRAFFIC, "refused", "train_s", "send_s", "wait_s",
                                      "aggregate_s", "delivered", "stragglers"]  # the wire's order, flat
    assert math.isnan(NodeReport.from_json(NodeReport(3).to_json(), 3).loss)
    for bad in ({"round": 2}, {"round": 3, "loss": "x"}, {"round": 3, "delivered": {"x": [1, 2]}},
                {"round": 3, "refused": {"a": -1}}, {"round": 3, "bytes_out": 2**70}, [3]):
        with pytest.raises(ReportError):
            NodeReport.from_json(bad, 3)


def test_node_states_and_a_barrier_in_memory_give_the_reference_models() -> None:
    """The daemon's path (NodeState per node, reports to a BarrierState, its releases back) is the reference's."""
    reference = InMemoryNetwork([Q.initial(i) for i in range(N)], FR, SAMPLER, Q.train, run_id="node-test")
    reference.run(ROUNDS)
    barrier = BarrierState(rounds=ROUNDS, round_deadline=10, drop_after=2, expected=N)
    for i in range(N):
        barrier.register(f"h:{i + 1}", 0.0)
    barrier.close(0.0)
    nodes = [started(i) for i in range(N)]
    vectors = [Q.initial(i) for i in range(N)]
    for t in range(ROUNDS):
        outgoing = {}
        for i, node in enumerate(nodes):
            local, loss = Q.train(i, t, vectors[i])
            outgoing[i] = (node.outgoing(local, 0.0).messages, loss)
        release = None
        for i, (messages, loss) in outgoing.items():
            for message in messages:
                nodes[message.peer].receive(message.payload, sender=i)
            report = nodes[i].sent({m.peer: (len(m.fragments), len(m.payload)) for m in messages}, [], 0.0, loss)
            release = barrier.arrive(i, t, 0.0, NodeReport.from_json(report.to_json(), t)) or release
        assert release is not None and release.round == t
        for i, node in enumerate(nodes):
            vectors[i] = node.released(release.members, {}, release.stragglers, 0.0).vector
    for i, node in enumerate(nodes):
        node.finishing()
        assert np.array_equal(vectors[i], reference.vectors[i]), i
    assert all(barrier.arrive(i, ROUNDS, 0.0) is None for i in range(N - 1))
    assert barrier.arrive(N - 1, ROUNDS, 0.0).finished


def test_older_snapshots_are_kept_only_for_the_evaluated_rounds_and_their_metrics_go_with_them() -> None:
    evaluated = {1, 4}
    state = NodeState()
    state.registered(0, [f"h:{i + 1}" for i in range(N)], range(N), 0, "node-test", 0.0)
    state.start(FR, SAMPLER, Q.initial(0), evaluated=evaluated.__contains__)
    for t in range(6):
        state.outgoing(state.vector, 0.0)
        state.sent({}, [], 0.0)
        state.keep_metrics(t, {"values": {"loss": float(t)}})
        state.released(range(N), {}, [], 0.0)
        expected = sorted({t, *(e for e in evaluated if t - SNAPSHOTS_KEPT < e < t)})
        assert sorted(state.snapshots) == sorted(state.snapshots.metrics) == expected
        assert state.model()[1] is state.vector  # the newest: the node's model, no copy
    resumed = NodeState(rejoining=True)
    resumed.registered(0, [f"h:{i + 1}" for i in range(N)], range(N), 3, "node-test", 0.0)
    resumed.start(FR, SAMPLER, evaluated=evaluated.__contains__)
    resumed.begin(Q.initial(0), kept_as=2, before=Q.initial(1))  # round 1's model: evaluated, kept
    assert sorted(resumed.snapshots) == [1, 2]
    again = NodeState(rejoining=True)
    again.registered(0, [f"h:{i + 1}" for i in range(N)], range(N), 4, "node-test", 0.0)
    again.start(FR, SAMPLER, evaluated=evaluated.__contains__)
    again.begin(Q.initial(0), kept_as=3, before=Q.initial(1))  # round 2's model: nobody asks for it
    assert sorted(again.snapshots) == [3]

"""BarrierState: registration, releases, deadlines, stragglers and drops, with no I/O; and the in-memory network
driving it through the same decisions a deployed barrier makes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mosaic_proto import (
    BARRIER_TRANSITIONS,
    NODE_COLUMNS,
    STOP_HOLD_S,
    BarrierError,
    BarrierInput,
    BarrierOutcome,
    BarrierPhase,
    BarrierPhases,
    BarrierState,
    BarrierStateError,
    CountRule,
    Failure,
    Fragmentation,
    Held,
    InMemoryNetwork,
    Joined,
    Layout,
    Left,
    NodeReport,
    PeerSampler,
    Quadratic,
    Registration,
    ReleaseNotice,
    received_counts,
    resume_point,
)
from mosaic_proto.round import RoundReport, Traffic


def running(n: int = 4, rounds: int = 10, deadline: float = 5.0, drop_after: int = 2,
            min_members: int | None = None) -> BarrierState:
    state = BarrierState(rounds=rounds, round_deadline=deadline, drop_after=drop_after, expected=n)
    for i in reversed(range(n)):
        assert state.register(f"10.0.0.{i + 1}:9000", 0.0) is None
    assert state.complete
    state.close(0.0, min_members)
    return state


def test_registration_ranks_are_sorted_addresses_and_closes_once() -> None:
    state = BarrierState(rounds=3, round_deadline=1, drop_after=2, expected=3)
    for address in ("10.0.0.10:1", "10.0.0.9:1", "host-b:1"):
        assert state.register(address, 0.0) is None
    assert state.complete
    assert state.close(1.0).addresses == ("10.0.0.9:1", "10.0.0.10:1", "host-b:1")
    assert state.register("10.0.0.10:1", 2.0, waited=True) == 1 and not state.complete  # the long poll's answer
    again = state.register("10.0.0.10:1", 2.0)  # once the run goes on: the member started again, in round 0 too
    assert isinstance(again, Joined) and again.incarnation and (again.rank, again.round, again.from_round) == (1, 0, 1)
    assert state.live == [0, 2] and state.joining == [1]
    assert not state.register("10.0.0.10:1", 2.5).incarnation  # asked again: it waits for its place
    state.arrive(0, 0, 3.0)
    assert state.arrive(2, 0, 3.0).joined == (1,)  # round 0 released while it asked again: placed from round 1
    assert state.register("10.0.0.10:1", 3.1) == 1 and state.round == 1 and 1 in state.live  # asked: there it is
    with pytest.raises(BarrierError) as err:
        state.register("10.0.0.11:1", 2.0)
    assert err.value.reason == "registration_closed"
    with pytest.raises(BarrierError) as err:
        BarrierState(rounds=1, round_deadline=1, drop_after=1, expected=1).register("no port", 0.0)
    assert err.value.reason == "bad_address"


def test_a_node_that_withdraws_before_the_roster_is_made_is_not_in_it() -> None:
    state = BarrierState(rounds=3, round_deadline=1, drop_after=2, expected=3)
    for address in ("a:1", "b:1"):
        state.register(address, 0.0)
    assert state.withdraw("a:1").to_json() == {"withdrawn": "a:1", "registered": 1}
    assert state.withdraw("a:1") is None and state.withdraw("never:1") is None
    assert state.register("c:1", 1.0) is None and not state.complete  # 2 of 3: b and c
    assert state.register("d:1", 1.0) is None and state.complete
    assert state.close(2.0).addresses == ("b:1", "c:1", "d:1")
    assert state.withdraw("b:1") is None  # a member now: it leaves as one


def test_failed_registration_refuses_later_nodes() -> None:
    state = BarrierState(rounds=3, round_deadline=1, drop_after=2, expected=3)
    state.register("a:1", 0.0)
    state.fail("deadline passed")
    assert state.phase is BarrierPhase.FAILED
    with pytest.raises(BarrierError) as err:
        state.register("b:1", 1.0)
    assert (err.value.reason, err.value.detail) == ("registration_failed", "deadline passed")


def test_round_releases_when_every_member_arrived() -> None:
    state = running(3)
    assert state.deadline == 5.0  # from the round's opening (the roster, at 0.0)
    assert state.arrive(2, 0, 1.0) is None and state.arrive(0, 0, 1.5) is None
    release = state.arrive(1, 0, 2.0, {"round": 0})
    assert release is not None and (release.round, release.members, release.stragglers) == (0, (0, 1, 2), ())
    assert state.round == 1 and state.deadline == 7.0  # round 1 opened with round 0's release
    assert state.closed[0][1] == (0.0, {"round": 0}) and state.closed[0][2][0] == 1.0  # waited 1 s
    assert state.arrive(1, 0, 3.0) is None and state.released[0] is release  # a retry: contact only, its answer kept


def test_deadline_makes_stragglers_and_drop_after_drops() -> None:
    state = running(4, deadline=5.0, drop_after=2)
    for r in (0, 1, 2):
        state.arrive(r, 0, 1.0)
    assert state.tick(4.9) is None
    first = state.tick(5.0)
    assert first is not None and first.stragglers == (3,) and first.dropped == () and first.members == (0, 1, 2, 3)
    state.arrive(3, 0, 6.0)  # late: gets the release it missed, and counts as contact only
    for r in (0, 1, 2):
        state.arrive(r, 1, 7.0)
    second = state.tick(10.0)
    assert second is not None and second.stragglers == (3,) and second.dropped == (3,)
    assert second.members == (0, 1, 2) and state.live == [0, 1, 2]
    with pytest.raises(BarrierError) as err:
        state.arrive(3, 2, 26.0)
    assert err.value.reason == "dropped"
    assert [e.round for e in state.events] == [0, 1]


def test_a_member_that_arrives_again_is_no_longer_missing() -> None:
    state = running(3, drop_after=2)
    state.arrive(0, 0, 0.0)
    state.arrive(1, 0, 0.0)
    assert state.tick(5.0).stragglers == (2,)
    for r in range(3):
        state.arrive(r, 1, 6.0)
    state.arrive(0, 2, 7.0)
    state.arrive(1, 2, 7.0)
    assert state.tick(11.0).dropped == ()  # missed rounds 0 and 2, not two in a row


@pytest.mark.parametrize("rank, round, reason", [
    (9, 0, "unknown_rank"), (0, 11, "bad_round"), (0, 1, "future_round")])
def test_refused_arrivals_change_nothing(rank: int, round: int, reason: str) -> None:
    state = running(3)
    state.arrive(1, 0, 1.0)
    before = (state.round, dict(state._open.arrivals), state.deadline)
    with pytest.raises(BarrierError) as err:
        state.arrive(rank, round, 2.0)
    assert err.value.reason == reason
    assert (state.round, dict(state._open.arrivals), state.deadline) == before


def test_rounds_released_long_ago_are_refused_not_counted() -> None:
    state = running(2, rounds=20)
    for t in range(6):
        state.arrive(0, t, t)
        state.arrive(1, t, t)
    with pytest.raises(BarrierError) as err:
        state.arrive(0, 1, 7.0)
    assert err.value.reason == "stale_round" and state._open.arrivals == {}


def test_final_arrival_finishes_the_run() -> None:
    state = running(2, rounds=1)
    state.arrive(0, 0, 0.0)
    state.arrive(1, 0, 0.0)
    state.arrive(0, 1, 1.0)
    final = state.arrive(1, 1, 1.0)
    assert final is not None and final.finished and state.phase is BarrierPhase.FINISHED
    assert [m.last_round for m in state.members.values()] == [0, 0]  # the last round each finished


def test_received_counts_sum_the_senders_deliveries() -> None:
    reports = {0: NodeReport(0, delivered={1: (2, 100), 2: (1, 50)}), 1: NodeReport(0, delivered={2: (3, 120)}),
               2: None}
    assert received_counts(reports) == {1: (1, 2, 100), 2: (2, 4, 170)}


@pytest.mark.parametrize("refused", [{}, {"wrong_run": 2, "clipped": 3}])
def test_a_reports_nodes_csv_row_is_its_json_in_the_columns_order(refused: dict[str, int]) -> None:
    """`NodeReport.row`, written out field by field for speed, says what `to_json` says, in NODE_COLUMNS' order."""
    traffic = RoundReport(5, messages_out=4, fragments_out=16, bytes_out=1000, messages_in=3, fragments_in=12,
                          bytes_in=900, fragments_unsent=4, raw_bytes_out=1024)
    traffic.refused.update({k: v for k, v in refused.items() if k == "wrong_run"})
    traffic.cut.update({k: v for k, v in refused.items() if k == "clipped"})
    report = NodeReport.of_traffic(traffic, loss=0.25, train_s=1.5, send_s=0.5, aggregate_s=0.1).with_release(
        0.2, (3,), bytes_in=950)
    row, data = report.row(7), report.to_json()
    assert tuple(row) == NODE_COLUMNS
    assert row == {**{c: data[c] for c in NODE_COLUMNS if c in data}, "node": 7, "refused": sum(refused.values()),
                   "refused_by_reason": " ".join(f"{k}={v}" for k, v in sorted(refused.items()))}
    assert report.traffic == Traffic(messages_out=4, fragments_out=16, bytes_out=1000, messages_in=3, fragments_in=12,
                                    bytes_in=950, fragments_unsent=4, raw_bytes_out=1024)
    assert report.refused == refused


def network(n: int, rounds: int, barrier: BarrierState | None) -> InMemoryNetwork:
    q = Quadratic.build(n, 12, "correlated", seed=4, lr=0.05, local_steps=1)
    fragmentation = Fragmentation.build(Layout.flat(12), 3, 4, "random")
    return InMemoryNetwork([q.initial(i) for i in range(n)], fragmentation, PeerSampler("local", 2, 4), q.train,
                           barrier=barrier)


def test_in_memory_barrier_changes_nothing_when_every_node_is_there() -> None:
    plain, barred = network(6, 8, None), network(6, 8, BarrierState(rounds=8, round_deadline=3, drop_after=2,
                                                                      expected=6))
    for _ in range(8):
        plain.step()
        record = barred.step()
        assert record.release is not None and record.release.stragglers == ()
    final = barred.finish()
    assert final is not None and final.finished
    for a, b in zip(plain.vectors, barred.vectors, strict=True):
        assert np.array_equal(a, b)


def missed_rounds(first: int, last: int, node: int = 3, n: int = 6, rounds: int = 12, drop_after: int = 2
                  ) -> tuple[list[dict], list[int]]:
    """In memory: `node` misses rounds first..last; the releases with stragglers, and the final members."""
    barrier = BarrierState(rounds=rounds, round_deadline=3.0, drop_after=drop_after, expected=n)
    net = network(n, rounds, barrier)
    for t in range(rounds):
        net.step(absent={node} if first <= t <= last else ())
    net.finish()
    return [e.to_json() for e in barrier.events], net.members


def test_node_missing_rounds_4_to_6_straggles_then_is_dropped() -> None:
    events, members = missed_rounds(4, 6)
    assert events == [
        {"round": 4, "members": [0, 1, 2, 3, 4, 5], "stragglers": [3], "dropped": [], "finished": False,
         "joined": [], "left": []},
        {"round": 5, "members": [0, 1, 2, 4, 5], "stragglers": [3], "dropped": [3], "finished": False,
         "joined": [], "left": []},
    ]
    assert members == [0, 1, 2, 4, 5]


def test_node_missing_one_round_straggles_and_goes_on() -> None:
    events, members = missed_rounds(4, 4)
    assert [(e["round"], e["stragglers"], e["dropped"]) for e in events] == [(4, [3], [])]
    assert members == list(range(6))


def test_every_wait_ends_even_if_nobody_arrives() -> None:
    state = running(3, deadline=5.0, drop_after=2)
    first = state.tick(5.0)
    assert first is not None and first.stragglers == (0, 1, 2) and not first.finished
    second = state.tick(10.0)
    assert second is not None and second.finished and second.members == () and second.dropped == (0, 1, 2)
    assert state.phase is BarrierPhase.FAILED and "every member was dropped" in (state.failure or "")
    assert state.deadline is None and state.tick(100.0) is None


def test_a_restarted_member_sits_out_the_open_round_and_joins_the_next() -> None:
    state = running(3, rounds=10)
    for r in range(3):
        state.arrive(r, 0, 1.0)
    state.arrive(2, 1, 2.0)  # then rank 2 restarts and registers again
    joined = state.join("10.0.0.3:9000", 3.0)
    assert (joined.rank, joined.release, joined.from_round) == (2, None, 2)
    with pytest.raises(BarrierError) as err:
        state.arrive(2, 1, 3.5)
    assert err.value.reason == "joining"
    state.arrive(0, 1, 4.0)
    release = state.arrive(1, 1, 4.0)  # nobody waits for rank 2 in round 1
    assert release is not None and release.stragglers == () and release.joined == (2,)
    assert release.members == (0, 1, 2) and state.arrive(2, 2, 5.0) is None and state.events == [release]


def test_a_dropped_member_can_rejoin_and_new_nodes_only_when_allowed() -> None:
    state = running(3, rounds=10, drop_after=1)
    state.arrive(0, 0, 1.0)
    state.arrive(1, 0, 1.0)
    assert state.tick(5.0).dropped == (2,)
    with pytest.raises(BarrierError) as err:
        state.join("10.0.0.9:9000", 6.0)
    assert err.value.reason == "registration_closed" and state.addresses[-1] == "10.0.0.3:9000"
    assert state.join("10.0.0.3:9000", 6.0).rank == 2 and state.join("10.0.0.9:9000", 6.0, allow_new=True).rank == 3
    state.arrive(0, 1, 7.0)
    release = state.arrive(1, 1, 7.0)
    assert release.members == (0, 1, 2, 3) and release.joined == (2, 3) and release.dropped == ()
    assert state.addresses[3] == "10.0.0.9:9000"  # a newcomer takes the next rank: nobody's rank moves


def test_no_join_when_no_round_is_left() -> None:
    state = running(2, rounds=2)
    state.arrive(0, 0, 1.0)
    state.arrive(1, 0, 1.0)
    with pytest.raises(BarrierError) as err:
        state.join("10.0.0.1:9000", 2.0)
    assert err.value.reason == "run_not_joinable"


def test_a_restored_state_decides_as_the_original_would() -> None:
    """Saved (through JSON) after round 3's release and restored: the same releases, stragglers and drops."""
    def drive(state: BarrierState, start: int, clock: float) -> list[dict]:
        out = []
        for t in range(start, 8):
            for r in list(state.live):
                if not (r == 2 and 4 <= t <= 6):
                    state.arrive(r, t, clock + 1)
            release = state.tick(clock + 5) if state.round == t else state.released[t]
            out.append(release.to_json())
            clock = clock + 5 if release.stragglers else clock + 1
        return out

    original = running(4, rounds=8)
    expected = drive(original, 0, 0.0)
    stopped = running(4, rounds=8)
    drive_rounds = [stopped.arrive(r, t, float(t)) for t in range(4) for r in range(4)]
    assert drive_rounds[-1] is not None and stopped.round == 4
    restored = BarrierState.from_json(json.loads(json.dumps(stopped.to_json())), 100.0)
    assert restored.round == 4 and restored.deadline == 105.0 and restored.released[3] == stopped.released[3]
    assert drive(restored, 4, 100.0) == expected[4:]
    assert restored.to_json()["events"] == original.to_json()["events"]


def test_a_join_that_leaves_nobody_awaited_releases_the_round() -> None:
    state = running(3, rounds=10)
    for r in range(3):
        state.arrive(r, 0, 1.0)
    state.arrive(0, 1, 2.0)
    state.arrive(1, 1, 2.0)
    joined = state.join("10.0.0.3:9000", 3.0)
    rank, release = joined.rank, joined.release
    assert rank == 2 and joined.round == 1 and release is not None and release.round == 1 and release.joined == (2,)
    assert release.stragglers == () and state.round == 2


def test_a_member_that_leaves_is_not_waited_for_and_its_round_is_released() -> None:
    state = running(n=4, rounds=10, min_members=2)
    for rank in (0, 1, 2):
        assert state.arrive(rank, 0, 1.0) is None
    left = state.leave(3, 1.5)
    release = left.release
    assert left.to_json() == {"left": 3, "round": 1, "live": [0, 1, 2]}
    assert release is not None and release.members == (0, 1, 2) and release.left == (3,) and not release.stragglers
    assert state.left == [3] and release in state.events
    with pytest.raises(BarrierError) as refused:
        state.arrive(3, 1, 2.0)
    assert refused.value.reason == "left"
    before = state.to_json()
    assert state.leave(3, 2.5).release is None and state.to_json() == before  # a second leave changes nothing


def test_too_few_members_end_the_run_at_once_failed() -> None:
    state = running(n=4, rounds=10, min_members=3)  # fanout 2
    assert state.leave(0, 1.0).release is None
    release = state.leave(1, 1.2).release
    assert release is not None and release.finished and state.phase is BarrierPhase.FAILED
    assert "fewer than the 3 the run needs" in (state.failure or "")
    with pytest.raises(BarrierError) as refused:
        state.arrive(2, 1, 2.0)
    assert refused.value.reason == "run_failed"


def test_leaving_survives_a_restart_of_the_barrier() -> None:
    state = running(n=4, rounds=10)
    state.leave(2, 1.0)
    again = BarrierState.from_json(state.to_json(), 5.0)
    assert again.left == [2] and again.live == [0, 1, 3] and again.min_members == state.min_members


# -- the phase table ---------------------------------------------------------------------------------------
def test_every_phase_has_a_row_every_input_and_outcome_is_used_and_every_phase_is_reachable() -> None:
    assert set(BARRIER_TRANSITIONS) == set(BarrierPhase)
    assert {i for row in BARRIER_TRANSITIONS.values() for i in row} == set(BarrierInput)
    assert {o for row in BARRIER_TRANSITIONS.values() for outs in row.values() for o in outs} == set(BarrierOutcome)
    reachable, frontier = {BarrierPhase.REGISTERING}, [BarrierPhase.REGISTERING]
    while frontier:
        for outs in BARRIER_TRANSITIONS[frontier.pop()].values():
            for to in outs.values():
                if to not in reachable:
                    reachable.add(to)
                    frontier.append(to)
    assert reachable == set(BarrierPhase)


def test_failed_is_the_end_and_finished_can_only_fail() -> None:
    """A finished run's outcome is written after its final release: a write that fails there ends it failed."""
    assert BARRIER_TRANSITIONS[BarrierPhase.FAILED] == {}
    assert BARRIER_TRANSITIONS[BarrierPhase.FINISHED] == {
        BarrierInput.FAIL: {BarrierOutcome.FAILED: BarrierPhase.FAILED}}


def test_the_phases_say_what_the_table_allows() -> None:
    for phase in BarrierPhase:
        phases = BarrierPhases(phase)
        assert {i for i in BarrierInput if phases.allows(i)} == set(BARRIER_TRANSITIONS[phase])
        assert phases.run_phase is (BarrierPhase.RUNNING if phase is BarrierPhase.REBINDING else phase)
        assert phases.said(written=False) is (BarrierPhase.RUNNING if phase is BarrierPhase.FINISHED
                                              else phases.run_phase)
        assert BarrierPhases.saved(phase.value).phase is phase


def in_phase(phase: BarrierPhase) -> BarrierState:
    """A state in `phase`, reached through its public methods only."""
    if phase is BarrierPhase.REGISTERING:
        state = BarrierState(rounds=3, round_deadline=1, drop_after=2, expected=2)
        state.register("a:1", 0.0)
        return state
    if phase is BarrierPhase.REBINDING:
        return BarrierState.from_json(running(3).to_json(), 1.0, rebind=True)
    state = running(2, rounds=1)
    if phase is BarrierPhase.FINISHED:
        for t in (0, 1):
            state.arrive(0, t, 0.0)
            state.arrive(1, t, 0.0)
    elif phase is BarrierPhase.FAILED:
        state.fail("a write failed")
    assert state.phase is phase
    return state


@pytest.mark.parametrize("phase", list(BarrierPhase))
def test_an_input_or_outcome_a_phase_has_no_row_for_is_refused_and_changes_nothing(phase: BarrierPhase) -> None:
    row = BARRIER_TRANSITIONS[phase]
    for input in BarrierInput:
        for outcome in set(BarrierOutcome) - set(row.get(input, {})):
            state = in_phase(phase)
            before = state.to_json()
            with pytest.raises(BarrierStateError):
                state.phases.fire(input, outcome)
            assert state.phase is phase and state.to_json() == before


@pytest.mark.parametrize("phase, call", [
    (BarrierPhase.RUNNING, lambda s: s.close(9.0)),
    (BarrierPhase.RUNNING, lambda s: s.count(7)),
    (BarrierPhase.REBINDING, lambda s: s.close(9.0)),
    (BarrierPhase.FINISHED, lambda s: s.count(1)),
    (BarrierPhase.FAILED, lambda s: s.fail("again")),
    (BarrierPhase.FAILED, lambda s: s.close(9.0)),
])
def test_calls_out_of_order_are_refused_and_change_nothing(phase: BarrierPhase, call: object) -> None:
    state = in_phase(phase)
    before = state.to_json()
    with pytest.raises(BarrierStateError):
        call(state)  # type: ignore[operator]
    assert state.phase is phase and state.to_json() == before


@pytest.mark.parametrize("phase, call, reason", [
    (BarrierPhase.REGISTERING, lambda s: s.join("a:1", 1.0), "run_not_joinable"),
    (BarrierPhase.REGISTERING, lambda s: s.leave(0, 1.0), "unknown_rank"),
    (BarrierPhase.REGISTERING, lambda s: s.arrive(0, 0, 1.0), "unknown_rank"),
    (BarrierPhase.REGISTERING, lambda s: s.rebind(0, "a:2", 1.0), "registration_closed"),
    (BarrierPhase.REBINDING, lambda s: s.arrive(0, 0, 1.0), "bad_round"),
    (BarrierPhase.REBINDING, lambda s: s.leave(0, 1.0), "bad_round"),
    (BarrierPhase.REBINDING, lambda s: s.join("10.0.0.1:9000", 1.0), "run_not_joinable"),
    (BarrierPhase.REBINDING, lambda s: s.rebind(0, "no port", 1.0), "bad_address"),
    (BarrierPhase.RUNNING, lambda s: s.rebind(0, "a:2", 1.0), "registration_closed"),
    (BarrierPhase.RUNNING, lambda s: s.register("new:1", 1.0), "registration_closed"),
    (BarrierPhase.FINISHED, lambda s: s.arrive(0, 2, 1.0), "bad_round"),
    (BarrierPhase.FINISHED, lambda s: s.leave(0, 1.0), "bad_round"),
    (BarrierPhase.FAILED, lambda s: s.arrive(0, 0, 1.0), "run_failed"),
    (BarrierPhase.FAILED, lambda s: s.leave(0, 1.0), "run_failed"),
])
def test_refusals_in_each_phase_change_nothing(phase: BarrierPhase, call: object, reason: str) -> None:
    state = in_phase(phase)
    before = state.to_json()
    with pytest.raises(BarrierError) as err:
        call(state)  # type: ignore[operator]
    assert err.value.reason == reason
    assert state.phase is phase and state.to_json() == before


def test_a_resumed_run_waits_for_every_member_at_its_new_address_then_reopens_its_round() -> None:
    saved = running(3).to_json()
    state = BarrierState.from_json(saved, 1.0, rebind=True)
    assert state.phase is BarrierPhase.REBINDING and state.deadline is None
    assert state.to_json() == saved  # the journal says running: the run goes on from it
    first = state.rebind(2, "10.0.1.3:9000", 2.0)
    assert (first.waiting_for, first.all_back) == ((0, 1), False)
    with pytest.raises(BarrierError) as err:  # back already
        state.rebind(2, "10.0.1.3:9000", 2.0)
    assert err.value.reason == "registration_closed"
    state.rebind(0, "10.0.1.1:9000", 3.0)
    last = state.rebind(1, "10.0.1.2:9000", 4.0)
    assert last.all_back and last.round == 0 and state.phase is BarrierPhase.RUNNING
    assert state.deadline == 9.0 and state.addresses == ("10.0.1.1:9000", "10.0.1.2:9000", "10.0.1.3:9000")
    assert BarrierState.from_json(saved, 1.0).phase is BarrierPhase.RUNNING  # not resumed elsewhere


def test_the_notice_and_the_registration_cross_the_wire_as_they_always_did() -> None:
    state = running(3, rounds=10, drop_after=1)
    state.arrive(0, 0, 1.0)
    state.arrive(1, 0, 1.0)
    state.tick(5.0)
    state.join("10.0.0.3:9000", 6.0)
    state.arrive(0, 1, 7.0)
    release = state.arrive(1, 1, 7.0)
    notice = state.notice(release)
    wire = {"round": 1, "members": [0, 1, 2], "stragglers": [], "dropped": [], "finished": False, "joined": [2],
            "left": [], "addresses": {"2": "10.0.0.3:9000"}}
    assert json.dumps(notice.to_json()) == json.dumps(wire) and ReleaseNotice.from_json(wire) == notice
    failed = running(2, rounds=5, drop_after=1)
    ending = failed.tick(5.0)
    assert failed.notice(ending).to_json()["failure"] == failed.failure and "failure" not in wire
    registration = Registration(1, ("a:1", "b:1"), {"rounds": 3}, 0, (0, 1))
    assert list(registration.to_json()) == ["rank", "members", "run", "round", "live"]
    assert Registration.from_json(json.loads(json.dumps(registration.to_json()))) == registration


def test_who_has_heard_that_the_run_failed() -> None:
    state = running(3)
    state.answered(1)  # the run has not failed: nothing to hear
    state.fail("a write failed")
    assert state.unheard(0) == [1, 2]
    state.answered(2)
    assert state.unheard(0) == [1]


# -- the policies the daemon once kept (issue 57): fed to the state, decided there -----------------------------------
def test_members_told_to_stop_are_held_then_leave_together_at_held_until() -> None:
    state = running(n=5, min_members=2)
    first = state.stop(3, "it was told to stop (SIGTERM)", 1.0)
    assert isinstance(first, Held) and first.until == 1.0 + STOP_HOLD_S and not first.journaled
    assert state.stop(3, "again", 1.5) is None  # sent again: nothing new
    assert isinstance(state.stop(4, "it was told to stop (SIGTERM)", 2.0), Held)
    assert state.held.until == 2.0 + STOP_HOLD_S and state.live == [0, 1, 2, 3, 4]  # still waited for
    assert state.leave_held(2.0 + STOP_HOLD_S - 0.1) is None  # not yet
    left = [state.leave_held(2.0 + STOP_HOLD_S), state.leave_held(2.0 + STOP_HOLD_S)]
    assert [(d.rank, d.reason) for d in left if isinstance(d, Left)] == [(3, "it was told to stop (SIGTERM)"),
                                                                         (4, "it was told to stop (SIGTERM)")]
    assert state.leave_held(9.0) is None and state.held.until is None and state.live == [0, 1, 2]


def test_a_member_back_before_its_held_leave_applies_does_not_leave() -> None:
    state = running(n=4, min_members=2)
    state.stop(2, "it was told to stop (SIGTERM)", 1.0)
    state.returned("10.0.0.3:9000")  # rank 2 registers again
    assert state.leave_held(10.0) is None and state.live == [0, 1, 2, 3]


def test_members_told_to_stop_that_would_leave_too_few_interrupt_the_run() -> None:
    state = running(n=3, min_members=2)
    state.stop(0, "it was told to stop (SIGTERM)", 1.0)
    ended = state.stop(1, "it was told to stop (SIGTERM)", 1.2)
    assert isinstance(ended, Failure) and ended.stopped == (0, 1) and not ended.journaled
    assert ended.reason == ("interrupted (2 of 3 members were told to stop (SIGTERM), ranks [0, 1]: the run was "
                            "stopped, not failed)") == state.failure
    assert state.phase is BarrierPhase.FAILED and state.held.until is None and state.live == [0, 1, 2]
    later = state.stop(2, "it was told to stop (SIGTERM)", 1.5)  # told to stop after it: counted too
    assert isinstance(later, Failure) and later.stopped == (0, 1, 2) and later.reason.startswith(
        "interrupted (3 of 3 members were told to stop (SIGTERM), ranks [0, 1, 2]") and state.failure == later.reason
    assert state.stop(2, "again", 1.6) is None and state.phase is BarrierPhase.FAILED


def test_a_member_not_live_told_to_stop_leaves_at_once() -> None:
    state = running(n=3)
    state.leave(2, 1.0)
    assert isinstance(state.stop(2, "again", 2.0), Left)


def test_a_retried_arrival_is_contact_only_and_decides_nothing() -> None:
    state = running(2)
    state.arrive(0, 0, 1.0)
    release = state.arrive(1, 0, 1.0)
    assert release is not None and release.journaled
    assert state.arrive(0, 0, 2.0) is None and state.released[0] is release and state.round == 1


def test_the_node_count_is_taken_once_it_held_still() -> None:
    state = BarrierState(rounds=3, round_deadline=1, drop_after=2, count_rule=CountRule(2.0, stretched=True, fanout=1))
    state.count(1, 0.0)
    assert state.expected == 0
    state.count(1, 5.9)
    assert state.expected == 0  # no more than the fanout: three times as long (6 s)
    state.count(3, 6.0)
    state.count(3, 7.0)
    assert state.expected == 0  # moved at 6.0; settles at max(2, 2 x 6.0) = 12 s
    state.count(3, 18.0)
    assert state.expected == 3
    flat = BarrierState(rounds=3, round_deadline=1, drop_after=2, count_rule=CountRule(1.0))
    flat.count(4, 0.0)
    flat.count(4, 1.0)
    assert flat.expected == 4


def test_a_layout_that_differs_from_the_first_claimed_is_named() -> None:
    state = running(3)
    assert state.claim_layout(0, None) is None and state.claim_layout(0, (10, "ab" * 32)) is None
    assert state.claim_layout(1, (10, "ab" * 32)) is None
    why = state.claim_layout(2, (12, "cd" * 32))
    assert why is not None and "rank 2 fragments a model of 12 values, rank 0's of 10" in why


def test_the_end_of_a_run_is_decided_by_the_state_running_or_failed_already() -> None:
    state = running(3)
    ended = state.end("cannot write out: No space left")
    assert state.phase is BarrierPhase.FAILED and ended.reason == state.failure and not ended.registration
    again = state.end("the process stopped")  # failed already: its end recorded for it, nothing moves
    assert again.reason == "the process stopped" and state.failure == "cannot write out: No space left"


def test_the_resume_rule_takes_the_newest_round_every_live_member_holds() -> None:
    kept = [{"round": 7, "live": [0, 1], "joining": [2]}, {"round": 6, "live": [0, 1], "joining": []}]
    assert resume_point(kept, {0: {7, 6}, 1: {7, 6}, 2: {6}}) == (6, {0, 1})
    assert resume_point(kept, {0: {7}, 1: {7}, 2: {7}}) == (7, {0, 1, 2})
    assert resume_point(kept, {0: {5}, 1: {7, 6}}) is None


def test_a_barrier_frozen_past_its_deadline_reads_what_arrived_before_it_releases() -> None:
    """The deadline's timer taken 15 s late (the process was SIGSTOPped): the arrivals sent meanwhile are read
    first, and the round is released with them, nobody a straggler; taken on time, the deadline releases as ever."""
    from mosaic_proto.barrier_rules import LATE_GRACE_S, LATE_TICK_S

    state = running(3, deadline=5.0)
    assert state.tick(20.0, due=5.0) is None and state.round == 0  # woke late: nothing released yet
    assert state.deadline == 20.0 + LATE_GRACE_S
    assert state.arrive(0, 0, 20.01) is None and state.arrive(1, 0, 20.02) is None
    release = state.arrive(2, 0, 20.03)
    assert release is not None and release.stragglers == () and state.deadline == 25.03
    # one that really did not come: released at the grace's end, a straggler as at any deadline
    state.arrive(0, 1, 21.0)
    state.arrive(1, 1, 21.0)
    assert state.tick(40.0, due=25.03) is None
    assert state.tick(40.0 + LATE_GRACE_S, due=40.0 + LATE_GRACE_S).stragglers == (2,)
    # on time (late by less than LATE_TICK_S): released at the deadline
    late = state.deadline + LATE_TICK_S / 2
    assert state.tick(late, due=state.deadline).stragglers == (0, 1, 2)


def test_a_resumed_run_whose_first_word_is_a_member_started_again_waits_for_them_all() -> None:
    """Resumed from the journal, the run's first word a live member registering again with its checkpoints (its
    members stopped with the barrier: a full disk): it waits for every live member to come back (the comeback). Once
    any member spoke otherwise (an arrival, a join), a member started again is an ordinary rejoin."""
    state = running(3)
    state.arrive(0, 0, 1.0), state.arrive(1, 0, 1.0), state.arrive(2, 0, 1.0)
    saved = state.to_json()
    resumed = BarrierState.from_json(saved, 10.0)
    assert resumed.returned("10.0.0.9:9000", restarted=True) is None  # not a member
    assert resumed.returned("10.0.0.2:9000") is None  # no checkpoints said: a rejoin, not a restart
    assert resumed.returned("10.0.0.2:9000", restarted=True) == (0, 1, 2)
    assert resumed.phase is BarrierPhase.REBINDING and resumed.deadline is None and resumed.awaited == {0, 1, 2}
    for rank in (0, 1, 2):
        resumed.rebind(rank, resumed.addresses[rank], 12.0)
    assert resumed.phase is BarrierPhase.RUNNING and resumed.returned("10.0.0.2:9000", restarted=True) is None
    spoken = BarrierState.from_json(saved, 10.0)
    spoken.arrive(0, 1, 10.5)
    assert spoken.returned("10.0.0.2:9000", restarted=True) is None and spoken.phase is BarrierPhase.RUNNING
    joined = BarrierState.from_json(saved, 10.0)
    joined.join("10.0.0.3:9000", 10.5)
    assert joined.returned("10.0.0.2:9000", restarted=True) is None
    assert state.returned("10.0.0.2:9000", restarted=True) is None  # never resumed: a restarted node rejoins
    assert BarrierState.from_json(saved, 10.0, rebind=True).returned("10.0.0.2:9000", restarted=True) is None

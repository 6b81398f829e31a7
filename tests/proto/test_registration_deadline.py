"""The registration's deadline in the barrier's core (issue 57): `BarrierState.registration_deadline`, fed the clock
through `tick`, fails the run when the registration (or a resumed run's members coming back) gives up, and its
failure line says what was fed in as it happened: who registered, who the peer list names that did not, the members
back, the requests refused meanwhile."""

from __future__ import annotations

import pytest

from mosaic_proto import BarrierError, BarrierPhase, BarrierState, Failure


def registering(expected: int = 3) -> BarrierState:
    return BarrierState(rounds=5, round_deadline=30.0, drop_after=2, expected=expected)


def test_the_clock_past_the_registration_deadline_with_too_few_nodes_fails_the_run_saying_who_is_missing() -> None:
    state = registering()
    state.registration.begin(10.0, 5.0, ("a:1", "b:1", "c:1"))
    state.register("b:1", 11.0)
    state.register("a:1", 12.0)
    state.registration.saw_refused("2 requests refused: bad_tag x2 from 10.0.0.9")
    assert state.registration_deadline == 15.0 and state.registration.unregistered(state.pending) == ["c:1"]
    assert state.tick(14.9) is None and state.phase is BarrierPhase.REGISTERING
    failure = state.tick(15.0)
    said = ("registration deadline (5s) passed with 2 of 3 nodes; not registered: c:1; 2 requests refused: bad_tag "
            "x2 from 10.0.0.9")
    assert failure == Failure(said, 0, registration=True)
    assert state.phase is BarrierPhase.FAILED and state.failure == said and state.registration_deadline is None
    with pytest.raises(BarrierError) as err:  # a long poll that asks again hears it
        state.register("a:1", 16.0, waited=True)
    assert (err.value.reason, err.value.detail) == ("registration_failed", said)


def test_without_a_peer_list_or_a_count_the_line_says_how_many_came() -> None:
    state = registering(expected=0)
    state.registration.begin(0.0, 0.3)
    failure = state.tick(0.3)
    assert isinstance(failure, Failure) and failure.reason == "registration deadline (0.3s) passed with 0 of ? nodes"


def test_nodes_registered_in_time_leave_no_registration_deadline() -> None:
    state = registering()
    state.registration.begin(0.0, 5.0)
    for address in ("c:1", "a:1", "b:1"):
        state.register(address, 1.0)
    state.close(2.0)
    assert state.registration_deadline is None and state.deadline == 32.0
    assert state.tick(20.0) is None and state.phase is BarrierPhase.RUNNING  # past the registration's: nothing


def test_a_registration_never_begun_has_no_deadline() -> None:
    """The in-memory network never begins one: its registrations have no deadline."""
    state = registering()
    assert state.registration_deadline is None and state.tick(1e9) is None
    assert state.phase is BarrierPhase.REGISTERING


def test_a_registration_the_daemon_fails_says_the_refusals_too() -> None:
    state = registering()
    state.registration.saw_refused("1 request refused: task_differs x1")
    failure = state.fail("a:1 runs the run's task", registration=True)
    assert failure.reason == "a:1 runs the run's task; 1 request refused: task_differs x1" and failure.registration
    assert state.phase is BarrierPhase.FAILED and state.failure == failure.reason


def resumed(live: int = 3) -> BarrierState:
    """A run of `live` members, resumed where they all start again: it waits for them to come back."""
    state = registering(expected=live)
    for i in range(live):
        state.register(f"10.0.0.{i + 1}:9000", 0.0)
    state.close(0.0)
    state = BarrierState.from_json(state.to_json(), 100.0, rebind=True)
    assert state.phase is BarrierPhase.REBINDING and state.awaited == set(range(live))
    return state


def test_a_resumed_runs_wait_for_its_members_runs_from_the_first_back_and_names_the_missing() -> None:
    state = resumed()
    assert state.registration_deadline is None and state.tick(1e9) is None  # --resume-round: no run deadline
    state.registration.came_back(1, 120.0, 5.0)
    state.registration.came_back(0, 123.0, 5.0)
    state.registration.came_back(0, 124.0, 5.0, withdrew=True)  # it withdrew: missing again
    assert state.registration_deadline == 125.0 and state.tick(124.9) is None
    failure = state.tick(125.0)
    assert failure == Failure("members [0, 2] did not come back within --register-deadline 5s", 0, registration=True)
    assert state.phase is BarrierPhase.FAILED


def test_a_resumed_run_whose_members_are_all_back_in_time_goes_on() -> None:
    state = resumed()
    for rank in range(3):
        state.registration.came_back(rank, 120.0 + rank, 5.0)
    for rank in range(3):
        state.rebind(rank, f"10.0.1.{rank + 1}:9000", 123.0)
    assert state.phase is BarrierPhase.RUNNING and state.registration_deadline is None
    assert state.tick(125.0) is None and state.phase is BarrierPhase.RUNNING

"""What a registration says it runs, against what the barrier runs (`RunTask`, `TaskClaim`), and layout claims that are
not a member's (`LayoutClaim.changed`): decided by the state, returned as values, nothing changed by a refusal."""

from __future__ import annotations

import pytest

from mosaic_proto import BarrierError, BarrierReason, BarrierState, RunTask, TaskClaim

OWN = TaskClaim(True, "digits-loop", 8)


def test_a_barrier_with_a_task_refuses_an_own_loop_naming_own_loop_unless_its_model_fits() -> None:
    quadratic = RunTask("quadratic", own_loop=False, evaluates=True, values=16)
    why = quadratic.differs("10.0.0.5:9000", OWN)
    assert why is not None and "--own-loop" in why and "a model of 8 values" in why and "16 values" in why
    assert quadratic.claimed is None  # a refused claim is not what ran
    assert quadratic.differs("10.0.0.5:9000", TaskClaim(True, "", 16)) is None  # the task's own size: it evaluates
    assert RunTask("digits", False, True).differs("a:1", TaskClaim(True, "", None)) is not None  # size unknown


def test_an_own_loop_barrier_refuses_the_run_s_task_naming_task_and_old_nodes_pass() -> None:
    own = RunTask("digits-loop", own_loop=True, evaluates=False)
    why = own.differs("10.0.0.5:9000", TaskClaim(False))
    assert why is not None and "--task NAME" in why and "--own-loop" in why
    assert own.differs("10.0.0.5:9000", None) is None and own.differs("a:1", OWN) is None  # an older node says nothing
    assert own.ran() == {}  # the barrier's own settings say it already


def test_a_barrier_that_evaluates_nothing_records_the_own_loops_that_ran() -> None:
    state = BarrierState(rounds=3, round_deadline=5.0, drop_after=2, expected=1,
                         task=RunTask("quadratic", own_loop=False, evaluates=False, values=16))
    assert state.task.differs("a:1", OWN) is None
    state.register("a:1", 0.0)
    assert state.close(0.0).ran == {"own_loop": True, "task": "digits-loop"}
    evaluating = RunTask("quadratic", own_loop=False, evaluates=True, values=8)  # the loops' size: it evaluates them
    assert evaluating.differs("a:1", OWN) is None and evaluating.ran() == {}  # with its task: the task is what ran


@pytest.mark.parametrize("bad", [None, {}, {"own_loop": "yes"}, {"own_loop": True, "values": 0},
                                 {"own_loop": True, "name": "x" * 201}, {"own_loop": False, "values": 2.5}])
def test_a_malformed_claim_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="field 'task'"):
        TaskClaim.from_json(bad)
    assert TaskClaim.from_json(OWN.to_json()) == OWN


def test_a_stale_or_changed_layout_claim_fails_nothing_and_blames_no_rank() -> None:
    state = BarrierState(rounds=5, round_deadline=5.0, drop_after=2, expected=2)
    for address in ("a:1", "b:1"):
        state.register(address, 0.0)
    state.close(0.0)
    run, other = (8, "ab" * 32), (16, "cd" * 32)
    assert state.claim_layout(0, run, 0) is None and state.claim_layout(1, run, 0) is None
    state.arrive(0, 0, 0.0), state.arrive(1, 0, 0.0)
    assert state.claim_layout(0, other, 0) is None  # round 0 was released: a stale arrival claims nothing
    with pytest.raises(BarrierError) as refused:
        state.claim_layout(0, other, 1)
    assert refused.value.reason == BarrierReason.LAYOUT_CHANGED and not state.phases.failed

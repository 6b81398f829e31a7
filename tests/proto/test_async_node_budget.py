"""An asynchronous node's time budget (docs/spec.md, "Asynchronous mode"): it starts no iteration once the driver's
clock is the budget past the run's start, or stops at its iterations, whichever comes first, and says which."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic_proto import Fragmentation, Layout, PeerSampler, Quadratic
from mosaic_proto.async_network import AsyncNetwork
from mosaic_proto.async_node import AsyncNodeState, AsyncOutcome, AsyncStateError, StopReason
from mosaic_proto.profiles import NodeProfile

FOUR = Fragmentation.build(Layout.flat(4), 2, 0, "contiguous")


def node(iterations: int = 100, **kw) -> AsyncNodeState:
    return AsyncNodeState(0, range(3), FOUR, PeerSampler("local", 1, 0), iterations, np.zeros(4, np.float32),
                          planned_only=False, **kw)


def test_no_iteration_starts_once_the_budget_is_spent_from_the_run_s_start() -> None:
    state = node(budget_s=2.5)
    state.started(10.0)  # a daemon's clock: the start's barrier at 10 s
    local = np.ones(4, np.float32)
    assert [state.trained(local, now).outcome for now in (11.0, 12.0)] == [AsyncOutcome.ITERATED] * 2
    assert state.stopped_by is None and not state.over_budget(12.4) and state.over_budget(12.5)
    assert state.trained(local, 12.5).outcome is AsyncOutcome.DONE  # at the budget: none starts
    assert state.finished and state.step == 3 and state.stopped_by is StopReason.BUDGET
    assert state.status(13.0).stopped_by == "budget" and state.status(13.0).budget_s == 2.5
    with pytest.raises(AsyncStateError):
        state.started(14.0)


def test_the_iterations_stop_it_where_they_come_first_and_without_a_budget_only_they_do() -> None:
    both = node(iterations=2, budget_s=1.0)
    both.trained(np.ones(4, np.float32), 0.5)
    assert both.trained(np.ones(4, np.float32), 5.0).outcome is AsyncOutcome.DONE
    assert both.stopped_by is StopReason.ITERATIONS  # its last iteration, whatever the clock says
    plain = node(iterations=3)
    outcomes = [plain.trained(np.ones(4, np.float32), t).outcome for t in (1e6, 2e6, 3e6)]
    assert outcomes == [AsyncOutcome.ITERATED, AsyncOutcome.ITERATED, AsyncOutcome.DONE]
    assert plain.stopped_by is StopReason.ITERATIONS and not plain.over_budget(1e9)
    with pytest.raises(ValueError, match="budget_s"):
        node(budget_s=0.0)


def test_on_the_virtual_clock_each_node_stops_at_the_budget_by_its_own_pace() -> None:
    """An iteration ending at or past the budget is a node's last: the unslowed nodes do ceil(5.5 / 1) = 6, the
    node slowed 4x two (4 s, then 8 s); the run, the same twice, bit for bit."""
    def run() -> AsyncNetwork:
        q = Quadratic.build(6, 16, "correlated", 0)
        fr = Fragmentation.build(Layout.flat(16), 4, 0)
        states = [AsyncNodeState(i, range(6), fr, PeerSampler("local", 2, 0), 50, q.initial(i), budget_s=5.5)
                  for i in range(6)]
        network = AsyncNetwork(states, q.train, [NodeProfile(latency=0.1)] * 5 + [NodeProfile(slowdown=4.0)], 1.0)
        network.run()
        return network

    first, again = run(), run()
    assert [s.step for s in first.states] == [6] * 5 + [2]
    assert {s.stopped_by for s in first.states} == {StopReason.BUDGET}
    assert first.finished_at == {**{i: 6.0 for i in range(5)}, 5: 8.0}
    assert [v.tobytes() for v in first.vectors] == [v.tobytes() for v in again.vectors]

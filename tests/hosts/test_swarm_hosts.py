"""deploy/stack.yaml on a swarm of three engines (tests/hosts/hostlab.py): engine 0 inits it, 1 and 2 join.

- the nodes spread over all three hosts (placement read from Swarm's tasks), the models equal `mosaicd simulate`'s;
  the same with 2 nodes per task (MOSAIC_NODES_PER_CONTAINER: the barrier counts each address of tasks.node twice);
- a worker engine stopped mid-run: its nodes straggle and are dropped, the others finish, summary.json says who;
- the barrier's engine restarted mid-run (the barrier pinned to it by a node label, MOSAIC_BARRIER_PLACEMENT; its
  results and journal a bind mount there): the barrier comes back, resumes from OUT/barrier-state.json, and the
  models still equal simulate's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostlab import HostsLab, StackRun, Swarm, simulated_hashes

pytestmark = [pytest.mark.docker, pytest.mark.netns, pytest.mark.slow]

SETTINGS = {"MOSAIC_TASK": "quadratic", "MOSAIC_FRAGMENTS": "4", "MOSAIC_FANOUT": "3", "MOSAIC_EVAL_EVERY": "5",
            "MOSAIC_SEED": "7", "MOSAIC_DNS_SETTLE": "5", "MOSAIC_BARRIER_LINGER": "5"}


@pytest.fixture(scope="module")
def swarm(hosts: HostsLab) -> Iterator[Swarm]:
    swarm = Swarm(hosts).init()
    try:
        yield swarm
    finally:
        swarm.leave()


@pytest.fixture
def stack(swarm: Swarm, tmp_path: Path) -> Iterator[list[StackRun]]:
    runs: list[StackRun] = []
    yield runs
    for run in runs:
        run.remove()


def finished_with_every_node(summary: dict, nodes: int, run: StackRun) -> None:
    assert summary["status"] == "finished", f"{summary.get('error')}\n{run.logs()}"
    assert sorted(summary["model_sha256"], key=int) == [str(i) for i in range(nodes)]


@pytest.mark.parametrize("per_task", [1, 2])
def test_stack_spreads_over_three_engines_and_equals_simulate(per_task: int, swarm: Swarm, host_image: str,
                                                              tmp_path: Path, stack: list[StackRun]) -> None:
    nodes = 6
    tasks = nodes // per_task
    settings = {**SETTINGS, "MOSAIC_ROUNDS": "8"}
    if per_task > 1:
        settings["MOSAIC_NODES_PER_CONTAINER"] = str(per_task)
    run = StackRun(swarm, tmp_path, host_image, tasks, settings).deploy()
    stack.append(run)
    run.wait_released(0, timeout=300)
    placed = Counter(run.tasks("node", ended_too=True).values())  # 8 quadratic rounds: they may have ended
    assert set(placed) == {0, 1, 2} and sum(placed.values()) == tasks, placed  # Swarm spread them over all three
    assert run.barrier_host(ended_too=True) == 0  # a manager, by default
    summary = run.wait_final(timeout=300)
    finished_with_every_node(summary, nodes, run)
    assert summary["dropped"] == []
    # each task's members at its own overlay address, on ports 8000 + I
    per_address = Counter(address.rsplit(":", 1)[0] for address in summary["addresses"])
    assert sorted(per_address.values()) == [per_task] * tasks, summary["addresses"]
    assert {int(a.rsplit(":", 1)[1]) for a in summary["addresses"]} == set(range(8000, 8000 + per_task))
    assert summary["model_sha256"] == simulated_hashes(summary, tmp_path / "simulated")


def test_a_worker_engine_stopped_mid_run_its_nodes_leave_and_the_rest_finish(
        swarm: Swarm, host_image: str, tmp_path: Path, stack: list[StackRun]) -> None:
    # 400 rounds: the engine stops mid-run on a fast host too (bare quadratic rounds take ~5 ms on loopback there, ~27
    # ms over Swarm's overlay here; the crash below once came after 150 had ended)
    nodes, rounds = 6, 400
    settings = {**SETTINGS, "MOSAIC_ROUNDS": str(rounds), "MOSAIC_ROUND_DEADLINE": "6", "MOSAIC_DROP_AFTER": "2",
                "MOSAIC_REQUEST_TIMEOUT": "3"}
    run = StackRun(swarm, tmp_path, host_image, nodes, settings).deploy()
    stack.append(run)
    run.wait_released(0, timeout=300)  # every node's task running: where Swarm put them, asked before round 2
    on_worker = sorted(task for task, host in run.tasks("node").items() if host == 2)
    assert on_worker
    run.wait_released(2, timeout=300)  # then the engine stopped at once, with no `docker` calls in between
    engine = swarm.lab.engines[2]
    engine.stop()  # dockerd stops its containers, then exits: the host's nodes are gone
    try:
        summary = run.wait_final(timeout=300)
    finally:
        engine.start()  # back for the next test; it is still a member of the swarm
        swarm.wait_ready(3, timeout=120)
    assert summary["status"] == "finished", f"{summary.get('error')}\n{run.logs()}"
    # dockerd stops its containers with SIGTERM: their nodes leave (or, killed before they could, are dropped); a
    # task Swarm starts again elsewhere at the same address rejoins as that node restarting
    gone = set(summary.get("left") or []) | set(summary["dropped"])
    back = {r for e in summary.get("events", []) for r in e.get("joined", [])}
    assert len(gone) >= len(on_worker) or back, (summary.get("left"), summary["dropped"], summary.get("events"))
    assert any(e.get("left") or e.get("stragglers") for e in summary.get("events", [])), summary.get("events")
    assert sorted(summary["model_sha256"], key=int) == sorted((str(r) for r in summary["members"]), key=int)


def test_the_barriers_engine_restarted_mid_run_resumes_from_its_journal(
        swarm: Swarm, host_image: str, tmp_path: Path, stack: list[StackRun]) -> None:
    # 1,000 rounds: the crash comes mid-run on a fast host too. Killing the engine's containers takes `docker` calls
    # first (seconds on a loaded host), and at 150 rounds, ~4 s of them once, a run ended before its crash came
    nodes, rounds = 5, 1000
    swarm.label(1, "mosaic.barrier=true")
    # the engine's restart and Swarm's rescheduling took over 120 s once on a loaded 2-core CI machine
    settings = {**SETTINGS, "MOSAIC_ROUNDS": str(rounds), "MOSAIC_ROUND_DEADLINE": "120", "MOSAIC_BARRIER_GRACE": "300",
                "MOSAIC_BARRIER_PLACEMENT": "node.labels.mosaic.barrier == true",
                "MOSAIC_NODE_PLACEMENT": "node.labels.mosaic.barrier != true"}
    run = StackRun(swarm, tmp_path, host_image, nodes, settings).deploy()
    stack.append(run)
    run.wait_released(0, timeout=300)  # the placement, asked before round 3: the crash then comes at once
    assert run.barrier_host() == 1 and set(run.tasks("node").values()) <= {0, 2}
    run.wait_released(3, timeout=300)
    engine = swarm.lab.engines[1]
    engine.crash()  # its barrier with it: nothing of that host survives
    engine.start()
    summary = run.wait_final(timeout=600)  # the restart and rescheduling (120 s and more), then the rounds left
    assert summary.get("resumed_at", 0) >= 3, f"{summary}\n{run.logs()[-6000:]}"  # it went on from its journal
    finished_with_every_node(summary, nodes, run)
    assert summary["dropped"] == []
    assert summary["model_sha256"] == simulated_hashes(summary, tmp_path / "simulated")

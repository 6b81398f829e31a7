"""Runs that end well: a node told to stop leaves (the barrier stops waiting for it at once), a run that can no
longer run ends at once on every process, failed, with the reason, and nodes that cannot start say why on the
launcher's console. Real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from own_tasks import write_tasks

from mosaic_proto import STOP_HOLD_S, Layout
from mosaicd import Peer
from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.daemon.errors import RunEnded
from mosaicd.experiments.cluster import free_ports

# round_deadline 60: a stalled round would take a minute; the tests see the leave within seconds instead.
# rounds: far more than a fast host runs before the test stops the run (a fast host runs ~200 such rounds a second)
RUN = dict(nodes=4, rounds=20_000, fragments=2, fanout=2, dim=16, seed=5, eval_every=0, round_deadline=60)
# a round at least this long (kit.pace) where the test stops a run mid-way and then lets it end (or resumes it to
# its end): the run is still going when the test acts, on a fast host too, and stays short
PACE_S = 0.05


def peer_list(kit: Any, tmp_path: Path, run: dict[str, Any], ports: list[int] | None = None,
              logs: str = "node") -> tuple[dict[int, subprocess.Popen], list[int]]:
    """The members of a peer list, started by hand (`ports`: the same list again, logging to `logs`-PORT.log)."""
    if ports is None:
        ports = sorted(free_ports(run["nodes"]))
        (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    procs = {}
    for port in ports:
        with open(tmp_path / f"{logs}-{port}.log", "wb") as log:
            procs[port] = subprocess.Popen(
                [*kit.by_hand, "node", "--peer-list", str(tmp_path / "peers.txt"), "--port", str(port), "--host",
                 "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), "--log-json", *kit.flags(run)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return procs, ports


def exited(tmp_path: Path, procs: dict[int, subprocess.Popen], port: int, within: float, logs: str = "node") -> int:
    """The node's exit code; one that goes on past `within` s fails the test with what it said last (in the
    `logs`-PORT.log `peer_list` started it with)."""
    try:
        return procs[port].wait(timeout=within)
    except subprocess.TimeoutExpired:
        said = (tmp_path / f"{logs}-{port}.log").read_text()
        pytest.fail(f"the node on port {port} (rank {sorted(procs).index(port)}) still runs {within:g} s on; "
                    f"it said last:\n{said[-3000:]}")


def barrier_status(kit: Any, port: int) -> dict[str, Any] | None:
    try:
        return kit.http("GET", f"http://127.0.0.1:{port}/barrier/v1/status", timeout=2).json()
    except OSError:
        return None


@pytest.mark.slow
def test_a_node_told_to_stop_leaves_and_the_others_finish(tmp_path: Path, kit: Any) -> None:
    # 200 rounds of PACE_S: 9 s at least after round 20, for the leave's hold and the status reads below
    run = {**RUN, "rounds": 200, "node_profile": kit.pace(tmp_path, PACE_S)}
    procs, ports = peer_list(kit, tmp_path, run)
    rank0, victim = ports[0], ports[3]
    try:
        kit.wait_until(lambda: (barrier_status(kit, rank0) or {}).get("round", 0) >= 20, 60, "round 20")
        procs[victim].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert procs[victim].wait(timeout=30) == 0  # it left as told
        exited_after = time.monotonic() - stopped
        # within seconds (a loaded host's), not at the round deadline (60 s)
        assert exited_after < 15, f"the node took {exited_after:.1f} s to exit after SIGTERM"
        # its leave is held a moment (a whole run stopped is interrupted, not failed: BarrierState.stop), then applied
        status = kit.wait_until(lambda: (s := barrier_status(kit, rank0)) and 3 in s["left"] and s, 30,
                                "the barrier to record rank 3 as left")
        seen_after = time.monotonic() - stopped
        assert 3 not in status["live"] and STOP_HOLD_S <= seen_after < STOP_HOLD_S + 15, seen_after
        shown = subprocess.run([*kit.by_hand, "status", f"http://127.0.0.1:{rank0}/barrier", "--json"],
                               capture_output=True, text=True, timeout=60)
        assert next(r for r in json.loads(shown.stdout)["nodes"] if r["rank"] == 3)["phase"] == "left", shown
        metrics = kit.http("GET", f"http://127.0.0.1:{rank0}/barrier/metrics").body.decode()
        assert "mosaic_barrier_left_total 1.0" in metrics
        for port in ports[:3]:
            assert procs[port].wait(timeout=120) == 0, (tmp_path / f"node-{port}.log").read_text()[-2000:]
    finally:
        kit.stop_all(procs)
    out = tmp_path / f"out-{rank0}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["left"] == [3] and summary["members"] == [0, 1, 2]
    # rank 0 leaves logs/ as `cluster` does (the barrier's, its own), which `mosaicd log` reads
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["barrier.log", "node-0.log"]
    for args, said in (([], " left "), (["--node", "0"], "info    round role=node")):  # info lines too
        shown = subprocess.run([*kit.mosaicd, "log", str(out), *args], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and said in shown.stdout, (shown.stdout[-2000:], shown.stderr)
    folder = subprocess.run([*kit.mosaicd, "status", str(out), "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(folder.stdout)["barrier"]["live"] == [0, 1, 2], folder.stdout[-2000:]  # not the one that left
    assert any(e["left"] == [3] for e in summary["events"])
    left_log = [json.loads(line) for line in (tmp_path / f"node-{victim}.log").read_text().splitlines()
                if line.startswith("{")]
    assert any(e["event"] == "left" and "SIGTERM" in e["reason"] for e in left_log)


@pytest.mark.slow
def test_members_told_to_stop_interrupt_the_run_and_the_same_commands_resume_it_exactly(tmp_path: Path,
                                                                                         kit: Any) -> None:
    """3 nodes, fanout 2: once one is told to stop, the two others cannot sample two peers. A person stopped the
    run (its leave held: `stop`): it ends interrupted, not failed, on every process within seconds (not at a
    deadline; the two others say so, no error, and exit 130), its journal with every member in it; the same three
    commands again resume it from the members' checkpoints and end with `simulate`'s models, bit for bit."""
    from mosaicd.settings import Settings

    # 1.5 s at least from round 10 to the end
    run = {**RUN, "nodes": 3, "rounds": 40, "node_profile": kit.pace(tmp_path, PACE_S)}
    procs, ports = peer_list(kit, tmp_path, run)
    rank0 = ports[0]
    try:
        kit.wait_until(lambda: (barrier_status(kit, rank0) or {}).get("round", 0) >= 10, 60, "round 10")
        procs[ports[2]].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        codes = {port: exited(tmp_path, procs, port, 30) for port in ports}
        took = time.monotonic() - stopped
    finally:
        kit.stop_all(procs)
    assert codes == {ports[0]: 130, ports[1]: 130, ports[2]: 0}, codes  # interrupted, not failed: 130, as Ctrl-C
    assert took < 20, took  # the round deadline is 60 s
    out = tmp_path / f"out-{rank0}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"].startswith(
        "interrupted (1 of 3 members were told to stop (SIGTERM), ranks [2]"), summary
    assert summary["members_stopped"] == [2]
    journal = json.loads((out / "barrier-state.json").read_text())["state"]
    assert journal["live"] == [0, 1, 2] and journal["left"] == [], journal
    said = (tmp_path / f"node-{ports[1]}.log").read_text()
    assert "mosaicd node: the run ended" in said and "mosaicd node: error" not in said, said[-2000:]
    assert "interrupted (1 of 3 members were told to stop" in said, said[-2000:]
    codes_again, said_again = started_again(kit, tmp_path, run, ports)
    assert set(codes_again) == {0}, {p: t[-1500:] for p, t in said_again.items()}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["left"] == [], summary
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run)), summary["model_sha256"]
    (entry,) = summary["resumed"]
    assert entry["stopped"].startswith("interrupted (1 of 3 members were told to stop"), entry


@pytest.mark.slow
def test_rank_0_told_to_stop_interrupts_the_run_and_exits_once_the_others_heard(tmp_path: Path, kit: Any) -> None:
    """Rank 0 hosts the barrier: told to stop (as by `scancel`), it ends the run, interrupted (a person stopped it,
    not a failure: summary.json, exit 130); every other node hears why at its next arrival and exits 130 saying so,
    and rank 0 exits as soon as they have (not after HOST_LINGER_S). A member that rank 0's last 2 s could not reach
    (starved by a loaded host) takes the barrier for restarting, waits --barrier-grace for it and then says it did
    not answer (exit 1): never a hang."""
    from mosaicd.daemon.node.run import HOST_LINGER_S

    procs, ports = peer_list(kit, tmp_path, {**RUN, "barrier_grace": 15})
    rank0 = ports[0]
    try:
        kit.wait_until(lambda: (barrier_status(kit, rank0) or {}).get("round", 0) >= 10, 60, "round 10")
        procs[rank0].send_signal(signal.SIGTERM)
        code0 = exited(tmp_path, procs, rank0, 30)
        codes = {port: exited(tmp_path, procs, port, 40) for port in ports[1:]}
    finally:
        kit.stop_all(procs)
    assert code0 == 130, (code0, codes)
    summary = json.loads((tmp_path / f"out-{rank0}" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"].startswith(
        "interrupted (rank 0, which hosts the barrier, stopped with"), summary
    said0 = (tmp_path / f"node-{rank0}.log").read_text()  # how to go on, in a line for people
    assert "start the same commands again, on every member, to resume it" in said0, said0[-2000:]
    told = [json.loads(line) for line in said0.splitlines() if '"failure_told"' in line]
    assert len(told) <= 1 and all(t["waited_s"] < HOST_LINGER_S for t in told), told
    missed = None if not told else set(told[0]["unheard"])  # None: its 2 s ran out before they all heard
    for rank, port in enumerate(ports[1:], 1):
        said = (tmp_path / f"node-{port}.log").read_text()
        if "which hosts the barrier, stopped" in said:  # heard: interrupted, no error
            assert codes[port] == 130 and "barrier_unreachable" not in said, (codes[port], said[-2000:])
            assert "mosaicd node: the run ended" in said and "mosaicd node: error" not in said, said[-2000:]
        else:
            assert missed is None or rank in missed, (rank, told, said[-2000:])
            assert codes[port] == 1 and "did not answer for --barrier-grace 15s" in said, said[-2000:]


def stopped_by_rank_0(kit: Any, tmp_path: Path, run: dict[str, Any]) -> list[int]:
    """A peer list whose rank 0 is told to stop at round 10 or later; every member has exited (the run interrupted:
    130; 1 for one that rank 0's last 2 s missed, whose --barrier-grace ran out): the ports."""
    procs, ports = peer_list(kit, tmp_path, run)
    try:
        kit.wait_until(lambda: (barrier_status(kit, ports[0]) or {}).get("round", 0) >= 10, 60, "round 10")
        procs[ports[0]].send_signal(signal.SIGTERM)
        codes = [exited(tmp_path, procs, port, 40) for port in ports]
    finally:
        kit.stop_all(procs)
    assert codes[0] == 130 and set(codes[1:]) <= {130, 1}, codes
    return ports


def started_again(kit: Any, tmp_path: Path, run: dict[str, Any], ports: list[int]) -> tuple[list[int], dict[int, str]]:
    """The same commands again, run to their end: each member's exit code and what it said."""
    procs, _ = peer_list(kit, tmp_path, run, ports, logs="again")
    try:
        codes = [exited(tmp_path, procs, port, 120, logs="again") for port in ports]
    finally:
        kit.stop_all(procs)
    return codes, {port: (tmp_path / f"again-{port}.log").read_text() for port in ports}


@pytest.mark.slow
def test_the_same_commands_again_resume_the_run_exactly_and_every_member_says_so(tmp_path: Path, kit: Any) -> None:
    """What rank 0 told to stop says to do: start the same commands again. Every member says which rounds its
    checkpoints hold; once all are back, rank 0's barrier goes on at the newest round its journal keeps of which
    every member has a checkpoint (as `cluster --resume`), every member from its checkpoint of it: the run ends
    with `simulate`'s models, bit for bit, nodes.csv has every round's rows once, and summary.json keeps the stop
    and the resume. (A member that rank 0's last 2 s missed ends after a short --barrier-grace, as above.)"""
    from mosaicd.settings import Settings

    run = {**RUN, "rounds": 40, "barrier_grace": 15, "node_profile": kit.pace(tmp_path, PACE_S)}
    ports = stopped_by_rank_0(kit, tmp_path, run)
    out = tmp_path / f"out-{ports[0]}"
    stopped_at = json.loads((out / "barrier-state.json").read_text())["state"]["round"]
    codes, said = started_again(kit, tmp_path, run, ports)
    assert set(codes) == {0}, {p: s[-1500:] for p, s in said.items()}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    resumed = [re.search(r"^mosaicd node: run \S+ goes on with (\d+) of 40 rounds done, the newest point every "
                         r"member holds a checkpoint of: this node resumes from its checkpoint of round (\d+)$", s,
                         re.MULTILINE) for s in said.values()]
    assert all(resumed), {p: s[-1500:] for (p, s), m in zip(said.items(), resumed, strict=True) if m is None}
    rounds = {(int(m[1]), int(m[2])) for m in resumed if m}
    assert len(rounds) == 1, [m[0] for m in resumed if m]
    (at, of), = rounds
    assert at == of and stopped_at - 1 <= at <= stopped_at and at >= 10, (at, of, stopped_at)  # every one: exactly
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run)), summary["model_sha256"]
    with open(out / "nodes.csv", newline="") as f:
        rows = [(int(r["round"]), int(r["node"])) for r in csv.DictReader(f)]
    assert sorted(rows) == [(t, n) for t in range(40) for n in range(4)], "a round's rows missing or twice"
    (entry,) = summary["resumed"]
    assert entry["round"] == at and entry["stopped_at_round"] == stopped_at and entry["at"], entry
    assert "which hosts the barrier, stopped" in entry["stopped"] and "SIGTERM" in entry["stopped"], entry
    assert summary["resumed_at"] == at


@pytest.mark.slow
def test_a_peer_list_that_cannot_resume_exactly_says_why_on_every_member(tmp_path: Path, kit: Any) -> None:
    """A member started again without its checkpoints (its state directory gone): the run cannot go on exactly, and
    does not go on otherwise: every member exits 1 saying why, summary.json says so, and the journal is kept."""
    run = {**RUN, "rounds": 40, "barrier_grace": 15, "node_profile": kit.pace(tmp_path, PACE_S)}
    ports = stopped_by_rank_0(kit, tmp_path, run)
    out = tmp_path / f"out-{ports[0]}"
    journal = (out / "barrier-state.json").read_text()
    shutil.rmtree(tmp_path / f"out-{ports[2]}" / "state")
    codes, said = started_again(kit, tmp_path, run, ports)
    assert set(codes) == {1}, {p: s[-1500:] for p, s in said.items()}
    for port, text in said.items():
        assert "mosaicd node: error:" in text and "cannot be resumed exactly" in text, (port, text[-2000:])
        assert f"rank 2 (127.0.0.1:{ports[2]}) has checkpoints of rounds none" in text, (port, text[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot be resumed exactly" in summary["error"], summary
    assert (out / "barrier-state.json").read_text() == journal  # nothing changed: it can be fixed and resumed


@pytest.mark.slow
def test_rank_0_killed_and_started_again_resumes_exactly_once_the_others_are_started_again(tmp_path: Path,
                                                                                          kit: Any) -> None:
    """Rank 0 SIGKILLed: its barrier could tell no one, and the others wait for it. Started again, it waits for every
    member to come back with its checkpoints: a member still running from before is refused at its next arrival,
    saying to start it again, and exits 1; started again, the run goes on exactly, to `simulate`'s models."""
    from mosaicd.settings import Settings

    run = {**RUN, "rounds": 40, "node_profile": kit.pace(tmp_path, PACE_S)}
    procs, ports = peer_list(kit, tmp_path, run)
    again: dict[int, subprocess.Popen] = {}
    others: dict[int, subprocess.Popen] = {}
    try:
        kit.wait_until(lambda: (barrier_status(kit, ports[0]) or {}).get("round", 0) >= 10, 60, "round 10")
        procs[ports[0]].send_signal(signal.SIGKILL)
        assert exited(tmp_path, procs, ports[0], 10) == -signal.SIGKILL
        again, _ = peer_list(kit, tmp_path, run, ports[:1], logs="again")
        codes = [exited(tmp_path, procs, port, 60) for port in ports[1:]]
        assert set(codes) == {1}, codes
        for port in ports[1:]:
            said = (tmp_path / f"node-{port}.log").read_text()
            assert "mosaicd node: error:" in said and "restart it" in said, said[-2000:]
        others, _ = peer_list(kit, tmp_path, run, ports[1:], logs="again")
        codes = [exited(tmp_path, {**again, **others}, port, 120, logs="again") for port in ports]
    finally:
        for group in (procs, again, others):  # the same ports: each its own processes
            kit.stop_all(group)
    assert set(codes) == {0}, codes
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    assert len(summary["resumed"]) == 1 and summary["resumed"][0]["stopped"] is None  # a crash says no why


async def test_members_back_with_their_checkpoints_go_on_at_the_newest_round_all_of_them_hold(tmp_path: Path,
                                                                                             kit: Any) -> None:
    """Rank 0's barrier started again (`members_return`): it answers no member before all are back, then goes on
    at the newest round its journal keeps of which each holds a checkpoint (here the one before the open round:
    rank 1 lacks the open round's), every answer `resumed` at that round; the rows of the rounds done again are
    dropped, and summary.json will say where it went on. An address that is not a member is refused."""
    import aiohttp

    run = dict(nodes=3, rounds=20, fragments=2, fanout=1, dim=8, seed=3, train=False, eval_every=0,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10, insecure=True)
    out = tmp_path / "barrier"
    addresses = await kit.barrier_run_stopped(run, out, rounds=4)
    assert json.loads((out / "barrier-state.json").read_text())["state"]["round"] == 4
    again, runner, settings = await kit.served_barrier(run, out, members_return=True)
    held = {0: [4, 3, 2], 1: [3, 2, 1], 2: [4, 3, 2]}
    try:
        async with aiohttp.ClientSession() as session:
            async def register(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                async with session.post(f"{settings.barrier_url}/v1/register", json=body) as answer:
                    return answer.status, await answer.json()

            assert (await register({"address": addresses[0], "checkpoints": "4"}))[0] == 400
            stranger = await register({"address": "127.0.0.1:9", "checkpoints": [4]})
            assert stranger[0] == 409 and "has no member 127.0.0.1:9" in stranger[1]["detail"], stranger
            first = asyncio.ensure_future(register({"address": addresses[0], "checkpoints": held[0]}))
            await asyncio.sleep(0.3)
            assert not first.done() and again.state.phase.value == "rebinding"  # not before every member is back
            others = [register({"address": addresses[r], "checkpoints": held[r]}) for r in (1, 2)]
            answers = await asyncio.wait_for(asyncio.gather(first, *others), 30)
    finally:
        await runner.cleanup()
    assert [a[0] for a in answers] == [200] * 3, answers
    assert [(a[1]["rank"], a[1]["round"], a[1].get("resumed")) for a in answers] == [(r, 3, True) for r in range(3)]
    assert again.state.phase.value == "running" and again.state.round == 3 and again.ending.resumed_at == 3
    assert again.recorder.notes["resumed"][-1]["round"] == 3 and again.recorder.notes["resumed"][-1][
        "stopped_at_round"] == 4
    with open(out / "nodes.csv", newline="") as f:
        assert {int(r["round"]) for r in csv.DictReader(f)} == {0, 1, 2}  # round 3 is done again


async def test_a_failed_run_still_evaluating_when_its_barrier_stops_is_recorded_failed(tmp_path: Path,
                                                                                          kit: Any) -> None:
    """Rank 0 under scancel: the others leave (too few: the run fails), and rank 0 is told to stop while its
    barrier still evaluates the last models. summary.json says "failed" and why, never "running"."""
    run = dict(nodes=3, rounds=50, fragments=2, fanout=2, dim=8, seed=3, train=False, eval_every=1,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10)
    evaluating, go_on, evaluation = threading.Event(), threading.Event(), NetworkEvaluation(tmp_path / "data")

    def slow_evaluation(run: Any, vectors: list[np.ndarray]) -> dict[str, Any]:
        evaluating.set()
        go_on.wait(30)
        return evaluation(run, vectors)

    barrier, runner, settings = await kit.served_barrier(run, tmp_path / "barrier", evaluate=slow_evaluation)
    peers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(settings.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        peers.sort(key=lambda p: p.rank)
        vectors = {p.rank: np.full(settings.dim, float(p.rank), np.float32) for p in peers}
        for _ in range(2):
            results = await asyncio.wait_for(asyncio.gather(*(p.gossip(vectors[p.rank]) for p in peers)), 30)
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
        assert await asyncio.to_thread(evaluating.wait, 10)
        await asyncio.wait_for(peers[2].leave("it was told to stop (SIGTERM)"), 4)  # not after the evaluation
        with pytest.raises(RunEnded):
            await asyncio.wait_for(peers[0].gossip(vectors[peers[0].rank]), 30)
        assert not barrier.done.is_set()  # the run's end waits for its evaluations
        await runner.cleanup()  # the process hosting the barrier stops
        summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
        assert summary["status"] == "failed", summary
        assert "fewer than the 3 the run needs" in summary["error"] and "SIGTERM" in summary["error"], summary
        assert summary["left"] == [2] and barrier.done.is_set()
    finally:
        go_on.set()
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


@pytest.mark.slow
def test_nodes_that_cannot_start_end_a_cluster_with_their_reason(tmp_path: Path, kit: Any) -> None:
    """Nodes that fail at their first training step (a missing data set is found by the launcher before any node
    starts now: tests/experiments/test_failed_runs.py) end the run with their reason."""
    task = write_tasks(tmp_path / "tasks") / "bad.py"
    started = time.monotonic()
    proc = subprocess.run([*kit.by_hand, "cluster", "--task", f"{task}:Small", "--task-option", "fail=train",
                           "--nodes", "4", "--rounds", "1", "--fanout", "2", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-2000:])
    assert "the training data went away" in proc.stderr and "exited with status 1" in proc.stderr, proc.stderr
    assert "--resume continues it" not in proc.stderr  # no node got past its first round: nothing to resume
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "the training data went away" in summary["error"], summary


@pytest.mark.slow
def test_a_peer_list_member_with_other_run_settings_is_refused_naming_them(tmp_path: Path, kit: Any) -> None:
    run = {**RUN, "rounds": 30}
    ports = sorted(free_ports(run["nodes"]))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    procs = {}
    for port in ports:
        mine = {**run, "rounds": 5, "fragments": 8} if port == ports[2] else run
        with open(tmp_path / f"node-{port}.log", "wb") as log:
            procs[port] = subprocess.Popen(
                [*kit.by_hand, "node", "--peer-list", str(tmp_path / "peers.txt"), "--port", str(port), "--host",
                 "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), *kit.flags(mine)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        codes = {port: procs[port].wait(timeout=120) for port in ports}
    finally:
        kit.stop_all(procs)
    said = (tmp_path / f"node-{ports[2]}.log").read_text()
    assert codes[ports[2]] == 2 and "--rounds 5 (the run's: 30)" in said and "--fragments 8 (the run's: 2)" in said
    assert [codes[p] for p in ports if p != ports[2]] == [0, 0, 0], codes  # the others go on without it
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["left"] == [2]


@pytest.mark.slow
def test_a_peer_list_member_that_never_starts_is_named_when_registration_gives_up(tmp_path: Path, kit: Any) -> None:
    """Two of three listed members start: rank 0's barrier gives up at --register-deadline naming the address that
    never registered, and both members end with that reason, exit 1."""
    ports = sorted(free_ports(3))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    run = {**RUN, "nodes": 3, "fanout": 1, "register_deadline": 6}
    procs = {}
    try:
        for port in ports[:2]:
            with open(tmp_path / f"node-{port}.log", "wb") as log:
                procs[port] = subprocess.Popen(
                    [*kit.by_hand, "node", "--peer-list", str(tmp_path / "peers.txt"), "--port", str(port), "--host",
                     "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), "--log-json", *kit.flags(run)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for port, proc in procs.items():
            assert proc.wait(timeout=60) == 1, (tmp_path / f"node-{port}.log").read_text()[-2000:]
            said = (tmp_path / f"node-{port}.log").read_text()
            assert f"passed with 2 of 3 nodes; not registered: 127.0.0.1:{ports[2]}" in said, said[-2000:]
    finally:
        kit.stop_all(procs)


@pytest.mark.parametrize(("odd", "said"), [
    (Layout.flat(9), "a model of 9 values"),
    (Layout.from_pairs([("w", (2, 4))]), "the same 8 values as rank"),
])
async def test_members_that_build_different_models_end_the_run_at_once_naming_them(
        tmp_path: Path, kit: Any, odd: Layout, said: str) -> None:
    """A `Peer` whose model is not the others' would have every fragment refused (foreign_fingerprint) and the run
    "finish" with nothing exchanged: the barrier compares the layouts the arrivals claim and ends the run, failed."""
    run = dict(nodes=3, rounds=5, fragments=2, fanout=1, dim=8, seed=3, train=False, eval_every=0,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10)
    _, runner, settings = await kit.served_barrier(run, tmp_path / "barrier")
    peers = [Peer(settings, layout) for layout in (Layout.flat(8), Layout.flat(8), odd)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        ended = await asyncio.wait_for(asyncio.gather(
            *(p.gossip(np.zeros(p.inbox.layout.dim, np.float32)) for p in peers), return_exceptions=True), 30)
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()
    assert all(isinstance(e, RunEnded) and "the members build different models" in str(e) for e in ended), ended
    summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
    assert summary["status"] == "failed" and said in summary["error"], summary
    assert f"rank {peers[2].rank} fragments" in summary["error"] or f"rank {peers[2].rank}'s" in summary["error"]

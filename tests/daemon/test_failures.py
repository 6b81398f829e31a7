"""Failures on loopback: a node killed mid-run is a straggler, then dropped, and the others finish; and the
`Cluster` launcher leaves no process behind when a run fails."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from mosaicd import Settings
from mosaicd.experiments.cluster import Cluster, ClusterFailed, free_ports


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def port_free(port: int) -> bool:
    """Nothing listens on `port` any more."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def status(kit: Any, port: int) -> dict | None:
    try:
        reply = kit.http("GET", f"http://127.0.0.1:{port}/v1/status", timeout=2)
    except OSError:
        return None
    return reply.json() if reply.status == 200 else None


def launcher(tmp_path: Path, kit: Any, run: dict[str, Any]) -> tuple[int, list[int], dict[int, subprocess.Popen],
                                                                   Any]:
    """Free ports for a barrier and run["nodes"] nodes, and spawn(name, port, *args) for their processes."""
    ports = free_ports(run["nodes"] + 1)
    procs: dict[int, subprocess.Popen] = {}

    def spawn(name: str, port: int, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[port] = subprocess.Popen(
                [*kit.by_hand, *args, "--host", "127.0.0.1", "--port", str(port), "--log-json",
                 *kit.role_flags(args[0], run)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    return ports[0], ports[1:], procs, spawn


@pytest.mark.slow
def test_killed_node_is_a_straggler_then_dropped_and_the_others_finish(tmp_path: Path, kit: Any) -> None:
    # 0.05 s a round at least (kit.pace): the kill comes mid-run, within a round of the status read that
    # triggers it, on a fast host too
    run = dict(nodes=6, rounds=40, fragments=4, fanout=2, round_deadline=2, drop_after=2, eval_every=10,
               request_timeout=5, retries=1, node_profile=kit.pace(tmp_path, 0.05))
    barrier_port, node_ports, procs, spawn = launcher(tmp_path, kit, run)

    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"))
        for i, port in enumerate(node_ports):
            spawn(f"node-{i}", port, "node", "--barrier-url", f"http://127.0.0.1:{barrier_port}",
                  "--out", str(tmp_path / f"node-{i}"))
        view = kit.wait_until(lambda: (s := status(kit, barrier_port)) and s["round"] >= 3 and s, 60, "round 3",
                              explain=kit.log_tail(tmp_path / "barrier.log"))
        victim = 2
        address = next(m["address"] for m in view["members"] if m["rank"] == victim)
        victim_port = int(address.rsplit(":", 1)[1])
        assert view["round"] < run["rounds"] - 10, "the run went too fast to kill a node in the middle of it"
        procs[victim_port].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert procs[victim_port].wait(timeout=10) == -signal.SIGKILL

        seen: list[tuple[float, list[int], list[int], list[int]]] = []  # (time, stragglers, dropped, live)

        def watch() -> bool:
            s = status(kit, barrier_port)
            if s is None:  # the barrier is gone: the run is over
                return True
            seen.append((time.monotonic() - killed_at, s["stragglers"], s["dropped"], s["live"]))
            return s["phase"] == "finished"

        kit.wait_until(watch, 60, "the barrier to finish the run", interval=0.02)
        for port, proc in procs.items():
            if port != victim_port:
                assert proc.wait(timeout=30) == 0, (port, (tmp_path / "barrier.log").read_text()[-3000:])
        finished_in = time.monotonic() - killed_at
    finally:
        kit.stop_all(procs)

    # straggler first (missed one deadline), then dropped (missed --drop-after of them)
    straggling = [t for t, stragglers, dropped, _ in seen if victim in stragglers and victim not in dropped]
    dropped_at = [t for t, _, dropped, live in seen if victim in dropped and victim not in live]
    assert straggling and dropped_at, seen[:50]
    assert min(straggling) < min(dropped_at)
    # it takes about drop_after round deadlines (2 x 2 s) to drop a dead node, and the run goes on after that
    assert 1.5 < min(dropped_at) < 30
    assert finished_in < 60
    others = [r for r in range(run["nodes"]) if r != victim]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dropped"] == [victim]
    assert summary["members"] == others
    assert sorted(summary["model_sha256"], key=int) == [str(r) for r in others]
    assert summary["final"]["round"] == run["rounds"] - 1 and summary["final"]["nodes"] == others
    # every other node reported every round; the victim's reports stop where it died
    rows = (tmp_path / "run" / "nodes.csv").read_text().splitlines()[1:]
    per_node: dict[int, set[int]] = {}
    for row in rows:
        t, node = row.split(",")[:2]
        per_node.setdefault(int(node), set()).add(int(t))
    assert all(per_node[r] == set(range(run["rounds"])) for r in others)
    assert max(per_node[victim]) < view["round"] + 2


def test_cluster_fails_and_leaves_no_process_when_a_node_is_killed(tmp_path: Path, kit: Any) -> None:
    settings = Settings(nodes=4, rounds=100_000, fanout=2, eval_every=0, out=tmp_path / "run")
    cluster = Cluster(settings, progress=False, fail_fast=True)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_until(lambda: (s := status(kit, cluster.barrier_port or 0)) and s["round"] >= 2, 60, "round 2")
        pids = {name: p.pid for name, p in cluster.procs.items()}
        assert len(pids) == 5 and all(not gone(pid) for pid in pids.values())
        os.kill(pids["node-1"], signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        cluster.stop()
    assert isinstance(result.get("error"), ClusterFailed), result
    assert "node-1" in str(result["error"]) and "-9" in str(result["error"])
    kit.wait_until(lambda: all(gone(pid) for pid in pids.values()), 10, "every cluster process to exit")
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    assert not children & set(pids.values())
    assert all(port_free(p) for p in [cluster.barrier_port, *cluster.node_ports])


def test_cluster_timeout_leaves_no_process(tmp_path: Path, kit: Any) -> None:
    settings = Settings(nodes=3, rounds=100_000, fanout=1, eval_every=0, out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    started = time.monotonic()
    with pytest.raises(ClusterFailed, match="did not finish in time"):
        cluster.run(timeout=4)
    assert time.monotonic() - started < 20
    pids = [p.pid for p in cluster.procs.values()]
    assert len(pids) == 4 and all(gone(pid) for pid in pids)
    assert all(p.returncode is not None for p in cluster.procs.values())


def test_killed_cluster_command_takes_its_processes_with_it(tmp_path: Path, kit: Any) -> None:
    """`mosaicd cluster` killed with SIGKILL (no chance to clean up): its children die with it (PDEATHSIG)."""
    out = tmp_path / "run"
    parent = subprocess.Popen([*kit.by_hand, "cluster", "--nodes", "3", "--fanout", "1", "--rounds", "100000",
                               "--eval-every", "0", "--out", str(out), "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    procs: list[psutil.Process] = []
    try:
        def children() -> list[psutil.Process] | None:
            found = psutil.Process(parent.pid).children(recursive=True)
            return found if len(found) == 4 else None

        procs = kit.wait_until(children, 30, "the barrier and 3 nodes")

        def some_rounds() -> bool:
            return (out / "nodes.csv").exists() and len((out / "nodes.csv").read_text().splitlines()) > 6

        kit.wait_until(some_rounds, 60, "a few rounds")
        parent.kill()
        assert parent.wait(timeout=10) == -signal.SIGKILL
        kit.wait_until(lambda: all(gone(p.pid) for p in procs), 15, "the children to die with their parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for proc in procs:  # only left if the test failed
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.slow
@pytest.mark.parametrize("request_timeout,eval_every", [(1, 10), (20, 2)])
def test_stopped_node_gets_the_barrier_decisions_of_the_in_memory_barrier(tmp_path: Path, kit: Any,
                                                                         request_timeout: int, eval_every: int) -> None:
    """SIGSTOP a node on a loopback cluster: the barrier's release, straggler and drop sequence is exactly what
    `InMemoryNetwork` + `BarrierState` decide when the same members miss the same rounds in memory; the stopped
    node misses every round from its stop until it is dropped. Its peers retry their sends to it (--retries 30)
    but only within the round's budget: none is dropped with it (sends retried past the deadline would make them
    all miss two rounds in a row); and a --request-timeout longer than the round deadline does not hold a release
    behind the collection of the stopped node's model for an evaluation (then the rounds around it would take
    --request-timeout longer). Another member missing a round now and then is the host's load (with 3 s rounds, 1 s
    left to arrive after the sends): counted with the load, and replayed in memory too."""
    from mosaic_proto import BarrierState, Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic

    run = dict(nodes=6, rounds=40, fragments=4, fanout=2, dim=16, seed=3, round_deadline=3, drop_after=2,
               eval_every=eval_every, request_timeout=request_timeout, retries=30)
    barrier_port, node_ports, procs, spawn = launcher(tmp_path, kit, run)

    victim = 3
    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"))
        for i, port in enumerate(node_ports):
            spawn(f"node-{i}", port, "node", "--barrier-url", f"http://127.0.0.1:{barrier_port}")
        view = kit.wait_until(lambda: (s := status(kit, barrier_port)) and s["round"] >= 3 and s, 60, "round 3")
        address = next(m["address"] for m in view["members"] if m["rank"] == victim)
        proc = procs[int(address.rsplit(":", 1)[1])]
        proc.send_signal(signal.SIGSTOP)
        assert view["round"] < run["rounds"] - 10, "the run went too fast to stop a node in the middle of it"
        dropped = kit.wait_until(lambda: (s := status(kit, barrier_port)) and victim in s["dropped"] and s, 60,
                                 "the drop")
        # still stopped for a few rounds more: a collection of its model must not hold the releases back
        kit.wait_until(lambda: (s := status(kit, barrier_port)) is None or s["round"] >= dropped["round"] + 4
                       or s["phase"] != "running", 60, "4 rounds after the drop")
        proc.send_signal(signal.SIGCONT)
        kit.wait_until(lambda: status(kit, barrier_port) is None or status(kit, barrier_port)["phase"] == "finished",
                       90, "the barrier to finish the run")
        for port, p in procs.items():
            if p is not proc:
                assert p.wait(timeout=30) == 0, (port, (tmp_path / "barrier.log").read_text()[-3000:])
        assert proc.wait(timeout=30) != 0  # it learns that it was dropped, and says so
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=10)

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    events = summary["events"]
    missed = {e["round"]: set(e["stragglers"]) for e in events}
    drops = [e for e in events if e["dropped"]]
    assert [e["dropped"] for e in drops] == [[victim]], events
    drop = drops[0]["round"]
    missed_from = drop - run["drop_after"] + 1  # every round from its stop (after the view) to its drop
    assert missed_from >= view["round"] and all(victim in missed.get(t, ()) for t in range(missed_from, drop + 1))
    assert summary["dropped"] == [victim], summary  # nobody else: their sends kept to the round's budget
    barrier = BarrierState(rounds=run["rounds"], round_deadline=run["round_deadline"], drop_after=run["drop_after"],
                           expected=run["nodes"])
    q = Quadratic.build(run["nodes"], run["dim"], "correlated", run["seed"], lr=0.05, local_steps=1)
    network = InMemoryNetwork([q.initial(i) for i in range(run["nodes"])],
                              Fragmentation.build(Layout.flat(run["dim"]), run["fragments"], run["seed"], "random"),
                              PeerSampler("local", run["fanout"], run["seed"]), q.train, barrier=barrier)
    for t in range(run["rounds"]):
        network.step(absent=missed.get(t, set()))
    network.finish()
    assert events == [e.to_json() for e in barrier.events]
    assert summary["members"] == network.members

    # an evaluation's collection of the stopped node's model does not hold the releases back for --request-timeout
    rows = [r for r in csv.DictReader((tmp_path / "run" / "rounds.csv").read_text().splitlines()) if r["elapsed_s"]]
    took = max(float(b["elapsed_s"]) - float(a["elapsed_s"]) for a, b in itertools.pairwise(rows))
    if request_timeout > run["round_deadline"]:
        assert took < request_timeout, rows
    others = sorted(t for t, ranks in missed.items() if ranks - {victim})
    kit.measured(f"SIGSTOPped node (--request-timeout {request_timeout} s, 3 s rounds): rounds in which another "
                 f"member straggled {others or 'none'}; the longest time between evaluations {took:.1f} s; "
                 f"load {os.getloadavg()[0]:.1f}")


@pytest.mark.slow
def test_cluster_goes_on_without_a_killed_node(tmp_path: Path, kit: Any) -> None:
    """`mosaicd cluster` survives what the protocol survives: a dead node is reported, told to the barrier as left
    (by the launcher, which saw its process end), and the run ends without it."""
    # round_deadline 30: the leave, not a drop (test_killed_node_is_a_straggler_then_dropped_...), lets them go on
    settings = Settings(nodes=5, rounds=60, fanout=2, eval_every=10, round_deadline=30, drop_after=2,
                        request_timeout=2, retries=0, out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_until(lambda: (s := status(kit, cluster.barrier_port or 0)) and s["round"] >= 3, 60, "round 3")
        os.kill(cluster.procs["node-1"].pid, signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        cluster.stop()
    assert "summary" in result, result
    summary = result["summary"]
    assert summary["status"] == "finished" and summary["left"] == [1] and summary["dropped"] == [], summary
    assert summary["members"] == [0, 2, 3, 4] and sorted(summary["model_sha256"]) == ["0", "2", "3", "4"]
    assert cluster.dead == {"node-1": -signal.SIGKILL}


@pytest.mark.slow
def test_a_registered_node_ends_at_once_when_the_barrier_gives_up_registration(tmp_path: Path, kit: Any) -> None:
    """The barrier's --register-deadline passes with 1 of 3 nodes: the node that registered hears why and exits 1
    then, not after its own --register-deadline of retrying a barrier that is gone."""
    run = dict(nodes=3, rounds=5, fanout=1)
    barrier_port, node_ports, procs, spawn = launcher(tmp_path, kit, run)
    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"), "--register-deadline", "4")
        started = time.monotonic()
        spawn("node-0", node_ports[0], "node", "--barrier-url", f"http://127.0.0.1:{barrier_port}",
              "--register-deadline", "120")
        node = procs[node_ports[0]]
        assert node.wait(timeout=60) == 1 and time.monotonic() - started < 30
        log = (tmp_path / "node-0.log").read_text()
        assert "registration deadline (4s) passed with 1 of 3 nodes" in log, log[-2000:]
    finally:
        kit.stop_all(procs)


@pytest.mark.slow
def test_a_node_told_to_stop_while_it_waits_for_the_roster_withdraws(tmp_path: Path, kit: Any) -> None:
    """Of 3 expected nodes, 2 register and one is given SIGTERM: it withdraws its registration (signed, as the
    address it registered) and exits 0, and the roster is made of the next ones to come, not with it, dead (which
    round 0 would wait for, and drop, as a straggler)."""
    (tmp_path / "secret").write_text("a-cluster-secret-of-enough-bytes-0123456789")
    run = dict(nodes=3, rounds=3, fanout=1, dim=8, round_deadline=10, secret_file=str(tmp_path / "secret"))
    barrier_port, _, procs, spawn = launcher(tmp_path, kit, run)
    node_ports = sorted(free_ports(4))
    url = f"http://127.0.0.1:{barrier_port}"

    def barrier_events(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / "barrier.log").read_text().splitlines()
        return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e.get("event") == name]
    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"))
        for i in (0, 1):
            spawn(f"node-{i}", node_ports[i], "node", "--barrier-url", url)
        kit.wait_until(lambda: len(barrier_events("registered")) == 2, 60, "two registrations")
        stopped = procs[node_ports[0]]
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=30) == 0, (tmp_path / "node-0.log").read_text()[-2000:]
        assert [e["address"] for e in barrier_events("withdrew")] == [f"127.0.0.1:{node_ports[0]}"]
        for i in (2, 3):
            spawn(f"node-{i}", node_ports[i], "node", "--barrier-url", url)
        for i in (1, 2, 3):
            assert procs[node_ports[i]].wait(timeout=120) == 0, (tmp_path / f"node-{i}.log").read_text()[-2000:]
    finally:
        kit.stop_all(procs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and len(summary["model_sha256"]) == 3
    assert summary["events"] == [] and summary["dropped"] == []  # no member missed a round


@pytest.mark.slow
def test_a_node_stopped_past_the_end_learns_it_and_exits_within_seconds(tmp_path: Path, kit: Any) -> None:
    """SIGSTOP a node mid-run; the others finish, the barrier and the nodes exit; SIGCONT: the node finds the
    barrier and every peer gone (connections refused, not cut off) and ends, saying so, well within 15 s of
    resuming, instead of retrying the barrier for --barrier-grace (120 s). Rounds here take 0.05 s at least
    (kit.pace; ~10 ms bare, less on a fast host): the node is stopped a third of the way in, so that it cannot have
    finished its part of the last round before the signal."""
    run = dict(nodes=4, rounds=24, fragments=2, fanout=2, round_deadline=2, drop_after=1, eval_every=6,
               request_timeout=5, retries=1, node_profile=kit.pace(tmp_path, 0.05))
    barrier_port, node_ports, procs, spawn = launcher(tmp_path, kit, run)
    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"), "--linger", "0")
        for i, port in enumerate(node_ports):
            spawn(f"node-{i}", port, "node", "--barrier-url", f"http://127.0.0.1:{barrier_port}",
                  "--out", str(tmp_path / f"node-{i}"))
        view = kit.wait_until(lambda: (s := status(kit, barrier_port)) and s["round"] >= run["rounds"] // 3 and s,
                              90, f"round {run['rounds'] // 3}")
        victim_port = int(next(m["address"] for m in view["members"] if m["rank"] == 1).rsplit(":", 1)[1])
        procs[victim_port].send_signal(signal.SIGSTOP)
        for port, proc in procs.items():  # the run ends without it; everyone else exits
            if port != victim_port:
                proc.wait(timeout=90)
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
        resumed = time.monotonic()
        procs[victim_port].send_signal(signal.SIGCONT)
        code = procs[victim_port].wait(timeout=60)
        took = time.monotonic() - resumed
    finally:
        kit.stop_all(procs)
    said = (tmp_path / f"node-{node_ports.index(victim_port)}.log").read_text()
    print(f"figures: the stopped node exited {took:.1f}s after SIGCONT (exit {code})")
    assert took < 15, said[-3000:]
    assert code != 0 and "neither the barrier nor any of the 3 other members listens any more" in said, said[-3000:]


@pytest.mark.slow
def test_a_stand_alone_barrier_whose_members_are_stopped_says_interrupted_and_exits_130(tmp_path: Path,
                                                                                       kit: Any) -> None:
    """4 nodes, fanout 2, a barrier of its own (compose's shape): three members told to stop at once leave too few,
    so a person stopped the run. The barrier counts every member stopped (the third after the interruption too),
    says so at warning (`interrupted`, no `run_failed` error), and exits 130 as docs/faults.md says, not 1 with
    "error: interrupted"; so does the member that was not told to stop, which hears it (no `error` line)."""
    # rounds: far more than a fast host runs before the members are told to stop (~200 such rounds a second)
    run = dict(nodes=4, rounds=20_000, fanout=2, dim=8, round_deadline=60)
    barrier_port, node_ports, procs, spawn = launcher(tmp_path, kit, run)
    try:
        spawn("barrier", barrier_port, "barrier", "--out", str(tmp_path / "run"))
        for i, port in enumerate(node_ports):
            spawn(f"node-{i}", port, "node", "--barrier-url", f"http://127.0.0.1:{barrier_port}")
        view = kit.wait_until(lambda: (s := status(kit, barrier_port)) and s["round"] >= 3 and s, 60, "round 3")
        ports = {m["rank"]: int(m["address"].rsplit(":", 1)[1]) for m in view["members"]}
        for rank, port in ports.items():
            if rank != 0:
                procs[port].send_signal(signal.SIGTERM)
        code = procs[barrier_port].wait(timeout=30)
        nodes = {rank: procs[port].wait(timeout=30) for rank, port in ports.items()}
    finally:
        kit.stop_all(procs)
    lines = (tmp_path / "barrier.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert code == 130, lines[-5:]
    # the member not told to stop hears the run was interrupted: it says so, not an error, and exits 130 too
    said0 = (tmp_path / f"node-{node_ports.index(ports[0])}.log").read_text()
    assert nodes == {0: 130, 1: 0, 2: 0, 3: 0}, (nodes, said0[-2000:])
    # what it heard when it asked: the members told to stop by then (the barrier counts the later ones too, below)
    ended = re.search(r"^mosaicd node: the run ended(?: after round \d+)?: interrupted \([23] of 4 members", said0,
                      re.M)
    assert ended, said0[-2000:]
    assert "mosaicd node: error" not in said0 and '"level": "error"' not in said0, said0[-2000:]
    said = [e for e in events if e.get("event") == "interrupted"]
    assert said and all(e["level"] == "warning" for e in said) and said[-1]["ranks"] == [1, 2, 3], said
    assert not [e for e in events if e.get("level") == "error"], [e for e in events if e.get("level") == "error"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["members_stopped"] == [1, 2, 3], summary
    assert summary["error"].startswith("interrupted (3 of 4 members were told to stop (SIGTERM), ranks [1, 2, 3]")

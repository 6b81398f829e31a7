"""Recovery on loopback, with real processes: a barrier SIGKILLed mid-run and started again resumes the run
(same models as the in-memory reference); a node SIGKILLed and started again rejoins from its checkpoint; a
barrier and nodes started again for a new run keep the last run's results and do not take its checkpoints for
theirs; a node that starts late joins with --allow-join; a node frozen for a while costs nobody their place.

Each test prints how long the recovery took (pytest -s shows it); nothing here asserts a speed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaicd import Settings
from mosaicd.daemon.http.auth import write_new_secret
from mosaicd.experiments.cluster import free_ports
from mosaicd.outputs import read_rounds

pytestmark = pytest.mark.slow


class Lab:
    """A barrier and nodes as separate `mosaicd` processes on 127.0.0.1 (fixed ports, so a restart is the same
    member), each with its own log."""

    def __init__(self, tmp_path: Path, kit: Any, run: dict[str, Any], extra_ports: int = 0) -> None:
        self.tmp, self.kit, self.run = tmp_path, kit, run
        ports = free_ports(run["nodes"] + 1 + extra_ports)
        self.barrier_port, self.node_ports = ports[0], ports[1:]
        self.procs: dict[str, subprocess.Popen] = {}
        self.out = tmp_path / "run"

    def spawn(self, name: str, port: int, command: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([*self.kit.by_hand, command, *args, "--host", "127.0.0.1", "--port", str(port),
                                 "--log-json", *self.kit.role_flags(command, self.run)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[name] = proc
        return proc

    def barrier(self, *args: str) -> subprocess.Popen:
        return self.spawn("barrier", self.barrier_port, "barrier", "--out", str(self.out), *args)

    def start(self, *barrier_args: str) -> None:
        self.barrier(*barrier_args)
        for i in range(self.run["nodes"]):
            self.node(i)

    def exited_cleanly(self) -> None:
        """Every process that was not SIGKILLed exits 0."""
        for name, proc in self.procs.items():
            if proc.returncode != -signal.SIGKILL:
                assert proc.wait(timeout=30) == 0, (name, (self.tmp / f"{name}.log").read_text()[-3000:])

    def node(self, i: int, *args: str) -> subprocess.Popen:
        return self.spawn(f"node-{i}", self.node_ports[i], "node", "--barrier-url",
                          f"http://127.0.0.1:{self.barrier_port}", "--out", str(self.tmp / f"node-{i}"), *args)

    def status(self) -> dict | None:
        try:
            reply = self.kit.http("GET", f"http://127.0.0.1:{self.barrier_port}/v1/status", timeout=2)
        except OSError:
            return None
        return reply.json() if reply.status == 200 else None

    def at_round(self, round: int, timeout: float = 60) -> dict:
        return self.kit.wait_until(lambda: (s := self.status()) and s["round"] >= round and s, timeout,
                                   f"the barrier at round {round}", interval=0.01)

    def freeze(self, name: str, seconds: float) -> None:
        """SIGSTOP process `name` for `seconds`, then SIGCONT."""
        self.procs[name].send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.procs[name].send_signal(signal.SIGCONT)

    def summary(self, timeout: float = 120) -> dict:
        path = self.out / "summary.json"
        self.kit.wait_until(lambda: path.exists() and json.loads(path.read_text())["status"] != "running", timeout,
                            "the run's final summary.json")
        return json.loads(path.read_text())

    def log(self, name: str) -> list[dict]:
        lines = (self.tmp / f"{name}.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)


def node_rounds(out: Path) -> dict[int, set[int]]:
    rounds: dict[int, set[int]] = {}
    for row in (out / "nodes.csv").read_text().splitlines()[1:]:
        t, node = row.split(",")[:2]
        rounds.setdefault(int(node), set()).add(int(t))
    return rounds


# many short rounds: whenever the test acts (round 10 or a little later), most of the run is still ahead
RUN = dict(nodes=5, rounds=300, fragments=4, fanout=2, dim=64, seed=5, eval_every=50, drop_after=2)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_barrier_killed_at_round_10_and_restarted_resumes_the_run_to_the_reference_models(
        tmp_path: Path, kit: Any, how: signal.Signals) -> None:
    """SIGKILL, or Ctrl-C (then its summary says interrupted, not running, and its console how to go on). SIGTERM
    (`docker stop`) ends it as Ctrl-C does: test_cluster_stops.py's launcher killed, whose barrier gets it."""
    # an evaluation every 5 rounds: the kill at round 10 cuts the collection of round 9 short, or just missed it
    run = {**RUN, "round_deadline": 20, "request_timeout": 5, "retries": 1, "barrier_grace": 60, "eval_every": 5}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        lab.at_round(10)
        lab.procs["barrier"].send_signal(how)
        killed_at = time.monotonic()
        assert lab.procs["barrier"].wait(timeout=10) == (-signal.SIGKILL if how == signal.SIGKILL else 130)
        saved = json.loads((lab.out / "barrier-state.json").read_text())["state"]
        if how != signal.SIGKILL:
            stopped = json.loads((lab.out / "summary.json").read_text())
            said_how = "Ctrl-C" if how == signal.SIGINT else "SIGTERM"
            assert stopped["status"] == "interrupted" and stopped["error"] == f"interrupted ({said_how})", stopped
            said = (tmp_path / "barrier.log").read_text()
            done = f"interrupted with {saved['round']} of {run['rounds']} rounds done; the same command"
            assert done in said, said[-2000:]
        assert 10 <= saved["round"] < run["rounds"] - 50, "the run went too fast to kill the barrier mid-run"
        time.sleep(1.0)  # the nodes find it gone and retry (--barrier-grace)
        lab.barrier()
        lab.at_round(saved["round"] + 1)
        resumed_in = time.monotonic() - killed_at
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    print(f"\nbarrier SIGKILLed at round {saved['round']}, restarted 1.0 s later: round {saved['round']} released "
          f"{resumed_in:.2f} s after the kill")
    assert summary["status"] == "finished" and summary["events"] == [] and summary["members"] == list(range(5))
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    rows = read_rounds(lab.out)  # every evaluation round has its row, once, across the restart too
    assert [r["round"] for r in rows] == list(range(4, run["rounds"], 5))
    assert all(len(r["per_node"]) == 5 and r["metric"] == rows[0]["metric"] for r in rows)  # the nodes' metrics
    assert all(r["average_model"] is not None for r in rows)  # by hand, no --task: the default task's, as cluster's
    assert all(rounds == set(range(run["rounds"])) for rounds in node_rounds(lab.out).values())
    restarted = lab.log("barrier")
    assert any(e["event"] == "resumed" and e["round"] == saved["round"] for e in restarted)
    retries = [e for i in range(run["nodes"]) for e in lab.log(f"node-{i}") if e["event"] == "barrier_unreachable"]
    assert retries and all("left_s" in e and "retry_in_s" in e for e in retries)  # every retry said so


def journal_of_a_3_node_run(tmp_path: Path, round_deadline: float) -> Settings:
    """OUT (tmp_path/run) with the journal of a 3-node, 5-round run just started, unsecured; its settings."""
    from mosaic_proto import BarrierState
    from mosaicd.daemon.barrier import journal as barrier_journal

    run = Settings(nodes=3, rounds=5, fanout=1, out=tmp_path / "run")
    state = BarrierState(rounds=5, round_deadline=round_deadline, drop_after=2, expected=3)
    for port in (1, 2, 3):
        state.register(f"127.0.0.1:{port}", 0.0)
    state.close(0.0)
    barrier_journal.save(run.out, run.run_config(), state, 0.0, secured=False)
    return run


def test_restarted_barrier_refuses_another_runs_settings(tmp_path: Path, kit: Any) -> None:
    """A run in progress in OUT is resumed only with its own settings; else the barrier says which differ."""
    run = journal_of_a_3_node_run(tmp_path, round_deadline=9)
    proc = subprocess.run([*kit.by_hand, "barrier", "--out", str(run.out), "--nodes", "3", "--rounds", "7",
                           "--fanout", "1", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # a usage error, as simulate --resume with other settings
    assert "holds run 'mosaic' in progress" in proc.stderr and "--rounds" in proc.stderr, proc.stderr
    assert json.loads((run.out / "barrier-state.json").read_text())["state"]["round"] == 0  # untouched


def test_restarted_barrier_takes_the_journals_node_count_only_where_it_counts_the_nodes(tmp_path: Path,
                                                                                      kit: Any) -> None:
    """A --nodes that differs from the run's is refused like any run setting; a barrier that counts the nodes
    (here --expect-settle; --expect-dns and a peer list alike) resumes the run with the run's count."""
    run = journal_of_a_3_node_run(tmp_path, round_deadline=60)
    saved = (run.out / "barrier-state.json").read_text()
    barrier = [*kit.by_hand, "barrier", "--out", str(run.out), "--nodes", "4", "--rounds", "5", "--fanout", "1"]
    given = subprocess.run([*barrier, "--port", "0"], capture_output=True, text=True, timeout=30)
    assert given.returncode == 2, given.stderr  # a usage error, as any other run setting
    assert "(--nodes 4; the run has --nodes 3)" in given.stderr, given.stderr
    assert (run.out / "barrier-state.json").read_text() == saved
    port_file, console = tmp_path / "port", tmp_path / "console.txt"
    with open(console, "wb") as said:  # its console, off a terminal: lines for people (not --log-json)
        counting = subprocess.Popen([*barrier, "--expect-settle", "1", "--port", "0", "--port-file", str(port_file)],
                                    stdout=said, stderr=subprocess.STDOUT)
    try:
        port = kit.wait_until(lambda: port_file.exists() and port_file.read_text().strip(), 30, "the port file")
        status = kit.wait_until(lambda: _status(kit, int(port)), 30, "the barrier's status")
        assert status["phase"] == "running" and status["live"] == [0, 1, 2] and status["settings"]["nodes"] == 3
        kit.wait_until(lambda: "resumed with" in console.read_text(), 30, "the resumed banner")
    finally:
        counting.terminate()
        stopped = time.monotonic()
        counting.wait(timeout=30)
    assert time.monotonic() - stopped < 15  # SIGTERM: out within seconds (a loaded host's), not at a deadline
    text = console.read_text()
    assert f"resumed with 0 of 5 rounds done, from the journal in {run.out}/" in text, text
    assert "registration closed" not in text and "round 0 starts" not in text, text


def _status(kit: Any, port: int) -> dict[str, Any] | None:
    try:
        return kit.http("GET", f"http://127.0.0.1:{port}/v1/status").json()
    except OSError:
        return None


@pytest.mark.parametrize("content", ['{"version": 1, "state": {}}', '[1]', '{"version": 1, "state": {"phase": '
                                     '"running", "round": 3}, "run": {}, "started": 0}', '{"version": 1, "sta'])
def test_a_barrier_refuses_a_damaged_journal_in_one_line(tmp_path: Path, kit: Any, content: str) -> None:
    """A barrier-state.json that is not a journal it can read (cut short, edited, another file) is no traceback."""
    (tmp_path / "barrier-state.json").write_text(content)
    proc = subprocess.run([*kit.by_hand, "barrier", "--out", str(tmp_path), "--nodes", "3", "--rounds", "7",
                           "--fanout", "1", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "barrier-state.json cannot be read" in proc.stderr and "move it away" in proc.stderr, proc.stderr
    assert (tmp_path / "barrier-state.json").read_text() == content


def test_a_barrier_that_cannot_write_its_out_says_so_in_one_line(tmp_path: Path, kit: Any) -> None:
    """An --out where the barrier cannot keep the run there aside (here `earlier` is a file; read-only and full
    folders end the same way): one line naming --out, exit 1, and the run that was there left as it was."""
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "settings": {"run_id": "old"}}))
    (tmp_path / "earlier").write_text("not a folder")
    proc = subprocess.run([*kit.by_hand, "barrier", "--out", str(tmp_path), "--nodes", "3", "--rounds", "7",
                           "--fanout", "1", "--port", "0", "--replace"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--out {tmp_path}: cannot write" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["run_id"] == "old"


def test_a_node_that_cannot_write_its_checkpoint_ends_the_run_saying_so(tmp_path: Path, kit: Any) -> None:
    """A node's checkpoint is written in the worker call that trains its next round (one hand-off a round): a write
    that fails there still ends the run, failed, with the path and why, before the node arrives at that round."""
    lab = Lab(tmp_path, kit, {**RUN, "rounds": 20})
    (tmp_path / "a-file").write_text("not a folder")
    try:
        lab.barrier()
        for i in range(lab.run["nodes"]):
            lab.node(i, *(["--state-dir", str(tmp_path / "a-file" / "state")] if i == 1 else []))
        summary = lab.summary()
        assert lab.procs["node-1"].wait(timeout=30) != 0
    finally:
        lab.stop()
    said = [e for e in lab.log("node-1") if "cannot write the checkpoint" in json.dumps(e)]
    assert said and str(tmp_path / "a-file") in json.dumps(said[0]), lab.log("node-1")[-5:]
    assert summary["status"] == "failed", summary
    assert "cannot write the checkpoint" in json.dumps(summary), summary
    # its first checkpoint (after round 0) failed as round 1 trained: the node never arrived at round 1
    assert summary["progress"]["rounds_done"] == 1, summary


def test_a_barrier_that_cannot_listen_leaves_its_out_untouched(tmp_path: Path, kit: Any) -> None:
    """Its port in use: one line naming --port, exit 1, before the run in --out is kept aside or a file written."""
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "settings": {"run_id": "old"}}))
    (tmp_path / "rounds.csv").write_text("round\n0\n")
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([*kit.by_hand, "barrier", "--out", str(tmp_path), "--nodes", "3", "--rounds", "7",
                               "--fanout", "1", "--host", "127.0.0.1", "--port", str(port)], capture_output=True,
                              text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--port {port}" in proc.stderr and "in use" in proc.stderr, proc.stderr
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before


def test_node_killed_and_restarted_rejoins_from_its_checkpoint(tmp_path: Path, kit: Any) -> None:
    """At the default round deadline (120 s), a node frozen mid-round (its peers' sends to it waiting), SIGKILLed and
    started again at once: the round it comes back in costs its peers seconds, not the deadline (its peers give up
    its fragments of that round: it answers "not ready" until it registers again, and sits that round out)."""
    run = {**RUN, "drop_after": 3, "retries": 6}  # retries for 6 s: its peers still send when it is back
    assert "round_deadline" not in run and Settings().round_deadline == 120
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        members = lab.at_round(10)["members"]
        victim = next(m["rank"] for m in members if m["address"] == f"127.0.0.1:{lab.node_ports[2]}")
        lab.procs["node-2"].send_signal(signal.SIGSTOP)  # frozen first: its peers' sends of the round wait on it
        time.sleep(1.0)
        lab.procs["node-2"].kill()
        killed_at = time.monotonic()
        assert lab.procs["node-2"].wait(timeout=10) == -signal.SIGKILL
        lab.node(2)
        view = lab.kit.wait_until(lambda: (s := lab.status()) and victim in s["live"] and s["round"] > 12 and s,
                                  60, "the node to be a member again")
        rejoined_in = time.monotonic() - killed_at
        history = kit.http("GET", f"http://127.0.0.1:{lab.barrier_port}/v1/history?since=9").json()["rounds"]
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    joined = [e for e in summary["events"] if victim in e["joined"]]
    assert len(joined) == 1, summary["events"]
    back_from = joined[0]["round"] + 1
    slowest = max((r for r in history if r["round"] <= back_from), key=lambda r: r["duration_s"] or 0)
    kit.measured(f"node {victim} SIGKILLed at round ~10, started again at once (round deadline 120 s): a member "
                 f"again from round {back_from}, seen live {rejoined_in:.2f} s after the kill (barrier at round "
                 f"{view['round']}); the slowest round "
                 f"meanwhile, {slowest['round']}, took {slowest['duration_s']:.2f} s (bound 15 s)")
    assert slowest["duration_s"] < 15, history
    assert summary["status"] == "finished" and summary["members"] == list(range(5)) and summary["dropped"] == []
    assert set(summary["model_sha256"]) == {str(r) for r in range(5)}
    rejoined = [e for e in lab.log("node-2") if e["event"] == "rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["model"] == "checkpoint" and rejoined[0]["round"] == back_from
    assert back_from - rejoined[0]["checkpoint_round"] <= 2
    assert any(e["event"] == "joining" and e["rank"] == victim for e in lab.log("barrier"))
    rounds = node_rounds(lab.out)[victim]
    assert set(range(back_from, run["rounds"])) <= rounds  # it took part in every round after it came back


@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_node_killed_and_restarted_at_the_default_deadline_costs_its_round_seconds(
        tmp_path: Path, kit: Any, checkpoint_every: int) -> None:
    """Issue #50: a node SIGKILLed and started again with the same command, at the default --round-deadline (120 s)
    and --request-timeout, with the cluster secret: its peers' sends that reach it while it rejoins are answered
    `rejoining` at once and given up for the round (it is a member again only from the next one), so no round waits
    for their send budget. Rounds take ~2 s (a profile), so the others send while it is starting again. Without
    checkpoints (--checkpoint-every 0) the node knows it came back from the note its registration left in its state
    directory, and goes on from a live peer's model."""
    profile = kit.pace(tmp_path, 2.0)
    secret = write_new_secret(tmp_path / "secret")
    run = {**RUN, "rounds": 14, "eval_every": 0, "node_profile": profile,
           "secret_file": str(secret), **({"checkpoint_every": 0} if checkpoint_every == 0 else {})}
    assert "round_deadline" not in run and "request_timeout" not in run and "retries" not in run  # the defaults
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        members = lab.at_round(3)["members"]
        victim = next(m["rank"] for m in members if m["address"] == f"127.0.0.1:{lab.node_ports[2]}")
        lab.procs["node-2"].kill()  # just after a release: the others train, then send to it while it restarts
        assert lab.procs["node-2"].wait(timeout=10) == -signal.SIGKILL
        lab.node(2)
        # bounded well past the 15 s aimed at, well short of the deadline that the stall this guards against took
        lab.kit.wait_until(lambda: (s := lab.status()) and victim in s["live"], 60, "the node to be a member again")
        summary = lab.summary(timeout=120)
        lab.exited_cleanly()
    finally:
        lab.stop()
    released = {e["round"]: e for e in lab.log("barrier") if e["event"] == "released"}
    (joined,) = [e for e in summary["events"] if victim in e["joined"]]
    back_from = joined["round"] + 1
    lost = [t for t in range(3, back_from + 1)]  # from the kill to the first round it is back in
    durations = {t: released[t]["duration_s"] for t in lost}
    print(f"\nnode {victim} SIGKILLed at round 3, started again at once (round deadline 120 s): rounds {lost[0]}-"
          f"{lost[-1]} took {', '.join(f'{d:.2f}' for d in durations.values())} s (a member again from round "
          f"{back_from})")
    assert max(durations.values()) < 15, durations
    assert summary["status"] == "finished" and summary["members"] == list(range(5)) and summary["dropped"] == []
    assert set(range(back_from, run["rounds"])) <= node_rounds(lab.out)[victim]
    # a rejoining receiver is routine: no peer warns of it (its connections refused while it was down are warned of)
    warned = [e for i in range(5) if i != 2 for e in lab.log(f"node-{i}") if e["level"] == "warning" and (
              e["event"] == "send_abandoned" or any(w in str(e.get("error")) for w in ("rejoining", "not_ready")))]
    assert not warned, warned
    told = [e for i in range(5) if i != 2 for e in lab.log(f"node-{i}") if e["event"] == "receiver_rejoining"]
    assert all(e["level"] == "info" and e["peer"] == victim for e in told), told
    state = tmp_path / "node-2" / "state" / f"127.0.0.1_{lab.node_ports[2]}"
    assert {p.name for p in state.iterdir()} == ({"member.json"} if checkpoint_every == 0 else
                                                 {"member.json", *(f"checkpoint-{i}.npz" for i in range(3))})
    (back,) = [e for e in lab.log("node-2") if e["event"] == "rejoined"]
    assert back["model"] == ("peer" if checkpoint_every == 0 else "checkpoint"), back


def test_a_new_run_on_the_state_of_a_finished_one_starts_anew_to_the_reference_models(
        tmp_path: Path, kit: Any) -> None:
    """The same barrier and nodes (the same --out, so the same state directories) started again: the barrier alone
    refuses to wait for the nodes of a finished run (exit 2, naming --replace, nothing moved); with --replace each
    node finds the last run's checkpoint and says it does not use it, the barrier keeps the last run's files in
    OUT/earlier/ and says so, and the new run is the reference's."""
    run = {**RUN, "nodes": 4, "rounds": 20, "eval_every": 5}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        first = lab.summary()
        lab.exited_cleanly()
        again = lab.barrier()
        assert again.wait(timeout=60) == 2
        said = (tmp_path / "barrier.log").read_text()
        assert "holds a finished run" in said and "--replace" in said and "Traceback" not in said, said[-2000:]
        assert not (lab.out / "earlier").exists()
        assert json.loads((lab.out / "summary.json").read_text())["model_sha256"] == first["model_sha256"]
        lab.start("--replace")
        second = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    assert first["status"] == second["status"] == "finished" and second["events"] == []
    assert first["model_sha256"] == second["model_sha256"] == kit.reference_hashes(Settings(**run))
    (kept,) = (lab.out / "earlier").iterdir()
    earlier = json.loads((kept / "summary.json").read_text())
    assert earlier["status"] == "finished" and earlier["model_sha256"] == first["model_sha256"]
    assert [r["round"] for r in read_rounds(kept)] == [r["round"] for r in read_rounds(lab.out)] == [4, 9, 14, 19]
    told = [e for e in lab.log("barrier") if e["event"] == "earlier_run_kept"]
    assert len(told) == 1 and told[0]["folder"] == str(kept)
    for i in range(run["nodes"]):
        unused = [e for e in lab.log(f"node-{i}") if e["event"] == "checkpoint_not_used"]
        assert len(unused) == 1 and unused[0]["checkpoint_round"] == run["rounds"], unused
        assert not any(e["event"] == "rejoined" for e in lab.log(f"node-{i}"))


def test_late_node_joins_with_allow_join_and_takes_part_from_its_join_round(tmp_path: Path, kit: Any) -> None:
    # 12 s of rounds at least: the late node's start (seconds on a loaded host) comes well before the end
    run = {**RUN, "nodes": 4, "round_deadline": 10, "request_timeout": 2, "retries": 1,
           "node_profile": kit.pace(tmp_path, 0.04)}
    lab = Lab(tmp_path, kit, run, extra_ports=1)
    late = 4
    try:
        lab.start("--allow-join")
        lab.at_round(8)
        asked_at = time.monotonic()
        lab.node(late)
        lab.kit.wait_until(lambda: (s := lab.status()) and late in s["live"] and s, 60, "the late node to join")
        joined_in = time.monotonic() - asked_at
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    (event,) = [e for e in summary["events"] if e["joined"]]
    join_round = event["round"] + 1
    print(f"\nnode started at round ~8 joined {joined_in:.2f} s later, a member from round {join_round}")
    assert event["joined"] == [late] and summary["members"] == [0, 1, 2, 3, 4]
    assert summary["addresses"][late] == f"127.0.0.1:{lab.node_ports[late]}"  # the next rank: nobody's moved
    assert node_rounds(lab.out)[late] == set(range(join_round, run["rounds"]))
    assert [e["model"] for e in lab.log(f"node-{late}") if e["event"] == "rejoined"] == ["peer"]
    assert summary["final"]["nodes"] == [0, 1, 2, 3, 4]
    # the others sent it fragments from its join round on (it was sampled like any member)
    rows = [r.split(",") for r in (lab.out / "nodes.csv").read_text().splitlines()[1:]]
    header = (lab.out / "nodes.csv").read_text().splitlines()[0].split(",")
    got = [int(r[header.index("fragments_in")]) for r in rows if int(r[1]) == late]
    assert sum(got) > 0


def test_frozen_node_resumed_within_the_round_costs_nothing(tmp_path: Path, kit: Any) -> None:
    """SIGSTOP a node for 3 s: its peers' sends wait for it within the round's budget (retrying), nobody
    straggles, and since no message was lost the models are the reference's."""
    run = {**RUN, "round_deadline": 12, "request_timeout": 1.5, "retries": 8}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        lab.at_round(8)
        lab.freeze("node-3", 3.0)
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    assert summary["status"] == "finished" and summary["events"] == []
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))


def test_dropped_node_rejoins_with_rejoin_dropped(tmp_path: Path, kit: Any) -> None:
    """A node stalled until the barrier drops it (as a host cut off would be) comes back on its own with
    --rejoin-dropped: it registers again and is a member from the next round boundary on."""
    # 11 s of rounds at least after the drop: the node resumed is back well before the end
    run = {**RUN, "round_deadline": 3, "request_timeout": 1, "retries": 30, "rejoin_dropped": True,
           "node_profile": kit.pace(tmp_path, 0.04)}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        members = lab.at_round(10)["members"]
        victim = next(m["rank"] for m in members if m["address"] == f"127.0.0.1:{lab.node_ports[1]}")
        lab.procs["node-1"].send_signal(signal.SIGSTOP)
        lab.kit.wait_until(lambda: (s := lab.status()) and victim in s["dropped"], 60, "the drop")
        lab.procs["node-1"].send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        lab.kit.wait_until(lambda: (s := lab.status()) and victim in s["live"], 60, "the node to be back")
        back_in = time.monotonic() - resumed_at
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    print(f"\nnode {victim} dropped while stopped, resumed: a member again {back_in:.2f} s later")
    stragglers = [e for e in summary["events"] if e["stragglers"]]
    assert stragglers and all(e["stragglers"] == [victim] for e in stragglers)  # only the stalled node
    (joined,) = [e for e in summary["events"] if e["joined"]]
    assert joined["joined"] == [victim] and summary["members"] == list(range(5)) and summary["dropped"] == []
    assert set(range(joined["round"] + 1, run["rounds"])) <= node_rounds(lab.out)[victim]
    assert [e["event"] for e in lab.log("node-1") if e["event"] in ("dropped", "rejoined")] == ["dropped", "rejoined"]


def test_barrier_whose_nodes_all_died_ends_the_run(tmp_path: Path, kit: Any) -> None:
    """Every wait ends: with every node dead, each round ends at its deadline (from its release), every node
    is dropped after --drop-after rounds, and the barrier writes a failed summary.json and exits 1."""
    run = {**RUN, "nodes": 3, "fanout": 1, "round_deadline": 2, "request_timeout": 1}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        lab.at_round(5)
        for i in range(run["nodes"]):
            lab.procs[f"node-{i}"].kill()
        killed_at = time.monotonic()
        assert lab.procs["barrier"].wait(timeout=60) == 1
        ended_in = time.monotonic() - killed_at
    finally:
        lab.stop()
    summary = json.loads((lab.out / "summary.json").read_text())
    print(f"\nevery node SIGKILLed: the barrier ended the run {ended_in:.2f} s later")
    # every member dropped at once, or (a node whose last arrival came a round later) the others first, which
    # leaves fewer members than the fanout needs: either way the run ends failed, saying who was dropped
    error = summary["status"] == "failed" and summary["error"]
    assert error and ("every member was dropped" in error or "fewer than the 2 the run needs" in error), summary
    assert len(summary["dropped"]) >= 2 and sorted(summary["dropped"] + summary["members"]) == [0, 1, 2]


def test_a_checkpoint_is_found_whichever_point_a_crash_stopped_its_save_at(tmp_path: Path) -> None:
    """save() rewrites the slot written longest ago in place; a save cut short (a SIGKILL, a full disk) leaves that
    slot torn and the two newest checkpoints whole, and the next save goes into the torn slot, not over them."""
    from mosaicd.daemon.node import checkpoint

    def saved(round: int) -> checkpoint.Checkpoint:
        return checkpoint.Checkpoint("run", 2, "127.0.0.1:9", round, np.full(4096, float(round), np.float32))

    for round in (3, 4, 5):
        checkpoint.save(tmp_path, saved(round))
    assert checkpoint.load(tmp_path).round == 5 and checkpoint.rounds(tmp_path) == [5, 4, 3]
    oldest = tmp_path / checkpoint.SLOTS[0]  # round 3's, the one save(6) rewrites
    inode = oldest.stat().st_ino
    whole = oldest.read_bytes()
    checkpoint.save(tmp_path, saved(6))
    assert oldest.stat().st_ino == inode and checkpoint.rounds(tmp_path) == [6, 5, 4]  # rewritten in place
    cut = oldest.read_bytes()[: len(whole) // 2] + whole[len(whole) // 2:]  # save(6) killed halfway through
    oldest.write_bytes(cut)
    found = checkpoint.load(tmp_path)
    assert found is not None and found.round == 5 and found.vector.tolist() == [5.0] * 4096
    assert checkpoint.rounds(tmp_path) == [5, 4] and checkpoint.load(tmp_path, round=4).round == 4
    assert checkpoint.load(tmp_path, round=3) is None and checkpoint.load(tmp_path, round=6) is None
    checkpoint.save(tmp_path, saved(6))  # into the torn slot: 5 and 4 stay
    assert checkpoint.rounds(tmp_path) == [6, 5, 4]
    checkpoint.save(tmp_path, saved(6))  # a round saved again (a resumed node): the newest of the two is read
    assert checkpoint.rounds(tmp_path) == [6, 6, 5] and checkpoint.load(tmp_path).round == 6
    for name in checkpoint.SLOTS:
        (tmp_path / name).write_bytes(b"torn")
    assert checkpoint.load(tmp_path) is None


def test_a_checkpoint_an_earlier_version_wrote_is_resumed_from(tmp_path: Path) -> None:
    """Versions before the slots wrote checkpoint.npz (and checkpoint-previous.npz): a node upgraded in the middle
    of a run goes on from them, and what it writes from then on is newer."""
    import json

    from mosaicd.daemon.node import checkpoint

    def earlier(name: str, round: int) -> None:
        meta = {"run_id": "run", "rank": 2, "address": "127.0.0.1:9", "round": round}
        np.savez(tmp_path / name, vector=np.full(8, float(round), "<f4"), meta=np.array(json.dumps(meta)))

    earlier("checkpoint.npz", 7)
    earlier("checkpoint-previous.npz", 6)
    assert checkpoint.rounds(tmp_path) == [7, 6] and checkpoint.load(tmp_path).vector.tolist() == [7.0] * 8
    checkpoint.save(tmp_path, checkpoint.Checkpoint("run", 2, "127.0.0.1:9", 8, np.full(8, 8.0, np.float32)))
    assert checkpoint.rounds(tmp_path) == [8, 7, 6] and checkpoint.load(tmp_path, round=6).round == 6


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_an_unreadable_checkpoint_is_not_used_and_said_so(tmp_path: Path, damage: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint file damaged after it was written (a copy cut short, a flipped bit: the zip's CRC catches it)
    is passed over for the previous one, with a warning: it does not stop the node from starting."""
    from mosaicd.daemon.node import checkpoint

    for round in (3, 4):
        checkpoint.save(tmp_path, checkpoint.Checkpoint("run", 2, "127.0.0.1:9", round, np.full(64, round, np.float32)))
    newest = tmp_path / checkpoint.SLOTS[1]
    raw = newest.read_bytes()
    middle = len(raw) // 2
    damaged = {"truncated": raw[:middle], "empty": b"",
               "flipped": raw[:middle] + bytes([raw[middle] ^ 1]) + raw[middle + 1:]}
    newest.write_bytes(damaged[damage])
    found = checkpoint.load(tmp_path)
    assert found is not None and found.round == 3 and found.vector.tolist() == [3.0] * 64
    assert checkpoint.rounds(tmp_path) == [3]
    assert "checkpoint_unreadable" in capsys.readouterr().out


def test_a_barrier_told_to_stop_while_a_node_waits_decides_nothing_more_and_exits_at_once(tmp_path: Path,
                                                                                           kit: Any) -> None:
    """Ctrl-C while rank 0 waits for a round that rank 1 has not reached: the barrier answers the wait 503
    barrier_stopping (the node retries against the barrier started again) and exits, without waiting the round's
    deadline out and without dropping rank 1 at it: its journal stays where its console says the run stopped."""
    run = {"nodes": 2, "fanout": 1, "rounds": 5, "round_deadline": 30, "request_timeout": 5}
    lab = Lab(tmp_path, kit, run)
    url = f"http://127.0.0.1:{lab.barrier_port}"
    try:
        lab.barrier()
        kit.wait_until(lambda: lab.status() is not None, 30, "the barrier listening")
        with ThreadPoolExecutor(3) as pool:
            registered = [pool.submit(kit.http, "POST", f"{url}/v1/register",
                                      json.dumps({"address": f"127.0.0.1:{port}"}).encode(), "application/json", 30)
                          for port in lab.node_ports]
            ranks = sorted(json.loads(r.result(30).body)["rank"] for r in registered)
            assert ranks == [0, 1]
            waiting = pool.submit(kit.http, "POST", f"{url}/v1/arrive", json.dumps({"rank": 0, "round": 0}).encode(),
                                  "application/json", 60)
            time.sleep(0.5)  # rank 0's arrival is in, and waits for rank 1's
            assert not waiting.done()
            journal = (lab.out / "barrier-state.json").read_text()
            lab.procs["barrier"].send_signal(signal.SIGINT)
            told_at = time.monotonic()
            answer = waiting.result(10)
            assert lab.procs["barrier"].wait(timeout=10) == 130
            took = time.monotonic() - told_at
    finally:
        lab.stop()
    assert (answer.status, json.loads(answer.body)["reason"]) == (503, "barrier_stopping"), answer
    assert (lab.out / "barrier-state.json").read_text() == journal  # nothing decided after Ctrl-C
    said = (tmp_path / "barrier.log").read_text()
    assert "interrupted with 0 of 5 rounds done; the same command" in said, said[-2000:]
    print(f"\nthe barrier exited {took:.2f} s after Ctrl-C (its round deadline: {run['round_deadline']} s)")


def test_a_barrier_stopped_while_it_lingers_after_the_end_exits_as_the_run_ended(tmp_path: Path, kit: Any) -> None:
    """`docker compose down` after a run: SIGTERM while the barrier and the nodes linger (--linger) is no
    interruption: each exits 0 at once (a node used to sleep its linger out), the summary as it was (finished)."""
    lab = Lab(tmp_path, kit, {**RUN, "rounds": 5})
    try:
        lab.barrier("--linger", "60")
        for i in range(RUN["nodes"]):
            lab.node(i, "--linger", "60")
        summary = lab.summary()
        assert summary["status"] == "finished", summary
        for name in ("node-0", "barrier"):
            lab.procs[name].send_signal(signal.SIGTERM)
            assert lab.procs[name].wait(timeout=10) == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
        assert json.loads((lab.out / "summary.json").read_text()) == summary
    finally:
        lab.stop()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_by_hand_run_restarted_after_a_full_disk_ends_with_the_reference_models(tmp_path: Path, kit: Any) -> None:
    """The barrier's --out fills: the barrier and every node exit 1. Space grown, the barrier (same --out) and its
    nodes (same addresses, same state) started again go on exactly, as a peer list's comeback does: every member
    from its checkpoint of the newest round all hold. Every node row and every evaluation row is there once, and the
    models are the uninterrupted run's."""
    run = {**RUN, "nodes": 6, "rounds": 200, "round_deadline": 20, "request_timeout": 5, "retries": 1,
           "eval_every": 5}
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)], check=True)
    lab = Lab(tmp_path, kit, run)
    lab.out = disk / "run"
    try:
        lab.start()
        codes = {name: proc.wait(timeout=120) for name, proc in lab.procs.items()}
        assert set(codes.values()) == {1}, codes
        said = (tmp_path / "barrier.log").read_text()
        assert "No space left" in said, said[-2000:]
        stopped_at = json.loads((lab.out / "barrier-state.json").read_text())["state"]["round"]
        assert stopped_at < run["rounds"] - 20, "the disk did not fill mid-run"
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)  # room again
        lab.start()
        summary = lab.summary()
        lab.exited_cleanly()
        nodes, rows = node_rounds(lab.out), read_rounds(lab.out)
    finally:
        lab.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False)
    restarted = lab.log("barrier")
    said = [(e["event"], e.get("round")) for e in restarted if e["event"] in ("members_restarted", "resumed")]
    print(f"\nfull disk at round {stopped_at}: {said}")
    assert ("members_restarted", stopped_at) in said
    assert summary["status"] == "finished", summary
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    assert all(rounds == set(range(run["rounds"])) for rounds in nodes.values())
    assert [r["round"] for r in rows] == list(range(4, run["rounds"], 5))


def test_a_barrier_frozen_past_the_deadline_reads_the_arrivals_before_it_releases(tmp_path: Path, kit: Any) -> None:
    """SIGSTOP the barrier for 20 s with a 5 s round deadline: woken, it reads the arrivals sent meanwhile before it
    acts on the deadline it slept through (`LateClock`), so nobody straggles and the models are the reference's."""
    run = {**RUN, "nodes": 6, "rounds": 40, "round_deadline": 5, "request_timeout": 5, "retries": 2,
           "barrier_grace": 60}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        lab.at_round(8)
        lab.freeze("barrier", 20.0)
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    assert summary["status"] == "finished" and summary["events"] == [], summary["events"]
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))


ROW_KEYS = ("metric", "node_average", "average_model", "consensus_distance", "node_spread", "per_node")


@pytest.mark.parametrize("how", ["barrier_killed", "run_interrupted"])
@pytest.mark.parametrize("after", [1, 2, 3])
def test_every_evaluation_round_has_its_row_once_whatever_stops_it(tmp_path: Path, kit: Any, how: str,
                                                                   after: int) -> None:
    """The barrier SIGKILLed (and started again), or the whole run stopped (SIGTERM to every process, as `docker
    compose down`) and started again, `after` rounds past an evaluation round (its models released, being
    collected, being evaluated...): every evaluation round has its row in rounds.csv exactly once, simulate's row, or
    (its models gone) a row saying why, named by the barrier's `resumed` warning; the models are the reference's."""
    # 0.02 s a round's training at least (kit.pace): the stop comes `after` rounds past round 24, not at the end
    run = {**RUN, "rounds": 60, "round_deadline": 20, "request_timeout": 5, "retries": 1, "barrier_grace": 60,
           "eval_every": 5, "node_profile": kit.pace(tmp_path, 0.02)}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        status = lab.at_round(24 + after)  # evaluation round 24: released at 24, collected with 25's release
        if how == "barrier_killed":
            lab.procs["barrier"].kill()
            lab.procs["barrier"].wait(timeout=10)
            time.sleep(1.0)
            lab.barrier()
        else:
            for proc in lab.procs.values():
                proc.send_signal(signal.SIGTERM)
            codes = {name: proc.wait(timeout=30) for name, proc in lab.procs.items()}
            assert codes["barrier"] == 130, codes
            lab.start()
        lab.at_round(status["round"] + 2, timeout=120)  # the restarted barrier's run (its summary says running)
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    subprocess.run([*kit.by_hand, "simulate", *kit.role_flags("simulate", run), "--out", str(tmp_path / "sim"),
                    "--quiet"], check=True, capture_output=True, timeout=120)
    expected = {r["round"]: r for r in read_rounds(tmp_path / "sim")}
    rows = read_rounds(lab.out)
    lost = sorted(e for w in lab.log("barrier") if w["event"] == "resumed" for e in w.get("evaluations_lost", []))
    print(f"\n{how} at round {status['round']}: rows lost {lost}")
    assert [r["round"] for r in rows] == sorted(expected) == list(range(4, run["rounds"], 5))
    for row in rows:
        if row["round"] in lost:
            assert row["lost"] and row["average_model"] is None, row
        else:
            assert not row.get("lost") and {k: row[k] for k in ROW_KEYS} == \
                {k: expected[row["round"]][k] for k in ROW_KEYS}, (row, expected[row["round"]])
    warned = [w for w in lab.log("barrier") if w["event"] == "resumed" and w.get("evaluations_lost")]
    assert all(w["level"] == "warning" for w in warned)
    assert summary["status"] == "finished" and summary["model_sha256"] == kit.reference_hashes(Settings(**run))


def test_an_evaluation_whose_models_are_gone_gets_a_row_saying_why_and_a_warning(tmp_path: Path, kit: Any) -> None:
    """The rows from round 9 on never written (evaluations lagging behind, each waits for the one before) and the
    barrier SIGKILLed long after, so no node keeps round 9's or 14's models: the resumed barrier writes their rows
    with the reason (`lost`), in round order, names them in its `resumed` warning (logs/barrier.log too), collects
    again those the nodes still keep, and every row is there once."""
    run = {**RUN, "rounds": 60, "round_deadline": 20, "request_timeout": 5, "retries": 1, "barrier_grace": 60,
           "eval_every": 5}
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        lab.at_round(20)
        lab.procs["barrier"].kill()
        lab.procs["barrier"].wait(timeout=10)
        lines = (lab.out / "rounds.csv").read_text().splitlines(keepends=True)
        (lab.out / "rounds.csv").write_text("".join(lines[:1] + [r for r in lines[1:] if int(r.split(",")[0]) < 9]))
        lab.barrier()
        summary = lab.summary()
        lab.exited_cleanly()
    finally:
        lab.stop()
    rows = read_rounds(lab.out)
    assert [r["round"] for r in rows] == list(range(4, run["rounds"], 5))
    lost = [r for r in rows if r.get("lost")]
    said = [e for e in lab.log("barrier") if e["event"] == "resumed"]
    assert said and said[-1]["level"] == "warning" and said[-1]["evaluations_lost"] == [r["round"] for r in lost]
    assert {9, 14} <= {r["round"] for r in lost} and all(r["average_model"] is None and "gone" in r["lost"]
                                                         for r in lost)
    assert all(r["average_model"] is not None for r in rows if not r.get("lost"))
    assert "evaluations_lost" in (lab.out / "logs" / "barrier.log").read_text()
    assert summary["status"] == "finished" and summary["model_sha256"] == kit.reference_hashes(Settings(**run))


def test_a_node_s_slots_are_read_once_and_again_after_a_save_that_failed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`checkpoint.Slots` (a node's writer, saving every round) reads the slots' metas at its first save only, then
    goes on from what it wrote: the same slots and rounds as `save`, which reads them each time. A save that fails
    (a full disk) leaves the files to be read again at the next one, which goes into the slot it cut short."""
    from mosaicd.daemon.node import checkpoint

    reads: list[str] = []
    real = checkpoint._written
    monkeypatch.setattr(checkpoint, "_written", lambda path: reads.append(path.name) or real(path))

    def saved(round: int) -> checkpoint.Checkpoint:
        return checkpoint.Checkpoint("run", 2, "127.0.0.1:9", round, np.full(256, float(round), np.float32))

    slots = checkpoint.Slots(tmp_path / "state")
    for round in (3, 4, 5, 6):
        slots.save(saved(round))
    assert reads == list(checkpoint.SLOTS)  # at the first save only
    assert checkpoint.rounds(tmp_path / "state") == [6, 5, 4] and checkpoint.load(tmp_path / "state").round == 6
    oldest = tmp_path / "state" / checkpoint.SLOTS[1]  # round 4's: the next save rewrites it

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as failing:
        failing.setattr(checkpoint.os, "fsync", full_disk)
        with pytest.raises(OSError):
            slots.save(saved(7))
    oldest.write_bytes(oldest.read_bytes()[:100])  # what the failed write left: a torn slot
    reads.clear()
    slots.save(saved(7))
    assert reads == list(checkpoint.SLOTS)  # read again after the failure
    assert checkpoint.rounds(tmp_path / "state") == [7, 6, 5]
    assert checkpoint.load(tmp_path / "state").vector.tolist() == [7.0] * 256


@pytest.mark.parametrize("state", ["note", "none"])
def test_node_killed_in_round_0_and_restarted_at_the_default_deadline_costs_its_round_seconds(
        tmp_path: Path, kit: Any, state: str) -> None:
    """Issue #61 item 5: a node SIGKILLed during round 0 and started again at the same address, at the default
    --round-deadline (120 s): the barrier takes its registration as the member's restart (a new incarnation: it sits
    round 0 out and is a member from round 1), the node refuses its peers' round-0 fragments with `rejoining`, and
    they give them up at once, so round 0 costs seconds, not the deadline. `note`: its state directory holds the note
    its registration left (member.json); `none`: it comes back with no state at all (its state directory gone, as a
    container's without a volume, or a `--port 0` node's, which has none)."""
    profile = kit.pace(tmp_path, 2.0)
    run = {**RUN, "rounds": 8, "eval_every": 0, "node_profile": profile, "checkpoint_every": 0}
    assert "round_deadline" not in run and "request_timeout" not in run and "retries" not in run  # the defaults
    lab = Lab(tmp_path, kit, run)
    try:
        lab.start()
        members = kit.wait_until(lambda: (s := lab.status()) and s["phase"] == "running" and s["members"], 60,
                                 "the roster", interval=0.01)
        victim = next(m["rank"] for m in members if m["address"] == f"127.0.0.1:{lab.node_ports[2]}")
        kit.wait_until(lambda: list((tmp_path / "node-2").glob("state/*/member.json")), 30, "node-2 to register",
                       interval=0.01)
        lab.procs["node-2"].send_signal(signal.SIGSTOP)  # frozen in round 0 while the others train, then send to it
        time.sleep(3.0)
        lab.procs["node-2"].kill()
        assert lab.procs["node-2"].wait(timeout=10) == -signal.SIGKILL
        assert (lab.status() or {}).get("round") == 0, "round 0 ended before the kill"
        if state == "none":
            shutil.rmtree(tmp_path / "node-2" / "state")
        lab.node(2)
        lab.kit.wait_until(lambda: (s := lab.status()) and victim in s["live"] and s["round"] >= 1, 150,
                           "the node to be a member again")
        summary = lab.summary(timeout=240)
        lab.exited_cleanly()
    finally:
        lab.stop()
    said = lab.log("barrier")
    (closed,) = [e["timestamp"] for e in said if e["event"] == "registration_closed"]
    released = {e["round"]: e for e in said if e["event"] == "released"}
    durations = [(datetime.fromisoformat(released[0]["timestamp"]) - datetime.fromisoformat(closed)).total_seconds(),
                 released[1]["duration_s"]]
    print(f"\nnode {victim} SIGKILLed in round 0, started again at once with state {state!r} (round deadline 120 s): "
          f"round 0 took {durations[0]:.2f} s, round 1 {durations[1]:.2f} s")
    assert max(durations) < 15, released
    joined = [e["round"] for e in summary["events"] if victim in e["joined"]]
    # it sat round 0 out, once: asking again after round 0's release, it was answered its place in round 1
    assert joined == [0], summary["events"]
    assert summary["status"] == "finished" and summary["members"] == list(range(5)) and summary["dropped"] == []
    assert set(range(joined[-1] + 1, run["rounds"])) <= node_rounds(lab.out)[victim]
    told = [e for i in range(5) if i != 2 for e in lab.log(f"node-{i}") if e["event"] == "receiver_rejoining"]
    assert all(e["level"] == "info" and e["peer"] == victim for e in told), told
    (back,) = [e for e in lab.log("node-2") if e["event"] == "rejoined"]
    assert back["model"] == "peer" and back["round"] == joined[-1] + 1, back

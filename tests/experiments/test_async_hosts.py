"""Asynchronous runs on every host set-up (issue 60, items 4 and 5): a peer list's members run `--sync async`
for real, with no barrier process; faults cost the other nodes nothing."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaicd.daemon.http.auth import write_new_secret
from mosaicd.experiments.cluster import free_ports, settings_env
from mosaicd.experiments.cluster_async import AsyncCluster, run_cluster_async
from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings, SettingsError

ASYNC = {"sync": "async", "task": "quadratic", "fragments": 4, "fanout": 2}


def start_peer_list(kit: Any, tmp_path: Path, run: dict[str, Any], ports: list[int], shared: bool = False,
                    logs: str = "node") -> dict[int, subprocess.Popen]:
    """Every member of the peer list in tmp_path/peers.txt: by hand with flags, each its own --out; or (`shared`)
    as a sweep's Slurm task starts a cluster run's members (`sweep_slurm.cluster_task`): `mosaicd node` given the
    run's settings as MOSAIC_* variables and one --out for all."""
    procs = {}
    for port in ports:
        with open(tmp_path / f"{logs}-{port}.log", "wb") as log:
            if shared:
                env = settings_env(Settings.load(**run), out=str(tmp_path / "out"), peer_list=str(tmp_path /
                                   "peers.txt"), port=port, advertise=f"127.0.0.1:{port}", host="127.0.0.1",
                                   log_json=True)
                procs[port] = subprocess.Popen([*kit.mosaicd, "node"], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                continue
            procs[port] = subprocess.Popen(
                [*kit.mosaicd, "node", "--peer-list", str(tmp_path / "peers.txt"), "--port", str(port), "--host",
                 "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), "--log-json", *kit.flags(run)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return procs


def wait_all(tmp_path: Path, procs: dict[int, subprocess.Popen], within: float, logs: str = "node") -> None:
    try:
        for port, proc in procs.items():
            code = proc.wait(timeout=within)
            assert code == 0, (tmp_path / f"{logs}-{port}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.slow  # about 10 s on 2 idle cores
@pytest.mark.parametrize("shared", [False, True])
def test_a_peer_list_runs_asynchronously_and_rank_0_writes_the_summary(tmp_path: Path, kit: Any,
                                                                        shared: bool) -> None:
    profile = kit.pace(tmp_path, 0.05)
    ports = sorted(free_ports(4))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    run = {**ASYNC, "nodes": 4, "rounds": 15, "eval_every": 5, "node_profile": profile,
           "secret_file": write_new_secret(tmp_path / "run.secret")}
    wait_all(tmp_path, start_peer_list(kit, tmp_path, run, ports, shared), 120)
    rank0 = tmp_path / ("out" if shared else f"out-{ports[0]}")
    summary = json.loads((rank0 / "summary.json").read_text())
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and summary["dropped"] == [] and summary["mode"] == "node"
    assert summary["addresses"] == [f"127.0.0.1:{p}" for p in ports]
    assert block["steps"] == {str(i): 15 for i in range(4)} and block["signed"] is True
    assert block["messages_sent"] >= 4 * 15 and block["replays_refused"] == 0
    assert summary["final"]["consensus_distance"] < 1.0
    for rank, port in enumerate(ports):  # each member's report in its own --out, and in rank 0's
        mine = tmp_path / ("out" if shared else f"out-{port}") / "nodes" / str(rank)
        assert json.loads((mine / "async.json").read_text())["steps"] == 15
        fetched = rank0 / "nodes" / str(rank)
        assert np.array_equal(np.load(fetched / "model.npy"), np.load(mine / "model.npy"))
        assert shared or rank == 0 or not (tmp_path / f"out-{port}" / "summary.json").exists()


@pytest.mark.slow  # about 10 s on 2 idle cores
def test_a_peer_list_member_killed_and_started_again_goes_on_from_its_checkpoint(tmp_path: Path, kit: Any) -> None:
    """The same `mosaicd node` command again: the member resumes from its checkpoint, rank 0 waits for its report."""
    profile = kit.pace(tmp_path, 0.05)
    ports = sorted(free_ports(4))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    run = {**ASYNC, "rounds": 40, "eval_every": 10, "node_profile": profile,
           "secret_file": write_new_secret(tmp_path / "run.secret")}
    procs = start_peer_list(kit, tmp_path, run, ports)
    try:
        _when(lambda: _steps_of(f"127.0.0.1:{ports[3]}") >= 8, 60, "rank 3's 8th iteration")
        procs[ports[3]].kill()
        procs[ports[3]].wait(10)
        procs |= start_peer_list(kit, tmp_path, run, ports[3:], logs="again")
    finally:
        wait_all(tmp_path, {p: procs[p] for p in ports[:3]}, 120)
        wait_all(tmp_path, {ports[3]: procs[ports[3]]}, 60, logs="again")
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and summary["dropped"] == [] and block["resume_exact"] is False
    assert block["steps"] == {str(i): 40 for i in range(4)} and set(block["resumed"]) == {"3"}, block
    assert 1 <= block["resumed"]["3"] < 40


@pytest.mark.slow  # about 25 s on 2 idle cores
def test_rank_0_of_an_asynchronous_peer_list_told_to_stop_records_the_run_interrupted(tmp_path: Path,
                                                                                      kit: Any) -> None:
    """SIGTERM to rank 0 mid-run (as `scancel` sends): its summary.json says interrupted, naming how far it got, not
    failed with an exception's name; it exits 130. It tells the other members, which stop training at once, say so
    and exit 130 too (not 1 after --register-deadline); the same commands started again resume the run from their
    checkpoints."""
    profile = kit.pace(tmp_path, 0.05)
    ports = sorted(free_ports(3))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    run = {**ASYNC, "nodes": 3, "rounds": 150, "eval_every": 5, "node_profile": profile,
           "register_deadline": 120, "secret_file": write_new_secret(tmp_path / "run.secret")}
    procs = start_peer_list(kit, tmp_path, run, ports)
    try:
        _when(lambda: _steps_of(f"127.0.0.1:{ports[0]}") >= 5, 60, "rank 0's fifth iteration")
        procs[ports[0]].send_signal(signal.SIGTERM)
        assert procs[ports[0]].wait(timeout=30) == 130
        for port in ports[1:]:  # within far less than --register-deadline
            assert procs[port].wait(timeout=60) == 130, (tmp_path / f"node-{port}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert re.match(rf"interrupted \(rank 0 at 127.0.0.1:{ports[0]}, which collects the run, was told to stop with "
                    r"\d+ of 150 iterations", summary["error"]), summary["error"]
    stopped_at = {}
    for rank, port in enumerate(ports[1:], 1):
        log = (tmp_path / f"node-{port}.log").read_text()
        line = re.search(rf"mosaicd node: interrupted \(rank 0 .*\); this member \(rank {rank}\) stopped with "
                         r"(\d+) of 150 iterations done; start the same commands again, on every member, to resume "
                         r"it: each goes on from its newest checkpoint .*not bit-exact\)", log)
        assert line is not None and "Traceback" not in log, log[-3000:]
        stopped_at[rank] = int(line.group(1))
        assert stopped_at[rank] < 150 and not (tmp_path / f"out-{port}" / "nodes" / str(rank) / "async.json").exists()
    wait_all(tmp_path, start_peer_list(kit, tmp_path, run, ports, logs="again"), 120, logs="again")
    block = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())["asynchronous"]
    assert block["steps"] == {str(i): 150 for i in range(3)} and block["resume_exact"] is False, block
    assert set(block["resumed"]) == {"0", "1", "2"} and all(1 <= block["resumed"][str(r)] <= stopped_at[r]
                                                           for r in (1, 2)), (block, stopped_at)


async def test_a_member_told_by_its_collector_that_the_run_is_interrupted_stops_its_run(tmp_path: Path,
                                                                                       kit: Any) -> None:
    """POST /v1/async/end {"interrupted": reason}: the member's run is cancelled (it then says so and exits 130);
    a body that is not such a reason is refused (400) and changes nothing."""
    import aiohttp

    from mosaicd.daemon.http.auth import Secret
    from mosaicd.daemon.node.async_member import AsyncNode
    from mosaicd.daemon.node.async_routes import async_app
    from mosaicd.learning.tasks import build_task

    settings = Settings.load(**ASYNC, nodes=3, rounds=3, dim=4, insecure=True, out=tmp_path / "out")
    node = AsyncNode(settings, build_task(settings.run_config()), 1, [f"127.0.0.1:{p}" for p in (9, 10, 11)],
                     Secret(None))
    runner, base = await kit.serve_on_loopback(async_app(node))
    running = asyncio.ensure_future(asyncio.sleep(60))
    node.stop.cancels(running)
    reason = "interrupted (rank 0 at 127.0.0.1:9, which collects the run, was told to stop with 2 of 3 iterations done)"
    try:
        async with aiohttp.ClientSession() as session:
            for body in ([], {"interrupted": 3}, {"interrupted": "failed: x"}, {"interrupted": None},
                         {"interrupted": reason, "x": 1}):
                async with session.post(f"{base}/v1/async/end", json=body) as answer:
                    assert answer.status == 400 and (await answer.json())["reason"] == "malformed", body
            async with session.post(f"{base}/v1/async/end", json={"interrupted": "interrupted " + "x" * 8192}) \
                    as answer:  # longer than any reason: refused as it passes END_BODY_BYTES, not read whole
                assert answer.status == 413 and (await answer.json())["reason"] == "too_large"
            assert node.stop.reason is None and not running.done()
            async with session.post(f"{base}/v1/async/end", json={"interrupted": reason}) as answer:
                assert answer.status == 200 and await answer.json() == {"interrupted": True}
            with pytest.raises(asyncio.CancelledError):
                await running
            assert node.stop.reason == reason and not node.ended.is_set()
    finally:
        await runner.cleanup()


@pytest.mark.slow  # about 8 s on 2 idle cores
def test_an_asynchronous_peer_list_runs_over_mutual_tls(tmp_path: Path, kit: Any) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    member = ca.issue_cert("127.0.0.1", "localhost")
    member.private_key_pem.write_to_path(str(tmp_path / "member.key"))
    for i, blob in enumerate(member.cert_chain_pems):
        blob.write_to_path(str(tmp_path / "member.crt"), append=i > 0)
    ports = sorted(free_ports(3))
    (tmp_path / "peers.txt").write_text("".join(f"https://127.0.0.1:{p}\n" for p in ports))
    profile = kit.pace(tmp_path, 0.1)
    run = {**ASYNC, "rounds": 30, "fanout": 1, "eval_every": 10, "secret_file": write_new_secret(tmp_path / "s"),
           "node_profile": profile, "tls_cert": tmp_path / "member.crt", "tls_key": tmp_path /
           "member.key", "tls_ca": tmp_path / "ca.crt", "tls_client_auth": True}
    procs = start_peer_list(kit, tmp_path, run, ports)
    member_tls = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    member_tls.load_cert_chain(str(tmp_path / "member.crt"), str(tmp_path / "member.key"))

    def answers(url: str, context: ssl.SSLContext | None = None) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as answer:
                return answer.status == 200
        except OSError:
            return False
    try:
        _when(lambda: answers(f"https://127.0.0.1:{ports[1]}/healthz", member_tls), 60, "rank 1 over TLS")
        assert not answers(f"http://127.0.0.1:{ports[1]}/healthz")  # no plain HTTP
    finally:
        wait_all(tmp_path, procs, 120)
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and block["steps"] == {str(i): 30 for i in range(3)}
    assert block["signed"] is True and block["messages_sent"] >= 3 * 30 and block["messages_unsent"] == 0


def test_a_node_of_a_barrier_is_refused_async_naming_the_flag(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from mosaicd.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["node", "--sync", "async", "--port", "0", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--sync async" in err and "node --peer-list" in err, err
    assert not (tmp_path / "run").exists()


def _steps_of(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/v1/status", timeout=1) as answer:
            return int(json.loads(answer.read())["steps"])
    except OSError:
        return 0


def _when(predicate: Any, within: float, what: str) -> None:
    until = time.monotonic() + within
    while not predicate():
        if time.monotonic() > until:
            pytest.fail(f"timed out after {within:g} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def faults(tmp_path: Path, kit: Any) -> tuple[dict[str, Any], float]:
    """The settings of the fault tests (4 nodes of 40 iterations of 0.1 s, long enough that a restarted process's
    start, which takes the others' CPU on a small host, weighs little; a send not answered in 2 s is dropped), and
    the mean step rate of nodes 0-2 in such a cluster where nothing happens to node 3 (measured just before the
    test's own run: a loaded host's pace drifts)."""
    profile = kit.pace(tmp_path, 0.1)
    run = {**ASYNC, "nodes": 4, "rounds": 40, "eval_every": 10, "node_profile": profile,
           "request_timeout": 2}
    alike = run_cluster_async(Settings.load(**run, out=tmp_path / "alike"), progress=False,
                              timeout=120)["asynchronous"]
    return run, sum(alike["steps_per_s"][str(i)] for i in range(3)) / 3


def _with_a_fault(out: Path, run: dict[str, Any], fault: Any) -> dict[str, Any]:
    """A cluster of `run` in `out`; once node 3 has done 8 iterations, `fault(cluster, node 3's process)`; the
    run's summary."""
    cluster = AsyncCluster(Settings.load(**run, out=out), progress=False)
    done: dict = {}
    running = threading.Thread(target=lambda: done.update(cluster.run(120)))
    running.start()
    try:
        roster = out / "roster.json"
        _when(lambda: roster.exists() and "node-3" in cluster.processes.procs, 60, "node 3's start")
        address = json.loads(roster.read_text())["addresses"][3]
        _when(lambda: _steps_of(address) >= 8, 60, "node 3's 8th iteration")  # a checkpoint every iteration
        fault(cluster, cluster.processes.procs["node-3"])
    finally:
        running.join(150)
    assert done.get("status") == "finished" and done["dropped"] == [], done
    return done


def _others_unslowed(block: dict[str, Any], reference: float) -> None:
    for i in range(3):  # the others trained at their pace meanwhile: no slower than without the fault (by 20%)
        assert block["steps_per_s"][str(i)] > 0.8 * reference, (block, reference)


@pytest.mark.slow  # about 25 s on 2 idle cores, the fixture's run included
def test_a_node_killed_and_restarted_resumes_from_its_checkpoint_and_costs_the_others_nothing(
        tmp_path: Path, faults: tuple[dict[str, Any], float]) -> None:
    run, reference = faults

    def kill_and_restart(cluster: AsyncCluster, process: Any) -> None:
        process.kill()
        process.wait(10)
        cluster.restart(3)

    block = _with_a_fault(tmp_path / "killed", run, kill_and_restart)["asynchronous"]
    assert block["steps"] == {str(i): 40 for i in range(4)}
    assert set(block["resumed"]) == {"3"} and 1 <= block["resumed"]["3"] < 40, block  # from its checkpoint
    assert block["resume_exact"] is False and "not those of an uninterrupted run" in block["resume_note"]
    _others_unslowed(block, reference)
    assert (tmp_path / "killed" / "logs" / "node-3.log").read_text().count("async_resumed") == 1


@pytest.mark.slow  # about 25 s on 2 idle cores, the fixture's run included
def test_a_frozen_node_never_stalls_the_others(tmp_path: Path, faults: tuple[dict[str, Any], float]) -> None:
    """Node 3 stopped (SIGSTOP) for 4 s: sends to it time out (--request-timeout 2) and are dropped, not retried;
    the others train at their pace and finish; node 3 goes on when continued and finishes too."""
    run, reference = faults

    def freeze(cluster: AsyncCluster, process: Any) -> None:
        process.send_signal(signal.SIGSTOP)
        time.sleep(4)
        process.send_signal(signal.SIGCONT)

    block = _with_a_fault(tmp_path / "frozen", run, freeze)["asynchronous"]
    assert block["steps"] == {str(i): 40 for i in range(4)} and "resumed" not in block
    assert block["messages_unsent"] > 0  # what went to node 3 while it was frozen: timed out, dropped
    _others_unslowed(block, reference)


def _stop_at(round: int) -> Any:
    def stop(done: object) -> None:  # Ctrl-C lands in the main thread as this does, between two events
        if getattr(done, "round", None) == round:
            raise KeyboardInterrupt
    return stop


def _csv(out: Path, name: str) -> str:
    return (out / name).read_text()


@pytest.mark.parametrize("flags", [
    # slow links: queues superseding and messages in flight at every checkpoint; int8 with error feedback
    {"task": "quadratic", "compress": "int8", "node_profile": "compute_s = 0.5\n[default]\nlatency = 0.02\n"
     "[[draw]]\nshare = 0.25\nbandwidth = 64\n"},
    pytest.param({"task": "teacher", "optimizer": "adam", "lr": 0.01, "samples_per_node": 16},  # its moments
                 marks=pytest.mark.slow),  # about 6 s: torch's import and the task's build
    {"task": "quadratic", "exchange": "pairwise"},  # AD-PSGD's pairs
])
def test_ctrl_c_then_resume_gives_the_uninterrupted_models_bit_for_bit(tmp_path: Path, flags: dict) -> None:
    flags = dict(flags)
    if "node_profile" in flags:
        (tmp_path / "p.toml").write_text(flags["node_profile"])
        flags["node_profile"] = tmp_path / "p.toml"
    run = {"sync": "async", "nodes": 6, "rounds": 12, "eval_every": 2, "checkpoint_rounds": 4,
           **({} if flags.get("exchange") else {"fragments": 4, "fanout": 2}), **flags}
    whole = run_simulation(Settings.load(**run, out=tmp_path / "whole"), progress=False)
    settings = Settings.load(**run, out=tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):  # checkpointed at round 3 (grid point 2), stopped after round 5
        run_simulation(settings, progress=False, on_round=_stop_at(5), advise=False)
    assert (tmp_path / "stopped" / "simulate-checkpoint.npz").exists()
    seen: list[int] = []
    resumed = run_simulation(settings, progress=False, resume=True, on_round=lambda done: seen.append(done.round))
    assert seen[0] == 5  # it went on from the checkpoint: the grid point after it (round 3) is its first row
    assert resumed["status"] == "finished" and resumed["models_sha256"] == whole["models_sha256"]
    assert resumed["asynchronous"] == whole["asynchronous"] and resumed["virtual_s"] == whole["virtual_s"]
    assert _csv(tmp_path / "stopped", "nodes.csv") == _csv(tmp_path / "whole", "nodes.csv")
    keep = ("round", "virtual_s", "node_average", "consensus_distance")
    with open(tmp_path / "stopped" / "rounds.csv") as a, open(tmp_path / "whole" / "rounds.csv") as b:
        assert [{k: r[k] for k in keep} for r in csv.DictReader(a)] == \
            [{k: r[k] for k in keep} for r in csv.DictReader(b)]


def test_a_resume_stopped_before_its_first_checkpoint_starts_over_and_another_setting_is_refused(
        tmp_path: Path) -> None:
    run = {"sync": "async", "task": "quadratic", "nodes": 5, "rounds": 8, "eval_every": 2, "fragments": 2,
           "fanout": 2, "checkpoint_rounds": 100}
    whole = run_simulation(Settings.load(**run, out=tmp_path / "whole"), progress=False)
    settings = Settings.load(**run, out=tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run_simulation(settings, progress=False, on_round=_stop_at(3), advise=False)
    assert not (tmp_path / "stopped" / "simulate-checkpoint.npz").exists()
    with pytest.raises(SettingsError, match="--seed"):
        run_simulation(Settings.load(**run, seed=9, out=tmp_path / "stopped"), progress=False, resume=True)
    assert run_simulation(settings, progress=False, resume=True)["models_sha256"] == whole["models_sha256"]

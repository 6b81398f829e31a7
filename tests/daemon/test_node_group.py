"""`mosaicd node --nodes-per-process N` (compose's MOSAIC_NODES_PER_CONTAINER): one process pays the node's imports,
then forks N members, each a node of the barrier's with its own port, port file, state folder and address
(`experiments/warm.run_group`). The settings' refusals are quick; the runs start real processes on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.cli import main
from mosaicd.experiments.cluster import free_ports
from mosaicd.settings import SettingsError

RUN = dict(rounds=4, fragments=2, fanout=1, dim=16, seed=3)
BARRIER_URL = "http://127.0.0.1:8000"


@pytest.mark.parametrize(("given", "refusal"), [
    (dict(nodes_per_process=0), "--nodes-per-process (MOSAIC_NODES_PER_PROCESS): Input should be greater than or "
                                "equal to 1"),
    (dict(nodes_per_process="two"), "--nodes-per-process (MOSAIC_NODES_PER_PROCESS): Input should be a valid "
                                    "integer"),
    (dict(nodes_per_process=300), "less than or equal to 256"),
    (dict(nodes_per_process=4, port=65533), "its members listen on --port 65533 to 65536, past 65535"),
    (dict(nodes_per_process=2, advertise="10.0.0.5:9000", port=0), "member I advertises HOST:PORT + I"),
    (dict(nodes_per_process=2, advertise="10.0.0.5", port=9000), "member I advertises HOST:PORT + I"),
    (dict(nodes_per_process=2, barrier_url=None), "--nodes-per-process needs --barrier-url"),
])
def test_a_node_group_is_refused_where_its_members_could_not_be_nodes(given: dict[str, Any], refusal: str) -> None:
    with pytest.raises(SettingsError, match="nodes-per-process") as refused:
        Settings.load(**{"barrier_url": BARRIER_URL, **given})
    assert refusal in str(refused.value), refused.value


def test_the_command_refuses_a_group_of_no_node_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setenv("MOSAIC_NODES_PER_PROCESS", "0")
    try:
        with pytest.raises(SystemExit) as stopped:
            main(["node", "--barrier-url", BARRIER_URL, "--out", str(tmp_path / "run")])
    finally:
        gc.enable()  # `mosaicd node` holds collection off until its imports are done
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and err.startswith("mosaicd node: error: --nodes-per-process") and "\n" not in err
    assert not list(tmp_path.iterdir())


def test_each_member_has_its_own_port_files_folder_and_address() -> None:
    one = Settings.load(barrier_url=BARRIER_URL, port=9000, port_file="p", state_dir="s", advertise="h:9100")
    assert one.member_fields(0) == {}  # one node: the settings as they are
    group = Settings.load(barrier_url=BARRIER_URL, port=9000, port_file="p", state_dir="s", advertise="h:9100",
                          nodes_per_process=3)
    assert [group.member_fields(i) for i in (0, 2)] == [
        {"nodes_per_process": 1, "port": 9000, "port_file": Path("p.0"), "state_dir": Path("s/0"),
         "advertise": "h:9100"},
        {"nodes_per_process": 1, "port": 9002, "port_file": Path("p.2"), "state_dir": Path("s/2"),
         "advertise": "h:9102"}]
    any_port = Settings.load(barrier_url=BARRIER_URL, port=0, nodes_per_process=2)
    assert any_port.member_fields(1) == {"nodes_per_process": 1, "port": 0}  # no port file, no state: none made


def group_command(kit: Any, barrier: int, folder: Path, count: int = 2) -> list[str]:
    return [*kit.by_hand, "node", "--barrier-url", f"http://127.0.0.1:{barrier}", "--host", "127.0.0.1",
            "--port", "0", "--port-file", str(folder / "port"), "--state-dir", str(folder / "state"),
            "--nodes-per-process", str(count), "--out", str(folder)]


def member_pids(pid: int) -> list[int]:
    return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


@pytest.mark.slow
def test_two_groups_of_two_run_as_four_nodes_with_the_reference_models(tmp_path: Path, kit: Any) -> None:
    """The barrier counts nodes, not processes: 2 processes x 2 members make its 4 nodes, each at the address in
    its own port file, and the run ends with the reference's models; every process exits 0."""
    (port,) = free_ports(1)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["barrier"] = subprocess.Popen(
            [*kit.by_hand, "barrier", *kit.flags(RUN), "--nodes", "4", "--host", "127.0.0.1", "--port", str(port),
             "--out", str(tmp_path / "run")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL)
        for group in ("a", "b"):
            procs[group] = subprocess.Popen(group_command(kit, port, tmp_path / group), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        addresses = kit.wait_until(lambda: [m["address"] for m in kit.status(port).get("members", [])]
                                   if kit.status(port).get("registered") == 4 else None, 120, "4 nodes registered")
        codes = {name: proc.wait(timeout=120) for name, proc in procs.items()}
        errors = {name: proc.stderr.read().decode() for name, proc in procs.items() if proc.stderr}
    finally:
        kit.stop_all(procs)
    assert codes == dict.fromkeys(procs, 0), errors
    ports = {f"127.0.0.1:{(tmp_path / g / f'port.{i}').read_text().strip()}" for g in "ab" for i in (0, 1)}
    assert set(addresses) == ports and len(ports) == 4
    assert all((tmp_path / g / "state" / str(i)).is_dir() for g in "ab" for i in (0, 1))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN, nodes=4))


@pytest.mark.slow
def test_a_group_told_to_stop_leaves_started_again_rejoins_and_a_member_killed_is_said(tmp_path: Path,
                                                                                       kit: Any) -> None:
    """SIGTERM to a group: each member leaves as a node does and the process exits 0; the same command again
    brings both members back into the run. A member killed: the group's console says which, the other goes on
    (what the run does without it is the barrier's to decide, as for any node), and the process ends with the
    killed member's status."""
    (port,) = free_ports(1)
    run = {**RUN, "rounds": 100000}
    procs: dict[str, subprocess.Popen] = {}

    def live() -> list[int]:
        return kit.status(port).get("live", [])

    try:
        procs["barrier"] = subprocess.Popen(
            [*kit.by_hand, "barrier", *kit.flags(run), "--nodes", "4", "--host", "127.0.0.1", "--port", str(port),
             "--out", str(tmp_path / "run")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        procs["a"] = subprocess.Popen(group_command(kit, port, tmp_path / "a"), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        with open(tmp_path / "b.console", "wb") as console:
            procs["b"] = subprocess.Popen(group_command(kit, port, tmp_path / "b"), stdout=console, stderr=console,
                                          stdin=subprocess.DEVNULL)
        kit.wait_until(lambda: kit.status(port).get("round", 0) >= 3, 120, "round 3", interval=0.1)
        told = time.monotonic()
        procs["a"].send_signal(signal.SIGTERM)
        code = procs["a"].wait(timeout=10)
        exited = time.monotonic() - told
        assert code == 0, procs["a"].stderr.read().decode()
        procs["a"] = subprocess.Popen(group_command(kit, port, tmp_path / "a"), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        at = kit.status(port)["round"]
        kit.wait_until(lambda: len(live()) == 4 and kit.status(port)["round"] >= at + 3, 120,
                       "both members back and 3 rounds more", interval=0.1)
        survivor, victim = member_pids(procs["b"].pid)
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        said = kit.wait_until(lambda: [x for x in (tmp_path / "b.console").read_text().splitlines()
                                       if x.startswith("mosaicd node: member")], 60,
                              "the group to say which member ended")
        assert procs["b"].poll() is None and Path(f"/proc/{survivor}").exists()  # its other member goes on
        for name in ("a", "b", "barrier"):
            procs[name].send_signal(signal.SIGTERM)
        codes = {name: procs[name].wait(timeout=30) for name in ("a", "b")}
    finally:
        kit.stop_all(procs)
    kit.measured(f"node group of 2: exited {exited:.2f} s after SIGTERM")
    assert codes == {"a": 0, "b": 128 + signal.SIGKILL}
    port = (tmp_path / "b" / "port.1").read_text().strip()
    assert said == [f"mosaicd node: member 1 of 2 (127.0.0.1:{port}) ended: killed by SIGKILL; 1 other " \
                           "member goes on"], said


@pytest.mark.slow
def test_a_group_of_four_is_an_asynchronous_barriers_four_nodes(tmp_path: Path, kit: Any) -> None:
    """compose's MOSAIC_SYNC=async: the barrier counts the group's members as nodes, each trains and reports; the
    run finishes with four reports and both processes exit 0."""
    (port,) = free_ports(1)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["barrier"] = subprocess.Popen(
            [*kit.by_hand, "barrier", "--sync", "async", *kit.flags({**RUN, "rounds": 20}), "--nodes", "4",
             "--host", "127.0.0.1", "--port", str(port), "--out", str(tmp_path / "run")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        procs["group"] = subprocess.Popen(group_command(kit, port, tmp_path / "g", count=4),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        codes = {name: proc.wait(timeout=120) for name, proc in procs.items()}
        errors = {name: proc.stderr.read().decode()[-2000:] for name, proc in procs.items() if proc.stderr}
    finally:
        kit.stop_all(procs)
    assert codes == {"barrier": 0, "group": 0}, errors
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and sorted(summary["model_sha256"], key=int) == ["0", "1", "2", "3"]


@pytest.mark.slow
def test_a_barrier_counting_by_dns_counts_each_address_times_its_nodes(tmp_path: Path, kit: Any) -> None:
    """Swarm's stack of several nodes per task: --expect-dns counts addresses (localhost: one), --nodes-per-address 3
    makes them 3 nodes, the 3 members of one process; the run has 3 nodes and the reference's models."""
    (port,) = free_ports(1)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["barrier"] = subprocess.Popen(
            [*kit.by_hand, "barrier", *kit.flags(RUN), "--nodes", "99", "--expect-dns", "localhost",
             "--nodes-per-address", "3", "--dns-settle", "1", "--host", "127.0.0.1", "--port", str(port),
             "--out", str(tmp_path / "run"), "--no-log-json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        procs["group"] = subprocess.Popen(group_command(kit, port, tmp_path / "group", 3), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        codes = {name: proc.wait(timeout=120) for name, proc in procs.items()}
        console = procs["barrier"].stdout.read().decode() if procs["barrier"].stdout else ""
        errors = procs["group"].stderr.read().decode() if procs["group"].stderr else ""
    finally:
        kit.stop_all(procs)
    assert codes == dict.fromkeys(procs, 0), (console[-3000:], errors[-3000:])
    assert "over the nodes localhost resolves to (3 per address)" in console
    assert "registration closed: 3 nodes" in console
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["settings"]["nodes"] == 3  # --nodes 99 is not the count: one address of 3 nodes is
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN, nodes=3))

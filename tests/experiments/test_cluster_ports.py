"""A local cluster's processes are handed their listening sockets by the launcher (`listening_sockets`,
`http.server.LISTEN_FD`): another process on the host taking free ports meanwhile costs the run nothing. The
launcher used to choose free ports and close them; each process bound its own seconds later (after its imports),
and a port taken in between failed that node ("--port N: ... is in use"), whose run then waited out its
registration: CI met it once beside other tests' clusters."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mosaicd.daemon.http.server import LISTEN_FD, ListenError, handed_socket
from mosaicd.settings import Settings

# Run in a network namespace of its own (`unshare --net`): the hog takes ports there, where no other test's
# processes listen. Without the hand-off, 8 of 9 runs here failed (3 tries of the three starts), each naming a port
# in use.
HOGGED_RUN = r"""
import json, resource, socket, sys, threading, time
from collections import deque
from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.cluster_async import run_cluster_async
from mosaicd.settings import Settings

HOLD_S = 3.0  # how long the hog keeps each port: longer than a node takes from its start to its bind
RATE = 5000  # ports taken a second, at most
MOST = 15000  # ports held at once, at most: about the half of the ephemeral range that bind(0) draws from

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
stop, taken = threading.Event(), [0]

def hog():
    held = deque()
    while not stop.is_set():
        now = time.monotonic()
        while held and (held[0][0] < now - HOLD_S or len(held) >= MOST):
            held.popleft()[1].close()
        for _ in range(RATE // 20):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", 0))
            except OSError:
                sock.close()
                break
            held.append((now, sock))
            taken[0] += 1
        stop.wait(0.05)

thread = threading.Thread(target=hog, daemon=True)
thread.start()
out, results = sys.argv[1], {}
run = {"task": "quadratic", "nodes": 4, "fanout": 2, "dim": 16, "seed": 5, "eval_every": 0, "rounds": 10}
for start in ("warm", "cold", "async"):
    before = taken[0]
    settings = Settings.load(**run, out=f"{out}/{start}", **({"sync": "async"} if start == "async" else {}))
    try:  # --fail-fast: a node that cannot listen fails the run at once, not after its registration's deadline
        if start == "async":
            summary = run_cluster_async(settings, progress=False, timeout=60, fail_fast=True)
        else:
            summary = run_cluster(settings, progress=False, timeout=60, fail_fast=True, warm=start == "warm")
        results[start] = {"status": summary["status"], "models": sorted(summary["model_sha256"])}
    except Exception as exc:
        results[start] = {"status": "failed", "error": str(exc)[:600]}
    results[start]["ports_taken"] = taken[0] - before
stop.set()
thread.join(10)
print(json.dumps(results))
"""


@pytest.mark.netns
def test_ports_taken_by_another_process_meanwhile_cost_the_run_nothing(tmp_path: Path) -> None:
    """In a namespace of its own, a thread takes loopback ports as fast as a busy host would (5,000 a second, each
    kept 3 s) while a warm, a cold and an asynchronous cluster start: each finishes, every node a member."""
    from needs import lacking  # tests/needs.py (on the path under pytest)

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        lacking("NETNS", "a network namespace of its own needs root, `unshare` (util-linux) and `ip` (iproute2)")
    script = tmp_path / "hogged.py"
    script.write_text(HOGGED_RUN)
    done = subprocess.run(["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                           sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for start in ("warm", "cold", "async"):
        assert results[start]["status"] == "finished", (start, results[start])
        assert results[start]["models"] == ["0", "1", "2", "3"], (start, results[start])
        assert results[start]["ports_taken"] > 1000, (start, results[start])  # it took ports while they started


def test_a_socket_handed_down_is_taken_once_and_a_wrong_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    options = Settings.load(host="127.0.0.1", port=0).daemon_options()
    assert handed_socket(options) is None  # none handed: the process binds --port itself
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        monkeypatch.setenv(LISTEN_FD, str(os.dup(sock.fileno())))  # its own descriptor, which it closes
        with pytest.raises(ListenError, match=f"{LISTEN_FD}=.*bound to 127.0.0.1:{port}, not --host 127.0.0.1 "
                                              f"--port {port + 1}"):
            handed_socket(options.model_copy(update={"port": port + 1}))
        assert LISTEN_FD not in os.environ  # taken out: a child process inherits no claim to it
    with socket.create_server(("127.0.0.1", 0)) as sock:
        monkeypatch.setenv(LISTEN_FD, str(os.dup(sock.fileno())))
        handed = handed_socket(options.model_copy(update={"port": sock.getsockname()[1]}))
        assert handed is not None and handed.getsockname() == sock.getsockname() and not handed.getblocking()
        handed.close()
    read, write = os.pipe()
    try:
        monkeypatch.setenv(LISTEN_FD, str(read))
        with pytest.raises(ListenError, match=f"{LISTEN_FD}={read}: no socket handed down"):
            handed_socket(options)
    finally:
        os.close(write)
        os.close(read)


def test_ports_for_daemons_started_by_hand_lie_below_the_range_outgoing_connections_take() -> None:
    """`free_ports` (the tests' daemons, which bind their --port seconds later): a client connecting meanwhile gets
    its port from the ephemeral range, so a port drawn there could be taken before its daemon binds it."""
    from mosaicd.experiments.cluster import PORTS_FROM, ephemeral_start, free_ports

    ports = free_ports(6)
    assert ports == sorted(set(ports)) and len(ports) == 6
    assert all(PORTS_FROM <= port < ephemeral_start() for port in ports), ports
    for port in ports:  # free now
        socket.create_server(("127.0.0.1", port)).close()
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            assert not {c.getsockname()[1] for c in clients} & set(free_ports(6) + ports)
        finally:
            for client in clients:
                client.close()

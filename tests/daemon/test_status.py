"""`mosaicd status URL`: the table of a live loopback cluster, from its barrier or from any node."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mosaicd import Settings
from mosaicd.experiments.cluster import Cluster, free_ports
from mosaicd.status import cluster_view, render


@pytest.mark.slow
def test_status_of_a_live_cluster_from_barrier_and_node(tmp_path: Path, kit: Any) -> None:
    # 0.05 s a round at least (kit.pace), 10 s in all: the reads below (a `mosaicd status` process among
    # them) see the run going, on a fast host too, which ran 300 bare rounds in about 2 s
    settings = Settings(nodes=4, rounds=200, fragments=4, fanout=2, train=True, eval_every=2,
                        node_profile=kit.pace(tmp_path, 0.05), out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_until(lambda: cluster.barrier_port and cluster.node_ports, 30, "the cluster's ports")
        barrier = f"http://127.0.0.1:{cluster.barrier_port}"

        def evaluated() -> dict | None:
            try:
                view = cluster_view(barrier)
            except Exception:
                return None
            return view if view["barrier"]["metrics"] and all(r["metric"] is not None for r in view["nodes"]) else None

        view = kit.wait_until(evaluated, 60, "an evaluation of every node")
        via_node = cluster_view(f"127.0.0.1:{cluster.node_ports[2]}")
        proc = subprocess.run([*kit.by_hand, "status", barrier, "--json"], capture_output=True, text=True, timeout=30)
        console = Console(record=True, width=160)
        console.print(render(view))
        text = console.export_text()
    finally:
        thread.join(timeout=150)
    assert "summary" in result, result
    assert [r["rank"] for r in view["nodes"]] == [0, 1, 2, 3]
    assert all(r["reachable"] and r["address"].startswith("127.0.0.1:") for r in view["nodes"])
    assert all(r["phase"] in ("training", "sending", "waiting") for r in view["nodes"])
    assert all(isinstance(r["metric"], float) and r["bytes_out"] > 0 for r in view["nodes"])
    assert via_node["url"] == barrier and [r["rank"] for r in via_node["nodes"]] == [0, 1, 2, 3]
    assert proc.returncode == 0, proc.stderr
    scripted = json.loads(proc.stdout)
    assert scripted["barrier"]["role"] == "barrier" and len(scripted["nodes"]) == 4
    assert "rank" in text and "loss" in text and "loss" in text and "node-average" in text
    for r in view["nodes"]:
        assert r["address"] in text


def test_status_of_nothing_says_so(kit: Any) -> None:
    proc = subprocess.run([*kit.by_hand, "status", f"http://127.0.0.1:{free_ports(1)[0]}"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 1 and proc.stderr.startswith("mosaicd status: error: http://127.0.0.1:")
    proc = subprocess.run([*kit.by_hand, "status", "ftp://x"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "expected http://host:port" in proc.stderr


def test_status_of_a_silent_address_names_the_limit_it_waited(kit: Any) -> None:
    """A port that takes the connection and never answers (a process stopped with SIGSTOP, say)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.run([*kit.by_hand, "status", url, "--timeout", "0.5"], capture_output=True, text=True,
                              timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == f"mosaicd status: error: {url}/v1/status: no answer within 0.5 s (--timeout)"


def test_status_of_a_barrier_waiting_for_its_nodes_counts_who_has_come(tmp_path: Path, kit: Any) -> None:
    """While nodes register there are no members yet: "registered 0/4", not "live 0/0"."""
    port = free_ports(1)[0]
    barrier = subprocess.Popen([*kit.by_hand, "barrier", "--task", "quadratic", "--nodes", "4", "--rounds", "3",
                                "--fanout", "2", "--host", "127.0.0.1", "--port", str(port), "--out",
                                str(tmp_path / "run")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        def listening() -> bool:
            try:
                return kit.http("GET", f"{url}/healthz").status == 200
            except OSError:
                return False
        kit.wait_until(listening, 30, "the barrier to listen")
        proc = subprocess.run([*kit.by_hand, "status", url], capture_output=True, text=True, timeout=30)
    finally:
        barrier.terminate()
        barrier.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "registering  round 0/3  registered 0/4  dropped []" in proc.stdout.splitlines()[0], proc.stdout

"""A barrier not told the node count (compose --scale on the host's network): it counts the nodes that registered
once none new came for --expect-settle seconds; nodes on --port 0 say their port in --port-file and take it back
when started again; the barrier's console (not --log-json) says where to look, each round and the result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from aiohttp import web

from mosaicd import Settings
from mosaicd.daemon.barrier.registration import count_nodes, invalid_count
from mosaicd.daemon.http.membership import resolve_all
from mosaicd.daemon.http.server import serve
from mosaicd.experiments.cluster import free_ports

RUN = dict(task="quadratic", rounds=3, fragments=2, fanout=2, dim=64, eval_every=1, seed=3)


def test_barrier_counts_nodes_once_none_new_came_and_tells_people(tmp_path: Path, kit: Any) -> None:
    nodes, (port,) = 4, free_ports(1)
    procs: list[subprocess.Popen] = []
    console = tmp_path / "barrier.txt"
    try:
        with open(console, "wb") as out:
            procs.append(subprocess.Popen(
                [*kit.by_hand, "barrier", *kit.flags(RUN), "--nodes", "99", "--expect-settle", "2", "--host",
                 "127.0.0.1", "--port", str(port), "--out", str(tmp_path / "run"), "--no-log-json", "--linger", "3"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        for i in range(nodes):
            with open(tmp_path / f"node-{i}.log", "wb") as out:
                procs.append(subprocess.Popen(
                    [*kit.by_hand, "node", "--barrier-url", f"http://127.0.0.1:{port}", "--host", "127.0.0.1",
                     "--port", "0", "--port-file", str(tmp_path / f"node-{i}.port"), "--log-json"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = console.read_text()
    assert codes == [0] * (nodes + 1), text[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["settings"]["nodes"] == nodes  # --nodes 99 is not the count: the nodes that came are
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN, nodes=nodes))
    ports = sorted(int((tmp_path / f"node-{i}.port").read_text()) for i in range(nodes))
    assert sorted(int(a.rsplit(":", 1)[1]) for a in summary["addresses"]) == ports

    assert f"dashboard: http://127.0.0.1:{port}/" in text and f"mosaicd status http://127.0.0.1:{port}" in text
    assert "until none new comes for 2s (or twice the longest pause between them)" in text
    assert f"registration closed: {nodes} nodes" in text
    assert "round 2 (3/3 done)" in text and "finished: 3 rounds" in text
    assert '"event"' not in text and "registered address=" not in text  # people's lines, not the log's


async def test_a_process_started_again_takes_its_port_back(tmp_path: Path) -> None:
    options = Settings(host="127.0.0.1", port=0, port_file=tmp_path / "port").daemon_options()
    runner, first = await serve(web.Application(), options)
    await runner.cleanup()
    assert int((tmp_path / "port").read_text()) == first
    runner, again = await serve(web.Application(), options)
    try:
        assert again == first
        taken, other = await serve(web.Application(), options)  # the port is taken now: any free one
        assert other != first and int((tmp_path / "port").read_text()) == other
        await taken.cleanup()
    finally:
        await runner.cleanup()


async def test_a_dns_count_is_the_addresses_times_the_nodes_behind_each() -> None:
    """--expect-dns counts addresses; a task of Swarm's stack holding 4 nodes is one address of 4 nodes."""
    options = Settings.load(expect_dns="localhost", nodes_per_address=4).daemon_options()
    readings: list[int] = []
    await count_nodes(options, lambda: not readings, lambda: 0, readings.append)
    assert readings == [len(resolve_all("localhost")) * 4] and readings[0] > 0
    options = Settings.load(expect_dns="tasks.node", nodes_per_address=4).daemon_options()
    assert "(tasks.node resolved to 2 addresses of 4 nodes each)" in invalid_count(8, options, ValueError("x"))

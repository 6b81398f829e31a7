"""The daemon end to end on loopback: real processes and real HTTP give mosaic_proto's in-memory models, bit for bit."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mosaic_proto import Layout
from mosaicd import Peer, Settings
from mosaicd.experiments.cluster import Cluster, free_ports

RUN = dict(nodes=8, rounds=5, fragments=4, fanout=2, seed=0)  # the quadratic task's defaults otherwise


@pytest.mark.slow  # about 8 s on 2 idle cores (9 processes start), more on a busy machine
def test_cluster_matches_in_memory_network(tmp_path: Path, kit: Any) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([*kit.by_hand, "cluster", *kit.flags(RUN), "--out", str(out), "--quiet"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cluster"
    assert summary["dropped"] == []
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN))
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(out)
    for rank in range(RUN["nodes"]):  # logs/node-<rank>.log holds that rank
        lines = [json.loads(x) for x in (out / "logs" / f"node-{rank}.log").read_text().splitlines() if x[:1] == "{"]
        assert {x["node"] for x in lines if "node" in x} == {rank}


@pytest.mark.slow  # about 6 s on 2 idle cores, more on a busy machine
def test_peer_list_matches_in_memory_network(tmp_path: Path, kit: Any) -> None:
    ports = free_ports(RUN["nodes"])
    lines = ["# the run's nodes, one host:port a line; rank = sorted order", ""]
    for port in reversed(ports):  # not in rank order: ranks come from sorting
        lines += [f"127.0.0.1:{port}   # node on {port}", ""]
    peers = tmp_path / "peers.txt"
    peers.write_text("\n".join(lines) + "\n")
    procs = {}
    try:
        for port in ports:
            log = open(tmp_path / f"node-{port}.log", "wb")
            procs[port] = subprocess.Popen(
                [*kit.by_hand, "node", "--peer-list", str(peers), "--port", str(port), "--host", "127.0.0.1",
                 "--out", str(tmp_path / f"out-{port}"), "--log-json", *kit.flags(RUN)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
        for port, proc in procs.items():
            rc = proc.wait(timeout=120)
            assert rc == 0, (tmp_path / f"node-{port}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    rank0 = min(ports)
    summary = json.loads((tmp_path / f"out-{rank0}" / "summary.json").read_text())
    assert summary["addresses"] == [f"127.0.0.1:{p}" for p in sorted(ports)]
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN))
    assert not any((tmp_path / f"out-{p}" / "summary.json").exists() for p in ports if p != rank0)


def scrape(kit: Any, port: int) -> dict[str, Any]:
    """GET /v1/status and /metrics of one daemon: {"status": {...}, "metrics": {"name{labels}": value}}."""
    status = kit.http("GET", f"http://127.0.0.1:{port}/v1/status", timeout=5)
    metrics = kit.http("GET", f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert status.status == 200 and metrics.status == 200
    assert status.content_type == "application/json" and metrics.content_type == "text/plain"
    samples = {}
    for family in text_string_to_metric_families(metrics.body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return {"status": status.json(), "metrics": samples}


@pytest.mark.slow
def test_status_and_metrics_move_during_a_run(tmp_path: Path, kit: Any) -> None:
    # protocol-only rounds of a 500k-float model: each round moves ~4 MB per node; and 0.05 s at least
    # (kit.pace), so that both scrapes come during the run on a fast host too
    settings = Settings(nodes=4, rounds=40, fragments=4, fanout=2, dim=500_000, train=False, eval_every=0,
                        node_profile=kit.pace(tmp_path, 0.05), out=tmp_path / "run")
    cluster = Cluster(settings, progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=120)
    try:
        kit.wait_until(lambda: cluster.barrier_port and cluster.node_ports, 30, "the cluster's ports")
        node, barrier = cluster.node_ports[0], cluster.barrier_port

        def at_round(at_least: int) -> dict[str, Any] | None:
            if "error" in result:
                raise result["error"]
            try:
                node_view, barrier_view = scrape(kit, node), scrape(kit, barrier)
            except OSError:  # not listening yet
                return None
            return {"node": node_view, "barrier": barrier_view} if node_view["status"]["round"] >= at_least else None

        first = kit.wait_until(lambda: at_round(2), 60, "round 2 on node-0")
        def later(view: dict[str, Any] | None) -> dict[str, Any] | None:
            # the barrier is scraped after the node, so each view's barrier may be a round ahead of its node
            barrier_moved = view is not None and (view["barrier"]["metrics"]["mosaic_barrier_round"]
                                                  > first["barrier"]["metrics"]["mosaic_barrier_round"])
            return view if barrier_moved else None

        second = kit.wait_until(lambda: later(at_round(first["node"]["status"]["round"] + 2)), 60, "two more rounds")
    finally:
        thread.join(timeout=150)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    assert result["summary"]["settings"]["rounds"] == 40 and len(result["summary"]["model_sha256"]) == 4

    a, b = first["node"], second["node"]
    assert a["status"]["round"] < b["status"]["round"] < settings.rounds  # both scrapes during the run
    assert a["status"]["last_round"]["round"] < b["status"]["last_round"]["round"]
    assert a["status"]["rank"] == b["status"]["rank"] and a["status"]["phase"] != "finished"
    for name in ("mosaic_round", "mosaic_sent_bytes_total", "mosaic_received_bytes_total",
                 "mosaic_sent_fragments_total", "mosaic_received_fragments_total", "mosaic_received_messages_total"):
        assert a["metrics"][name] < b["metrics"][name], name
    # every node sends s=2 copies of each of its K fragments per round: exactly s*d floats plus headers
    assert b["metrics"]["mosaic_sent_fragments_total"] == 2 * 4 * b["metrics"]["mosaic_round"]
    assert b["metrics"]["mosaic_sent_bytes_total"] >= 2 * 4 * settings.dim * b["metrics"]["mosaic_round"]

    a, b = first["barrier"], second["barrier"]
    assert a["status"]["role"] == "barrier" and a["status"]["phase"] == "running"
    assert a["status"]["round"] < b["status"]["round"]
    assert a["metrics"]["mosaic_barrier_round"] < b["metrics"]["mosaic_barrier_round"]
    assert b["metrics"]["mosaic_barrier_members"] == 4 and b["metrics"]["mosaic_barrier_registered"] == 4
    assert b["status"]["live"] == [0, 1, 2, 3] and b["status"]["dropped"] == []
    assert sum(m["last_round"] for m in a["status"]["members"]) < sum(m["last_round"] for m in b["status"]["members"])


async def test_python_api_peers_match_in_memory_network(tmp_path: Path, kit: Any) -> None:
    run = dict(nodes=5, rounds=4, fragments=3, fanout=2, dim=30, seed=11, train=False, eval_every=2,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10)
    barrier, runner, settings = await kit.served_barrier(run, tmp_path / "barrier")
    peers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(settings.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        assert sorted(p.rank for p in peers) == list(range(settings.nodes))
        reference = kit.reference_vectors(settings)
        initial = kit.reference_vectors(settings.model_copy(update={"rounds": 0}))
        vectors = {p.rank: initial[p.rank] for p in peers}
        received = 0
        for t in range(settings.rounds):
            results = await asyncio.wait_for(asyncio.gather(*(p.gossip(vectors[p.rank]) for p in peers)), 30)
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
            assert all(p.round == t + 1 and p.last_report.round == t for p in peers)
            received += sum(p.last_report.messages_in for p in peers)
        frames = sum(p.inbox.metrics.registry.get_sample_value("mosaic_fragment_frames_total", {"status": "200"})
                     or 0 for p in peers)
        assert frames == received > 0  # every message went as a frame on a fragments stream (http/stream.py)
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 30)
        for rank, vector in vectors.items():
            assert kit.sha256_f32(vector) == kit.sha256_f32(reference[rank]), rank
        await asyncio.wait_for(barrier.done.wait(), 10)
        summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
        assert summary["model_sha256"] == {str(r): kit.sha256_f32(v) for r, v in enumerate(reference)}
        with pytest.raises(RuntimeError):
            await peers[0].gossip(vectors[peers[0].rank])
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


async def test_gossip_awaits_before_arrival_after_its_sends_and_before_the_barrier_releases(tmp_path: Path,
                                                                                            kit: Any) -> None:
    """`Peer.gossip(before_arrival=...)` (the node daemon's checkpoint wait): awaited once per round, after the
    round's fragments are delivered and before the node arrives, so the round is not released meanwhile; the models
    are those of the in-memory network."""
    run = dict(nodes=3, rounds=2, fragments=2, fanout=2, dim=24, seed=5, train=False, eval_every=0,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10)
    barrier, runner, settings = await kit.served_barrier(run, tmp_path / "barrier")
    peers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(settings.nodes)]
    seen: list[tuple[int, int, str, int]] = []

    def hook(peer: Peer, t: int) -> Callable[[], Awaitable[None]]:
        async def before_arrival() -> None:
            await asyncio.sleep(0.2)  # a slow checkpoint: nobody's round is released while this one waits
            seen.append((peer.rank, peer.round, peer.phase.value, sum(q.round for q in peers)))
        return before_arrival

    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        reference = kit.reference_vectors(settings)
        vectors = dict(enumerate(kit.reference_vectors(settings.model_copy(update={"rounds": 0}))))
        for t in range(settings.rounds):
            results = await asyncio.wait_for(asyncio.gather(*(
                p.gossip(vectors[p.rank], before_arrival=hook(p, t)) for p in peers)), 30)
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
            # each peer's sends were over (waiting for its arrival) in round t, and none was released meanwhile
            assert [(rnd, phase, total) for _, rnd, phase, total in seen[-3:]] == [(t, "waiting", 3 * t)] * 3
        assert len(seen) == 3 * settings.rounds
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 30)
        for rank, vector in vectors.items():
            assert kit.sha256_f32(vector) == kit.sha256_f32(reference[rank]), rank
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


async def test_a_peer_whose_loop_raises_leaves_and_the_others_go_on(tmp_path: Path, kit: Any) -> None:
    """`async with Peer(...)` around a loop that raises: the peer leaves, saying why, so the others finish their
    rounds at once instead of waiting for it for `--drop-after` round deadlines (here 2 x 60 s)."""
    run = dict(nodes=4, rounds=3, fragments=2, fanout=2, dim=12, seed=3, train=False, eval_every=0,
               host="127.0.0.1", port=0, round_deadline=60, drop_after=2, register_deadline=30, request_timeout=10)
    barrier, runner, settings = await kit.served_barrier(run, tmp_path / "barrier")
    initial = kit.reference_vectors(settings.model_copy(update={"rounds": 0}))

    async def node(failing: bool) -> int:
        async with Peer(settings, Layout.flat(settings.dim)) as peer:
            vector = initial[peer.rank]
            for t in range(settings.rounds):
                if failing and t == 1:
                    raise ValueError("a bug in the user's loop")
                vector = await peer.gossip(vector)
            await peer.finish()
            return peer.rank

    try:
        results = await asyncio.wait_for(asyncio.gather(*(node(i == 2) for i in range(4)), return_exceptions=True),
                                         40)  # well under one round deadline
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], ValueError), results
        done = sorted(r for r in results if isinstance(r, int))
        assert len(done) == 3, results
        await asyncio.wait_for(barrier.done.wait(), 10)
        summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
        assert summary["status"] == "finished", summary
        gone = sorted(set(range(4)) - set(done))
        assert [e.get("left") for e in summary["events"] if e.get("left")] == [gone], summary["events"]
    finally:
        await runner.cleanup()


async def test_the_public_peer_hosts_a_peer_lists_barrier_and_the_node_role_alone_needs_a_host(tmp_path: Path) -> None:
    """`mosaicd.Peer` hosts the barrier as rank 0 of a --peer-list, as it always did (daemon/embedded.py); the node
    role's own `Peer` reaches it only through the `host` it is given, and says so without one."""
    from mosaicd.daemon.embedded import EmbeddedBarrier, hosting
    from mosaicd.daemon.http.auth import Secret
    from mosaicd.daemon.node import peer as node_peer

    peers = tmp_path / "peers.txt"
    peers.write_text("127.0.0.1:5002\n127.0.0.1:5001\n127.0.0.1:5003\n")
    settings = Settings(**RUN, peer_list=peers, host="127.0.0.1", port=5001, out=tmp_path / "run")
    options, run = settings.daemon_options(), settings.run_config()
    assert issubclass(Peer, node_peer.Peer) and Peer(options, run=run)._host is not None
    secret = Secret.new()
    hosted = node_peer.hosted_barrier(options, run, hosting(), secret)
    assert isinstance(hosted, EmbeddedBarrier) and hosted.barrier.run.nodes == 3
    assert hosted.barrier.keyring.secret == secret.value  # the node's own value, not the file read again
    assert hosted.unheard(0) == [] and hosted.app() is not None
    with pytest.raises(ValueError, match="needs a host"):
        node_peer.hosted_barrier(options, run, None, secret)
    rank_1 = settings.daemon_options().model_copy(update={"port": 5002})
    assert node_peer.hosted_barrier(rank_1, run, None, secret) is None  # not rank 0: nothing to host

"""Large fragment messages over real HTTP on loopback: the copy-saving paths (a body sent after its head, not
joined to it, a body read as its chunks joined, blocked aggregation) give mosaic_proto's in-memory models bit for
bit, signed or not."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientSession, web

from mosaic_proto import CONTENT_TYPE, Fragmentation, InMemoryNetwork, Layout, PeerSampler
from mosaicd import Peer, Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.http.body import OFF_LOOP_BYTES
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.node.routes import read_body

# K=1 (one contiguous fragment) and K=3 (random fragments); d big enough that every message is a piecewise body;
# and K=1 with messages of OFF_LOOP_BYTES and more, which the receivers decode in worker threads (node/inbox.py)
RUNS = [dict(fragments=1, strategy="random"), dict(fragments=3, strategy="random"),
        dict(fragments=1, strategy="random", dim=OFF_LOOP_BYTES // 4 + 1000)]


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
@pytest.mark.parametrize("run", RUNS, ids=["k1", "k3", "k1-off-loop"])
async def test_large_messages_give_the_in_memory_models(tmp_path: Path, kit: Any, run: dict, secret: bool) -> None:
    extra: dict[str, Any] = {}
    if secret:
        (tmp_path / "secret").write_bytes(b"s" * 32)
        extra["secret_file"] = tmp_path / "secret"
    settings = {**dict(nodes=4, rounds=3, fanout=2, dim=300_000, seed=7, train=False, eval_every=0, host="127.0.0.1",
                       port=0, round_deadline=60, register_deadline=30, request_timeout=30), **run, **extra}
    barrier_settings = Settings(**settings, out=tmp_path / "barrier")
    shared = Secret.of(barrier_settings) if secret else Secret.new()  # "plain": the program's own, in memory
    barrier = Barrier(barrier_settings.run_config(), barrier_settings.daemon_options(), secret=shared)
    runner, barrier_url = await kit.serve_on_loopback(barrier_app(barrier))
    peer_settings = Settings(**settings, barrier_url=barrier_url)
    peers = [Peer(peer_settings, Layout.flat(peer_settings.dim), secret=None if secret else shared)
             for _ in range(peer_settings.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 60)
        s = peer_settings
        rng = np.random.default_rng(3)  # any starting models: the same for the daemons and the reference
        initial = [(rng.standard_normal(s.dim) * 10.0 ** rng.integers(-20, 20, s.dim)).astype(np.float32)
                   for _ in range(s.nodes)]
        network = InMemoryNetwork(initial, Fragmentation.build(Layout.flat(s.dim), s.fragments, s.seed, s.strategy),
                                  PeerSampler(s.sampler, s.fanout, s.seed), None, run_id=s.run_id)
        network.run(s.rounds)
        reference = network.vectors
        vectors = {p.rank: initial[p.rank] for p in peers}
        for _ in range(peer_settings.rounds):
            results = await asyncio.wait_for(asyncio.gather(*(p.gossip(vectors[p.rank]) for p in peers)), 60)
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
            for p in peers:
                report = p.last_report
                assert not report.refused and report.fragments_unsent == 0 and report.delivered
                # every message is large: many socket reads on the receiver's side
                assert all(size > 1 << 18 for _, size in report.delivered.values())
                assert "dim" not in run or all(size >= OFF_LOOP_BYTES for _, size in report.delivered.values())
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 60)
        for rank, vector in vectors.items():
            assert kit.sha256_f32(vector) == kit.sha256_f32(reference[rank]), rank
        await asyncio.wait_for(barrier.done.wait(), 30)
        summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
        assert summary["model_sha256"] == {str(r): kit.sha256_f32(v) for r, v in enumerate(reference)}
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


async def test_read_body_joins_chunks_refuses_oversized_and_takes_chunked_bodies(kit: Any) -> None:
    """read_body against request.read() on the same bodies: Content-Length and chunked, in one piece or many."""
    seen: list[tuple[bytes, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await read_body(request)
        assert type(body) is bytes
        seen.append((body, await request.read()))  # what is left for request.read() after read_body: nothing
        return web.Response(text=str(len(body)))

    app = web.Application(client_max_size=1 << 20)
    app.add_routes([web.post("/b", handler)])
    runner, base = await kit.serve_on_loopback(app)
    url = f"{base}/b"
    payload = np.random.default_rng(1).bytes(700_000)
    try:
        async with Client(10, 0) as client:
            for data in (b"x", payload[:1000], payload):
                status, answer, _ = await client.request("POST", url, data=data,
                                                         headers={"Content-Type": CONTENT_TYPE})
                assert (status, answer) == (200, str(len(data)).encode())
                assert seen[-1][0] == data
            with pytest.raises(HttpError) as refused:
                await client.request("POST", url, data=payload * 2, headers={"Content-Type": CONTENT_TYPE})
            assert refused.value.status == 413

        async def pieces() -> Any:  # chunked transfer encoding, many small chunks
            for i in range(0, len(payload), 70_001):
                yield payload[i:i + 70_001]

        async with ClientSession() as session:
            async with session.post(url, data=pieces()) as resp:
                assert resp.status == 200 and await resp.text() == str(len(payload))
            assert seen[-1][0] == payload

            async def too_many() -> Any:
                for _ in range(20):
                    yield payload[:100_000]

            async with session.post(url, data=too_many()) as resp:
                assert resp.status == 413
    finally:
        await runner.cleanup()


_FAULTS_OF_A_BLOCK_AGAIN = """
import resource, sys
took = None
if sys.argv[1] == "node":
    from mosaicd.daemon.http.server import keep_freed_memory
    took = keep_freed_memory()
block = bytearray(40 << 20)  # a model of 10M values: above the 32 MiB glibc maps on its own
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(40 << 20)
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's next round reuses the memory of its last one: a 40 MiB block allocated again faults in no page
    (10,240 without the settings); the environment's own settings win. Fresh interpreters: the settings stay."""
    def faults(*argv: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_BLOCK_AGAIN, *argv], capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()
        return out[0], int(out[1])

    took, node = faults("node")
    assert took == "True" and node < 1000  # glibc (this project's Linux images) takes the settings
    assert faults("plain")[1] > 10_000
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")  # the environment's own settings win
    assert faults("node")[0] == "False"

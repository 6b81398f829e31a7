"""Nothing large on the loop (issue #23): a node decodes a large message in a worker thread, so its /healthz and
small messages are served meanwhile; a body that cannot be a message of the run is refused from its CBOR heads.

The node here is the daemon's own HTTP app (`node_app` over an `Inbox` and a `NodeState` in its training phase)
served on loopback; the messages are real ones of its run, sent over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import numpy as np
import pytest

from mosaic_proto import CONTENT_TYPE, Fragmentation, FragmentBatch, Layout, NodeState, PeerSampler, encode
from mosaicd.daemon.http.body import OFF_LOOP_BYTES
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.node.inbox import Inbox
from mosaicd.daemon.node.routes import node_app
from mosaicd.settings import DaemonOptions

RUN, K, DIM = "bodies", 8, 4 << 20  # 16 MiB of floats: all K fragments make a large message, one a small one
FR = Fragmentation.build(Layout.flat(DIM), K, 0)
SAMPLER = PeerSampler("local", 2, 0)  # 3 members, fanout 2: every fragment goes to both others


def message(sender: int, fragments: list[int]) -> bytes:
    values = {f: np.full(len(FR.indices[f]), sender, np.float32) for f in fragments}
    return encode(FragmentBatch(RUN, 0, sender, K, FR.fingerprint, values))


@pytest.fixture
async def node() -> AsyncIterator[tuple[str, Inbox]]:
    """Node 0 of a 3-member run, in round 0's training phase, served on 127.0.0.1."""
    options = DaemonOptions(host="127.0.0.1", port=0)
    state = NodeState(max_bytes=options.max_body_bytes)
    state.registered(0, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], [0, 1, 2], 0, RUN, 0.0)
    state.start(FR, SAMPLER, np.zeros(DIM, np.float32))
    inbox = Inbox(state, options, None)
    inbox.model_known(FR.layout)
    runner, port = await serve(node_app(inbox), options)
    try:
        yield f"http://127.0.0.1:{port}", inbox
    finally:
        await runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/v1/fragments", data=body, headers={"Content-Type": CONTENT_TYPE}) as resp:
        return resp.status, await resp.json()


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts the work handed to it (a large body's buffer and its decoding go there)."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


async def test_healthz_and_a_small_message_are_served_while_a_large_one_decodes(node: tuple[str, Inbox]) -> None:
    url, inbox = node
    assert SAMPLER.share(0, 1, K, [0, 1, 2], 0) == tuple(range(K))
    large, small = message(1, list(range(K))), message(2, [3])
    assert len(large) >= OFF_LOOP_BYTES > len(small)
    # The loop's worker threads: one, held busy until released, so the large message's work (once the body is in,
    # its decoding) stays pending in the pool for as long as this test looks
    # at the node; work done on the loop would not wait for it.
    loop, release, pool = asyncio.get_running_loop(), threading.Event(), CountingPool(1)
    loop.set_default_executor(pool)
    held = loop.run_in_executor(None, release.wait, 60)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            pending = asyncio.create_task(post(session, url, large))
            for _ in range(600):  # until the body is in and its work waits in the pool (bounded; nothing timed)
                if pool.submitted > 1 or pending.done():
                    break
                await asyncio.sleep(0.05)
            assert pool.submitted == 2 and not pending.done()
            async with session.get(f"{url}/healthz") as resp:
                assert resp.status == 200
            assert await post(session, url, small) == (200, {"status": "accepted", "round": 0})
            assert not pending.done() and inbox.state.taking().report.fragments_in == 1
            release.set()
            assert await pending == (200, {"status": "accepted", "round": 0})
    finally:
        release.set()
        await held
    assert inbox.state.taking().report.fragments_in == K + 1 and inbox.decoding.count == 0
    assert pool.submitted == 2  # held, then the large body's decode, not on the loop (its buffer is a kept one)


async def test_a_large_body_that_cannot_be_a_message_is_refused_from_its_heads(node: tuple[str, Inbox]) -> None:
    url, inbox = node

    def array(size: int) -> bytes:  # one zero per byte: cbor2 would build a list of that many items
        return b"\x9b" + (size - 9).to_bytes(8, "big") + bytes(size - 9)

    head = message(1, [0])
    frags = head[:head.index(b"\x65frags") + 6]  # a header of this run up to its "frags" key
    bodies = {(400, "bad_header"): array(12 << 20), (400, "bad_fragment"): frags + array(12 << 20)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for (code, reason), body in bodies.items():
            assert len(body) >= OFF_LOOP_BYTES
            status, answer = await post(session, url, body)
            assert (status, answer["reason"]) == (code, reason), answer
        assert await post(session, url, message(2, [3])) == (200, {"status": "accepted", "round": 0})
    refused = inbox.state.taking().report.refused
    assert refused == {"bad_header": 1, "bad_fragment": 1} and inbox.decoding.count == 0


async def test_a_body_longer_than_any_message_of_the_run_is_refused_from_its_request_head(
        node: tuple[str, Inbox]) -> None:
    url, inbox = node
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:  # the head alone, declaring more than the K fragments' 16 MiB of floats: the body is never sent
        writer.write(b"POST /v1/fragments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/cbor\r\n"
                     b"Content-Length: %d\r\n\r\n" % (24 << 20))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        answer = json.loads(await asyncio.wait_for(reader.readexactly(length), 30))
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413") and answer["reason"] == "too_large", (head, answer)
    assert b"connection: close" in head.lower()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        assert await post(session, url, message(2, [3])) == (200, {"status": "accepted", "round": 0})

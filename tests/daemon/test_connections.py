"""The thin HTTP/1.1 client (`http/connections.py`, under `Client`) against real aiohttp servers on loopback:
kept-alive connections reused, answers of every framing (Content-Length, chunked, none, large), a server that
closes or drops its connections, deadlines, and requests it refuses to write."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from mosaicd.daemon.http.client import Client, HttpError, Refused
from mosaicd.daemon.http.connections import Connections, SlowConnects


@asynccontextmanager
async def raw_server(serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                     ) -> AsyncIterator[tuple[str, Connections]]:
    """A server that writes its answers by hand on loopback: its URL, and the client's connections to it."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    connections = Connections()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x", connections
    finally:
        connections.close()
        server.close()
        await server.wait_closed()


def app_with(seen: list[tuple[Any, bytes, dict[str, str]]]) -> web.Application:
    """Handlers that note (connection, body, headers) of each request."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.transport, body, dict(request.headers)))
        return web.Response(body=body, content_type="application/cbor")

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/plain"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for piece in (b"one ", b"two ", b"three"):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def close(request: web.Request) -> web.Response:
        seen.append((request.transport, await request.read(), dict(request.headers)))
        resp = web.json_response({"closing": True})
        resp.force_close()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"reason": "stale_round", "detail": "too old"}, status=409)

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * (1 << 15))  # 8 MiB: many reads

    app = web.Application(client_max_size=1 << 24)
    app.add_routes([web.post("/echo", echo), web.get("/echo", echo), web.get("/chunked", chunked),
                    web.post("/close", close), web.get("/slow", slow), web.post("/refuse", refuse),
                    web.delete("/empty", empty), web.get("/big", big)])
    return app


async def test_requests_share_kept_alive_connections_and_read_every_framing(kit: Any) -> None:
    seen: list[tuple[Any, bytes, dict[str, str]]] = []
    runner, base = await kit.serve_on_loopback(app_with(seen))
    try:
        async with Client(5, 0) as client:
            for body in (b"", b"x", os.urandom(70_000), os.urandom(3 << 20)):  # joined to the head, and not
                status, answer, kind = await client.request("POST", f"{base}/echo?a=1", data=body,
                                                            headers={"Content-Type": "application/cbor"})
                assert (status, answer, kind) == (200, body, "application/cbor")
            assert len({id(transport) for transport, _, _ in seen}) == 1  # one connection, kept alive
            assert seen[0][2]["Content-Length"] == "0" and seen[0][2]["Host"] == base.split("//")[1]
            status, answer, _ = await client.request("GET", f"{base}/echo")
            assert status == 200 and answer == b"" and "Content-Length" not in seen[-1][2]
            assert (await client.request("GET", f"{base}/chunked"))[1:] == (b"one two three", "text/plain")
            assert (await client.request("DELETE", f"{base}/empty"))[:2] == (204, b"")
            assert (await client.request("GET", f"{base}/big"))[1] == bytes(range(256)) * (1 << 15)
            assert await client.post_json(f"{base}/close", {"a": 1}) == {"closing": True}
            await client.request("POST", f"{base}/echo", data=b"after")  # the closed one is not taken again
            assert seen[-1][1] == b"after" and seen[-1][0] is not seen[-2][0]

            # ten at once: ten connections, kept and taken again
            await asyncio.gather(*(client.request("POST", f"{base}/echo", data=b"%d" % i) for i in range(10)))
            before = {id(t) for t, _, _ in seen[-10:]}
            await asyncio.gather(*(client.request("POST", f"{base}/echo", data=b"%d" % i) for i in range(10)))
            assert {id(t) for t, _, _ in seen[-10:]} <= before

            with pytest.raises(Refused) as refused:
                await client.request("POST", f"{base}/refuse", data=b"x")
            assert (refused.value.status, refused.value.reason) == (409, "stale_round")
    finally:
        await runner.cleanup()


async def test_a_connection_its_server_closed_while_idle_is_replaced(kit: Any) -> None:
    """The server forgets idle connections (its keep-alive timeout); the next request opens a new one at once."""
    seen: list[tuple[Any, bytes, dict[str, str]]] = []
    runner = web.AppRunner(app_with(seen), access_log=None, keepalive_timeout=0.05)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with Client(5, 0) as client:
            for _ in range(3):
                assert (await client.request("POST", f"{base}/echo", data=b"x"))[1] == b"x"
                while not seen[-1][0].is_closing():  # the server closes it: no fixed wait
                    await asyncio.sleep(0.01)
            assert len({id(t) for t, _, _ in seen}) == 3
    finally:
        await runner.cleanup()


async def test_a_kept_connection_closed_as_the_request_leaves_is_replaced_once() -> None:
    """A server that answers the first request on each connection and closes it, unanswered, at the second: the
    client, finding its kept connection dropped before any answer, sends the request again on a new one."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the second request on this connection: dropped unanswered
        writer.close()

    async with raw_server(serve) as (url, connections):
        for _ in range(3):
            answer = await connections.request("GET", url, {}, b"")
            assert (answer.status, answer.body, answer.content_type) == (200, b"ok", "text/plain")
        assert len(heads) == 3  # each later request on a new connection, once


async def test_an_answer_without_a_length_ends_with_its_connection() -> None:
    """A server that frames its answer by closing the connection (no Content-Length, not chunked)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with raw_server(serve) as (url, connections):
        for _ in range(2):
            answer = await connections.request("GET", url, {}, b"")
            assert (answer.status, answer.body, answer.content_type) == (200, b"all of it", "application/octet-stream")


async def test_a_request_past_its_deadline_fails_and_its_connection_is_dropped(kit: Any) -> None:
    seen: list[tuple[Any, bytes, dict[str, str]]] = []
    runner, base = await kit.serve_on_loopback(app_with(seen))
    try:
        async with Client(0.2, 1, backoff=0.01) as client:
            with pytest.raises(HttpError) as failed:
                await client.request("GET", f"{base}/slow")
            assert failed.value.status is None and "2 attempts" in failed.value.detail
            assert not failed.value.closed  # a peer that answers late is slow, not down
            assert (await client.request("POST", f"{base}/echo", data=b"y"))[1] == b"y"
        async with Client(5, 0) as client:  # nobody listens: a connection error, no answer
            port = runner.addresses[0][1]
            await runner.cleanup()
            with pytest.raises(HttpError) as failed:
                await client.request("GET", f"http://127.0.0.1:{port}/echo")
            assert failed.value.status is None and failed.value.closed  # its port closed: down (a routine send)
    finally:
        await runner.cleanup()


async def test_requests_it_will_not_write() -> None:
    connections = Connections()
    with pytest.raises(ValueError, match="line breaks"):
        await connections.request("GET", "http://127.0.0.1:1/", {"X-A": "1\r\nX-B: 2"}, b"")
    with pytest.raises(ValueError, match="http"):
        await connections.request("GET", "ftp://127.0.0.1/", {}, b"")
    connections.close()


def test_slow_connects_are_logged(capsys: pytest.CaptureFixture[str]) -> None:
    before = SlowConnects.seen
    SlowConnects()("127.0.0.1:1", 0.01)
    assert SlowConnects.seen == before
    SlowConnects()("127.0.0.1:1", SlowConnects.SLOW_CONNECT_S + 1)
    assert SlowConnects.seen == before + 1


async def test_a_body_in_pieces_arrives_as_them_joined_and_is_signed_as_them_joined(kit: Any) -> None:
    """A body given as pieces (a fragment message's framing and views of its values, `Payload.parts`) is written one
    piece after the other, small ones joined to the head, large ones not copied; it arrives, and is hashed for its
    signature, as the pieces joined."""
    import numpy as np

    from mosaic_proto.auth import body_digest
    from mosaicd.daemon.http.client import hash_body

    seen: list[tuple[Any, bytes, dict[str, str]]] = []
    runner, base = await kit.serve_on_loopback(app_with(seen))
    values = np.arange(3 << 18, dtype=np.float32)  # 3 MiB
    try:
        async with Client(5, 0) as client:
            for parts in ((b"head", memoryview(values[:100]).cast("B")), (b"\x82", memoryview(values).cast("B"),
                                                                          b"tail", memoryview(values[::-1].copy()))):
                joined = b"".join(parts)
                status, answer, _ = await client.request("POST", f"{base}/echo", data=parts,
                                                         headers={"Content-Type": "application/cbor"})
                assert (status, answer) == (200, joined)
                assert seen[-1][2]["Content-Length"] == str(len(joined))
                assert await hash_body(parts) == body_digest(joined)
    finally:
        await runner.cleanup()


async def test_a_message_answered_busy_past_the_clients_retries_is_sent_again_within_the_budget(kit: Any) -> None:
    """A receiver whose large-body budget is taken answers 503 `busy` (http/limits.py, the inbox's decoding slots):
    `send_all` tries again, backing off, until it is taken or the round's budget is spent; not given up after the
    client's few quick retries (which lost a 200 MB message of a 50M-value model: not the models `simulate` gives)."""
    from mosaic_proto import Fragmentation, Layout, PeerSampler, RoundState
    from mosaicd.daemon.node.outbound import send_all
    from mosaicd.logs import get_logger

    answers = {"busy": 5}
    bodies: list[bytes] = []

    async def fragments(request: web.Request) -> web.Response:
        body = await request.read()
        if answers["busy"]:
            answers["busy"] -= 1
            return web.json_response({"reason": "busy", "detail": "try again"}, status=503)
        bodies.append(body)
        return web.json_response({"status": "accepted"})

    app = web.Application(client_max_size=1 << 24)
    app.add_routes([web.post("/v1/fragments", fragments)])
    runner, base = await kit.serve_on_loopback(app)
    fr = Fragmentation.build(Layout.flat(1000), 1, seed=1)
    state = RoundState(node=1, round=0, members=[0, 1], fragmentation=fr, sampler=PeerSampler("local", 1, seed=1),
                       run_id="busy")
    messages = state.outgoing(np.arange(1000, dtype=np.float32))
    try:
        async with Client(timeout=5, retries=1, backoff=0.01) as client:
            delivered, unsent = await send_all(client, 0, messages, [f"{base}/v1/fragments"], get_logger(role="node"),
                                               budget=20.0)
        assert list(delivered) == [0] and unsent == [] and bodies == [messages[0].payload]

        answers["busy"] = 1000  # busy for good: given up when the budget is spent
        async with Client(timeout=5, retries=1, backoff=0.01) as client:
            delivered, unsent = await send_all(client, 0, messages, [f"{base}/v1/fragments"], get_logger(role="node"),
                                               budget=0.5)
        assert delivered == {} and unsent == messages
    finally:
        await runner.cleanup()

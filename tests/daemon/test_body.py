"""Request bodies read once: hashed while they arrive (large batches in a worker thread), the same bytes for
the handler, the cluster secret's check refusing a body that does not match its signed digest."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.auth import body_digest
from mosaicd.daemon.http import body
from mosaicd.daemon.http.auth import Authenticator, Keyring, auth_middleware, signer
from mosaicd.daemon.http.client import Client, HttpError


def echo_app(seen: list[Any], middlewares: list[Any] = ()) -> web.Application:  # type: ignore[assignment]
    async def handler(request: web.Request) -> web.Response:
        first = await body.read_body(request, digest=True)
        again = await request.read()  # aiohttp's cache: the same object, not a copy
        seen.append((first is again, body.body_digest_of(request), len(first)))
        return web.Response(body=hashlib.sha256(first).digest())

    app = web.Application(middlewares=list(middlewares), client_max_size=64 << 20)
    app.router.add_post("/echo", handler)
    return app


@pytest.mark.parametrize("size", [0, 10, (1 << 20) - 1, 5 << 20])
async def test_the_body_is_hashed_while_read_and_kept_once(aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch,
                                                           size: int) -> None:
    monkeypatch.setattr(body, "OFF_LOOP_BYTES", 1 << 15)  # the larger pieces in worker threads, in order
    seen: list[Any] = []
    client = await aiohttp_client(echo_app(seen))
    data = os.urandom(size)
    resp = await client.post("/echo", data=data)
    assert resp.status == 200 and await resp.read() == hashlib.sha256(data).digest()
    assert seen == [(True, body_digest(data), size)]


@pytest.mark.parametrize(("size", "content_type", "kept"), [
    (body.ARRAY_FROM, CONTENT_TYPE, True), (body.ARRAY_FROM - 1, CONTENT_TYPE, False),
    (body.ARRAY_FROM, "application/octet-stream", False)])
async def test_a_large_fragments_message_is_read_into_a_kept_buffer(aiohttp_client: Any, size: int,
                                                                    content_type: str, kept: bool) -> None:
    """A fragments message of ARRAY_FROM bytes or more goes into a buffer the process keeps for the next rounds,
    handed on as a read-only view with the same bytes and digest; smaller ones and other bodies stay `bytes`."""
    seen: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        got = await body.read_body(request, digest=True)
        seen.append((got, body.body_digest_of(request)))
        return web.Response(body=hashlib.sha256(got).digest())

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/echo", handler)
    client = await aiohttp_client(app)
    data = os.urandom(size)
    resp = await client.post("/echo", data=data, headers={"Content-Type": content_type})
    assert resp.status == 200 and await resp.read() == hashlib.sha256(data).digest()
    got, digest = seen[0]
    assert isinstance(got, memoryview) is kept and bytes(got) == data and digest == body_digest(data)
    if kept:
        assert got.readonly


@pytest.mark.parametrize(("size", "content_type", "viewed"), [
    (body.RESERVE_AFTER + 1, CONTENT_TYPE, True), (body.RESERVE_AFTER + 1, "application/octet-stream", True),
    (body.RESERVE_AFTER + 1, "application/json", False), (body.RESERVE_AFTER, CONTENT_TYPE, False)])
async def test_a_large_chunked_binary_body_is_read_into_a_mapping_of_its_own(aiohttp_client: Any, size: int,
                                                                           content_type: str, viewed: bool) -> None:
    """A chunked body (its size unknown until its end) past RESERVE_AFTER, of a type its handler takes as any buffer,
    is read into a mapping and handed on as a read-only view of it, with the same bytes and digest; a JSON one and
    a small one stay `bytes`."""
    seen: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        got = await body.read_body(request, digest=True)
        seen.append((got, body.body_digest_of(request), request.content_length))
        return web.Response(body=hashlib.sha256(got).digest())

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/echo", handler)
    client = await aiohttp_client(app)
    data = os.urandom(size)

    async def pieces() -> Any:
        for at in range(0, size, 100_000):
            yield data[at:at + 100_000]

    resp = await client.post("/echo", data=pieces(), headers={"Content-Type": content_type})
    assert resp.status == 200 and await resp.read() == hashlib.sha256(data).digest()
    got, digest, declared = seen[0]
    assert declared is None  # sent chunked
    assert isinstance(got, memoryview) is viewed and bytes(got) == data and digest == body_digest(data)
    if viewed:
        assert got.readonly


def test_a_kept_buffer_is_handed_out_again_only_when_nothing_views_it() -> None:
    """The pool's one rule: a buffer is written over only where nothing refers to it (a fragment decoded from an
    earlier message is a view of its buffer); a full pool replaces a free buffer; past its bytes it keeps none."""
    def at(array: np.ndarray) -> int:
        return array.__array_interface__["data"][0]

    pool = body.BodyBuffers(kept=2, kept_bytes=12 << 20)
    first = pool.take(5 << 20)
    place = at(first)
    fragment = np.frombuffer(memoryview(first[:64].view()).toreadonly()[8:48], np.float32)  # as `wire.decode` does
    del first
    second = pool.take(5 << 20)
    assert at(second) != place and pool.held == 10 << 20  # the first is still viewed: a new one, kept
    assert pool.in_use() == [5 << 20, 5 << 20]
    del second
    del fragment
    assert pool.in_use() == []
    again = pool.take(5 << 20)
    assert at(again) == place  # nothing views it any more
    small = pool.take(1 << 20)  # the second buffer, free and large enough: what it holds does not grow
    assert pool.held == 10 << 20 and len(small) == 5 << 20
    large = pool.take(8 << 20)  # none free: handed out, not kept
    assert pool.held == 10 << 20 and len(large) == 8 << 20
    del small, large, again
    assert pool.take(6 << 20) is not None and pool.held == 11 << 20  # a buffer too small is replaced
    assert pool.take(2 << 20) is not None and pool.held == 11 << 20


def test_a_buffer_spans_the_largest_message_and_holds_what_was_written() -> None:
    """Messages of a K > 1 round differ in size: a buffer made for a small one serves a larger one later (it spans
    `room`), the free buffer already written as far as a message is the one handed out (no page to fault in), and
    the pool counts the pages written, not the span."""
    def at(array: np.ndarray) -> int:
        return array.__array_interface__["data"][0]

    pool = body.BodyBuffers(kept=4, kept_bytes=20 << 20)
    small = pool.take(2 << 20, room=9 << 20)
    wide = pool.take(7 << 20, room=9 << 20)
    assert len(small) == len(wide) == 9 << 20 and pool.held == 9 << 20
    places = at(small), at(wide)
    del small, wide
    assert at(pool.take(6 << 20, room=9 << 20)) == places[1]  # written as far already: no new page
    assert pool.held == 9 << 20
    assert at(pool.take(8 << 20, room=9 << 20)) == places[1]  # none written so far: the one written furthest
    assert pool.held == 10 << 20
    assert at(pool.take(3 << 20, room=9 << 20)) == places[1]  # the smallest written as far: the first
    assert len(pool.take(64 << 20, room=64 << 20)) == 64 << 20 and pool.held == 10 << 20  # past the bytes: not kept


async def test_signed_bodies_pass_and_a_changed_body_is_refused(aiohttp_client: Any) -> None:
    secret = b"s" * 32
    keyring = Keyring(secret)

    async def run_of(request: web.Request) -> str:
        return "run"

    seen: list[Any] = []
    guard = auth_middleware(Authenticator(keyring, run_of, 60.0, CollectorRegistry()))
    server = await aiohttp_client(echo_app(seen, [guard]))
    url = str(server.make_url("/echo"))
    sign = signer(lambda: keyring.credentials("run"), lambda: "3")
    data = os.urandom(3 << 20)
    async with Client(timeout=10, retries=0, signer=sign) as client:
        status, answer, _ = await client.request("POST", url, data=data)
    assert status == 200 and answer == hashlib.sha256(data).digest()
    assert seen == [(True, body_digest(data), len(data))]

    tampered = {**sign("POST", url, data, 0), "X-Mosaic-Nonce": "n" * 16}
    resp = await server.post("/echo", data=data, headers=tampered)  # the tag no longer matches
    assert resp.status == 401 and (await resp.json())["reason"] == "bad_tag"
    headers = sign("POST", url, data, 0)
    resp = await server.post("/echo", data=data[:-1] + bytes([data[-1] ^ 1]), headers=headers)  # last byte changed
    assert resp.status == 401 and (await resp.json())["reason"] == "bad_body"
    assert len(seen) == 1
    with pytest.raises(HttpError):  # signed for another run: 401 wrong_run
        async with Client(timeout=10, retries=0, signer=signer(lambda: keyring.credentials("other"), lambda: "3")) \
                as client:
            await client.request("POST", url, data=data)

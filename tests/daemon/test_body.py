"""Request bodies read once: hashed while they arrive (large batches in a worker thread), the same bytes for
the handler, the cluster secret's check refusing a body that does not match its signed digest."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from mosaic_proto.auth import body_digest
from mosaicd.daemon.http import body
from mosaicd.daemon.http.auth import Keyring, auth_middleware, signer
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


async def test_signed_bodies_pass_and_a_changed_body_is_refused(aiohttp_client: Any) -> None:
    secret = b"s" * 32
    keyring = Keyring(secret)

    async def run_of(request: web.Request) -> str:
        return "run"

    seen: list[Any] = []
    server = await aiohttp_client(echo_app(seen, [auth_middleware(keyring, run_of, 60.0, CollectorRegistry())]))
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

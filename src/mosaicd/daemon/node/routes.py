"""A node's HTTP API over its `Inbox` (input checks and status codes; the state is the node's `NodeState`)."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

from aiohttp import web

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.async_node import SyncMode
from mosaicd.daemon.http.auth import REGISTER_RUN, SENDER
from mosaicd.daemon.http.body import read_body as _read_body
from mosaicd.daemon.http.endpoints import member_app
from mosaicd.daemon.http.errors import bad_request
from mosaicd.daemon.http.limits import Limits, refusal
from mosaicd.daemon.http.model_codec import encode_model
from mosaicd.daemon.http.stream import FragmentsStreams
from mosaicd.daemon.node.inbox import Inbox

_ROUND = re.compile(r"-?[0-9]{1,18}")


async def read_body(request: web.Request, limit: int | None = None) -> bytes | memoryview:
    """The request's body, held once (`http.body.read_body`: `bytes`, or a read-only view of a large message's kept
    buffer), read up to `limit` bytes at most; a body the cluster secret's check read and hashed already comes from
    aiohttp's cache, not copied again."""
    return await _read_body(request, limit=limit)


def node_document(sync: SyncMode) -> bytes:
    """The node's OpenAPI document as a node of `sync` serves it: without the paths marked for the other kind
    (`x-mosaic-sync`, left out too), so that it names exactly that node's routes."""
    document = json.loads((Path(__file__).parent / "openapi.json").read_text())
    document["paths"] = {path: {k: v for k, v in item.items() if k != "x-mosaic-sync"}
                         for path, item in document["paths"].items()
                         if item.get("x-mosaic-sync", sync.value) == sync.value}
    return json.dumps(document, indent=2).encode()


def node_app(inbox: Inbox) -> web.Application:
    async def fragments(request: web.Request) -> web.Response:
        if request.content_type != CONTENT_TYPE:
            raise bad_request("unsupported_media_type", f"expected {CONTENT_TYPE}, got {request.content_type}", 415)
        oversized = inbox.oversized(request.content_length)
        if oversized is not None:  # not read: the connection is closed instead of drained
            return refusal(413, "too_large", oversized, close=True)
        limit = inbox.message_limit()
        try:
            body = await read_body(request, limit)
        except web.HTTPRequestEntityTooLarge as exc:  # chunked: cut where it passed the limit, not read on
            detail = inbox.oversized(limit, passed=True) if limit is not None else None
            return refusal(413, "too_large", detail or exc.text or "too large", close=True)
        status, answer = await inbox.receive(body, request.get(SENDER))
        return web.json_response(answer, status=status)

    async def model(request: web.Request) -> web.Response:
        raw = request.query.get("round")
        if raw is not None and not _ROUND.fullmatch(raw):  # ASCII digits, one sign at most: int() takes more
            raise bad_request("bad_round", f"round must be an integer, got {raw!r}")
        kept = inbox.state.model(None if raw is None else int(raw))
        if kept is None or inbox.layout is None:
            if raw is None:
                raise bad_request("no_model", "this node has no model yet", 404)
            raise bad_request("no_snapshot", f"no model kept for round {raw} (have {sorted(inbox.state.snapshots)})",
                              404)
        round, vector = kept
        metrics = await inbox.metrics_of(round)
        return web.Response(body=encode_model(inbox.state.rank, round, inbox.layout, vector, metrics),
                            content_type="application/cbor")

    async def status(request: web.Request) -> web.Response:
        return web.json_response(inbox.status())

    async def run_of(request: web.Request) -> str | None:
        return REGISTER_RUN if request.path.endswith("/v1/register") else await inbox.run_of()

    streams = FragmentsStreams(inbox.receive, inbox.oversized, inbox.message_limit, inbox.options.header_timeout,
                               inbox.metrics.registry)
    return member_app([web.post("/v1/fragments", fragments), web.get("/v1/status", status),
                       web.get("/v1/model", model)],
                      options=inbox.options, keyring=inbox.keyring, run_of=run_of, registry=inbox.metrics.registry,
                      limits=Limits(inbox.options, inbox.metrics.registry), max_body=inbox.options.max_body_bytes,
                      openapi=partial(node_document, SyncMode.BARRIER), streams=streams)

"""The HTTP face of an asynchronous node (`async_member.AsyncNode`): its routes read the request, hand the node what
came in and answer what it decided; the node's state is never written here."""

from __future__ import annotations

import json
from functools import partial

from aiohttp import web

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.async_node import SyncMode
from mosaic_proto.barrier_rules import ended_status
from mosaicd.daemon.http.auth import SENDER
from mosaicd.daemon.http.endpoints import member_app
from mosaicd.daemon.http.limits import Limits
from mosaicd.daemon.http.pages import dashboard_routes
from mosaicd.daemon.http.stream import FragmentsStreams
from mosaicd.daemon.node.async_member import PAIR_SENDER, PAIR_STEP, AsyncNode
from mosaicd.daemon.node.routes import node_document, read_body

# POST /v1/async/end's body is at most {"interrupted": reason}: a longer one is refused (413) as it passes this, not
# read whole up to --max-body-bytes
END_BODY_BYTES = 4 << 10


def async_app(node: AsyncNode) -> web.Application:
    """The node's server: POST /v1/fragments (or its messages as frames on GET /v1/fragments/stream, as a barrier
    node's), /v1/pair, /v1/async/result, /v1/async/end, GET /v1/status and the dashboard, behind the member's auth
    and limits."""
    async def fragments(request: web.Request) -> web.Response:
        if request.content_type != CONTENT_TYPE:
            return web.json_response({"reason": "unsupported_media_type", "detail": f"expected {CONTENT_TYPE}, "
                                      f"got {request.content_type}"}, status=415)
        body = await read_body(request, node.max_bytes)
        answer, status = node.receive(body, request.get(SENDER))
        return web.json_response(answer, status=status)

    async def pair(request: web.Request) -> web.Response:
        body = await read_body(request, 4 * node.state.vector.size)
        said = request.headers.get(PAIR_SENDER, "")  # who it is, where no signature proves it (--insecure)
        proved = request.get(SENDER, int(said) if node.keyring is None and said.isdigit() else None)
        answer, status = node.pair(body, request.headers.get(PAIR_STEP, ""), proved)
        if isinstance(answer, bytes):
            return web.Response(body=answer, content_type="application/octet-stream")
        return web.json_response(answer, status=status)

    async def status(request: web.Request) -> web.Response:  # any origin may read it: the dashboard of a member
        return web.json_response(node.status(), headers={"Access-Control-Allow-Origin": "*"})

    async def result(request: web.Request) -> web.Response:
        """The collector (rank 0 of a peer list, or the barrier) fetches the node's report (POST: signed, only
        it may read its model)."""
        if node.keyring is not None and str(request.get(SENDER)) != node.collector:
            return web.json_response({"reason": "refused", "detail": f"only {node.collector_name} collects "
                                      "reports"}, status=403)
        if node.result is None:
            return web.json_response({"reason": "running", "detail": f"{node.state.step} of "
                                      f"{node.run.rounds} iterations done"}, status=409)
        return web.Response(body=node.result, content_type="application/octet-stream")

    async def end(request: web.Request) -> web.Response:
        """The collector wrote the run's summary, or ({"interrupted": reason}) was told to stop (`RunStop`)."""
        if node.keyring is not None and str(request.get(SENDER)) != node.collector:
            return web.json_response({"reason": "refused", "detail": f"only {node.collector_name} ends the "
                                      "run"}, status=403)
        try:
            reason = interruption_of(await read_body(request, END_BODY_BYTES))
        except ValueError as exc:
            return web.json_response({"reason": "malformed", "detail": str(exc)}, status=400)
        return web.json_response(node.stop.told(reason, node.ended))

    async def run_of(request: web.Request) -> str | None:
        return node.run.run_id

    streams = FragmentsStreams(node.received, node.oversized, lambda: node.max_bytes, node.options.header_timeout,
                               node.metrics.registry)
    return member_app([web.post("/v1/fragments", fragments), web.post("/v1/pair", pair),
                       web.get("/v1/status", status), web.post("/v1/async/result", result),
                       web.post("/v1/async/end", end), *dashboard_routes()],
                      options=node.options, keyring=node.keyring, run_of=run_of, registry=node.metrics.registry,
                      limits=Limits(node.options, node.metrics.registry), max_body=node.options.max_body_bytes,
                      openapi=partial(node_document, SyncMode.ASYNC), streams=streams)


def interruption_of(body: bytes | memoryview) -> str | None:
    """POST /v1/async/end's body: none (the run ended), or {"interrupted": reason} (ValueError: anything else)."""
    try:
        told = json.loads(bytes(body)) if body else {}  # bytes: json.loads takes no memoryview
    except ValueError:
        told = None
    if told == {}:
        return None
    reason = told.get("interrupted") if isinstance(told, dict) and set(told) == {"interrupted"} else None
    if not (isinstance(reason, str) and ended_status(reason) == "interrupted"):
        raise ValueError('expected no body, or {"interrupted": "interrupted (...)"}')
    return reason

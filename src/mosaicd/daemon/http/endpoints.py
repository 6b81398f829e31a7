"""What every member's HTTP application has alike: /metrics, /openapi.json and /healthz, and the middlewares."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from mosaic_proto.frames import STREAM_PATH
from mosaicd.daemon.http.auth import AUTHENTICATOR, Authenticator, Keyring, auth_middleware, auth_window
from mosaicd.daemon.http.errors import Handler, json_errors
from mosaicd.daemon.http.limits import LIMITS, Limits

if TYPE_CHECKING:
    from mosaicd.daemon.http.stream import FragmentsStreams
    from mosaicd.settings import DaemonOptions


class WithoutCreated:
    """A registry's metrics less the `_created` series of counters and histograms: Prometheus needs none, and
    they would double the series count. Only this registry's, unlike prometheus_client's process-wide switch."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s for s in family.samples if s.name != f"{family.name}_created"]
            yield copy


def metrics_handler(registry: CollectorRegistry) -> Handler:
    exposed = WithoutCreated(registry)

    async def metrics(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(exposed))  # type: ignore[arg-type]
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp
    return metrics


def openapi_handler(document: Path | Callable[[], bytes]) -> Handler:
    """GET /openapi.json: the API's OpenAPI 3 document (package data beside the role's routes, or what makes its
    bytes), read or made at the first request: a cluster's every node would pay for it at its start otherwise."""
    made: list[bytes] = []

    async def openapi(request: web.Request) -> web.Response:
        if not made:
            made.append(document.read_bytes() if isinstance(document, Path) else document())
        return web.Response(body=made[0], content_type="application/json")
    return openapi


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def member_app(routes: list[web.RouteDef], *, options: DaemonOptions, keyring: Keyring | None,
               run_of: Callable[[web.Request], Awaitable[str | None]], registry: CollectorRegistry, limits: Limits,
               max_body: int, openapi: Path | Callable[[], bytes],
               on_refused: Callable[[str, web.Request], None] | None = None,
               streams: FragmentsStreams | None = None) -> web.Application:
    """A member's application: its `routes` and the endpoints every member serves, behind the middlewares in
    their order: errors as JSON, then the limits (bodies, before the guard reads them), then the cluster secret's
    guard (with a `keyring`: http/auth.py). A node's `streams`: GET /v1/fragments/stream, ended as the app stops."""
    authenticator = Authenticator(keyring, run_of, auth_window(options), registry, on_refused) if keyring else None
    guard = [auth_middleware(authenticator)] if authenticator else []
    app = web.Application(middlewares=[json_errors, *limits.middlewares, *guard], client_max_size=max_body)
    app[LIMITS] = limits
    if authenticator is not None:
        app[AUTHENTICATOR] = authenticator
    app.add_routes([*routes, web.get("/metrics", metrics_handler(registry)), web.get("/healthz", healthz),
                    web.get("/openapi.json", openapi_handler(openapi))])
    if streams is not None:
        app.router.add_get(STREAM_PATH, streams.handle)
        app.on_shutdown.append(streams.close)
    return app

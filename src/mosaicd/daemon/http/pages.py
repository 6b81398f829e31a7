"""The live dashboard's files (`dashboard/`): the barrier serves it at `/`, and so does an asynchronous node (no
barrier there); the page reads `v1/status` and tells the two apart by its `sync`."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from mosaicd.daemon.http.errors import bad_request

DASHBOARD = Path(__file__).parent / "dashboard"
# the files /dashboard/{name} serves, and nothing else: name -> content type
DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
                   "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain"}


def dashboard_file(name: str, content_type: str) -> web.Response:
    """One file of the dashboard folder (tens of kB at most; read per request, so an edit shows on reload)."""
    return web.Response(body=(DASHBOARD / name).read_bytes(), content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def dashboard(request: web.Request) -> web.Response:
    """GET /: the page."""
    return dashboard_file("index.html", "text/html")


async def dashboard_asset(request: web.Request) -> web.Response:
    """GET /dashboard/{name}: one of DASHBOARD_FILES."""
    name = request.match_info["name"]
    if name not in DASHBOARD_FILES:
        raise bad_request("not_found", f"no dashboard file {name!r}", 404)
    return dashboard_file(name, DASHBOARD_FILES[name])


def dashboard_routes() -> list[web.RouteDef]:
    return [web.get("/", dashboard), web.get("/dashboard/{name}", dashboard_asset)]

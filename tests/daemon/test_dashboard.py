"""The barrier's live dashboard (`GET /`) in a real headless browser during a loopback run, and the inputs of
`GET /v1/history`, the page's data.

The browser test needs Debian's `chromium` and `chromium-driver` and the `selenium` package (the `test` extra).
`.ci/run` installs both packages and sets MOSAIC_REQUIRE_BROWSER=1, so that there a missing browser fails the test
instead of skipping it. MOSAIC_SCREENSHOT=1 writes the screenshot to docs/dashboard.png (the README's picture).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from mosaicd import Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.release_log import HISTORY_KEPT
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.http.pages import DASHBOARD
from mosaicd.experiments.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
# read at import: the autouse fixture `_no_mosaic_env` clears MOSAIC_* variables before each test
SCREENSHOT = os.environ.get("MOSAIC_SCREENSHOT") == "1"
# 0.05 s a round's training at least (PACE_S, kit.pace: 150 bare rounds took 2 s on 2 shared cores, less on a fast
# host, which could end the run before the browser has the page); heterogeneous optima keep consensus distance and
# node spread above zero, so every chart has something to draw
PACE_S = 0.05
QUADRATIC = dict(nodes=4, rounds=150, fragments=4, fanout=2, dim=256, eval_every=3, heterogeneous=True, seed=1)
# the README's picture (MOSAIC_SCREENSHOT=1): a digits run on non-iid data (the `learning` extra), so that the page
# shows accuracy and a spread between nodes
DIGITS = dict(task="digits", nodes=6, rounds=200, fragments=4, fanout=2, eval_every=4, partition="dirichlet",
              alpha=0.5, seed=1)
RUN: dict[str, Any] = DIGITS if SCREENSHOT else QUADRATIC


@pytest.fixture
def cluster(tmp_path: Path, kit: Any) -> Iterator[Cluster]:
    """A loopback run in a background thread; the test reads `cluster.barrier_port`."""
    cluster = Cluster(Settings(**RUN, node_profile=kit.pace(tmp_path, PACE_S), out=tmp_path / "run"), progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=300)

    def barrier_up() -> bool:
        if "error" in result:
            raise result["error"]
        if not cluster.barrier_port:
            return False
        try:
            return kit.http("GET", f"http://127.0.0.1:{cluster.barrier_port}/healthz", timeout=2).status == 200
        except OSError:  # not listening yet
            return False

    try:
        kit.wait_until(barrier_up, 120, "the barrier to answer /healthz")
        yield cluster
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not end"
    if "error" in result:
        raise result["error"]
    assert result["summary"]["dropped"] == []


PAGE_STATE = """
const d = window.mosaicDashboard, table = document.getElementById("node-table");
if (!d) return null;
const points = (name) => (d.charts[name] ? d.charts[name].data[0].length : 0);
return {rows: table.tBodies[0].rows.length, ranks: [...table.tBodies[0].rows].map((r) => Number(r.dataset.rank)),
        round: Number(document.getElementById("round").textContent) || 0,
        phase: document.getElementById("phase").textContent,
        connection: document.getElementById("connection").textContent,
        accuracy: points("accuracy"), consensus: points("consensus"), spread: points("spread"), loss: points("loss"),
        duration: points("duration"), stragglers: points("stragglers"),
        drawn: Number(document.getElementById("chart-accuracy").dataset.points || 0),
        canvases: document.querySelectorAll("#chart-accuracy canvas").length,
        metric: document.getElementById("metric-header").textContent,
        cells: [...table.tBodies[0].rows].map((r) => [...r.cells].map((c) => c.textContent))};
"""


@pytest.mark.browser
@pytest.mark.slow  # a 5-process loopback run and a browser: ~15 s on 2 idle cores, more on a busy machine
def test_dashboard_fills_in_during_a_run(browser: Any, cluster: Cluster, kit: Any, tmp_path: Path) -> None:
    n = RUN["nodes"]
    browser.get(f"http://127.0.0.1:{cluster.barrier_port}/")
    assert browser.title == "Mosaic run"

    def page() -> dict[str, Any] | None:
        return browser.execute_script(PAGE_STATE)

    def filled(view: dict[str, Any] | None) -> dict[str, Any] | None:
        return view if view and view["rows"] == n and view["accuracy"] > 0 and view["drawn"] > 0 else None

    first = kit.wait_until(lambda: filled(page()), 120, f"a node table of {n} rows and a drawn accuracy chart",
                           interval=0.2)
    assert first["ranks"] == list(range(n)) and first["canvases"] == 1
    assert first["metric"] == ("accuracy" if RUN is DIGITS else "loss")  # the task's metric names the column
    # the page keeps up with the run: a later view has more rounds and more evaluations
    later = kit.wait_until(lambda: (v := filled(page())) and v["round"] > first["round"]
                           and v["accuracy"] > first["accuracy"] and v, 60, "the page to follow the run", interval=0.2)
    assert later["consensus"] == later["spread"] == later["loss"] == later["accuracy"] and later["duration"] > 0
    assert all(row[6] != "–" for row in later["cells"]), later["cells"]  # every node's latest metric
    # a screenshot with most of the run drawn (the README's picture under MOSAIC_SCREENSHOT=1); the barrier exits
    # once its last evaluation is written, and the page then says so
    evaluations = RUN["rounds"] // RUN["eval_every"]
    kit.wait_until(lambda: (v := page()) and (v["accuracy"] >= 0.9 * evaluations or "exited" in v["connection"]), 120,
                   "most of the run's evaluations on the page", interval=0.2)
    shot = ROOT / "docs" / "dashboard.png" if SCREENSHOT else tmp_path / "dashboard.png"
    # the whole page: the window as tall as the page, plus the browser's own frame
    height = browser.execute_script("return document.documentElement.scrollHeight + outerHeight - innerHeight")
    browser.set_window_size(1280, min(height, 2000))
    assert browser.save_screenshot(str(shot)), "screenshot failed"
    assert shot.stat().st_size > 10_000
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE" and e.get("source") == "javascript"]
    assert not errors, errors


async def test_history_and_dashboard_routes(tmp_path: Path, aiohttp_client: Any) -> None:
    """Plain HTTP, in process: /v1/history's `since` and bound, NaN as null; the page and its allow-listed files."""
    settings = Settings(nodes=4, rounds=3000, register_deadline=60, out=tmp_path / "barrier", insecure=True)
    barrier = Barrier(settings.run_config(), settings.daemon_options(), secret=Secret.of(settings))
    client = await aiohttp_client(barrier_app(barrier))

    async def get(path: str) -> tuple[int, str, bytes]:
        async with client.get(path) as resp:
            return resp.status, resp.content_type, await resp.read()

    for since in ("-1", "x", "1.5", "", "%EF%BC%91", "9" * 40, "0x10", "+1", "1%20"):
        status, kind, body = await get(f"/v1/history?since={since}")
        assert status == 400 and kind == "application/json", (since, status, body)
        assert json.loads(body)["reason"] == "bad_since", since
    assert json.loads((await get("/v1/history"))[2]) == {"rounds": [], "evaluations": []}

    barrier.history.extend({"round": t, "duration_s": 0.1, "stragglers": [], "dropped": []} for t in range(2500))
    barrier.recorder.rounds.extend({"round": t, "node_average": math.nan, "per_node": [1.0, 2.0], "nodes": [0, 1]}
                                   for t in range(0, 2500, 2))
    body = json.loads((await get("/v1/history?since=2490"))[2])
    assert [r["round"] for r in body["rounds"]] == list(range(2490, 2500))
    assert [r["round"] for r in body["evaluations"]] == [2490, 2492, 2494, 2496, 2498]
    assert body["evaluations"][0]["node_average"] is None and body["evaluations"][0]["per_node"] == [1.0, 2.0]
    body = json.loads((await get("/v1/history?since=0"))[2])  # bounded: the newest HISTORY_KEPT of each
    assert [r["round"] for r in body["rounds"]] == list(range(2500 - HISTORY_KEPT, 2500))
    assert len(body["evaluations"]) == 1250 and body["evaluations"][0]["round"] == 0
    assert json.loads((await get("/v1/history?since=2500"))[2]) == {"rounds": [], "evaluations": []}

    status, kind, body = await get("/")
    assert status == 200 and kind == "text/html" and b'id="node-table"' in body and b'id="chart-accuracy"' in body
    for name, wanted in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                         ("uPlot.iife.min.js", "text/javascript"), ("uPlot.min.css", "text/css"),
                         ("uPlot.LICENSE", "text/plain")):
        status, kind, body = await get(f"/dashboard/{name}")
        assert status == 200 and kind == wanted and body, name
    for name in ("index.html", "VENDORED.md", "..%2Fbarrier.py", "nope.js", "barrier.py"):
        status, kind, _ = await get(f"/dashboard/{name}")
        assert status == 404 and kind == "application/json", name
    status, _, body = await get("/v1/status")
    assert status == 200 and json.loads(body)["phase"] == "registering"


async def test_dashboard_works_under_a_prefix(tmp_path: Path, aiohttp_client: Any) -> None:
    """With --peer-list, rank 0 serves the barrier under /barrier/: the page refers to its files and the API by
    relative URLs, so that they resolve there too."""
    settings = Settings(nodes=4, register_deadline=60, out=tmp_path / "barrier", insecure=True)
    outer = web.Application()
    outer.add_subapp("/barrier", barrier_app(Barrier(settings.run_config(), settings.daemon_options(),
                                                     secret=Secret.of(settings))))
    client = await aiohttp_client(outer)
    async with client.get("/barrier/") as resp:
        assert resp.status == 200
        page = await resp.text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(not ref.startswith("/") for ref in refs), refs
    for ref in refs:
        if not ref.startswith("data:"):
            async with client.get(f"/barrier/{ref}") as resp:
                assert resp.status == 200, ref
    script = (DASHBOARD / "dashboard.js").read_text()
    assert 'getJSON("v1/status")' in script and "getJSON(`v1/history?since=" in script
    async with client.get("/barrier/v1/history?since=0") as resp:
        assert resp.status == 200 and await resp.json() == {"rounds": [], "evaluations": []}

"""What a person sees of an asynchronous run while it goes (issue 60, item 4): `mosaicd status` and the dashboard,
from any node of a real `cluster --sync async` on loopback (there is no barrier): each node's steps, its inbox and
outgoing queue depths, and the staleness of its last aggregation (`AsyncNodeStatus`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mosaicd.cli import main
from mosaicd.experiments.cluster_async import AsyncCluster
from mosaicd.settings import Settings
from mosaicd.status import cluster_view, folder_view, render_async

# ~0.1 s an iteration (the profile's compute_s): 120 iterations are about 12 s of training, so that a status read
# mid-run sees the fields move even on a loaded host
RUN = dict(sync="async", task="quadratic", nodes=3, rounds=120, fragments=4, fanout=2, eval_every=10, seed=1)
PROFILE = "compute_s = 0.1\n"
# nodes 0 and 1 do their 120 iterations in about 12 s; node 2, 4x slower, about 62 before the 25 s budget ends them:
# for about 13 s the first two are finished by their iterations while node 2 trains on
UNEVEN = {"profile": PROFILE + "[nodes.2]\nslowdown = 4\n", "time_budget": 25.0}


@pytest.fixture
def running(request: pytest.FixtureRequest, tmp_path: Path, kit: Any) -> Iterator[str]:
    """An asynchronous cluster running in a background thread: node 0's URL once it answers (indirect parameter:
    {"profile": its --node-profile, other settings over RUN})."""
    given = dict(getattr(request, "param", {}))
    (tmp_path / "profile.toml").write_text(given.pop("profile", PROFILE))
    cluster = AsyncCluster(Settings.load(**{**RUN, **given}, node_profile=tmp_path / "profile.toml",
                                         out=tmp_path / "run"), progress=False)
    thread, result = kit.run_in_thread(cluster, timeout=240)
    roster = tmp_path / "run" / "roster.json"

    def up() -> str | None:
        if "error" in result:
            raise result["error"]
        if not roster.exists():
            return None
        url = f"http://{json.loads(roster.read_text())['addresses'][0]}"
        try:
            return url if kit.http("GET", f"{url}/healthz", timeout=2).status == 200 else None
        except OSError:  # not listening yet
            return None

    try:
        yield kit.wait_until(up, 120, "node 0 to answer /healthz")
    finally:
        thread.join(timeout=240)
    assert not thread.is_alive(), "the run did not end"
    if "error" in result:
        raise result["error"]
    assert result["summary"]["status"] == "finished"


@pytest.mark.slow  # a 4-process loopback run: ~20 s on 2 busy cores
def test_status_of_an_asynchronous_run_moves_while_it_trains(running: str, kit: Any, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    views: list[dict[str, Any]] = []

    def training_view() -> dict[str, Any] | None:
        view = cluster_view(running, timeout=5)
        views.append(view)
        rows = view["nodes"]
        return view if all(r["reachable"] and r["phase"] == "training" and r["steps"] >= 2 for r in rows) else None

    first = kit.wait_until(training_view, 120, "every node training past its second step", interval=0.1)
    assert first["sync"] == "async" and [r["rank"] for r in first["nodes"]] == [0, 1, 2]
    assert first["run"]["settings"]["fragments"] == 4 and first["run"]["exchange"] == "push"
    for row in first["nodes"]:
        assert row["iterations"] == 120 and len(row["inbox_per_fragment"]) == 4
        assert row["inbox"] == sum(row["inbox_per_fragment"]) and row["queue"] >= 0 and row["queue_fragments"] >= 0
        assert row["copies"] is not None and row["steps_per_s"] > 0  # it has aggregated (its step >= 2)
    with pytest.raises(SystemExit) as exited:  # the table, from any node
        main(["status", running])
    assert exited.value.code == 0
    table = capsys.readouterr().out
    assert "asynchronous (push)" in table and "lag" in table and "inbox" in table

    later = kit.wait_until(lambda: (v := cluster_view(running, timeout=5)) and views.append(v) is None and all(
        b["steps"] > a["steps"] and b["sent"] > a["sent"] for a, b in zip(first["nodes"], v["nodes"], strict=True))
        and v, 120, "every node's steps and sends to move on", interval=0.1)
    # the copies each node averaged came from the others: their lag and wait are measured
    seen = [r for v in [*views, later] for r in v["nodes"] if r["copies"]]
    assert seen and all(r["lag_steps_max"] is not None and r["wait_s_max"] >= 0 for r in seen)
    assert any(r["inbox"] for v in views for r in v["nodes"]) or any(r["queue"] for v in views for r in v["nodes"])
    done = kit.wait_until(lambda: (v := cluster_view(running, timeout=5)) and all(  # a finished node's queue drains
        r["phase"] == "finished" and r["queue"] == 0 for r in v["nodes"]) and v, 120, "every node to finish and "
        "send its queue")
    assert [r["steps"] for r in done["nodes"]] == [120, 120, 120]
    assert [r["stopped_by"] for r in done["nodes"]] == ["iterations"] * 3  # not its --time-budget: it has none
    console = Console(record=True, width=240)
    console.print(render_async(done))
    assert console.export_text().count("finished (iterations)") == 3
    # the run's folder, once it is over: each node's iterations in the rounds' place
    summary = tmp_path / "run" / "summary.json"
    kit.wait_until(lambda: summary.exists() and json.loads(summary.read_text()).get("status") == "finished", 120,
                   "the run's summary")
    over = folder_view(tmp_path / "run")
    assert over["barrier"]["round"] == 120 and [r["round"] for r in over["nodes"]] == [120] * 3


PAGE_STATE = """
const d = window.mosaicDashboard, table = document.getElementById("node-table");
if (!d || !d.status) return null;
const points = (name) => (d.charts[name] ? d.charts[name].data[0].length : 0);
return {rows: table.tBodies[0].rows.length, ranks: [...table.tBodies[0].rows].map((r) => Number(r.dataset.rank)),
        header: [...document.getElementById("node-header").cells].map((c) => c.textContent),
        slowest: Number(document.getElementById("round").textContent) || 0,
        phase: document.getElementById("phase").textContent,
        barrierCharts: document.getElementById("barrier-charts").hidden,
        steps: points("steps"), depths: points("depths"), lag: points("lag"),
        series: d.charts.steps ? d.charts.steps.series.length : 0,
        cells: [...table.tBodies[0].rows].map((r) => [...r.cells].map((c) => c.textContent))};
"""


@pytest.mark.browser
@pytest.mark.slow  # a 4-process loopback run of 25 s and a browser: ~35 s on 2 busy cores
@pytest.mark.parametrize("running", [UNEVEN], indirect=True, ids=["uneven"])
def test_the_dashboard_of_an_asynchronous_node_shows_every_node(browser: Any, running: str, kit: Any) -> None:
    """Node 0 serves the page; the page reads every member's /v1/status (another origin: another port), and shows
    what ended a finished node's iterations as `mosaicd status` does."""
    browser.get(f"{running}/")
    assert browser.title == "Mosaic run"

    def page() -> dict[str, Any] | None:
        return browser.execute_script(PAGE_STATE)

    first = kit.wait_until(lambda: (v := page()) and v["rows"] == 3 and v["steps"] > 0
                           and all(c[2] == "training" for c in v["cells"]) and v, 120,
                           "a table of 3 training nodes and a steps chart", interval=0.2)
    assert first["ranks"] == [0, 1, 2] and first["barrierCharts"] is True and first["series"] == 4  # x + 3 nodes
    assert first["header"][:7] == ["rank", "address", "state", "steps", "steps/s", "inbox (oldest)",
                                   "queue (fragments)"] and "lag mean / max" in first["header"]
    later = kit.wait_until(lambda: (v := page()) and v["slowest"] > first["slowest"] and v["steps"] > first["steps"]
                           and v, 120, "the page to follow the nodes' steps", interval=0.2)
    assert later["depths"] == later["lag"] == later["steps"]
    assert all(c[7] != "–" for c in later["cells"]), later["cells"]  # each node's last aggregation's copies
    assert later["header"][-1] == "refused (max-norm)" and {c[-1] for c in later["cells"]} == {"0 (0)"}
    ended = kit.wait_until(lambda: (v := page()) and [c[2] for c in v["cells"][:2]] == ["finished (iterations)"] * 2
                           and v, 120, "nodes 0 and 1 shown finished by their iterations", interval=0.2)
    assert [c[3] for c in ended["cells"][:2]] == ["120 / 120"] * 2
    # node 2 trains on until the budget ends it (the run ends soon after: the page may not see it finished)
    assert ended["cells"][2][2] in ("training", "finished (budget)"), ended["cells"]
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE" and e.get("source") == "javascript"]
    assert not errors, errors

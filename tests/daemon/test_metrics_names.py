"""/metrics of a real node and barrier follow Prometheus conventions, and the Grafana dashboard asks only for metrics
that they serve.

A small loopback run (an in-process barrier that evaluates every round, three `Peer`s) is played to the end, then
both kinds of daemon are scraped over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mosaic_proto import Layout
from mosaicd import Peer, Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.http.auth import Secret

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "mosaic-dashboard.json"
NAME = re.compile(r"\b(?:mosaic|process)_[A-Za-z0-9_:]*")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """family name -> (type, the sample names it served)."""
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(text)}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))  # rows
    walk(dashboard["panels"])
    return exprs


def served_name(name: str, served: dict[str, tuple[str, set[str]]]) -> bool:
    """Whether `name`, as a query names it, is a series the scrape holds: a sample name of a served family
    (`x_total` of a counter, `x_bucket`/`x_sum`/`x_count` of a histogram, a gauge by its own name)."""
    samples = {s for _, names in served.values() for s in names}
    if name not in samples:
        return False
    for suffix in HISTOGRAM_SUFFIXES:  # a histogram's series only: not e.g. a gauge that happens to end so
        base = name.removesuffix(suffix)
        if base != name and base in served and served[base][0] == "histogram":
            return True
    return any(name in names and kind != "histogram" for kind, names in served.values())


@pytest.fixture
async def scrapes(tmp_path: Path, kit: Any) -> dict[str, str]:
    run = dict(nodes=3, rounds=3, fragments=2, fanout=1, dim=12, seed=3, train=True, eval_every=1,
               host="127.0.0.1", port=0, round_deadline=30, register_deadline=30, request_timeout=10,
               insecure=True)  # the families of an unsigned run (a signed one adds mosaic_auth_refused)
    barrier_settings = Settings(**run, out=tmp_path / "barrier")
    barrier = Barrier(barrier_settings.run_config(), barrier_settings.daemon_options(), secret=Secret(None),
                      evaluate=NetworkEvaluation(tmp_path / "data"))
    runner, barrier_url = await kit.serve_on_loopback(barrier_app(barrier))
    settings = Settings(**run, barrier_url=barrier_url)
    peers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(settings.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        vectors = {p.rank: np.full(settings.dim, p.rank, np.float32) for p in peers}
        for t in range(settings.rounds):
            results = await asyncio.wait_for(asyncio.gather(
                *(p.gossip(vectors[p.rank], loss=1.0 / (1 + t), train_s=0.001, metrics={"loss": 1.0 / (1 + t)})
                  for p in peers)), 30)  # each node's metrics: the barrier evaluates only the average model
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 30)
        await asyncio.wait_for(barrier.done.wait(), 10)
        async with aiohttp.ClientSession() as session:
            async def get(url: str) -> str:
                async with session.get(url) as resp:
                    assert resp.status == 200 and resp.content_type == "text/plain"
                    return await resp.text()
            node, barrier_text = await get(f"http://{peers[0].address}/metrics"), await get(f"{barrier_url}/metrics")
        yield {"node": node, "barrier": barrier_text}
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


async def test_metrics_follow_prometheus_conventions(scrapes: dict[str, str]) -> None:
    for role, text in scrapes.items():
        served = families(text)
        samples = {s for _, names in served.values() for s in names}
        assert not [s for s in samples if s.endswith("_created")], role
        assert "process_resident_memory_bytes" in samples and "process_cpu_seconds_total" in samples, role
        for name, (kind, names) in served.items():
            if kind == "counter":
                assert names == {f"{name}_total"}, name
            if name.startswith("mosaic_") and kind == "gauge" and not name.endswith("_info"):  # one per quantity:
                assert not any(re.search(r'\{.*\b(name|metric)="', line) for line in text.splitlines()
                               if line.startswith(name + "{")), name  # no label says which quantity
    node, barrier = families(scrapes["node"]), families(scrapes["barrier"])
    assert node["mosaic_round_phase_seconds"][0] == "histogram"
    assert barrier["mosaic_barrier_round_seconds"][0] == "histogram"
    for name in ("mosaic_sent_bytes", "mosaic_received_bytes", "mosaic_sent_fragments", "mosaic_received_fragments",
                 "mosaic_refused_messages"):
        assert node[name][0] == "counter", name
    for name in ("mosaic_node_average_metric", "mosaic_average_model_metric", "mosaic_consensus_distance",
                 "mosaic_node_spread", "mosaic_evaluated_round"):
        assert barrier[name][0] == "gauge", name
    assert barrier["mosaic_run_info"][0] == "gauge"  # an info metric, as the text format (0.0.4) serves it


async def test_phase_durations_are_observed_once_per_round(scrapes: dict[str, str]) -> None:
    counts = {}
    for family in text_string_to_metric_families(scrapes["node"]):
        for sample in family.samples:
            if sample.name == "mosaic_round_phase_seconds_count":
                counts[sample.labels["phase"]] = sample.value
            if sample.name == "mosaic_round":
                rounds = sample.value
            if sample.name == "mosaic_run_info":
                pytest.fail("the run's info is the barrier's")
    assert rounds == 3 and counts == {"train": 3, "send": 3, "wait": 3, "aggregate": 3}
    info = next(s for f in text_string_to_metric_families(scrapes["barrier"]) for s in f.samples
                if s.name == "mosaic_run_info")
    assert info.labels == {"run_id": "mosaic", "task": "quadratic", "metric": "loss", "higher_is_better": "false"}
    values = {s.name: s.value for f in text_string_to_metric_families(scrapes["barrier"]) for s in f.samples}
    assert values["mosaic_evaluated_round"] == 2 and values["mosaic_barrier_round_seconds_count"] == 3


async def test_every_dashboard_query_names_served_metrics(scrapes: dict[str, str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 15
    served = {**families(scrapes["node"]), **families(scrapes["barrier"])}
    named = {name for expr in exprs for name in NAME.findall(expr)}
    assert {"mosaic_round_phase_seconds_bucket", "process_resident_memory_bytes"} <= named
    assert sorted(n for n in named if not served_name(n, served)) == []


def test_served_name_tells_histogram_series_from_families() -> None:
    served = {"h_seconds": ("histogram", {"h_seconds_bucket", "h_seconds_sum", "h_seconds_count"}),
              "c": ("counter", {"c_total"}), "g_count": ("gauge", {"g_count"})}
    assert all(served_name(n, served) for n in ("h_seconds_bucket", "h_seconds_sum", "c_total", "g_count"))
    assert not any(served_name(n, served) for n in ("h_seconds", "c", "g", "h_seconds_total"))

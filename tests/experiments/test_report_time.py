"""`mosaicd report` on the time axis (issue 60, item 4): accuracy (here the quadratic loss) and the consensus distance
against time for asynchronous runs, and runs of different clocks in one figure, from small real runs."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from mosaicd.experiments.cluster_async import run_cluster_async
from mosaicd.experiments.report import write_report
from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings

RUN = dict(task="quadratic", nodes=4, rounds=20, fragments=4, fanout=2, eval_every=5, seed=3)


def png_ok(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_an_asynchronous_simulation_is_reported_against_its_virtual_time(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_simulation(Settings.load(**RUN, sync="async", out=tmp_path / "async"), progress=False)
    report = write_report(tmp_path / "async")
    out = tmp_path / "async" / "report"
    assert png_ok(out / "metric_vs_time.png") and png_ok(out / "consensus_vs_time.png")
    assert {str(out / "metric_vs_time.png"), str(out / "consensus_vs_time.png")} <= set(report["figures"])
    curve, recorded = rows(out / "curves_vs_time.csv"), rows(tmp_path / "async" / "rounds.csv")
    assert {r["clock"] for r in curve} == {"virtual_s"}
    # the curve is rounds.csv's rows on its clock: the time grid, the loss and the consensus distance of each point
    assert [float(r["time"]) for r in curve] == [float(r["virtual_s"]) for r in recorded]
    for drawn, row in zip(curve, recorded, strict=True):
        for key in ("node_average", "consensus_distance"):
            assert float(drawn[key]) == pytest.approx(float(row[key]), rel=1e-5)
    assert "curves_vs_time.csv" in (out / "report.md").read_text()


def test_a_run_without_a_clock_leaves_the_time_figures_out(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_simulation(Settings.load(**RUN, out=tmp_path / "barrier"), progress=False)  # no --node-profile: no clock
    run_simulation(Settings.load(**RUN, sync="async", out=tmp_path / "async"), progress=False)
    report = write_report([tmp_path / "barrier", tmp_path / "async"], tmp_path / "report")
    assert not any("vs_time" in f for f in report["figures"]) and "curves_vs_time" not in report
    assert not (tmp_path / "report" / "curves_vs_time.csv").exists()


@pytest.mark.slow  # a 4-process loopback run (~10 s on 2 idle cores) and two simulations
def test_barrier_and_asynchronous_runs_share_the_time_figures_each_on_its_clock(tmp_path: Path, kit: Any) -> None:
    pytest.importorskip("matplotlib")
    profile = kit.pace(tmp_path, 0.05)
    profiled = dict(RUN, nodes=3, node_profile=profile)
    run_cluster_async(Settings.load(**profiled, sync="async", out=tmp_path / "cluster-async"), progress=False,
                      timeout=120)
    run_simulation(Settings.load(**profiled, sync="async", out=tmp_path / "sim-async"), progress=False)
    run_simulation(Settings.load(**profiled, out=tmp_path / "sim-barrier"), progress=False)
    folders = [tmp_path / name for name in ("cluster-async", "sim-async", "sim-barrier")]
    report = write_report(folders, tmp_path / "report")
    out = tmp_path / "report"
    assert png_ok(out / "metric_vs_time.png") and png_ok(out / "consensus_vs_time.png")
    curve = rows(out / "curves_vs_time.csv")
    clocks = {r["line"].split(",")[0]: r["clock"] for r in curve}
    assert clocks == {str(folders[0]): "time_s", str(folders[1]): "virtual_s", str(folders[2]): "virtual_s"}
    drawn = [float(r["time"]) for r in curve if r["line"].startswith(f"{folders[0]},")]
    assert drawn == [float(r["time_s"]) for r in rows(folders[0] / "rounds.csv")]  # the cluster's time grid
    assert all(float(r["consensus_distance"]) >= 0 for r in curve)
    assert report["runs"] == 3 and report["curves_vs_time"] == str(out / "curves_vs_time.csv")

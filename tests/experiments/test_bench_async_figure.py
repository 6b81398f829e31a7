"""bench/async_figure.py, the asynchronous figure (issue 60, item 7): its quick check runs every curve of both
scenarios and writes the CSV and the PNG, and the barrier's rows lie where the bench's own round time says (the
time axes it compares are the simulator's virtual clock, as the page says)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "async_figure.py"


def test_the_time_to_target_is_interpolated_from_the_evaluation_before(kit: Any) -> None:
    time_to = kit.bench_module("async_figure").time_to
    rows = [{"virtual_s": 5.0, "node_average": 0.5}, {"virtual_s": 10.0, "node_average": 0.7},
            {"virtual_s": 15.0, "node_average": 0.9}, {"virtual_s": 20.0, "node_average": 0.6}]
    assert time_to(rows, 0.8) == pytest.approx(12.5)
    assert time_to(rows, 0.25) == pytest.approx(2.5)  # from accuracy 0 at time 0
    assert time_to(rows, 0.95) == math.inf


@pytest.mark.slow
def test_the_small_figure_runs_every_curve_and_writes_its_csv_and_png(tmp_path: Path, kit: Any) -> None:
    module = kit.bench_module("async_figure")
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(tmp_path / "fig")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["nodes"] == 8 and summary["seeds"] == [0]
    with open(tmp_path / "fig" / "async_figure.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    curves = {(r["scenario"], r["curve"]) for r in rows}
    assert curves == {(s, c) for s in module.SCENARIOS for c in module.CURVES}
    for scenario, share in module.SCENARIOS.items():
        assert set(summary["time_to_target"]["0.8"][scenario]) == set(module.CURVES)
        for curve, flags in module.CURVES.items():
            mine = [r for r in rows if r["scenario"] == scenario and r["curve"] == curve]
            assert all(0 <= float(r["node_average"]) <= 1 for r in mine)
            assert all(float(r["virtual_s"]) <= summary["horizon_s"] + 1e-6 for r in mine)
            if flags["sync"] == "barrier":  # round r ends at (r + 1) x (compute, latency, s models, slowest link)
                for r in mine:
                    assert float(r["virtual_s"]) == pytest.approx((int(r["round"]) + 1) * module.round_s(share)), r
            else:  # the asynchronous grid: every 5 virtual s
                assert [float(r["virtual_s"]) for r in mine] == [5.0, 10.0], (scenario, curve)
    assert (tmp_path / "fig" / "async_figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = len(module.SCENARIOS) * len(module.CURVES)
    assert f"[{runs}/{runs}]" in done.stdout  # the progress, one line per run

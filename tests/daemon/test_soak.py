"""A soak: a 16-node loopback cluster (real `mosaicd` processes, real HTTP) plays 600 protocol-only rounds
through bench/soak.py, and nothing grows with the rounds: resident memory, descriptors, sockets, asyncio tasks.
(`bench/soak.py --rounds 10000` soaks longer; the verdict's limits are per round, so 500 fitted rounds catch what
900 did.)

On 2 idle cores a round of 16 processes takes about 0.06 s (0.1-0.2 s on a loaded machine): about a minute in CI.
What the verdict catches is shown on made-up samples
by the second test: one descriptor, socket or task leaked per round is +200 on the floor of the second half of
the fitted samples against the first (allowed: +8), and a page (4 KiB) of memory per round is a growth of
1.5 MiB over 375 made-up rounds (allowed: 3 KiB per round, 1.1 MiB, or 3 x the fit's noise, here about 0.03 MiB); the
barrier's history of releases (about 1.5 KiB per round, 0.58 MiB here) passes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
NODES, ROUNDS, EVERY, WARMUP, SLACK = 16, 600, 25, 100, 8


@pytest.mark.slow
def test_a_16_node_cluster_runs_600_rounds_without_growing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    done = subprocess.run([sys.executable, str(SOAK), "--nodes", str(NODES), "--rounds", str(ROUNDS), "--every",
                           str(EVERY), "--warmup", str(WARMUP), "--slack", str(SLACK), "--out", str(tmp_path),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    result = json.loads(lines[-1])
    report = "\n".join(lines[-NODES - 6:])
    assert result["fitted_rounds"][0] == WARMUP and result["fitted_rounds"][1] >= ROUNDS - EVERY, report
    assert result["samples"] == ROUNDS // EVERY, report  # one per EVERY rounds, the last before the end
    for key in ("fds_floor", "sockets_floor", "tasks_floor"):  # every process was measured (no NaN: the gauge)
        assert all(math.isfinite(v) and v > 0 for v in result[key].values()), (key, report)
    assert result["leaks"] == [] and result["ok"], report
    summary = json.loads((tmp_path / "summary.json").read_text())  # the run itself finished, with every node
    assert summary["status"] == "finished" and summary["dropped"] == [] and len(summary["model_sha256"]) == NODES


def samples(rounds: range, **per_round: float) -> list[dict[str, Any]]:
    """Made-up samples of a barrier and two nodes; `per_round` adds that much of a quantity per round to node-1."""
    out = []
    for i, r in enumerate(rounds):
        wobble = (-1) ** i  # in-flight work and page noise
        base = {"rss_mib": 60.0 + 0.01 * wobble, "fds": 38 + 2 * (i % 3), "sockets": 34 + (i % 2),
                "tasks": 20.0 + 16 * (i % 2)}
        procs = {name: dict(base) for name in ("barrier", "node-0", "node-1")}
        for key, step in per_round.items():
            procs["node-1"][key] += step * r
        out.append({"round": r, "t": r * 0.1, "procs": procs})
    return out


def test_the_verdict_catches_a_leak_of_one_per_round_and_a_page_per_round(kit: Any) -> None:
    soak, rounds = kit.bench_module("soak"), range(0, 500 - EVERY + 1, EVERY)  # 500 made-up rounds

    def leaks(**per_round: float) -> list[str]:
        return soak.judge(samples(rounds, **per_round), WARMUP, SLACK, 3.0)["leaks"]

    assert leaks() == []
    for key in ("fds", "sockets", "tasks"):
        found = leaks(**{key: 1})
        assert len(found) == 1 and found[0].startswith(f"node-1: {key} at least"), found
    assert leaks(tasks=1 / 25) == []  # one task per 25 rounds: +8 between the halves, within the slack
    found = leaks(rss_mib=4 / 1024)  # a page per round
    assert len(found) == 1 and found[0].startswith("node-1: RSS grows 1.46 MiB"), found
    assert leaks(rss_mib=1.5 / 1024) == []  # the barrier's history: about 1.5 KiB per round
    with pytest.raises(ValueError, match="samples after the warm-up"):
        soak.judge(samples(range(0, 100, 25)), WARMUP, SLACK, 3.0)

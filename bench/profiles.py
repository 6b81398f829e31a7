"""How close `simulate`'s virtual clock comes to `cluster` on the same --node-profile (issue #37).

Each case runs the same settings twice: `mosaicd simulate` (its rounds.csv's `virtual_s`: the predicted release of
every round, and its summary's stragglers and drops) and `mosaicd cluster` on loopback (the barrier's `released` log
lines: the measured release of every round, from `registration_closed` for round 0, and its stragglers and drops).
Both evaluate every round so that every round has a time.

    .venv/bin/python bench/profiles.py              # the six cases, about 3 min on 2 cores
    .venv/bin/python bench/profiles.py --case slow-missed

Last line of stdout: a JSON object, case -> its figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.logs import configure_logging
from mosaicd.settings import Settings

COMMON = {"task": "quadratic", "nodes": 6, "rounds": 8, "fragments": 2, "fanout": 2, "eval_every": 1, "seed": 3}
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "slow-missed": ("2 of 6 nodes 5x slower (2 s), deadline 1.5 s", "compute_s = 0.4\n[nodes.1]\nslowdown = 5\n"
                    "[nodes.4]\nslowdown = 5\n", {"round_deadline": 1.5}),
    "slow-met": ("2 of 6 nodes 3x slower (1.2 s), deadline 3 s", "compute_s = 0.4\n[nodes.1]\nslowdown = 3\n"
                 "[nodes.4]\nslowdown = 3\n", {"round_deadline": 3.0}),
    "draw-20pct": ("20% of 10 nodes drawn 4x slower (1.2 s), 1 s deadline, --drop-after 3",
                   "compute_s = 0.3\n[[draw]]\nshare = 0.2\nslowdown = 4\n",
                   {"nodes": 10, "round_deadline": 1.0, "drop_after": 3}),
    "bandwidth": ("1 MB/s + 50 ms links, one node 250 kB/s; 800 kB sent a round", "compute_s = 0.2\n[default]\n"
                  "bandwidth = \"1MB/s\"\nlatency = 0.05\n[nodes.2]\nbandwidth = \"250kB/s\"\n",
                  {"dim": 100_000, "curvature": "diagonal", "round_deadline": 6.0}),
    "bandwidth-fp16": ("the same links, --compress fp16: 400 kB sent a round", "compute_s = 0.2\n[default]\n"
                       "bandwidth = \"1MB/s\"\nlatency = 0.05\n[nodes.2]\nbandwidth = \"250kB/s\"\n",
                       {"dim": 100_000, "curvature": "diagonal", "round_deadline": 6.0, "compress": "fp16"}),
    "link-cut": ("one node 100 kB/s: its 800 kB cut at its send budget (3 s deadline)", "compute_s = 0.2\n"
                 "[nodes.2]\nbandwidth = \"100kB/s\"\n", {"dim": 100_000, "curvature": "diagonal",
                                                          "round_deadline": 3.0}),
}


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def measured(out: Path) -> tuple[list[float], dict[int, list[int]]]:
    """The cluster's release times (s since registration closed) and stragglers per round, from the barrier's log."""
    start, times, stragglers = None, {}, {}
    for line in (out / "logs" / "barrier.log").read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "registration_closed" and start is None:
            start = stamp(event["timestamp"])
        elif event.get("event") == "released" and not event.get("finished"):
            times[event["round"]] = stamp(event["timestamp"])
            stragglers[event["round"]] = event.get("stragglers") or []
    assert start is not None
    return [times[r] - start for r in sorted(times)], stragglers


def predicted(out: Path, summary: dict[str, Any]) -> tuple[list[float], dict[int, list[int]]]:
    with open(out / "rounds.csv", newline="") as f:
        times = [float(row["virtual_s"]) for row in csv.DictReader(f)]
    stragglers = {r: [] for r in range(len(times))}
    for event in summary["events"]:
        stragglers[event["round"]] = event["stragglers"]
    return times, stragglers


def run_case(name: str, workdir: Path) -> dict[str, Any]:
    title, profile, extra = CASES[name]
    path = workdir / f"{name}.toml"
    path.write_text(profile)
    flags = {**COMMON, **extra, "node_profile": path}
    sim = run_simulation(Settings.load(**flags, out=workdir / f"{name}-sim"), progress=False)
    cluster = run_cluster(Settings.load(**flags, out=workdir / f"{name}-cluster"), progress=False, timeout=600)
    virtual, predicted_stragglers = predicted(workdir / f"{name}-sim", sim)
    real, measured_stragglers = measured(workdir / f"{name}-cluster")
    rounds = min(len(virtual), len(real))
    durations = [b - a for a, b in zip([0.0, *virtual], virtual, strict=False)][:rounds]
    real_durations = [b - a for a, b in zip([0.0, *real], real, strict=False)][:rounds]
    errors = [m - p for p, m in zip(durations, real_durations, strict=True)]
    return {"case": title, "rounds": rounds, "predicted_total_s": round(virtual[rounds - 1], 3),
            "measured_total_s": round(real[rounds - 1], 3),
            "predicted_round_s": [round(d, 3) for d in durations], "measured_round_s": [round(d, 3) for d in
                                                                                       real_durations],
            "median_error_s": round(statistics.median(errors), 3), "max_abs_error_s": round(max(map(abs, errors)), 3),
            "same_stragglers": all(sorted(predicted_stragglers.get(r, [])) == sorted(measured_stragglers.get(r, []))
                                   for r in range(rounds)),
            "same_dropped": sim.get("dropped") == cluster.get("dropped"),
            "stragglers": {r: s for r, s in measured_stragglers.items() if s}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=list(CASES), help="a case to run (default: all)")
    args = parser.parse_args()
    configure_logging("warning")
    results = {}
    with tempfile.TemporaryDirectory(prefix="mosaic-profiles-") as tmp:
        for name in args.case or list(CASES):
            results[name] = run_case(name, Path(tmp))
            r = results[name]
            print(f"{r['case']}: predicted {r['predicted_total_s']} s, measured {r['measured_total_s']} s over "
                  f"{r['rounds']} rounds; per round median error {r['median_error_s']} s, max {r['max_abs_error_s']} "
                  f"s; same stragglers {r['same_stragglers']}, same drops {r['same_dropped']}", flush=True)
            print(f"  predicted {r['predicted_round_s']}\n  measured  {r['measured_round_s']}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Start-up of a local cluster: launch to round 0 released, 16 digits nodes, warm start against cold.

Launch: `Cluster.run` is called (this script has imported `mosaicd` already; `cli_import_s`, the time a fresh
interpreter takes to import `mosaicd.cli`, is measured apart and added in `launch_to_round0_cli_s`, the figure
a user of `mosaicd cluster` waits). Round 0 released: the timestamp of the barrier's `released` log line of
round 0 (out/logs/barrier.log, UTC, microseconds). The same log gives the steps between: the barrier
listening, the first node registered, registration closed. The run is the tutorial's job (bench/tutorial.py)
cut to 2 rounds without evaluation: what happens before round 0 is released does not depend on the rounds.

Warm (the default of `mosaicd cluster`): the barrier process imports, builds the task and warms torch up, then
forks the nodes. Cold, the reference measured in the same run: every process a fresh interpreter that imports
and builds for itself (`Cluster(warm=False)`, the way before the warm start).

    .venv/bin/python bench/startup.py              # warm and cold, 3 runs each (medians): about 2 min on 2 cores
    .venv/bin/python bench/startup.py --repeat 1 --nodes 4

Last line of stdout: a JSON object {"warm": {...}, "cold": {...}, "ratio": warm/cold launch_to_round0_s}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from mosaicd.experiments.cluster import Cluster
from mosaicd.logs import configure_logging
from mosaicd.settings import Settings

STEPS = {"listening": "barrier_listening_s", "registered": "first_registered_s",
         "registration_closed": "registration_closed_s"}


def barrier_events(log: Path) -> dict[str, float]:
    """Unix time of the first `listening`, `registered`, `registration_closed` and round 0 `released` lines."""
    found: dict[str, float] = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        if name == "released" and event.get("round") != 0:
            continue
        if name in (*STEPS, "released") and name not in found:
            found[name] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    return found


def run_once(warm: bool, nodes: int, workdir: Path, index: int) -> dict[str, float]:
    out = workdir / f"{'warm' if warm else 'cold'}-{index}"
    settings = Settings.load(task="digits", nodes=nodes, rounds=2, sampler="local", fanout=min(4, nodes - 1),
                             fragments=1, local_steps=10, batch_size=16, lr=0.05, partition="dirichlet", alpha=0.1,
                             eval_every=0, out=out)
    launched = time.time()
    Cluster(settings, progress=False, warm=warm).run(timeout=600)
    events = barrier_events(out / "logs" / "barrier.log")
    if "released" not in events:
        raise SystemExit(f"no release of round 0 in {out / 'logs' / 'barrier.log'}")
    result = {"launch_to_round0_s": round(events["released"] - launched, 3)}
    for name, key in STEPS.items():
        if name in events:
            result[key] = round(events[name] - launched, 3)
    return result


def cli_import_seconds() -> float:
    """A fresh interpreter importing `mosaicd.cli` (what `mosaicd cluster` does before it launches): best of 3."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import mosaicd.cli"], check=True)
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant; figures are medians")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold reference")
    args = parser.parse_args()
    configure_logging("warning")
    cli = cli_import_seconds()
    report: dict[str, Any] = {"nodes": args.nodes, "repeat": args.repeat, "cli_import_s": cli}
    with tempfile.TemporaryDirectory(prefix="mosaic-startup-") as tmp:
        for warm in [True] if args.no_cold else [True, False]:
            name = "warm" if warm else "cold"
            runs = [run_once(warm, args.nodes, Path(tmp), i) for i in range(args.repeat)]
            figures = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]
                       if all(key in r for r in runs)}
            figures["launch_to_round0_cli_s"] = round(figures["launch_to_round0_s"] + cli, 3)
            figures["runs"] = [r["launch_to_round0_s"] for r in runs]
            report[name] = figures
            steps = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in figures.items()
                              if k.endswith("_s") and k != "launch_to_round0_s")
            print(f"{name:5s} launch to round 0 released: {figures['launch_to_round0_s']:.2f} s ({steps})")
    if "cold" in report:
        report["ratio"] = round(report["warm"]["launch_to_round0_s"] / report["cold"]["launch_to_round0_s"], 3)
        print(f"warm / cold: {report['ratio']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Seconds per round of deploy/multihost on the three-engine lab: one host vs three, plain links vs shaped ones.

    sudo .venv/bin/python tests/hosts/measure.py [--rounds 20]      # needs the image mosaic:test (pytest builds it)

Each scenario is one run of 6 nodes (quadratic task, K=4, s=3) and the barrier, through the deploy/multihost files
exactly as in tests/hosts/test_compose_hosts.py: all on host 0 ("one host"), or 2 nodes on each of three hosts with
the barrier on host 0 ("three hosts"), on plain links or with tbf 100 Mbit/s on every host and 20 ms more each way
(tproxy.py). The figures are the barrier's release intervals after round 0 (GET /v1/history): median, mean, max.
Prints a Markdown table, then a JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostlab import ComposePerHost, HostsLab, load_image, seconds_per_round  # noqa: E402

IMAGE = os.environ.get("MOSAIC_TEST_IMAGE", "mosaic:test")
SCENARIOS = {"one host": ({0: 6}, False), "three hosts": ({0: 2, 1: 2, 2: 2}, False),
             "three hosts, 100 Mbit/s + 20 ms": ({0: 2, 1: 2, 2: 2}, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    settings = {"MOSAIC_TASK": "quadratic", "MOSAIC_ROUNDS": str(args.rounds), "MOSAIC_FRAGMENTS": "4",
                "MOSAIC_FANOUT": "3", "MOSAIC_EVAL_EVERY": "5", "MOSAIC_SEED": "5", "MOSAIC_BARRIER_LINGER": "30"}
    figures = {}
    with tempfile.TemporaryDirectory(prefix="mosaic-measure-") as tmp, HostsLab(hosts=3) as lab:
        engines = lab.start_engines(Path(os.environ.get("MOSAIC_HOSTS_ENGINES", Path(tmp) / "engines")))
        load_image(engines, IMAGE, Path(tmp) / "image.tar")
        for i, (name, (scale, shaped)) in enumerate(SCENARIOS.items()):
            if shaped:
                for k in range(3):
                    lab.shape(k, "100mbit", burst="64kb")
                lab.delay(0.02, Path(tmp) / "tproxy.log")
            run = ComposePerHost(lab, Path(tmp) / f"run{i}", IMAGE, scale, settings=settings, name=f"measure{i}")
            try:
                run.up()
                summary = run.wait_final(timeout=600)
                if summary["status"] != "finished":
                    raise SystemExit(f"{name}: {summary.get('error')}")
                durations = seconds_per_round(run.history())
            finally:
                run.down()
                lab.undelay()
                for k in range(3):
                    lab.unshape(k)
            figures[name] = {"median_s": round(statistics.median(durations), 3),
                             "mean_s": round(statistics.mean(durations), 3), "max_s": round(max(durations), 3),
                             "rounds": len(durations), "wall_s": summary["wall_s"]}
    print("| scenario | round median | round mean | round max | run wall |")
    print("| --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        print(f"| {name} | {f['median_s']:.3f} s | {f['mean_s']:.3f} s | {f['max_s']:.3f} s | {f['wall_s']:.1f} s |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

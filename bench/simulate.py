"""Node-rounds per second of `mosaicd simulate` (one process) and `mosaicd cluster` (processes + HTTP).

Both run the same settings and must end with the same model hashes; the ratio is what in-process
simulation saves. Last line of stdout: a JSON object.

    .venv/bin/python bench/simulate.py [--task digits] [--nodes 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.logs import configure_logging
from mosaicd.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--fanout", type=int, default=2)
    args = parser.parse_args()
    configure_logging("warning")
    rows = {}
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, runner in (("simulate", lambda s: run_simulation(s, progress=False)),
                             ("cluster", lambda s: run_cluster(s, progress=False))):
            settings = Settings.load(task=args.task, nodes=args.nodes, rounds=args.rounds, fragments=args.fragments,
                                     fanout=args.fanout, eval_every=0, out=Path(tmp) / mode)
            started = time.perf_counter()
            summary = runner(settings)
            wall = time.perf_counter() - started
            hashes[mode] = summary["model_sha256"]
            rows[mode] = {"wall_s": round(wall, 3), "node_rounds_per_s": round(args.nodes * args.rounds / wall, 3)}
            print(f"{mode:9s} {wall:8.2f} s  {rows[mode]['node_rounds_per_s']:8.2f} node-rounds/s", flush=True)
    ratio = rows["simulate"]["node_rounds_per_s"] / rows["cluster"]["node_rounds_per_s"]
    same = hashes["simulate"] == hashes["cluster"]
    print(f"simulate / cluster: {ratio:.2f}x; identical final models: {same}")
    print(json.dumps({**vars(args), **rows, "ratio": round(ratio, 3), "identical_models": same}))


if __name__ == "__main__":
    main()

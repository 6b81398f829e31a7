"""`mosaicd simulate --sync async` at 1,000 nodes: the cost of a node-iteration of the discrete-event simulation
against a node-round of the barrier's simulation on the same settings, measured in the same run (the reference).

Settings: `--task quadratic --dim 16 --fragments 4 --fanout 2 --rounds R --eval-every 5` at `--nodes N`; the async
run also with a quarter of the nodes 10x slower (`[[draw]] share = 0.25 slowdown = 10`), whose virtual time is 10x
longer while the others' step rates stay those of the run without them. Per run: wall seconds (the summary's
`wall_s`), seconds per node-iteration (node-round), the ratio against the barrier run, the final node average.

Usage: python bench/async_scale.py [--nodes 1000] [--rounds 20]   (the last line printed is JSON)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mosaicd.experiments.simulate import run_simulation
from mosaicd.settings import Settings

SLOW_QUARTER = "[[draw]]\nshare = 0.25\nslowdown = 10\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    base = {"nodes": args.nodes, "rounds": args.rounds, "fragments": 4, "fanout": 2, "eval_every": 5, "dim": 16}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "slow.toml").write_text(SLOW_QUARTER)
        cases = {"barrier": {}, "async": {"sync": "async"},
                 "async_slow_quarter": {"sync": "async", "node_profile": Path(tmp) / "slow.toml"}}
        for name, extra in cases.items():
            summary = run_simulation(Settings.load(**base, **extra, out=Path(tmp) / name), progress=False)
            per = summary["wall_s"] / (args.nodes * args.rounds)
            results[name] = {"wall_s": summary["wall_s"], "per_node_iteration_us": round(per * 1e6, 1),
                             "virtual_s": summary.get("virtual_s"), "node_average": summary["final"]["node_average"]}
    reference = results["barrier"]["per_node_iteration_us"]
    for name, row in results.items():
        row["ratio_to_barrier"] = round(row["per_node_iteration_us"] / reference, 2)
        print(f"{name:>20}: {row['wall_s']:7.2f} s  {row['per_node_iteration_us']:8.1f} us/node-iteration  "
              f"x{row['ratio_to_barrier']:<6} virtual {row['virtual_s']}  node_average {row['node_average']:.3g}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

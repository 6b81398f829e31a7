"""A real-size model's round: ResNet-18 (11.2M values) on CIFAR-shaped synthetic data, `cluster` against `simulate`.

The same job (`bench/resnet18_task.py:SyntheticResNet18`, --nodes 4, K=1, s=2, 1 local step of batch 16, evaluation
every round on 64 test images) runs through `mosaicd cluster` (`Cluster`: a barrier and one process per node on
this host, the model's 45 MB sent over HTTP to each of s peers every round) and through `mosaicd simulate` (one
process, the nodes in turn, gossip in memory), in turn --repeats times. Figures per run:

- `s_per_round`: rounds.csv's `elapsed_s` from the first round's row to the last's, over the rounds between (the
  first round, with the processes' start-up, is not counted);
- `wall_s`: the whole run as the launcher saw it, start-up included;
- `models_sha256`: the final models' hash (the two must agree: same seed and settings, same models).

`ratio`: the cluster's seconds per round over simulate's, side by side (the median where --repeats > 1). The
cluster has this host's cores to train on at once; simulate trains the nodes one after another on one.

    .venv/bin/python bench/resnet18.py                        # about 2 min on 2 loaded cores
    .venv/bin/python bench/resnet18.py --rounds 4 --repeats 2 --fragments 16

Last line of stdout: a JSON object {"cluster": [...], "simulate": [...], "ratio": ..., "same_models": ...}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mosaicd.experiments.cluster import Cluster
from mosaicd.settings import Settings

TASK = f"{Path(__file__).resolve().parent / 'resnet18_task.py'}:SyntheticResNet18"


def job(out: Path, args: argparse.Namespace) -> Settings:
    return Settings.load(task=TASK, nodes=args.nodes, rounds=args.rounds, fragments=args.fragments,
                         fanout=min(args.fanout, args.nodes - 1), local_steps=1, batch_size=16, lr=0.05,
                         eval_every=1, out=out, log_level="warning", round_deadline=600.0, request_timeout=300.0,
                         register_deadline=300.0)


def seconds_per_round(out: Path) -> float:
    """rounds.csv's elapsed_s from the first round's row to the last's, per round between."""
    with open(out / "rounds.csv", newline="") as f:
        elapsed = [float(r["elapsed_s"]) for r in csv.DictReader(f) if r["elapsed_s"]]
    if len(elapsed) < 2:
        raise SystemExit(f"{out / 'rounds.csv'}: fewer than 2 evaluated rounds")
    return (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1)


def run(kind: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    settings = job(out, args)
    started = time.perf_counter()
    if kind == "cluster":
        Cluster(settings, progress=False).run(timeout=1200)
    else:
        from mosaicd.experiments.simulate import run_simulation
        run_simulation(settings, progress=False)
    wall = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("status") != "finished":
        raise SystemExit(f"{kind} did not finish: {summary.get('error')}")
    return {"s_per_round": round(seconds_per_round(out), 3), "wall_s": round(wall, 1),
            "models_sha256": summary["models_sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run (the first is not counted)")
    parser.add_argument("--fragments", type=int, default=1, help="K")
    parser.add_argument("--fanout", type=int, default=2, help="s (capped at nodes - 1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, in turn (cluster, simulate, ...)")
    args = parser.parse_args()
    if args.rounds < 2 or args.nodes < 2:
        parser.error("--rounds and --nodes must be at least 2")
    root = Path(tempfile.mkdtemp(prefix="mosaic-bench-resnet18-"))
    runs: dict[str, list[dict[str, Any]]] = {"cluster": [], "simulate": []}
    for rep in range(args.repeats):
        for kind in runs:
            runs[kind].append(run(kind, root / f"{kind}-{rep}", args))
            r = runs[kind][-1]
            print(f"{kind:>8}: {r['s_per_round']:.2f} s/round, wall {r['wall_s']:.0f} s, models_sha256 "
                  f"{r['models_sha256'][:12]}", flush=True)
    ratios = [c["s_per_round"] / s["s_per_round"] for c, s in zip(runs["cluster"], runs["simulate"], strict=True)]
    same = all(c["models_sha256"] == s["models_sha256"] for c, s in zip(runs["cluster"], runs["simulate"],
                                                                          strict=True))
    ratio = statistics.median(ratios)
    print(f"ResNet-18 ({args.nodes} nodes, K={args.fragments}): cluster / simulate seconds per round {ratio:.2f}x; "
          f"same models: {same}")
    print(json.dumps({**runs, "ratio": round(ratio, 3), "same_models": same, "nodes": args.nodes,
                      "fragments": args.fragments, "rounds": args.rounds}))


if __name__ == "__main__":
    main()

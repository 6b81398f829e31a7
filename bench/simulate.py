"""Node-rounds per second of `mosaicd simulate`: against `mosaicd cluster`, or exact against `--batched`.

Default: simulate (one process) and cluster (processes + HTTP) run the same settings and must end with the
same model hashes; the ratio is what in-process simulation saves.

`--batched`: `mosaicd simulate` exact (on the CPU, today's reference) and `mosaicd simulate --batched` (on
`--device`, default cuda when present) on the same settings; with `--task cifar10` on CIFAR-10-shaped
synthetic data (`write_synthetic`, `--train-samples` images, a small test set so that the one evaluation
at the end weighs little). The models are close, not identical: the largest gap of the final metrics is
printed. The issue's target (GN-LeNet, n=60, s=8, K=16, H=5, batch 32; batched >= 5x exact):

    .venv/bin/python bench/simulate.py --batched --task cifar10 --nodes 60 --fanout 8 --fragments 16 \\
        --local-steps 5 --rounds 3 --train-samples 50000

Last line of stdout: a JSON object.

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
from mosaicd.learning.data import write_synthetic
from mosaicd.logs import configure_logging
from mosaicd.settings import Settings


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--fanout", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batched", action="store_true", help="exact simulate against simulate --batched")
    parser.add_argument("--device", default=None, help="--batched: device of the batched run [cuda if present]")
    parser.add_argument("--train-samples", type=int, default=6000, help="synthetic training images (not digits)")
    parser.add_argument("--test-samples", type=int, default=200, help="synthetic test images (not digits)")
    args = parser.parse_args()
    if args.batched and args.device is None:
        args.device = _default_device()
    configure_logging("warning")
    rows, summaries = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        if args.task not in ("digits", "quadratic"):
            write_synthetic(args.task, data_dir, train=args.train_samples, test=args.test_samples)
        runs = (("exact", {"device": "cpu"}, lambda s: run_simulation(s, progress=False)),
                ("batched", {"batched": True, "device": args.device}, lambda s: run_simulation(s, progress=False))
                ) if args.batched else (
                ("simulate", {}, lambda s: run_simulation(s, progress=False)),
                ("cluster", {}, lambda s: run_cluster(s, progress=False)))
        for mode, extra, runner in runs:
            settings = Settings.load(task=args.task, nodes=args.nodes, rounds=args.rounds, fragments=args.fragments,
                                     fanout=args.fanout, local_steps=args.local_steps, batch_size=args.batch_size,
                                     eval_every=0, data_dir=data_dir, out=Path(tmp) / mode, **extra)
            started = time.perf_counter()
            summaries[mode] = runner(settings)
            wall = time.perf_counter() - started
            rows[mode] = {"wall_s": round(wall, 3), "node_rounds_per_s": round(args.nodes * args.rounds / wall, 3)}
            print(f"{mode:9s} {wall:8.2f} s  {rows[mode]['node_rounds_per_s']:8.2f} node-rounds/s", flush=True)
    first, second = list(rows)
    ratio = rows[second]["node_rounds_per_s"] / rows[first]["node_rounds_per_s"]
    out = {**{k: v for k, v in vars(args).items() if k != "batched"}, "compare": second, **rows}
    if args.batched:
        a, b = summaries["exact"]["final"], summaries["batched"]["final"]
        keys = [k for k in ("node_average", "average_model", "node_average_test_loss", "average_model_test_loss",
                            "train_loss") if isinstance(a.get(k), float)]
        gap = max(abs(a[k] - b[k]) for k in keys)
        print(f"batched / exact: {ratio:.2f}x; largest gap of the final metrics: {gap:.2e}")
        out.update({"ratio": round(ratio, 3), "max_metric_gap": gap})
    else:
        same = summaries["simulate"]["model_sha256"] == summaries["cluster"]["model_sha256"]
        ratio = 1 / ratio
        print(f"simulate / cluster: {ratio:.2f}x; identical final models: {same}")
        out.update({"ratio": round(ratio, 3), "identical_models": same})
    print(json.dumps(out))


if __name__ == "__main__":
    main()

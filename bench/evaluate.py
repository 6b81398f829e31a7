"""Evaluation seconds per model: the barrier's network evaluation of many GN-LeNet models on CIFAR-10-shaped
synthetic data (`write_synthetic`), today's way against the batched one.

Three timings of `network_metrics` (every node model, then the average model on the full test set):

- one_by_one: each model alone over the test set, as evaluation did before (the training model's memory
              format; the reference)
- default:    what network_metrics does now on this device: on the CPU each model alone in channels-last
              memory (CIFAR), off the CPU chunks of models through torch.func.vmap over each test batch
- stacked:    chunks of models through torch.func.vmap, whatever the device
- subset:     the default, node models on a fixed seeded subset of `--eval-samples` test images

Seconds per model = wall / (models + 1). The issue's target (60 models, 10,000 images; today ~11 min, target
<= 1 min full set, seconds with --eval-samples 1000):

    .venv/bin/python bench/evaluate.py --models 60 --test-samples 10000 --eval-samples 1000

Last line of stdout: a JSON object with the ratios against one_by_one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from mosaicd.learning.data import write_synthetic
from mosaicd.learning.evaluation import network_metrics
from mosaicd.learning.tasks import build_task
from mosaicd.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="cifar10")
    parser.add_argument("--models", type=int, default=60)
    parser.add_argument("--test-samples", type=int, default=10000)
    parser.add_argument("--eval-samples", type=int, default=1000)
    parser.add_argument("--device", default=None, help="torch device [cuda if present, else cpu]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-one-by-one", action="store_true", help="when today's way takes too long")
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic(args.task, tmp, train=100, test=args.test_samples)
        modes = [("one_by_one", False, None), ("default", None, None), ("stacked", True, None),
                 ("subset", None, args.eval_samples)]
        vectors: list[np.ndarray] = []
        for mode, stacked, samples in modes:
            if mode == "one_by_one" and args.skip_one_by_one:
                continue
            run = Settings.load(task=args.task, nodes=max(args.models, 3), fanout=1, device=args.device,
                                threads=args.threads, eval_samples=samples, data_dir=Path(tmp))
            task = build_task(run)
            if mode == "one_by_one":
                task.eval_channels_last = False
            task.stacked_eval = stacked
            if not vectors:
                rng = np.random.default_rng(0)
                vectors = [task.initial(0) + rng.normal(0, 0.01, task.layout.dim).astype(np.float32)
                           for _ in range(args.models)]
            task.evaluate(vectors[0])  # data loaded, kernels warm
            started = time.perf_counter()
            metrics = network_metrics(task, vectors)
            wall = time.perf_counter() - started
            rows[mode] = {"wall_s": round(wall, 3), "s_per_model": round(wall / (args.models + 1), 4),
                          "eval_samples": metrics["eval_samples"]}
            print(f"{mode:11s} {wall:8.2f} s  {rows[mode]['s_per_model']:8.4f} s per model "
                  f"(node models on {metrics['eval_samples']} images)", flush=True)
    out: dict = {**vars(args), **rows}
    if "one_by_one" in rows:
        for mode in ("default", "stacked", "subset"):
            out[f"{mode}_speedup"] = round(rows["one_by_one"]["wall_s"] / rows[mode]["wall_s"], 3)
        print(f"speed-up against one by one: default {out['default_speedup']:.2f}x, stacked "
              f"{out['stacked_speedup']:.2f}x, subset {out['subset_speedup']:.2f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

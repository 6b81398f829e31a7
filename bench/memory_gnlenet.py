"""Peak memory of one CIFAR-10 / GN-LeNet node: does a node fit in 400 MB?

Writes a synthetic CIFAR-10 of the real size and format (5 x 10,000 training images as the official
python pickles, plus a 10,000-image test_batch) into a temporary folder, then, in fresh subprocesses,
builds the cifar10 task, trains a few rounds for one node (batch 32, H=5) and evaluates once, and
reports the peak resident set size (ru_maxrss) of each:

- cold: first use of the folder (the pickles are converted into the memory-mapped cache)
- warm: the cache exists (every later start)
- in-memory: the cache folder is not writable, so the arrays live in the process

Usage: python bench/memory_gnlenet.py [--rounds 3] [--nodes 1] [--train 50000] [--test 10000]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
import mosaicd.learning.data
from mosaicd.settings import Settings
from mosaicd.learning.tasks import build_task

data_dir, rounds, nodes, in_memory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if in_memory:
    def refuse(*args, **kwargs):
        raise PermissionError("cache folder not writable")
    mosaicd.learning.data._write_cache = refuse
    mosaicd.learning.data._open_cache = lambda *args: None
after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
settings = Settings(task="cifar10", nodes=nodes, fanout=max(1, min(2, nodes - 1)), data_dir=data_dir,
                    batch_size=32, local_steps=5, lr=0.05)
task = build_task(settings)
started = time.perf_counter()
vector = task.initial(0)
for r in range(rounds):
    vector, loss = task.train(0, r, vector)
train_s = time.perf_counter() - started
metrics = task.evaluate(vector)
print(json.dumps({"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "after_imports_mb": round(after_import, 1), "params": task.layout.dim,
                  "shard": len(task.shard(0)), "train_s": round(train_s, 2), "loss": loss,
                  "accuracy": metrics["accuracy"]}))
"""


def measure(data_dir: str, rounds: int, nodes: int, in_memory: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, data_dir, str(rounds), str(nodes), "1" if in_memory else "0"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=1, help="n; the measured node is rank 0")
    parser.add_argument("--train", type=int, default=50_000)
    parser.add_argument("--test", type=int, default=10_000)
    parser.add_argument("--target-mb", type=float, default=400.0)
    args = parser.parse_args()

    from mosaicd.learning.data import write_synthetic

    with tempfile.TemporaryDirectory(prefix="mosaic-bench-") as tmp:
        started = time.perf_counter()
        write_synthetic("cifar10", tmp, train=args.train, test=args.test)
        print(f"wrote {args.train} + {args.test} synthetic CIFAR-10 images in {time.perf_counter() - started:.1f}s")
        results = {}
        for mode, in_memory in (("cold", False), ("warm", False), ("in_memory", True)):
            results[mode] = measure(tmp, args.rounds, args.nodes, in_memory)
            r = results[mode]
            print(f"{mode:>9}: peak RSS {r['peak_rss_mb']:.0f} MB (after imports {r['after_imports_mb']:.0f} MB), "
                  f"{args.rounds} rounds x H=5 in {r['train_s']}s")
    summary = {"bench": "memory_gnlenet", "target_mb": args.target_mb, "rounds": args.rounds, "nodes": args.nodes,
               "train_images": args.train, "test_images": args.test, **results,
               "peak_rss_mb": results["warm"]["peak_rss_mb"],
               "within_target": all(results[m]["peak_rss_mb"] < args.target_mb for m in ("cold", "warm"))}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

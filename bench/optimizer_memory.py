"""Memory of a node process by optimizer: does a torch.optim optimizer cost what its import promises?

`--optimizer sgd` is `torch_util.SGD` (torch.optim.SGD's arithmetic without constructing a torch.optim optimizer,
which imports torch._dynamo), `adam` and `adamw` on the CPU `torch_util.Adam` / `AdamW` (the same for torch.optim's
single-tensor step); every other optimizer is a torch.optim class. In a fresh process per optimizer, as a
node does: build the digits task, train `--rounds` rounds of node 0 (its state kept across rounds), and report
the resident set (VmRSS), its peak (VmHWM) and whether torch._dynamo was loaded. The reference is sgd, measured in
the same run; the ratio is each optimizer's RSS against it.

Usage: python bench/optimizer_memory.py [--rounds 5] [--optimizers sgd,adam,adamw,torch.optim:RAdam]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys
from mosaicd.settings import Settings
from mosaicd.learning.tasks import build_task

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

optimizer, rounds = sys.argv[1], int(sys.argv[2])
settings = Settings(task="digits", nodes=16, fanout=4, local_steps=5, optimizer=optimizer,
                    lr=0.05 if optimizer == "sgd" else 0.002)
task = build_task(settings)
vector = task.initial(0)
for r in range(rounds):
    vector, loss = task.train(0, r, vector)
print(json.dumps({"optimizer": optimizer, "rss_mb": round(status("VmRSS"), 1), "peak_mb": round(status("VmHWM"), 1),
                  "dynamo": "torch._dynamo" in sys.modules, "state_arrays": len(task.node_state(0)),
                  "loss": round(loss, 4)}))
"""


def measure(optimizer: str, rounds: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, optimizer, str(rounds)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizers", default="sgd,adam,adamw,torch.optim:RAdam")
    args = parser.parse_args()
    names = args.optimizers.split(",")
    if "sgd" not in names:
        names.insert(0, "sgd")
    rows = [measure(name, args.rounds) for name in names]
    reference = next(r for r in rows if r["optimizer"] == "sgd")
    print(f"{'optimizer':<20} {'RSS MiB':>8} {'peak MiB':>9} {'vs sgd':>7} {'+MiB':>6}  torch._dynamo")
    for r in rows:
        r["ratio"] = round(r["rss_mb"] / reference["rss_mb"], 2)
        r["extra_mb"] = round(r["rss_mb"] - reference["rss_mb"], 1)
        print(f"{r['optimizer']:<20} {r['rss_mb']:>8.1f} {r['peak_mb']:>9.1f} {r['ratio']:>6.2f}x {r['extra_mb']:>6.1f}"
              f"  {'loaded' if r['dynamo'] else 'not loaded'}")
    print(json.dumps({"rounds": args.rounds, "reference": "sgd", "rows": rows}))


if __name__ == "__main__":
    main()

"""The optimizer figure: digits, 16 nodes, K=4, s=4, Dirichlet 0.1, 60 rounds, H=5, three seeds, with SGD (its
state reset each round, as decentralizepy's default), SGD with momentum 0.9 kept across rounds, and Adam kept
across rounds; the node-average test accuracy per round (mean over the seeds, the band their min and max).

Each run is `mosaicd simulate` in this process (bit for bit what `cluster` gives). Writes OUT/optimizers.csv (one
row per optimizer, seed and round), OUT/optimizers.png and, as the last line of stdout, a JSON summary.

Usage: python bench/optimizers_digits.py [--out runs/optimizers] [--seeds 0,1,2] [--rounds 60]
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from mosaicd.experiments.simulate import run_simulation
from mosaicd.outputs import read_rounds
from mosaicd.settings import Settings

COMMON = {"task": "digits", "nodes": 16, "fragments": 4, "fanout": 4, "partition": "dirichlet", "alpha": 0.1,
          "local_steps": 5, "eval_every": 1}
CONFIGS = {  # each optimizer at a learning rate that suits it (SGD's is the quick start's)
    "SGD, state reset": {"lr": 0.05},  # plain SGD keeps no state: reset and keep are the same run
    "SGD momentum 0.9, kept": {"lr": 0.01, "momentum": 0.9},
    "Adam, kept": {"optimizer": "adam", "lr": 0.002},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/optimizers"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, final = [], {}
    for label, config in CONFIGS.items():
        for seed in seeds:
            started = time.perf_counter()
            settings = Settings.load(**COMMON, **config, seed=seed, rounds=args.rounds,
                                     out=args.out / f"{label.split(',')[0].replace(' ', '-').lower()}-{seed}")
            run_simulation(settings, progress=False, replace=True)
            for r in read_rounds(settings.out):
                rows.append({"optimizer": label, "seed": seed, "round": r["round"], "node_average": r["node_average"],
                             "average_model": r["average_model"], "train_loss": r["train_loss"]})
            final.setdefault(label, []).append(rows[-1]["node_average"])
            print(f"{label:<24} seed {seed}: node-average accuracy {rows[-1]['node_average']:.4f} at round "
                  f"{args.rounds - 1} ({time.perf_counter() - started:.1f} s)", flush=True)
    with open(args.out / "optimizers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "optimizers.png", seeds)
    summary = {label: {"final_mean": round(sum(v) / len(v), 4), "final_min": round(min(v), 4),
                       "final_max": round(max(v), 4)} for label, v in final.items()}
    for label, s in summary.items():
        print(f"{label:<24} final node-average accuracy {s['final_mean']:.4f} (seeds: {s['final_min']:.4f}-"
              f"{s['final_max']:.4f})")
    print(json.dumps({"out": str(args.out), "seeds": seeds, "rounds": args.rounds, "final": summary}))


def plot(rows: list[dict], path: Path, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label in CONFIGS:
        per_seed = [[r["node_average"] for r in rows if r["optimizer"] == label and r["seed"] == s] for s in seeds]
        acc = np.array(per_seed)
        rounds = np.arange(acc.shape[1])
        ax.plot(rounds, acc.mean(axis=0), label=label)
        ax.fill_between(rounds, acc.min(axis=0), acc.max(axis=0), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("node-average test accuracy")
    ax.set_title(f"digits, 16 nodes, K=4, s=4, Dirichlet 0.1, H=5 ({len(seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

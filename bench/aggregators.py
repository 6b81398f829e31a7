"""Cost of each aggregator per node and round, without attackers, against `mean` measured in the same run.

One node's aggregation step (`Aggregator.aggregate`, what `RoundState.finish` runs after the barrier) for a model
of d floats in K fragments (random layer-stratified fragmentation of a flat layout), where every fragment came
from `s` senders (EL-Local with fan-out s gives s fragments per fragment on average). Honest senders: the node's
own vector plus small noise, so that `clipped` clips nothing (its cost without attackers). The rules are timed
in turn, round after round (best of several loops each), so that a busy machine slows them alike; the figure is
milliseconds per aggregation and the ratio to `mean`.

Usage: .venv/bin/python bench/aggregators.py [--budget SECONDS]
Sizes: the digits CNN (14,826 floats), GN-LeNet for CIFAR-10 (89,834) and a 1M-float model; K in {1, 4}; s = 4.
The last line of stdout is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from mosaic_proto import Aggregator, Fragmentation, Layout

SIZES = {"digits CNN": 14_826, "GN-LeNet": 89_834, "1M floats": 1_000_000}
RULES = {"mean": Aggregator("mean"), "trimmed-mean": Aggregator("trimmed-mean", trim=1),
         "clipped": Aggregator("clipped", clip_radius=0.1)}


def inputs(d: int, k: int, senders: int) -> tuple[np.ndarray, Fragmentation, dict[int, dict[int, np.ndarray]]]:
    rng = np.random.default_rng([d, k, senders])
    fragmentation = Fragmentation.build(Layout.flat(d), k, seed=1)
    own = rng.standard_normal(d).astype(np.float32)
    received = {}
    for s in range(1, senders + 1):
        other = own + 0.01 * rng.standard_normal(d).astype(np.float32)
        received[s] = {f: fragmentation.take(other, f) for f in range(k)}
    return own, fragmentation, received


def seconds(rule: Aggregator, own: np.ndarray, fragmentation: Fragmentation,
            received: dict[int, dict[int, np.ndarray]], budget: float) -> float:
    """Seconds per aggregation: the best of 3 loops of about budget / 3 each."""
    def once() -> None:
        rule.aggregate(own, fragmentation, received)

    once()
    t0 = time.perf_counter()
    once()
    loops = max(1, int(budget / 3 / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(loops):
            once()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of timing per rule, size and K per pass")
    parser.add_argument("--passes", type=int, default=3, help="passes over the rules (the best pass is kept)")
    parser.add_argument("--senders", type=int, default=4, help="received contributions per fragment (s)")
    args = parser.parse_args()
    results = []
    print(f"{'model':>12} {'d':>9} {'K':>2} {'rule':>13} {'ms/aggregation':>15} {'x mean':>7}")
    for name, d in SIZES.items():
        for k in (1, 4):
            own, fragmentation, received = inputs(d, k, args.senders)
            best = {rule: float("inf") for rule in RULES}
            for _ in range(args.passes):  # interleaved: a busy moment slows every rule of the pass
                for rule, aggregator in RULES.items():
                    best[rule] = min(best[rule], seconds(aggregator, own, fragmentation, received, args.budget))
            for rule in RULES:
                ratio = best[rule] / best["mean"]
                print(f"{name:>12} {d:>9} {k:>2} {rule:>13} {best[rule] * 1e3:>15.3f} {ratio:>7.2f}")
                results.append({"model": name, "d": d, "K": k, "senders": args.senders, "rule": rule,
                                "ms": round(best[rule] * 1e3, 4), "ratio_to_mean": round(ratio, 3)})
    print(json.dumps({"machine": platform.processor() or platform.machine(), "results": results}))


if __name__ == "__main__":
    main()

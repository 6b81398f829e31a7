"""Consensus on identical quadratics: does fragmentation (K) speed up consensus? (the paper's quadratic claim)

Every node minimises the same f(x) = (x - x*)^T A (x - x*) with x* = 0, starting from its own x_0 ~ N(0, I).
One round: one gradient step (eta = 0.05), then Mosaic gossip over `InMemoryNetwork` (its batched rounds:
the models of RoundStates exchanging encoded messages, bit for bit; `high_k.py` checks that): EL-Local sampler,
s = 2, K fragments from Fragmentation.build(Layout.flat(d), K, seed) (random strategy). After R rounds we
measure the squared consensus error sum_i ||x_i - mean_j x_j||^2 and average it over seeds. Two curvatures:
  correlated: A = Q diag(linspace(0.1, 4, d)) Q^T, Q a seeded random rotation;
  diagonal:   A = diag(linspace(0.1, 4, d)).
The paper claims the error falls faster as K grows for correlated A, and that K makes no difference for
diagonal A. For a given seed every K shares A, x_0 and the sampler seed (paired comparison).

Usage: .venv/bin/python bench/consensus.py [--seeds 20] [--rounds 20] [--workers N]
The last line of stdout is a JSON object {"correlated": {"1": mean error, ...}, "diagonal": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic, consensus_error

N, D, S, LR, LOCAL_STEPS = 50, 16, 2, 0.05, 1
KS = (1, 2, 4, 8, 16)
CURVATURES = ("correlated", "diagonal")


def run_one(job: tuple[str, int, int, int]) -> list[float]:
    """Consensus error before round 0 and after each of `rounds` rounds, for one (curvature, K, seed)."""
    curvature, k, seed, rounds = job
    task = Quadratic.build(N, D, curvature, seed, lr=LR, local_steps=LOCAL_STEPS)  # homogeneous: x* = 0
    fragmentation = Fragmentation.build(Layout.flat(D), k, seed)
    net = InMemoryNetwork([task.initial(i) for i in range(N)], fragmentation, PeerSampler("local", S, seed),
                          task.train, run_id=f"consensus-{curvature}-k{k}-s{seed}")
    errors = [consensus_error(net.matrix())]
    net.run(rounds, on_round=lambda _: errors.append(consensus_error(net.matrix())))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    jobs = [(c, k, seed, args.rounds) for c in CURVATURES for k in KS for seed in range(args.seeds)]
    started = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(run_one, jobs, chunksize=4))
    else:
        results = [run_one(job) for job in jobs]
    elapsed = time.perf_counter() - started
    curves: dict[str, dict[int, np.ndarray]] = {c: {} for c in CURVATURES}
    for (c, k, _, _), errors in zip(jobs, results, strict=True):
        curves[c].setdefault(k, []).append(errors)
    curves = {c: {k: np.array(v) for k, v in per_k.items()} for c, per_k in curves.items()}  # seeds x (R+1)

    rounds = args.rounds
    marks = sorted({r for r in (rounds // 4, rounds // 2, 3 * rounds // 4) if 0 < r < rounds})
    print(f"Consensus on identical quadratics: n={N} d={D} sampler=local s={S} eta={LR} H={LOCAL_STEPS} "
          f"rounds={rounds} seeds={args.seeds} (InMemoryNetwork; {elapsed:.1f} s, "
          f"{args.workers} workers)")
    print("error = sum_i ||x_i - mean(x)||^2, mean over seeds; ratio = mean error / mean error at K=1; "
          "wins = seeds where K beats K=1")
    summary: dict[str, dict[str, float]] = {}
    for c in CURVATURES:
        base = curves[c][1]
        print(f"\nA {c}: initial error {base[:, 0].mean():.1f}")
        head = "".join(f"{'round ' + str(r):>12}" for r in marks)
        print(f"{'K':>3}{head}{'final mean':>13}{'final std':>12}{'ratio':>8}{'wins':>7}")
        summary[c] = {}
        for k in KS:
            e = curves[c][k]
            final = e[:, rounds]
            ratio = final.mean() / base[:, rounds].mean()
            wins = int((final < base[:, rounds]).sum()) if k > 1 else 0
            cells = "".join(f"{e[:, r].mean():>12.3e}" for r in marks)
            print(f"{k:>3}{cells}{final.mean():>13.3e}{final.std():>12.3e}{ratio:>8.3f}"
                  f"{(f'{wins}/{len(final)}' if k > 1 else '-'):>7}")
            summary[c][str(k)] = float(final.mean())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

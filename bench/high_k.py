"""High K against low K: seconds for R rounds of the paper's quadratic through `InMemoryNetwork`.

Since receivers check every message against its sender's plan (`planned_only`), a plan that is rebuilt per
message (one keyed generator per fragment) made K=16 cost 60x K=1; plans are now drawn once per (round, sender),
their picks computed by `keyed_choice` (numpy's algorithms on plain integers, the same picks). What K still adds
is ~12x the messages (each encoded, decoded, checked and accepted in Python) and K aggregation steps, against a
K=1 round of ~170 us per node. This prints the time of `--rounds` rounds
(n=50, d=16, s=2, EL-Local, correlated A, one gradient step per round) for each K, the ratio to K=1 measured
in the same run (the target: K=16 / K=1 <= 2x), and each run's model hash (so a change to the plans, which
must stay bit-identical, shows here as a changed hash).

Usage: .venv/bin/python bench/high_k.py [--rounds 20] [--fragments 1,16] [--repeat 3]
The last line of stdout is a JSON object {"seconds": {"1": ..., "16": ...}, "ratio": {"16": ...}, "sha256": {...}}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic

N, D, S, LR, SEED = 50, 16, 2, 0.05, 0


def run(k: int, rounds: int) -> tuple[float, str]:
    """Seconds for `rounds` rounds at K=k (setup excluded) and the SHA-256 of the final models."""
    task = Quadratic.build(N, D, "correlated", SEED, lr=LR, local_steps=1)
    net = InMemoryNetwork([task.initial(i) for i in range(N)], Fragmentation.build(Layout.flat(D), k, SEED),
                          PeerSampler("local", S, SEED), task.train, run_id=f"high-k-{k}")
    started = time.perf_counter()
    net.run(rounds)
    elapsed = time.perf_counter() - started
    return elapsed, hashlib.sha256(net.matrix().tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--fragments", default="1,16", help="comma-separated K values; the first is the reference")
    parser.add_argument("--repeat", type=int, default=3, help="runs per K, the best kept (the machine is shared)")
    args = parser.parse_args()
    ks = [int(k) for k in args.fragments.split(",")]
    seconds: dict[str, float] = {}
    hashes: dict[str, str] = {}
    for _ in range(args.repeat):  # interleaved, so that a busy spell hits every K alike
        for k in ks:
            elapsed, digest = run(k, args.rounds)
            seconds[str(k)] = min(seconds.get(str(k), elapsed), elapsed)
            hashes[str(k)] = digest
    base = seconds[str(ks[0])]
    print(f"{args.rounds} rounds of the quadratic, n={N} d={D} s={S}, InMemoryNetwork (best of {args.repeat})")
    print(f"{'K':>4}{'seconds':>10}{'ratio':>8}  model sha256")
    for k in ks:
        print(f"{k:>4}{seconds[str(k)]:>10.3f}{seconds[str(k)] / base:>8.2f}  {hashes[str(k)][:16]}")
    print(json.dumps({"rounds": args.rounds, "seconds": seconds,
                      "ratio": {str(k): seconds[str(k)] / base for k in ks[1:]}, "sha256": hashes}))


if __name__ == "__main__":
    main()

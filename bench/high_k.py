"""High K against low K: seconds for R rounds of the paper's quadratic through `InMemoryNetwork`.

A round of nodes that keep to the protocol is exchanged as arrays (`exchange.exchange_round`: every plan of the
round drawn at once by `keyed_table`, every model averaged in a few numpy calls). The per-message path
(`InMemoryNetwork(messages=True)`, what a daemon does: encode, decode, check and accept each message in Python)
pays for ~12x K=1's messages at K=16. This prints, for each K and both paths, the time of `--rounds` rounds (n=50,
d=16, s=2, EL-Local, correlated A, one gradient step per round), the ratio to the first K measured in the same run
(the target: K=16 / K=1 <= 2x on the default, batched path), and each run's model hash: the two paths must give the
same models (the script fails if they do not), and a change to the plans shows as a changed hash.

Usage: .venv/bin/python bench/high_k.py [--rounds 20] [--fragments 1,16] [--repeat 3]
The last line of stdout is a JSON object {"seconds": {"1": ..., "16": ...}, "ratio": {"16": ...}, "messages":
{"seconds": ..., "ratio": ...}, "sha256": {...}}: "seconds" and "ratio" are the batched path's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic

N, D, S, LR, SEED = 50, 16, 2, 0.05, 0


def run(k: int, rounds: int, messages: bool) -> tuple[float, str]:
    """Seconds for `rounds` rounds at K=k (setup excluded) and the SHA-256 of the final models."""
    task = Quadratic.build(N, D, "correlated", SEED, lr=LR, local_steps=1)
    net = InMemoryNetwork([task.initial(i) for i in range(N)], Fragmentation.build(Layout.flat(D), k, SEED),
                          PeerSampler("local", S, SEED), task.train, run_id=f"high-k-{k}", messages=messages)
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
    paths = {"batched": False, "messages": True}
    seconds: dict[str, dict[str, float]] = {path: {} for path in paths}
    hashes: dict[str, dict[str, str]] = {path: {} for path in paths}
    run(ks[0], 1, False)  # the first table checks itself against keyed_choice once per process: not timed
    for _ in range(args.repeat):  # interleaved, so that a busy spell hits every K and path alike
        for k in ks:
            for path, messages in paths.items():
                elapsed, digest = run(k, args.rounds, messages)
                seconds[path][str(k)] = min(seconds[path].get(str(k), elapsed), elapsed)
                hashes[path][str(k)] = digest
    if hashes["batched"] != hashes["messages"]:
        raise SystemExit(f"the batched and the per-message rounds gave different models: {hashes}")
    print(f"{args.rounds} rounds of the quadratic, n={N} d={D} s={S}, InMemoryNetwork (best of {args.repeat})")
    print(f"{'K':>4}{'batched s':>11}{'ratio':>8}{'messages s':>12}{'ratio':>8}  model sha256 (both paths)")
    ratio = {path: {str(k): seconds[path][str(k)] / seconds[path][str(ks[0])] for k in ks} for path in paths}
    for k in ks:
        key = str(k)
        print(f"{k:>4}{seconds['batched'][key]:>11.3f}{ratio['batched'][key]:>8.2f}"
              f"{seconds['messages'][key]:>12.3f}{ratio['messages'][key]:>8.2f}  {hashes['batched'][key][:16]}")
    print(json.dumps({"rounds": args.rounds, "seconds": seconds["batched"],
                      "ratio": {str(k): ratio["batched"][str(k)] for k in ks[1:]},
                      "messages": {"seconds": seconds["messages"],
                                   "ratio": {str(k): ratio["messages"][str(k)] for k in ks[1:]}},
                      "sha256": hashes["batched"]}))


if __name__ == "__main__":
    main()

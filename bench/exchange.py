"""A gossip round of `InMemoryNetwork` without training: batched (`exchange.exchange_round`) against message by message.

`mosaicd simulate` goes through `InMemoryNetwork`; a round of honest nodes is exchanged as arrays, any other message by
message (what the daemons do: encode, decode, check, accept). This times both on the same models over a grid of model
sizes d, fragment counts K, fan-outs s and node counts n (no training: the gossip alone), checks that both give the
same models, and prints milliseconds per round and their ratio (messages / batched: above 1, batching is faster).

Usage: .venv/bin/python bench/exchange.py [--rounds 10] [--repeat 3]
The last line of stdout is a JSON list of {"dim", "k", "fanout", "nodes", "batched_ms", "messages_ms", "speedup"}.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler

GRID = ((16, 1, 2, 50), (16, 16, 2, 50), (1000, 16, 4, 16), (14890, 1, 4, 16), (14890, 4, 4, 16),
        (100000, 16, 4, 16), (1000000, 1, 8, 16), (1000000, 16, 8, 16))  # 14890: about the digits CNN


def per_round(dim: int, k: int, fanout: int, nodes: int, rounds: int, messages: bool,
              cpu: list[float] | None = None) -> tuple[float, np.ndarray]:
    """Seconds per round after two warm-up rounds, and the final models; `cpu` gets the CPU seconds per round."""
    vectors = [np.random.default_rng(i).standard_normal(dim).astype(np.float32) for i in range(nodes)]
    net = InMemoryNetwork(vectors, Fragmentation.build(Layout.flat(dim), k, 0), PeerSampler("local", fanout, 0), None,
                          run_id="exchange", messages=messages)
    net.run(2)
    started, cpu_started = time.perf_counter(), time.process_time()
    net.run(rounds)
    if cpu is not None:
        cpu.append((time.process_time() - cpu_started) / rounds)
    return (time.perf_counter() - started) / rounds, net.matrix()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="runs per path, the best kept (interleaved)")
    args = parser.parse_args()
    rows = []
    print(f"{'d':>8}{'K':>4}{'s':>3}{'n':>4}{'batched ms':>12}{'messages ms':>13}{'speedup':>9}")
    for dim, k, fanout, nodes in GRID:
        best = {False: float("inf"), True: float("inf")}
        models = {}
        for _ in range(args.repeat):
            for messages in (False, True):
                seconds, models[messages] = per_round(dim, k, fanout, nodes, args.rounds, messages)
                best[messages] = min(best[messages], seconds)
        if not np.array_equal(models[False], models[True]):
            raise SystemExit(f"d={dim} K={k}: the batched and the per-message rounds gave different models")
        row = {"dim": dim, "k": k, "fanout": fanout, "nodes": nodes, "batched_ms": best[False] * 1e3,
               "messages_ms": best[True] * 1e3, "speedup": best[True] / best[False]}
        rows.append(row)
        print(f"{dim:>8}{k:>4}{fanout:>3}{nodes:>4}{row['batched_ms']:>12.2f}{row['messages_ms']:>13.2f}"
              f"{row['speedup']:>9.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

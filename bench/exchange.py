"""A gossip round of `InMemoryNetwork` without training: batched (`exchange.exchange_round`) against message by message.

`mosaicd simulate` goes through `InMemoryNetwork`; a round of honest nodes is exchanged as arrays, any other message by
message (what the daemons do: encode, decode, check, accept). This times both on the same models over a grid of model
sizes d, fragment counts K, fan-outs s and node counts n (no training: the gossip alone), checks that both give the
same models, and prints milliseconds per round and their ratio (messages / batched: above 1, batching is faster).

Usage: .venv/bin/python bench/exchange.py [--rounds 10] [--repeat 3] [--grid D,K,S,N;...] [--batched-only]
(--grid: the cases instead of the built-in grid; --batched-only: the batched path alone, for models whose per-message
rounds take long: no speedup, no check of the models.) The last line of stdout is a JSON object: "rows", a list of
{"dim", "k", "fanout", "nodes", "batched_ms", "messages_ms", "speedup"}, and "batched_ms", each case's milliseconds
by its name, "d<D>_k<K>_s<S>_n<N>" (what `ab.py --key batched_ms.<name>` compares between two versions of src).
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


def grid(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """--grid's cases: "D,K,S,N" separated by ";"."""
    try:
        cases = tuple(tuple(int(x) for x in case.split(",")) for case in text.split(";") if case.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"cases of four integers D,K,S,N separated by ';' (got {text!r})") from None
    if not cases or any(len(case) != 4 or min(case) < 1 for case in cases):
        raise argparse.ArgumentTypeError(f"cases of four positive integers D,K,S,N separated by ';' (got {text!r})")
    if any(k > dim or fanout >= nodes for dim, k, fanout, nodes in cases):
        raise argparse.ArgumentTypeError(f"each case needs K <= D and S < N (got {text!r})")
    return cases  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="runs per path, the best kept (interleaved)")
    parser.add_argument("--grid", type=grid, default=GRID, help="cases D,K,S,N separated by ';' (default: the "
                        "built-in grid)")
    parser.add_argument("--batched-only", action="store_true", help="time the batched path alone")
    args = parser.parse_args()
    rows = []
    paths = (False,) if args.batched_only else (False, True)
    print(f"{'d':>8}{'K':>4}{'s':>3}{'n':>4}{'batched ms':>12}{'messages ms':>13}{'speedup':>9}")
    for dim, k, fanout, nodes in args.grid:
        best = {messages: float("inf") for messages in paths}
        models = {}
        for _ in range(args.repeat):
            for messages in paths:
                seconds, models[messages] = per_round(dim, k, fanout, nodes, args.rounds, messages)
                best[messages] = min(best[messages], seconds)
        if not args.batched_only and not np.array_equal(models[False], models[True]):
            raise SystemExit(f"d={dim} K={k}: the batched and the per-message rounds gave different models")
        row = {"dim": dim, "k": k, "fanout": fanout, "nodes": nodes, "batched_ms": best[False] * 1e3,
               "messages_ms": best[True] * 1e3 if True in best else None,
               "speedup": best[True] / best[False] if True in best else None}
        rows.append(row)
        print(f"{dim:>8}{k:>4}{fanout:>3}{nodes:>4}{row['batched_ms']:>12.2f}"
              + ("" if args.batched_only else f"{row['messages_ms']:>13.2f}{row['speedup']:>9.2f}"), flush=True)
    print(json.dumps({"rows": rows, "batched_ms": {f"d{r['dim']}_k{r['k']}_s{r['fanout']}_n{r['nodes']}":
                                                   round(r["batched_ms"], 3) for r in rows}}))


if __name__ == "__main__":
    main()

"""`mosaicd cluster --sync async` on large messages: the seconds a node's link is busy per message it sends, in a
real cluster of daemons on loopback (signed unless `--insecure`).

Each node's link sends one queued message at a time and waits for its answer (`AsyncNode.send`), so its busy seconds
per message (`async.json`'s `link_s` over `sent`) hold both ends' work on it (the body's hash, the writes, the
receiver's read, check and decode) and the waits for a core among the other nodes' loops and, with `--train`, their
training. Settings: `--task quadratic --curvature diagonal --dim D --nodes N --fragments 4 --fanout 2 --rounds R`,
no profile. `nodes_cpu_s`: the node processes' CPU, their start included. On 2 cores the figures move by 10-30%
from one run to the next: compare versions with `ab.py`, several pairs.

Usage: python bench/async_link.py [--nodes 4] [--dim 2000000] [--rounds 60] [--repeat 3] [--insecure] [--no-train]
(the last line printed is JSON: the medians over the runs)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

from mosaicd.experiments.cluster_async import run_cluster_async
from mosaicd.settings import Settings


def one_run(out: Path, nodes: int, dim: int, rounds: int, insecure: bool, train: bool) -> dict[str, float]:
    settings = Settings.load(sync="async", task="quadratic", curvature="diagonal", dim=dim, nodes=nodes, fragments=4,
                             fanout=2, rounds=rounds, insecure=insecure, train=train, out=out)
    started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    run_cluster_async(settings, progress=False, timeout=600)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime  # the node processes, waited for
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("nodes/*/async.json"))]
    sent, link_s = sum(r["sent"] for r in reports), sum(r["link_s"] for r in reports)
    sent_bytes = sum(r["sent_bytes"] for r in reports)
    return {"wall_s": round(wall, 3), "messages": sent, "ms_per_message": round(1e3 * link_s / sent, 3),
            "nodes_cpu_s": round(cpu, 3), "steps": sum(r["steps"] for r in reports),
            "mb_per_s": round(sent_bytes / link_s / 1e6, 1),
            "steps_per_s": round(statistics.mean(r["steps_per_s"] for r in reports), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--insecure", action="store_true", help="no cluster secret: messages unsigned")
    parser.add_argument("--no-train", dest="train", action="store_false",
                        help="the nodes only aggregate and send: fewer messages (most are superseded in the queue), "
                             "so a peer's first message, which opens its stream, weighs more")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="async-link-") as tmp:
        for r in range(args.repeat):
            got = one_run(Path(tmp) / f"run-{r}", args.nodes, args.dim, args.rounds, args.insecure, args.train)
            runs.append(got)
            print(f"run {r + 1}/{args.repeat}: {got['messages']} messages of {4 * args.dim / 1e6:.1f} MB at most, "
                  f"{got['ms_per_message']:.2f} ms a message on the link ({got['mb_per_s']:.0f} MB/s), "
                  f"{got['steps_per_s']:.2f} steps/s a node, {got['wall_s']:.2f} s", flush=True)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"settings": vars(args), "runs": runs, **median}))


if __name__ == "__main__":
    main()

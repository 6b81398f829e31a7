"""The copies of the model a node holds at its round's aggregation, in a real `Cluster` run (issue 59, item 1).

It runs `mosaicd`'s `Cluster` (n node processes forked from the warm barrier; quadratic task, training off,
evaluation at the end only, as `round.py`) with a probe in every node process: `tracemalloc` from the node's
start and, at each `NodeState.settled` (the round aggregated, its received messages still held), the live
allocations of 1 MB or more with where they were made, and the traced peak since the last round (the peak is
inside the aggregation, with its transient arrays). The received messages' buffers that a node keeps across rounds
(`body.BodyBuffers`: mappings, which tracemalloc does not see) are added from the pool, in use ones only: they count
as copies, but not in the traced peak. A model-sized allocation made anywhere but the fragmentation's
index arrays (`Fragmentation.build`, `.positions`) counts as a copy of the model. The reference, measured in the
same terms: the copies the algorithm needs, 1 + s + 1 (the model, the s messages it receives, the aggregate).

The probe reaches the node processes through a `sitecustomize` on PYTHONPATH (a temporary folder) that calls
`install_probe` when COPIES_PROBE_DIR names the folder to write to. Rounds >= 3 are read: by then a node keeps
all the snapshots it would keep.

    .venv/bin/python bench/model_copies.py --nodes 5 --fanout 4 --fragments 1,16 --dim 11000000 --rounds 5
The last line of stdout is a JSON list with one row per K.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import sys
import tempfile
from functools import cache
from pathlib import Path

PROBE = "COPIES_PROBE_DIR"  # not MOSAIC_*: the cluster passes its environment on to the nodes but those
INDEX = {"build", "positions", "_assignment", "_indices"}  # the fragmentation's index arrays: not copies of the model


def install_probe() -> None:
    """In a node process: record the live large allocations at each round's aggregation (see the docstring)."""
    import tracemalloc

    from mosaic_proto import node
    from mosaicd.daemon.http import body

    folder, init, settled = os.environ[PROBE], node.NodeState.__init__, node.NodeState.settled

    def traced_init(self: node.NodeState, *args: object, **kwargs: object) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    def probed(self: node.NodeState, outcome: object) -> object:
        vector = settled(self, outcome)  # type: ignore[arg-type]
        current, peak = tracemalloc.get_traced_memory()
        big = [(size, [(f[0], f[1]) for f in frames])  # (filename, line), the newest frame first
               for _, size, frames, _ in tracemalloc.take_snapshot().traces._traces if size >= 1_000_000]
        # the received messages' kept buffers are mappings, which tracemalloc does not see
        big += [(size, [("<kept buffer>", 0)]) for size in body.kept_buffers().in_use() if size >= 1_000_000]
        with open(Path(folder) / f"{os.getpid()}-{self.round}.json", "w") as f:
            json.dump({"rank": self.rank, "round": self.round, "current": current, "peak": peak, "big": big}, f)
        tracemalloc.reset_peak()
        return vector

    node.NodeState.__init__, node.NodeState.settled = traced_init, probed  # type: ignore[method-assign]


@cache
def functions(filename: str) -> list[tuple[int, int, str]]:
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError):
        return []
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def made_by(frames: list[tuple[str, int]]) -> str:
    """The innermost function of ours (mosaic_proto, mosaicd) that made the allocation, as module.function."""
    for filename, line in frames:
        if "/mosaic_proto/" in filename or "/mosaicd/" in filename:
            inner = [(lo, name) for lo, hi, name in functions(filename) if lo <= line <= hi]
            return f"{Path(filename).stem}.{max(inner)[1] if inner else line}"
    return Path(frames[0][0]).stem if frames else "?"


def measure(n: int, k: int, s: int, d: int, rounds: int, out: Path) -> dict:
    from mosaicd.experiments.cluster import Cluster
    from mosaicd.settings import Settings

    probes = out / "probe"
    probes.mkdir(parents=True)
    settings = Settings.load(run_id=f"copies-n{n}-k{k}", nodes=n, rounds=rounds, fragments=k, fanout=s, dim=d,
                             task="quadratic", train=False, eval_every=0, round_deadline=900.0, request_timeout=300.0,
                             register_deadline=300.0, out=out / "run", insecure=True)
    os.environ[PROBE] = str(probes)
    try:
        Cluster(settings, progress=False).run(timeout=1800)
    finally:
        del os.environ[PROBE]
    model = 4 * d
    worst: dict = {}
    for path in probes.glob("*.json"):
        rec = json.loads(path.read_text())
        if rec["round"] < 3:
            continue
        sites = collections.Counter(made_by(frames) for size, frames in rec["big"] if abs(size / model - 1) < 0.01)
        index = sum(size for size, frames in rec["big"] if made_by(frames).split(".")[-1] in INDEX)
        copies = sum(c for site, c in sites.items() if site.split(".")[-1] not in INDEX)
        transient = round((rec["peak"] - rec["current"]) / model)
        row = {"copies_at_aggregation": copies, "transient": transient, "peak_copies": copies + transient,
               "index_mb": round(index / 1e6), "peak_traced_mb": round(rec["peak"] / 1e6), "sites": dict(sites)}
        if not worst or row["peak_copies"] > worst["peak_copies"]:
            worst = row
    return {"n": n, "K": k, "s": s, "d": d, "model_mb": round(model / 1e6, 1), "needed_copies": 1 + s + 1, **worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--fanout", type=int, default=4, help="s (capped at n - 1)")
    parser.add_argument("--fragments", default="1,16", help="comma-separated K values")
    parser.add_argument("--dim", type=int, default=11_000_000)
    parser.add_argument("--rounds", type=int, default=5, help="at least 4: rounds >= 3 are read")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4")
    s = min(args.fanout, args.nodes - 1)
    with tempfile.TemporaryDirectory(prefix="mosaic-bench-copies-") as tmp:
        hook = Path(tmp) / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(
            f"import os, sys\nif os.environ.get({PROBE!r}):\n    sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "    import model_copies\n    model_copies.install_probe()\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
        rows = [measure(args.nodes, int(k), s, args.dim, args.rounds, Path(tmp) / f"k{k}")
                for k in args.fragments.split(",")]
    print(f"bench/model_copies.py: n={args.nodes}, s={s}, d={args.dim} ({4 * args.dim / 1e6:.1f} MB a model), "
          f"rounds={args.rounds}; the node with the most copies, rounds >= 3")
    for row in rows:
        print(f"K={row['K']:>3}: {row['peak_copies']} copies at the peak ({row['copies_at_aggregation']} held at the "
              f"aggregation's end + {row['transient']} transient), {row['peak_copies'] / row['needed_copies']:.2f}x "
              f"the {row['needed_copies']} the algorithm needs; index arrays {row['index_mb']} MB; traced peak "
              f"{row['peak_traced_mb']} MB")
        for site, count in sorted(row["sites"].items(), key=lambda item: -item[1]):
            index = " (index data: not counted)" if site.split(".")[-1] in INDEX else ""
            print(f"       {count} x {site}{index}")
    print(json.dumps(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

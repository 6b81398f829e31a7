"""`mosaicd simulate` at internet scale: the cost of a node-round and the memory per node from 1,000 to 100,000
quadratic nodes, and `--batched` against the exact runner on digits and on the teacher task.

Part 1 (each size in a fresh process): `simulate --task quadratic --dim 16 --fragments 4 --fanout 4 --rounds 20
--eval-every 10` at each `--sizes`; per node-round wall, peak RSS (VmHWM) per node, the run folder's size per
1,000 node-rounds. The reference is the smallest size, measured in the same run: flat means the ratio stays near 1.

Part 2: exact and `--batched` on the same settings (`--device cpu`): digits, 32 nodes, K=8, s=4, 20 rounds, and
the teacher task at 1,000 nodes, K=4, s=4, H=5, 20 rounds (evaluated at rounds 9 and 19); the ratio exact/batched,
and the largest gap of the final metrics (node-average and average-model accuracy).

Usage: python bench/scale.py [--sizes 1000,10000,100000] [--rounds 20] [--no-batched] [--no-scale] [--repeat N]
[--cases digits,teacher] [--threads N]
(--repeat: each batched case N times, exact and batched alternating; the medians and their ratio are printed.
--threads: the runs' --threads; without it each run takes the setting's default, what a user's run gets. Every run
reports the threads its summary.json records, and its CPU seconds beside its wall: on a loaded machine the CPU ratio
moves less than the wall ratio. Each case also names the kernels numpy's BLAS ran (threadpoolctl): `--batched`
multiplies through it at one thread, and an environment that sets OPENBLAS_CORETYPE picks older ones.) The last line
printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
from mosaicd.settings import Settings
from mosaicd.experiments.simulate import run_simulation
out, settings = sys.argv[1], json.loads(sys.argv[2])
started, cpu = time.perf_counter(), time.process_time()
summary = run_simulation(Settings.load(**settings, out=out), progress=False)
wall, cpu = time.perf_counter() - started, time.process_time() - cpu
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
final = summary["final"]
from threadpoolctl import threadpool_info
blas = sorted({f"{p['internal_api']} {p.get('architecture')}" for p in threadpool_info() if p["user_api"] == "blas"})
print(json.dumps({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "threads": summary["settings"]["threads"],
                  "blas": ", ".join(blas),
                  "peak_mb": round(peak, 1), "folder_bytes": size,
                  "node_average": final.get("node_average"), "average_model": final.get("average_model")}))
"""


def run(out: Path, **settings: object) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), json.dumps(settings)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/scale.py: the run failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scale(sizes: list[int], rounds: int, root: Path) -> list[dict]:
    rows = []
    print(f"{'nodes':>8} {'wall':>8} {'us/node-round':>14} {'vs first':>9} {'peak RSS':>9} {'KiB/node':>9} "
          f"{'added KiB/node':>15} {'folder/1k node-rounds':>22}")
    for n in sizes:
        got = run(root / f"quadratic-{n}", task="quadratic", nodes=n, dim=16, fragments=4, fanout=4, rounds=rounds,
                  eval_every=10)
        node_rounds = n * rounds
        row = {"nodes": n, **got, "us_per_node_round": round(1e6 * got["wall_s"] / node_rounds, 1),
               "kib_per_node": round(got["peak_mb"] * 1024 / n, 2),
               "folder_kb_per_1000_node_rounds": round(got["folder_bytes"] / node_rounds, 1)}
        row["ratio"] = round(row["us_per_node_round"] / rows[0]["us_per_node_round"], 2) if rows else 1.0
        if rows:  # what each node adds, past the first size's (the interpreter, numpy and the modules)
            row["marginal_kib_per_node"] = round((got["peak_mb"] - rows[0]["peak_mb"]) * 1024 / (n - rows[0]["nodes"]),
                                                 2)
        rows.append(row)
        print(f"{n:>8,} {got['wall_s']:>7.1f}s {row['us_per_node_round']:>14.1f} {row['ratio']:>8.2f}x "
              f"{got['peak_mb']:>7.0f}MB {row['kib_per_node']:>9.2f} {row.get('marginal_kib_per_node', '-'):>15} "
              f"{row['folder_kb_per_1000_node_rounds']:>19.1f} kB",
              flush=True)
    return rows


CASES = {"digits": dict(task="digits", nodes=32, fragments=8, fanout=4),
         "teacher": dict(task="teacher", nodes=1000, fragments=4, fanout=4, local_steps=5, lr=0.1,
                         partition="dirichlet", alpha=0.3, eval_every=10)}


def batched(root: Path, rounds: int, repeat: int, cases: list[str], threads: int | None) -> list[dict]:
    rows = []
    pinned = {} if threads is None else {"threads": threads}
    print(f"\n{'case':<16} {'threads':>7} {'exact':>8} {'batched':>8} {'exact/batched':>14} {'CPU ratio':>10} "
          f"{'gap node-avg':>13} {'gap avg-model':>14}")
    for case in cases:
        settings = {**CASES[case], "rounds": rounds, "device": "cpu", **pinned}
        name = f"{case} n={settings['nodes']}"
        runs: dict[str, list[dict]] = {"exact": [], "batched": []}
        for r in range(repeat):  # interleaved, so that a change of load falls on both
            exact = run(root / f"{case}-exact-{r}", **settings)
            fast = run(root / f"{case}-batched-{r}", **settings, batched=True)
            runs["exact"].append(exact)
            runs["batched"].append(fast)
        walls = {kind: [got["wall_s"] for got in each] for kind, each in runs.items()}
        cpus = {kind: [got["cpu_s"] for got in each] for kind, each in runs.items()}
        used = sorted({got["threads"] for each in runs.values() for got in each})
        kernels = sorted({got["blas"] for each in runs.values() for got in each})
        exact_s, batched_s = statistics.median(walls["exact"]), statistics.median(walls["batched"])
        cpu_ratio = statistics.median(cpus["exact"]) / statistics.median(cpus["batched"])
        row = {"case": name, "threads": used, "blas": kernels, "exact_s": exact_s, "batched_s": batched_s,
               "ratio": round(exact_s / batched_s, 2), "cpu_ratio": round(cpu_ratio, 2),
               "exact_walls": walls["exact"], "batched_walls": walls["batched"], "exact_cpus": cpus["exact"],
               "batched_cpus": cpus["batched"],
               "gap_node_average": abs(exact["node_average"] - fast["node_average"]),
               "gap_average_model": abs(exact["average_model"] - fast["average_model"])}
        rows.append(row)
        each = f"  (exact {walls['exact']}, batched {walls['batched']})" if repeat > 1 else ""
        print(f"{name:<16} {','.join(map(str, used)):>7} {exact_s:>7.1f}s {batched_s:>7.1f}s {row['ratio']:>13.2f}x "
              f"{row['cpu_ratio']:>9.2f}x {row['gap_node_average']:>13.2e} {row['gap_average_model']:>14.2e}{each}",
              flush=True)
        print(f"{'':<16} numpy's BLAS: {'; '.join(kernels)}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-batched", action="store_true")
    parser.add_argument("--no-scale", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each batched case (exact and batched "
                        "alternating); the medians are compared")
    parser.add_argument("--cases", default=",".join(CASES), help="batched cases to run: " + ", ".join(CASES))
    parser.add_argument("--threads", type=int, default=None, help="--threads of every run (default: the setting's "
                        "default, as a user's run)")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        parser.error(f"--cases: choose from {', '.join(CASES)}, comma-separated (got {args.cases!r})")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: at least 1 (got {args.threads})")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mosaic-scale-") as tmp:
        root = Path(tmp)
        sizes = [] if args.no_scale else scale([int(n) for n in args.sizes.split(",")], args.rounds, root)
        fast = [] if args.no_batched else batched(root, args.rounds, args.repeat, cases, args.threads)
    print(json.dumps({"rounds": args.rounds, "scale": sizes, "batched": fast,
                      "bench_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()

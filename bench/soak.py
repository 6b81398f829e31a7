"""A protocol-only soak: --rounds rounds (default 1,000) of a 16-node loopback cluster, watching for anything
that grows with the rounds: resident memory, open file descriptors, sockets, asyncio tasks.

    .venv/bin/python bench/soak.py                         # 16 nodes x 1,000 rounds: ~70 s on 2 idle cores
    .venv/bin/python bench/soak.py --nodes 8 --rounds 300  # a quick look

It runs `mosaicd cluster` (`Cluster`: one barrier and --nodes node processes on 127.0.0.1) protocol-only: the
quadratic task without training (--no-train), d = --dim, K=4, s=2, evaluation only at the end, without the
cluster secret (`--insecure`): with it, every member remembers each signed request's nonce for twice the auth
window (2 x 60 s, at most 200,000), by design, which a two-minute soak would read as growth; that memory is
bounded by the window, not by the rounds. Every --every
rounds it samples each process: resident memory (VmRSS of /proc/PID/status), open file descriptors (the
entries of /proc/PID/fd), how many of them are sockets (links to "socket:[...]"), and asyncio tasks (the
`mosaic_asyncio_tasks` gauge of the process's /metrics, scraped after the /proc reads). The sample nearest
the end is taken --every/2 rounds or more before the last round, while every process still runs.

Verdict, per process, over the samples after the first --warmup rounds (allocator arenas, connection pools
and caches fill up first):
- memory: a least-squares line through RSS against the round. Its slope (MiB per 100 rounds) times the
  rounds the fit spans is the growth; the noise is the residual standard deviation of the fit. Flat means
  growth <= max(--flat-kib x the rounds spanned, 3 x noise): less than --flat-kib (3 KiB) per round, or
  within the noise. A leak of a page (4 KiB) per round fails; the barrier's history of releases (one row
  per round, kept for /v1/history and the dashboard: about 1.5 KiB per round measured here) passes with
  room for noise in its slope.
- descriptors, sockets and tasks: work in flight at the moment of a sample (a connection being made, the
  barrier's waiting long polls: its task count swings by the node count) only adds to a count, so the
  floor of each count is what a leak raises. The floor over the second half of the fitted samples may
  exceed the floor over the first half by at most --slack. One leaked per round is about +375 at the
  default settings; one every 25 rounds, +15.

Prints one line per sample, one per process, and as the last line of stdout a JSON object: seconds per round,
the slopes, noise and growth, the counts at start and end, `leaks` (what failed, in words) and `ok`. The
ratio against a reference measured in the same run is `growth_over_allowance_max`: the largest memory growth
over its allowance (<= 1 is flat). The cluster's own files (logs, summary.json) go to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from mosaicd.experiments.cluster import Cluster
from mosaicd.progress import RoundProgress
from mosaicd.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TASKS = re.compile(r"^mosaic_asyncio_tasks (\S+)$", re.M)
COUNTS = ("fds", "sockets", "tasks")


def probe_proc(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open descriptors and sockets of one process, from /proc."""
    rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed between listdir and readlink
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return {"rss_mib": rss_kib / 1024, "fds": fds, "sockets": sockets}


def scrape_tasks(port: int) -> float:
    """The process's asyncio task count, from its /metrics (NaN when the gauge is missing)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        found = TASKS.search(resp.read().decode())
    return float(found.group(1)) if found else math.nan


class Sampler:
    """`on_round` of the cluster: a sample of every process at rounds 0, every, 2*every, ... while they run."""

    def __init__(self, cluster: Cluster, rounds: int, every: int, verbose: bool = True) -> None:
        self.cluster, self.rounds, self.every, self.verbose = cluster, rounds, every, verbose
        self.next = 0
        self.last = rounds - max(1, every // 2)  # no sample later: processes begin to finish
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []

    def __call__(self, progress: RoundProgress) -> None:
        if progress.round < self.next or progress.round > self.last:
            return
        self.next = (progress.round // self.every + 1) * self.every
        ports = {"barrier": self.cluster.barrier_port,
                 **{f"node-{i}": p for i, p in enumerate(self.cluster.node_ports)}}
        pids = {name: proc.pid for name, proc in self.cluster.procs.items() if proc.poll() is None}
        if set(pids) != set(ports):
            return  # a process is gone: the run will fail or end; no partial sample
        t = time.monotonic() - self.t0
        procs = {name: probe_proc(pid) for name, pid in pids.items()}  # /proc first: the scrapes open sockets
        for name, port in ports.items():
            procs[name]["tasks"] = scrape_tasks(port)
        self.samples.append({"round": progress.round, "t": t, "procs": procs})
        if self.verbose:
            print_sample(self.samples[-1])


def print_sample(sample: dict[str, Any]) -> None:
    nodes = [v for k, v in sample["procs"].items() if k != "barrier"]
    barrier = sample["procs"]["barrier"]
    print(f"{sample['round']:6d} {sample['t']:7.1f}s  nodes: rss {sum(v['rss_mib'] for v in nodes):7.1f} MiB "
          f"(max {max(v['rss_mib'] for v in nodes):5.1f})  fds {sum(v['fds'] for v in nodes):4d}  sockets "
          f"{sum(v['sockets'] for v in nodes):4d}  tasks {sum(v['tasks'] for v in nodes):4.0f}  |  barrier: rss "
          f"{barrier['rss_mib']:5.1f} MiB  fds {barrier['fds']:3d}  sockets {barrier['sockets']:3d}  tasks "
          f"{barrier['tasks']:3.0f}", flush=True)


def fit(rounds: list[int], values: list[float]) -> tuple[float, float]:
    """(slope per round, residual standard deviation) of the least-squares line through the points."""
    x, y = np.asarray(rounds, float), np.asarray(values, float)
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (slope * x + intercept)
    return float(slope), float(math.sqrt(float(residuals @ residuals) / max(1, len(x) - 2)))


def judge(samples: list[dict[str, Any]], warmup: int, slack: int, flat_kib: float) -> dict[str, Any]:
    """Per process: the RSS line, noise and growth after the warm-up, and the counts at its start and end;
    `leaks`: each process whose memory is not flat or whose fds, sockets or tasks grew by more than `slack`."""
    kept = [s for s in samples if s["round"] >= warmup]
    if len(kept) < 3:
        raise ValueError(f"{len(kept)} samples after the warm-up of {warmup} rounds: need at least 3 "
                         "(more --rounds, a smaller --warmup or --every)")
    rounds = [s["round"] for s in kept]
    span = rounds[-1] - rounds[0]
    per: dict[str, dict[str, Any]] = {}
    leaks: list[str] = []
    for name in kept[0]["procs"]:
        rss = [s["procs"][name]["rss_mib"] for s in kept]
        slope, noise = fit(rounds, rss)
        growth, allowance = slope * span, max(flat_kib * span / 1024, 3 * noise)
        row = {"rss_start_mib": rss[0], "rss_end_mib": rss[-1], "rss_slope_mib_per_100_rounds": slope * 100,
               "rss_noise_mib": noise, "rss_growth_mib": growth, "rss_allowance_mib": allowance}
        if growth > allowance:
            leaks.append(f"{name}: RSS grows {growth:.2f} MiB over rounds {rounds[0]}-{rounds[-1]} "
                         f"({slope * 100:.3f} MiB per 100 rounds; allowed {allowance:.2f} MiB)")
        half = len(kept) // 2
        for key in COUNTS:
            values = [s["procs"][name][key] for s in kept]
            start, end = min(values[:half]), min(values[half:])  # floors: work in flight only adds to a count
            row[f"{key}_start"], row[f"{key}_end"], row[f"{key}_max"] = start, end, max(values)
            if not end <= start + slack:  # NaN (no gauge) fails too
                leaks.append(f"{name}: {key} at least {start:g} in rounds {rounds[0]}-{rounds[half - 1]}, at least "
                             f"{end:g} in rounds {rounds[half]}-{rounds[-1]} (more than +{slack})")
        per[name] = row
    return {"first_round": rounds[0], "last_round": rounds[-1], "procs": per, "leaks": leaks}


def summary(samples: list[dict[str, Any]], verdict: dict[str, Any], args: argparse.Namespace,
            wall_s: float) -> dict[str, Any]:
    """The JSON line: totals over the nodes, the barrier's own figures, the verdict."""
    kept = [s for s in samples if s["round"] >= args.warmup]
    procs = verdict["procs"]
    nodes = {k: v for k, v in procs.items() if k != "barrier"}

    def over_nodes(key: str) -> dict[str, float]:
        values = [v[key] for v in nodes.values()]
        return {"max": round(max(values), 4), "median": round(statistics.median(values), 4)}

    def floors(key: str) -> dict[str, float]:
        """Sums over the processes of each one's floor in either half, and of its highest count."""
        return {"first_half": sum(v[f"{key}_start"] for v in procs.values()),
                "second_half": sum(v[f"{key}_end"] for v in procs.values()),
                "max": sum(v[f"{key}_max"] for v in procs.values())}

    return {
        "nodes": args.nodes, "rounds": args.rounds, "every": args.every, "warmup": args.warmup,
        "samples": len(samples), "fitted_rounds": [verdict["first_round"], verdict["last_round"]],
        "seconds_per_round": round((kept[-1]["t"] - kept[0]["t"]) / (kept[-1]["round"] - kept[0]["round"]), 4),
        "wall_s": round(wall_s, 1),
        "node_rss_mib": {"start": round(sum(v["rss_start_mib"] for v in nodes.values()), 1),
                         "end": round(sum(v["rss_end_mib"] for v in nodes.values()), 1)},
        "node_rss_slope_mib_per_100_rounds": over_nodes("rss_slope_mib_per_100_rounds"),
        "node_rss_noise_mib": over_nodes("rss_noise_mib"),
        "node_rss_growth_mib": over_nodes("rss_growth_mib"),
        "barrier_rss_mib": {"start": round(procs["barrier"]["rss_start_mib"], 1),
                            "end": round(procs["barrier"]["rss_end_mib"], 1)},
        "barrier_rss_slope_mib_per_100_rounds": round(procs["barrier"]["rss_slope_mib_per_100_rounds"], 4),
        "barrier_rss_noise_mib": round(procs["barrier"]["rss_noise_mib"], 4),
        "growth_over_allowance_max": round(max(v["rss_growth_mib"] / v["rss_allowance_mib"]
                                               for v in procs.values()), 3),
        "fds_floor": floors("fds"), "sockets_floor": floors("sockets"), "tasks_floor": floors("tasks"),
        "slack": args.slack, "flat_kib_per_round": args.flat_kib,
        "leaks": verdict["leaks"], "ok": not verdict["leaks"],
    }


def print_processes(verdict: dict[str, Any]) -> None:
    print(f"\nrounds {verdict['first_round']}-{verdict['last_round']}; fds, sockets, tasks: floor in the first half > "
          "in the second half")
    print(f"{'process':9s} {'rss MiB':>15s} {'MiB/100 rounds':>14s} {'noise':>6s} {'growth':>7s} {'allowed':>7s}"
          f" {'fds':>9s} {'sockets':>9s} {'tasks':>9s}")
    for name, v in verdict["procs"].items():
        counts = " ".join(f"{v[f'{k}_start']:4g}>{v[f'{k}_end']:<4g}" for k in COUNTS)
        print(f"{name:9s} {v['rss_start_mib']:7.1f}>{v['rss_end_mib']:<7.1f} "
              f"{v['rss_slope_mib_per_100_rounds']:14.3f} {v['rss_noise_mib']:6.2f} {v['rss_growth_mib']:7.2f} "
              f"{v['rss_allowance_mib']:7.2f} {counts}")
    for leak in verdict["leaks"]:
        print(f"LEAK {leak}")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=positive, default=16)
    parser.add_argument("--rounds", type=positive, default=1000)
    parser.add_argument("--every", type=positive, default=50, help="rounds between samples")
    parser.add_argument("--warmup", type=int, default=200, help="rounds before the fitted samples")
    parser.add_argument("--dim", type=positive, default=16, help="model size d of the quadratic task")
    parser.add_argument("--slack", type=int, default=8, help="growth of fds, sockets or tasks still no leak")
    parser.add_argument("--flat-kib", type=float, default=3.0, help="RSS growth per round (KiB) taken as flat")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the run may take")
    parser.add_argument("--quiet", action="store_true", help="no line per sample")
    args = parser.parse_args()
    if not 0 <= args.warmup <= args.rounds - 3 * args.every:
        parser.error(f"--warmup {args.warmup}: must leave 3 samples (--every {args.every}) before --rounds "
                     f"{args.rounds}")
    if args.nodes < 3:
        parser.error(f"--nodes {args.nodes}: a fanout of 2 needs at least 3 nodes")

    settings = Settings(nodes=args.nodes, rounds=args.rounds, fragments=4, fanout=2, task="quadratic",
                        dim=args.dim, train=False, eval_every=0, seed=0, out=args.out, log_level="warning",
                        round_deadline=60, register_deadline=120, insecure=True)
    cluster = Cluster(settings, progress=False)  # unsigned: see the module's docstring
    sampler = Sampler(cluster, args.rounds, args.every, verbose=not args.quiet)
    cluster.on_round = sampler
    print(f"soak: {args.nodes} nodes x {args.rounds} rounds, protocol-only (d={args.dim}), a sample every "
          f"{args.every} rounds, fitted after round {args.warmup}", flush=True)
    started = time.monotonic()
    cluster.run(timeout=args.timeout)
    verdict = judge(sampler.samples, args.warmup, args.slack, args.flat_kib)
    print_processes(verdict)
    print(json.dumps(summary(sampler.samples, verdict, args, time.monotonic() - started)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

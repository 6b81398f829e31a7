"""Asynchronous Mosaic against synchronous Mosaic and AD-PSGD, accuracy against virtual time (issue 60, item 7).

digits, 32 nodes, Dirichlet alpha = 0.1, s = 4, H = 1, lr 0.05; every node trains an iteration (a round's H steps)
in compute_s = 1 s, and its uplink moves BANDWIDTH bytes/s with LATENCY s of latency (a model of 59,304 bytes in
0.124 s, so a round's s = 4 copies take half a compute step). Two scenarios: "slow links", a quarter of the nodes
(8, drawn from the seed) with 10x slower uplinks, and "no slow links". Six curves, each `mosaicd simulate` with
those node profiles, so that every time axis is the same virtual clock (compute_s x slowdown per iteration,
bytes / bandwidth per message, latency once per message):

    sync K=1 (EL), sync K=8        --sync barrier (rounds: every node waits for the slowest; no deadline)
    async K=1, async K=8           --sync async (a node sends the model it trained: --async-send trained)
    async K=8 (sends aggregated)   --sync async --async-send aggregated (it sends the aggregate)
    AD-PSGD                        --sync async --exchange pairwise

Each curve runs for the same virtual time (--horizon; a barrier round lasts the slowest node's compute plus its
sends, an asynchronous node does horizon / compute_s iterations) and is evaluated about every 5 virtual seconds.
Runs go over every core (a process pool, one run per process, largest first), each printed as it ends.

Writes OUT/async_figure.csv (scenario, curve, seed, virtual_s, round, node_average, average_model),
OUT/async_figure.png (two panels: node-average accuracy, mean over seeds with the min-max band) and prints the
time to each of --targets (80% and 90% node-average accuracy) of each curve (per seed: the first evaluation at or
above it, linearly interpolated from the one before), with its ratio to sync K=1 of the same scenario; the last line
is JSON.

    .venv/bin/python bench/async_figure.py                 # the figure: 36 runs, 754 CPU-s (~6 min on 2 idle cores)
    .venv/bin/python bench/async_figure.py --small         # 8 nodes, 1 seed, 10 virtual s: a quick check
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

MODEL_BYTES = 59_304  # digits' GroupNorm CNN in float32 (checked against the task in main)
COMPUTE_S = 1.0
BANDWIDTH = 480_000  # bytes/s: a model in 0.124 s
SLOW = 10  # the slow uplinks' bandwidth is BANDWIDTH / SLOW
LATENCY = 0.02
FANOUT = 4
EVAL_S = 5.0  # about how often (virtual seconds) each curve is evaluated
COMMON = {"task": "digits", "partition": "dirichlet", "alpha": 0.1, "local_steps": 1, "lr": 0.05, "threads": 1}
CURVES: dict[str, dict[str, Any]] = {
    "sync K=1 (EL)": {"sync": "barrier", "fragments": 1, "fanout": FANOUT},
    "sync K=8": {"sync": "barrier", "fragments": 8, "fanout": FANOUT},
    "async K=1 (EL)": {"sync": "async", "fragments": 1, "fanout": FANOUT},
    "async K=8": {"sync": "async", "fragments": 8, "fanout": FANOUT},
    "async K=8 (sends aggregated)": {"sync": "async", "fragments": 8, "fanout": FANOUT, "async_send": "aggregated"},
    "AD-PSGD": {"sync": "async", "exchange": "pairwise"},  # one whole model to one peer per iteration
}
SCENARIOS = {"slow links": 0.25, "no slow links": 0.0}  # the share of nodes with SLOW x slower uplinks
REFERENCE = "sync K=1 (EL)"


def profile_text(slow_share: float) -> str:
    text = f"compute_s = {COMPUTE_S}\n[default]\nbandwidth = {BANDWIDTH}\nlatency = {LATENCY}\n"
    if slow_share:
        text += f"[[draw]]\nshare = {slow_share}\nbandwidth = {BANDWIDTH / SLOW}\n"
    return text


def round_s(slow_share: float) -> float:
    """A barrier round on the virtual clock: the slowest node's compute, latency and s copies of the model (K does
    not change the bytes)."""
    bandwidth = BANDWIDTH / SLOW if slow_share else BANDWIDTH
    return COMPUTE_S + LATENCY + FANOUT * MODEL_BYTES / bandwidth


def plan(horizon: float, slow_share: float, curve: str) -> tuple[int, int]:
    """(rounds or iterations, eval_every) so that the curve covers `horizon` virtual seconds."""
    if CURVES[curve]["sync"] == "barrier":
        each = round_s(slow_share)
        return max(1, math.floor(horizon / each + 1e-9)), max(1, round(EVAL_S / each))
    return max(1, math.floor(horizon / COMPUTE_S + 1e-9)), max(1, round(EVAL_S / COMPUTE_S))


def run_name(curve: str) -> str:
    """A curve's runs' folder name: "async K=8 (sends aggregated)" -> "async-K8-sends-aggregated" ("(EL)" left out)."""
    return "-".join(curve.replace("(EL)", "").replace("=", "").replace("(", "").replace(")", "").split())


def one_run(job: dict[str, Any]) -> dict[str, Any]:
    """One simulate run in this (pool) process: its evaluation rows up to the horizon."""
    from mosaicd.experiments.simulate import run_simulation
    from mosaicd.rundir.read import read_rounds
    from mosaicd.settings import Settings

    started, cpu = time.perf_counter(), time.process_time()
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    profile = out.with_suffix(".toml")
    profile.write_text(profile_text(job["slow_share"]))
    settings = Settings.load(**COMMON, **CURVES[job["curve"]], nodes=job["nodes"], seed=job["seed"],
                             rounds=job["rounds"], eval_every=job["eval_every"], node_profile=profile, out=out)
    summary = run_simulation(settings, progress=False, replace=True, advise=False)
    rows = [{"scenario": job["scenario"], "curve": job["curve"], "seed": job["seed"],
             "virtual_s": r["virtual_s"], "round": r["round"], "node_average": r["node_average"],
             "average_model": r["average_model"]}
            for r in read_rounds(out) if r["virtual_s"] <= job["horizon"] + 1e-6]
    return {"job": job, "rows": rows, "wall_s": round(time.perf_counter() - started, 1),
            "cpu_s": round(time.process_time() - cpu, 1),
            "virtual_s": summary.get("virtual_s") or (rows[-1]["virtual_s"] if rows else None)}


def time_to(rows: list[dict[str, Any]], target: float) -> float:
    """The virtual time one run's node-average accuracy first reaches `target` (linear between evaluations; the
    start counts as accuracy 0 at time 0), or inf."""
    before_t, before_a = 0.0, 0.0
    for r in rows:
        t, a = r["virtual_s"], r["node_average"]
        if a >= target:
            return before_t + (t - before_t) * (target - before_a) / (a - before_a) if a > before_a else t
        before_t, before_a = t, a
    return math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/async-figure"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--horizon", type=float, default=200.0, help="virtual seconds each curve covers")
    parser.add_argument("--targets", default="0.8,0.9", help="node-average accuracies to time (the first is drawn)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (default: every core)")
    parser.add_argument("--small", action="store_true", help="a quick check: 8 nodes, seed 0, 10 virtual s")
    args = parser.parse_args()
    if args.small:
        args.nodes, args.seeds, args.horizon = 8, "0", 10.0
    seeds = [int(s) for s in args.seeds.split(",")]
    args.targets = [float(t) for t in args.targets.split(",")]
    if args.nodes < 4 or args.horizon <= 0 or not all(0 < t <= 1 for t in args.targets) or args.jobs < 1:
        parser.error("--nodes >= 4, --horizon > 0, each of --targets in (0, 1] and --jobs >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    check_model_bytes()
    jobs = []
    for scenario, share in SCENARIOS.items():
        for curve in CURVES:
            rounds, eval_every = plan(args.horizon, share, curve)
            for seed in seeds:
                name = f"{'slow' if share else 'even'}-{run_name(curve)}-{seed}"
                jobs.append({"scenario": scenario, "slow_share": share, "curve": curve, "seed": seed,
                             "nodes": args.nodes, "rounds": rounds, "eval_every": eval_every,
                             "horizon": args.horizon, "out": str((args.out / "runs" / name).resolve())})
    jobs.sort(key=lambda j: -j["rounds"])  # the longest first: the pool ends together
    print(f"{len(jobs)} runs on {args.jobs} processes; links {BANDWIDTH / 1e3:g} kB/s (slow: {BANDWIDTH / SLOW / 1e3:g}"
          f" kB/s), latency {LATENCY} s, compute {COMPUTE_S} s; a barrier round {round_s(0):.3f} s "
          f"({round_s(0.25):.3f} s with slow links); load {os.getloadavg()[0]:.1f}", flush=True)
    started, results = time.perf_counter(), []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(one_run, job) for job in jobs]
        for n, future in enumerate(as_completed(futures), 1):
            result = future.result()
            job, rows = result["job"], result["rows"]
            results.append(result)
            last = rows[-1] if rows else {"node_average": math.nan, "virtual_s": math.nan}
            print(f"[{n}/{len(jobs)}] {job['scenario']:<13} {job['curve']:<28} seed {job['seed']}: "
                  f"{job['rounds']} {'rounds' if CURVES[job['curve']]['sync'] == 'barrier' else 'iterations'}, "
                  f"node-average {last['node_average']:.3f} at {last['virtual_s']:.1f} virtual s "
                  f"({result['wall_s']} s wall, {result['cpu_s']} CPU-s; {time.perf_counter() - started:.0f} s in all, "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
    rows = [row for r in sorted(results, key=lambda r: (list(SCENARIOS).index(r["job"]["scenario"]),
                                                       list(CURVES).index(r["job"]["curve"]), r["job"]["seed"]))
            for row in r["rows"]]
    with open(args.out / "async_figure.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tables = {f"{target:g}": targets(rows, seeds, target) for target in args.targets}
    plot(rows, seeds, args, args.out / "async_figure.png")
    for target, table in tables.items():
        print(f"\ntime to {float(target):.0%} node-average accuracy (virtual s; mean over seeds, min-max; the ratio to "
              f"{REFERENCE} of the same scenario, < 1 is faster):")
        for scenario, curves in table.items():
            for curve, t in curves.items():
                spread = f"{t['min_s']:.1f}-{t['max_s']:.1f}" if t["reached"] == len(seeds) else f"{t['reached']}/" \
                    f"{len(seeds)} seeds reach it"
                ratio = f"{t['ratio']:.2f}x" if t["ratio"] is not None else "-"
                mean = f"{t['mean_s']:>7.1f} s" if t["mean_s"] is not None else "    -    "
                print(f"  {scenario:<13} {curve:<28} {mean} ({spread})  {ratio}  final {t['final']:.3f}")
    wall, cpu = time.perf_counter() - started, sum(r["cpu_s"] for r in results)
    print(f"{len(jobs)} runs in {wall:.0f} s wall, {cpu:.0f} CPU-s in the runs; load {os.getloadavg()[0]:.1f}; CSV and "
          f"PNG in {args.out}")
    print(json.dumps({"out": str(args.out), "nodes": args.nodes, "seeds": seeds, "horizon_s": args.horizon,
                      "jobs": args.jobs, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                      "time_to_target": tables}))


def targets(rows: list[dict[str, Any]], seeds: list[int], target: float) -> dict[str, dict[str, dict[str, Any]]]:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario in SCENARIOS:
        for curve in CURVES:
            per_seed = [[r for r in rows if r["scenario"] == scenario and r["curve"] == curve and r["seed"] == s]
                        for s in seeds]
            times = [time_to(run, target) for run in per_seed]
            reached = [t for t in times if math.isfinite(t)]
            mean = sum(times) / len(times) if len(reached) == len(times) else math.inf
            table.setdefault(scenario, {})[curve] = {
                "mean_s": round(mean, 2) if math.isfinite(mean) else None,  # None: a seed does not reach it
                "min_s": round(min(reached), 2) if reached else None,
                "max_s": round(max(reached), 2) if reached else None, "reached": len(reached),
                "final": round(sum(run[-1]["node_average"] for run in per_seed if run) / len(per_seed), 4)}
        reference = table[scenario][REFERENCE]["mean_s"]
        for t in table[scenario].values():
            t["ratio"] = round(t["mean_s"] / reference, 3) if t["mean_s"] is not None and reference else None
    return table


def plot(rows: list[dict[str, Any]], seeds: list[int], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    styles = {"sync K=1 (EL)": ("tab:blue", "--"), "sync K=8": ("tab:orange", "--"),
              "async K=1 (EL)": ("tab:blue", "-"), "async K=8": ("tab:orange", "-"),
              "async K=8 (sends aggregated)": ("tab:red", ":"), "AD-PSGD": ("tab:green", "-")}
    for ax, (scenario, share) in zip(axes, SCENARIOS.items(), strict=True):
        for curve in CURVES:
            per_seed = [[r for r in rows if r["scenario"] == scenario and r["curve"] == curve and r["seed"] == s]
                        for s in seeds]
            points = min(len(run) for run in per_seed)
            if points == 0:
                continue
            acc = np.array([[r["node_average"] for r in run[:points]] for run in per_seed])
            when = np.array([r["virtual_s"] for r in per_seed[0][:points]])
            color, line = styles[curve]
            ax.plot(when, acc.mean(axis=0), line, color=color, label=curve)
            ax.fill_between(when, acc.min(axis=0), acc.max(axis=0), color=color, alpha=0.15)
        ax.axhline(args.targets[0], color="grey", lw=0.8, ls=":")
        title = (f"{scenario}: {round(share * args.nodes)} of {args.nodes} nodes' uplinks {SLOW}x slower"
                 if share else f"{scenario}: every uplink {BANDWIDTH / 1e3:g} kB/s")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("virtual time (s; one iteration's compute = 1 s)")
        ax.set_xlim(0, args.horizon)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("node-average test accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"digits, {args.nodes} nodes, Dirichlet 0.1, s={FANOUT}, H=1; {BANDWIDTH / 1e3:g} kB/s uplinks, "
                 f"{LATENCY * 1e3:g} ms; mean of {len(seeds)} seed{'s' * (len(seeds) > 1)}, band min-max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_model_bytes() -> None:
    """The link times above assume digits' model size; say so if the model changed."""
    from mosaicd.learning.tasks import build_task
    from mosaicd.settings import Settings

    values = sum(math.prod(shape) for shape in build_task(Settings.load(task="digits", nodes=4)).layout.shapes)
    if values * 4 != MODEL_BYTES:
        sys.exit(f"bench/async_figure.py: digits' model is {values * 4} bytes, MODEL_BYTES says {MODEL_BYTES}: "
                 "update it (and the bandwidth's comment)")


if __name__ == "__main__":
    main()

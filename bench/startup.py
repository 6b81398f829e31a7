"""Start-up of a local cluster: launch to round 0 released, digits nodes, warm start against cold, and with Adam
against SGD (issue 59 item 2), with each node's memory.

Launch: `Cluster.run` is called (this script has imported `mosaicd` already; `cli_import_s`, the time a fresh
interpreter takes to import `mosaicd.cli`, is measured apart and added in `launch_to_round0_cli_s`, the figure
a user of `mosaicd cluster` waits). Round 0 released: the timestamp of the barrier's `released` log line of
round 0 (out/logs/barrier.log, UTC, microseconds). The same log gives the steps between: the barrier
listening, the first node registered, registration closed. The run is the tutorial's job (bench/tutorial.py)
cut to 4 rounds without evaluation: what happens before round 0 is released does not depend on the rounds.

Warm (the default of `mosaicd cluster`): the barrier process imports, builds the task and warms torch up (and the
run's optimizer: what torch.optim imports, torch._dynamo), then forks the nodes. Cold, the reference measured in the
same run: every process a fresh interpreter that imports and builds for itself (`Cluster(warm=False)`).
Adam: the warm run with `--optimizer adam`, against the warm SGD run (`adam_sgd`: the median over the repeats of
Adam / SGD launch to round 0, each Adam run against the SGD run just before it); RMSprop the same (`rmsprop_sgd`: a
torch.optim class, whose torch._dynamo the warm parent imports once for all nodes).
Memory: every 0.5 s while the run lasts, each node's RSS and USS (psutil: USS is what the process alone holds, the
pages it shares with the warm parent left out), each node's largest kept; the median and largest over the nodes,
and the barrier's (the warm parent's).

Batched: the first `train_many` of `simulate --batched` against the second, in a fresh interpreter, with SGD and
with Adam: `digits-vmap` (digits' CNN through torch.func.vmap, as on an accelerator: `stacked_train` forced on),
`digits` and `teacher` (the CPU's defaults: digits one model after another, the teacher's MLP through batched matrix
products). `first_call_extra_s` is what the first call pays; `dynamo_imported`: whether torch._dynamo was loaded
(torch.func's grad imports it, as torch.optim's optimizers do: whichever comes first pays it, once per process).

    .venv/bin/python bench/startup.py              # warm SGD, Adam, RMSprop, cold SGD, 3 runs each (medians), 16 nodes
    .venv/bin/python bench/startup.py --repeat 3 --nodes 8 --no-cold    # the optimizers: ~2 min on 2 busy cores
    .venv/bin/python bench/startup.py --repeat 1 --no-adam --no-rmsprop --no-batched   # warm against cold only

Last line of stdout: a JSON object {"sgd": {...}, "adam": {...}, "cold": {...}, "batched": {...},
"ratio": warm/cold launch_to_round0_s, "adam_sgd": adam/sgd launch_to_round0_s, "rmsprop_sgd", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from mosaicd.experiments.cluster import Cluster
from mosaicd.logs import configure_logging
from mosaicd.settings import Settings

STEPS = {"listening": "barrier_listening_s", "registered": "first_registered_s",
         "registration_closed": "registration_closed_s"}


def barrier_events(log: Path) -> dict[str, float]:
    """Unix time of the first `listening`, `registered`, `registration_closed` and round 0 `released` lines."""
    found: dict[str, float] = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        if name == "released" and event.get("round") != 0:
            continue
        if name in (*STEPS, "released") and name not in found:
            found[name] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    return found


class NodeMemory:
    """The largest RSS and USS seen of each process under this one while a run lasts (a thread sampling them)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s, self.rss, self.uss = every_s, {}, {}
        self.barriers: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> NodeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self.every_s):
            for child in me.children(recursive=True):
                try:
                    if child.ppid() == me.pid:
                        self.barriers.add(child.pid)  # warm: the barrier, the nodes' parent
                    info = child.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                self.rss[child.pid] = max(self.rss.get(child.pid, 0), info.rss)
                self.uss[child.pid] = max(self.uss.get(child.pid, 0), info.uss)

    def figures(self) -> dict[str, float]:
        mib = 1 << 20
        nodes = [pid for pid in self.uss if pid not in self.barriers]
        if not nodes:
            return {}
        found = {"nodes_sampled": len(nodes)}
        for name, table in (("rss", self.rss), ("uss", self.uss)):
            values = [table[pid] / mib for pid in nodes]
            found[f"node_{name}_median_mib"] = round(statistics.median(values), 1)
            found[f"node_{name}_max_mib"] = round(max(values), 1)
            barrier = [table[pid] / mib for pid in self.barriers if pid in table]
            if barrier:
                found[f"barrier_{name}_mib"] = round(max(barrier), 1)
        return found


def run_once(warm: bool, nodes: int, workdir: Path, index: int, optimizer: str = "sgd") -> dict[str, float]:
    out = workdir / f"{'warm' if warm else 'cold'}-{optimizer}-{index}"
    settings = Settings.load(task="digits", nodes=nodes, rounds=4, sampler="local", fanout=min(4, nodes - 1),
                             fragments=1, local_steps=10, batch_size=16, lr=0.005 if optimizer == "adam" else 0.05,
                             partition="dirichlet", alpha=0.1, eval_every=0, optimizer=optimizer, out=out)
    launched = time.time()
    with NodeMemory() as memory:
        Cluster(settings, progress=False, warm=warm).run(timeout=600)
    events = barrier_events(out / "logs" / "barrier.log")
    if "released" not in events:
        raise SystemExit(f"no release of round 0 in {out / 'logs' / 'barrier.log'}")
    result = {"launch_to_round0_s": round(events["released"] - launched, 3)}
    for name, key in STEPS.items():
        if name in events:
            result[key] = round(events[name] - launched, 3)
    return {**result, **(memory.figures() if warm else {})}


BATCHED = """
import json, sys, time
import torch
from mosaicd.learning.tasks import build_task
from mosaicd.settings import Settings

run = Settings.load(task=sys.argv[2], nodes=8, rounds=2, fanout=2, batched=True, optimizer=sys.argv[1],
                    lr=0.005 if sys.argv[1] == "adam" else 0.05).run_config()
task = build_task(run)
if sys.argv[3] == "vmap":
    task.stacked_train = True  # through torch.func.vmap, as on an accelerator (on the CPU digits goes one by one)
nodes = list(range(run.nodes))
vectors = [task.initial(n) for n in nodes]
calls = []
for index in range(2):
    started = time.perf_counter()
    task.train_many(nodes, index, vectors)
    calls.append(time.perf_counter() - started)
print(json.dumps({"first_call_s": round(calls[0], 3), "second_call_s": round(calls[1], 3),
                  "first_call_extra_s": round(calls[0] - calls[1], 3),
                  "dynamo_imported": "torch._dynamo" in sys.modules}))
"""


BATCHED_CASES = {"digits-vmap": ("digits", "vmap"), "digits": ("digits", "default"), "teacher": ("teacher", "default")}


def batched_first_call(optimizer: str, case: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", BATCHED, optimizer, *BATCHED_CASES[case]], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cli_import_seconds() -> float:
    """A fresh interpreter importing `mosaicd.cli` (what `mosaicd cluster` does before it launches): best of 3."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import mosaicd.cli"], check=True)
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def _medians(runs: list[dict[str, float]]) -> dict[str, Any]:
    figures: dict[str, Any] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]
                               if all(key in r for r in runs) and key != "nodes_sampled"}
    figures["runs"] = [r["launch_to_round0_s"] for r in runs]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant, interleaved; figures are medians")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold reference")
    parser.add_argument("--no-adam", action="store_true", help="skip the warm run with --optimizer adam")
    parser.add_argument("--no-rmsprop", action="store_true", help="skip the warm run with --optimizer rmsprop")
    parser.add_argument("--no-batched", action="store_true", help="skip the batched first call")
    args = parser.parse_args()
    configure_logging("warning")
    cli = cli_import_seconds()
    report: dict[str, Any] = {"nodes": args.nodes, "repeat": args.repeat, "cli_import_s": cli}
    variants = {"sgd": (True, "sgd")}
    if not args.no_adam:
        variants["adam"] = (True, "adam")
    if not args.no_rmsprop:
        variants["rmsprop"] = (True, "rmsprop")
    if not args.no_cold:
        variants["cold"] = (False, "sgd")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="mosaic-startup-") as tmp:
        for i in range(args.repeat):  # interleaved: the machine's load falls on every variant alike
            for name, (warm, optimizer) in variants.items():
                runs[name].append(run_once(warm, args.nodes, Path(tmp), i, optimizer))
    for name, done in runs.items():
        figures = _medians(done)
        figures["launch_to_round0_cli_s"] = round(figures["launch_to_round0_s"] + cli, 3)
        report[name] = figures
        steps = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in figures.items()
                          if k.endswith("_s") and k != "launch_to_round0_s")
        memory = (f"; node USS median {figures['node_uss_median_mib']} MiB (max {figures['node_uss_max_mib']}), "
                  f"RSS {figures['node_rss_median_mib']} MiB; barrier USS {figures.get('barrier_uss_mib')} MiB"
                  if "node_uss_median_mib" in figures else "")
        label = {"sgd": "warm sgd", "adam": "warm adam", "rmsprop": "warm rmsprop", "cold": "cold sgd"}[name]
        print(f"{label:12s} launch to round 0 released: {figures['launch_to_round0_s']:.2f} s ({steps}){memory}")
    if "cold" in report:
        report["ratio"] = round(report["sgd"]["launch_to_round0_s"] / report["cold"]["launch_to_round0_s"], 3)
        print(f"warm / cold: {report['ratio']}")
    for name in ("adam", "rmsprop"):
        if name in report:  # each run against the SGD run just before it (interleaved: the same load), median
            pairs = [a["launch_to_round0_s"] / b["launch_to_round0_s"]
                     for a, b in zip(runs[name], runs["sgd"], strict=True)]
            report[f"{name}_sgd"] = round(statistics.median(pairs), 3)
            report[f"{name}_sgd_runs"] = [round(p, 3) for p in pairs]
            uss = [report[v].get("node_uss_median_mib") for v in (name, "sgd")]
            report[f"{name}_sgd_node_uss_mib"] = round(uss[0] - uss[1], 1) if None not in uss else None
            print(f"{name} / sgd: {report[f'{name}_sgd']} (runs {report[f'{name}_sgd_runs']}; node USS median "
                  f"{report[f'{name}_sgd_node_uss_mib']:+} MiB)")
    if not args.no_batched:
        report["batched"] = {f"{case} {optimizer}": batched_first_call(optimizer, case)
                             for case in BATCHED_CASES for optimizer in ("sgd", "adam")}
        for name, figures in report["batched"].items():
            print(f"batched {name}: first train_many {figures['first_call_s']:.2f} s, second "
                  f"{figures['second_call_s']:.2f} s (first pays {figures['first_call_extra_s']:.2f} s; "
                  f"torch._dynamo imported: {figures['dynamo_imported']})")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

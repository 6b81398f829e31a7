"""What a forked node pays after registering for the first fragmentation and plan of its run, with and without the
warm parent's `warm_protocol` (issue 59 item 3).

The tutorial job's task (digits, K=1, EL-Local s=4) is built as the warm start's parent builds it; then a child is
forked (`--children` times) and times, in CPU milliseconds, its `Fragmentation.build` (what `Peer.set_model` does
as it learns the run) and its first sampler plan (`PeerSampler.share`, what its first message received asks for).
`cold`: the parent forks without `warm_protocol`, as before; `warm`: after it. Each mode runs in a fresh interpreter
of its own (the caches it warms are per process).

    .venv/bin/python bench/warm_fork.py

Last line of stdout: JSON {"cold": {"build_ms": [...], "plan_ms": [...]}, "warm": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tutorial import tutorial_settings

from mosaic_proto.fragmentation import Fragmentation
from mosaic_proto.sampling import PeerSampler


def one_mode(mode: str, children: int) -> dict[str, list[float]]:
    """In this interpreter: build the task, warm (or not), fork `children` children one after the other."""
    from mosaicd.experiments.warm import warm_protocol
    from mosaicd.learning.tasks import build_task

    settings = tutorial_settings(Path("/nonexistent"), rounds=60, nodes=16)
    run = settings.run_config()
    task = build_task(run, settings.data_dir)
    task.initial(0)
    if mode == "warm":
        warm_protocol(run, task.layout)
    result: dict[str, list[float]] = {"build_ms": [], "plan_ms": []}
    for _ in range(children):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: what a node does first, timed
            os.close(read)
            started = time.process_time()
            Fragmentation.build(task.layout, run.fragments, run.seed, run.strategy)
            built = time.process_time()
            PeerSampler(run.sampler, run.fanout, run.seed).share(0, 3, run.fragments, tuple(range(run.nodes)), 5)
            planned = time.process_time()
            os.write(write, json.dumps([1000 * (built - started), 1000 * (planned - built)]).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            build_ms, plan_ms = json.loads(pipe.read())
        os.waitpid(pid, 0)
        result["build_ms"].append(round(build_ms, 2))
        result["plan_ms"].append(round(plan_ms, 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=3, help="children forked per mode")
    parser.add_argument("--mode", choices=["cold", "warm"], help=argparse.SUPPRESS)  # one mode, in a fresh process
    args = parser.parse_args()
    if args.children < 1:
        parser.error(f"--children: expected at least 1, got {args.children}")
    if args.mode:
        print(json.dumps(one_mode(args.mode, args.children)))
        return
    report = {}
    for mode in ("cold", "warm"):
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--children", str(args.children)],
                              capture_output=True, text=True, timeout=300, check=True)
        report[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:4s}: a forked child's fragmentation build {report[mode]['build_ms']} ms CPU, its first plan "
              f"{report[mode]['plan_ms']} ms")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""What 16 processes time-sharing the cores cost the training itself: the tutorial job's training, in one process
against one process per node, all at once.

The tutorial job (`tutorial.py`) is CPU-bound, and its nodes' training threads spend more CPU than `simulate`'s
training does for the same work. This isolates that part: the same training steps (digits CNN, H=10, batch 16,
every node's data and rounds, no gossip, each node training on its own model) run (a) node after node in this
process, on one core, as `simulate` does, and (b) in one forked process per node, all at once on every core, as
`mosaicd cluster` runs them, and (c) as (b) but taking turns: a process trains a round while it holds one of
`cores` slots (an exclusive flock on a slot file). The CPU seconds of (b) over (a) is what time-sharing costs the
training (cache and scheduler), measured in the same run; (c) over (a) what is left of it when no more trainers
than cores run at once. The variants alternate, and the best of `--repeat` counts. `--also` adds per-node
variants of (b), each set in the child before it trains: `pinned` (node i on core i % cores), `batch`
(SCHED_BATCH), `slice100` / `slice20` (EEVDF's custom slice of 100 / 20 ms, Linux >= 6.12, x86_64),
`batch+slice100`, `pinned+batch`.

Usage: .venv/bin/python bench/time_sharing.py [--rounds 60] [--nodes 16] [--repeat 2] [--also pinned,batch]
Last line of stdout: a JSON object {"one_process_cpu_s": ..., "per_node_processes_cpu_s": ..., "ratio": ...,
"taking_turns_cpu_s": ..., "ratio_taking_turns": ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import resource
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tutorial import tutorial_settings

from mosaicd.learning.tasks import build_task


def train(task: Any, nodes: list[int], rounds: int, turn: Any = contextlib.nullcontext) -> None:
    vectors = {i: task.initial(i) for i in nodes}
    for r in range(rounds):
        for i in nodes:
            with turn():
                vectors[i], _ = task.train(i, r, vectors[i])


def slot_turns(slots: list[Path]) -> Any:
    """In the calling process: a context that holds one of `slots` (an exclusive flock, tried in turn)."""
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in slots]

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        wait = 0.0005
        while True:
            for fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                return
            time.sleep(wait)
            wait = min(2 * wait, 0.005)
    return turn


def one_process(task: Any, nodes: int, rounds: int) -> float:
    started = time.process_time()
    train(task, list(range(nodes)), rounds)
    return time.process_time() - started


def pinned(i: int) -> None:
    """Node i on core i % cores (of those this process may use)."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[i % len(cores)]})


def batch(i: int) -> None:
    """SCHED_BATCH: no wake-up preemption, longer slices."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def long_slice(i: int, ms: int = 100, policy: int = os.SCHED_OTHER) -> None:
    """EEVDF's slice for this thread (Linux >= 6.12: sched_setattr's sched_runtime for SCHED_OTHER): ms, not ~1.5."""
    import ctypes
    import struct

    attr = struct.pack("=IIQiIQQQII", 56, policy, 0, 0, 0, ms * 1_000_000, 0, 0, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(314, 0, ctypes.c_char_p(attr), 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr")


SETUPS = {"pinned": pinned, "batch": batch, "pinned+batch": lambda i: (pinned(i), batch(i)),
          "slice100": long_slice, "slice20": lambda i: long_slice(i, 20),
          "batch+slice100": lambda i: long_slice(i, 100, os.SCHED_BATCH)}


def per_node_processes(task: Any, nodes: int, rounds: int, slots: list[Path] | None = None,
                       setup: Any = None) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    children: list[int] = []
    try:
        for i in range(nodes):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    if setup is not None:
                        setup(i)
                    train(task, [i], rounds, slot_turns(slots) if slots else contextlib.nullcontext)
                    code = 0
                except KeyboardInterrupt:  # Ctrl-C reached the whole group: the parent says so, once
                    code = 130
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            children.append(pid)
        while children:
            _, status = os.waitpid(children[0], 0)
            children.pop(0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"a training process failed (exit status {os.waitstatus_to_exitcode(status)})")
    finally:  # failed or interrupted: the other training processes are stopped, not left running
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each variant, alternating; the best counts")
    parser.add_argument("--also", default="", metavar="V[,V]",
                        help=f"more per-node variants, each in turn with the others: {', '.join(SETUPS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mosaic-time-sharing-") as tmp:
        settings = tutorial_settings(Path(tmp), args.rounds, args.nodes)
        task = build_task(settings.run_config(), settings.data_dir)
        task.train(0, 0, task.initial(0))  # data loaded and the kernels warm before either variant, as in a node
        slots = [Path(tmp) / f"slot-{i}" for i in range(len(os.sched_getaffinity(0)))]
        also = [v for v in args.also.split(",") if v]
        one, many, turns = [], [], []
        more: dict[str, list[float]] = {v: [] for v in also}
        for _ in range(args.repeat):
            one.append(one_process(task, args.nodes, args.rounds))
            many.append(per_node_processes(task, args.nodes, args.rounds))
            turns.append(per_node_processes(task, args.nodes, args.rounds, slots))
            for v in also:
                more[v].append(per_node_processes(task, args.nodes, args.rounds, setup=SETUPS[v]))
            print(f"one process {one[-1]:.2f} CPU-s, {args.nodes} processes at once {many[-1]:.2f} CPU-s, "
                  f"taking turns {turns[-1]:.2f}" + "".join(f", {v} {more[v][-1]:.2f}" for v in also), flush=True)
    ratio, ratio_turns = min(many) / min(one), min(turns) / min(one)
    print(f"training of {args.nodes} nodes x {args.rounds} rounds (best of {args.repeat}): one process "
          f"{min(one):.2f} CPU-s; one process per node {min(many):.2f} CPU-s on {len(slots)} cores ({ratio:.2f}x), "
          f"taking turns {min(turns):.2f} ({ratio_turns:.2f}x)")
    print(json.dumps({"nodes": args.nodes, "rounds": args.rounds, "one_process_cpu_s": round(min(one), 2),
                      "per_node_processes_cpu_s": round(min(many), 2), "ratio": round(ratio, 3),
                      "taking_turns_cpu_s": round(min(turns), 2), "ratio_taking_turns": round(ratio_turns, 3),
                      **{f"{v}_cpu_s": round(min(more[v]), 2) for v in also},
                      **{f"ratio_{v}": round(min(more[v]) / min(one), 3) for v in also}}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit("interrupted: no figures") from None

"""`tutorial.py --phases`: the CPU seconds of each phase of a process's work, in every process of a run.

Python imports `sitecustomize` at start-up from the first folder on its path that has one: `tutorial.py --phases`
puts this folder first on the cluster's PYTHONPATH and names a folder in `BENCH_PHASES_DIR`. Each process then
times, on its thread's CPU clock, every call of `TorchTask.train` (a node's local steps), `TorchTask.evaluate_one`
(one model's evaluation: a node's own, the barrier's average model, simulate's every model) and
`checkpoint.Slots.save` (a node's checkpoint), and keeps {phase: [calls, CPU-s]} in BENCH_PHASES_DIR/<pid>.json,
written after each call (a few tens of microseconds). A node forked from the warm parent starts from zero. Set
nothing, and this module does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

DIR_VARIABLE = "BENCH_PHASES_DIR"
_totals: dict[str, list[float]] = {}
_lock = threading.Lock()  # a node trains, evaluates and saves in worker threads


def _write() -> None:
    path = os.path.join(os.environ[DIR_VARIABLE], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(_totals, f)
    os.replace(path + ".tmp", path)


def _timed(owner: type, name: str, phase: str) -> None:
    work: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return work(*args, **kwargs)
        finally:
            took = time.thread_time() - started
            with _lock:
                total = _totals.setdefault(phase, [0, 0.0])
                total[0] += 1
                total[1] += took
                _write()

    setattr(owner, name, timed)


def install() -> None:
    """Time the phases in this process (and the processes it forks, each from zero)."""
    from mosaicd.daemon.node.checkpoint import Slots
    from mosaicd.learning.tasks.torch_task import TorchTask

    _timed(TorchTask, "train", "train")
    _timed(TorchTask, "evaluate_one", "evaluate")
    _timed(Slots, "save", "checkpoint")
    os.register_at_fork(after_in_child=_totals.clear)


if os.environ.get(DIR_VARIABLE):
    install()

"""Start-up work done before a node knows its rank: import the task's modules, pay torch's first-call costs.

`prefetch_in_background` imports a task's modules in a thread while a node registers (registration waits for every
node anyway), so a node that is told the run is already past the imports. That thread runs at the node's own
priority: what it has not imported by the roster is on round 0's path, whose deadline runs from the roster. At nice
19, as it once ran, a host busy with other work starved it (a loaded CI host: every member of a 6-node run with 2 s
rounds ready ~10 s after the roster, all dropped), and an unprivileged process cannot take nice 19 back.

`warm_up` is the warm start's (`mosaicd cluster`): one forward and backward pass of a built task and one step of the
run's optimizer on a dummy parameter (what torch.optim imports, torch._dynamo, then lives in the parent's pages,
shared), in the process that then forks the nodes. It runs with one torch thread, so that no OpenMP pool thread
exists at the fork (GNU libgomp's pool does not survive fork(); a child that uses it can hang); each forked process
sets the run's thread count itself (`set_threads`).

`mosaicd node` imports with the cyclic garbage collector off (`collect_after_imports`) until those imports are done: the
imports make ~200,000 objects that live as long as the process, and the ~470 collections that their allocations
triggered scanned them again and again: 0.26-0.34 of the ~2.3 CPU-s a compose node spends before its first round
(bench/README.md, Speed 4 item 4). Then they are frozen (`gc.freeze`, as the warm start does before it forks) and
collection resumes.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from typing import Any


def collect_after_imports() -> None:
    """No cyclic garbage collection in this process until its start-up imports are done (`imports_done`)."""
    gc.disable()


def imports_done() -> None:
    """Where `collect_after_imports` held collection off, what the imports made is frozen (kept out of every later
    collection: it lives as long as the process) and collection resumes; elsewhere nothing changes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def prefetch_in_background(task: str) -> asyncio.Future:
    """The task's imports (`learning.tasks.import_task_modules`) in a thread of its own; done when they are."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work() -> None:
        from mosaicd.learning.tasks import import_task_modules

        try:
            import_task_modules(task)
        finally:
            imports_done()
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop ended meanwhile (the node stopped before it needed the imports)
                pass

    threading.Thread(target=work, name="mosaic-prefetch", daemon=True).start()
    return done


def set_threads(threads: int) -> None:
    """The run's torch thread count in this process (no-op where torch was never imported)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def warm_up(task: Any) -> float:
    """One training step's forward and backward, one step of the run's optimizer on a dummy parameter and one
    evaluation batch on `task` (node 0's data), leaving the model's state as it was; returns the seconds it took.
    Torch tasks only; others have nothing to warm."""
    started = time.perf_counter()
    if "torch" not in sys.modules:
        return 0.0
    import torch

    from mosaicd.learning.tasks.torch_task import TorchTask

    if not isinstance(task, TorchTask):
        return 0.0
    torch.set_num_threads(1)  # no OpenMP pool before fork(); see the module's docstring
    split, shard = task.split, task.shard(0)
    model = task.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        if len(shard):
            idx = shard[:max(1, min(task.run.batch_size, len(shard)))]
            model.train()
            task.loss(model(task.inputs(split.x_train[idx])), task.targets(split.y_train[idx])).backward()
        if len(split.y_test):
            model.eval()
            with torch.no_grad():
                model(task.inputs(split.x_test[:min(64, len(split.y_test))]))
        if task.run.train and task.run.local_steps > 0:
            from mosaicd.learning.tasks.optim import Schedule

            task.optimizers.warm()  # torch.optim's imports (torch._dynamo) once here, not in every node
            Schedule(task.run).factor(0)  # a torch.optim.lr_scheduler class's too
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)
        torch.set_num_threads(task.run.threads)  # sets the count only: threads start at the first parallel region
    seconds = time.perf_counter() - started
    from mosaicd.logs import get_logger

    get_logger(role="warmup").info("warmed_up", task=task.name, seconds=round(seconds, 3))
    return seconds

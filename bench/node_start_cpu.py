"""One node's start-up CPU, phase by phase, in the image's own Python (`bench/README.md`, "Speed 4, item 4"):

    docker run --rm -v $PWD/bench/node_start_cpu.py:/n.py:ro --entrypoint python mosaic:latest /n.py
    docker run --rm -e HOLD=0 ...      # the same with the garbage collector on during the imports

It imports what `mosaicd node` imports before it registers, then its task's modules as the node's background
thread does (`learning.tasks.import_task_modules("digits")`), builds the task and trains two rounds; prints the CPU
seconds of each phase (getrusage: the process's own, steadier than wall time on a shared machine) and the
collections counted. `tests/daemon/test_bare_node_start.py` runs it outside an image.
An image older than `warmup.collect_after_imports` runs with the collector on.
"""

from __future__ import annotations

import gc
import os
import resource


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    from mosaicd.daemon.node import warmup

    held = hasattr(warmup, "collect_after_imports") and os.environ.get("HOLD", "1") == "1"
    if held:
        warmup.collect_after_imports()
    import mosaicd.cli

    mosaicd.cli.build_parser("node")
    import mosaicd.daemon.embedded  # noqa: F401  (the node role, as `mosaicd node` runs it)
    import mosaicd.daemon.loop  # noqa: F401

    daemon = cpu()
    from mosaicd.learning.tasks import import_task_modules

    import_task_modules("digits")
    if held:
        warmup.imports_done()
    task_imports = cpu()
    from mosaicd.learning.tasks import build_task
    from mosaicd.settings import RunConfig

    run = RunConfig(task="digits", nodes=60, fragments=4, fanout=4, local_steps=5, lr=0.05, batch_size=32)
    task = build_task(run, "/tmp")
    vector = task.initial(7)
    for t in range(2):
        vector, _ = task.train(7, t, vector)
    done = cpu()
    print(f"collector held off {held!s:5s} interpreter + daemon {daemon:.2f}  + task imports "
          f"{task_imports - daemon:.2f}"
          f"  + build, 2 rounds {done - task_imports:.2f}  = {done:.2f} CPU-s; collections "
          f"{[s['collections'] for s in gc.get_stats()]}")


if __name__ == "__main__":
    main()

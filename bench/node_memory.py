"""What one `mosaicd node` process holds on digits, step by step as it starts and runs (issue 59, item 4).

A compose node container is one such process (its entrypoint execs it): its cgroup's resident anonymous memory,
what `compose_scale.py` reports per node, is this process's `Anonymous` (smaps_rollup) give or take a few MiB.
This script walks the node's steps in one fresh interpreter, in the order `mosaicd node` takes them, and prints
after each the process's Anonymous, Rss and Pss (MiB), the modules loaded and the CPU seconds the step took:

1. the CLI and the settings (`mosaicd.cli`, `Settings.load`: pydantic-settings, numpy, mosaic_proto);
2. the daemon (`mosaicd.daemon.embedded`, `daemon.node.run`: aiohttp, structlog, prometheus_client);
3. torch, then the task's modules (what `warmup.prefetch_in_background` imports while the node registers);
4. the task built (data, partition, model) and the initial model;
5. three rounds of training in a worker thread, one evaluation (as the node does them).

The imports run with the garbage collector held off, as `mosaicd node` runs them (`warmup.collect_after_imports`).
Each step's figures are the process's own: what torch holds is the "torch" line, what is ours the others. The
last lines: the total CPU seconds of the imports (steps 1-3), and what 60 such containers starting at once need
of this host's cores for them alone (60 x that / cores: an estimate, not a compose run), and the JSON object.

    .venv/bin/python bench/node_memory.py
    MALLOC_ARENA_MAX=1 .venv/bin/python bench/node_memory.py     # the same with one malloc arena
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 1024


def memory() -> dict[str, float]:
    """Anonymous, Rss and Pss of this process (MiB), from /proc/self/smaps_rollup."""
    text = Path("/proc/self/smaps_rollup").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+)", text, re.M).group(1)) / MIB  # type: ignore[union-attr]
            for key in ("Anonymous", "Rss", "Pss")}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Steps:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._anon, self._cpu = memory()["Anonymous"], cpu()
        self.step("python, asyncio")

    def step(self, name: str) -> None:
        mem, now = memory(), cpu()
        row = {"step": name, "anon_mib": round(mem["Anonymous"], 1),
               "added_mib": round(mem["Anonymous"] - self._anon, 1), "rss_mib": round(mem["Rss"], 1),
               "pss_mib": round(mem["Pss"], 1), "modules": len(sys.modules), "cpu_s": round(now - self._cpu, 3)}
        self.rows.append(row)
        print(f"{name:34s} anonymous {row['anon_mib']:6.1f} MiB (+{row['added_mib']:5.1f})  rss {row['rss_mib']:6.1f}"
              f"  pss {row['pss_mib']:6.1f}  modules {row['modules']:5d}  cpu {row['cpu_s']:.3f} s", flush=True)
        self._anon, self._cpu = mem["Anonymous"], now


def main() -> None:
    from mosaicd.daemon.node import warmup

    warmup.collect_after_imports()
    steps = Steps()
    import mosaicd.cli
    from mosaicd.settings import Settings

    mosaicd.cli.build_parser("node")
    out = Path(tempfile.mkdtemp(prefix="mosaic-node-memory-"))
    settings = Settings.load(task="digits", nodes=16, rounds=60, sampler="local", fanout=4, fragments=1,
                             local_steps=10, batch_size=16, lr=0.05, partition="dirichlet", alpha=0.1, eval_every=10,
                             out=out, barrier_url="http://127.0.0.1:9")
    steps.step("cli and settings")
    import mosaicd.daemon.embedded  # noqa: F401  (the node role, as `mosaicd node` runs it)
    import mosaicd.daemon.node.run  # noqa: F401
    from mosaicd.daemon.http.server import keep_freed_memory

    keep_freed_memory()  # as run_node does first
    steps.step("daemon (aiohttp, structlog, ...)")
    import torch  # noqa: F401

    steps.step("torch")
    from mosaicd.learning.tasks import build_task, import_task_modules

    import_task_modules("digits")
    warmup.imports_done()
    steps.step("task modules (digits)")
    imports_cpu = sum(r["cpu_s"] for r in steps.rows)
    run = settings.run_config()
    task = build_task(run, settings.data_dir)
    vector = task.initial(0)
    steps.step("task built, initial model")

    async def rounds() -> Any:
        v = vector
        for t in range(3):
            v, _ = await asyncio.to_thread(task.train, 0, t, v)
        return v

    trained = asyncio.run(rounds())
    steps.step("3 rounds trained (worker thread)")
    from mosaicd.learning.evaluation import node_evaluation

    node_evaluation(task, trained)
    steps.step("one evaluation")
    cores = os.cpu_count() or 1
    torch_mib = next(r["added_mib"] for r in steps.rows if r["step"] == "torch")
    total = steps.rows[-1]["anon_mib"]
    print(f"torch's import: {torch_mib} MiB of {total} MiB anonymous; the rest ({total - torch_mib:.1f} MiB) is "
          "Python, our modules and their dependencies, data, model and the rounds' buffers")
    print(f"imports: {imports_cpu:.2f} CPU-s per node; 60 containers starting at once: 60 x {imports_cpu:.2f} / "
          f"{cores} cores = {60 * imports_cpu / cores:.0f} s of this host's cores for the imports alone (an estimate)")
    print(json.dumps({"steps": steps.rows, "anon_mib": total, "torch_mib": torch_mib,
                      "imports_cpu_s": round(imports_cpu, 3),
                      "compose60_imports_s_estimate": round(60 * imports_cpu / cores, 1), "cores": cores}))


if __name__ == "__main__":
    main()

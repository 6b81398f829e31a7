"""A bare node (compose's: --barrier-url, the run's settings from the barrier) registers with the daemon's own
imports: its task's modules (torch, for a torch task) are imported in the background meanwhile, and none of the
barrier role's modules at all. Where dozens of containers start on few cores, every module imported before
registering delays the run's start (bench/README.md, Speed 4 item 4)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.experiments.cluster import free_ports

RUN = dict(rounds=2, fragments=2, fanout=1, dim=16, seed=7)

# A torch task's module as far as imports go (it imports torch), training the quadratic objective; its import
# waits for the file HOLD_TASK_IMPORT names, where that variable is set (the nodes' environment only).
HELD_TASK = '''
import json
import os
import time
from pathlib import Path

hold = os.environ.get("HOLD_TASK_IMPORT")
while hold and not Path(hold).exists():
    time.sleep(0.02)

import torch  # noqa: E402,F401

from mosaicd.learning.tasks.quadratic import QuadraticTask  # noqa: E402


class HeldQuadratic(QuadraticTask):
    """The quadratic task, from a module that imports torch."""
'''


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_node_imports_none_of_the_barrier_role_before_it_registers() -> None:
    """`mosaicd node`'s own imports (the command's module, the node role as `embedded.run_node` runs it, the event
    loop): no barrier module, no torch. A fresh interpreter, as a container starts it."""
    code = ("import sys; import mosaicd.cli as c; c.build_parser(); from mosaicd.daemon.embedded import run_node; "
            "from mosaicd.daemon.loop import run; "
            "print(sorted(m for m in sys.modules if m.startswith('mosaicd.daemon.barrier') or m == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/maps")
def test_a_bare_node_registers_before_its_task_imports_torch(tmp_path: Path, kit: Any) -> None:
    """Two nodes register, and the barrier forms the run, while their task's module (which imports torch) is still
    being imported: neither has loaded torch then. Once that import goes on, the run ends with the reference's
    models."""
    pytest.importorskip("torch")
    (tmp_path / "held_task.py").write_text(HELD_TASK)
    task, go = f"{tmp_path / 'held_task.py'}:HeldQuadratic", tmp_path / "go"
    nodes, (port,) = 2, free_ports(1)
    procs: list[subprocess.Popen] = []
    try:
        with open(tmp_path / "barrier.log", "wb") as out:
            procs.append(subprocess.Popen(
                [*kit.by_hand, "barrier", *kit.flags(RUN), "--task", task, "--nodes", str(nodes), "--host",
                 "127.0.0.1", "--port", str(port), "--out", str(tmp_path / "run"), "--log-json"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        env = {**os.environ, "MOSAIC_TASK": task, "HOLD_TASK_IMPORT": str(go)}  # as compose gives a node its task
        for i in range(nodes):
            with open(tmp_path / f"node-{i}.log", "wb") as out:
                procs.append(subprocess.Popen(
                    [*kit.by_hand, "node", "--barrier-url", f"http://127.0.0.1:{port}", "--host", "127.0.0.1",
                     "--port", "0", "--log-json"], env=env, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL))
        kit.wait_until(lambda: kit.status(port).get("registered") == nodes, 120, "both nodes registered")
        assert [maps_torch(p.pid) for p in procs[1:]] == [False] * nodes
        assert all(p.poll() is None for p in procs)
        go.touch()
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        go.touch()
        kit.stop_all(dict(enumerate(procs)))
    assert codes == [0] * (nodes + 1), (tmp_path / "barrier.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN, nodes=nodes))


async def test_a_node_started_without_collections_resumes_them_once_its_task_is_imported() -> None:
    """`mosaicd node` imports with the garbage collector off (`collect_after_imports`); once the background import
    of its task is done, what was made so far is frozen and collection is on again. A process whose collector was
    on (every other) keeps it as it was."""
    import gc

    from mosaicd.daemon.node.warmup import collect_after_imports, prefetch_in_background

    frozen = gc.get_freeze_count()
    try:
        await prefetch_in_background("quadratic")
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        collect_after_imports()
        assert not gc.isenabled()
        await prefetch_in_background("quadratic")
        assert gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.enable()


async def test_a_nodes_task_imports_run_at_its_own_priority(tmp_path: Path) -> None:
    """What the background import has not done by the roster is on round 0's path (its deadline runs from the
    roster): at nice 19 a host busy with other work starved it, and every member straggled, then was dropped."""
    from mosaicd.daemon.node.warmup import prefetch_in_background

    seen = tmp_path / "nice"
    task = tmp_path / "nice_task.py"
    task.write_text("import os, threading\n"
                    f"open({str(seen)!r}, 'w').write(str(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))\n"
                    "class Task:\n    pass\n")
    await prefetch_in_background(f"{task}:Task")
    assert int(seen.read_text()) == os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.slow
def test_the_start_up_bench_runs_each_phase() -> None:
    """bench/node_start_cpu.py, outside an image: it imports as a bare node does and says each phase's CPU."""
    bench = Path(__file__).parents[2] / "bench" / "node_start_cpu.py"
    done = subprocess.run([sys.executable, str(bench)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    phases = re.fullmatch(r"collector held off True\s+interpreter \+ daemon ([\d.]+)\s+\+ task imports ([\d.]+)\s+"
                          r"\+ build, 2 rounds ([\d.]+)\s+= ([\d.]+) CPU-s; collections \[.*\]\n", done.stdout)
    assert phases, done.stdout
    daemon, imports, rounds, total = map(float, phases.groups())
    assert imports > 0 and rounds > 0 and abs(daemon + imports + rounds - total) < 0.02

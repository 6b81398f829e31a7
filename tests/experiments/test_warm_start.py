"""`mosaicd cluster`'s warm start: nodes forked from the warmed-up barrier are real processes of their own and
end with the models of the in-process run, bit for bit, torch threads included; the cold start still works.

(Node death, --fail-fast and no orphans under the warm start: tests/daemon/test_failures.py; every task's
cluster against simulate: tests/experiments/test_task_runs.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from mosaicd.cli import main
from mosaicd.experiments.cluster import Cluster
from mosaicd.experiments.processes import ForkedProcess, node_cores
from mosaicd.experiments.simulate import run_simulation
from mosaicd.progress import RoundProgress
from mosaicd.rundir import read_rounds
from mosaicd.settings import Settings


@pytest.mark.slow  # about 15 s on 2 busy cores
def test_forked_digits_nodes_with_two_torch_threads_match_simulate(tmp_path: Path) -> None:
    """threads=2: the barrier warms torch up with one thread (no OpenMP pool crosses the fork), each node then
    trains with two; a pool inherited from the parent would hang the nodes, a wrong thread count changes bits."""
    common = dict(task="digits", nodes=3, rounds=3, fragments=2, fanout=1, local_steps=2, seed=4, threads=2,
                  partition="dirichlet", alpha=0.1, min_samples=8, eval_every=3, eval_samples=100)
    # --linger 3: the nodes stay 3 s after the run, so that round 0 is reported while they are alive even when
    # the whole run is over before the launcher's first look at the barrier
    cluster = Cluster(Settings.load(**common, linger=3, out=tmp_path / "cluster"), progress=False)
    parents: dict[str, int] = {}

    def on_round(p: RoundProgress) -> None:
        if p.round == 0:  # every node is running: whose children are they?
            for name, proc in cluster.procs.items():
                parents[name] = psutil.Process(proc.pid).ppid()

    cluster.on_round = on_round
    clustered = cluster.run(timeout=240)
    simulated = run_simulation(Settings.load(**common, out=tmp_path / "sim"), progress=False)
    assert clustered["model_sha256"] == simulated["model_sha256"]
    assert clustered["final"]["average_model"] == simulated["final"]["average_model"]
    # every node evaluates its own model (--eval-samples rows), the barrier combines: simulate's rows, exactly
    rows = {name: [{k: v for k, v in row.items() if k != "elapsed_s"} for row in read_rounds(tmp_path / name)]
            for name in ("cluster", "sim")}
    assert [r["round"] for r in rows["cluster"]] == [2] and rows["cluster"] == rows["sim"]
    assert rows["cluster"][0]["eval_samples"] == 100 and len(rows["cluster"][0]["per_node"]) == 3
    barrier = cluster.procs["barrier"].pid
    assert {n: p for n, p in parents.items() if n != "barrier"} == {f"node-{i}": barrier for i in range(3)}
    assert all(isinstance(cluster.procs[f"node-{i}"], ForkedProcess) for i in range(3))
    assert {p.returncode for p in cluster.procs.values()} == {0}
    log = [json.loads(x) for x in (tmp_path / "cluster" / "logs" / "barrier.log").read_text().splitlines()
           if x.startswith("{")]
    assert any(x["event"] == "warm_start" and x["prebuilt"] is True for x in log)
    for i in range(3):  # each node logs its own rounds in its own file
        lines = [json.loads(x) for x in (tmp_path / "cluster" / "logs" / f"node-{i}.log").read_text().splitlines()
                 if x.startswith("{")]
        assert {x["round"] for x in lines if x.get("event") == "round"} == {0, 1, 2}
        assert {x["node"] for x in lines if "node" in x} == {i}


@pytest.mark.slow  # about 8 s on 2 busy cores
def test_cold_cluster_still_matches_the_reference(tmp_path: Path, kit: Any) -> None:
    run = dict(nodes=4, rounds=4, fragments=4, fanout=2, seed=1)
    cluster = Cluster(Settings(**run, out=tmp_path / "run"), progress=False, warm=False)
    summary = cluster.run(timeout=120)
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    assert not any(isinstance(p, ForkedProcess) for p in cluster.procs.values())
    assert {p.returncode for p in cluster.procs.values()} == {0}


def test_roles_import_neither_torch_nor_plotting() -> None:
    """A node or barrier imports torch only for a torch task (lazily, where it trains or evaluates), never
    matplotlib; structlog does not drag rich in. A fresh interpreter, as `mosaicd node` starts."""
    code = ("import sys; import mosaicd.cli as c; c.build_parser(); import mosaicd.daemon.node.run, "
            "mosaicd.experiments.cluster, mosaicd.experiments.warm; from mosaicd.learning.tasks import require_task; "
            "from mosaicd.settings import TaskName; require_task(TaskName.DIGITS); "
            "print(sorted(m for m in ('torch', 'sklearn', 'matplotlib', 'rich', 'pygments') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def mapped(pid: int, library: str) -> bool:
    return library in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow  # about 6 s on 2 busy cores
def test_quadratic_cluster_never_loads_torch(tmp_path: Path, kit: Any) -> None:
    """The warm barrier builds what the run needs: for the quadratic task, no process of the cluster maps torch."""
    run = dict(nodes=3, rounds=4, fragments=2, fanout=1, seed=2)
    cluster = Cluster(Settings(**run, linger=3, out=tmp_path / "run"), progress=False)  # alive when round 0 shows
    seen: dict[str, bool] = {}

    def on_round(p: RoundProgress) -> None:
        if p.round == 0:
            seen.update({name: mapped(proc.pid, "libtorch") for name, proc in cluster.procs.items()})

    cluster.on_round = on_round
    summary = cluster.run(timeout=120)
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    assert seen == {"barrier": False, "node-0": False, "node-1": False, "node-2": False}


def test_an_error_line_sent_on_the_report_pipe_is_the_exit_reason(tmp_path: Path) -> None:
    """A process's log may sit on the disk that filled, its last line cut: the error line it sent on the report
    pipe is what the launcher says, whole (and the log's last error where nothing was sent)."""
    import os
    import threading

    from mosaicd.experiments.processes import Children, Processes, exit_reason

    processes = Processes(tmp_path)
    read, write = os.pipe()
    reader = threading.Thread(target=processes._read_reports, args=(read, {}))
    line = "mosaicd barrier: error: cannot write /x/run: No space left on device"
    Children(write).error("barrier", line)
    os.close(write)
    reader.start()
    reader.join(5)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "barrier.log").write_text("mosaicd barrier: error: cannot write /x/ru")  # cut short
    assert exit_reason(tmp_path, "barrier", 1, processes.said.get("barrier")) == line
    assert exit_reason(tmp_path, "barrier", 1, None) == "mosaicd barrier: error: cannot write /x/ru"


WARM_OPTIMIZER = """
import sys, numpy as np, torch
from mosaicd.daemon.node.warmup import warm_up
from mosaicd.learning.tasks import build_task
from mosaicd.settings import Settings

task = build_task(Settings(task="digits", nodes=4, fanout=1, optimizer=sys.argv[1], lr_schedule=sys.argv[2],
                           lr=0.01, rounds=10).run_config())
before, rng = task.initial(0), torch.get_rng_state()
warm_up(task)
same = bool(np.array_equal(task.initial(0), before) and torch.equal(torch.get_rng_state(), rng))
warmed = "torch._dynamo" in sys.modules
task.train(0, 0, before)
print(same, warmed, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("optimizer,schedule,dynamo", [("adam", "cosine", False), ("adamw", "constant", False),
                                                       ("rmsprop", "constant", True),
                                                       ("sgd", "torch.optim.lr_scheduler:ConstantLR", True)])
def test_the_warm_parent_pays_an_optimizers_imports_and_adam_needs_none(optimizer: str, schedule: str,
                                                                       dynamo: bool) -> None:
    """torch.optim's classes import torch._dynamo (~70 MiB, 1-2 s) when built: the warm start builds the run's
    optimizer (and a torch schedule) once before the fork, so its nodes share it; adam and adamw (torch_util's)
    import nothing. The warm-up leaves the model and torch's generator as they were. A fresh interpreter, as the
    warm parent."""
    done = subprocess.run([sys.executable, "-c", WARM_OPTIMIZER, optimizer, schedule], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["True", str(dynamo), str(dynamo)]  # after the warm-up's log line


def test_the_warm_parent_computes_what_every_node_computes_alike_before_the_fork(tmp_path: Path) -> None:
    """`prebuild` leaves the sampler's check against numpy cached in the parent, so that every forked node has it
    (issue 59 item 3: each node paid for it, and for its first fragmentation, after registering)."""
    from mosaic_proto import keyed_choice
    from mosaicd.experiments.warm import prebuild

    keyed_choice.matches_numpy.cache_clear()
    task = prebuild(Settings(task="quadratic", nodes=3, fragments=2, out=tmp_path / "run"))
    assert task is not None
    assert keyed_choice.matches_numpy.cache_info().currsize == 1


def test_node_cores_alternate_over_the_allowed_cores_where_the_nodes_outnumber_them() -> None:
    names = [f"node-{i}" for i in range(5)]
    assert node_cores(names, "off", 5, cores=[0, 1]) == {}
    assert node_cores(names[:2], "auto", 2, cores=[0, 1]) == {}  # no more nodes than cores: the kernel places them
    pinned = node_cores(names, "auto", 5, key="runs/a", cores=[5, 2])
    assert list(pinned) == names and {len(c) for c in pinned.values()} == {1}
    order = [pinned[name][0] for name in names]
    assert set(order) == {2, 5} and all(a != b for a, b in zip(order, order[1:], strict=False))  # alternating
    assert node_cores(["node-3"], "auto", 5, key="runs/a", cores=[2, 5]) == {"node-3": pinned["node-3"]}  # again
    spread = node_cores(names[:3], "on", 3, key="runs/b", cores=range(4))
    assert len({c for c in spread.values()}) == 3  # one core each
    starts = {node_cores(["node-0"], "on", 1, key=f"runs/{i}", cores=range(4))["node-0"] for i in range(20)}
    assert len(starts) > 1  # runs launched side by side do not all start on the first core
    with pytest.raises(ValueError, match="--pin-nodes: expected one of auto, on, off, got 'always'"):
        node_cores(names, "always", 5, cores=[0])


def test_a_core_a_node_cannot_be_put_on_leaves_it_where_it_was() -> None:
    """A cpuset narrowed after the cores were chosen: the node runs unpinned rather than failing (in a child: the
    test's own process keeps its cores)."""
    code = ("import os; from mosaicd.experiments.processes import pin_to; before = os.sched_getaffinity(0); "
            "pin_to([os.cpu_count() + 64]); assert os.sched_getaffinity(0) == before; "
            "pin_to([min(before)]); assert os.sched_getaffinity(0) == {min(before)}; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


@pytest.mark.slow  # about 10 s on 2 busy cores
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_pinned_nodes_run_on_one_core_each_and_end_with_the_reference_models(tmp_path: Path, kit: Any,
                                                                              warm: bool) -> None:
    """--pin-nodes on: every node process (forked from the warm barrier, or a fresh interpreter) runs on the one
    core `node_cores` gives it, its threads too; the barrier keeps the launcher's cores; the models are the
    reference's (where a process runs changes no bit)."""
    run = dict(nodes=3, rounds=4, fragments=2, fanout=1, seed=3)
    cluster = Cluster(Settings(**run, linger=3, out=tmp_path / "run"), progress=False, warm=warm, pin="on")
    seen: dict[str, set[frozenset[int]]] = {}
    turns: dict[str, set[str]] = {}

    def on_round(p: RoundProgress) -> None:
        if p.round == 0:
            for name, proc in cluster.procs.items():
                threads = psutil.Process(proc.pid).threads()
                seen[name] = {frozenset(os.sched_getaffinity(thread.id)) for thread in threads}
                turns[name] = turn_pipes(proc.pid)

    cluster.on_round = on_round
    summary = cluster.run(timeout=120)
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**run))
    launcher = frozenset(os.sched_getaffinity(0))
    expected = node_cores([f"node-{i}" for i in range(3)], "on", 3, key=str(tmp_path / "run"))
    assert expected and seen == {"barrier": {launcher}, **{n: {frozenset(cores)} for n, cores in expected.items()}}
    # forked nodes that share a core take turns through one pipe of that core's (the warm start's), nodes alone on
    # theirs and fresh interpreters through none (daemon/node/core_turn.py)
    holders: dict[str, set[str]] = {}
    for name, pipes in turns.items():
        for pipe in pipes:
            holders.setdefault(pipe, set()).add(name)
    shared = sorted(sorted(names) for names in holders.values() if len(names) > 1)  # a process's own pipes aside
    by_core: dict[tuple[int, ...], list[str]] = {}
    for name, cores in expected.items():
        by_core.setdefault(cores, []).append(name)
    assert shared == (sorted(names for names in by_core.values() if len(names) > 1) if warm else []), turns


def turn_pipes(pid: int) -> set[str]:
    """The pipes process `pid` holds both ends of, the read end non-blocking: its event loop's own, and a pinned
    node's core turn (`CoreTurn` made it so), which the other nodes of its core hold too (the report pipe to the
    warm parent it only writes to)."""
    ends: dict[str, set[int]] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if target.startswith("pipe:"):
            mode = flags & os.O_ACCMODE
            ends.setdefault(target, set()).add(-1 if mode == os.O_RDONLY and not flags & os.O_NONBLOCK else mode)
    return {pipe for pipe, modes in ends.items() if modes == {os.O_RDONLY, os.O_WRONLY}}


@pytest.mark.slow  # about 12 s: four runs of 3 nodes
@pytest.mark.parametrize("sync", ["barrier", "async"])
def test_the_cluster_command_pins_its_nodes_as_told_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                sync: str) -> None:
    for pin in ("on", "off"):
        with pytest.raises(SystemExit) as ended:
            main(["cluster", "--sync", sync, "--pin-nodes", pin, "--nodes", "3", "--rounds", "2", "--fanout", "1",
                  "--out", str(tmp_path / pin)])
        out = capsys.readouterr().err  # the console's lines; the summary is on stdout
        assert ended.value.code == 0, out
        said = re.search(r"nodes pinned to cores \((\d) on core (\d), (\d) on core (\d); --pin-nodes on: off lets "
                         r"the kernel place them\)", out)
        assert (said is not None) == (pin == "on"), out
        if said is not None:
            expected = node_cores([f"node-{i}" for i in range(3)], "on", 3, key=str(tmp_path / pin))
            counts = {int(said[2]): int(said[1]), int(said[4]): int(said[3])}
            assert counts == {core: sum(c == (core,) for c in expected.values()) for core in counts}, out

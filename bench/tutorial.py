"""decentralizepy's EL-Local tutorial job on `mosaicd cluster`: wall, CPU and memory, warm start against cold.

The job (issue #12): 16 node processes on this host, digits with its CNN, Dirichlet alpha=0.1, EL-Local with
s=4 (`--sampler local --fanout 4 --fragments 1`: K=1), H=10 local steps, batch 16, lr 0.05, 60 rounds,
evaluation every 10. Each variant runs the whole job through `Cluster` (the code of `mosaicd cluster`):
warm (the default: nodes forked from the warmed-up barrier) and, as the reference measured in the same run,
cold (`warm=False`: every process a fresh interpreter, as before). Figures per variant:

- `wall_s`: summary.json's (the barrier's clock: from its recorder's start to the end of the run); with a
  warm start the barrier's clock starts after the warm-up, so `launch_wall_s` is given too: from the
  launcher's `Cluster.run` to its return (every process exited), the figure a user waits;
- `cpu_s`: user + system seconds of every cluster process (the launcher's children and their children, all
  reaped: getrusage(RUSAGE_CHILDREN) before and after), and `launcher_cpu_s` (the polling launcher itself);
- memory: /proc/PID/smaps_rollup's Pss of every cluster process, sampled once, when half the rounds are done (at
  nice 19): the total (`pss_total_mib`), the median and largest node (`pss_node_median_mib`, `pss_node_max_mib`)
  and the barrier (`pss_barrier_mib`);
- `cpu_per_round_s`: the CPU seconds of every cluster process per round from round 1 to the last but one, read as the
  rounds are reported (no warm-up, forks, round 0 or end); simulate's the same way, and `round_cpu_to_simulate`,
  their ratio, side by side: where the wall's ratio comes from. Both drift with this host's state, run by run;
  `split_per_round` divides the cluster's into the barrier's event loop and its other threads and the nodes'
  event loops and their other threads (training, evaluation and checkpoints run there), in ms per round;
- `wall_ms_per_round` and `idle_core_ms_per_round`: the wall and the host's idle core-time per round over the same
  rounds: what of the cores the rounds leave unused (the wall's ratio beyond the CPU's);
- `switches_per_round`: the context switches of the same four parts per round (a node's per node), voluntary (a
  thread slept: I/O, the GIL, its core's turn) and involuntary (it was preempted): how often a node's loop wakes in
  a round, and how often its trainer is cut off by another thread on its core;
- the final models' hashes (cluster == cluster: both variants must agree bit for bit).

And the reference the cluster is held to: the same job through `mosaicd simulate` (one process), whose CPU
seconds spread over this host's cores are the bound of the computation itself: `ratio_to_bound` is the warm
cluster's wall against it. With --repeat the variants and simulate run in turn (warm, cold, simulate, warm, ...)
and each ratio is the median of the ratios of runs made side by side (`ratios_to_bound`, `ratios_wall`): this
host's speed drifts by tens of percent over minutes.

`--unpinned`: the warm cluster also with `--pin-nodes off`, in turn with the others: `pinned_to_unpinned_wall`
and `pinned_to_unpinned_cpu` (the default, `auto`, pins the nodes where they outnumber the cores), and
`unpinned_ratio_to_bound`.

`--plain`: the warm cluster also without a secret (`--insecure`), in turn with the others: `secret_to_plain_wall`
and `secret_to_plain_cpu`, the median of side-by-side ratios of the default (signed) run to the plain one.

`--phases`: every process of the warm cluster and simulate's also times its phases on its thread's CPU clock
(`phase_hook/sitecustomize.py`, put first on the cluster's PYTHONPATH): training (`TorchTask.train`), each model's
evaluation (`TorchTask.evaluate_one`) and the nodes' checkpoints (`Slots.save`), as calls, CPU ms a call and CPU
ms a round over the whole run; `phases` in the JSON, and a line setting the nodes' beside simulate's. What the
nodes' threads spend beyond those is the thread hops; their event loops and the barrier are in `split_per_round`.

`--simulate-pair`: simulate also twice at once, each copy pinned to a core of its own, in turn with the others:
`simulate_pair`, the copies' CPU per round against simulate's alone (`round_cpu_to_alone`; with `--phases` their
training per call, `train_to_alone`) and the warm cluster's wall over the bound their CPU would make
(`ratio_to_busy_bound`). The bound assumes that two busy cores do twice one's work: this says what this host gives.

`--event-loop uvloop,asyncio`: the warm cluster once per loop named (variants `warm-uvloop`, `warm-asyncio`), in
turn with the others; `ratio_to_bound` and `ratios_to_bound` per loop, and `loop_ratio_wall` / `loop_ratio_cpu`:
the first loop's wall (CPU seconds) over the last's, side by side (below 1: the first is faster).

    .venv/bin/python bench/tutorial.py                # warm and cold once each: about 1.5 min on 2 idle cores
    .venv/bin/python bench/tutorial.py --repeat 3     # 3 of each, interleaved; medians
    .venv/bin/python bench/tutorial.py --no-cold --rounds 20   # a quick look
    .venv/bin/python bench/tutorial.py --no-cold --plain --repeat 3   # the secret's cost
    .venv/bin/python bench/tutorial.py --no-cold --phases --repeat 3  # training, evaluation, checkpoints: per call
    .venv/bin/python bench/tutorial.py --no-cold --event-loop uvloop,asyncio --repeat 3
    .venv/bin/python bench/tutorial.py --no-cold --simulate-pair --phases --repeat 3  # two busy cores' cost

Last line of stdout: a JSON object {"warm": {...}, "cold": {...}, "simulate": {...}, "ratio_wall": warm/cold
launch_wall_s, "ratio_to_bound": ..., ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from procstat import cpu_seconds, host_cpu, stat_fields

from mosaicd.experiments.cluster import Cluster
from mosaicd.logs import configure_logging
from mosaicd.rundir import claim_out
from mosaicd.settings import EventLoop, Settings

MIB = 1024 * 1024
PHASE_HOOK = Path(__file__).resolve().parent / "phase_hook"  # its sitecustomize times the phases (--phases)
TARGET = 1.5  # issue 59 "Speed 5" item 3: the cluster's wall within 1.5x of simulate's CPU seconds over the cores
SECRET_TARGET = 1.15  # issue 59 item 3: the warm cluster with its secret against the same without (--plain)


def tutorial_settings(out: Path, rounds: int, nodes: int, event_loop: str = "auto",
                      insecure: bool = False) -> Settings:
    return Settings.load(task="digits", nodes=nodes, rounds=rounds, sampler="local", fanout=4, fragments=1,
                         local_steps=10, batch_size=16, lr=0.05, partition="dirichlet", alpha=0.1, eval_every=10,
                         out=out, event_loop=event_loop, insecure=insecure)


def pss_bytes(pid: int | None) -> int | None:
    """Pss of one process from /proc/PID/smaps_rollup (None when it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Sampler:
    """A thread that calls `sample` every `every` seconds while the cluster runs."""

    def __init__(self, cluster: Cluster, every: float) -> None:
        self.cluster, self.every = cluster, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:  # the cluster's cores are the ones measured: a sampler takes what they leave (Linux: per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError


class PssSampler(Sampler):
    """The Pss of each cluster process, once, when the run is halfway through its rounds (its memory is steady
    from round 0 on): `due` is the cluster's `on_round`.

    Once, at the lowest priority: reading smaps_rollup walks a process's page tables under its mmap lock, ~0.1 CPU-s
    for the 17 processes of the tutorial job, inside the window the cluster is timed in, which simulate, the
    reference, does not pay (issue 59: every 2 s it was 5.5% of a core of the two; every 4 s, 2-3 passes, 1% of
    the run's CPU)."""

    def __init__(self, cluster: Cluster, every: float = 0.5) -> None:
        super().__init__(cluster, every)
        self.taken: dict[str, int] = {}
        self.samples = 0
        self._half = cluster.settings.rounds // 2
        self._due = threading.Event()

    def due(self, progress: Any) -> None:
        if progress.round >= self._half:
            self._due.set()

    def sample(self) -> None:
        if not self._due.is_set() or self.samples:
            return
        sample = {}
        for name, proc in list(self.cluster.procs.items()):
            value = pss_bytes(proc.pid)
            if value is not None:
                sample[name] = value
        if len(sample) == self.cluster.settings.nodes + 1:  # every process up; else again `every` s later
            self.samples += 1
            self.taken = sample


class ThreadCpuSampler(Sampler):
    """The CPU seconds (user + system) of every thread of every cluster process, last seen: where the cluster's
    CPU goes, per role (barrier, node) and thread (the event loop is the process's main thread; the others are
    training, evaluation and file writes). A thread's last ~0.5 s before its process exits are not seen."""

    def __init__(self, cluster: Cluster, every: float = 0.5) -> None:
        super().__init__(cluster, every)
        self.seen: dict[Thread, float] = {}

    def sample(self) -> None:
        for thread in cluster_threads(self.cluster):
            cpu = thread_cpu(thread)
            if cpu is not None:
                self.seen[thread] = cpu

    def split(self) -> dict[str, float]:
        """CPU seconds of the barrier's event loop and other threads, and of all nodes' event loops and others."""
        parts = dict.fromkeys(PARTS, 0.0)
        for (part, _, _), cpu in self.seen.items():
            parts[part] += cpu
        return {k: round(v, 2) for k, v in parts.items()}


def cluster_threads(cluster: Cluster) -> list[Thread]:
    """(part of PARTS, pid, tid) of every thread of every cluster process now (the event loop is a process's main
    thread)."""
    threads = []
    for name, proc in list(cluster.procs.items()):
        role = "barrier" if name == "barrier" else "node"
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{proc.pid}/task")] if proc.pid is not None else []
        except OSError:
            tids = []
        threads += [(f"{role}_{'loop' if tid == proc.pid else 'threads'}_s", proc.pid, tid) for tid in tids]
    return threads


def thread_cpu(thread: Thread) -> float | None:
    """The CPU seconds (user + system) of one of `cluster_threads` so far; None once it has exited."""
    fields = stat_fields(f"/proc/{thread[1]}/task/{thread[2]}/stat")
    return cpu_seconds(fields) if fields is not None else None


@dataclass(frozen=True)
class Mark:
    """What `RoundCpu` reads as a round is reported."""

    when: float  # time.monotonic()
    round: int
    cpu_s: float  # of the cluster's processes, all their threads
    parts: dict[str, float]  # CPU-s by role and thread, as ThreadCpuSampler.split
    idle_s: float  # the host's idle core-s since boot
    switches: dict[Thread, tuple[int, int]]  # `_switches`


class RoundCpu:
    """The CPU seconds of every cluster process (all their threads) as the rounds are reported (`due`, the cluster's
    `on_round`): the cluster's CPU per round between its second round and its last but one, without the warm-up,
    the forks, round 0 and the end. Against simulate's per round over the same rounds it says whether the wall's
    excess is in the rounds or around them; `split_per_round` says which part of the cluster it is in (the
    barrier's event loop and its other threads, the nodes' event loops and their other threads)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.marks: list[Mark] = []

    def due(self, progress: Any) -> None:
        if not measured_round(progress.round, self.cluster.settings.rounds):
            return
        total, parts = 0.0, dict.fromkeys(PARTS, 0.0)
        for proc in list(self.cluster.procs.values()):
            fields = stat_fields(f"/proc/{proc.pid}/stat") if proc.pid is not None else None
            total += cpu_seconds(fields) if fields is not None else 0.0
        threads = cluster_threads(self.cluster)
        for thread in threads:
            parts[thread[0]] += thread_cpu(thread) or 0.0
        self.marks.append(Mark(time.monotonic(), progress.round, total, parts, host_cpu()[1], _switches(threads)))

    def _kept(self) -> list[Mark]:
        """Rounds the launcher's poll saw released together are reported together: of those, only the last is the
        round the CPU seconds were read at."""
        return [m for m, after in itertools.pairwise(self.marks) if after.when - m.when > 0.02] + self.marks[-1:]

    def per_round(self) -> float | None:
        """CPU-s per round between the first mark and the last."""
        return slope([(m.round, m.cpu_s) for m in self._kept()])

    def idle_per_round(self) -> dict[str, float]:
        """The wall and the host's idle core-time per round, in ms, between the first mark and the last: what of
        the cores the rounds leave unused (a core whose nodes are done waits for the other's last arrival)."""
        kept = self._kept()
        wall = slope([(m.round, m.when) for m in kept])
        idle = slope([(m.round, m.idle_s) for m in kept])
        if wall is None or idle is None:
            return {}
        return {"wall_ms_per_round": round(1000 * wall, 1), "idle_core_ms_per_round": round(1000 * idle, 1)}

    def switches_per_round(self) -> dict[str, float]:
        """Context switches per round of each part's threads (a node's: per node), voluntary and involuntary, from
        round 1 to the last but one: how often a node's trainer is preempted in a round, and how often its loop
        wakes. Between the first and the last mark that saw every process (a round reported late, once its nodes
        exited, is not one), over the threads the last saw: one started since the first (an executor's worker,
        started when first needed) counts from zero."""
        processes = [len({pid for _, pid, _ in m.switches}) for m in self.marks]
        full = [m for m, count in zip(self.marks, processes, strict=True) if count == max(processes)]
        if len(full) < 2 or full[-1].round <= full[0].round:
            return {}
        first, last = full[0], full[-1]
        nodes = len({pid for part, pid, _ in last.switches if part == "node_loop_s"}) or 1
        figures = {}
        for part in PARTS:
            for index, kind in enumerate(("voluntary", "involuntary")):
                total = sum(counts[index] - first.switches.get(k, (0, 0))[index]
                            for k, counts in last.switches.items() if k[0] == part)
                figures[f"{part.removesuffix('_s')}_{kind}"] = round(
                    total / (last.round - first.round) / (1 if part.startswith("barrier") else nodes), 2)
        return figures

    def split_per_round(self) -> dict[str, float]:
        """CPU ms per round of each part (PARTS), between the first mark and the last."""
        kept = self._kept()
        split = {}
        for part in PARTS:
            value = slope([(m.round, m.parts[part]) for m in kept])
            if value is not None:
                split[part.replace("_s", "_ms_per_round")] = round(1000 * value, 1)
        return split


def _switches(threads: list[Thread]) -> dict[Thread, tuple[int, int]]:
    """Each of `threads`' context switches so far (`cluster_threads`'s), voluntary (it slept: a wait for I/O, the GIL,
    a turn) and involuntary (it was preempted)."""
    counts = {}
    for thread in threads:
        try:
            status = Path(f"/proc/{thread[1]}/task/{thread[2]}/status").read_text()
        except OSError:
            continue
        seen = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches:" in line)
        counts[thread] = (int(seen["voluntary_ctxt_switches"]), int(seen["nonvoluntary_ctxt_switches"]))
    return counts


PARTS = ("barrier_loop_s", "barrier_threads_s", "node_loop_s", "node_threads_s")
Thread = tuple[str, int, int]  # (part of PARTS, pid, tid): `cluster_threads`'s


def measured_round(round: int, rounds: int) -> bool:
    """Whether the CPU per round reads its seconds as `round` is reported: from round 1 to the last but one."""
    return 1 <= round <= rounds - 2


def slope(marks: list[tuple[int, float]]) -> float | None:
    """(CPU-s at the last mark - at the first) / (rounds between), or None with fewer than 10 rounds between."""
    if len(marks) < 2 or marks[-1][0] - marks[0][0] < 10:
        return None
    return (marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0])


def run_once(name: str, rounds: int, nodes: int, workdir: Path, event_loop: str = "auto",
             phases: bool = False) -> dict[str, Any]:
    # each run afresh: a repeat in the same folder would find the last run's checkpoints and journal
    warm = name.startswith("warm") or name in ("plain", "unpinned")
    out = claim_out(workdir / name, "cluster", replace=True)
    settings = tutorial_settings(out, rounds, nodes, event_loop, insecure=name == "plain")
    cluster = Cluster(settings, progress=False, warm=warm, pin="off" if name == "unpinned" else "auto")
    timed = fresh_folder(workdir / f"phases-{name}") if phases else None
    with phase_hook(timed):
        result = _measured_run(cluster, nodes, rounds, event_loop)
    if timed is not None:
        procs = cluster.procs
        result["phases"] = {
            "node": phase_figures(timed, [p.pid for n, p in procs.items() if n != "barrier"], rounds),
            "barrier": phase_figures(timed, [procs["barrier"].pid] if "barrier" in procs else [], rounds)}
    return result


def _measured_run(cluster: Cluster, nodes: int, rounds: int, event_loop: str) -> dict[str, Any]:
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_self = resource.getrusage(resource.RUSAGE_SELF)
    started, host_before, load_before = time.perf_counter(), host_cpu(), os.getloadavg()[0]
    rounds_cpu = RoundCpu(cluster)
    with PssSampler(cluster) as sampler, ThreadCpuSampler(cluster) as threads:
        def on_round(progress: Any) -> None:
            sampler.due(progress)
            rounds_cpu.due(progress)

        cluster.on_round = on_round
        summary = cluster.run(timeout=900)
    launch_wall = time.perf_counter() - started
    host_after = host_cpu()
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_self = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after_children.ru_utime - before_children.ru_utime) + (after_children.ru_stime - before_children.ru_stime)
    user = after_children.ru_utime - before_children.ru_utime
    switches = (after_children.ru_nvcsw - before_children.ru_nvcsw,
                after_children.ru_nivcsw - before_children.ru_nivcsw)
    own = (after_self.ru_utime - before_self.ru_utime) + (after_self.ru_stime - before_self.ru_stime)
    taken, split = sampler.taken, threads.split()
    node_pss = sorted(v for k, v in taken.items() if k != "barrier")
    final = summary.get("final") or {}
    return {
        "wall_s": summary.get("wall_s"), "launch_wall_s": round(launch_wall, 3), "cpu_s": round(cpu, 2),
        "user_s": round(user, 2), "sys_s": round(cpu - user, 2), "voluntary_switches": switches[0],
        "involuntary_switches": switches[1], "minor_faults": after_children.ru_minflt - before_children.ru_minflt,
        "launcher_cpu_s": round(own, 2),
        # the rest of the host meanwhile (other jobs): on a shared host the wall grows with it, the CPU seconds not
        "others_cpu_s": round(host_after[0] - host_before[0] - cpu - own, 1),
        "host_idle_s": round(host_after[1] - host_before[1], 1), "load_before": round(load_before, 1),
        "pss_total_mib": round(sum(taken.values()) / MIB, 1) if taken else None,
        "pss_node_median_mib": round(statistics.median(node_pss) / MIB, 1) if node_pss else None,
        "pss_node_max_mib": round(node_pss[-1] / MIB, 1) if node_pss else None,
        "pss_barrier_mib": round(taken["barrier"] / MIB, 1) if "barrier" in taken else None,
        "pss_samples": sampler.samples, "accuracy": final.get("average_model"),
        **split, "node_loop_ms_per_round": round(1000 * split["node_loop_s"] / (nodes * rounds), 2),
        "model_sha256": summary.get("model_sha256"), "event_loop": event_loop,
        "pinned_nodes": len(cluster.processes.cores), "cpu_per_round_s": _rounded(rounds_cpu.per_round(), 4),
        "split_per_round": rounds_cpu.split_per_round(),
        "switches_per_round": rounds_cpu.switches_per_round(), **rounds_cpu.idle_per_round(),
    }


def fresh_folder(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def phase_hook_module() -> Any:
    """`phase_hook/sitecustomize.py`, loaded by its path (it installs nothing where its variable is not set)."""
    spec = importlib.util.spec_from_file_location("phase_hook", PHASE_HOOK / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def phase_hook(folder: Path | None) -> contextlib.AbstractContextManager[Any]:
    """The cluster's processes started meanwhile time their phases into `folder` (`phase_hook/sitecustomize.py`,
    first on their PYTHONPATH); the environment as it was afterwards."""
    if folder is None:
        return contextlib.nullcontext()
    path = os.pathsep.join(p for p in (str(PHASE_HOOK), os.environ.get("PYTHONPATH")) if p)
    return mock.patch.dict(os.environ, {"PYTHONPATH": path, phase_hook_module().DIR_VARIABLE: str(folder)})


def phase_figures(folder: Path, pids: list[int | None], rounds: int) -> dict[str, dict[str, float]]:
    """phase -> its calls, CPU ms per call and CPU ms per round (the whole run's over its rounds), summed over the
    processes `pids`, from what they wrote into `folder`."""
    totals: dict[str, list[float]] = {}
    for pid in pids:
        path = folder / f"{pid}.json"
        if pid is None or not path.exists():
            continue
        for phase, (calls, cpu) in json.loads(path.read_text()).items():
            total = totals.setdefault(phase, [0, 0.0])
            total[0] += calls
            total[1] += cpu
    return {phase: {"calls": int(calls), "cpu_ms_per_call": round(1000 * cpu / calls, 3),
                    "cpu_ms_per_round": round(1000 * cpu / rounds, 2)}
            for phase, (calls, cpu) in sorted(totals.items())}


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _simulate_child(settings: Settings, conn: Any, timed: Path | None = None) -> None:
    """In a forked child: `mosaicd simulate`'s run of the same job; its CPU seconds (task built, training,
    evaluation, in-memory gossip, outputs), its wall and its final models' hash go back on `conn`. `timed`: its
    phases timed into that folder, as the cluster's processes time theirs."""
    from mosaicd.experiments.simulate import run_simulation

    if timed is not None:
        hook = phase_hook_module()
        os.environ[hook.DIR_VARIABLE] = str(timed)
        hook.install()

    marks: list[tuple[int, float]] = []

    def on_round(progress: Any) -> None:  # the same rounds as RoundCpu's
        if measured_round(progress.round, settings.rounds):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            marks.append((progress.round, usage.ru_utime + usage.ru_stime))

    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    summary = run_simulation(settings, progress=False, on_round=on_round, replace=True)  # --repeat: the same folder
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 3), "model_sha256": summary.get("model_sha256"),
              "cpu_per_round_s": _rounded(slope(marks), 4)}
    if timed is not None:
        result["phases"] = {"simulate": phase_figures(timed, [os.getpid()], settings.rounds)}
    conn.send(result)


def run_simulate(rounds: int, nodes: int, workdir: Path, phases: bool = False,
                 name: str = "simulate") -> dict[str, Any]:
    """The reference: the same job through `mosaicd simulate` (one process, one torch thread), in a child
    process so that its CPU seconds are its own (`name`: its folders under `workdir`)."""
    settings = tutorial_settings(workdir / name, rounds, nodes)
    timed = fresh_folder(workdir / f"phases-{name}") if phases else None
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_simulate_child, args=(settings, send, timed))
    child.start()
    send.close()  # the child's end only: a child that fails closes it, and recv raises EOFError
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    if result is None:
        raise SystemExit(f"the simulate reference failed (exit status {child.exitcode}); see above")
    return result


def run_simulate_pair(rounds: int, nodes: int, workdir: Path, phases: bool = False) -> list[dict[str, Any]]:
    """`run_simulate` twice at once, each copy pinned to a core of its own (the first two this process may use):
    the same job's CPU with both cores busy, as the cluster keeps them. The bound (simulate's CPU over the cores)
    takes two busy cores to do twice one's work; where they share caches or memory bandwidth they do less, and the
    pair's CPU per round against simulate's alone says by how much on this host."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def copy(i: int) -> None:
        try:
            os.sched_setaffinity(threading.get_native_id(), {cores[i]})  # this thread's: the forked copy inherits it
            results[i] = run_simulate(rounds, nodes, workdir, phases, name=f"simulate-pair{i}")
        except BaseException as exc:  # SystemExit of a copy that failed: raised below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[0], results[1]]


def phases_side_by_side(cluster: list[dict[str, Any]], simulate: list[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's CPU ms per call and per round, medians over the runs: the cluster's nodes, its barrier and
    simulate, and the nodes' per call against simulate's (printed as one line)."""
    def medians(runs: list[dict[str, Any]], role: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for phase in sorted({p for r in runs for p in r["phases"][role]}):
            got = [r["phases"][role][phase] for r in runs if phase in r["phases"][role]]
            out[phase] = {k: round(statistics.median(g[k] for g in got), 3) for k in ("cpu_ms_per_call",
                                                                                      "cpu_ms_per_round")}
        return out

    nodes, barrier, sim = medians(cluster, "node"), medians(cluster, "barrier"), medians(simulate, "simulate")
    parts = []
    for phase, figures in nodes.items():
        ours = f"{figures['cpu_ms_per_call']:.2f} ({figures['cpu_ms_per_round']:.1f})"
        theirs = sim.get(phase)
        if theirs is None:
            parts.append(f"{phase} {ours} | none")
            continue
        ratio = figures["cpu_ms_per_call"] / theirs["cpu_ms_per_call"]
        parts.append(f"{phase} {ours} | {theirs['cpu_ms_per_call']:.2f} ({theirs['cpu_ms_per_round']:.1f}): "
                     f"{ratio:.2f}x a call")
    print("phases, CPU ms a call (a round), the cluster's nodes | simulate: " + "; ".join(parts) + "; the barrier: "
          + ", ".join(f"{p} {f['cpu_ms_per_call']:.2f} ({f['cpu_ms_per_round']:.1f})" for p, f in barrier.items()))
    return {"node": nodes, "barrier": barrier, "simulate": sim}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    result = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and all(isinstance(r.get(key), (int, float)) for r in runs):
            result[key] = round(statistics.median(r[key] for r in runs), 3)
    result["runs"] = len(runs)
    return result


def side_by_side(numerators: list[float], denominators: list[float]) -> tuple[float, list[float]]:
    """The median of the ratios of runs made side by side (repeat i against repeat i), and those ratios: the
    host's speed drifts by tens of percent over minutes, so a ratio of two medians taken minutes apart is not one
    of the same machine."""
    ratios = [round(a / b, 3) for a, b in zip(numerators, denominators, strict=True)]
    return round(statistics.median(ratios), 3), ratios


def pair_figures(pairs: list[list[dict[str, Any]]], alone: list[dict[str, Any]], warm: list[dict[str, Any]],
                 cores: int, phases: bool) -> dict[str, Any]:
    """--simulate-pair's figures, each repeat's pair against the same repeat's simulate alone (and warm cluster),
    printed and returned: the copies' CPU per round over simulate's alone, each copy's training per call where the
    phases were timed, and the cluster's wall over the bound the pair's CPU would make (context for item 3, whose
    bound stays simulate's alone)."""
    if any(r.get("cpu_per_round_s") is None for r in [*alone, *(c for pair in pairs for c in pair)]):
        print("simulate twice at once: too few rounds to read a CPU per round (--rounds 12 or more)")
        return {}
    per_round = [statistics.mean(c["cpu_per_round_s"] for c in pair) for pair in pairs]
    ratio, ratios = side_by_side(per_round, [s["cpu_per_round_s"] for s in alone])
    busy, busies = side_by_side([w["wall_s"] for w in warm], [statistics.mean(c["cpu_s"] for c in pair) / cores
                                                              for pair in pairs])
    figures: dict[str, Any] = {"cpu_per_round_s": round(statistics.median(per_round), 4),
                               "round_cpu_to_alone": ratio, "round_cpus_to_alone": ratios,
                               "ratio_to_busy_bound": busy, "ratios_to_busy_bound": busies}
    train = ""
    if phases:
        calls = [statistics.mean(c["phases"]["simulate"]["train"]["cpu_ms_per_call"] for c in pair) for pair in pairs]
        one = [s["phases"]["simulate"]["train"]["cpu_ms_per_call"] for s in alone]
        figures["train_ms_per_call"] = round(statistics.median(calls), 3)
        figures["train_to_alone"], _ = side_by_side(calls, one)
        train = (f"; training {figures['train_ms_per_call']} ms a call, {figures['train_to_alone']}x simulate's "
                 "alone")
    print(f"simulate twice at once, a core each: CPU per round {1000 * figures['cpu_per_round_s']:.0f} ms a copy, "
          f"{ratio}x simulate's alone (each run: {', '.join(map(str, ratios))}){train}; the cluster's wall over "
          f"the bound such busy cores make: {busy}x (not issue 59's bound, which is simulate's alone)")
    return figures


def print_variant(name: str, r: dict[str, Any]) -> None:
    print(f"{name:5s} wall {r['wall_s']:.1f} s (launch to end {r['launch_wall_s']:.1f} s), cpu {r['cpu_s']:.1f} s,"
          f" PSS total {r['pss_total_mib']} MiB, per node median {r['pss_node_median_mib']} MiB "
          f"(max {r['pss_node_max_mib']}), barrier {r['pss_barrier_mib']} MiB, accuracy {r['accuracy']}")
    print(f"      host meanwhile: other processes {r['others_cpu_s']} CPU-s, idle {r['host_idle_s']} core-s "
          f"(load before {r['load_before']})")
    print(f"      CPU-s by thread: nodes' event loops {r['node_loop_s']} ({r['node_loop_ms_per_round']} ms per "
          f"node and round), nodes' other threads {r['node_threads_s']}, barrier's loop {r['barrier_loop_s']}, "
          f"its other threads {r['barrier_threads_s']}")
    split = r.get("split_per_round") or {}
    if split:
        print("      CPU ms per round, rounds 1 to the last but one: " + ", ".join(
            f"{k.replace('_ms_per_round', '').replace('_', ' ')} {v}" for k, v in split.items()))
    if r.get("wall_ms_per_round"):
        print(f"      a round took {r['wall_ms_per_round']} ms of wall and left {r['idle_core_ms_per_round']} core-ms "
              f"of this host idle ({os.cpu_count()} cores), rounds 1 to the last but one")
    switches = r.get("switches_per_round") or {}
    if switches:
        print("      context switches per round (a node's per node), voluntary/involuntary: " + ", ".join(
            f"{part.replace('_', ' ')} {switches[f'{part}_voluntary']}/{switches[f'{part}_involuntary']}"
            for part in ("node_loop", "node_threads", "barrier_loop", "barrier_threads")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per variant, interleaved (warm, cold, simulate, warm, ...); figures are medians")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold reference")
    parser.add_argument("--no-simulate", action="store_true", help="skip simulate's CPU-seconds reference")
    parser.add_argument("--plain", action="store_true",
                        help="also the warm cluster without a secret (--insecure), in turn: the secret / plain ratios")
    parser.add_argument("--unpinned", action="store_true",
                        help="also the warm cluster with --pin-nodes off, in turn: the pinned / unpinned ratios")
    parser.add_argument("--phases", action="store_true",
                        help="also time each process's phases (training, each model's evaluation, checkpoints) on "
                        "its thread's CPU clock, in the cluster's nodes and barrier and in simulate: where the "
                        "nodes' threads spend theirs against simulate's")
    parser.add_argument("--simulate-pair", action="store_true",
                        help="also simulate twice at once, each copy pinned to a core of its own, in turn with the "
                        "others: the job's CPU per round with both cores busy against simulate's alone (what the "
                        "bound assumes costs nothing)")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs go [default: a temporary folder]")
    parser.add_argument("--event-loop", default="auto", metavar="LOOP[,LOOP]",
                        help="the cluster's --event-loop (auto, uvloop, asyncio); several (uvloop,asyncio): the warm "
                        "cluster on each, in turn, and their ratios")
    args = parser.parse_args()
    loops = [x.strip() for x in args.event_loop.split(",") if x.strip()]
    if not loops or any(x not in EventLoop._value2member_map_ for x in loops):
        parser.error(f"--event-loop: expected {', '.join(EventLoop)} (comma-separated), got {args.event_loop!r}")
    if args.simulate_pair and (args.no_simulate or len(os.sched_getaffinity(0)) < 2):
        parser.error("--simulate-pair: needs simulate's reference (no --no-simulate) and two cores to pin the copies "
                     f"to (this process may use {len(os.sched_getaffinity(0))})")
    configure_logging("warning")
    cores = os.cpu_count() or 1
    # variant -> its loop; the first warm one is "warm" for the cold and simulate comparisons
    variants = {"warm": loops[0]} if len(loops) == 1 else {f"warm-{loop}": loop for loop in loops}
    warms = list(variants)
    if not args.no_cold:
        variants["cold"] = loops[0]
    if args.plain:
        variants["plain"] = loops[0]
    if args.unpinned:
        variants["unpinned"] = loops[0]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    if not args.no_simulate:
        runs["simulate"] = []
    pair_runs: list[list[dict[str, Any]]] = []  # --simulate-pair: each repeat's two copies
    with tempfile.TemporaryDirectory(prefix="mosaic-tutorial-") as tmp:
        workdir = args.workdir or Path(tmp)
        for i in range(args.repeat):
            for name in runs:
                runs[name].append(run_simulate(args.rounds, args.nodes, workdir, args.phases) if name == "simulate"
                                  else run_once(name, args.rounds, args.nodes, workdir, variants[name], args.phases))
            if args.simulate_pair:
                pair_runs.append(run_simulate_pair(args.rounds, args.nodes, workdir, args.phases))
            if args.repeat > 1:
                done = ", ".join(f"{name} cpu {r[-1]['cpu_s']:.1f} s" if name == "simulate"
                                 else f"{name} wall {r[-1]['wall_s']:.1f} s" for name, r in runs.items())
                print(f"run {i + 1}/{args.repeat}: {done}", flush=True)
    results = {name: median_of(r) for name, r in runs.items()}
    for name in results:
        if name != "simulate":
            print_variant(name, results[name])
    report: dict[str, Any] = {"job": {"nodes": args.nodes, "rounds": args.rounds, "repeat": args.repeat,
                                      "event_loops": loops}, "cores": cores, **results}
    if "simulate" in results:
        sim = results["simulate"]
        bound = sim["cpu_s"] / cores
        report["compute_bound_s"] = round(bound, 2)
        bounds = [s["cpu_s"] / cores for s in runs["simulate"]]
        for name in warms:
            warm, key = results[name], "" if len(warms) == 1 else f" ({name})"
            ratio, ratios = side_by_side([r["wall_s"] for r in runs[name]], bounds)
            launch, _ = side_by_side([r["launch_wall_s"] for r in runs[name]], bounds)
            if len(warms) == 1:
                report["ratio_to_bound"], report["ratios_to_bound"], report["ratio_launch_to_bound"] = \
                    ratio, ratios, launch
            else:
                report.setdefault("ratio_to_bound", {})[variants[name]] = ratio
                report.setdefault("ratios_to_bound", {})[variants[name]] = ratios
                report.setdefault("ratio_launch_to_bound", {})[variants[name]] = launch
            each = f" (each run: {', '.join(f'{x}x' for x in ratios)})" if args.repeat > 1 else ""
            print(f"simulate: cpu {sim['cpu_s']:.1f} s (wall {sim['wall_s']:.1f} s); bound on {cores} cores "
                  f"{bound:.1f} s; cluster{key} wall {warm['wall_s']:.1f} s = {ratio}x the bound{each} "
                  f"(launch to end {launch}x); target <= {TARGET}x (issue 59): "
                  f"{'met' if ratio <= TARGET else 'not met'}")
            by_cpu, cpus = side_by_side([r["cpu_s"] for r in runs[name]], [s["cpu_s"] for s in runs["simulate"]])
            report.setdefault("cpu_to_simulate", {})[variants[name]] = by_cpu
            print(f"cluster{key} CPU / simulate's CPU: {by_cpu}x (each run: {', '.join(map(str, cpus))}): the ratio "
                  "the wall comes to on idle cores where the cluster keeps both busy; other jobs on the host stretch "
                  "the wall, not this")
            pairs = [(r["cpu_per_round_s"], s["cpu_per_round_s"]) for r, s in zip(runs[name], runs["simulate"],
                                                                                 strict=True)
                     if r.get("cpu_per_round_s") and s.get("cpu_per_round_s")]
            if pairs:
                per_round, per_rounds = side_by_side([a for a, _ in pairs], [b for _, b in pairs])
                report.setdefault("round_cpu_to_simulate", {})[variants[name]] = per_round
                report.setdefault("round_cpus_to_simulate", {})[variants[name]] = per_rounds
                print(f"cluster{key} CPU per round / simulate's, rounds 1 to {args.rounds - 2} (no start, no end): "
                      f"{per_round}x (each run: {', '.join(map(str, per_rounds))}; cluster "
                      f"{1000 * statistics.median(a for a, _ in pairs):.0f} ms, simulate "
                      f"{1000 * statistics.median(b for _, b in pairs):.0f} ms a round, medians of those runs): the "
                      "wall's ratio in those rounds, were both cores kept busy")
            workers = warm["node_threads_s"] / sim["cpu_s"]
            report.setdefault("workers_to_bound", {})[variants[name]] = round(workers, 3)
            print(f"cluster{key}: its nodes' worker threads alone (training, checkpoints, their own evaluations) "
                  f"{warm['node_threads_s']:.1f} CPU-s = {workers:.2f}x simulate's {sim['cpu_s']:.1f}: the least "
                  f"the ratio could come to were the event loops, HTTP and the barrier free")
        report["same_models_simulate"] = all(s["model_sha256"] == w["model_sha256"] for name in warms
                                             for s, w in zip(runs["simulate"], runs[name], strict=True))
        print(f"same models as simulate: {report['same_models_simulate']}")
        if args.phases:
            report["phases"] = phases_side_by_side(runs[warms[0]], runs["simulate"])
        if pair_runs:
            report["simulate_pair"] = pair_figures(pair_runs, runs["simulate"], runs[warms[0]], cores, args.phases)
    if len(warms) > 1:
        first, last = warms[0], warms[-1]
        report["loop_ratio_wall"], report["loop_ratios_wall"] = side_by_side(
            [r["wall_s"] for r in runs[first]], [r["wall_s"] for r in runs[last]])
        report["loop_ratio_cpu"], report["loop_ratios_cpu"] = side_by_side(
            [r["cpu_s"] for r in runs[first]], [r["cpu_s"] for r in runs[last]])
        report["loop_ratio_node_loop"], _ = side_by_side(
            [r["node_loop_s"] for r in runs[first]], [r["node_loop_s"] for r in runs[last]])
        print(f"{loops[0]} / {loops[-1]}: wall {report['loop_ratio_wall']} (each run: "
              f"{', '.join(map(str, report['loop_ratios_wall']))}), CPU {report['loop_ratio_cpu']}, nodes' event "
              f"loops' CPU {report['loop_ratio_node_loop']}")
    if "plain" in results:
        secret = runs[warms[0]]
        report["secret_to_plain_wall"], report["secrets_to_plain_wall"] = side_by_side(
            [r["wall_s"] for r in secret], [r["wall_s"] for r in runs["plain"]])
        report["secret_to_plain_cpu"], report["secrets_to_plain_cpu"] = side_by_side(
            [r["cpu_s"] for r in secret], [r["cpu_s"] for r in runs["plain"]])
        report["secret_to_plain_node_loop"], _ = side_by_side(
            [r["node_loop_s"] for r in secret], [r["node_loop_s"] for r in runs["plain"]])
        print(f"secret / plain: wall {report['secret_to_plain_wall']} (each run: "
              f"{', '.join(map(str, report['secrets_to_plain_wall']))}), CPU {report['secret_to_plain_cpu']} "
              f"(each run: "
              f"{', '.join(map(str, report['secrets_to_plain_cpu']))}), nodes' event loops' CPU "
              f"{report['secret_to_plain_node_loop']}; target <= {SECRET_TARGET}x (issue 59): "
              f"{'met' if report['secret_to_plain_wall'] <= SECRET_TARGET else 'not met'}")
    if "unpinned" in results:
        pinned = runs[warms[0]]
        for figure in ("wall", "cpu"):
            key = "wall_s" if figure == "wall" else "cpu_s"
            report[f"pinned_to_unpinned_{figure}"], report[f"pinneds_to_unpinned_{figure}"] = side_by_side(
                [r[key] for r in pinned], [r[key] for r in runs["unpinned"]])
        if "simulate" in results:
            report["unpinned_ratio_to_bound"], report["unpinned_ratios_to_bound"] = side_by_side(
                [r["wall_s"] for r in runs["unpinned"]], [s["cpu_s"] / cores for s in runs["simulate"]])
        walls, cpus = (", ".join(map(str, report[f"pinneds_to_unpinned_{f}"])) for f in ("wall", "cpu"))
        print(f"pinned ({pinned[-1]['pinned_nodes']} nodes; --pin-nodes auto) / unpinned (off): wall "
              f"{report['pinned_to_unpinned_wall']} (each run: {walls}), CPU {report['pinned_to_unpinned_cpu']} "
              f"(each run: {cpus})"
              + (f"; unpinned {report['unpinned_ratio_to_bound']}x the bound" if "simulate" in results else ""))
    if "cold" in results:
        warm, cold = results[warms[0]], results["cold"]
        report["ratio_wall"], report["ratios_wall"] = side_by_side(
            [r["launch_wall_s"] for r in runs[warms[0]]], [r["launch_wall_s"] for r in runs["cold"]])
        report["ratio_pss_total"] = (round(warm["pss_total_mib"] / cold["pss_total_mib"], 3)
                                     if warm["pss_total_mib"] and cold["pss_total_mib"] else None)
        report["same_models"] = all(w["model_sha256"] == c["model_sha256"]
                                    for w, c in zip(runs[warms[0]], runs["cold"], strict=True))
        print(f"warm / cold: wall {report['ratio_wall']}, PSS {report['ratio_pss_total']}, "
              f"same models: {report['same_models']}")
    for r in results.values():
        r.pop("model_sha256", None)
    print(json.dumps(report))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the cluster has been stopped (Cluster.run) and the temporary runs removed
        raise SystemExit("interrupted: no figures") from None

"""`mosaicd cluster --sync async`: N asynchronous node daemons on 127.0.0.1 (`daemon/node/async_run.py`).

No barrier process: what is left of one in an asynchronous run is done here, never on the data path. The start:
the roster (every node's address in rank order, a file the nodes read; each waits for the others to answer before
it trains). The end: each node reports (its `async.json` and final model, in OUT/nodes/<rank>) when it has done its
--rounds iterations and sent its queue; the run ends when every node has, and this launcher evaluates the final
models and writes summary.json (the models' hashes, the metrics, the `asynchronous` block: each node's steps,
training time and step rate, and what it counted). A node process that dies is left out (`dropped`): the others
go on, never waiting for it, and the run ends when each of them has reported (no rejoin yet; --fail-fast fails the
run instead). The secret is the cluster's (`run_secret.py`): every message is signed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mosaicd.daemon.node.async_run import GRID, MODEL, REPORT, ROSTER_ENV
from mosaicd.experiments.cluster import POLL_S, ClusterFailed, free_ports, settings_env
from mosaicd.experiments.processes import Processes, exit_reason
from mosaicd.experiments.run_secret import RunSecret
from mosaicd.files import write_whole
from mosaicd.learning.tasks import check_requirements, require_task
from mosaicd.outputs import MODE_ENV, RunRecorder, failure_text, honest_nodes, remove_summary, robustness_summary
from mosaicd.progress import ProgressPrinter
from mosaicd.rundir import claim_out, release
from mosaicd.settings import Settings

START_S = 60.0  # on top of --register-deadline: the processes' imports and the task's build


def async_deadline(settings: Settings) -> float:
    """How long a whole run may take: the start, then every iteration at its slowest node's pace with a wide
    margin (a second an iteration at least)."""
    from mosaicd.protocol import profile_spec

    spec = profile_spec(settings.run_config())
    slowest = 1.0
    if spec is not None:
        slowest = max(1.0, max(p.train_s(spec.compute_s) for p in spec.resolve(settings.seed, settings.nodes)))
    return START_S + settings.register_deadline + 4 * settings.rounds * slowest


@dataclass(frozen=True)
class NodeHost:
    """Where a node runs when not on this machine's loopback: the host:port it listens on and is reached at (its
    roster entry), and the command that starts it there (a netns lab's `ip netns exec NS`)."""

    address: str
    prefix: tuple[str, ...] = ()


class AsyncCluster:
    def __init__(self, settings: Settings, progress: bool = True, fail_fast: bool = False,
                 hosts: Sequence[NodeHost] | None = None) -> None:
        """`fail_fast`: a node process that dies fails the run; by default the others go on without it, and the
        run ends when every other node has reported. `hosts`: node i runs at hosts[i] (rank = roster order; by
        default every node on 127.0.0.1, at a free port)."""
        if hosts is not None and len(hosts) != settings.nodes:
            raise ValueError(f"{len(hosts)} hosts for {settings.nodes} nodes")
        self.settings, self.progress, self.fail_fast, self.hosts = settings, progress, fail_fast, hosts
        self.lost: list[int] = []  # the ranks whose process died before they reported
        self.out = Path(settings.out)
        self.processes = Processes(self.out)
        self.secret = RunSecret(settings)

    def run(self, timeout: float | None = None) -> dict[str, Any]:
        """Run to the end; summary.json's content. ClusterFailed where a node fails or the run does not end in
        time (every process is stopped, and summary.json says "failed" and why)."""
        self.out.mkdir(parents=True, exist_ok=True)
        remove_summary(self.out)
        recorder = RunRecorder(self.out, self.settings, mode="cluster")
        try:
            reports = self._run(timeout or async_deadline(self.settings))
            return self._finish(recorder, reports)
        except BaseException as exc:
            recorder.fail(failure_text(exc))
            raise
        finally:
            self.processes.stop()
            self.secret.remove()

    def _run(self, timeout: float) -> dict[int, dict[str, Any]]:
        s = self.settings
        require_task(s.task)
        hosts = self.hosts or [NodeHost(f"127.0.0.1:{p}") for p in sorted(free_ports(s.nodes))]
        addresses = [h.address for h in hosts]  # rank i is address i, as the barrier's roster orders them
        roster = self.out / "roster.json"
        write_whole(roster, json.dumps({"addresses": addresses}))
        secret = self.secret.make()
        for rank, host in enumerate(hosts):
            ip, port = host.address.rsplit(":", 1)
            env = {**settings_env(s, host=ip, port=int(port), advertise=host.address, log_json=True,
                                  out=str(self.out / "nodes" / str(rank)), **secret),
                   MODE_ENV: "cluster", ROSTER_ENV: str(roster)}
            self.processes.spawn(f"node-{rank}", "node", env, module="mosaicd.daemon.node.async_run",
                                 prefix=host.prefix)
        deadline = time.monotonic() + timeout
        reports: dict[int, dict[str, Any]] = {}
        with ProgressPrinter(enabled=self.progress) as printer:
            printer.message(f"run folder {self.out}: {s.nodes} asynchronous nodes, {s.rounds} iterations each")
            while len(reports) + len(self.lost) < s.nodes:
                _, new = self.processes.failures()
                for name in new:  # a node that dies costs the others nothing: they go on without it
                    code = self.processes.dead[name]
                    why = f"{name} exited with status {code}: " \
                          f"{exit_reason(self.out, name, code, self.processes.said_by(name))} " \
                          f"(see {self.out / 'logs' / name}.log)"
                    if self.fail_fast:
                        raise ClusterFailed(why)
                    self.lost.append(int(name.removeprefix("node-")))
                    printer.message(f"{why}; the others go on without it (--fail-fast to stop instead)", always=True)
                if len(self.lost) == s.nodes:
                    raise ClusterFailed(f"every node exited before its end; see {self.out / 'logs'}")
                if time.monotonic() > deadline:
                    raise ClusterFailed(f"the run did not finish in {timeout:g} s: nodes "
                                        f"{sorted(set(range(s.nodes)) - set(reports) - set(self.lost))} did not "
                                        f"report; see {self.out / 'logs'}")
                for rank in set(range(s.nodes)) - set(reports) - set(self.lost):
                    path = self.out / "nodes" / str(rank) / REPORT
                    if path.exists():
                        reports[rank] = json.loads(path.read_text())
                        printer.message(f"node {rank} finished its {reports[rank]['steps']} iterations in "
                                        f"{reports[rank]['elapsed_s']:.2f} s")
                time.sleep(POLL_S)
        return reports

    def _grid(self, finals: dict[int, np.ndarray]) -> list[dict[int, np.ndarray]]:
        """Each point of the time grid: every node's model then (a node finished before it: its final model)."""
        grids = {}
        for rank in finals:
            with np.load(self.out / "nodes" / str(rank) / GRID) as kept:
                grids[rank] = kept["models"]
        points = max((len(g) for g in grids.values()), default=0)
        return [{r: grids[r][k] if k < len(grids[r]) else finals[r] for r in finals} for k in range(points)]

    def _finish(self, recorder: RunRecorder, reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The final models evaluated: the last row of rounds.csv and summary.json."""
        from mosaicd.learning.evaluation import network_metrics
        from mosaicd.learning.tasks import build_task

        s = self.settings
        run = s.run_config()
        task = build_task(run, s.data_dir)
        vectors = {rank: np.load(self.out / "nodes" / str(rank) / MODEL) for rank in sorted(reports)}
        honest, says = honest_nodes(run, sorted(reports))
        period = max(n["eval_period_s"] for n in reports.values())
        last = -1
        for k, models in enumerate(self._grid(vectors), start=1):  # rows as simulate's: `round` the iterations
            last = k * s.eval_every - 1  # an unslowed node has done by then, less one; `time_s` the grid's time
            recorder.network_round(last, {**network_metrics(task, [models[i] for i in honest]), "nodes": honest,
                                          **says, "time_s": round(k * period, 6)}, time.time())
        end = max(n["elapsed_s"] for n in reports.values())
        nominal = max(s.rounds - 1, last + 1, math.ceil(end / period - 1e-9) * s.eval_every - 1 if period else 0)
        recorder.network_round(nominal, {**network_metrics(task, [vectors[i] for i in honest]),
                                         "nodes": honest, **says, "time_s": round(end, 6)}, time.time())
        per_node = {str(r): {k: v for k, v in reports[r].items() if k != "rank"} for r in sorted(reports)}
        return recorder.finish(vectors, members=sorted(reports), dropped=sorted(self.lost), events=[],
                               asynchronous={"steps": {r: n["steps"] for r, n in per_node.items()},
                                             "elapsed_s": {r: n["elapsed_s"] for r, n in per_node.items()},
                                             "steps_per_s": {r: n["steps_per_s"] for r, n in per_node.items()},
                                             "eval_period_s": period,
                                             "signed": all(n["signed"] for n in per_node.values()),
                                             "messages_sent": sum(n["sent"] for n in per_node.values()),
                                             "messages_unsent": sum(n["unsent"] for n in per_node.values()),
                                             "replays_refused": sum(n["replays_refused"] for n in per_node.values()),
                                             "fragments_superseded": sum(n["fragments_superseded"]
                                                                         for n in per_node.values()),
                                             "pairs_averaged": sum(n["averaged"] for n in per_node.values()),
                                             "fragments_stale": sum(n["fragments_stale"] for n in per_node.values())},
                               **robustness_summary(run))


def run_cluster_async(settings: Settings, progress: bool = True, timeout: float | None = None, *,
                      replace: bool = False, fail_fast: bool = False) -> dict[str, Any]:
    """`run_cluster` for --sync async: summary.json's content. The folder is claimed as `run_cluster` claims it
    (`rundir.claim_out`); ClusterFailed where the run fails or the settings are not run yet (`refusal`)."""
    if (refused := refusal(settings)) is not None:
        raise ClusterFailed(refused)
    given = settings.out if "out" in settings.model_fields_set else None
    check_requirements(settings.task, settings.data_dir)  # before any folder is made or process starts
    out = claim_out(given, "cluster", replace=replace, run_id=settings.run_id)
    try:
        return AsyncCluster(settings.model_copy(update={"out": out}), progress, fail_fast).run(timeout)
    finally:
        release(out)


def refusal(settings: Settings, resume: bool = False) -> str | None:
    """Why `cluster --sync async` cannot run these settings yet (one line naming the flag), or None."""
    if resume:
        return "--resume: the asynchronous daemons save no checkpoint yet: run it again from the start"
    return None

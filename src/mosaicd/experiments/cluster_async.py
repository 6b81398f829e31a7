"""`mosaicd cluster --sync async`: N asynchronous node daemons on 127.0.0.1 (`daemon/node/async_run.py`).

No barrier process: what is left of one in an asynchronous run is done here, never on the data path. The start:
the roster (every node's address in rank order, a file the nodes read; each waits for the others to answer before
it trains). The end: each node reports (its `async.json` and final model, in OUT/nodes/<rank>) when it has done its
--rounds iterations and sent its queue; the run ends when every node has, and this launcher evaluates the final
models and writes summary.json (the models' hashes, the metrics, the `asynchronous` block: each node's steps,
training time and step rate, and what it counted). A node process that dies is left out (`dropped`): the others
go on, never waiting for it, and the run ends when each of them has reported (--fail-fast fails the run instead);
one started again (`restart`) goes on from its checkpoint and is waited for again. The secret is the cluster's
(`run_secret.py`): every message is signed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaicd.daemon.async_end import node_folder, read_report, run_deadline, summarize
from mosaicd.daemon.http.server import LISTEN_FD
from mosaicd.daemon.node.async_run import ROSTER_ENV
from mosaicd.experiments.cluster import POLL_S, ClusterFailed, listening_sockets, settings_env
from mosaicd.experiments.processes import Processes, exit_reason, node_cores, pinned_line
from mosaicd.experiments.run_secret import RunSecret
from mosaicd.files import write_whole
from mosaicd.learning.tasks import check_requirements, require_task
from mosaicd.outputs import MODE_ENV, RunRecorder, failure_text, remove_summary
from mosaicd.progress import ProgressPrinter
from mosaicd.rundir import claim_out, release
from mosaicd.settings import Settings

START_S = 60.0  # on top of --register-deadline: the processes' imports and the task's build


def async_deadline(settings: Settings) -> float:
    """How long a whole run may take: the processes' start, then `async_end.run_deadline`."""
    return START_S + run_deadline(settings)


@dataclass(frozen=True)
class NodeHost:
    """Where a node runs when not on this machine's loopback: the host:port it listens on and is reached at (its
    roster entry), and the command that starts it there (a netns lab's `ip netns exec NS`)."""

    address: str
    prefix: tuple[str, ...] = ()


class AsyncCluster:
    def __init__(self, settings: Settings, progress: bool = True, fail_fast: bool = False,
                 hosts: Sequence[NodeHost] | None = None, pin: str = "auto") -> None:
        """`fail_fast`: a node process that dies fails the run; by default the others go on without it, and the
        run ends when every other node has reported. `hosts`: node i runs at hosts[i] (rank = roster order; by
        default every node on 127.0.0.1, at a free port). `pin`: `--pin-nodes` (`processes.node_cores`), for
        nodes on this host (not given `hosts`)."""
        if hosts is not None and len(hosts) != settings.nodes:
            raise ValueError(f"{len(hosts)} hosts for {settings.nodes} nodes")
        self.settings, self.progress, self.fail_fast, self.hosts, self.pin = settings, progress, fail_fast, hosts, pin
        self.lost: list[int] = []  # the ranks whose process died before they reported (and was not restarted)
        self.envs: dict[int, dict[str, str]] = {}  # each node's process environment, for `restart`
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
        socks = listening_sockets(s.nodes) if self.hosts is None else []  # handed to the nodes: held from now on
        try:
            self._spawn(s, socks)
        finally:
            for sock in socks:  # the nodes hold them now
                sock.close()
        deadline = time.monotonic() + timeout
        reports: dict[int, dict[str, Any]] = {}
        with ProgressPrinter(enabled=self.progress) as printer:
            budget = f" or {s.time_budget:g} s of training" if s.time_budget is not None else ""
            printer.message(f"run folder {self.out}: {s.nodes} asynchronous nodes, {s.rounds} iterations each"
                            f"{budget}")
            if (pinned := pinned_line(self.processes.cores, self.pin)) is not None:
                printer.message(pinned)
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
                    if (report := read_report(self.out, rank)) is not None:
                        reports[rank] = report
                        by = " (its time budget spent)" if report.get("stopped_by") == "budget" else ""
                        printer.message(f"node {rank} finished its {report['steps']} iterations{by} in "
                                        f"{reports[rank]['elapsed_s']:.2f} s")
                time.sleep(POLL_S)
        return reports

    def _spawn(self, s: Settings, socks: list[socket.socket]) -> None:
        """The nodes' processes, at `self.hosts` or, on this host's loopback, each handed its listening socket
        (`socks`, in the order of their ports: rank i is address i)."""
        hosts = self.hosts or [NodeHost(f"127.0.0.1:{sock.getsockname()[1]}") for sock in socks]
        addresses = [h.address for h in hosts]  # rank i is address i, as the barrier's roster orders them
        roster = self.out / "roster.json"
        write_whole(roster, json.dumps({"addresses": addresses}))
        secret = self.secret.make()
        if self.hosts is None:
            self.processes.place(node_cores([f"node-{rank}" for rank in range(s.nodes)], self.pin, s.nodes,
                                            key=str(self.out)))
        for rank, host in enumerate(hosts):
            ip, port = host.address.rsplit(":", 1)
            env = {**settings_env(s, host=ip, port=int(port), advertise=host.address, log_json=True,
                                  out=str(node_folder(self.out, rank)), **secret),
                   MODE_ENV: "cluster", ROSTER_ENV: str(roster)}
            self.envs[rank] = env  # a restart binds the port itself: the socket handed down is gone with the process
            fds = [socks[rank].fileno()] if socks else []
            handed = {LISTEN_FD: str(fds[0])} if fds else {}
            self.processes.spawn(f"node-{rank}", "node", {**env, **handed}, module="mosaicd.daemon.node.async_run",
                                 prefix=host.prefix, pass_fds=fds)

    def restart(self, rank: int) -> None:
        """Start node `rank`'s process again, the same member (address, --out, state directory): it goes on from its
        checkpoint and the run waits for its report again (what an operator's supervisor does; the others never
        wait for it meanwhile)."""
        name = f"node-{rank}"
        if self.processes.ended(name) is None:
            raise RuntimeError(f"{name} still runs")
        self.processes.failures()  # its death seen here first, not taken for a new one after the restart
        prefix = self.hosts[rank].prefix if self.hosts is not None else ()
        self.processes.respawn(name, "node", self.envs[rank], module="mosaicd.daemon.node.async_run", prefix=prefix)
        if rank in self.lost:
            self.lost.remove(rank)

    def _finish(self, recorder: RunRecorder, reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The reports evaluated: rounds.csv and summary.json (`async_end.summarize`)."""
        return summarize(self.out, self.settings, recorder, reports, self.lost)


def run_cluster_async(settings: Settings, progress: bool = True, timeout: float | None = None, *,
                      replace: bool = False, fail_fast: bool = False, pin: str = "auto") -> dict[str, Any]:
    """`run_cluster` for --sync async: summary.json's content. The folder is claimed as `run_cluster` claims it
    (`rundir.claim_out`); ClusterFailed where the run fails or the settings are not run yet (`refusal`)."""
    if (refused := refusal(settings)) is not None:
        raise ClusterFailed(refused)
    given = settings.out if "out" in settings.model_fields_set else None
    check_requirements(settings.task, settings.data_dir)  # before any folder is made or process starts
    out = claim_out(given, "cluster", replace=replace, run_id=settings.run_id)
    try:
        return AsyncCluster(settings.model_copy(update={"out": out}), progress, fail_fast, pin=pin).run(timeout)
    finally:
        release(out)


def refusal(settings: Settings, resume: bool = False) -> str | None:
    """Why `cluster --sync async` cannot run these settings yet (one line naming the flag), or None."""
    if resume:
        return ("--resume: an asynchronous cluster is not resumed as a whole (a node started again within the run "
                "goes on from its own checkpoint, not bit-exact): run it again from the start")
    return None

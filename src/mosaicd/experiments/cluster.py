"""`mosaicd cluster`: a barrier and N node processes on 127.0.0.1, with progress, and no orphans left behind.

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` once per round, in order, as the barrier's /v1/status shows rounds released (polled every
0.2 s); the last round is reported once the run's summary is written, with the final evaluation row.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from mosaicd.daemon.tls import client_context, scheme
from mosaicd.experiments.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.learning.tasks import require_task
from mosaicd.outputs import failed_summary, failure_text
from mosaicd.settings import Settings

PR_SET_PDEATHSIG = 1


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def settings_env(settings: Settings, **override: Any) -> dict[str, str]:
    """The settings as MOSAIC_* variables, so every child process reads the same run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    values = {**settings.model_dump(mode="json"), **override}
    for key, value in values.items():
        if value is None:
            continue
        env[f"MOSAIC_{key.upper()}"] = json.dumps(value) if isinstance(value, bool) else str(value)
    return env


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    def __init__(self, settings: Settings, progress: bool = True, on_round: OnRound | None = None,
                 fail_fast: bool = False) -> None:
        """`fail_fast`: end the run when any node process dies; by default a dead node is reported and the run
        goes on without it, as a run started by hand does (the barrier drops it)."""
        self.settings, self.progress, self.on_round, self.fail_fast = settings, progress, on_round, fail_fast
        self.dead: dict[str, int] = {}
        self.out = Path(settings.out)
        self.procs: dict[str, subprocess.Popen] = {}
        self.barrier_port: int | None = None  # set by run(): where to scrape the barrier's /v1/status, /metrics
        self.node_ports: list[int] = []  # node-i listens on node_ports[i] (its rank is its address' sort order)

    def _spawn(self, name: str, command: str, env: dict[str, str]) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mosaicd", command], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        log.close()

    def status(self, port: int) -> dict | None:
        try:
            with urllib.request.urlopen(f"{scheme(self.settings)}://127.0.0.1:{port}/v1/status", timeout=2,
                                        context=client_context(self.settings)) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def run(self, timeout: float | None = None) -> dict:
        """Run to the end and return summary.json's content. ClusterFailed when a process fails or the run
        does not finish in time; then (and on any other exception, Ctrl-C included) every process is stopped and
        summary.json says "status": "failed" and why, with the rounds recorded until then."""
        started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "summary.json").unlink(missing_ok=True)  # an earlier run's: it must not pass for this one's
        try:
            return self._run(timeout)
        except BaseException as exc:
            self.stop()
            self._record_failure(exc, started)
            raise
        finally:
            self.stop()

    def _run(self, timeout: float | None) -> dict:
        s = self.settings
        require_task(s.task)  # the one-line error here, not one per node log
        ports = free_ports(s.nodes + 1)
        barrier_port, node_ports = ports[0], sorted(ports[1:])  # ranks follow address order: node-i is rank i
        self.barrier_port, self.node_ports = barrier_port, node_ports
        barrier_url = f"{scheme(s)}://127.0.0.1:{barrier_port}"
        self._spawn("barrier", "barrier", settings_env(s, host="127.0.0.1", port=barrier_port, log_json=True))
        for i, port in enumerate(node_ports):
            self._spawn(f"node-{i}", "node", settings_env(
                s, host="127.0.0.1", port=port, barrier_url=barrier_url, log_json=True,
                out=str(self.out / "nodes" / str(i)), advertise=f"127.0.0.1:{port}"))
        deadline = time.monotonic() + (timeout or s.register_deadline + s.rounds * (s.round_deadline + 60))
        with ProgressPrinter(enabled=self.progress) as printer:
            printer.message(f"barrier {barrier_url}: dashboard in a browser, or `mosaicd status {barrier_url}`")
            printer.start_run("", s.rounds)
            reported = _Reported(s.rounds, [printer.on_round] + ([self.on_round] if self.on_round else []))
            try:
                while True:
                    barrier = self.procs["barrier"].poll()
                    failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
                    if failed and (self.fail_fast or "barrier" in failed):
                        raise ClusterFailed(f"processes failed: {failed}; see {self.out / 'logs'}")
                    for name in sorted(set(failed) - set(self.dead)):
                        self.dead[name] = failed[name]
                        printer.message(f"{name} exited with status {failed[name]} (see {self.out / 'logs' / name}"
                                        ".log); the run goes on without it (--fail-fast to stop instead)",
                                        always=True)
                    if barrier == 0 and all(p.poll() is not None for p in self.procs.values()):
                        break
                    if time.monotonic() > deadline:
                        raise ClusterFailed(f"the run did not finish in time; see {self.out / 'logs'}")
                    status = self.status(barrier_port)
                    if status:
                        # "round": rounds released so far; the last one is reported with the summary, below
                        reported.upto(min(int(status.get("round", 0)), s.rounds - 1), status.get("metrics"),
                                      len(status.get("live", [])), len(status.get("members", [])))
                    time.sleep(0.2)
            finally:
                self.stop()
            try:
                summary = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError) as exc:
                raise ClusterFailed(f"the barrier left no summary.json ({exc}); see {self.out / 'logs'}") from None
            rows = summary.get("rounds") or []
            final = {k: v for k, v in rows[-1].items() if k != "per_node"} if rows else None
            reported.upto(s.rounds, final, reported.live, reported.members)
        return summary

    def _record_failure(self, exc: BaseException, started: float) -> None:
        """summary.json after a failure: the barrier's, marked failed (its own error kept where it gave one), or
        one made from rounds.csv where the barrier left none."""
        error = failure_text(exc)
        path = self.out / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            failed_summary(self.out, self.settings, "cluster", error, wall_s=time.time() - started)
            return
        if summary.get("status") == "failed":
            summary.setdefault("cluster_error", error)
        else:
            summary.update(status="failed", error=error)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(path)

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class ClusterFailed(RuntimeError):
    pass


class _Reported:
    """Rounds reported to the callbacks so far: each round once, in order; each evaluation row once."""

    def __init__(self, rounds: int, callbacks: list[OnRound]) -> None:
        self.rounds, self.callbacks = rounds, callbacks
        self.done = 0            # rounds reported
        self.row_round = -1      # the round of the latest row reported
        self.live: int | None = None
        self.members: int | None = None

    def upto(self, done: int, row: dict[str, Any] | None, live: int | None, members: int | None) -> None:
        """Report the rounds before `done` not reported yet; a row not reported yet, of one of those rounds, goes
        with the last of them."""
        self.live, self.members = live, members
        done = min(done, self.rounds)
        new_row = row if row and isinstance(row.get("round"), int) and self.row_round < row["round"] < done else None
        for r in range(self.done, done):
            last = r == done - 1
            p = RoundProgress(r, self.rounds, row=new_row if last else None, live=live, members=members)
            if last and new_row is not None:
                self.row_round = new_row["round"]
            self.done = r + 1
            for callback in self.callbacks:
                callback(p)


def run_cluster(settings: Settings, progress: bool = True, timeout: float | None = None,
                on_round: OnRound | None = None, fail_fast: bool = False) -> dict:
    return Cluster(settings, progress, on_round, fail_fast).run(timeout)

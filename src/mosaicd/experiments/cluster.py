"""`mosaicd cluster`: a barrier and N node processes on 127.0.0.1, with progress, and no orphans left behind.

Warm start (the default): the barrier process imports, loads and partitions the data, builds the model and warms
torch up once, then forks the nodes from that state (`experiments/warm.py`); they share its read-only pages and
skip the start-up that used to take most of a short run. They are still separate processes on their own ports,
talking HTTP. `warm=False` (or a non-CPU device) starts every process as a fresh `mosaicd` interpreter instead.

Secure by default: unless --secret-file is given (or --insecure asks for none), the launcher makes a random secret
for the run, in a 0600 file in a private temporary folder (never in the output folder), hands every process its
path (MOSAIC_SECRET_FILE) and deletes it at the end: every request between members is signed, and the secret
appears in no output, log or status (`run_secret.py`).

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` once per round, in order, as the barrier's /v1/status shows rounds released (polled every
0.2 s); the last round is reported once the run's summary is written, with the final evaluation row.

This module is the launcher: the run's settings as each process's environment, the loop that watches the run and
reports its rounds. Its processes are `processes.py`'s (spawned, watched, stopped), its requests to the barrier
`barrier_client.py`'s, its secret `run_secret.py`'s, `--resume` is `cluster_resume.py`'s, and summary.json is
written by `outputs` only.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mosaicd.daemon.deadlines import RELEASE_PADDING_S
from mosaicd.daemon.errors import OutputError
from mosaicd.daemon.http.server import BACKLOG, LISTEN_FD
from mosaicd.experiments import barrier_client, cluster_resume
from mosaicd.experiments.processes import (
    STOP_GRACE_S,
    Processes,
    exit_reason,
    exit_text,
    last_error,
    node_cores,
    pinned_line,
)
from mosaicd.experiments.run_secret import RunSecret
from mosaicd.learning.tasks import check_requirements, require_task
from mosaicd.outputs import MODE_ENV, failure_text, mark_failed, remove_summary
from mosaicd.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.rundir import claim_out, read_summary, release
from mosaicd.settings import Settings

POLL_S = 0.2  # how often the run's loop looks at the processes and the barrier's status
PORTS_FROM = 10000  # free_ports draws from here up to the ephemeral range
FREE_PORT_TRIES = 2000


class ClusterFailed(RuntimeError):
    pass


def listening_sockets(count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """`count` sockets listening on free ports of `host`, in the order of their ports: each is handed to the
    process that serves on it (`http.server.LISTEN_FD`), which so never meets its port taken by another process,
    as it could between a port's choice and its bind (`free_ports`)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(socket.create_server((host, 0), backlog=BACKLOG))
    except OSError:
        for s in socks:
            s.close()
        raise
    return sorted(socks, key=lambda s: s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports free now, in order, for processes started by hand with --port (the tests' daemons). They are
    drawn below the host's ephemeral range, where the kernel takes the ports of outgoing connections: any client on
    the host could otherwise take one before its daemon binds it. Another process choosing ports the same way still
    could, at one chance in ~20,000 a port. The launcher does not use them: it hands sockets down."""
    low = max(PORTS_FROM + count, ephemeral_start())
    chooser = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(FREE_PORT_TRIES):
            if len(socks) == count:
                break
            try:
                socks.append(socket.create_server((host, chooser.randrange(PORTS_FROM, low))))
            except OSError:  # taken: another
                continue
        if len(socks) < count:
            raise OSError(f"no {count} free ports on {host} between {PORTS_FROM} and {low} in {FREE_PORT_TRIES} "
                          "tries")
        return sorted(sock.getsockname()[1] for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def ephemeral_start() -> int:
    """The lowest port the host gives outgoing connections (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def settings_env(settings: Settings, **override: Any) -> dict[str, str]:
    """The settings as MOSAIC_* variables, so every child process reads the same run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    values = {**settings.model_dump(mode="json"), **override}
    for key, value in values.items():
        if value is None:
            continue
        env[f"MOSAIC_{key.upper()}"] = json.dumps(value) if isinstance(value, bool | dict) else str(value)
    return env


def run_deadline(settings: Settings) -> float:
    """How long a whole run may take before the launcher gives up on it: registration, then every round's deadline
    and the padding a release may come after it (`daemon.deadlines`)."""
    return settings.register_deadline + settings.rounds * (settings.round_deadline + RELEASE_PADDING_S)


class Cluster:
    def __init__(self, settings: Settings, progress: bool = True, on_round: OnRound | None = None,
                 fail_fast: bool = False, warm: bool = True, resume: bool = False, pin: str = "auto") -> None:
        """`fail_fast`: end the run when any node process dies; by default a dead node is reported and the run
        goes on without it, as a run started by hand does (the barrier drops it). `warm`: fork the nodes from a
        warmed-up barrier (see the module's docstring), else start fresh interpreters. `pin`: `--pin-nodes`
        (`processes.node_cores`)."""
        self.settings, self.progress, self.on_round, self.fail_fast = settings, progress, on_round, fail_fast
        self.pin = pin
        self.resume = resume  # go on with the interrupted run of OUT (`cluster_resume`; claim_out checked it is one)
        self.resumed_at: int | None = None
        self.warm = warm and str(getattr(settings, "device", "cpu")) == "cpu"  # CUDA does not survive fork()
        self.out = Path(settings.out)
        self.processes = Processes(self.out, append=resume)  # a resumed run's logs go on
        self.barrier_port: int | None = None  # set by run(): where to scrape the barrier's /v1/status, /metrics
        self.node_ports: list[int] = []  # node-i listens on node_ports[i] (its rank is its address' sort order)
        self.secret = RunSecret(settings)  # the run's own secret file, while it runs
        self.last_status: dict | None = None  # the barrier's newest /v1/status, as the run loop saw it
        self.addresses: dict[str, str] = {}  # node name -> the address it registers with

    @property
    def procs(self) -> dict[str, Any]:
        """The run's processes by name ("barrier", "node-<i>"): `subprocess.Popen` or `ForkedProcess`."""
        return self.processes.procs

    @property
    def dead(self) -> dict[str, int]:
        """The processes that ended with a status other than 0, as the run's loop saw them."""
        return self.processes.dead

    @property
    def secret_file(self) -> Path | None:
        """The launcher's own secret file for the run, while it runs (None: --secret-file, --insecure)."""
        return self.secret.path

    def status(self, port: int) -> dict | None:
        return barrier_client.status(self.settings, port)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        self.processes.stop(grace)

    def run(self, timeout: float | None = None) -> dict:
        """Run to the end and return summary.json's content. ClusterFailed when a process fails or the run
        does not finish in time; then (and on any other exception, Ctrl-C included) every process is stopped and
        summary.json says "status": "failed" and why, with the rounds recorded until then."""
        started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.resume:  # an earlier run's: it must not pass for this one's (a resumed run's is its own)
            remove_summary(self.out)
        try:
            return self._run(timeout)
        except BaseException as exc:
            self.stop()
            try:
                mark_failed(self.out, self.settings, "cluster", failure_text(exc), wall_s=time.time() - started,
                            rounds_done=cluster_resume.rounds_released(self.out))
            except OSError as write:  # a full disk: the barrier's summary (if any) says why already
                print(f"mosaicd cluster: cannot mark {self.out / 'summary.json'} failed: {write.strerror}",
                      file=sys.stderr)
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                raise OutputError(f"cannot write {exc.filename or self.out}: {exc.strerror or exc}") from None
            raise
        finally:
            self.stop()
            self.secret.remove()

    def _resume_point(self) -> tuple[dict[str, int], list[str]]:
        """`--resume`: the settings override of the round to go on from, and the nodes to start again."""
        try:
            self.resumed_at, names = cluster_resume.start(self.out, self.settings)
        except cluster_resume.NotResumable as exc:
            raise ClusterFailed(str(exc)) from None
        return {"resume_round": self.resumed_at}, names

    def _start(self) -> str:
        """Spawn the barrier and the nodes (warm or cold); the barrier's URL."""
        s = self.settings
        require_task(s.task)  # the one-line error here, not one per node log
        socks = listening_sockets(s.nodes + 1)  # held from now on: no other process can take their ports
        try:
            return self._spawn(s, socks)
        finally:
            for sock in socks:  # the processes hold them now
                sock.close()

    def _spawn(self, s: Settings, socks: list[socket.socket]) -> str:
        """`_start`'s processes, each handed its listening socket (`socks`: the barrier's, then the nodes' in the
        order of their ports: ranks follow address order, node-i is rank i); the barrier's URL."""
        barrier_sock, node_socks = socks[0], socks[1:]
        self.barrier_port = barrier_sock.getsockname()[1]
        self.node_ports = [sock.getsockname()[1] for sock in node_socks]
        url = barrier_client.barrier_url(s, self.barrier_port)
        secret = self.secret.make()
        resume, names = ({}, [f"node-{i}" for i in range(s.nodes)]) if not self.resume else self._resume_point()
        held = dict(zip(names, node_socks, strict=False))  # the nodes started (a resumed run's), each with its own
        barrier_env = {**settings_env(s, host="127.0.0.1", port=self.barrier_port, log_json=True, **secret, **resume),
                       MODE_ENV: "cluster", LISTEN_FD: str(barrier_sock.fileno())}
        # every node checkpoints every round (unless told otherwise), in OUT/state/node-<i>: what --resume needs
        every = s.checkpoint_every if "checkpoint_every" in s.model_fields_set else 1
        ports = {name: sock.getsockname()[1] for name, sock in held.items()}
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        node_envs = {name: {**settings_env(s, host="127.0.0.1", port=port, barrier_url=url, log_json=True,
                                           out=str(self.out / "nodes" / name.removeprefix("node-")),
                                           advertise=f"127.0.0.1:{port}", state_dir=str(self.out / "state" / name),
                                           checkpoint_every=every, leave_on_signal=False, **secret, **resume),
                            LISTEN_FD: str(held[name].fileno())}
                     for name, port in ports.items()}
        self.processes.place(node_cores(list(node_envs), self.pin, s.nodes, key=str(self.out)))
        if self.warm:
            self.processes.spawn_warm(barrier_env, node_envs, pass_fds=[sock.fileno() for sock in socks])
        else:
            self.processes.spawn("barrier", "barrier", barrier_env, pass_fds=[barrier_sock.fileno()])
            for name, env in node_envs.items():
                self.processes.spawn(name, "node", env, pass_fds=[held[name].fileno()])
        return url

    def _run(self, timeout: float | None) -> dict:
        s = self.settings
        url = self._start()
        deadline = time.monotonic() + (timeout or run_deadline(s))
        with ProgressPrinter(enabled=self.progress) as printer:
            printer.message(f"run folder {self.out}")
            if self.resumed_at is not None:
                printer.message(f"resuming {self.out} with {self.resumed_at} of {s.rounds} rounds done (from the "
                                "barrier's journal and the nodes' checkpoints)", always=True)
            printer.message(f"barrier {url}: dashboard in a browser, or `mosaicd status {url}`")
            if (pinned := pinned_line(self.processes.cores, self.pin)) is not None:
                printer.message(pinned)
            printer.start_run("", s.rounds)
            reported = _Reported(s.rounds, [printer.on_round] + ([self.on_round] if self.on_round else []),
                                 done=self.resumed_at or 0)
            try:
                while not self._watch(printer, reported, url, deadline):
                    time.sleep(POLL_S)
            finally:
                self.stop()
            try:
                summary = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError) as exc:
                raise ClusterFailed(f"the barrier left no summary.json ({exc}); see {self.out / 'logs'}") from None
            final = {k: v for k, v in (summary.get("final") or {}).items() if k != "per_node"} or None
            reported.upto(s.rounds, final, reported.live, reported.members)
        return summary

    def _watch(self, printer: ProgressPrinter, reported: _Reported, url: str, deadline: float) -> bool:
        """One look at the run: processes that ended (said, and told to the barrier), the barrier's rounds
        reported; True once the run is over. ClusterFailed when the barrier failed, a node with --fail-fast, or
        the deadline passed."""
        barrier = self.processes.ended("barrier")
        failed, new = self.processes.failures()
        for name in new:
            goes_on = ""
            if "barrier" not in failed and not self.fail_fast:
                unheard = self._tell_left(name, failed[name], url)
                goes_on = "; told the barrier it left: the others go on without it, not waiting for it" \
                    if unheard is None else f"; the barrier could not be told it left ({unheard}): the others " \
                    "go on without it while they can (--fail-fast to stop instead)"
            why = exit_reason(self.out, name, failed[name], self.processes.said_by(name))
            printer.message(f"{name} exited with status {failed[name]}: {why} "
                            f"(see {self.out / 'logs' / name}.log){goes_on}", always=True)
        if "barrier" in failed:
            raise ClusterFailed(barrier_failure(self.out, failed["barrier"], self.processes.said_by("barrier")))
        if failed and self.fail_fast:
            raise ClusterFailed(f"processes failed: {failed}; see {self.out / 'logs'}")
        if barrier == 0 and self.processes.all_ended():
            return True
        if time.monotonic() > deadline:
            raise ClusterFailed(f"the run did not finish in time; see {self.out / 'logs'}")
        status = self.status(self.barrier_port or 0)
        self.last_status = status or self.last_status
        if status:
            # "round": rounds released so far; the last one is reported with the summary, in `_run`
            reported.upto(min(int(status.get("round", 0)), self.settings.rounds - 1), status.get("metrics"),
                          len(status.get("live", [])), len(status.get("members", [])))
        return False

    def _tell_left(self, name: str, code: int, url: str) -> str | None:
        """A node's process ended while the run goes on (killed one by one, say: the nodes of a cluster do not
        leave on a signal, so that Ctrl-C of the whole cluster can be resumed): tell the barrier it left, as
        `mosaicd node` does when told to stop, so that its peers do not wait --round-deadline x --drop-after for
        it. None once the barrier took it, else why not."""
        def rank_in(status: dict | None) -> int | None:
            members = (status or {}).get("members") or []
            return next((m.get("rank") for m in members if m.get("address") == self.addresses.get(name)), None)
        rank = rank_in(self.last_status)
        if rank is None:  # the status this loop saw last may be older than the roster (a fast run): ask again
            self.last_status = self.status(self.barrier_port or 0) or self.last_status
            rank = rank_in(self.last_status)
        if rank is None:
            return "its rank is not known: the barrier's status has not named it yet"
        return barrier_client.tell_left(url, self.settings, self.secret.load(), rank,
                                        f"its process ended ({exit_text(code)})")


def barrier_failure(out: Path, code: int, said: str | None = None) -> str:
    """Why the barrier ended the run: its summary's error (it writes one when it can), else its exit and the error
    line it `said` on the report pipe (whole where its log, on a full disk, may be cut), else its log's."""
    error = (read_summary(out) or {}).get("error")
    return f"the run failed: {error}" if error else f"the barrier exited with status {code}: " \
        f"{said or last_error(out, 'barrier')} (see {out / 'logs' / 'barrier.log'})"


class _Reported:
    """Rounds reported to the callbacks so far: each round once, in order; each evaluation row once."""

    def __init__(self, rounds: int, callbacks: list[OnRound], done: int = 0) -> None:
        """`done`: the rounds done before (a resumed run's): they are not reported again."""
        self.rounds, self.callbacks = rounds, callbacks
        self.done = done         # rounds reported
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
                on_round: OnRound | None = None, fail_fast: bool = False, warm: bool = True, *,
                resume: bool = False, replace: bool = False, advise: bool = True, pin: str = "auto") -> dict:
    """Run a cluster to its end; summary.json's content. The folder is claimed first (`rundir.claim_out`: a fresh
    one without --out; another run's is refused unless `resume` or `replace` says what to do with it); `resume`:
    go on with the interrupted run in --out, exactly (its journal and the nodes' checkpoints). `advise`: a run that
    stops says on stderr how to go on with it (`cluster_resume.next_step`); a sweep, which goes on its own way, says
    it instead."""
    if str(settings.sync) == "async":  # before any folder is made
        raise ClusterFailed("--sync async: experiments/cluster_async.py's run_cluster_async runs it")
    given = settings.out if "out" in settings.model_fields_set else None
    check_requirements(settings.task, settings.data_dir)  # before any folder is made or process starts
    out = claim_out(given, "cluster", resume=resume, replace=replace, run_id=settings.run_id)
    try:
        if resume:  # ResumeError naming the run settings that differ (--nodes too: given here), before any change
            cluster_resume.check(Path(out), settings)
        settings = settings.model_copy(update={"out": out})
        return Cluster(settings, progress, on_round, fail_fast, warm, resume, pin).run(timeout)
    except (KeyboardInterrupt, ClusterFailed, OutputError) as exc:
        if advise and (step := cluster_resume.next_step(Path(out), settings, exc)):
            print(f"mosaicd cluster: {out}: {step}", file=sys.stderr)
        raise
    finally:
        release(out)

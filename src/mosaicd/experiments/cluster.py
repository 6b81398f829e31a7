"""`mosaicd cluster`: a barrier and N node processes on 127.0.0.1, with progress, and no orphans left behind.

Warm start (the default): the barrier process imports, loads and partitions the data, builds the model and warms
torch up once, then forks the nodes from that state (`experiments/warm.py`); they share its read-only pages and
skip the start-up that used to take most of a short run. They are still separate processes on their own ports,
talking HTTP. `warm=False` (or a non-CPU device) starts every process as a fresh `mosaicd` interpreter instead.

Secure by default: unless --secret-file is given (or --insecure asks for none), the launcher makes a random secret
for the run, in a 0600 file in a private temporary folder (never in the output folder), hands every process its
path (MOSAIC_SECRET_FILE) and deletes it at the end: every request between members is signed, and the secret
appears in no output, log or status.

Progress: `progress=True` shows the `ProgressPrinter` on stderr; `on_round`, when given, is called with a
`RoundProgress` once per round, in order, as the barrier's /v1/status shows rounds released (polled every
0.2 s); the last round is reported once the run's summary is written, with the final evaluation row.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.errors import OutputError
from mosaicd.daemon.http.auth import Keyring, load_secret
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.daemon.node import checkpoint
from mosaicd.experiments.warm import REPORT_FD
from mosaicd.learning.tasks import require_task
from mosaicd.outputs import failed_summary, failure_text
from mosaicd.progress import OnRound, ProgressPrinter, RoundProgress
from mosaicd.rundir import claim_out, read_summary, release
from mosaicd.settings import Settings

PR_SET_PDEATHSIG = 1


def last_error(out: Path, name: str) -> str:
    """The last error a process wrote to its log (OUT/logs/NAME.log): its one-line `error:` or its last error event."""
    try:
        with open(out / "logs" / f"{name}.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 64 * 1024, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("level") == "error":
                return str(event.get("detail") or event.get("error") or event.get("event"))
        elif "error" in line.lower():
            return line.strip()
    return lines[-1].strip() if lines else "(empty log)"


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
        env[f"MOSAIC_{key.upper()}"] = json.dumps(value) if isinstance(value, bool | dict) else str(value)
    return env


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    def __init__(self, settings: Settings, progress: bool = True, on_round: OnRound | None = None,
                 fail_fast: bool = False, warm: bool = True, resume: bool = False) -> None:
        """`fail_fast`: end the run when any node process dies; by default a dead node is reported and the run
        goes on without it, as a run started by hand does (the barrier drops it). `warm`: fork the nodes from a
        warmed-up barrier (see the module's docstring), else start fresh interpreters."""
        self.settings, self.progress, self.on_round, self.fail_fast = settings, progress, on_round, fail_fast
        self.resume = resume  # go on with the interrupted run of OUT (_resume_point; claim_out checked it is one)
        self.resumed_at: int | None = None
        self.warm = warm and str(getattr(settings, "device", "cpu")) == "cpu"  # CUDA does not survive fork()
        self.dead: dict[str, int] = {}
        self.out = Path(settings.out)
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.barrier_port: int | None = None  # set by run(): where to scrape the barrier's /v1/status, /metrics
        self.node_ports: list[int] = []  # node-i listens on node_ports[i] (its rank is its address' sort order)
        self.secret_file: Path | None = None  # the run's own secret, while it runs (`_own_secret`)
        self.last_status: dict | None = None  # the barrier's newest /v1/status, as the run loop saw it
        self.addresses: dict[str, str] = {}  # node name -> the address it registers with

    def _spawn(self, name: str, command: str, env: dict[str, str]) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{name}.log", "ab" if self.resume else "wb")  # a resumed run's logs go on
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mosaicd", command], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        log.close()

    def _spawn_warm(self, barrier_env: dict[str, str], node_envs: dict[str, dict[str, str]]) -> None:
        """The barrier as the warm fork server, told the nodes to fork on its stdin; their pids and exit statuses
        come back on a pipe (read by a thread into `ForkedProcess` handles)."""
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        children = [{"name": name, "log": str(logs / f"{name}.log"), "append": self.resume,
                     "env": {k: v for k, v in env.items() if k.startswith("MOSAIC_")}}
                    for name, env in node_envs.items()]
        handles = {name: ForkedProcess(name) for name in node_envs}
        read, write = os.pipe()
        try:
            with open(logs / "barrier.log", "ab" if self.resume else "wb") as log:
                barrier = subprocess.Popen([sys.executable, "-m", "mosaicd.experiments.warm"],
                                           env={**barrier_env, REPORT_FD: str(write)}, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE, pass_fds=(write,),
                                           preexec_fn=_die_with_parent)
        finally:
            os.close(write)
        self.procs["barrier"] = barrier
        self.procs.update(handles)
        threading.Thread(target=_read_reports, args=(read, handles), name="warm-reports", daemon=True).start()
        try:
            assert barrier.stdin is not None
            barrier.stdin.write(json.dumps({"children": children}).encode())
            barrier.stdin.close()
        except OSError:  # it died at once: the run's loop reports its exit status
            pass

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
        if not self.resume:  # an earlier run's: it must not pass for this one's (a resumed run's is its own)
            (self.out / "summary.json").unlink(missing_ok=True)
        try:
            return self._run(timeout)
        except BaseException as exc:
            self.stop()
            try:
                record_failure(self.out, self.settings, exc, started)
            except OSError as write:  # a full disk: the barrier's summary (if any) says why already
                print(f"mosaicd cluster: cannot mark {self.out / 'summary.json'} failed: {write.strerror}",
                      file=sys.stderr)
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                raise OutputError(f"cannot write {exc.filename or self.out}: {exc.strerror or exc}") from None
            raise
        finally:
            self.stop()
            if self.secret_file is not None:
                shutil.rmtree(self.secret_file.parent, ignore_errors=True)

    def _resume_point(self) -> tuple[dict[str, int], list[str]]:
        """`--resume`: the round to go on from and the nodes to start again (`resume_point`)."""
        kept = barrier_journal.rounds(self.out)
        if not kept:
            raise ClusterFailed(f"--resume: {self.out} holds no interrupted run to go on with (no "
                                f"{barrier_journal.STATE_FILE} of a running run)")
        point = resume_point(self.out, self.settings, kept)
        if point is None:
            raise ClusterFailed(f"--resume: the journal keeps rounds {kept}, but not every live member has a "
                                f"checkpoint of one of them in {self.out / 'state'}: it cannot be resumed exactly")
        self.resumed_at, names = point
        return {"resume_round": self.resumed_at}, names

    def _own_secret(self) -> dict[str, Any]:
        """The settings override that gives every process the run's secret: the user's --secret-file, none with
        --insecure, else a fresh random one in a private 0700 folder (deleted by `run` at the end)."""
        s = self.settings
        if s.secret_file is not None or s.insecure:
            return {}
        folder = Path(tempfile.mkdtemp(prefix="mosaic-secret-"))  # 0700, outside the output folder
        path = folder / "secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        self.secret_file = path
        return {"secret_file": str(path)}

    def _run(self, timeout: float | None) -> dict:
        s = self.settings
        require_task(s.task)  # the one-line error here, not one per node log
        ports = free_ports(s.nodes + 1)
        barrier_port, node_ports = ports[0], sorted(ports[1:])  # ranks follow address order: node-i is rank i
        self.barrier_port, self.node_ports = barrier_port, node_ports
        barrier_url = f"{scheme(s)}://127.0.0.1:{barrier_port}"
        secret = self._own_secret()
        resume, names = ({}, [f"node-{i}" for i in range(s.nodes)]) if not self.resume else self._resume_point()
        barrier_env = settings_env(s, host="127.0.0.1", port=barrier_port, log_json=True, **secret, **resume)
        # every node checkpoints every round (unless told otherwise), in OUT/state/node-<i>: what --resume needs
        every = s.checkpoint_every if "checkpoint_every" in s.model_fields_set else 1
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in zip(names, node_ports, strict=False)}
        node_envs = {name: settings_env(s, host="127.0.0.1", port=port, barrier_url=barrier_url, log_json=True,
                                        out=str(self.out / "nodes" / name.removeprefix("node-")),
                                        advertise=f"127.0.0.1:{port}", state_dir=str(self.out / "state" / name),
                                        checkpoint_every=every, leave_on_signal=False, **secret, **resume)
                     for name, port in zip(names, node_ports, strict=False)}
        if self.warm:
            self._spawn_warm(barrier_env, node_envs)
        else:
            self._spawn("barrier", "barrier", barrier_env)
            for name, env in node_envs.items():
                self._spawn(name, "node", env)
        deadline = time.monotonic() + (timeout or s.register_deadline + s.rounds * (s.round_deadline + 60))
        with ProgressPrinter(enabled=self.progress) as printer:
            printer.message(f"run folder {self.out}")
            if self.resumed_at is not None:
                printer.message(f"resuming {self.out} at round {self.resumed_at} of {s.rounds} (from the barrier's "
                                "journal and the nodes' checkpoints)", always=True)
            printer.message(f"barrier {barrier_url}: dashboard in a browser, or `mosaicd status {barrier_url}`")
            printer.start_run("", s.rounds)
            reported = _Reported(s.rounds, [printer.on_round] + ([self.on_round] if self.on_round else []),
                                 done=self.resumed_at or 0)
            try:
                while True:
                    barrier = self.procs["barrier"].poll()
                    failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
                    for name in sorted(set(failed) - set(self.dead)):
                        self.dead[name] = failed[name]
                        goes_on = "" if "barrier" in failed or self.fail_fast else \
                            "; the others go on without it while they can (--fail-fast to stop instead)"
                        if goes_on and node_ended(self, name, failed[name], barrier_url):
                            goes_on = "; told the barrier it left: the others go on without it, not waiting for it"
                        why = exit_reason(self.out, name, failed[name])
                        printer.message(f"{name} exited with status {failed[name]}: {why} "
                                        f"(see {self.out / 'logs' / name}.log){goes_on}", always=True)
                    if "barrier" in failed:
                        raise ClusterFailed(barrier_failure(self.out, failed["barrier"]))
                    if failed and self.fail_fast:
                        raise ClusterFailed(f"processes failed: {failed}; see {self.out / 'logs'}")
                    if barrier == 0 and all(p.poll() is not None for p in self.procs.values()):
                        break
                    if time.monotonic() > deadline:
                        raise ClusterFailed(f"the run did not finish in time; see {self.out / 'logs'}")
                    status = self.status(barrier_port)
                    self.last_status = status or self.last_status
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
            final = {k: v for k, v in (summary.get("final") or {}).items() if k != "per_node"} or None
            reported.upto(s.rounds, final, reported.live, reported.members)
        return summary

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


def exit_text(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "interrupted (Ctrl-C or SIGTERM)" if code == 130 else f"exit status {code}"


def exit_reason(out: Path, name: str, code: int) -> str:
    """Why a process ended, for the console: the signal that killed it, else the last error of its log."""
    return exit_text(code) if code < 0 or code == 130 else last_error(out, name)


def node_ended(cluster: Cluster, name: str, code: int, barrier_url: str) -> bool:
    """A node's process ended while the run goes on (killed one by one, say: the nodes of a cluster do not leave
    on a signal, so that Ctrl-C of the whole cluster can be resumed): tell the barrier it left, as `mosaicd node`
    does when told to stop, so that its peers do not wait --round-deadline x --drop-after for it."""
    members = (cluster.last_status or {}).get("members") or []
    rank = next((m.get("rank") for m in members if m.get("address") == cluster.addresses.get(name)), None)
    if rank is None:
        return False
    settings = cluster.settings
    secret = load_secret(Path(settings.secret_file) if settings.secret_file else cluster.secret_file)
    return tell_left(barrier_url, settings, secret, rank, f"its process ended ({exit_text(code)})")


def tell_left(barrier_url: str, settings: Settings, secret: bytes | None, rank: int, reason: str) -> bool:
    """POST /v1/leave for `rank` (signed as that member when the run has a secret); whether the barrier took it."""
    body = json.dumps({"rank": rank, "reason": reason}).encode()
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        credentials = Keyring(secret).credentials(settings.run_id)
        headers.update(credentials.headers("POST", "/v1/leave", str(rank), 0, body, time.time(),
                                           os.urandom(12).hex()))
    request = urllib.request.Request(f"{barrier_url}/v1/leave", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5, context=client_context(settings)) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def barrier_failure(out: Path, code: int) -> str:
    """Why the barrier ended the run: its summary's error (it writes one when it can), else its exit."""
    try:
        error = json.loads((out / "summary.json").read_text()).get("error")
    except (OSError, ValueError):
        error = None
    return f"the run failed: {error}" if error else f"the barrier exited with status {code}: " \
        f"{last_error(out, 'barrier')} (see {out / 'logs' / 'barrier.log'})"


def record_failure(out: Path, settings: Settings, exc: BaseException, started: float) -> None:
    """summary.json after a failure: the barrier's, marked failed (its own error kept where it gave one), or
    one made from rounds.csv where the barrier left none."""
    error = failure_text(exc)
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        failed_summary(out, settings, "cluster", error, wall_s=time.time() - started)
        return
    if summary.get("status") == "finished":  # the barrier finished the run before the failure (a late Ctrl-C)
        return
    if summary.get("status") == "failed" and not str(summary.get("error")).startswith("interrupted ("):
        summary.setdefault("cluster_error", error)
    else:  # the barrier's own "interrupted (SIGTERM)" is the launcher stopping it: the launcher's reason is the cause
        summary.update(status="failed", error=error)
    kept = barrier_journal.rounds(out)  # the barrier writes its summary every few seconds, its journal every round
    if kept and isinstance(summary.get("progress"), dict):
        summary["progress"]["rounds_done"] = kept[0]  # the rounds released: the resumed run goes on from there
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(summary, indent=2))
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


class ClusterFailed(RuntimeError):
    pass


class ForkedProcess:
    """A node forked by the warm barrier, seen from the launcher with Popen's poll/wait/send_signal/kill: its pid
    and exit status are the barrier's reports; signals go through a pidfd, so they never reach a reused pid."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid: int | None = None
        self.returncode: int | None = None
        self._pidfd: int | None = None
        self._exited = threading.Event()
        self._orphaned = False  # the barrier is gone: no report will come

    def started(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already (its exit report follows), or no pidfd here
            self._pidfd = None

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def orphaned(self) -> None:
        """The barrier's reports ended; a node not reported is gone with it (PDEATHSIG) or was never forked."""
        self._orphaned = True
        if self.pid is None:
            self.exited(1)

    def _gone(self) -> bool:
        import select

        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])  # a pidfd reads ready once its process exited

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and self._gone():
            self.exited(-signal.SIGTERM)  # its parent's death signal
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = time.monotonic() + (30.0 if timeout is None else timeout)
        while self.poll() is None:
            if self._exited.wait(min(0.05, max(0.0, end - time.monotonic()))):
                break
            if time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.name, timeout or 30.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        pidfd = self._pidfd
        if self.returncode is not None or pidfd is None:
            return
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except (ProcessLookupError, OSError):
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read_reports(fd: int, handles: dict[str, ForkedProcess]) -> None:
    with os.fdopen(fd, "rb") as reports:
        for line in reports:
            try:
                message = json.loads(line)
                handle = handles[message["name"]]
            except (ValueError, KeyError):
                continue
            if "pid" in message:
                handle.started(int(message["pid"]))
            elif "exit" in message:
                handle.exited(int(message["exit"]))
    for handle in handles.values():
        handle.orphaned()


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
                resume: bool = False, replace: bool = False, advise: bool = True) -> dict:
    """Run a cluster to its end; summary.json's content. The folder is claimed first (`rundir.claim_out`: a fresh
    one without --out; another run's is refused unless `resume` or `replace` says what to do with it); `resume`:
    go on with the interrupted run in --out, exactly (its journal and the nodes' checkpoints). `advise`: a run that
    stops says on stderr how to go on with it (`next_step`); a sweep, which goes on its own way, says it instead."""
    given = settings.out if "out" in settings.model_fields_set else None
    out = claim_out(given, "cluster", resume=resume, replace=replace, run_id=settings.run_id)
    try:
        if resume:  # ResumeError naming the run settings that differ (--nodes too: given here), before any change
            barrier_journal.load(Path(out), settings.run_config(), secured=not (settings.insecure and
                                                                                settings.secret_file is None))
        settings = settings.model_copy(update={"out": out})
        return Cluster(settings, progress, on_round, fail_fast, warm, resume).run(timeout)
    except (KeyboardInterrupt, ClusterFailed, OutputError) as exc:
        if advise and (step := next_step(Path(out), settings, exc)):
            print(f"mosaicd cluster: {out}: {step}", file=sys.stderr)
        raise
    finally:
        release(out)


def resume_point(out: Path, settings: Settings, kept: list[int]) -> tuple[int, list[str]] | None:
    """The round an interrupted cluster in `out` goes on from (the newest of the open rounds its journal keeps,
    `kept`, of which every live member has a checkpoint) and the nodes to start again (node-<i>, whose checkpoint
    holds its rank); None where there is none (the journal raises ResumeError for a run of other settings)."""
    for round in kept:
        state = barrier_journal.load(out, settings.run_config(), round)["state"]
        live = set(state["live"]) | set(state["joining"])
        ranks = {f"node-{i}": c.rank for i in range(settings.nodes)
                 if (c := checkpoint.load(out / "state" / f"node-{i}", round)) is not None}
        if live <= set(ranks.values()):
            return round, sorted((n for n, r in ranks.items() if r in live), key=lambda n: ranks[n])
    return None


def next_step(out: Path, settings: Settings, exc: BaseException) -> str | None:
    """What the user can do with the run in OUT after it stopped, in one line (None: the error says it all)."""
    if (read_summary(out) or {}).get("status") == "finished":
        return "the run had finished before it was interrupted: its results are there"
    kept = barrier_journal.rounds(out)
    if kept and _resumable(out, settings, kept):
        return f"the run stopped at round {kept[0]} of {settings.rounds}; the same command with --resume continues " \
            f"it (--out {out})"
    if kept:
        return f"the run stopped at round {kept[0]} of {settings.rounds}, before every node had a checkpoint of a " \
            f"round its journal keeps, so it cannot be resumed exactly; --replace starts it again (--out {out})"
    if isinstance(exc, KeyboardInterrupt):
        return f"the run was stopped before its first round; --replace starts it again (--out {out})"
    return None


def _resumable(out: Path, settings: Settings, kept: list[int]) -> bool:
    try:
        return resume_point(out, settings, kept) is not None
    except (OSError, ValueError, KeyError):  # ResumeError is a ValueError
        return False

"""The processes of a local cluster, supervised: spawned (each with its log in OUT/logs, dying with its parent:
PDEATHSIG), watched, signalled and stopped, and how each one ended said in words.

Cold start: every process a fresh `python -m mosaicd` interpreter (`Processes.spawn`). Warm start: the barrier is
`python -m mosaicd.experiments.warm`, the fork server, told the nodes to fork on its stdin; it reports their pids
and exit statuses as JSON lines on a pipe named by MOSAIC_WARM_REPORT_FD (`REPORT_FD`), read here by a thread into
`ForkedProcess` handles, which look like `subprocess.Popen` to the launcher.

The warm barrier's end of that pipe is `Children` (its forked nodes: forked, reaped, signalled, reported).
Standard library only: the warm barrier imports this module before anything else.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

REPORT_FD = "MOSAIC_WARM_REPORT_FD"
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 1.5  # how long a process told SIGTERM may take to exit before it is killed (all: in 2 s)
FORKED_WAIT_S = 30.0  # how long `ForkedProcess.wait()` waits when given no timeout
LOG_TAIL_BYTES = 64 * 1024  # how much of a log's end `last_error` reads
KILLED_REAP_S = 10.0  # how long the warm barrier's reaper may take to see killed nodes exit


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """PR_SET_PDEATHSIG: this process gets `signum` when its parent dies (no orphans)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except OSError:
        pass


PIN_CHOICES = ("auto", "on", "off")


def pin_refusal(pin: str) -> str | None:
    """Why `pin` is no --pin-nodes value, in one line naming the flag; None where it is one."""
    return None if pin in PIN_CHOICES else f"--pin-nodes: expected one of {', '.join(PIN_CHOICES)}, got {pin!r}"


def node_cores(names: Sequence[str], pin: str, nodes: int, key: str = "",
               cores: Iterable[int] | None = None) -> dict[str, tuple[int, ...]]:
    """The core each of `names` ("node-I") runs on (`--pin-nodes`): node-I on the (I + offset)-th of the cores this
    process may use (its affinity: a `taskset` or a container's cpuset narrows them), where `pin` is "on", or
    "auto" and the run's `nodes` outnumber those cores. Nodes that share cores anyway then stay on one each: a
    trainer keeps its core's caches instead of the scheduler moving it between cores (bench/README.md: the
    tutorial job, 16 nodes on 2 cores). `key` (the run's folder) shifts where the alternation starts, so that runs
    launched side by side spread over the cores instead of all starting on the first; a node started again gets
    the same core. Empty: the kernel places them."""
    if (refused := pin_refusal(pin)) is not None:
        raise ValueError(refused)
    allowed = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if pin == "off" or not allowed or (pin == "auto" and nodes <= len(allowed)):
        return {}
    offset = zlib.crc32(key.encode()) % len(allowed)
    return {name: (allowed[(int(name.rpartition("-")[2]) + offset) % len(allowed)],) for name in names}


def pin_to(cores: Sequence[int]) -> None:
    """This process on `cores` (`node_cores`); where it cannot be put there (a cpuset narrowed since the cores were
    chosen), it runs where the kernel puts it: pinning only makes a run faster, never one that can go on fail."""
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        pass


def pinned_line(pinned: dict[str, tuple[int, ...]], pin: str) -> str | None:
    """What the console says of a run's pinned nodes (`node_cores`): how many share each core; None where none is
    pinned."""
    if not pinned:
        return None
    per_core = Counter(core for cores in pinned.values() for core in cores)
    shares = ", ".join(f"{n} on core {core}" for core, n in sorted(per_core.items()))
    return f"nodes pinned to cores ({shares}; --pin-nodes {pin}: off lets the kernel place them)"


def last_error(out: Path, name: str) -> str:
    """The last error a process wrote to its log (OUT/logs/NAME.log): its one-line `error:` or its last error event."""
    try:
        with open(out / "logs" / f"{name}.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
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


def exit_text(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "interrupted (Ctrl-C or SIGTERM)" if code == 130 else f"exit status {code}"


def exit_reason(out: Path, name: str, code: int, said: str | None = None) -> str:
    """Why a process ended, for the console: the signal that killed it, else the error line it `said` (on the
    report pipe), else the last error of its log."""
    return exit_text(code) if code < 0 or code == 130 else said or last_error(out, name)


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
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])  # a pidfd reads ready once its process exited

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and self._gone():
            self.exited(-signal.SIGTERM)  # its parent's death signal
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = time.monotonic() + (FORKED_WAIT_S if timeout is None else timeout)
        while self.poll() is None:
            if self._exited.wait(min(0.05, max(0.0, end - time.monotonic()))):
                break
            if time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.name, timeout or FORKED_WAIT_S)
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


class Processes:
    """A run's processes by name ("barrier", "node-<i>"), their logs in OUT/logs (appended to where `append`: a
    resumed run's logs go on); `dead`: those that ended with a status other than 0, as `failures` reported them;
    `said`: the error line each warm process sent on the report pipe (its log may be on a disk that filled)."""

    def __init__(self, out: Path, append: bool = False) -> None:
        self.out, self.append = out, append
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.dead: dict[str, int] = {}
        self.said: dict[str, str] = {}
        self._reports: threading.Thread | None = None
        self.cores: dict[str, tuple[int, ...]] = {}  # name -> the cores it runs on (`node_cores`); absent: any

    def _log(self, name: str) -> Path:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f"{name}.log"

    def place(self, cores: dict[str, tuple[int, ...]]) -> None:
        """The cores each node process runs on from its next start (`node_cores`; empty: the kernel places them)."""
        self.cores = dict(cores)

    def spawn(self, name: str, command: str, env: dict[str, str], module: str | None = None,
              prefix: Sequence[str] = (), pass_fds: Sequence[int] = ()) -> None:
        """`mosaicd COMMAND` as a fresh interpreter, with `env` (`module`: `python -m MODULE` instead); `prefix`:
        the command that runs it elsewhere (`ip netns exec NS`: a lab's host); `pass_fds`: descriptors it inherits
        (its listening socket, which `env` names)."""
        log = open(self._log(name), "ab" if self.append else "wb")
        argv = ["-m", "mosaicd", command] if module is None else ["-m", module]
        cores = self.cores.get(name)

        def before_exec() -> None:
            die_with_parent()
            if cores is not None:
                pin_to(cores)

        self.procs[name] = subprocess.Popen([*prefix, sys.executable, *argv], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=before_exec, pass_fds=tuple(pass_fds))
        log.close()

    def respawn(self, name: str, command: str, env: dict[str, str], module: str | None = None,
                prefix: Sequence[str] = ()) -> None:
        """`name` started again (after it ended): as `spawn`, its log appended to, its death forgotten."""
        self.dead.pop(name, None)
        append, self.append = self.append, True
        try:
            self.spawn(name, command, env, module, prefix)
        finally:
            self.append = append

    def spawn_warm(self, barrier_env: dict[str, str], node_envs: dict[str, dict[str, str]],
                   pass_fds: Sequence[int] = ()) -> None:
        """The barrier as the warm fork server, told the nodes to fork on its stdin; their pids and exit statuses
        come back on a pipe (read by a thread into `ForkedProcess` handles). `pass_fds`: descriptors the barrier
        inherits (its own listening socket and its nodes', which the environments name), to hand on."""
        children = [{"name": name, "log": str(self._log(name)), "append": self.append,
                     "env": {k: v for k, v in env.items() if k.startswith("MOSAIC_")},
                     **({"cores": list(self.cores[name])} if name in self.cores else {})}
                    for name, env in node_envs.items()]
        handles = {name: ForkedProcess(name) for name in node_envs}
        read, write = os.pipe()
        try:
            with open(self._log("barrier"), "ab" if self.append else "wb") as log:
                barrier = subprocess.Popen([sys.executable, "-m", "mosaicd.experiments.warm"],
                                           env={**barrier_env, REPORT_FD: str(write)}, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                           pass_fds=(write, *pass_fds),
                                           preexec_fn=die_with_parent)
        finally:
            os.close(write)
        self.procs["barrier"] = barrier
        self.procs.update(handles)
        self._reports = threading.Thread(target=self._read_reports, args=(read, handles), name="warm-reports",
                                         daemon=True)
        self._reports.start()
        try:
            assert barrier.stdin is not None
            barrier.stdin.write(json.dumps({"children": children}).encode())
            barrier.stdin.close()
        except OSError:  # it died at once: the run's loop reports its exit status
            pass

    def _read_reports(self, fd: int, handles: dict[str, ForkedProcess]) -> None:
        with os.fdopen(fd, "rb") as reports:
            for line in reports:
                try:
                    message = json.loads(line)
                    if "error" in message:
                        self.said[str(message["name"])] = str(message["error"])
                        continue
                    handle = handles[message["name"]]
                except (ValueError, KeyError, TypeError):
                    continue
                if "pid" in message:
                    handle.started(int(message["pid"]))
                elif "exit" in message:
                    handle.exited(int(message["exit"]))
        for handle in handles.values():
            handle.orphaned()

    def said_by(self, name: str, within: float = 2.0) -> str | None:
        """The error line `name` sent before it ended; the warm barrier's pipe is read to its end first (for up to
        `within` seconds: its line may still be in the pipe when its exit is seen)."""
        if name == "barrier" and self._reports is not None:
            self._reports.join(within)
        return self.said.get(name)

    def failures(self) -> tuple[dict[str, int], list[str]]:
        """Every process that ended with a status other than 0 (name -> status), and those of them not reported
        before (now in `dead`), by name."""
        failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
        new = sorted(set(failed) - set(self.dead))
        for name in new:
            self.dead[name] = failed[name]
        return failed, new  # type: ignore[return-value]

    def ended(self, name: str) -> int | None:
        """`name`'s exit status, None while it runs."""
        return self.procs[name].poll()

    def all_ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to those still running; after `grace` seconds, SIGKILL to those left."""
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


class Children:
    """The warm barrier's forked nodes: each one's pid reported on the report pipe (`REPORT_FD`) once forked, and
    its exit once a thread reaped it (what `ForkedProcess` reads, in the launcher)."""

    def __init__(self, report: int) -> None:
        self.report = report
        self.names: dict[int, str] = {}
        self.live: set[int] = set()
        self.lock = threading.RLock()  # the SIGTERM handler may run while this thread holds it
        self.reaper: threading.Thread | None = None

    def say(self, **message: Any) -> None:
        try:
            os.write(self.report, (json.dumps(message) + "\n").encode())  # one line < PIPE_BUF: atomic
        except OSError:
            pass  # the launcher is gone; PDEATHSIG ends us soon

    def error(self, name: str, line: str) -> None:
        """`name`'s error line, as its console printed it (its log may be on the disk that filled)."""
        self.say(name=name, error=line[:600])  # < PIPE_BUF even JSON-escaped

    def fork(self, name: str, body: Callable[[int, int], NoReturn]) -> None:
        """Fork a child that runs `body(parent's pid, the report pipe's fd)`, which never returns."""
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            body(parent, self.report)
        with self.lock:
            self.names[pid] = name
            self.live.add(pid)
        self.say(name=name, pid=pid)

    def start_reaping(self) -> None:
        self.reaper = threading.Thread(target=self._reap, name="reaper", daemon=True)
        self.reaper.start()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                return
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            with self.lock:
                self.live.discard(pid)
                name = self.names.get(pid)
            if name is not None:
                self.say(name=name, exit=os.waitstatus_to_exitcode(status))

    def signal(self, signum: int) -> None:
        with self.lock:
            for pid in self.live:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def join(self, timeout: float) -> bool:
        if self.reaper is not None:
            self.reaper.join(timeout)
        return self.reaper is None or not self.reaper.is_alive()

    def end(self, grace: float) -> None:
        """Wait `grace` seconds for the nodes, then kill those left and reap them."""
        if not self.join(grace):
            self.signal(signal.SIGKILL)
            self.join(KILLED_REAP_S)

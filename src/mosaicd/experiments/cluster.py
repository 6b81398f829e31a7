"""`mosaicd cluster`: a barrier and N node processes on 127.0.0.1, with progress, and no orphans left behind."""

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

from mosaicd.experiments.progress import Progress
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
    def __init__(self, settings: Settings, progress: bool = True) -> None:
        self.settings, self.progress = settings, progress
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
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def run(self, timeout: float | None = None) -> dict:
        s = self.settings
        self.out.mkdir(parents=True, exist_ok=True)
        ports = free_ports(s.nodes + 1)
        barrier_port, node_ports = ports[0], ports[1:]
        self.barrier_port, self.node_ports = barrier_port, node_ports
        barrier_url = f"http://127.0.0.1:{barrier_port}"
        self._spawn("barrier", "barrier", settings_env(s, host="127.0.0.1", port=barrier_port, log_json=True))
        for i, port in enumerate(node_ports):
            self._spawn(f"node-{i}", "node", settings_env(
                s, host="127.0.0.1", port=port, barrier_url=barrier_url, log_json=True,
                out=str(self.out / "nodes" / str(i)), advertise=f"127.0.0.1:{port}"))
        bar = Progress(s.rounds, enabled=self.progress)
        deadline = time.monotonic() + (timeout or s.register_deadline + s.rounds * (s.round_deadline + 60))
        last_round = -1
        try:
            while True:
                barrier = self.procs["barrier"].poll()
                failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
                if failed:
                    raise ClusterFailed(f"processes failed: {failed}; see {self.out / 'logs'}")
                if barrier == 0 and all(p.poll() is not None for p in self.procs.values()):
                    break
                if time.monotonic() > deadline:
                    raise ClusterFailed(f"the run did not finish in time; see {self.out / 'logs'}")
                status = self.status(barrier_port)
                if status and status.get("round", 0) - 1 > last_round and status["round"] > 0:
                    last_round = status["round"] - 1
                    bar.update(min(last_round, s.rounds - 1), row=status.get("metrics"),
                               extra=f" | members {len(status.get('live', []))}/{len(status.get('members', []))}")
                time.sleep(0.2)
        finally:
            bar.close()
            self.stop()
        return json.loads((self.out / "summary.json").read_text())

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


def run_cluster(settings: Settings, progress: bool = True, timeout: float | None = None) -> dict:
    return Cluster(settings, progress).run(timeout)

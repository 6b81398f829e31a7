"""Hosts with their own IPs, on links that lose, delay, shape and partition: network namespaces for cluster tests.

    with Lab(hosts=3) as lab:              # mosaic-<id>-relay holds bridge br0 (10.213.0.254/24); each host
        lab.loss(1, 0.01)                  # namespace mosaic-<id>-h<k> a veth eth0 on it (10.213.0.<k+1>)
        cluster = NetnsCluster(lab, tmp_path, flags, per_host=2, delay=0.05).start()

Nothing is created in the caller's namespace: the bridge sits in the relay namespace and both ends of every
veth are made inside namespaces, so no traffic leaves them and parallel labs (same addresses, other
namespaces) cannot meet. Names carry the creating process id: a lab whose process died (a crashed run) is
removed, with what still runs in it, when the next one starts. `close()` always runs (a context manager).

This kernel has no `netem`, so: loss is iptables' `statistic` match in a host's INPUT chain, bandwidth is `tbf`
on a host's eth0, and delay is relay.py in the relay namespace: every node listens on its host's address and
advertises a relay port, so every request between nodes crosses the relay (and the delay) once each way.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PREFIX = "mosaic-"
SUBNET = "10.213.0"  # a /24 that exists only inside a lab's namespaces
RELAY_IP = f"{SUBNET}.254"
BASE_PORT = 9000
_labs = itertools.count()
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+-(relay|h\d+)$")
_PARTITION = ["-m", "comment", "--comment", "mosaic-partition", "-j", "DROP"]


class HarnessError(RuntimeError):
    """A command of the harness failed (with its stderr)."""


def sh(*args: str, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise HarnessError(f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def require_netns() -> None:
    """Skip the calling test, saying what is missing, where the harness cannot run; fail it instead under
    MOSAIC_REQUIRE_NETNS=1 (CI)."""
    from needs import lacking  # tests/needs.py (on the path under pytest)

    why = missing()
    if why:
        lacking("NETNS", why)


def missing() -> str | None:
    """Why the harness cannot run here (None: it can): root, iproute2 and iptables, and a namespace to try."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package}; .ci/run does)"
    probe = f"{PREFIX}{os.getpid()}-probe-{next(_labs)}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m", "statistic", "--mode", "random",
           "--probability", "0.01", "-j", "DROP")
    except (HarnessError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace with an iptables statistic rule here: {exc}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _empty(namespace: str) -> None:
    """Kill what still runs in `namespace` (only labs' own processes run there)."""
    for pid in sh("ip", "netns", "pids", namespace, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def clean_leftovers() -> list[str]:
    """Remove the namespaces of labs whose creating process is gone (a crashed or killed run); their names."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split(" ", 1)[0]
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _empty(name)
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


class Lab:
    """`hosts` host namespaces on one bridge, plus the relay namespace; loss, partitions and shaping per host."""

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        self.id = f"{os.getpid()}-{next(_labs)}"
        self.relay_ns = f"{PREFIX}{self.id}-relay"
        self.hosts = [f"{PREFIX}{self.id}-h{k}" for k in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    def __enter__(self) -> Lab:
        clean_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        relay = self.relay_ns
        self._add(relay)
        sh("ip", "-n", relay, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", relay, "addr", "add", f"{RELAY_IP}/24", "dev", "br0")
        sh("ip", "-n", relay, "link", "set", "br0", "up")
        for k, ns in enumerate(self.hosts):
            self._add(ns)
            sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{k}", "netns", relay)
            # one wire-sized packet per skb (veths send up to 64 KB otherwise): loss and tbf then count packets
            sh("ip", "-n", relay, "link", "set", f"h{k}", "gso_max_segs", "1", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "gso_max_segs", "1", "up")

    def _add(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def ip(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def close(self) -> None:
        """Stop every process the lab started (TERM, then KILL), then delete its namespaces."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for ns in reversed(self.created):
            _empty(ns)
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()

    # -- processes -----------------------------------------------------------------------------------------
    def popen(self, ns: str, argv: list[str], log: Path | None = None, **kwargs: Any) -> subprocess.Popen:
        """Run argv in namespace `ns`; its output goes to `log` (else to a pipe); stopped by close()."""
        out: Any = open(log, "wb") if log else subprocess.PIPE
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out,
                                    stderr=subprocess.STDOUT if log else None, stdin=subprocess.DEVNULL, **kwargs)
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def relay(self, delay: float, routes: dict[int, str], log: Path) -> subprocess.Popen:
        """relay.py in the relay namespace: RELAY_IP:port -> target for each route; returns once it listens."""
        argv = [sys.executable, str(Path(__file__).with_name("relay.py")), "--delay", str(delay),
                *(f"{RELAY_IP}:{port}={target}" for port, target in routes.items())]
        proc = self.popen(self.relay_ns, argv)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().decode() if ready else ""
        if line.strip() != "ready":
            raise HarnessError(f"the relay did not start within 30 s (said {line!r}, exit {proc.poll()})")
        log.write_text(f"relay {argv[2:]}\n")
        return proc

    # -- links ---------------------------------------------------------------------------------------------
    def iptables(self, host: int, *args: str) -> str:
        return self._iptables(self.hosts[host], *args)

    def _iptables(self, ns: str, *args: str) -> str:
        return sh("ip", "netns", "exec", ns, "iptables", "-w", "5", *args)

    def loss(self, host: int, probability: float) -> None:
        """Drop each packet that reaches `host` with this probability (both directions of every path through
        the relay end at a host's INPUT: data one way, acknowledgements the other)."""
        self.iptables(host, "-A", "INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random", "--probability",
                      f"{probability:g}", "-j", "DROP")

    def lost(self, host: int) -> int:
        """Packets the loss rule of `host` has dropped so far."""
        listing = self.iptables(host, "-n", "-v", "-x", "-L", "INPUT")
        return sum(int(line.split()[0]) for line in listing.splitlines() if "statistic" in line)

    def cut(self, host: int) -> None:
        """Partition `host`: what reaches it and what it sends vanish (dropped on arrival, at the host and at
        the relay namespace, so no sender gets a local error, as on a real cut link) until heal()."""
        for ns, rule in self._partition(host):
            self._iptables(ns, "-I", *rule[:1], "1", *rule[1:])

    def heal(self, host: int) -> None:
        for ns, rule in self._partition(host):
            self._iptables(ns, "-D", *rule)

    def _partition(self, host: int) -> list[tuple[str, list[str]]]:
        return [(self.hosts[host], ["INPUT", "-i", "eth0", *_PARTITION]),
                (self.relay_ns, ["INPUT", "-s", self.ip(host), *_PARTITION]),
                (self.relay_ns, ["FORWARD", "-s", self.ip(host), *_PARTITION])]  # bridged host to host

    def shape(self, host: int, rate: str, burst: str = "32kb", latency: str = "400ms") -> None:
        """Limit what `host` sends to `rate` (tbf on its eth0, e.g. "8mbit")."""
        sh("ip", "netns", "exec", self.hosts[host], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
           "burst", burst, "latency", latency)

    def shaped(self, host: int) -> dict[str, int]:
        """tbf's counters on `host`'s eth0: sent bytes and overlimits (times it held packets back)."""
        text = sh("ip", "netns", "exec", self.hosts[host], "tc", "-s", "qdisc", "show", "dev", "eth0")
        sent = re.search(r"Sent (\d+) bytes", text)
        over = re.search(r"overlimits (\d+)", text)
        return {"bytes": int(sent.group(1)) if sent else 0, "overlimits": int(over.group(1)) if over else 0}


class NetnsCluster:
    """`mosaicd node --peer-list` processes, `per_host` on each host of a lab; node i listens on its host's
    address at port 9000 + i and is advertised at the relay's, so ranks follow i and rank 0 (host 0) serves the
    barrier. Signed with a fresh cluster secret (they listen beyond loopback)."""

    def __init__(self, lab: Lab, tmp: Path, flags: list[str], per_host: int = 2, delay: float = 0.0,
                 extra: dict[int, list[str]] | None = None, signed: bool = True) -> None:
        """`flags`: every node's; `extra`: rank -> more flags for that node only; `signed`: with a cluster
        secret (else --insecure: the lab's namespaces are the whole network)."""
        self.lab, self.tmp, self.flags, self.per_host, self.delay = lab, tmp, flags, per_host, delay
        self.extra, self.signed = extra or {}, signed
        self.nodes = len(lab.hosts) * per_host
        self.procs: dict[int, subprocess.Popen] = {}
        self.out = tmp / "out-0"  # rank 0's: the barrier's outputs

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    def start(self) -> NetnsCluster:
        secret = self.tmp / "secret"
        secret.write_bytes(secrets.token_urlsafe(32).encode())
        secret.chmod(0o600)
        peers = self.tmp / "peers.txt"
        peers.write_text("".join(f"{RELAY_IP}:{BASE_PORT + i}\n" for i in range(self.nodes)))
        self.lab.relay(self.delay, {BASE_PORT + i: f"{self.lab.ip(self.host_of(i))}:{BASE_PORT + i}"
                                    for i in range(self.nodes)}, self.tmp / "relay.log")
        for i in range(self.nodes):
            host = self.host_of(i)
            trust = ["--secret-file", str(secret)] if self.signed else ["--insecure"]
            argv = [sys.executable, "-m", "mosaicd", "node", "--peer-list", str(peers), *trust,
                    "--host", self.lab.ip(host), "--port", str(BASE_PORT + i), "--advertise",
                    f"{RELAY_IP}:{BASE_PORT + i}", "--out", str(self.tmp / f"out-{i}"), "--log-json", *self.flags,
                    *self.extra.get(i, [])]
            self.procs[i] = self.lab.popen(self.lab.hosts[host], argv, log=self.tmp / f"node-{i}.log")
        return self

    def released(self) -> int:
        """The last round the barrier released (its nodes.csv rows), -1 before the first."""
        try:
            with open(self.out / "nodes.csv", newline="") as f:
                return max((int(row["round"]) for row in csv.DictReader(f)), default=-1)
        except FileNotFoundError:
            return -1

    def wait_released(self, round: int, timeout: float) -> int:
        """Wait until the barrier has released `round`; fails naming the logs if it does not in time."""
        deadline = time.monotonic() + timeout
        while (seen := self.released()) < round:
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise HarnessError(f"round {round} not released within {timeout:g}s (last {seen}; rank 0 exit "
                                   f"{self.procs[0].poll()}): {self.log_tail(0)}")
            time.sleep(0.05)
        return seen

    def wait(self, timeout: float) -> dict[int, int]:
        """Every node's exit status; the ones still running after `timeout` seconds are killed (status None)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, Any] = {}
        for rank, proc in self.procs.items():
            try:
                codes[rank] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                codes[rank] = None
        return codes

    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    def rows(self) -> list[dict[str, str]]:
        with open(self.out / "nodes.csv", newline="") as f:
            return list(csv.DictReader(f))

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        path = self.tmp / f"node-{rank}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

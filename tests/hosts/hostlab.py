"""Three Docker hosts on one machine: the network-namespace lab of tests/netns, with one `dockerd` per host.

    with HostsLab(hosts=3) as lab:                 # namespaces mosaic-<id>-h<k>, 10.213.0.<k+1>, routed through
        engines = lab.start_engines(root)          # mosaic-<id>-relay; a dockerd in each host namespace
        load_image(engines, "mosaic:test")         # docker save | docker load: no registry
        lab.shape(1, "100mbit"); lab.delay(0.02)   # tbf on a host's eth0; the transparent delaying relay
        engines[0].docker("ps")

Topology. Each host namespace has one veth, `eth0`, to the relay namespace, a /32 address and a route to the lab's
/24 through the relay (10.213.0.254), which forwards between the hosts: every packet between two hosts crosses the
relay namespace, as it would cross a router. There `delay()` adds a REDIRECT rule that hands every new TCP
connection between hosts to tproxy.py (it connects on to the original destination, delaying each direction), so
latency applies to processes that advertise their own addresses and ports: containers on the host network,
Swarm's managers. UDP (Swarm's VXLAN data plane and gossip) is not delayed. Loss, cuts and tbf are those of
tests/netns/harness.py's `Lab` (eth0 in each host, the relay's INPUT/FORWARD).

Engines. A `dockerd` per host namespace, started with `ip netns exec`, with its own --data-root, --exec-root,
--pidfile and unix socket (-H) under a folder of the caller's choosing; it manages its own containerd (under its
exec root), its iptables rules and bridges live in its namespace, and `network_mode: host` means that host's
eth0. Why not Docker-in-Docker: it needs an image to run dockerd in (none can be pulled here: the base is
debootstrapped), a privileged container per host, and its inner engines would store images on the outer one's
overlay (overlay on overlay is refused; DinD falls back to vfs, a full copy of the 1.3 GB image per container).
One dockerd per namespace is the kernel's own isolation, the same dockerd binary as CI's, and stops like any
process. `close()` stops every engine (TERM, then KILL after 30 s), then the namespaces.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "netns"))
from harness import RELAY_IP, SUBNET, HarnessError, Lab, missing, sh  # noqa: E402
from pageblocks import DEPLOY_PAGE, block  # noqa: E402

__all__ = ["HostsLab", "Engine", "HarnessError", "load_image", "missing", "sh", "RELAY_IP", "SUBNET"]
TPROXY_PORT = 9999


class Engine:
    """One dockerd in a host namespace; `docker(...)` runs the CLI against it."""

    def __init__(self, lab: HostsLab, host: int, root: Path) -> None:
        self.lab, self.host, self.root = lab, host, root
        self.ns = lab.hosts[host]
        self.ip = lab.ip(host)
        self.socket = root / "docker.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker / compose CLIs aimed at this engine."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "MOSAIC_"))}
        return {**base, "DOCKER_HOST": f"unix://{self.socket}"}

    def start(self) -> Engine:
        for sub in ("data", "exec"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        argv = ["dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.root / "dockerd.pid"), "-H", f"unix://{self.socket}",
                "--bip", f"172.30.{self.host}.1/24",  # the default bridge (unused: host network, overlays)
                "--log-level", "warn"]
        log = open(self.root / "dockerd.log", "ab")
        try:
            # nsenter, not `ip netns exec`: that remounts /sys for the namespace, hiding the cgroup mounts dockerd needs
            self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", *argv], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + 60
        while self.docker("info", "--format", "{{.ID}}", check=False, timeout=10).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise HarnessError(f"dockerd in {self.ns} did not start (exit {self.proc.poll()}): {self.log_tail()}")
            time.sleep(0.5)
        return self

    def log_tail(self, chars: int = 2000) -> str:
        path = self.root / "dockerd.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def docker(self, *args: str, check: bool = True, timeout: float = 300, input: bytes | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["docker", *args], env={**self.env, **(env or {})}, capture_output=True,
                              timeout=timeout, input=input.decode() if input else None, text=True,
                              stdin=None if input else subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise HarnessError(f"docker {' '.join(args)} on host {self.host} exited {done.returncode}: "
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """Stop dockerd (TERM: it stops its containers first), KILL after `timeout`."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.unmount()

    def crash(self) -> None:
        """The host crashes: its containers killed (a Swarm task's container outlives its dockerd's stop, and lives
        in a network namespace of its own), dockerd stopped, and every process left in the host's namespace
        killed, as a machine that loses power loses them."""
        running = self.docker("ps", "-q", check=False, timeout=60).stdout.split()
        if running:
            self.docker("kill", *running, check=False, timeout=60)
        self.stop()
        pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=30).stdout
        for pid in (int(p) for p in pids.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.unmount()

    def unmount(self) -> None:
        """Unmount what dockerd left mounted under its folders: it runs in the machine's mount namespace (nsenter
        --net), so its bind of the host namespace (exec/netns/default) would outlive it and keep that namespace."""
        root = str(self.root.resolve()) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if line.split()[4].startswith(root)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


class HostsLab(Lab):
    """`Lab` with routed links (every packet between hosts crosses the relay namespace) and engines."""

    def __init__(self, hosts: int) -> None:
        super().__init__(hosts)
        self.engines: list[Engine] = []
        self._tproxy: subprocess.Popen | None = None

    def _build(self) -> None:
        relay = self.relay_ns
        self._add(relay)
        sh("ip", "netns", "exec", relay, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for k, ns in enumerate(self.hosts):
            self._add(ns)
            sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{k}", "netns", relay)
            sh("ip", "-n", relay, "addr", "add", f"{RELAY_IP}/32", "dev", f"h{k}")
            sh("ip", "-n", relay, "link", "set", f"h{k}", "up")
            sh("ip", "-n", relay, "route", "add", f"{self.ip(k)}/32", "dev", f"h{k}")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(k)}/32", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "route", "add", f"{RELAY_IP}/32", "dev", "eth0")
            sh("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "via", RELAY_IP, "dev", "eth0", "src", self.ip(k))

    def start_engines(self, root: Path) -> list[Engine]:
        """A dockerd in every host namespace, its files under root/h<k>."""
        for k in range(len(self.hosts)):
            engine = Engine(self, k, root / f"h{k}")
            self.engines.append(engine)
            engine.start()
        return self.engines

    def delay(self, seconds: float, log: Path) -> subprocess.Popen:
        """Every new TCP connection between hosts goes through tproxy.py, `seconds` more each way."""
        argv = [sys.executable, str(Path(__file__).with_name("tproxy.py")), "--delay", str(seconds),
                "--port", str(TPROXY_PORT)]
        self.undelay()
        proc = self._tproxy = self.popen(self.relay_ns, argv)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if line.strip() != "ready":
            raise HarnessError(f"tproxy did not start (said {line!r}, exit {proc.poll()})")
        self._iptables(self.relay_ns, "-t", "nat", "-A", "PREROUTING", "-d", RELAY_IP, "-j", "RETURN")
        self._iptables(self.relay_ns, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-s", f"{SUBNET}.0/24", "-d",
                       f"{SUBNET}.0/24", "-j", "REDIRECT", "--to-ports", str(TPROXY_PORT))
        log.write_text(f"tproxy {argv[2:]}\n")
        return proc

    def undelay(self) -> None:
        """No more delay: the REDIRECT rule goes, and the relay stops (its connections with it)."""
        self._iptables(self.relay_ns, "-t", "nat", "-F", "PREROUTING")
        if self._tproxy is not None and self._tproxy.poll() is None:
            self._tproxy.terminate()
            self._tproxy.wait(timeout=10)
        self._tproxy = None

    def redirected(self) -> int:
        """Connections the delay rule has handed to the relay so far."""
        listing = self._iptables(self.relay_ns, "-t", "nat", "-n", "-v", "-x", "-L", "PREROUTING")
        return sum(int(line.split()[0]) for line in listing.splitlines() if "REDIRECT" in line)

    def unshape(self, host: int) -> None:
        sh("ip", "netns", "exec", self.hosts[host], "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def http_json(self, host: int, url: str, timeout: float = 10) -> Any:
        """GET `url` from inside host namespace `host` (the test's own namespace has no route into the lab)."""
        code = ("import json, sys, urllib.request\n"
                f"print(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode())")
        out = sh("ip", "netns", "exec", self.hosts[host], sys.executable, "-c", code, timeout=timeout + 10)
        return json.loads(out)

    def close(self) -> None:
        for engine in self.engines:
            try:
                engine.stop()
            except Exception as exc:  # the namespaces must go whatever happened
                print(f"stopping the engine of host {engine.host}: {exc}", file=sys.stderr)
        super().close()


def image_id(engine: Engine, image: str) -> str | None:
    done = engine.docker("image", "inspect", "-f", "{{.Id}}", image, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def load_image(engines: list[Engine], image: str, archive: Path, main_env: dict[str, str] | None = None) -> None:
    """`docker save` the image from the machine's own engine (where it was built) once, then `docker load` it into
    every engine that lacks that very image (no registry is reachable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")} | (main_env or {})
    wanted = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image], env=env, capture_output=True,
                            text=True, check=True, timeout=60).stdout.strip()
    todo = [e for e in engines if image_id(e, image) != wanted]
    if not todo:
        return
    if not archive.exists():
        subprocess.run(["docker", "save", "-o", str(archive), image], env=env, check=True, timeout=600)

    def load(engine: Engine) -> None:
        engine.docker("load", "-q", "-i", str(archive), timeout=600)
        if image_id(engine, image) != wanted:
            raise HarnessError(f"host {engine.host}: {image} loaded but its id is not {wanted}")
    try:
        with ThreadPoolExecutor(len(todo)) as pool:  # the engines unpack it at once (CI time)
            list(pool.map(load, todo))
    finally:
        archive.unlink(missing_ok=True)  # 1.2 GB that pytest would otherwise keep for three sessions


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- runs -----------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
# The one-liner of deploy/multihost/barrier.yaml that makes the cluster secret file (tests/docker checks it is there).
SECRET_FILE_ONE_LINER = ("install -d -m 700 ~/.mosaic && head -c 32 /dev/urandom | base64 > ~/.mosaic/secret "
                         "&& chmod 444 ~/.mosaic/secret")


def compose_cli() -> list[str]:
    """Compose v2 where the docker CLI has it, else v1 (`docker-compose`): deploy/multihost works with both."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
    return ["docker", "compose"] if v2.returncode == 0 else ["docker-compose"]


class RunResults:
    """A deployed run's results folder (`results`) and logs (`logs()`): its summary, and waiting for the end."""

    results: Path

    def logs(self) -> str:
        raise NotImplementedError

    def summary(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.results / "summary.json").read_text())
        except (OSError, ValueError):
            return None

    def wait_final(self, timeout: float) -> dict[str, Any]:
        """summary.json once it is no longer "running"; fails naming the logs if that takes over `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            summary = self.summary()
            if summary and summary["status"] != "running":
                return summary
            if time.monotonic() > deadline:
                raise HarnessError(f"no final summary within {timeout:g}s:\n{self.logs()}")
            time.sleep(1)


class ComposePerHost(RunResults):
    """deploy/multihost by docs/deploy.md's marked blocks, as written (pageblocks.py): the secret, the barrier's
    project on one host, a nodes project with its own --scale on each node host, only the barrier's address and
    the home folder substituted (and the counts, where a caller's scale is not the page's 2 per host). The lab's
    hosts share this machine's file system, so the secret needs no copy (the page's scp); results, data and the
    image name come from the variables the page names (MOSAIC_RESULTS, MOSAIC_DATA, MOSAIC_IMAGE)."""

    def __init__(self, lab: HostsLab, tmp: Path, image: str, scale: dict[int, int], barrier_host: int = 0,
                 settings: dict[str, str] | None = None, name: str = "mh") -> None:
        self.lab, self.tmp, self.scale, self.barrier_host = lab, tmp, scale, barrier_host
        self.results = tmp / "results"
        self.results.mkdir(parents=True)
        self.home = tmp / "home"
        self.home.mkdir()
        (tmp / "data").mkdir()
        self.cli = compose_cli()
        self.run_block("secret", {**os.environ, "HOME": str(self.home)})
        self.secret = self.home / ".mosaic" / "secret"
        self.url = f"http://{lab.ip(barrier_host)}:8000"
        self.env = {"MOSAIC_IMAGE": image, "MOSAIC_RESULTS": str(self.results), "MOSAIC_DATA": str(tmp / "data"),
                    "HOME": str(self.home), **(settings or {})}
        self.projects: list[tuple[Engine, list[str]]] = []
        self.name = name
        # what `logs` and `down` need to read the files (the blocks set these on their own command lines)
        self.files_env = {**self.env, "MOSAIC_SECRET_PATH": str(self.secret), "MOSAIC_BARRIER_URL": self.url,
                          "MOSAIC_NODES": str(sum(scale.values()))}

    def run_block(self, name: str, env: dict[str, str], host: int | None = None, **names: str) -> str:
        text = block(DEPLOY_PAGE, name, **names)
        if self.cli == ["docker-compose"]:
            text = text.replace("docker compose", "docker-compose")
        done = subprocess.run(["bash", "-euc", text], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise HarnessError(f"docs/deploy.md block {name} on host {host} exited {done.returncode}: "
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    def up(self) -> ComposePerHost:
        barrier = self.lab.engines[self.barrier_host]
        self.projects.append((barrier, ["deploy/multihost/barrier.yaml", "mosaic-barrier"]))
        total = sum(self.scale.values())
        self.run_block("barrier", {**barrier.env, **self.env}, self.barrier_host,
                       **({} if total == 6 else {"MOSAIC_NODES=6": f"MOSAIC_NODES={total}"}))
        for host, n in self.scale.items():
            engine = self.lab.engines[host]
            self.projects.append((engine, ["deploy/multihost/nodes.yaml", "mosaic-nodes"]))
            self.run_block("nodes", {**engine.env, **self.env}, host, BARRIER_HOST=self.lab.ip(self.barrier_host),
                           **({} if n == 2 else {"node=2": f"node={n}"}))
        return self

    def status(self) -> dict[str, Any]:
        return self.lab.http_json(self.barrier_host, f"{self.url}/v1/status")

    def history(self) -> list[dict[str, Any]]:
        return self.lab.http_json(self.barrier_host, f"{self.url}/v1/history?since=0")["rounds"]

    def logs(self, tail: int = 15) -> str:
        out = []
        for engine, (file, project) in self.projects:
            cmd = [*self.cli, "-p", project, "-f", str(ROOT / file), "logs", "--no-color", "--tail", str(tail)]
            done = subprocess.run(cmd, env={**engine.env, **self.files_env}, capture_output=True, text=True,
                                  timeout=120)
            out.append(f"--- host {engine.host} {project}\n{done.stdout[-3000:]}{done.stderr[-1000:]}")
        return "\n".join(out)

    def down(self) -> None:
        for engine, (file, project) in reversed(self.projects):
            if engine.running():
                subprocess.run([*self.cli, "-p", project, "-f", str(ROOT / file), "down", "-v", "--remove-orphans",
                                "-t", "5"], env={**engine.env, **self.files_env}, capture_output=True, timeout=300)
        self.projects.clear()


def seconds_per_round(history: list[dict[str, Any]]) -> list[float]:
    """The barrier's release intervals after round 0 (round 0 includes the nodes' start)."""
    return [r["duration_s"] for r in history if r["round"] >= 1 and r["duration_s"] is not None]


def simulated_hashes(summary: dict[str, Any], tmp: Path) -> dict[str, str]:
    """`mosaicd simulate` with the run's settings (summary.json's), on this machine."""
    from mosaicd.settings import Settings

    run = {k: v for k, v in Settings.model_validate(summary["settings"]).run_fields().items()
           if v is not None and v != {}}  # no --task-options {}: simulate takes --task-option KEY=VALUE
    argv = []
    for key, value in run.items():
        name = key.replace("_", "-")
        argv += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else [f"--{name}", str(value)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}
    subprocess.run([sys.executable, "-m", "mosaicd", "simulate", *argv, "--out", str(tmp), "--quiet"], check=True,
                   env=env, capture_output=True, timeout=300)
    return json.loads((tmp / "summary.json").read_text())["model_sha256"]


# -- Swarm ----------------------------------------------------------------------------------------------------------
# The one-liner of deploy/stack.yaml that makes the Swarm secret.
SWARM_SECRET_ONE_LINER = "head -c 32 /dev/urandom | base64 | docker secret create mosaic_secret -"
ADDRESS_POOL = "10.214.0.0/16"  # overlay subnets: away from the lab's 10.213.0.0/24 (Swarm's default is 10.0.0.0/8)
_STACKS = itertools.count()


class Swarm:
    """Engine 0 inits a swarm (the manager), the others join as workers, each advertising its host's address."""

    def __init__(self, lab: HostsLab) -> None:
        self.lab = lab
        self.manager = lab.engines[0]

    def init(self) -> Swarm:
        m = self.manager
        m.docker("swarm", "init", "--advertise-addr", m.ip, "--listen-addr", f"{m.ip}:2377", "--default-addr-pool",
                 ADDRESS_POOL)
        token = m.docker("swarm", "join-token", "-q", "worker").stdout.strip()
        for engine in self.lab.engines[1:]:
            engine.docker("swarm", "join", "--token", token, "--advertise-addr", engine.ip, "--listen-addr",
                          f"{engine.ip}:2377", f"{m.ip}:2377", timeout=120)
        self.wait_ready(len(self.lab.engines), timeout=60)
        return self

    def node_ids(self) -> dict[str, int]:
        """Swarm node id -> host index."""
        return {e.docker("info", "--format", "{{.Swarm.NodeID}}").stdout.strip(): e.host for e in self.lab.engines}

    def ready(self) -> int:
        out = self.manager.docker("node", "ls", "--format", "{{.Status}}", check=False).stdout.split()
        return out.count("Ready")

    def wait_ready(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ready() != count:
            if time.monotonic() > deadline:
                raise HarnessError(f"the swarm did not have {count} ready nodes within {timeout:g}s: "
                                   + self.manager.docker("node", "ls", check=False).stdout)
            time.sleep(1)

    def label(self, host: int, label: str) -> None:
        node = self.lab.engines[host].docker("info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
        self.manager.docker("node", "update", "--label-add", label, node)

    def leave(self) -> None:
        for engine in reversed(self.lab.engines):
            if engine.running():
                engine.docker("swarm", "leave", "--force", check=False, timeout=120)


class StackRun(RunResults):
    """`docker stack deploy -c deploy/stack.yaml` on the manager, with its secret made by the documented one-liner."""

    def __init__(self, swarm: Swarm, tmp: Path, image: str, nodes: int, settings: dict[str, str],
                 name: str = "mosaichosts") -> None:
        self.swarm, self.nodes = swarm, nodes
        # a name of its own per deploy: a worker drops a removed stack's overlay network lazily, and a new network of
        # the same name (another subnet) then had its task rejected there ("no configured subnet ... contain the IP")
        self.name = f"{name}{os.getpid()}n{next(_STACKS)}"
        self.secret_name = f"{self.name}_secret"
        self.results = tmp / "results"
        self.results.mkdir(parents=True)
        self.env = {"MOSAIC_IMAGE": image, "MOSAIC_RESULTS": str(self.results), "MOSAIC_NODES": str(nodes),
                    "MOSAIC_SECRET_NAME": self.secret_name, "MOSAIC_BARRIER_PORT": "8000", **settings}

    def deploy(self) -> StackRun:
        """docs/deploy.md's Swarm blocks as written: the secret, then `docker stack deploy` (the lab's names for
        the secret, the stack and the results folder substituted; the run's settings in the environment)."""
        m = self.swarm.manager
        env = {**m.env, **{k: v for k, v in self.env.items() if k not in ("MOSAIC_NODES", "MOSAIC_RESULTS")}}
        for name, names in (("swarm-secret", {"mosaic_secret": self.secret_name}),
                            ("swarm-deploy", {"deploy/stack.yaml":
                                              str(ROOT / "deploy/stack.yaml"), " mosaic\n": f" {self.name}\n",
                                              "MOSAIC_NODES=6": f"MOSAIC_NODES={self.nodes}"})):
            done = subprocess.run(["bash", "-euc", block(DEPLOY_PAGE, name, **names)], env=env, capture_output=True,
                                  text=True, timeout=300, cwd=self.results.parent, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise HarnessError(f"docs/deploy.md block {name} exited {done.returncode}: {done.stdout[-2000:]}"
                                   f"{done.stderr[-2000:]}")
        return self

    def tasks(self, service: str, ended_too: bool = False) -> dict[str, int]:
        """The service's running tasks as task id -> host index; `ended_too`: and those that ran to their end (a
        short run's nodes may all have finished by the time Swarm is asked where it put them)."""
        hosts = self.swarm.node_ids()
        wanted = ("running", "complete") if ended_too else ("running",)
        out = self.swarm.manager.docker("service", "ps", "-q", *(() if ended_too else (
            "--filter", "desired-state=running")), f"{self.name}_{service}").stdout.split()
        placed = {}
        for task in out:
            state = self.swarm.manager.docker("inspect", "-f", "{{.NodeID}} {{.Status.State}}", task).stdout.split()
            if state[1] in wanted:
                placed[task] = hosts.get(state[0], -1)
        return placed

    def barrier_host(self, ended_too: bool = False) -> int:
        placed = self.tasks("barrier", ended_too)
        if len(placed) != 1:
            raise HarnessError(f"expected one running barrier task, got {placed}")
        return next(iter(placed.values()))

    def released(self) -> int:
        try:
            with open(self.results / "nodes.csv", newline="") as f:
                return max((int(row["round"]) for row in csv.DictReader(f)), default=-1)
        except (OSError, ValueError, KeyError):
            return -1

    def wait_released(self, round: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.released() < round:
            if time.monotonic() > deadline:
                raise HarnessError(f"round {round} not released within {timeout:g}s:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, tail: int = 20) -> str:
        out = []
        for service in ("barrier", "node"):
            done = self.swarm.manager.docker("service", "logs", "--tail", str(tail), f"{self.name}_{service}",
                                             check=False, timeout=60)
            out.append(f"--- {service}\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
        ps = self.swarm.manager.docker("service", "ps", "--no-trunc", f"{self.name}_barrier", f"{self.name}_node",
                                       check=False)
        return "\n".join(out) + "\n" + ps.stdout[-3000:]

    def remove(self) -> None:
        m = self.swarm.manager
        if not m.running():
            return
        m.docker("stack", "rm", self.name, check=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # its network gone from every engine, not only the manager's view
            gone = not any(e.docker("network", "ls", "-q", "-f", f"name={self.name}_", check=False).stdout.strip()
                           for e in self.swarm.lab.engines if e.running())
            secret = m.docker("secret", "rm", self.secret_name, check=False)
            if gone and (secret.returncode == 0 or "not found" in secret.stderr.lower()):
                return
            time.sleep(1)

"""Shared fixtures of the daemon tests: a tiny HTTP client, deadlines, and the in-memory reference run."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import structlog
from needs import lacking  # (needs reads MOSAIC_REQUIRE_* now, before the fixture below clears MOSAIC_*)

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic

# Ctrl-C reaches the commands the tests start (and this process) even where the suite was started in the background
# of a shell, which ignores SIGINT for its jobs: a child inherits an ignored signal, not a handler
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | None = None, content_type: str | None = None,
         timeout: float = 10.0) -> Reply:
    """One request on loopback; 4xx/5xx answers are returned, not raised."""
    request = urllib.request.Request(url, data=body, method=method)
    if content_type is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return Reply(resp.status, resp.read(), resp.headers.get_content_type())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(), exc.headers.get_content_type())


def stop_all(procs: dict[Any, subprocess.Popen]) -> None:
    """Kill what a test started and is still running (only left if the test failed, or stopped early)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


MEASURED: list[str] = []


def measured(line: str) -> None:
    """A figure a test measured (a time, a count, with the host's load): listed at the end of the run's output, so
    CI's log shows it, where a timed assertion would only fail on a busy host."""
    MEASURED.append(line)


HEAVY = ("slow", "docker", "browser", "netns", "slurm")  # what the quick set leaves out
ENGINES = ("docker", "netns", "slurm")  # the host's one Docker engine, its namespaces and its Slurm: one at a time


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that carries none of the HEAVY markers is `quick`: `pytest -m quick -n auto` is the set a person
    runs before each commit (every module's fast tests, ~2 minutes on 2 cores). The tests of the host's engines are
    one xdist group (`--dist loadgroup`: one worker runs them in turn), so that the rest may run beside them. First
    of the hook's implementations: xdist's worker reads the group's marker in its own, which runs before a
    conftest's otherwise (it is registered later), and then no test was grouped."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in HEAVY):
            item.add_marker(pytest.mark.quick)
        if any(item.get_closest_marker(name) for name in ENGINES):
            item.add_marker(pytest.mark.xdist_group("engines"))


FIGURES: list[str] = []  # what every test measured, as the reports carried it (from xdist's workers too)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    FIGURES.extend(value for name, value in report.user_properties if name == "measured")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("figures the tests measured")
        for line in FIGURES:
            terminalreporter.write_line(line)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
               explain: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds, with what
    `explain` says then (a log's tail: what CI's output shows of a wait that failed)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(interval)


def log_tail(path: Path, lines: int = 12) -> Callable[[], str]:
    """For `wait_until(explain=...)`: the last `lines` lines of the log at `path`, once the wait failed."""
    def tail() -> str:
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"{path.name}: {exc}"
        return f"the last lines of {path.name}:\n" + "\n".join(text)

    return tail


def flags(values: dict[str, Any]) -> list[str]:
    """Settings as mosaicd command-line flags: {"dim": 8, "train": False} -> ["--dim", "8", "--no-train"]."""
    out: list[str] = []
    for key, value in values.items():
        name = key.replace("_", "-")
        if isinstance(value, dict):  # task_options: one --task-option KEY=VALUE each (none when empty)
            out += [a for k, v in value.items() for a in (f"--{name.removesuffix('s')}", f"{k}={v}")]
            continue
        out += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else [f"--{name}", str(value)]
    return out


def role_flags(command: str, values: dict[str, Any]) -> list[str]:
    """`flags` of the settings that `mosaicd COMMAND` takes (the CLI refuses the others): a node given
    --barrier-url takes no run settings, a barrier no retries."""
    from mosaicd.cli import applies
    from mosaicd.settings import RunConfig

    taken = applies()[command] - (set(RunConfig.model_fields) if command == "node" else set())
    return flags({k: v for k, v in values.items() if k in taken})


def status(port: int) -> dict[str, Any]:
    """A daemon's /v1/status on loopback; {} while it does not listen yet."""
    try:
        reply = http("GET", f"http://127.0.0.1:{port}/v1/status", timeout=5)
    except OSError:
        return {}
    return reply.json() if reply.status == 200 else {}


def wait_lingering(cluster: Any, result: dict[str, Any], timeout: float) -> None:
    """Wait until every node of `cluster` (run by `run_in_thread`, with --linger) is done and still serves its last
    /metrics; the cluster's error if it failed meanwhile."""
    def lingering() -> bool:
        if "error" in result:
            raise result["error"]
        return bool(cluster.node_ports) and all(status(p).get("phase") == "finished" for p in cluster.node_ports)

    wait_until(lingering, timeout, "every node done (lingering)")


def run_in_thread(cluster: Any, timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    """`cluster.run(timeout)` in a background thread; the dict gets "summary", or "error" (raised or not by the
    test, as it sees fit)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["summary"] = cluster.run(timeout=timeout)
        except BaseException as exc:  # reported by the test thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


async def serve_on_loopback(app: Any) -> tuple[Any, str]:
    """`app` (an aiohttp application) served in this event loop on 127.0.0.1, a free port: its runner (the test
    cleans it up) and its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def served_barrier(run: dict[str, Any], out: Path, **barrier_kwargs: Any) -> tuple[Any, Any, Any]:
    """A `Barrier` of the run `run` (settings) writing to `out`, served in this event loop on loopback: the barrier,
    its runner (the test cleans it up) and the settings its peers take (`Peer(settings, layout)`)."""
    from mosaicd import Settings
    from mosaicd.daemon.barrier.barrier import Barrier
    from mosaicd.daemon.barrier.routes import barrier_app
    from mosaicd.daemon.http.auth import Secret, write_new_secret

    if not run.get("insecure") and "secret_file" not in run:  # the run's secret, as `mosaicd barrier` makes one
        out.parent.mkdir(parents=True, exist_ok=True)
        run = {**run, "secret_file": write_new_secret(out.parent / f"{out.name}.secret")}
    settings = Settings(**run, out=out)
    barrier = Barrier(settings.run_config(), settings.daemon_options(), secret=Secret.of(settings), **barrier_kwargs)
    runner, barrier_url = await serve_on_loopback(barrier_app(barrier))
    return barrier, runner, Settings(**run, barrier_url=barrier_url)


async def barrier_run_stopped(run: dict[str, Any], out: Path, rounds: int) -> list[str]:
    """A served barrier's run to `out`, its members gossiping `rounds` rounds of ones, then everything closed as a
    host's restart would: the members' addresses by rank, for a barrier started again on the journal left there."""
    import asyncio

    from mosaicd import Peer

    _, runner, settings = await served_barrier(run, out)
    peers = [Peer(settings, Layout.flat(settings.dim)) for _ in range(settings.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        peers.sort(key=lambda p: p.rank)
        for _ in range(rounds):
            await asyncio.wait_for(asyncio.gather(*(p.gossip(np.ones(settings.dim, np.float32)) for p in peers)), 30)
        return [p.address for p in peers]
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()


def pace(folder: Path, seconds: float) -> str:
    """A --node-profile (its path) under which a round's training takes `seconds` at least: N rounds last N x
    `seconds` whatever the host's speed, so that a test that acts on a run mid-way (a signal, a kill, a read of it
    running) acts before its end on a fast host too, and a run it lets end stays short. The models are the same: a
    profile only delays."""
    path = folder / f"pace-{seconds:g}.toml"
    path.write_text(f"compute_s = {seconds}\n")
    return str(path)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py loaded as a module, its sibling scripts importable while it loads: a test of its parts."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def sha256_f32(vector: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(vector, dtype="<f4").tobytes()).hexdigest()


async def peers_gossip(barrier: Any, runner: Any, served: Any,
                       each_round: Callable[[int, list[Any]], None] | None = None) -> dict[int, np.ndarray]:
    """Every node of `served_barrier`'s run a `mosaicd.Peer` in this event loop, from the reference's first models
    through every round (`each_round(t, peers)` after round t), then finished and the barrier done; the runner
    cleaned up. rank -> the model its loop ends with."""
    from mosaicd import Peer

    peers = [Peer(served, Layout.flat(served.dim)) for _ in range(served.nodes)]
    try:
        await asyncio.wait_for(asyncio.gather(*(p.__aenter__() for p in peers)), 30)
        initial = reference_vectors(served.model_copy(update={"rounds": 0}))
        vectors = {p.rank: initial[p.rank] for p in peers}
        for t in range(served.rounds):
            results = await asyncio.wait_for(asyncio.gather(*(p.gossip(vectors[p.rank]) for p in peers)), 30)
            vectors = {p.rank: v for p, v in zip(peers, results, strict=True)}
            if each_round is not None:
                each_round(t, peers)
        await asyncio.wait_for(asyncio.gather(*(p.finish() for p in peers)), 30)
        await asyncio.wait_for(barrier.done.wait(), 10)
    finally:
        await asyncio.gather(*(p.close() for p in peers))
        await runner.cleanup()
    return vectors


def reference_vectors(settings: Any) -> list[np.ndarray]:
    """The run of `settings` (quadratic task) by mosaic_proto's InMemoryNetwork, built here from its parts."""
    s = settings
    q = Quadratic.build(s.nodes, s.dim, s.curvature, s.seed, heterogeneous=s.heterogeneous, lr=s.lr,
                        local_steps=s.local_steps)
    fragmentation = Fragmentation.build(Layout.flat(s.dim), s.fragments, s.seed, s.strategy)
    network = InMemoryNetwork([q.initial(i) for i in range(s.nodes)], fragmentation,
                              PeerSampler(s.sampler, s.fanout, s.seed), q.train if s.train else None)
    network.run(s.rounds)
    return network.vectors


def reference_hashes(settings: Any) -> dict[str, str]:
    """rank -> sha256 of the final model, as summary.json's model_sha256."""
    return {str(i): sha256_f32(v) for i, v in enumerate(reference_vectors(settings))}


@pytest.fixture(autouse=True)
def _no_mosaic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read MOSAIC_* variables: a test sees only those it sets itself."""
    import os

    for name in [n for n in os.environ if n.startswith("MOSAIC_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _structlog_restored() -> Any:
    """A test that runs `mosaicd.cli.main` in-process reconfigures structlog onto its own captured stderr, which
    pytest closes after it: later in-process daemons would fail to log ("I/O operation on closed file")."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


class Kit:
    """Helpers shared by the daemon tests (through a fixture, so test modules need not import conftest)."""

    mosaicd = (sys.executable, "-m", "mosaicd")  # as a user types it: secure by default
    # by-hand roles as the daemon tests start them on loopback: --insecure unless given a secret (loopback_mosaicd.py)
    by_hand = (sys.executable, str(Path(__file__).with_name("loopback_mosaicd.py")))
    http = staticmethod(http)
    flags = staticmethod(flags)
    role_flags = staticmethod(role_flags)
    run_in_thread = staticmethod(run_in_thread)
    status = staticmethod(status)
    wait_lingering = staticmethod(wait_lingering)
    serve_on_loopback = staticmethod(serve_on_loopback)
    served_barrier = staticmethod(served_barrier)
    peers_gossip = staticmethod(peers_gossip)
    barrier_run_stopped = staticmethod(barrier_run_stopped)
    wait_until = staticmethod(wait_until)
    log_tail = staticmethod(log_tail)
    measured = staticmethod(measured)
    stop_all = staticmethod(stop_all)
    sha256_f32 = staticmethod(sha256_f32)
    bench_module = staticmethod(bench_module)
    reference_vectors = staticmethod(reference_vectors)
    reference_hashes = staticmethod(reference_hashes)
    pace = staticmethod(pace)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    return Kit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Keep each phase's report on the test item, so fixtures can tell whether the test failed (rep_call), and hand
    it the figures measured meanwhile."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
    report.user_properties.extend(("measured", line) for line in MEASURED)  # the figures travel with the report
    MEASURED.clear()


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium through selenium (Debian's chromium and chromium-driver); its JS errors are in its logs."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        lacking("BROWSER", f"no headless browser: missing {', '.join(missing)} (apt-get install chromium "
                "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})  # JS errors, read at the end
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()

"""An asynchronous run whose nodes find each other through a barrier (issue 60, item 4; compose's set-up on
loopback): `mosaicd barrier --sync async` is the membership point and the collector, never on the data path."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaicd.cli import main
from mosaicd.daemon.http.auth import write_new_secret
from mosaicd.experiments.cluster import free_ports

RUN = ["--sync", "async", "--task", "quadratic", "--fragments", "4", "--fanout", "2", "--rounds", "15",
       "--eval-every", "5"]


def ended(procs: dict[str, subprocess.Popen], logs: Path, within: float) -> None:
    try:
        for name, proc in procs.items():
            code = proc.wait(timeout=within)
            assert code == 0, (name, code, (logs / f"{name}.log").read_text()[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


class Run:
    """A barrier (`mosaicd barrier --sync async`, counting the nodes as compose.yaml does) and its nodes
    (`mosaicd node --barrier-url`), each a process on loopback with its log in tmp_path."""

    def __init__(self, kit: Any, tmp_path: Path, compute_s: float, *run: str) -> None:
        self.kit, self.tmp = kit, tmp_path
        (tmp_path / "p.toml").write_text(f"compute_s = {compute_s}\n")
        self.secret = write_new_secret(tmp_path / "run.secret")
        self.barrier_port, *self.ports = free_ports(5)
        self.procs: dict[str, subprocess.Popen] = {}
        self.barrier_args = ("barrier", *RUN, *run, "--node-profile", str(tmp_path / "p.toml"), "--expect-settle",
                             "2", "--register-deadline", "120", "--port", str(self.barrier_port), "--out",
                             str(tmp_path / "results"))
        self.start("barrier", *self.barrier_args)
        for port in self.ports:
            self.node(port)

    def start(self, name: str, *args: str) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([*self.kit.mosaicd, *args, "--host", "127.0.0.1", "--secret-file",
                                                 str(self.secret), "--log-json"], stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def node(self, port: int, name: str = "node") -> None:
        """The same command every time: a node started again goes on as the same member."""
        self.start(f"{name}-{port}", "node", "--barrier-url", f"http://127.0.0.1:{self.barrier_port}", "--port",
                   str(port), "--out", str(self.tmp / f"out-{port}"))

    def kill(self, port: int) -> None:
        proc = self.procs.pop(f"node-{port}")
        proc.kill()
        proc.wait(timeout=10)


def steps_of(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=1) as answer:
            return int(json.loads(answer.read())["steps"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow  # about 10 s on 2 idle cores
def test_a_barrier_collects_an_asynchronous_run_of_registered_nodes(tmp_path: Path, kit: Any) -> None:
    """Nodes register (the barrier counts them once none new came for --expect-settle seconds), hear the run and the
    roster, train with no barrier between them, and the barrier collects their reports into its summary."""
    run = Run(kit, tmp_path, 0.05)
    procs, ports = run.procs, run.ports
    ended(procs, tmp_path, 180)
    results = tmp_path / "results"
    summary = json.loads((results / "summary.json").read_text())
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and summary["dropped"] == [], summary
    ranked = summary["addresses"]
    assert sorted(ranked) == sorted(f"127.0.0.1:{p}" for p in ports)
    assert block["steps"] == {str(i): 15 for i in range(4)} and block["signed"] is True
    assert block["messages_sent"] >= 4 * 15 and block["replays_refused"] == 0
    assert summary["final"]["consensus_distance"] < 1.0
    rows = (results / "rounds.csv").read_text().splitlines()
    assert len(rows) >= 2 and "time_s" in rows[0]
    for rank, address in enumerate(ranked):  # each node's report in its own --out, and fetched into the barrier's
        mine = tmp_path / f"out-{address.rsplit(':', 1)[1]}" / "nodes" / str(rank)
        assert json.loads((mine / "async.json").read_text())["steps"] == 15
        assert np.array_equal(np.load(results / "nodes" / str(rank) / "model.npy"), np.load(mine / "model.npy"))


def test_an_asynchronous_barrier_refuses_an_own_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["barrier", "--sync", "async", "--own-loop", "--nodes", "3", "--out", str(tmp_path / "barrier")])
    assert stopped.value.code == 2 and "--sync async: `mosaicd barrier --own-loop`" in capsys.readouterr().err
    assert not (tmp_path / "barrier").exists()


@pytest.mark.slow  # about 15 s on 2 idle cores
def test_a_node_of_an_asynchronous_barrier_started_again_goes_on_from_its_checkpoint(tmp_path: Path,
                                                                                      kit: Any) -> None:
    """A node killed mid-run and started again (a container restarted): the barrier answers its registration with its
    place at once, it goes on from its checkpoint, and the barrier collects its report with the others'."""
    run = Run(kit, tmp_path, 0.1, "--rounds", "40", "--eval-every", "10")
    victim = run.ports[3]
    until = time.monotonic() + 120
    while steps_of(victim) < 8:
        assert time.monotonic() < until, "the node's 8th iteration did not come"
        time.sleep(0.05)
    run.kill(victim)
    run.node(victim, name="again")
    ended(run.procs, tmp_path, 180)
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    block = summary["asynchronous"]
    rank = str(summary["addresses"].index(f"127.0.0.1:{victim}"))
    assert summary["status"] == "finished" and summary["dropped"] == [] and block["resume_exact"] is False
    assert block["steps"] == {str(i): 40 for i in range(4)} and set(block["resumed"]) == {rank}, block
    assert 1 <= block["resumed"][rank] < 40


@pytest.mark.slow  # about 15 s on 2 idle cores
def test_an_asynchronous_barrier_stopped_and_started_again_collects_the_run(tmp_path: Path, kit: Any) -> None:
    """The barrier told to stop mid-run (`docker stop`, `docker restart`): it records the run interrupted and exits
    130, telling its members nothing: it is on no data path, they train on, and the same command started again
    (the same --out) collects the run as if nothing had happened."""
    run = Run(kit, tmp_path, 0.05, "--rounds", "100")
    until = time.monotonic() + 120
    while steps_of(run.ports[0]) < 5:
        assert time.monotonic() < until, "the node's 5th iteration did not come"
        time.sleep(0.05)
    barrier = run.procs.pop("barrier")
    barrier.send_signal(signal.SIGTERM)
    assert barrier.wait(timeout=30) == 130
    log = (tmp_path / "barrier.log").read_text()
    assert "interrupted while its members train" in log and "rounds done" not in log, log[-3000:]
    assert json.loads((tmp_path / "results" / "summary.json").read_text())["status"] == "interrupted"
    assert all(proc.poll() is None for proc in run.procs.values())  # the members train on
    run.start("again", *run.barrier_args)
    ended(run.procs, tmp_path, 180)
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    block = summary["asynchronous"]
    assert summary["status"] == "finished" and summary["dropped"] == [], summary
    assert block["steps"] == {str(i): 100 for i in range(4)} and "resumed" not in block, block


def training_roster(kit: Any, run: Run, url: str) -> list[str]:
    """The members' addresses in rank order, read from the barrier at `url` once every node has done 3 iterations."""
    kit.wait_until(lambda: min(steps_of(p) for p in run.ports) >= 3, 120, "every node's 3rd iteration")
    members = kit.http("GET", f"{url}/v1/status").json()["members"]
    return [m["address"] for m in sorted(members, key=lambda m: m["rank"])]


@pytest.mark.slow  # about 8 s on 2 idle cores
def test_mosaicd_status_of_an_asynchronous_barrier_shows_each_member_s_steps_and_depths(tmp_path: Path,
                                                                                        kit: Any) -> None:
    """`mosaicd status BARRIER` of an asynchronous run (compose's): one row per member, in rank order, with its
    steps, inbox and queue depths and the staleness of what it aggregates, read from the members themselves."""
    from mosaicd.status import cluster_view

    run = Run(kit, tmp_path, 0.05, "--rounds", "400")
    url = f"http://127.0.0.1:{run.barrier_port}"
    try:
        roster = training_roster(kit, run, url)
        view = cluster_view(url)
        assert view["sync"] == "async" and view["barrier"]["phase"] == "running", view.get("barrier")
        rows = view["nodes"]
        assert [r["address"] for r in rows] == roster and sorted(roster) == sorted(f"127.0.0.1:{p}" for p in run.ports)
        for row in rows:
            assert row["reachable"] and row["phase"] == "training" and 3 <= row["steps"] < 400, row
            assert row["iterations"] == 400 and row["inbox"] >= 0 and row["queue"] >= 0, row
            assert row["copies"] is not None and row["lag_steps_max"] >= 0, row  # it has aggregated
        shown = subprocess.run([*kit.mosaicd, "status", url], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "asynchronous" in shown.stdout and f"barrier {url} (running)" in shown.stdout, shown.stdout
        assert all(address in shown.stdout for address in roster) and "inbox" in shown.stdout, shown.stdout
    finally:
        for proc in run.procs.values():
            proc.kill()
            proc.wait(timeout=10)


PAGE = """
const d = window.mosaicDashboard, table = document.getElementById("node-table");
if (!d || !d.status || !d.status.nodes) return null;
return {cells: [...table.tBodies[0].rows].map((r) => [...r.cells].map((c) => c.textContent)),
        barrierCharts: document.getElementById("barrier-charts").hidden,
        steps: d.charts.steps ? d.charts.steps.data[0].length : 0};
"""


@pytest.mark.browser
@pytest.mark.slow  # a barrier, 4 nodes and a browser: about 15 s on 2 idle cores
def test_the_dashboard_of_an_asynchronous_barrier_shows_every_node(browser: Any, tmp_path: Path, kit: Any) -> None:
    """compose's http://127.0.0.1:8000/ of an asynchronous run: the barrier's page reads its members from the
    barrier and each member's /v1/status (another origin), and shows their steps, as a node's page does."""
    run = Run(kit, tmp_path, 0.05, "--rounds", "400")
    url = f"http://127.0.0.1:{run.barrier_port}"
    try:
        roster = training_roster(kit, run, url)
        browser.get(f"{url}/")
        shown = kit.wait_until(lambda: (v := browser.execute_script(PAGE)) and len(v["cells"]) == 4
                               and v["steps"] > 0 and all(c[2] == "training" for c in v["cells"]) and v, 120,
                               "a table of 4 training nodes and a steps chart", interval=0.2)
        assert [c[:2] for c in shown["cells"]] == [[str(rank), a] for rank, a in enumerate(roster)]
        assert shown["barrierCharts"] is True and all(int(c[3].split(" / ")[0]) >= 3 for c in shown["cells"])
        errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"
                  and e.get("source") == "javascript"]
        assert not errors, errors
    finally:
        for proc in run.procs.values():
            proc.kill()
            proc.wait(timeout=10)

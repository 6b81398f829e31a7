"""Looking at runs from their files (issue #24, item 7): `mosaicd runs` lists finished, failed and running runs,
`mosaicd log` shows a cluster's logs (and follows one until it ends), `mosaicd status FOLDER` shows a run that
ended; the looking tools start fast and print plain tables when piped. Real processes and files throughout."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from own_tasks import write_tasks

MOSAICD = [sys.executable, "-m", "mosaicd"]
QUAD = ["--task", "quadratic", "--nodes", "3", "--fanout", "1", "--fragments", "2", "--dim", "8"]


def mosaicd(*argv: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MOSAICD, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def summary_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/: a finished simulation, a failed one (its task's training fails), one SIGKILLed mid-run ("running"
    left behind) and a finished cluster run (with its logs)."""
    root = tmp_path_factory.mktemp("looking") / "runs"
    done = mosaicd("simulate", *QUAD, "--rounds", "12", "--eval-every", "4", "--quiet", "--out", str(root / "done"))
    assert done.returncode == 0, done.stderr
    tasks = write_tasks(root.parent / "tasks")  # a task whose training fails: the run fails at round 0
    failed = mosaicd("simulate", "--task", f"{tasks / 'bad.py'}:Small", "--task-option", "fail=train", "--nodes",
                     "3", "--fanout", "2", "--rounds", "3", "--quiet", "--out", str(root / "failed"))
    assert failed.returncode == 1 and "the training data went away" in failed.stderr
    killed = subprocess.Popen([*MOSAICD, "simulate", *QUAD, "--rounds", "10000000", "--eval-every", "50", "--quiet",
                               "--out", str(root / "killed")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (summary_of(root / "killed").get("final") or {}).get("round", -1) >= 49:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
    cluster = mosaicd("cluster", *QUAD, "--rounds", "6", "--eval-every", "2", "--quiet", "--out",
                      str(root / "cluster"), timeout=120)
    assert cluster.returncode == 0, cluster.stderr
    return root


def test_runs_lists_finished_failed_and_running_runs(runs: Path) -> None:
    listed = mosaicd("runs", str(runs), "--json")
    assert listed.returncode == 0, listed.stderr
    by_id = {r["id"]: r for r in json.loads(listed.stdout)}
    assert set(by_id) == {"done", "failed", "killed", "cluster"}
    done = by_id["done"]
    assert (done["status"], done["task"], done["fragments"], done["rounds_done"], done["rounds"]) == (
        "finished", "quadratic", 2, 12, 12)
    assert done["evaluated_round"] == 11 and isinstance(done["node_average"], float) and done["started"]
    assert by_id["failed"]["status"] == "failed" and "the training data went away" in by_id["failed"]["error"]
    killed = by_id["killed"]  # its process is gone: listed as its files say
    assert killed["status"] == "running" and killed["rounds"] == 10000000 and killed["rounds_done"] >= 50
    assert by_id["cluster"]["status"] == "finished" and by_id["cluster"]["rounds_done"] == 6

    table = mosaicd("runs", str(runs))  # piped: one line per run, however long, no padding
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["id", "status", "task", "K", "optimizer", "rounds", "metric", "(round)", "started",
                                "folder"]
    assert len(lines) == 5 and all(line == line.rstrip() for line in lines)
    row = next(line for line in lines if line.startswith("done "))
    assert "finished" in row and " sgd " in row and "12/12" in row and "@ 11" in row
    assert row.endswith(str(runs / "done"))
    assert "\x1b" not in table.stdout


def test_runs_of_a_folder_without_runs_and_of_no_folder(tmp_path: Path) -> None:
    empty = mosaicd("runs", str(tmp_path))
    assert empty.returncode == 0 and "no runs under" in empty.stdout
    missing = mosaicd("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and missing.stderr.startswith("mosaicd runs: error:") and "no such" in missing.stderr
    default = mosaicd("runs", "--json", cwd=tmp_path)  # runs/ by default
    assert default.returncode == 1 and "runs: no such folder" in default.stderr
    status = mosaicd("status", str(tmp_path / "nowhere"))  # a path, not a URL: said so, not read as a host
    assert status.returncode == 1 and f"{tmp_path / 'nowhere'}: no such folder" in status.stderr, status.stderr
    typo = mosaicd("status", "nowhere", cwd=tmp_path)  # a bare word is a folder's name, not a host on port 80
    assert typo.returncode == 1 and "nowhere: no such folder (and not a URL" in typo.stderr, typo.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "summary.json").write_text('{"a": 1}')
    other = mosaicd("status", str(foreign))  # some other program's summary.json: not shown as a run of Nones
    assert other.returncode == 1 and "is not a run's" in other.stderr and "None" not in other.stdout, other.stdout


def test_status_of_a_finished_and_of_a_crashed_run(runs: Path) -> None:
    shown = mosaicd("status", str(runs / "cluster"))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("run mosaic  finished  rounds done 6/6  live 3/3") and len(lines[0]) > 80
    assert lines[1].startswith("round 5: loss  node-average")
    assert lines[2].split()[-3:] == ["train", "loss", "loss"] or lines[2].endswith("loss @ 5")
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all(r[1].startswith("127.0.0.1:") for r in rows)
    assert all(r[2] == "finished" and r[3] == "5" for r in rows)  # each node's newest row of nodes.csv: round 5

    crashed = mosaicd("status", str(runs / "killed"), "--json")
    view = json.loads(crashed.stdout)
    assert view["barrier"]["role"] == "run folder" and view["barrier"]["phase"] == "running"
    assert view["barrier"]["metrics"]["round"] >= 49 and len(view["nodes"]) == 3
    assert all(isinstance(n["metric"], float) and isinstance(n["round"], int) for n in view["nodes"])

    failed = mosaicd("status", str(runs / "failed"))
    assert failed.returncode == 0 and "error: " in failed.stdout and "the training data went away" in failed.stdout


def test_status_of_a_run_folder_names_the_nodes_that_left(runs: Path, tmp_path: Path) -> None:
    """A run whose summary says rank 1 left (`mosaicd cluster` writes "left"): its status says so, as the
    barrier's live status does."""
    folder = tmp_path / "left"
    shutil.copytree(runs / "cluster", folder)
    summary = {**summary_of(folder), "left": [1], "members": [0, 2]}
    (folder / "summary.json").write_text(json.dumps(summary))
    view = json.loads(mosaicd("status", str(folder), "--json").stdout)
    assert view["barrier"]["left"] == [1] and [n["phase"] for n in view["nodes"]][1] == "left"
    assert "left [1]" in mosaicd("status", str(folder)).stdout


def test_log_shows_the_barrier_and_a_node(runs: Path) -> None:
    barrier = mosaicd("log", str(runs / "cluster"))
    assert barrier.returncode == 0, barrier.stderr
    released = [line for line in barrier.stdout.splitlines() if " released " in line]
    assert any("round=5 " in line for line in released) and not released[-1].startswith("{")
    assert "finished=true" in released[-1]
    assert any("evaluated_round=3 " in line for line in released)  # the evaluation names its round
    raw = mosaicd("log", str(runs / "cluster"), "--raw")
    assert all(json.loads(line) for line in raw.stdout.splitlines() if line.startswith("{"))
    node = mosaicd("log", str(runs / "cluster"), "--node", "1")
    assert node.returncode == 0 and ("registered" in node.stdout or "rank=1" in node.stdout), node.stdout[-2000:]
    missing = mosaicd("log", str(runs / "cluster"), "--node", "7")
    assert missing.returncode == 1 and "no node-7.log; its logs: barrier, node-0, node-1, node-2" in missing.stderr
    simulated = mosaicd("log", str(runs / "done"))
    assert simulated.returncode == 1 and "logs to its console only" in simulated.stderr
    by_name = mosaicd("log", "cluster", cwd=runs.parent)  # a name under runs/
    assert by_name.returncode == 0 and by_name.stdout == barrier.stdout
    ended = mosaicd("log", str(runs / "cluster"), "--follow", timeout=30)  # the run ended: follow ends at once
    assert ended.returncode == 0 and "the run ended (finished)" in ended.stderr


def test_log_into_a_reader_that_goes_away_ends_quietly(runs: Path, tmp_path: Path) -> None:
    """`mosaicd log RUN | head -1`: no "Broken pipe" error once the reader has what it wanted."""
    run = tmp_path / "cluster"
    shutil.copytree(runs / "cluster", run)
    line = (run / "logs" / "barrier.log").read_text().splitlines()[-1]
    with open(run / "logs" / "barrier.log", "a") as f:  # more than a pipe holds
        f.write((line + "\n") * 5000)
    with subprocess.Popen([sys.executable, "-m", "mosaicd", "log", str(run)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as piped:
        assert piped.stdout is not None and piped.stderr is not None and piped.stdout.readline()
        piped.stdout.close()
        err = piped.stderr.read().decode()
    assert piped.returncode == 141 and err == "", err


def test_log_follows_a_running_cluster_to_its_end(tmp_path: Path) -> None:
    out = tmp_path / "live"
    run = subprocess.Popen([*MOSAICD, "cluster", *QUAD, "--rounds", "40", "--eval-every", "10", "--quiet", "--out",
                            str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        follow = mosaicd("log", str(out), "--follow", "--idle", "60", timeout=120)
        followed_s = time.monotonic() - started
        assert run.wait(30) == 0, run.stderr.read() if run.stderr else ""
    finally:
        if run.poll() is None:
            run.kill()
    assert follow.returncode == 0 and "the run ended (finished)" in follow.stderr, follow.stderr
    assert any(" released " in line and "finished=true" in line for line in follow.stdout.splitlines())
    assert followed_s < 60


def test_the_looking_tools_start_fast_and_import_little() -> None:
    """`mosaicd status --help`, `--help`, `--version`: no aiohttp, numpy, pydantic or structlog (issue #23's
    target: `status --help` within 1.5x of `python -c "import aiohttp"`, best of three each)."""
    heavy = ("aiohttp", "numpy", "pydantic", "structlog", "torch")
    for argv in (["status", "--help"], ["--help"], ["--version"], ["log", "--help"], ["runs", "--help"]):
        code = (f"import sys\nfrom mosaicd.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                f"print(sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.stderr.strip().splitlines()[-1] == "[]", (argv, done.stderr)

    def best(argv: list[str]) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run(argv, capture_output=True, timeout=60)
            times.append(time.perf_counter() - started)
        return min(times)

    aiohttp_s = best([sys.executable, "-c", "import aiohttp"])
    status_s = best([*MOSAICD, "status", "--help"])
    assert status_s <= 1.5 * aiohttp_s, (status_s, aiohttp_s)


@pytest.mark.parametrize(("argv", "said"), [
    (("status", "{run}", "--watch", "--interval", "0"), "argument --interval: expected seconds above 0, got 0"),
    (("status", "{run}", "--interval", "-1"), "argument --interval: expected seconds above 0, got -1"),
    (("status", "{run}", "--timeout", "nan"), "argument --timeout: expected seconds above 0, got nan"),
    (("log", "{run}", "--follow", "--idle", "-5"), "argument --idle: expected seconds above 0, got -5"),
])
def test_durations_that_are_no_wait_are_refused_naming_the_flag(runs: Path, argv: tuple[str, ...], said: str) -> None:
    """--watch --interval 0 spun a core (and could miss Ctrl-C), -1 failed after the first table, --timeout 0 was a
    socket error, --idle -5 was taken."""
    proc = mosaicd(*(a.format(run=runs / "done") for a in argv), timeout=20)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(said), proc.stderr
    assert proc.stdout == ""


def test_runs_shows_each_runs_optimizer_with_its_options(tmp_path: Path) -> None:
    """Two runs that differ by their optimizer alone are told apart in `mosaicd runs` (issue 58, item 8)."""
    digits = ["--task", "digits", "--nodes", "3", "--fanout", "1", "--rounds", "1", "--local-steps", "1", "--quiet"]
    for name, optimizer in (("plain", []), ("adam", ["--optimizer", "adam", "--optimizer-option", "betas=[0.8,0.9]"])):
        made = mosaicd("simulate", *digits, *optimizer, "--out", str(tmp_path / name), timeout=120)
        assert made.returncode == 0, made.stderr
    listed = {r["id"]: r for r in json.loads(mosaicd("runs", str(tmp_path), "--json").stdout)}
    assert (listed["plain"]["optimizer"], listed["plain"]["optimizer_options"]) == ("sgd", {})
    assert (listed["adam"]["optimizer"], listed["adam"]["optimizer_options"]) == ("adam", {"betas": [0.8, 0.9]})
    rows = {line.split()[0]: line.split() for line in mosaicd("runs", str(tmp_path)).stdout.splitlines()[1:]}
    assert rows["plain"][4] == "sgd" and rows["adam"][4] == "adam(betas=[0.8,0.9])", rows

"""`examples/own_training_loop.py`, the `mosaicd.Peer` example the README points to: it runs to its end, the same
models twice, with the loop's own metrics in rounds.csv, and Ctrl-C stops it cleanly with its run's summary saying
so. Real processes: four peers and a barrier on 127.0.0.1; or the twin: a stand-alone `mosaicd barrier` and one
process per node."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mosaicd.rundir import read_rounds

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_training_loop.py"


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_the_peer_example_runs_to_its_end_the_same_twice() -> None:
    procs = [start(), start()]  # at once: two runs of the same command
    summaries = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        accuracies = [float(a) for a in re.findall(r"'(\d\.\d+)'", err.splitlines()[-1])]
        assert len(accuracies) == 4 and min(accuracies) > 0.5, err[-2000:]
        out = Path(re.search(r"outputs in (\S+)\)", err).group(1))  # type: ignore[union-attr]
        summaries.append(json.loads((out / "summary.json").read_text()))
        rows = read_rounds(out)
        assert [r["round"] for r in rows] == list(range(15))  # the loop's metrics of every round
        assert rows[-1]["metric"] == "accuracy" and set(rows[-1]["reported"]) == {"accuracy", "test_loss"}
        assert rows[-1]["node_average"] == rows[-1]["reported"]["accuracy"] and len(rows[-1]["per_node"]) == 4
        assert rows[-1]["higher_is_better"] is True and 0.5 < rows[-1]["average_model"] <= 1  # evaluate=
    assert [s["status"] for s in summaries] == ["finished"] * 2
    assert [s["settings"]["task"] for s in summaries] == ["digits-mlp"] * 2  # the loop's name, not a task's
    assert summaries[0]["final"]["reported"]["accuracy"] > 0.5
    assert summaries[0]["model_sha256"] == summaries[1]["model_sha256"]  # seeded: the same models


@pytest.mark.slow
def test_own_loops_against_a_stand_alone_barrier(tmp_path: Path) -> None:
    """`mosaicd barrier --own-loop --task digits-mlp --nodes 4` (it evaluates nothing itself) and four processes of
    the example's twin (--barrier-url): the run finishes, the loops' metrics in rounds.csv, the same models as the
    example's loops against an in-process barrier, and the run named as the loop names it."""
    in_process = start()
    port_file, out = tmp_path / "port", tmp_path / "run"
    barrier = subprocess.Popen([sys.executable, "-m", "mosaicd", "barrier", "--own-loop", "--task", "digits-mlp",
                                "--nodes", "4", "--rounds", "15", "--fragments", "4", "--fanout", "2", "--seed", "0",
                                "--eval-every", "2", "--host", "127.0.0.1",
                                "--port", "0", "--port-file", str(port_file), "--out", str(out), "--linger", "0",
                                "--log-json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < end and barrier.poll() is None, barrier.communicate()[1][-3000:]
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        secret = Path(f"{out}.secret")  # made by the barrier, which was given none (secure by default)
        assert secret.stat().st_mode & 0o777 == 0o600
        nodes = [start("--barrier-url", url, "--secret-file", str(secret)) for _ in range(4)]
        for proc in nodes:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            assert "test accuracy" in err
        _, err = barrier.communicate(timeout=60)
        assert barrier.returncode == 0, err[-3000:]
        assert "average_model_failed" not in err  # no --task: it evaluated nothing itself
        _, err = in_process.communicate(timeout=300)
        assert in_process.returncode == 0, err[-3000:]
    finally:
        for proc in [in_process, barrier, *locals().get("nodes", [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and len(summary["model_sha256"]) == 4
    assert summary["settings"]["task"] == "digits-mlp" and summary["settings"]["own_loop"] is True
    one = json.loads((Path(re.search(r"outputs in (\S+)\)", err).group(1)) / "summary.json").read_text())  # type: ignore[union-attr]
    assert one["model_sha256"] == summary["model_sha256"]  # one process or five: the same models
    rows = read_rounds(out)
    assert [r["round"] for r in rows] == [1, 3, 5, 7, 9, 11, 13, 14]
    assert all(r["metric"] == "accuracy" and r["average_model"] is None and len(r["per_node"]) == 4 for r in rows)
    assert summary["final"]["reported"] == rows[-1]["reported"] and "test_loss" in rows[-1]["reported"]


@pytest.mark.slow
def test_ctrl_c_stops_the_peer_example_cleanly() -> None:
    proc = start()
    assert proc.stderr is not None
    first = proc.stderr.readline()
    out = Path(re.search(r"outputs in (\S+)", first).group(1))  # type: ignore[union-attr]
    end = time.monotonic() + 120
    while time.monotonic() < end and not (out / "summary.json").exists():  # the first round is released
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "interrupted" in summary["error"], summary

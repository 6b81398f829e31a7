"""A run that fails still leaves summary.json, saying "status": "failed" and why, with its newest evaluation;
rounds.csv and nodes.csv keep their rows."""

from __future__ import annotations

import asyncio
import csv
import gc
import json
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.http.auth import Secret
from mosaicd.experiments.cluster import Cluster, ClusterFailed
from mosaicd.experiments.simulate import YOUNG_OBJECTS, run_simulation
from mosaicd.learning.data import DataMissing
from mosaicd.outputs import RunRecorder, mark_failed, read_rounds, remove_summary
from mosaicd.progress import RoundProgress

QUICK = dict(task="quadratic", nodes=4, dim=8, fragments=2, fanout=1)


def summary_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_finished_run_says_so(tmp_path: Path) -> None:
    summary = run_simulation(Settings.load(**QUICK, rounds=2, out=tmp_path), progress=False)
    assert summary["status"] == "finished" and "error" not in summary
    assert summary_of(tmp_path)["status"] == "finished"


def test_missing_data_changes_nothing_as_in_cluster(tmp_path: Path) -> None:
    """A run that cannot start leaves no folder and changes none (as `cluster`'s): the data is checked before the
    folder is claimed, even with --replace."""
    out = tmp_path / "run"
    (out).mkdir()
    (out / "summary.json").write_text(json.dumps({"status": "finished"}))  # an earlier run's: not this one's
    settings = Settings.load(task="cifar10", nodes=4, rounds=3, data_dir=tmp_path / "nothing", out=out)
    with pytest.raises(DataMissing) as missing:
        run_simulation(settings, progress=False, replace=True)
    assert "mosaicd data fetch cifar10" in str(missing.value) and "\n" not in str(missing.value)
    assert summary_of(out) == {"status": "finished"} and [p.name for p in out.iterdir()] == ["summary.json"]
    fresh = Settings.load(task="cifar10", nodes=4, rounds=3, data_dir=tmp_path / "nothing", out=tmp_path / "new")
    with pytest.raises(DataMissing):
        run_simulation(fresh, progress=False)
    assert not (tmp_path / "new").exists()


def test_a_run_failing_midway_keeps_its_rounds(tmp_path: Path) -> None:
    def failing(p: RoundProgress) -> None:
        if p.round == 2:
            raise RuntimeError("disk full\nsecond line")

    with pytest.raises(RuntimeError, match="disk full"):
        run_simulation(Settings.load(**QUICK, rounds=10, eval_every=1, out=tmp_path), progress=False,
                       on_round=failing)
    summary = summary_of(tmp_path)
    assert summary["status"] == "failed" and summary["error"] == "disk full second line"
    assert [r["round"] for r in read_rounds(tmp_path)] == [0, 1, 2] and summary["final"]["round"] == 2
    assert summary["progress"] == {"rounds_done": 3, "rounds": 10}
    assert [int(r["round"]) for r in rows(tmp_path / "rounds.csv")] == [0, 1, 2]
    assert len(rows(tmp_path / "nodes.csv")) == 3 * QUICK["nodes"]


def test_a_run_collects_less_often_and_sets_the_collector_back_however_it_ends(tmp_path: Path) -> None:
    """While a simulation runs, the cyclic collector's young threshold is YOUNG_OBJECTS; after it, finished or failed,
    the process's own thresholds are back."""
    before = gc.get_threshold()
    seen: list[int] = []

    def look(p: RoundProgress) -> None:
        seen.append(gc.get_threshold()[0])

    run_simulation(Settings.load(**QUICK, rounds=2, out=tmp_path / "done"), progress=False, on_round=look)
    assert seen == [YOUNG_OBJECTS] * 2 and gc.get_threshold() == before

    def failing(p: RoundProgress) -> None:
        seen.append(gc.get_threshold()[0])
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        run_simulation(Settings.load(**QUICK, rounds=2, out=tmp_path / "failed"), progress=False, on_round=failing)
    assert seen[2:] == [YOUNG_OBJECTS] and gc.get_threshold() == before
    assert before[0] < YOUNG_OBJECTS  # CPython's default: the run's setting is one it changed


def test_a_cluster_timeout_leaves_a_failed_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    settings = Settings(nodes=3, rounds=100_000, fanout=1, eval_every=0, out=out)
    with pytest.raises(ClusterFailed, match="did not finish in time"):
        Cluster(settings, progress=False).run(timeout=4)
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["mode"] == "cluster"
    assert summary["error"].startswith("the run did not finish in time")
    # wall_s: as of the barrier's last summary (its progress, refreshed every few seconds; the launcher keeps it)
    assert summary["final"] is None and summary["settings"]["nodes"] == 3 and summary["wall_s"] >= 0


def test_an_interrupted_cluster_keeps_the_rounds_evaluated(tmp_path: Path) -> None:
    out = tmp_path / "run"
    settings = Settings(nodes=3, rounds=100_000, fanout=1, eval_every=1, out=out)

    def interrupt(p: RoundProgress) -> None:
        if p.round == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Cluster(settings, progress=False, on_round=interrupt).run(timeout=120)
    summary = summary_of(out)
    assert summary["status"] == "interrupted" and "interrupted" in summary["error"]
    evaluated = rows(out / "rounds.csv")
    parsed = read_rounds(out)
    assert evaluated and [r["round"] for r in parsed] == [int(r["round"]) for r in evaluated]
    assert parsed[0]["metric"] == "loss" and isinstance(parsed[0]["node_average"], float)
    assert parsed[-1]["nodes"] == [0, 1, 2] and len(parsed[-1]["per_node"]) == 3
    assert summary["final"]["round"] == parsed[-1]["round"]
    assert len(rows(out / "nodes.csv")) >= 6 * 3


async def test_a_failed_registration_leaves_a_failed_summary(tmp_path: Path) -> None:
    settings = Settings(nodes=3, rounds=5, register_deadline=0.3, out=tmp_path)
    barrier = Barrier(settings.run_config(), settings.daemon_options(), secret=Secret.new())
    await barrier.start()
    try:
        await asyncio.wait_for(barrier.done.wait(), 10)
    finally:
        await barrier.stop()
    summary = summary_of(tmp_path)
    assert summary["status"] == "failed" and summary["mode"] == "barrier"  # by hand
    assert summary["error"].startswith("registration failed: registration deadline (0.3s) passed with 0 of 3")
    assert summary["final"] is None


def test_a_running_run_keeps_a_partial_summary_at_every_evaluation(tmp_path: Path) -> None:
    seen: list[tuple[int, str, int | None]] = []

    def look(p: RoundProgress) -> None:
        summary = summary_of(tmp_path)
        assert "rounds" not in summary  # the rows are in rounds.csv only: summary.json stays small
        seen.append((p.round, summary["status"], (summary["final"] or {}).get("round")))

    run_simulation(Settings.load(**QUICK, rounds=6, eval_every=2, out=tmp_path), progress=False, on_round=look)
    assert seen[0] == (0, "running", None)  # progress is there from the first round
    assert seen[1] == (1, "running", 1) and seen[3] == (3, "running", 3)  # a crash would lose at most a round
    assert summary_of(tmp_path)["status"] == "finished"


def test_an_evaluation_that_completes_after_the_run_failed_leaves_it_failed(tmp_path: Path) -> None:
    """CI, under scancel: rank 0 ended the run (failed) while the barrier still evaluated a round, and that
    evaluation's progress write turned summary.json back to "running". It adds its row only."""
    recorder = RunRecorder(tmp_path, Settings(nodes=3, rounds=100, eval_every=1), mode="cluster")
    recorder.network_round(3, {"metric": "loss", "node_average": 1.0, "per_node": [1.0, 1.0]})
    assert summary_of(tmp_path)["status"] == "running"
    recorder.fail("rank 0, which hosts the barrier, stopped: it was told to stop (SIGTERM)")
    recorder.network_round(5, {"metric": "loss", "node_average": 0.5, "per_node": [0.5, 0.5]})
    summary = summary_of(tmp_path)
    assert summary["status"] == "failed" and "SIGTERM" in summary["error"] and summary["final"]["round"] == 3
    assert [r["round"] for r in read_rounds(tmp_path)] == [3, 5]
    # once its writers stopped, the launcher's mark names the newest row: the failure stays, with its reason
    mark_failed(tmp_path, recorder.settings, "cluster", "interrupted (Ctrl-C)", wall_s=1.0)
    summary = summary_of(tmp_path)
    assert summary["status"] == "failed" and "SIGTERM" in summary["error"] and summary["final"]["round"] == 5


def test_a_run_marked_failed_from_outside_keeps_what_its_writer_said(tmp_path: Path) -> None:
    """`mark_failed` (the launcher's view of a failure): a finished run stays finished, the barrier's own error
    stays (the launcher's beside it), the barrier's "interrupted" that the launcher caused gives way to the
    launcher's reason, and the rounds the journal released replace a summary's that lags behind."""
    settings = Settings(nodes=3, rounds=10)
    recorder = RunRecorder(tmp_path, settings, mode="cluster")
    recorder.finish({})
    mark_failed(tmp_path, settings, "cluster", "interrupted (Ctrl-C)", wall_s=1.0, rounds_done=4)
    assert summary_of(tmp_path)["status"] == "finished"

    RunRecorder(tmp_path, settings, mode="cluster").fail("a write failed")
    mark_failed(tmp_path, settings, "cluster", "the run did not finish in time", wall_s=1.0, rounds_done=4)
    summary = summary_of(tmp_path)
    assert (summary["status"], summary["error"]) == ("failed", "a write failed")
    assert summary["cluster_error"] == "the run did not finish in time" and summary["progress"]["rounds_done"] == 4

    RunRecorder(tmp_path, settings, mode="cluster").fail("interrupted (SIGTERM)")
    mark_failed(tmp_path, settings, "cluster", "interrupted (Ctrl-C)", wall_s=1.0)
    summary = summary_of(tmp_path)
    assert (summary["status"], summary["error"], summary["progress"]["rounds_done"]) == \
        ("interrupted", "interrupted (Ctrl-C)", 0)
    assert "cluster_error" not in summary

    remove_summary(tmp_path)
    mark_failed(tmp_path, settings, "cluster", "the barrier exited", wall_s=2.0)
    summary = summary_of(tmp_path)  # made from rounds.csv: the run's writer left none
    assert (summary["status"], summary["error"], summary["mode"], summary["wall_s"]) == \
        ("failed", "the barrier exited", "cluster", 2.0)


@pytest.mark.parametrize("command", ["cluster", "simulate"])
def test_a_run_without_its_data_says_so_once_and_makes_no_folder(kit, tmp_path: Path, command: str) -> None:
    """The launcher checks the data once, before any folder is made or process starts: one line, exit 1."""
    import subprocess
    import time

    started = time.monotonic()
    done = subprocess.run([*kit.mosaicd, command, "--task", "cifar10", "--nodes", "4", "--rounds", "2",
                           "--data-dir", str(tmp_path / "nothing")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and time.monotonic() - started < 10
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mosaicd {command}: error: task cifar10: data set not found"), \
        lines
    assert list(tmp_path.iterdir()) == []  # no runs/ folder

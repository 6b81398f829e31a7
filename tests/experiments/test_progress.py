"""Runs report each round to `on_round`; the one progress printer: plain lines off a terminal, a live rich display
on one, and a time left taken from the recent rounds."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from mosaicd.experiments.cluster import run_cluster
from mosaicd.experiments.simulate import run_simulation
from mosaicd.progress import ProgressPrinter, RoundProgress
from mosaicd.settings import Settings

ANSI = re.compile(r"[\x1b\r]")  # escape sequences, or a line redrawn in place
QUICK = {"task": "quadratic", "nodes": 4, "dim": 8, "fragments": 2, "fanout": 1, "seed": 3}


def flags(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_simulation_reports_every_round_with_rows_at_evaluation_rounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[RoundProgress] = []
    summary = run_simulation(Settings.load(**QUICK, rounds=7, eval_every=3, out=tmp_path), progress=False,
                             on_round=seen.append)
    assert [p.round for p in seen] == list(range(7))
    assert all(p.rounds == 7 and p.done == p.round + 1 for p in seen)
    assert [p.round for p in seen if p.row is not None] == [2, 5, 6]  # every 3rd round, and the last
    assert all(p.row["round"] == p.round for p in seen if p.row is not None)
    assert all(p.loss is not None and p.loss >= 0 for p in seen)
    assert seen[-1].row["node_average"] == summary["final"]["node_average"]
    assert capsys.readouterr().err == ""  # progress=False: nothing printed


def test_cluster_reports_each_round_once_in_order(tmp_path: Path) -> None:
    seen: list[RoundProgress] = []
    run_cluster(Settings.load(**QUICK, rounds=4, eval_every=2, out=tmp_path), progress=False, timeout=120,
                on_round=seen.append)
    assert [p.round for p in seen] == [0, 1, 2, 3]
    assert seen[-1].row is not None and seen[-1].row["round"] == 3  # the final evaluation, with the last round
    rows = [p.row["round"] for p in seen if p.row is not None]
    assert rows == sorted(set(rows)) and set(rows) <= {1, 3}


def test_progress_off_a_terminal_is_plain_lines(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TERM")}
    proc = subprocess.run([sys.executable, "-m", "mosaicd", "simulate", *flags({**QUICK, "rounds": 5, "eval_every": 2}),
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not ANSI.search(proc.stderr), repr(proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "round " in line]
    # rounds counted from 0, as in rounds.csv; a metric names the round it was measured at
    assert [line.split(" | ")[0] for line in lines] == [f"round {i} ({i + 1}/5 done)" for i in range(5)]
    assert "loss @ round 1: node-avg" in lines[1] and "loss @ round 1: node-avg" in lines[2] and "left" in lines[-1]
    assert "loss @ round 4: node-avg" in lines[-1] and "train loss" in lines[-1]

    quiet = subprocess.run([sys.executable, "-m", "mosaicd", "simulate", *flags({**QUICK, "rounds": 2}), "--quiet",
                            "--out", str(tmp_path / "q")], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 0 and "round" not in quiet.stderr


def test_sweep_display_off_a_terminal_has_no_escape_codes() -> None:
    buf = io.StringIO()
    with ProgressPrinter(console=Console(file=buf), plain_every=0) as printer:
        printer.start_sweep(runs=3, runs_to_run=2, rounds_to_run=4)
        printer.skip_run()
        for name in ("a", "b"):
            printer.message(f"sweep: {name} ...")
            printer.start_run(name, 2)
            for r in range(2):
                printer.on_round(RoundProgress(r, 2, 0.5, {"round": r, "metric": "accuracy", "node_average": 0.5,
                                                           "average_model": 0.25, "consensus_distance": 0.1}))
            printer.end_run()
    text = buf.getvalue()
    assert not ANSI.search(text), repr(text)
    assert "sweep: a ..." in text and "runs 2/3" in text and "b: round 1 (2/2 done)" in text
    assert "accuracy @ round 1: node-avg 0.5000 avg-model 0.2500" in text


def test_live_display_on_a_terminal() -> None:
    buf = io.StringIO()
    with ProgressPrinter(console=Console(file=buf, force_terminal=True, width=160)) as printer:
        assert printer.live
        printer.start_run("", 3)
        for r in range(3):
            printer.on_round(RoundProgress(r, 3, 1.0, None))
    text = buf.getvalue()
    assert "\x1b[" in text and "3/3 rounds" in text and "train loss 1.0000" in text


def test_a_sweep_on_a_terminal_is_one_bar() -> None:
    """A sweep's runs are shown on the sweep's bar (its detail: the run, its round, the latest news), not a bar
    and two lines per run; a failure is still a line."""
    buf = io.StringIO()
    with ProgressPrinter(console=Console(file=buf, force_terminal=True, width=200)) as printer:
        printer.start_sweep(runs=2, runs_to_run=2, rounds_to_run=4)
        for name in ("first", "second"):
            printer.sweep_news(f"sweep: {name} ...")
            printer.start_run(name, 2)
            for r in range(2):
                printer.on_round(RoundProgress(r, 2, 1.0, None))
            printer.end_run()
            printer.sweep_news(f"sweep: {name} done")
        printer.sweep_news("sweep: second failed", always=True)
    text = buf.getvalue()
    assert "runs 2/2" in text and "sweep: second done" in text  # the bar's last state (rich draws twice a second)
    assert "2/2 rounds" not in text  # no bar of a run's own
    assert "sweep: second failed\n" in ANSI.sub("", text) and "sweep: first ...\n" not in ANSI.sub("", text)


def test_runs_going_at_once_are_each_named_and_a_failure_counted() -> None:
    """`sweep --jobs 2`: the sweep's line names every run going on, with its round, and counts the failed."""
    buf = io.StringIO()
    with ProgressPrinter(console=Console(file=buf), plain_every=0.0) as printer:
        printer.start_sweep(runs=3, runs_to_run=3, rounds_to_run=6, parallel=2)
        printer.start_run("a", 2)
        printer.start_run("b", 2)
        printer.on_round(RoundProgress(0, 2, 1.0, None), "a")
        printer.on_round(RoundProgress(1, 2, 1.0, None), "b")
        assert "2 running: a 1/2, b 2/2" in buf.getvalue().splitlines()[-1]
        printer.end_run("b", failed=True)
        printer.on_round(RoundProgress(1, 2, 1.0, None), "a")
    last = buf.getvalue().splitlines()[-1]
    assert last.startswith("runs 1/3 (1 failed) |") and "| a: round 1 (2/2 done)" in last, last


def test_time_left_comes_from_the_recent_rounds() -> None:
    """A slow start-up (loading data, spawning processes) and fast rounds: the time left is that of the rounds
    left at the recent pace, not (time since the start) / (rounds done) x (rounds left)."""
    buf = io.StringIO()
    with ProgressPrinter(console=Console(file=buf)) as printer:
        printer.start_run("", 100)
        time.sleep(1.5)  # start-up
        for r in range(20):
            time.sleep(0.005)
            printer.on_round(RoundProgress(r, 100))
    lines = buf.getvalue().splitlines()
    assert "time left: measuring" in lines[0]  # one round says nothing of the pace
    left = re.search(r"~(\d+)s left", lines[-1])
    assert left is not None, lines[-1]
    assert int(left.group(1)) < 3  # ~0.5 s; from the start it would be >= 6 s

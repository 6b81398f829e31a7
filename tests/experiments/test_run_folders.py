"""A run's folder belongs to one run: a fresh one per run without --out; another run's is never taken over
silently (refused, changing no file, unless --resume or --replace says what to do); `simulate --resume` after
Ctrl-C ends with the uninterrupted run's models, bit for bit."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.experiments.simulate import run_simulation
from mosaicd.progress import RoundProgress
from mosaicd.rundir import JOURNAL, SIMULATE_CHECKPOINT, claim_out, keep_earlier_run, list_runs, read_summary
from mosaicd.settings import SettingsError

QUICK = dict(task="quadratic", nodes=4, dim=8, fragments=2, fanout=2, heterogeneous=True, eval_every=3)


def listing(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder`: its modification time and content hash (what "unchanged" means here)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def csv_rows(path: Path, drop: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """A CSV's rows without the columns in `drop` (the wall-clock ones, which differ between two runs)."""
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]


TIMINGS = ("elapsed_s", "train_s", "send_s", "wait_s", "aggregate_s")


def interrupt_at(round: int) -> Any:
    """An on_round that stops the run after `round` as Ctrl-C would (KeyboardInterrupt)."""
    def stop(p: RoundProgress) -> None:
        if p.round == round:
            raise KeyboardInterrupt
    return stop


def mosaicd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mosaicd", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_sigint_then_the_same_command_is_refused_and_resume_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    # 1,000 rounds: their progress lines (~140 bytes each) overfill the pipe's 64 KiB ~470 rounds in, where the run
    # holds still until the test reads on; so it cannot end before the SIGINT, on a fast host either (400 rounds took
    # ~0.3 s on 2 loaded cores: they could all be done between the line of round 12 and the signal)
    settings = dict(QUICK, rounds=1000, checkpoint_rounds=5)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "mosaicd", "simulate", *[f"--{k.replace('_', '-')}" if v is True else
                                                              f"--{k.replace('_', '-')}={v}"
                                                              for k, v in settings.items()], "--out", str(out)]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # plain progress lines (a pipe): "round 11 (12/1000 done) | ..."
        seen.append(line)
        match = re.match(r"round (\d+) \(", line)
        if match and int(match.group(1)) >= 12:
            os.kill(proc.pid, signal.SIGINT)
            break
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, "".join(seen[-5:]) + rest  # not finished before the signal came
    summary = read_summary(out)
    assert summary is not None and summary["status"] == "interrupted" and "interrupted" in summary["error"]
    assert summary["progress"]["rounds_done"] >= 13 and (out / SIMULATE_CHECKPOINT).is_file()
    assert "--resume" in rest and str(out) in rest  # the console says how to go on

    before = listing(out)
    again = mosaicd(*command[3:], cwd=tmp_path)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.count("\n") == 1 and "Traceback" not in again.stderr
    assert f"--out {out} holds an unfinished run (interrupted with" in again.stderr
    assert "--resume" in again.stderr and "--replace" in again.stderr
    assert listing(out) == before

    resumed = mosaicd(*command[3:], "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"resuming with (1[05]|[2-9]\d|\d{3}) of 1000 rounds done", resumed.stderr), resumed.stderr
    finished = read_summary(out)
    assert finished is not None and finished["status"] == "finished"
    assert not (out / SIMULATE_CHECKPOINT).exists()

    whole = run_simulation(Settings.load(**settings, out=tmp_path / "whole"), progress=False)
    assert finished["model_sha256"] == whole["model_sha256"] and len(whole["model_sha256"]) == 4
    # the rows of the rounds run twice are there once: the files equal the uninterrupted run's, clocks aside
    for name in ("rounds.csv", "nodes.csv"):
        assert csv_rows(out / name, TIMINGS) == csv_rows(tmp_path / "whole" / name, TIMINGS), name


def test_a_run_going_on_in_a_folder_is_not_resumed_or_replaced_beside_it(tmp_path: Path, kit: Any) -> None:
    """"holds an unfinished run (running ...): continue it with --resume" is true of a killed run, not of a live one:
    while a run's process holds its folder, --resume and --replace are refused (they would write the same files at
    once: rows twice, a folder emptied under a running process); once it has ended, the usual refusal names them."""
    out = tmp_path / "run"
    # rounds: far more than a fast host simulates during the two refusals (the test stops the run; a --node-profile
    # would not slow simulate, whose clock it plays)
    command = ["simulate", "--task", "digits", "--nodes", "4", "--rounds", "20000", "--out", str(out), "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "mosaicd", *command], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        kit.wait_until(lambda: ((read_summary(out) or {}).get("progress") or {}).get("rounds_done"), 90,
                       "the run's first round in summary.json", 0.05)
        for how in ("--resume", "--replace"):
            refused = mosaicd(*command, how, cwd=tmp_path)
            assert refused.returncode == 2 and refused.stdout == "", refused.stderr
            assert refused.stderr.strip() == f"mosaicd simulate: error: --out {out}: another process is running a " \
                "run there now: wait for it to end, or stop it (Ctrl-C), then try again", refused.stderr
        assert proc.poll() is None and (out / "nodes.csv").exists()  # the run went on, its files kept
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130
    after = mosaicd(*command, cwd=tmp_path)  # the folder is free again: the refusal is the usual one
    assert after.returncode == 2 and f"--out {out} holds an unfinished run (interrupted with" in after.stderr


def test_resume_is_exact_from_a_checkpoint_and_from_none(tmp_path: Path) -> None:
    settings = dict(QUICK, rounds=24)
    whole = run_simulation(Settings.load(**settings, out=tmp_path / "whole"), progress=False)
    for stop, checkpoint_rounds in ((16, 10), (4, 10), (9, 0)):  # resumes at round 10, then twice at round 0
        out = tmp_path / f"stop{stop}"
        s = Settings.load(**settings, checkpoint_rounds=checkpoint_rounds, out=out)
        with pytest.raises(KeyboardInterrupt):
            run_simulation(s, progress=False, on_round=interrupt_at(stop))
        assert (out / SIMULATE_CHECKPOINT).exists() == (stop >= 10)
        resumed = run_simulation(s, progress=False, resume=True)
        assert resumed["model_sha256"] == whole["model_sha256"], stop
        assert [r["round"] for r in csv_rows(out / "rounds.csv")] == [str(r) for r in range(2, 24, 3)]


def test_a_resumed_runs_clock_leaves_out_the_time_it_stood_stopped(tmp_path: Path) -> None:
    """wall_s and elapsed_s count the time the run ran: the pause before --resume (3 s here; hours, for a run
    resumed the next morning) is not in them, and elapsed_s goes on from where it stood."""
    import time

    s = Settings.load(**dict(QUICK, rounds=24), checkpoint_rounds=10, out=tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_simulation(s, progress=False, on_round=interrupt_at(16))
    stopped = read_summary(s.out)
    time.sleep(3)
    began = time.monotonic()
    resumed = run_simulation(s, progress=False, resume=True)
    took = time.monotonic() - began
    assert stopped["wall_s"] <= resumed["wall_s"] <= stopped["wall_s"] + took + 0.5, (stopped["wall_s"], took, resumed)
    elapsed = [float(r["elapsed_s"]) for r in csv_rows(s.out / "rounds.csv")]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= stopped["wall_s"] + took + 0.5, elapsed


def test_resume_batched_equals_the_uninterrupted_batched_run(tmp_path: Path) -> None:
    settings = dict(QUICK, rounds=14, batched=True, checkpoint_rounds=4)
    whole = run_simulation(Settings.load(**settings, out=tmp_path / "whole"), progress=False)
    s = Settings.load(**settings, out=tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_simulation(s, progress=False, on_round=interrupt_at(9))
    assert run_simulation(s, progress=False, resume=True)["model_sha256"] == whole["model_sha256"]


def test_resume_with_other_settings_is_refused_naming_the_flags(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(Settings.load(**QUICK, rounds=20, out=out), progress=False, on_round=interrupt_at(12))
    before = listing(out)
    with pytest.raises(SettingsError) as refused:
        run_simulation(Settings.load(**{**QUICK, "rounds": 30, "seed": 3}, out=out), progress=False, resume=True)
    assert "--rounds 30" in str(refused.value) and "--seed 3" in str(refused.value)
    assert "--fanout" not in str(refused.value) and "--replace" in str(refused.value)
    assert listing(out) == before
    # settings that do not change the results may differ
    summary = run_simulation(Settings.load(**QUICK, rounds=20, checkpoint_rounds=3, out=out), progress=False,
                             resume=True)
    assert summary["status"] == "finished"


def test_resume_from_a_damaged_checkpoint_is_refused_in_one_line_naming_replace(tmp_path: Path) -> None:
    """A checkpoint cut short (a copy that stopped, a full disk elsewhere) is no traceback: one line, no change."""
    out = tmp_path / "run"
    s = Settings.load(**QUICK, rounds=20, checkpoint_rounds=5, out=out)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(s, progress=False, on_round=interrupt_at(12))
    raw = (out / SIMULATE_CHECKPOINT).read_bytes()
    (out / SIMULATE_CHECKPOINT).write_bytes(raw[:len(raw) // 2])
    before = listing(out)
    with pytest.raises(ValueError) as refused:
        run_simulation(s, progress=False, resume=True)
    assert "cannot be read" in str(refused.value) and "--replace" in str(refused.value)
    assert listing(out) == before


def test_a_barrier_keeps_each_earlier_run_aside_and_nothing_else(tmp_path: Path) -> None:
    """`keep_earlier_run` (a barrier starting a new run in a used --out): the run's files, each run its own folder
    (the same start twice gets -2), the folder's other files left where they are; a folder without a run: None."""
    out = tmp_path / "results"
    assert keep_earlier_run(out) is None
    kept = []
    for _ in range(2):
        run_simulation(Settings.load(**QUICK, rounds=3, out=out), progress=False, replace=True)
        (out / "notes.txt").write_text("mine")
        summary = json.loads((out / "summary.json").read_text())
        kept.append(keep_earlier_run(out))
        assert json.loads((kept[-1] / "summary.json").read_text()) == summary
        assert not (out / "summary.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert kept[0] != kept[1] and kept[0].parent == kept[1].parent == out / "earlier"
    assert keep_earlier_run(out) is None
    run_simulation(Settings.load(**QUICK, rounds=3, out=out), progress=False, replace=True)
    listed = [Path(e["folder"]) for e in list_runs(tmp_path)]  # `mosaicd runs` shows the runs kept aside too
    assert sorted(listed) == sorted([out, *kept]), listed


def test_a_finished_run_is_refused_without_replace_and_replaced_with_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_simulation(Settings.load(**QUICK, rounds=3, out=out), progress=False)
    (out / "notes.txt").write_text("mine")
    (out / "logs").mkdir()
    (out / "logs" / "node-9.log").write_text("an earlier run's")
    before = listing(out)
    for resume in (False, True):
        with pytest.raises(SettingsError, match="holds a finished run") as refused:
            run_simulation(Settings.load(**QUICK, rounds=5, out=out), progress=False, resume=resume)
        assert "--replace" in str(refused.value) and "\n" not in str(refused.value)
        assert listing(out) == before
    summary = run_simulation(Settings.load(**QUICK, rounds=5, out=out), progress=False, replace=True)
    assert summary["status"] == "finished" and summary["progress"]["rounds_done"] == 5
    assert (out / "notes.txt").read_text() == "mine" and not (out / "logs").exists()


def test_the_same_command_twice_without_out_makes_two_folders(tmp_path: Path) -> None:
    first, second = (mosaicd("simulate", "--task", "quadratic", "--nodes", "3", "--fanout", "1", "--rounds", "2",
                             cwd=tmp_path) for _ in range(2))
    folders = []
    for done in (first, second):
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.splitlines()[-1])["out"]
        assert re.fullmatch(r"runs/mosaic-\d{8}-\d{6}(-\d+)?", out), out
        assert f"run folder {out}" in done.stderr  # said at the start too
        folders.append(out)
    assert folders[0] != folders[1]
    assert all(read_summary(tmp_path / f)["status"] == "finished" for f in folders)  # type: ignore[index]


def test_what_resume_and_replace_refuse(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (dict(out=tmp_path / "missing", mode="simulate", resume=True), "--resume: .*missing does not exist"),
        (dict(out=empty, mode="simulate", resume=True), "--resume: .*empty holds no run to continue"),
        (dict(out=None, mode="simulate", resume=True), "--resume needs --out"),
        (dict(out=empty, mode="cluster", resume=True, replace=True), "--resume and --replace"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SettingsError, match=message):
            claim_out(**kwargs)
    assert claim_out(empty, "cluster") == empty and claim_out(empty, "simulate", replace=True) == empty

    # a cluster whose barrier was killed: only its journal and logs
    cluster = tmp_path / "cluster"
    (cluster / "logs").mkdir(parents=True)
    (cluster / JOURNAL).write_text(json.dumps({"state": {"phase": "running", "round": 17, "rounds": 60}}))
    before = listing(cluster)
    with pytest.raises(SettingsError, match=r"unfinished run \(its barrier's journal is at round 17 of 60\): "
                                            r"continue it with --resume, or start afresh with --replace"):
        claim_out(cluster, "cluster")
    with pytest.raises(SettingsError, match="continue it with `mosaicd cluster --resume`"):
        claim_out(cluster, "simulate", resume=True)
    assert claim_out(cluster, "cluster", resume=True) == cluster and listing(cluster) == before

    # files of a run that left no summary (killed while starting): refused, and removed with --replace
    leftovers = tmp_path / "leftovers"
    leftovers.mkdir()
    (leftovers / "rounds.csv").write_text("round\n")
    with pytest.raises(SettingsError, match=r"holds files of another run \(rounds.csv\).*--replace"):
        claim_out(leftovers, "simulate")
    with pytest.raises(SettingsError, match="holds nothing to resume from"):
        claim_out(leftovers, "simulate", resume=True)
    assert claim_out(leftovers, "simulate", replace=True) == leftovers and not any(leftovers.iterdir())


def test_cluster_claims_its_folder_as_simulate_does(tmp_path: Path) -> None:
    """The same refusals, before any process starts; --resume of a cluster keeps the run's files for its barrier."""
    from mosaicd.experiments.cluster import run_cluster

    out = tmp_path / "run"
    run_simulation(Settings.load(**QUICK, rounds=2, out=out), progress=False)
    before = listing(out)
    with pytest.raises(SettingsError, match="holds a finished `mosaicd simulate` run .*--replace"):
        run_cluster(Settings.load(**QUICK, rounds=2, out=out), progress=False)
    with pytest.raises(SettingsError, match="--resume: .* holds a finished run"):
        run_cluster(Settings.load(**QUICK, rounds=2, out=out), progress=False, resume=True)
    assert listing(out) == before


@pytest.mark.parametrize("command", ["simulate", "cluster"])
def test_an_out_that_cannot_be_made_is_one_line_naming_out(tmp_path: Path, command: str) -> None:
    """A parent that is a file, a read-only file system: one line naming --out, before anything starts."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for out, why in ((afile / "sub", "Not a directory"), (Path("/proc/mosaic-run"), "")):
        proc = mosaicd(command, "--task", "quadratic", "--nodes", "4", "--rounds", "2", "--out", str(out),
                       cwd=tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.startswith(f"mosaicd {command}: error: --out {out}: cannot write "), proc.stderr
        assert proc.stderr.count("\n") == 1 and why in proc.stderr, proc.stderr
    assert afile.read_text() == "not a folder" and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("quiet", [[], ["--quiet"]], ids=["shown", "quiet"])
def test_ctrl_c_before_the_first_round_says_how_to_go_on(tmp_path: Path, kit: Any, quiet: list[str]) -> None:
    """--quiet leaves out the progress, not how to go on with a run that stopped."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mosaicd", "simulate", "--task", "digits", "--nodes", "4",
                             "--rounds", "3", "--out", str(out), *quiet], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    kit.wait_until(lambda: (out / "rounds.csv").exists(), 60, "the run's files (its task is being built)", 0.005)
    os.kill(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    summary = read_summary(out)
    assert summary is not None and summary["status"] == "interrupted" and summary["progress"]["rounds_done"] == 0
    assert f"{out}: the run stopped with 0 of 3 rounds done; the same command with --resume continues it" in err, err


def test_a_barrier_started_by_hand_holds_its_out(tmp_path: Path, kit: Any) -> None:
    """A second barrier, or `simulate --replace`, on the --out of a barrier that runs there is refused in one line
    (they would write the same rows at once), changing no file; once it has stopped, the folder is free again."""
    out = tmp_path / "run"
    barrier = ["barrier", "--task", "quadratic", "--nodes", "4", "--rounds", "3", "--fanout", "2", "--host",
               "127.0.0.1", "--port", "0", "--out", str(out)]
    proc = subprocess.Popen([*kit.by_hand, *barrier], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        kit.wait_until(lambda: (out / "rounds.csv").exists() and (out / "logs" / "barrier.log").exists(), 60,
                       "the barrier's rounds.csv and log (it waits for its nodes)")
        before = listing(out)  # every file the running barrier makes at its start: none may change from here
        second = mosaicd(*barrier, cwd=tmp_path)
        assert second.returncode == 2 and second.stdout == "", second.stderr
        assert second.stderr.strip().splitlines()[-1] == f"mosaicd barrier: error: --out {out}: another barrier is " \
            "running a run there now: give another --out, or stop it (Ctrl-C) and start this one again", second.stderr
        for command in ("simulate", "cluster"):
            refused = mosaicd(command, "--task", "quadratic", "--nodes", "4", "--rounds", "2", "--out", str(out),
                              "--replace", "--quiet", cwd=tmp_path)
            assert refused.returncode == 2 and refused.stderr.strip() == (
                f"mosaicd {command}: error: --out {out}: a barrier (`mosaicd barrier`) is running a run there now: "
                "give another --out, or stop it (Ctrl-C), then try again"), refused.stderr
        assert listing(out) == before and proc.poll() is None
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130
    done = mosaicd("simulate", "--task", "quadratic", "--nodes", "4", "--rounds", "2", "--out", str(out), "--replace",
                   "--quiet", cwd=tmp_path)
    assert done.returncode == 0 and read_summary(out)["status"] == "finished", done.stderr


def test_the_barrier_journal_has_one_name_and_one_reader(tmp_path: Path) -> None:
    """The journal's file name is defined once (`rundir/journal.py`); the barrier's journal writes and loads it by
    that name, and what classifies a folder reads it through the same reader."""
    import mosaicd.rundir
    from mosaicd.daemon.barrier import journal as barrier_journal
    from mosaicd.rundir import journal as journal_file

    assert barrier_journal.STATE_FILE is journal_file.JOURNAL is JOURNAL
    src = Path(mosaicd.rundir.__file__).parents[1]
    assert [p.relative_to(src).as_posix() for p in sorted(src.rglob("*.py")) if f'"{JOURNAL}"' in p.read_text()] \
        == ["rundir/journal.py"]
    (tmp_path / JOURNAL).write_text(json.dumps({"state": {"phase": "running", "round": 2, "rounds": 3},
                                                "earlier": {"phase": "running", "round": 1}}))
    assert journal_file.kept_rounds(tmp_path) == barrier_journal.rounds(tmp_path) == [2, 1]
    assert journal_file.position(tmp_path) == ("running", 2, 3)

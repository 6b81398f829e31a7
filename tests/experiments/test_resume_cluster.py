"""`mosaicd cluster --resume`: a run interrupted (Ctrl-C to the process group, its barrier SIGKILLed, a full disk)
goes on from the barrier's journal and the nodes' checkpoints, at new ports, and ends with the models an
uninterrupted run gives (`mosaicd simulate`'s, bit for bit). Real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from runs import checkpoints as checkpoints_of
from runs import interrupt_when_checkpointed, journal_rounds, rounds_done

RUN = ["--nodes", "6", "--rounds", "60", "--fragments", "4", "--fanout", "2", "--dim", "16", "--seed", "3",
       "--eval-every", "5"]


def start(kit: Any, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*kit.by_hand, "cluster", *RUN, "--out", str(out), "--quiet", *extra],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reference(kit: Any, tmp_path: Path, rounds: str = "60", *extra: str) -> dict[str, str]:
    args = [*RUN[:RUN.index("--rounds") + 1], rounds, *RUN[RUN.index("--rounds") + 2:], *extra]
    subprocess.run([*kit.by_hand, "simulate", *args, "--out", str(tmp_path / "simulate"), "--quiet"], check=True,
                   capture_output=True, timeout=120)
    return json.loads((tmp_path / "simulate" / "summary.json").read_text())["model_sha256"]


def checkpoints(out: Path) -> list[list[int]]:
    return checkpoints_of(out, int(RUN[RUN.index("--nodes") + 1]))


def evaluations(out: Path) -> list[list[str]]:
    """rounds.csv's rows as written, but for the clock's column (elapsed_s)."""
    rows = [r.split(",") for r in (out / "rounds.csv").read_text().splitlines()]
    clock = rows[0].index("elapsed_s")
    return [r[:clock] + r[clock + 1:] for r in rows]


def cut_evaluations_from(out: Path, round: int) -> None:
    """Remove rounds.csv's rows of `round` on: what an interruption leaves where it comes before their evaluation
    ends (as it can just after the barrier released round + 1, whose release starts the evaluation of `round`)."""
    lines = (out / "rounds.csv").read_text().splitlines(keepends=True)
    (out / "rounds.csv").write_text("".join(lines[:1] + [r for r in lines[1:] if int(r.split(",")[0]) < round]))


def resume(kit: Any, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    proc = subprocess.run([*kit.by_hand, "cluster", *extra, "--out", str(out), "--resume"], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_ctrl_c_then_resume_gives_the_uninterrupted_models(tmp_path: Path, kit: Any) -> None:
    """Ctrl-C, then --resume: the uninterrupted run's models, and its rounds.csv but for the clock: every round
    evaluated once, with the same values, those whose evaluation the interruption cut short included (the nodes
    started again keep their models of those rounds from their checkpoints)."""
    out = tmp_path / "run"
    every = ["--eval-every", "1"]
    # while the nodes wait at the barrier, each with its checkpoint of the open round (Ctrl-C, then, keeps those);
    # the run held still while that is read, so that a fast run cannot end between the look and the Ctrl-C
    interrupt_when_checkpointed(kit, start(kit, out, *every), out, 6, after=10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "interrupted" in summary["error"]
    before = listing(out)
    started = time.monotonic()
    again = subprocess.run([*kit.by_hand, "cluster", *RUN, *every, "--out", str(out), "--quiet"], capture_output=True,
                           text=True, timeout=60)  # the same command: refused, naming --resume, nothing touched
    assert again.returncode != 0 and "--resume" in again.stderr and time.monotonic() - started < 30, again.stderr
    assert listing(out) == before
    at = next(r for r in journal_rounds(out) if all(r in kept for kept in checkpoints(out)))  # what --resume takes
    if all(at - 1 in kept for kept in checkpoints(out)):  # (unless a round was released just before Ctrl-C)
        cut_evaluations_from(out, at - 2)  # the nodes keep their models of round at - 2 in their earlier checkpoints
    done, console = resume(kit, out, *RUN, *every)
    assert "resuming" in done.stderr and "rounds done" in done.stderr, done.stderr[-2000:]
    assert console["status"] == "finished" and console["model_sha256"] == reference(kit, tmp_path, "60", *every)
    rows = [r.split(",")[:2] for r in (out / "nodes.csv").read_text().splitlines()[1:]]
    assert sorted(map(tuple, rows)) == sorted((str(t), str(n)) for t in range(60) for n in range(6))  # each once
    assert evaluations(out) == evaluations(tmp_path / "simulate")


@pytest.mark.slow
def test_resume_with_another_node_count_is_refused_as_another_fanout_is(tmp_path: Path, kit: Any) -> None:
    """--resume goes on with the run in OUT only with its run settings, --nodes as any other: one line naming the
    flag and the run's value, and no file changed (not a run of the other count, nor a summary marked failed); nor
    without a secret (a barrier started again by hand without --secret-file, a cluster with --insecure)."""
    out = tmp_path / "run"
    proc = start(kit, out)
    kit.wait_until(lambda: rounds_done(out) >= 2, 90, "round 2 in nodes.csv")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    before = listing(out)
    for flag, value in (("--nodes", "7"), ("--fanout", "3")):
        refused = subprocess.run([*kit.by_hand, "cluster", *RUN, flag, value, "--out", str(out), "--quiet", "--resume"],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr[-2000:]  # a usage error, as simulate --resume's
        ours = RUN[RUN.index(flag) + 1]
        assert f"({flag} {value}; the run has {flag} {ours})" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert listing(out) == before
    # the run was started with a secret (the cluster's own): resumed without one, nothing would be checked
    for command in (["cluster", *RUN, "--resume", "--insecure", "--quiet"],
                    ["barrier", *RUN, "--host", "127.0.0.1", "--port", "0"]):
        refused = subprocess.run([*kit.by_hand, *command, "--out", str(out)], capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and "started with a cluster secret: give its --secret-file" in refused.stderr, \
            refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1 and listing(out) == before, refused.stderr


@pytest.mark.slow
def test_a_killed_barrier_then_resume_gives_the_uninterrupted_models(tmp_path: Path, kit: Any) -> None:
    out = tmp_path / "run"
    proc = start(kit, out)
    barrier = kit.wait_until(lambda: _barrier_pid(proc.pid), 60, "the barrier's process")  # found before round 10:
    kit.wait_until(lambda: rounds_done(out) >= 10, 90, "round 10 in nodes.csv")  # killed at once, mid-run
    os.kill(barrier, signal.SIGKILL)  # its nodes die with it (PDEATHSIG); the launcher reports the failure
    assert proc.wait(timeout=60) != 0
    _, summary = resume(kit, out, *RUN)
    assert summary["status"] == "finished" and summary["model_sha256"] == reference(kit, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_full_disk_ends_the_run_naming_the_path_and_resume_finishes_it(tmp_path: Path, kit: Any) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run"
        extra = ["--rounds", "300"]
        started = time.monotonic()
        proc = subprocess.run([*kit.by_hand, "cluster", *RUN, *extra, "--out", str(out), "--quiet"],
                              capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
        assert proc.returncode != 0 and took < 60, (took, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        # the barrier's last log line says it; that log is on the full disk too, so its end may be cut short
        assert last.startswith("mosaicd cluster: error:") and "No space left" in last, last
        assert str(disk) in last, last  # the path it could not write
        journal = json.loads((out / "barrier-state.json").read_text())  # whole, still resumable
        assert journal["state"]["phase"] == "running"
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)  # room again
        _, summary = resume(kit, out, *RUN, *extra)
        assert summary["status"] == "finished" and summary["model_sha256"] == reference(kit, tmp_path, "300")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def listing(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder`: (mtime in ns, sha256 of its content)."""
    import hashlib

    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _barrier_pid(launcher: int) -> int | None:
    """The warm barrier: the launcher's child running mosaicd.experiments.warm."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and b"mosaicd.experiments.warm" in cmdline:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "topk:0.5"])
def test_a_compressed_run_resumes_with_each_nodes_error_feedback(tmp_path: Path, kit: Any, codec: str) -> None:
    """--compress with error feedback: Ctrl-C, then --resume gives the uninterrupted run's models, because each
    node's checkpoint carries what its messages left out (without it, the resumed nodes would send other values)."""
    out, compress = tmp_path / "run", ["--compress", codec]
    interrupt_when_checkpointed(kit, start(kit, out, *compress), out, 6, after=10)
    done, summary = resume(kit, out, *RUN, *compress)
    assert summary["status"] == "finished" and summary["model_sha256"] == reference(kit, tmp_path, "60", *compress)

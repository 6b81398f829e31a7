"""How `mosaicd cluster` ends when it is stopped: SIGTERM as Ctrl-C does, and a Ctrl-C that comes while the barrier
collects and evaluates the final models. Real processes on 127.0.0.1 (the process group signalled, as a terminal's
Ctrl-C is)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaicd.cli import build_parser, load_settings
from mosaicd.experiments.cluster_resume import next_step

QUADRATIC = ["--task", "quadratic", "--nodes", "4", "--fanout", "2", "--dim", "16", "--seed", "5", "--eval-every", "0"]
DIGITS = ["--task", "digits", "--nodes", "4", "--rounds", "6", "--local-steps", "2", "--fanout", "2", "--eval-every",
          "0"]


# The runs a test stops or kills mid-run: PACED_ROUNDS rounds of PACE_S at least (kit.pace: a floor on a round's
# training; the models are the same, and simulate runs without it), so that the signal, sent as soon as round 10 is
# seen, comes 2 s at least before the end on a fast host too: CI's ran 400 bare rounds in 2 s, and ended such a run
# between the look at round 20 and the signal
PACED_ROUNDS, PACE_S = 80, 0.03


def paced(kit: Any, folder: Path) -> list[str]:
    return ["--node-profile", kit.pace(folder, PACE_S)]


def start(kit: Any, out: Path, run: list[str]) -> subprocess.Popen:
    """The command in its own process group, with SIGINT at its default (a background job's is ignored)."""
    return subprocess.Popen([*kit.mosaicd, "cluster", *run, "--out", str(out), "--quiet"], start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def nodes_rows(out: Path) -> int:
    try:
        return len((out / "nodes.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def resume(kit: Any, out: Path, run: list[str], at_round: int | None = None) -> dict[str, Any]:
    """`--resume`, whose console reports the rounds from where it resumed (`at_round`, where given), not those done
    before."""
    done = subprocess.run([*kit.mosaicd, "cluster", *run, "--out", str(out), "--resume"], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    at = int(re.search(r"resuming .* with (\d+) of \d+ rounds done", done.stderr).group(1))  # type: ignore[union-attr]
    assert at_round is None or at == at_round, (at, at_round)
    reported = [int(m) for m in re.findall(r"^round (\d+) \(", done.stderr, re.MULTILINE)]
    assert all(r >= at for r in reported) and len(reported) == len(set(reported)), (at, reported[:5])
    assert max(reported, default=at - 1) == at - 1 + len(reported)  # each round from there once (none: at the end)
    return summary(out)


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_the_run_as_ctrl_c_does(tmp_path: Path, kit: Any) -> None:
    run, out, pace = [*QUADRATIC, "--rounds", str(PACED_ROUNDS)], tmp_path / "run", paced(kit, tmp_path)
    proc = start(kit, out, [*run, *pace])
    kit.wait_until(lambda: nodes_rows(out) >= 4 * 10, 90, "round 10 in nodes.csv")
    proc.send_signal(signal.SIGTERM)  # the launcher alone: what `timeout`, systemd or a job scheduler sends
    told = time.monotonic()
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - told
    assert proc.returncode == 130, err[-2000:]
    # within seconds (a loaded host's), not after a deadline: its barrier and nodes stopped with it
    assert took < 15, f"the launcher took {took:.1f} s to exit after SIGTERM"
    ended = summary(out)
    assert ended["status"] == "interrupted" and "interrupted" in ended["error"], ended
    stopped = [line for line in err.splitlines() if "the same command with --resume continues it" in line]
    assert stopped and str(out) in stopped[0], err[-2000:]
    at = int(stopped[0].split("stopped with ")[1].split()[0])
    assert ended["progress"]["rounds_done"] == at  # the summary and the console name the same round
    # where a node had not yet checkpointed that round, the line names the round the resume goes on from
    earlier = re.search(r"continues it from (\d+) rounds done \(the newest round every node has a checkpoint of\)",
                        stopped[0])
    goes_on = int(earlier[1]) if earlier else at
    assert earlier is None or goes_on < at, stopped[0]
    # and for certain, in a copy where node 0 lacks that round's checkpoint (killed as it wrote it)
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    for slot in (cut / "state" / "node-0").glob("checkpoint-*.npz"):
        with np.load(slot) as saved:
            newest = json.loads(str(saved["meta"]))["round"] == at
        if newest:
            slot.unlink()
    settings = load_settings(build_parser("cluster").parse_args(["cluster", *run, *pace, "--out", str(cut)]))
    assert next_step(cut, settings, KeyboardInterrupt()) == (
        f"the run stopped with {at} of {PACED_ROUNDS} rounds done; the same command with --resume continues it from "
        f"{at - 1} rounds done (the newest round every node has a checkpoint of) (--out {cut})")
    whole = subprocess.run([*kit.mosaicd, "simulate", *run, "--out", str(tmp_path / "whole"), "--quiet"],
                           capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert resume(kit, out, [*run, *pace], goes_on)["model_sha256"] == summary(tmp_path / "whole")["model_sha256"]


@pytest.mark.slow
def test_ctrl_c_while_the_final_models_are_evaluated_leaves_a_run_that_ends_as_the_uninterrupted_one(
        tmp_path: Path, kit: Any) -> None:
    whole = subprocess.run([*kit.mosaicd, "simulate", *DIGITS, "--out", str(tmp_path / "whole"), "--quiet"],
                           capture_output=True, text=True, timeout=180)
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = summary(tmp_path / "whole")["model_sha256"]
    out = tmp_path / "run"
    proc = start(kit, out, DIGITS)

    def final_release() -> bool:  # the barrier has every final arrival: it now collects and evaluates the models
        try:
            return '"finished": true' in (out / "logs" / "barrier.log").read_text()
        except OSError:
            return False
    kit.wait_until(final_release, 120, "the barrier's final release in its log", interval=0.005)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    ended = summary(out)
    if ended["status"] == "finished":  # the barrier wrote its summary before the signal came: it stays finished
        assert ended["model_sha256"] == reference and "error" not in ended
        assert "the run had finished before it was interrupted" in err, err[-2000:]
    else:  # the run is resumable at its last round, and ends with the uninterrupted run's models
        assert ended["status"] == "interrupted" and "interrupted" in ended["error"], ended
        assert ended["progress"]["rounds_done"] == 6 and not ended.get("model_sha256")
        assert "stopped with 6 of 6 rounds done; the same command with --resume continues it" in err, err[-2000:]
        resumed = resume(kit, out, DIGITS)
        assert resumed["status"] == "finished" and resumed["model_sha256"] == reference


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def family(kit: Any, launcher: subprocess.Popen) -> list[int]:
    """The launcher's barrier (the warm fork server) and its 4 nodes (QUADRATIC's), once all are started."""
    barrier = kit.wait_until(lambda: next(iter(children_of(launcher.pid)), None), 60, "the barrier's process")
    return [barrier, *kit.wait_until(lambda: (found := children_of(barrier)) and len(found) >= 4 and found, 60,
                                     "the nodes' processes")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_node_killed_alone_leaves_at_once_and_the_others_finish(tmp_path: Path, kit: Any,
                                                                  signum: signal.Signals) -> None:
    """A cluster's nodes do not leave on a signal (Ctrl-C of the whole cluster is resumed as it was), so one node
    killed by itself (`kill PID`, the OOM killer) used to stall its peers --round-deadline x --drop-after (4 min by
    default): the launcher, which sees it end, tells the barrier it left, and says so."""
    run, out = [*QUADRATIC, "--rounds", str(PACED_ROUNDS), *paced(kit, tmp_path)], tmp_path / "run"
    proc = start(kit, out, run)
    nodes = family(kit, proc)[1:]  # found before round 10, killed at once
    kit.wait_until(lambda: nodes_rows(out) >= 4 * 10, 90, "round 10 in nodes.csv")
    os.kill(nodes[0], signum)
    _, err = proc.communicate(timeout=120)  # without the leave: 2 x 120 s before it is dropped
    ended = summary(out)
    assert ended["status"] == "finished" and len(ended["left"]) == 1 and ended["dropped"] == [], (ended, err[-2000:])
    rank = ended["left"][0]
    line = next(line for line in err.splitlines() if " exited with status " in line)
    assert f"exited with status {-signum}: killed by {signum.name} (see " in line, line
    assert line.endswith("; told the barrier it left: the others go on without it, not waiting for it"), line
    assert len(ended["model_sha256"]) == 3 and str(rank) not in ended["model_sha256"], ended["model_sha256"]
    assert proc.returncode == 0, err[-2000:]  # the run finished: a node that left is in its summary


def test_the_launcher_killed_takes_its_processes_with_it_and_leaves_a_resumable_run(tmp_path: Path, kit: Any) -> None:
    """SIGKILL to `mosaicd cluster` (it cannot clean up): its barrier hears it (PDEATHSIG: SIGTERM), ends as Ctrl-C
    does (summary.json: interrupted, not "running") and stops its nodes; no process is left, and --resume ends
    with the uninterrupted run's models."""
    run, out, pace = [*QUADRATIC, "--rounds", str(PACED_ROUNDS)], tmp_path / "run", paced(kit, tmp_path)
    proc = start(kit, out, [*run, *pace])
    processes = family(kit, proc)  # found before round 10, killed at once
    kit.wait_until(lambda: nodes_rows(out) >= 4 * 10, 90, "round 10 in nodes.csv")
    proc.kill()
    proc.communicate(timeout=30)

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    kit.wait_until(lambda: not any(running(pid) for pid in processes), 20, "the barrier and its nodes to end")
    stopped = summary(out)
    assert stopped["status"] == "interrupted" and stopped["error"] == "interrupted (SIGTERM)", stopped
    whole = subprocess.run([*kit.mosaicd, "simulate", *run, "--out", str(tmp_path / "whole"), "--quiet"],
                           capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert resume(kit, out, [*run, *pace])["model_sha256"] == summary(tmp_path / "whole")["model_sha256"]

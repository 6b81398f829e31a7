"""Peer-list members speak as `mosaicd cluster` does: a progress line on each member's console, and when rank 0 (which
hosts the barrier) is told to stop, every member says that the same commands resume the run, with the rounds counted
done in every line of the stop. Real `mosaicd node` processes on 127.0.0.1, consoles for people (no --log-json)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mosaicd.daemon.node.outbound import SAME_COMMANDS
from mosaicd.experiments.cluster import free_ports

# rounds: far more than a fast host runs before rank 0 is stopped (CI's ran 400 in 2 s, before the signal came)
RUN = dict(nodes=3, rounds=20_000, fragments=2, fanout=1, dim=16, seed=5, eval_every=0, round_deadline=60,
           barrier_grace=15)
TOTAL = RUN["rounds"]


@pytest.mark.slow
def test_members_show_progress_and_all_say_how_to_resume_when_rank_0_stops(tmp_path: Path, kit: Any) -> None:
    ports = sorted(free_ports(RUN["nodes"]))
    (tmp_path / "peers.txt").write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
    logs = {port: tmp_path / f"node-{port}.log" for port in ports}
    procs = {}
    for port in ports:
        with open(logs[port], "wb") as log:
            procs[port] = subprocess.Popen(
                [*kit.by_hand, "node", "--peer-list", str(tmp_path / "peers.txt"), "--port", str(port), "--host",
                 "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), *kit.flags(RUN)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    progress = re.compile(rf"^rank (\d): round (\d+) \((\d+)/{TOTAL} done\) \|.*members 3/3.*elapsed", re.MULTILINE)
    try:
        kit.wait_until(lambda: all(len(progress.findall(logs[p].read_text())) >= 2 for p in ports), 90,
                       "two progress lines on every member's console")
        procs[ports[0]].send_signal(signal.SIGTERM)
        codes = {port: procs[port].wait(timeout=60) for port in ports}
    finally:
        kit.stop_all(procs)
    said = {port: logs[port].read_text() for port in ports}
    assert codes[ports[0]] == 130, said[ports[0]][-2000:]  # interrupted (a person stopped it), not failed
    for rank, port in enumerate(ports):  # each member's lines are its own rank's, rounds counted from 0
        lines = progress.findall(said[port])
        assert {int(r) for r, _, _ in lines} == {rank} and all(int(d) == int(t) + 1 for _, t, d in lines), lines
    stop = re.search(rf"rank 0 stopped the run with (\d+) of {TOTAL} rounds done \(it hosts the barrier\); start the "
                     r"same commands again, on every member, to resume it", said[ports[0]])
    assert stop, said[ports[0]][-2000:]
    for port in ports[1:]:  # every other member: why, with the same count, and how to go on
        assert SAME_COMMANDS in said[port], said[port][-2000:]
        told = re.search(r"^mosaicd node: the run ended(?: after round \d+)?: interrupted \(rank 0, which hosts the "
                         rf"barrier, stopped with (\d+) of {TOTAL} rounds done", said[port], re.MULTILINE)
        assert told is None or told[1] == stop[1], (told, stop[1])  # unheard members: the grace's line, the hint
        # heard: interrupted, as rank 0 (no error line); unheard: the barrier did not answer, an error
        assert (codes[port], "mosaicd node: error" in said[port]) == ((130, False) if told else (1, True)), \
            (codes[port], said[port][-2000:])
    summary = json.loads((tmp_path / f"out-{ports[0]}" / "summary.json").read_text())
    assert summary["mode"] == "barrier" and summary["status"] == "interrupted" and SAME_COMMANDS in summary["error"], \
        summary

"""Helpers of the tests that run Mosaic across processes: where a cluster run stands on disk (its rounds, each
node's checkpoints, the barrier's journal), Ctrl-C at a round every node checkpointed, and a run of peer-list nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def rounds_done(out: Path) -> int:
    try:
        rows = (out / "nodes.csv").read_text().splitlines()[1:]
    except OSError:
        return -1
    return max((int(r.split(",")[0]) for r in rows if r), default=-1)


def checkpoints(out: Path, nodes: int) -> list[list[int]]:
    """The rounds of each node's checkpoints in OUT/state (newest first)."""
    from mosaicd.daemon.node import checkpoint

    return [checkpoint.rounds(out / "state" / f"node-{n}") for n in range(nodes)]


def journal_rounds(out: Path) -> list[int]:
    """The open rounds the barrier's journal keeps (newest first)."""
    from mosaicd.daemon.barrier import journal as barrier_journal

    return barrier_journal.rounds(out)


def interrupt_when_checkpointed(kit: Any, proc: subprocess.Popen, out: Path, nodes: int, after: int) -> None:
    """Ctrl-C to a `cluster`'s process group once round `after` is in nodes.csv and every node has checkpointed the
    open round (so that --resume goes on from it); the launcher ends with 130."""
    kit.wait_until(lambda: rounds_done(out) >= after, 90, f"round {after} in nodes.csv")

    def interrupted_at_a_checkpointed_round() -> bool:
        # the run held still while its files are read: a fast run moves on between a node's checkpoint and the
        # barrier's journal, and could end before one look saw them agree
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            agreed = all(kept[:1] == journal_rounds(out)[:1] for kept in checkpoints(out, nodes))
            if agreed:
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole process group
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        return agreed

    kit.wait_until(interrupted_at_a_checkpointed_round, 60, "a round that every node checkpointed")
    assert proc.wait(timeout=30) == 130


def run_peer_list(kit: Any, tmp_path: Path, settings: list[str], nodes: int) -> Path:
    """`nodes` `mosaicd node --peer-list` processes on loopback, each given `settings`, run to their end; rank 0's
    output folder (its summary.json)."""
    from mosaicd.experiments.cluster import free_ports

    ports = free_ports(nodes)
    peers = tmp_path / "peers.txt"
    peers.write_text("".join(f"127.0.0.1:{port}\n" for port in ports))
    procs = {}
    here = [str(Path(p).resolve()) for p in sys.path if p and Path(p, "mosaicd").is_dir()]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_")}, "PYTHONPATH": os.pathsep.join(here)}
    try:
        for port in ports:
            with open(tmp_path / f"node-{port}.log", "wb") as log:
                procs[port] = subprocess.Popen(
                    [sys.executable, "-m", "mosaicd", "node", "--insecure", "--peer-list", str(peers), "--port",
                     str(port), "--host", "127.0.0.1", "--out", str(tmp_path / f"out-{port}"), "--log-json", *settings],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        for port, proc in procs.items():
            assert proc.wait(timeout=120) == 0, (tmp_path / f"node-{port}.log").read_text()[-3000:]
    finally:
        kit.stop_all(procs)
    return tmp_path / f"out-{min(ports)}"

"""bench/tutorial.py --phases: every process of the cluster and simulate's times its phases, and the script sets the
nodes' per call beside simulate's; the threads' context switches per round are counted; --simulate-pair: simulate
twice at once against simulate alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "bench" / "tutorial.py"


@pytest.mark.slow
def test_phases_are_counted_in_every_node_and_in_simulate(tmp_path: Path) -> None:
    nodes, rounds = 6, 14  # 14: a CPU per round is read over rounds 1 to 12
    done = subprocess.run([sys.executable, str(TUTORIAL), "--nodes", str(nodes), "--rounds", str(rounds), "--no-cold",
                           "--phases", "--simulate-pair", "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["same_models_simulate"] is True
    nodes_, simulate = report["warm"]["phases"]["node"], report["simulate"]["phases"]["simulate"]
    assert nodes_["train"]["calls"] == simulate["train"]["calls"] == nodes * rounds  # every node, every round
    # eval every 10 rounds and at the end: rounds 9 and 13; each node its own model, simulate every node's and the
    # average model
    assert nodes_["evaluate"]["calls"] == 2 * nodes and simulate["evaluate"]["calls"] == 2 * (nodes + 1)
    assert report["warm"]["phases"]["barrier"]["evaluate"]["calls"] == 2  # the average model's
    assert nodes_["checkpoint"]["calls"] >= nodes * (rounds - 1) and "checkpoint" not in simulate
    assert all(f["cpu_ms_per_call"] > 0 for f in (*nodes_.values(), *simulate.values()))
    assert report["phases"]["node"]["train"]["cpu_ms_per_call"] == nodes_["train"]["cpu_ms_per_call"]
    assert "phases, CPU ms a call (a round), the cluster's nodes | simulate: checkpoint" in done.stdout
    assert not any(tmp_path.glob("phases-*/*.tmp"))
    switches = report["warm"]["switches_per_round"]
    assert switches["node_loop_voluntary"] >= 1, switches  # each node's loop sleeps and wakes for its release
    assert switches["barrier_loop_voluntary"] >= 1 and min(switches.values()) >= 0, switches
    assert switches["node_threads_voluntary"] >= 1, switches  # a node's trainer waits for its next round's work
    assert "context switches per round (a node's per node), voluntary/involuntary: node loop" in done.stdout
    pair = report["simulate_pair"]  # two copies, a core each, against simulate alone in the same repeat
    assert pair["round_cpu_to_alone"] > 0 and pair["train_to_alone"] > 0 and pair["ratio_to_busy_bound"] > 0, pair
    assert "simulate twice at once, a core each: CPU per round" in done.stdout


def test_a_simulate_pair_without_simulate_is_refused_naming_the_flag() -> None:
    done = subprocess.run([sys.executable, str(TUTORIAL), "--simulate-pair", "--no-simulate"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--simulate-pair: needs simulate's reference" in done.stderr, done.stderr
    assert done.stdout == ""  # refused before any run

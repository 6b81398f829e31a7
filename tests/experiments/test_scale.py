"""A simulated round costs O(n): the work of a node-round does not grow with the number of nodes.

Work is counted, not timed: the Python bytecodes executed by a whole `simulate` run (sampling, the barrier's
bookkeeping, aggregation, the virtual clock, metrics and outputs), per node-round, at n and at 4n. A part that
is quadratic in n (every node listing all the others, an arrival checking every member) makes the 4n run's count
per node-round grow with n: 2x and more over this range; linear parts keep it flat (setup is shared by more
node-rounds at 4n, so it falls a little). Work done inside C (numpy, a set's construction) is not counted; the
loops that were quadratic here were Python's (bench/README.md, "A simulator for internet scale").
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.experiments.simulate import run_simulation
from mosaicd.outputs import LISTED_NODES, failed_summary
from mosaicd.rundir import read_rounds
from mosaicd.settings import Settings

GROWTH = 1.25  # the most a node-round's work may grow from n to 4n


def bytecodes_per_node_round(out: Path, nodes: int, rounds: int = 2, **settings: Any) -> float:
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            count[0] += 1
        return tracer
    run = Settings.load(task="quadratic", nodes=nodes, fragments=4, fanout=4, rounds=rounds, eval_every=1, out=out,
                        **settings)
    sys.settrace(tracer)
    try:
        summary = run_simulation(run, progress=False)
    finally:
        sys.settrace(None)
    assert summary["status"] == "finished"
    return count[0] / (nodes * rounds)


@pytest.mark.parametrize("profile", [None, "slow"])
def test_a_node_rounds_work_does_not_grow_with_the_nodes(tmp_path: Path, profile: str | None) -> None:
    """Plain rounds, and rounds on the virtual clock with a drawn share of slow nodes (stragglers every round)."""
    extra: dict[str, Any] = {}
    if profile:
        spec = tmp_path / "profile.toml"
        spec.write_text('compute_s = 1.0\n[[draw]]\nshare = 0.1\nslowdown = 50\n')
        extra = {"node_profile": str(spec), "round_deadline": 10.0, "drop_after": 5}
    small = bytecodes_per_node_round(tmp_path / "small", 250, **extra)
    large = bytecodes_per_node_round(tmp_path / "large", 1000, **extra)
    print(f"bytecodes per node-round: {small:.0f} at 250 nodes, {large:.0f} at 1000 ({large / small:.2f}x)")
    assert large <= GROWTH * small, (small, large)


def outputs_of(out: Path, nodes: int, **settings: Any) -> tuple[dict[str, Any], str]:
    run = Settings.load(task="quadratic", nodes=nodes, fragments=2, fanout=2, rounds=3, eval_every=1, out=out,
                        **settings)
    summary = run_simulation(run, progress=False)
    assert summary["status"] == "finished"
    return json.loads((out / "summary.json").read_text()), (out / "model_sha256.csv").read_text()


def test_summary_json_stays_small_past_the_listed_nodes_and_the_hashes_are_in_their_file(tmp_path: Path) -> None:
    """Up to LISTED_NODES nodes summary.json lists each node; past it counts, with every list where it belongs:
    the hashes in model_sha256.csv (its own SHA-256 in the summary), each node's metric in rounds.csv. Stragglers
    of a drawn share of slow nodes are counted per event, drops listed."""
    few, few_table = outputs_of(tmp_path / "few", LISTED_NODES)
    rows = [line.split(",") for line in few_table.splitlines()[1:]]
    assert few["model_sha256"] == dict(rows) and len(rows) == LISTED_NODES
    assert few["models_sha256"] == hashlib.sha256(few_table.encode()).hexdigest()
    assert len(few["members"]) == LISTED_NODES and len(few["final"]["per_node"]) == LISTED_NODES

    spec = tmp_path / "profile.toml"
    spec.write_text('compute_s = 1.0\n[[draw]]\nshare = 0.1\nslowdown = 50\n')
    many, table = outputs_of(tmp_path / "many", LISTED_NODES + 1, node_profile=str(spec), round_deadline=10.0)
    assert many["model_sha256"] == {} and many["models_sha256"] == hashlib.sha256(table.encode()).hexdigest()
    assert "members" not in many and many["members_count"] == LISTED_NODES + 1 - len(many["dropped"])
    assert len(table.splitlines()) == 1 + many["members_count"]  # the members' models, as in a listed summary
    assert "per_node" not in many["final"] and "nodes" not in many["final"]
    assert len(read_rounds(tmp_path / "many")[-1]["per_node"]) == many["members_count"]
    first = many["events"][0]
    assert first["stragglers_count"] == 100 and "stragglers" not in first and "members" not in first
    assert sorted(many["dropped"]) == sorted(r for e in many["events"] for r in e["dropped"]) and many["dropped"]
    assert (tmp_path / "many" / "summary.json").stat().st_size < (tmp_path / "few" / "summary.json").stat().st_size
    failed = failed_summary(tmp_path / "many", many["settings"], "simulate", "made up for the test")
    assert failed["final"]["round"] == many["final"]["round"] and "per_node" not in failed["final"]

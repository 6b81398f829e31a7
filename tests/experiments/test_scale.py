"""A simulated round costs O(n): the work of a node-round does not grow with the number of nodes.

Work is counted, not timed: the Python bytecodes executed by a whole `simulate` run (sampling, the barrier's
bookkeeping, aggregation, the virtual clock, metrics and outputs), per node-round, at n and at 4n. A part that
is quadratic in n (every node listing all the others, an arrival checking every member) makes the 4n run's count
per node-round grow with n: 2x and more over this range; linear parts keep it flat (setup is shared by more
node-rounds at 4n, so it falls a little). Work done inside C (numpy, a set's construction) is not counted; the
loops that were quadratic here were Python's (bench/README.md, "A simulator for internet scale").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.experiments.simulate import run_simulation
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

"""The models a node keeps after its rounds (`mosaic_proto.Snapshots`): its newest, and of the last
`SNAPSHOTS_KEPT` rounds only those the barrier evaluates, which it still collects: no other older model is held."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from mosaic_proto import SNAPSHOTS_KEPT
from mosaicd import Peer
from mosaicd.outputs import is_eval_round
from mosaicd.settings import Settings

RUN = dict(nodes=4, rounds=7, fragments=2, fanout=2, dim=24, seed=3, train=False, eval_every=3, insecure=True,
           host="127.0.0.1", port=0, round_deadline=60, register_deadline=30, request_timeout=10)


async def test_a_daemon_node_keeps_its_newest_model_and_the_evaluated_rounds_only(tmp_path: Path, kit: Any) -> None:
    barrier, runner, served = await kit.served_barrier(RUN, tmp_path / "out")
    run = Settings(**RUN).run_config()
    kept: list[list[int]] = []

    def after(t: int, peers: list[Peer]) -> None:
        for p in peers:
            assert p.state.snapshots[t] is p.vector  # the newest is the node's model itself: no copy
            assert p.state.model()[0] == t  # what a rejoining peer asks for
        kept.append(sorted(peers[0].state.snapshots))
        assert all(sorted(p.state.snapshots) == kept[-1] for p in peers)

    await kit.peers_gossip(barrier, runner, served, after)
    evaluated = [t for t in range(run.rounds) if is_eval_round(t, run)]
    assert evaluated == [2, 5, 6]
    assert kept == [sorted({t, *(e for e in evaluated if t - SNAPSHOTS_KEPT < e < t)}) for t in range(run.rounds)]
    assert kept[3] == [2, 3] and kept[4] == [2, 4] and kept[5] == [5]  # round 3's model went with round 4's
    with open(tmp_path / "out" / "rounds.csv", newline="") as f:  # the barrier collected every evaluated round
        assert [int(row["round"]) for row in csv.DictReader(f)] == evaluated

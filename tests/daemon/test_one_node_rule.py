"""One node behaviour, two drivers (issue 57): `mosaicd simulate` (`InMemoryNetwork`) and the daemon (`Peer`) both
run `NodeState`, so a node rule changed in that one place changes both, and they still agree bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mosaic_proto import NodeState
from mosaic_proto.round import RoundOutcome
from mosaicd import Settings
from mosaicd.experiments.simulate import run_simulation

RUN = dict(nodes=5, rounds=4, fragments=3, fanout=2, dim=30, seed=11, train=False, eval_every=2)


def halved(self: NodeState, outcome: RoundOutcome) -> np.ndarray:
    """A changed rule: a node goes on with half its round's aggregate."""
    return (outcome.vector * np.float32(0.5)).astype(np.float32)


async def peers_on_loopback(settings: Settings, kit: Any, out: Path) -> tuple[dict[int, str], dict[str, str]]:
    """Every node a `mosaicd.Peer` in this process, through HTTP on loopback to a served barrier: (rank -> hash of
    the model its loop ends with, the barrier's summary.json `model_sha256`)."""
    barrier, runner, served = await kit.served_barrier({**settings.model_dump(include=set(RUN)), "host": "127.0.0.1",
                                                        "port": 0, "round_deadline": 30, "register_deadline": 30,
                                                        "request_timeout": 10}, out)
    vectors = await kit.peers_gossip(barrier, runner, served)
    summary = json.loads((out / "summary.json").read_text())
    return {r: kit.sha256_f32(v) for r, v in vectors.items()}, summary["model_sha256"]


@pytest.mark.parametrize("messages", [False, True], ids=["arrays", "messages"])
async def test_a_node_rule_changed_once_changes_simulate_and_the_daemon_alike(tmp_path: Path, kit: Any,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              messages: bool) -> None:
    """`NodeState.settled` (the model a node goes on with after a release) changed in one place: `simulate` (its
    array path, and message by message under --max-norm) and in-process daemons on loopback both run the new rule,
    and still end with the same models bit for bit."""
    run = {**RUN, **({"max_norm": 1e9} if messages else {})}  # a --max-norm that refuses nothing: message by message
    settings = Settings(**run)
    before = run_simulation(settings.model_copy(update={"out": tmp_path / "before"}), progress=False)
    monkeypatch.setattr(NodeState, "settled", halved)
    simulated = run_simulation(settings.model_copy(update={"out": tmp_path / "simulate"}), progress=False)
    ended, collected = await peers_on_loopback(settings, kit, tmp_path / "cluster")
    assert simulated["status"] == before["status"] == "finished"
    assert simulated["model_sha256"] != before["model_sha256"]  # the rule reached simulate
    assert collected == simulated["model_sha256"]  # ... and the daemons, bit for bit
    assert {str(r): h for r, h in ended.items()} == simulated["model_sha256"]

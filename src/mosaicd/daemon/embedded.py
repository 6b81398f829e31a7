"""The barrier a node hosts, put together: the one module that imports both roles (`daemon/node/` knows the barrier
only as a `hosting.HostedBarrier`; `daemon/barrier/` knows no node).

`EmbeddedBarrier` is a `Barrier` and its `barrier_app` behind that interface; `hosting(evaluate)` builds one for a
node that turns out to be rank 0 of a --peer-list. `Peer` (the public `mosaicd.Peer`) and `run_node` (`mosaicd
node`) are the node role's, with that host given by default, as every user of them had it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from mosaic_proto import Layout
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.barrier.ending import end_failed, unheard
from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.daemon.barrier.routes import barrier_app
from mosaicd.daemon.hosting import BarrierHost
from mosaicd.daemon.node import peer as node_peer
from mosaicd.daemon.node import run as node_run
from mosaicd.settings import DaemonOptions, RunConfig, Settings

__all__ = ["EmbeddedBarrier", "Peer", "hosting", "run_node"]

Evaluate = Callable[[RunConfig, list[np.ndarray]], dict]


class EmbeddedBarrier:
    """A `Barrier` served by the node that hosts it (`hosting.HostedBarrier`); `barrier`: the barrier itself."""

    def __init__(self, run: RunConfig, options: DaemonOptions, evaluate: Evaluate | None = None) -> None:
        counted = {"expect_dns": None, "expect_settle": None}  # the peer list counts the nodes
        self.barrier = Barrier(run, options.model_copy(update=counted), evaluate=evaluate)

    def app(self) -> web.Application:
        return barrier_app(self.barrier)

    async def wait_done(self) -> None:
        await self.barrier.done.wait()

    def fail(self, reason: str) -> None:
        end_failed(self.barrier, reason)

    def unheard(self, own: int) -> list[int]:
        return unheard(self.barrier, own)


def hosting(evaluate: Evaluate | None = None) -> BarrierHost:
    """A host of `EmbeddedBarrier`s whose network evaluation is `evaluate` (None: final models only)."""
    return lambda run, options: EmbeddedBarrier(run, options, evaluate)


class Peer(node_peer.Peer):
    """The public `mosaicd.Peer`: Mosaic gossip for any training loop (`mosaicd.daemon.node.peer` shows its use),
    hosting the run's barrier where it is rank 0 of a --peer-list."""

    def __init__(self, options: DaemonOptions, model: Layout | Any = None, *, run: RunConfig | None = None,
                 evaluate: Evaluate | None = None, rejoining: bool = False, resume_rank: int | None = None) -> None:
        """As `mosaicd.daemon.node.peer.Peer`'s; `evaluate`: the network evaluation of the barrier it hosts."""
        super().__init__(options, model, run=run, host=hosting(evaluate), rejoining=rejoining,
                         resume_rank=resume_rank)


async def run_node(settings: Settings, task: Any = None) -> int:
    """`mosaicd.daemon.node.run.run_node`, hosting the barrier (with the run's network evaluation) where this node
    is rank 0 of a --peer-list."""
    return await node_run.run_node(settings, task, host=hosting(NetworkEvaluation(settings.data_dir, task)))

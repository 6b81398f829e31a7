"""The barrier a node hosts (rank 0 of a --peer-list serves it under /barrier), as the node role sees it: the one
interface through which `daemon/node/` reaches a barrier, so that it imports nothing from `daemon/barrier/`.

The real one is put together above both roles, in `mosaicd.daemon.embedded` (a `Barrier` and its `barrier_app`),
and handed to the node's `Peer` as a `BarrierHost`; `mosaicd.Peer` and `mosaicd node` give that one by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from mosaicd.daemon.http.auth import Secret
from mosaicd.settings import DaemonOptions, RunConfig

__all__ = ["BarrierHost", "HostedBarrier"]


class HostedBarrier(Protocol):
    """What a node does with the barrier it hosts: serve it, wait for the run's end, end the run failed, and see
    who has not heard that yet. The barrier starts and stops with its application (the node's server)."""

    def app(self) -> web.Application:
        """The barrier's HTTP API, mounted at /barrier on the node's server: its start-up starts the barrier, its
        clean-up stops it."""
        ...

    async def wait_done(self) -> None:
        """Returns once the barrier is done with the run: the final models collected (or the run ended, failed)."""
        ...

    def fail(self, reason: str) -> None:
        """End the run now, failed, saying `reason` to every member (the hosting node stops)."""
        ...

    def unheard(self, own: int) -> list[int]:
        """The live members other than `own` not told yet that the run failed."""
        ...


BarrierHost = Callable[[RunConfig, DaemonOptions, Secret], HostedBarrier]
"""Builds the barrier a node hosts, from the run's settings (the peer list's node count in), the node's options
and its secret (the one value the node resolved)."""

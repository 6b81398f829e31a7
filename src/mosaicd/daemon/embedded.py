"""The barrier a node hosts, put together: the one module that imports both roles (`daemon/node/` knows the barrier
only as a `hosting.HostedBarrier`; `daemon/barrier/` knows no node).

`EmbeddedBarrier` is a `Barrier` and its `barrier_app` behind that interface; `hosting(evaluate)` builds one for a
node that turns out to be rank 0 of a --peer-list. `Peer` (the public `mosaicd.Peer`) and `run_node` (`mosaicd
node`) are the node role's, with that host given by default, as every user of them had it.

The barrier's modules are imported only where one is hosted or served: a node that registers with a barrier
elsewhere (every compose node) never needs them, and on few cores each module a node imports before it registers
delays the run's start (bench/README.md, Speed 4 item 4).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from mosaic_proto import Layout
from mosaicd.daemon.hosting import BarrierHost
from mosaicd.daemon.http.auth import Secret
from mosaicd.daemon.node import peer as node_peer
from mosaicd.daemon.node import run as node_run
from mosaicd.settings import DaemonOptions, RunConfig, Settings

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier as RunBarrier

__all__ = ["Barrier", "EmbeddedBarrier", "Peer", "hosting", "run_node"]

Evaluate = Callable[[RunConfig, list[np.ndarray]], dict]


class EmbeddedBarrier:
    """A `Barrier` served by the node that hosts it (`hosting.HostedBarrier`); `barrier`: the barrier itself."""

    def __init__(self, run: RunConfig, options: DaemonOptions, secret: Secret, evaluate: Evaluate | None = None,
                 ) -> None:
        from mosaicd.daemon.barrier.barrier import Barrier as RunBarrier

        counted = {"expect_dns": None, "expect_settle": None}  # the peer list counts the nodes
        self.barrier = RunBarrier(run, options.model_copy(update=counted), secret=secret, evaluate=evaluate,
                                  members_return=True)  # stopped, rank 0 is started again with the others

    def app(self) -> web.Application:
        from mosaicd.daemon.barrier.routes import barrier_app

        return barrier_app(self.barrier)

    async def wait_done(self) -> None:
        await self.barrier.done.wait()

    def fail(self, reason: str) -> None:
        self.barrier.end_failed(reason)

    def unheard(self, own: int) -> list[int]:
        return self.barrier.unheard(own)


def hosting(evaluate: Evaluate | None = None) -> BarrierHost:
    """A host of `EmbeddedBarrier`s whose network evaluation is `evaluate` (None: final models only)."""
    return lambda run, options, secret: EmbeddedBarrier(run, options, secret, evaluate)


class Peer(node_peer.Peer):
    """The public `mosaicd.Peer`: Mosaic gossip for any training loop (`mosaicd.daemon.node.peer` shows its use),
    hosting the run's barrier where it is rank 0 of a --peer-list."""

    def __init__(self, options: DaemonOptions, model: Layout | Any = None, *, run: RunConfig | None = None,
                 evaluate: Evaluate | None = None, rejoining: bool = False, resume_rank: int | None = None,
                 secret: Secret | None = None, checkpoints: Sequence[int] | None = None) -> None:
        """As `mosaicd.daemon.node.peer.Peer`'s; `evaluate`: the network evaluation of the barrier it hosts;
        `secret`: the run's (`barrier.secret` of a `mosaicd.Barrier` in the same program), else --secret-file's;
        `checkpoints`: the rounds of this member's own checkpoints, where a peer list's run is resumed (the loop
        goes on from its checkpoint of `peer.resumed_at`)."""
        super().__init__(options, model, run=run, host=hosting(evaluate), rejoining=rejoining,
                         resume_rank=resume_rank, secret=secret, checkpoints=checkpoints)


async def run_node(settings: Settings, task: Any = None) -> int:
    """`mosaicd.daemon.node.run.run_node`, hosting the barrier (with the run's network evaluation) where this node
    is rank 0 of a --peer-list."""

    def host(run: RunConfig, options: DaemonOptions, secret: Secret) -> EmbeddedBarrier:
        from mosaicd.daemon.barrier.evaluator import NetworkEvaluation

        return EmbeddedBarrier(run, options, secret, NetworkEvaluation(settings.data_dir, task))

    return await node_run.run_node(settings, task, host=host)


class Barrier:
    """The public `mosaicd.Barrier`: a run's barrier served from your own program, for your own training loops.

        async with mosaicd.Barrier(settings) as barrier:     # serves it; `barrier.url` is what Peers register with
            ...                                               # run the Peers: here with secret=barrier.secret
        # leaving the block waits for the run's end: summary.json written (`barrier.summary`)

    `settings`: a `mosaicd.Settings` (the run's: nodes, rounds, K, ...; where it listens; --out). It evaluates no
    node model (each node's loop reports its own metrics, `Peer.gossip(metrics=...)`). The run is an own loop's
    (`own_loop`): its task, as summary.json, `mosaicd runs`, status and MLflow show it, is `name` (default "own
    loop"); `evaluate` gives it the average model's metric: a function of a flat float32 vector returning metrics
    by name (the first leads; `test_loss` too where given), or a `mosaicd.Task`. Settings with an explicit `task`
    (a task the barrier can build) keep it and evaluate the average model with it, as `mosaicd barrier --task`.
    An exception or Ctrl-C inside the block ends the run as failed, saying why (the journal stays at the last
    decision: `mosaicd barrier` with the same --out resumes it).
    """

    def __init__(self, settings: Settings, *, name: str | None = None, evaluate: Any = None) -> None:
        if not settings.own_loop and "task" not in settings.model_fields_set:
            settings = settings.model_validate({**settings.model_dump(exclude_unset=True), "own_loop": True,
                                                **({"task": name} if name else {})})
        elif name is not None and name != settings.task:
            raise ValueError(f"mosaicd.Barrier(name={name!r}): the settings name the task {settings.task!r}")
        if evaluate is not None and not settings.own_loop:
            raise ValueError("mosaicd.Barrier(evaluate=...) is for an own loop's run: the settings' task "
                             f"{settings.task!r} evaluates the average model")
        self.settings, self._evaluate = settings, evaluate
        # the run's secret: --secret-file's, none with --insecure, else a new one in memory that this program
        # hands its Peers (`mosaicd.Peer(settings, model, secret=barrier.secret)`)
        self.secret = Secret.of(settings) if settings.secret_file or settings.insecure else Secret.new()
        self._barrier: RunBarrier | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def out(self) -> Any:
        return self.settings.out

    @property
    def summary(self) -> dict[str, Any] | None:
        """The run's summary.json as it is now (None before the first round)."""
        from mosaicd.rundir import read_summary

        return read_summary(self.settings.out)

    async def __aenter__(self) -> Barrier:
        from mosaicd.daemon.barrier.barrier import Barrier as RunBarrier
        from mosaicd.daemon.barrier.console import local_url
        from mosaicd.daemon.barrier.evaluator import LoopEvaluation, NetworkEvaluation
        from mosaicd.daemon.barrier.routes import barrier_app
        from mosaicd.daemon.barrier.run import evaluates
        from mosaicd.daemon.http.server import serve
        from mosaicd.daemon.http.tls import scheme

        s = self.settings
        evaluate = NetworkEvaluation(s.data_dir) if evaluates(s) else None
        if self._evaluate is not None:
            evaluate = LoopEvaluation(self._evaluate)
        self._barrier = RunBarrier(s.run_config(), s.daemon_options(), secret=self.secret, evaluate=evaluate,
                                   hold_out=True)
        try:
            self._runner, port = await serve(barrier_app(self._barrier), s)
        except BaseException:
            self._release()
            raise
        self.url = local_url(s.host, port, scheme(s))
        return self

    async def wait(self) -> dict[str, Any] | None:
        """Until the run ended (finished or failed): its summary."""
        assert self._barrier is not None, "use it as `async with mosaicd.Barrier(settings) as barrier`"
        await self._barrier.done.wait()
        return self.summary

    @property
    def finished(self) -> bool:
        return self._barrier is not None and self._barrier.done.is_set() and self._barrier.failure is None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        barrier = self._barrier
        assert barrier is not None
        try:
            if exc is None:
                await self.wait()
            elif not barrier.done.is_set():
                barrier.interrupt()  # its open long polls are answered now, so the server stops at once
                why = "Ctrl-C" if isinstance(exc, KeyboardInterrupt | asyncio.CancelledError) else \
                    f"{type(exc).__name__}: {exc}"
                barrier.interrupted(why)
        finally:
            if self._runner is not None:
                await self._runner.cleanup()
            self._release()

    def _release(self) -> None:
        from mosaicd.rundir import BARRIER_LOCK, release

        release(self.settings.out / BARRIER_LOCK)

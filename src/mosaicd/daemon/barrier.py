"""The barrier process around `mosaic_proto.BarrierState`: long polls, the clock, snapshots, outputs.

`BarrierState` decides (ranks, releases, stragglers, drops); this adapter feeds it requests and the
clock, tells waiting nodes what it decided, and does the I/O that follows a release, off the round's
critical path: it writes the round's node rows, then pulls the nodes' model snapshots at evaluation
rounds and evaluates them in a worker thread while the next rounds go on. Nodes keep their last
`SNAPSHOTS_KEPT` snapshots, so a collection must end before the release that would drop its snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from mosaic_proto import BarrierError, BarrierPhase, BarrierState, Release, received_counts
from mosaicd.daemon.auth import Keyring, load_secret
from mosaicd.daemon.barrier_metrics import BarrierMetrics
from mosaicd.daemon.evaluator import NetworkEvaluator
from mosaicd.daemon.membership import resolve_all
from mosaicd.logs import get_logger
from mosaicd.outputs import SUMMARY_KEYS, RunRecorder, is_eval_round
from mosaicd.settings import DaemonOptions, RunConfig

SNAPSHOTS_KEPT = 3  # as many as a node keeps (peer.SNAPSHOTS_KEPT)


def phase_means(closed: dict[int, tuple[float, dict[str, Any] | None]]) -> dict[str, float]:
    """Mean seconds per phase over the members that arrived: train, send, aggregate (their reports), wait (the
    barrier's clock)."""
    seconds: dict[str, list[float]] = {"train": [], "send": [], "wait": [], "aggregate": []}
    for wait, report in closed.values():
        seconds["wait"].append(wait)
        for phase in ("train", "send", "aggregate"):
            value = (report or {}).get(f"{phase}_s")
            if isinstance(value, int | float):
                seconds[phase].append(float(value))
    return {f"{phase}_s": round(float(np.mean(v)), 6) for phase, v in seconds.items() if v}


class Barrier:
    def __init__(self, run: RunConfig, options: DaemonOptions, *,
                 evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None = None) -> None:
        """`evaluate(run, vectors)`: the network metrics of the models (None: collect final models only)."""
        self.run, self.options = run, options
        self.state = BarrierState(rounds=run.rounds, round_deadline=options.round_deadline,
                                  drop_after=options.drop_after, expected=0 if options.expect_dns else run.nodes)
        self.log = get_logger(role="barrier", run=run.run_id)
        self.recorder = RunRecorder(options.out, {**options.model_dump(mode="json"), **run.model_dump(mode="json")},
                                    mode="cluster")
        self.metrics = BarrierMetrics(run)
        secret = load_secret(options.secret_file)
        self.keyring = Keyring(secret) if secret else None
        self.register_status = 503  # 422 when the run as registered is invalid: retrying cannot help
        self.registered = asyncio.Event()
        self.done = asyncio.Event()
        self.published: dict[int, dict[str, Any]] = {}
        self.evaluator = NetworkEvaluator(options, self.keyring, evaluate, self.recorder, self.metrics, self.log)
        self._published = asyncio.Event()
        self._collections: dict[int, asyncio.Task] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.history: list[dict[str, Any]] = []  # per released round: duration, mean phase seconds, stragglers
        self._released_at: float | None = None
        self._logged_eval: int | None = None

    def app(self) -> web.Application:
        from mosaicd.daemon.barrier_routes import barrier_app

        return barrier_app(self)

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def start(self) -> None:
        self._spawn(self._registration_deadline())
        if self.options.expect_dns:
            self._spawn(self._watch_dns())
        self.metrics.expected.set(self.state.expected)

    async def stop(self) -> None:
        if self._timer:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- registration ------------------------------------------------------------------------------
    async def register(self, address: str) -> dict[str, Any]:
        """Long poll until the roster is made: {"rank", "members", "run"}. BarrierError if refused."""
        rank = self.state.register(address, self.now())
        if rank is None:
            self.metrics.registered.set(len(self.state.pending))
            self.log.info("registered", address=address, registered=len(self.state.pending),
                          expected=self.state.expected)
            self._maybe_close()
            try:
                await asyncio.wait_for(self.registered.wait(), timeout=self.options.register_deadline)
            except TimeoutError:
                pass
            rank = self.state.register(address, self.now())
            if rank is None:
                raise BarrierError("registration_failed", self.state.failure or "registration did not complete")
        return {"rank": rank, "members": list(self.state.addresses), "run": self.run.model_dump(mode="json")}

    def _maybe_close(self) -> None:
        if not self.state.complete:
            return
        count = len(self.state.pending)
        try:  # the node count may be known only now (DNS): check the run as it will be
            self.run = self.run.with_nodes(count)
        except ValueError as exc:
            dns = self.options.expect_dns
            counted = f" ({dns} resolved to that many addresses)" if dns else ""
            return self._fail(f"{count} nodes registered{counted}, but the run is invalid with them: {exc}", 422)
        self.state.close(self.now())
        self.recorder.settings["nodes"] = count
        self.metrics.members.set(count)
        self.log.info("registration_closed", members=count)
        self.registered.set()

    def _fail(self, reason: str, status: int) -> None:
        self.state.fail(reason)
        self.register_status = status
        self.log.error("registration_failed", detail=reason)
        self.recorder.fail(f"registration failed: {reason}")
        self.registered.set()
        self.done.set()

    async def _registration_deadline(self) -> None:
        await asyncio.sleep(self.options.register_deadline)
        if self.state.phase is BarrierPhase.REGISTERING:
            self._fail(f"registration deadline ({self.options.register_deadline:g}s) passed with "
                       f"{len(self.state.pending)} of {self.state.expected or '?'} nodes", 503)

    async def _watch_dns(self) -> None:
        """Count nodes as the addresses the service name resolves to, once the count holds still."""
        stable_since, last = self.now(), -1
        while self.state.phase is BarrierPhase.REGISTERING:
            count = len(await asyncio.to_thread(resolve_all, self.options.expect_dns))
            if count != last:  # still moving (replicas starting): nothing is counted until it holds still
                last, stable_since = count, self.now()
                self.state.expected = 0
            if count and self.now() - stable_since >= self.options.dns_settle:
                self.state.expected = count
                self._maybe_close()
            self.metrics.expected.set(self.state.expected)
            await asyncio.sleep(0.5)

    # -- rounds ------------------------------------------------------------------------------------
    async def arrive(self, rank: int, round: int, report: dict[str, Any] | None) -> dict[str, Any]:
        """Long poll until `round` is released: the release as JSON. BarrierError if refused."""
        retry = round < self.state.round  # a round released already: its release again, recorded once
        release = self.state.arrive(rank, round, self.now(), report)
        if release is not None and not retry:
            await self._publish(release)
        elif self._timer is None and self.state.deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self.state.deadline, self._on_deadline)
        limit = self.options.round_deadline + 60 + 2 * self.options.request_timeout
        while round not in self.published:
            event = self._published
            try:
                await asyncio.wait_for(event.wait(), timeout=limit)
            except TimeoutError:
                raise BarrierError("barrier_timeout", f"round {round} was not released in time") from None
        return self.published[round]

    def _on_deadline(self) -> None:
        self._timer = None
        release = self.state.tick(self.now())
        if release is not None:
            self._spawn(self._publish(release))

    async def _publish(self, release: Release) -> None:
        """Record what the release decided, then tell the waiting nodes (after any collection whose
        snapshots the nodes would drop once they move on)."""
        if self._timer:
            self._timer.cancel()
            self._timer = None
        t = release.round
        self._record(release)
        if t >= 1 and is_eval_round(t - 1, self.run):
            live = {r: self.state.addresses[r] for r in self.state.live}
            self._collections[t - 1] = self._spawn(self.evaluator.collect(self.run, t - 1, live, release.finished))
        for e in [e for e in self._collections if e + SNAPSHOTS_KEPT <= t or release.finished]:
            await self._collections.pop(e)
        if release.finished:
            await self.evaluator.drain()
            self.recorder.finish(self.evaluator.final_vectors, members=list(release.members),
                                 dropped=list(release.dropped), addresses=list(self.state.addresses),
                                 events=[e.to_json() for e in self.state.events])
            self.done.set()
        self.published[t] = release.to_json()
        self.published.pop(t - SNAPSHOTS_KEPT, None)
        self._published.set()
        self._published = asyncio.Event()

    def _record(self, release: Release) -> None:
        closed = self.state.closed[release.round]
        received = received_counts({r: report for r, (_, report) in closed.items()})
        if not release.finished:
            for rank, (wait_s, report) in closed.items():
                if report is not None:
                    messages, fragments, nbytes = received.get(rank, (0, 0, 0))
                    self.recorder.node_round({**report, "node": rank, "wait_s": round(wait_s, 6),
                                              "messages_in": messages, "fragments_in": fragments,
                                              "bytes_in": nbytes})
        now = self.now()
        duration = now - self._released_at if self._released_at is not None else None
        self._released_at = now
        phases = phase_means(closed)
        self.history.append({"round": release.round, "duration_s": None if duration is None else round(duration, 6),
                             **phases, "members": len(release.members), "stragglers": list(release.stragglers),
                             "dropped": list(release.dropped)})
        self.metrics.released(release, now)
        news = {}
        latest = self.evaluator.last_metrics
        if latest and latest.get("round") != self._logged_eval:
            self._logged_eval = latest.get("round")
            news = {"evaluated_round": self._logged_eval, **{k: latest.get(k) for k in SUMMARY_KEYS}}
        log = self.log.warning if release.stragglers else self.log.info
        log("released", round=release.round, duration_s=self.history[-1]["duration_s"], members=len(release.members),
            stragglers=list(release.stragglers), dropped=list(release.dropped), finished=release.finished, **news)

"""`Peer`: Mosaic gossip for any training loop. The built-in node daemon is one user of it.

    async with Peer(options, model) as peer:             # serve, register: rank, members and the run
        for t in range(peer.run.rounds):
            train(model)
            await peer.gossip(model)                      # send fragments, barrier, aggregate
        await peer.finish()                               # let the barrier collect the final models

`options` says how this process listens and reaches the others (`DaemonOptions`, or a whole `Settings`);
the run itself (K, s, sampler, seed, ...) comes from the barrier at registration: `peer.run`. A peer that
registers during a run (it restarted, or joins late) starts at `peer.round` > 0, with `peer.download_model()`
or its own checkpoint.

A round's sends are bounded by its budget (--round-deadline from the round's release, less a margin for the
arrival): a peer that does not take its fragments in time costs only those fragments, never the sender's
place in the round.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from mosaic_proto import (
    CONTENT_TYPE,
    Fragmentation,
    Layout,
    OutgoingMessage,
    PeerSampler,
    Reason,
    RoundState,
    WireError,
)
from mosaicd.daemon.barrier.barrier import Barrier
from mosaicd.daemon.http.auth import REGISTER_RUN, Keyring, check_listen, load_secret, signer
from mosaicd.daemon.http.client import Client, HttpError
from mosaicd.daemon.http.membership import embedded_barrier_url, listed_addresses, own_address
from mosaicd.daemon.http.model_codec import decode_model
from mosaicd.daemon.http.server import serve
from mosaicd.daemon.http.tls import client_context, scheme
from mosaicd.daemon.node.metrics import NodeMetrics
from mosaicd.logs import get_logger
from mosaicd.settings import DaemonOptions, RunConfig

SNAPSHOTS_KEPT = 3


class PeerDropped(RuntimeError):
    """The barrier dropped this node from the run (it missed too many rounds, or fell too far behind)."""
_STATUS_OF_REASON = {Reason.TOO_LARGE: 413, Reason.STALE_ROUND: 409, Reason.FUTURE_ROUND: 409,
                     Reason.DUPLICATE_FRAGMENT: 409, Reason.UNKNOWN_SENDER: 403, Reason.WRONG_RUN: 409,
                     Reason.ROUND_CLOSED: 409, Reason.SENDER_MISMATCH: 403, Reason.UNPLANNED_FRAGMENT: 403}


def _embedded_barrier(options: DaemonOptions, run: RunConfig | None, evaluate: Any) -> Barrier | None:
    """With --peer-list, rank 0 (the first address in sorted order) also serves the barrier."""
    addresses = listed_addresses(options)
    if addresses[0] != own_address(options, options.port) or options.barrier_url:
        return None
    if run is None:
        raise ValueError("rank 0 of a --peer-list hosts the barrier: it needs the run's settings")
    return Barrier(run.with_nodes(len(addresses)), options.model_copy(update={"expect_dns": None}), evaluate=evaluate)


def send_budget(options: DaemonOptions, elapsed: float) -> float:
    """Seconds the send phase may take when `elapsed` seconds of the round (from its release) have passed: the
    rest of --round-deadline less a margin for the arrival (a tenth of it, 1 s to half of it), at least 0.5 s."""
    deadline = options.round_deadline
    margin = min(max(0.1 * deadline, 1.0), 0.5 * deadline)
    return max(deadline - margin - elapsed, 0.5)


async def send_all(client: Client, state: RoundState, messages: list[OutgoingMessage], urls: list[str],
                   log: Any, budget: float = math.inf) -> dict[int, list[int]]:
    """POST every message concurrently, for at most `budget` seconds; peer -> [fragments, bytes] of those taken.
    The others are marked unsent in the round's report: a peer that does not take its fragments is not fatal.
    A send that takes over a quarter of the budget (and a second) is logged with its peer and time."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def send(message: OutgoingMessage, url: str) -> bool:
        try:
            await client.request("POST", url, data=message.payload, round=state.round,
                                 headers={"Content-Type": CONTENT_TYPE})
            ok = True
        except HttpError as exc:
            ok = exc.status == 409 and "duplicate_fragment" in exc.detail  # an earlier attempt got there
            if not ok:
                log.warning("send_failed", round=state.round, peer=message.peer, status=exc.status, error=exc.detail)
        took = loop.time() - started
        if took > max(budget / 4, 1.0):
            log.warning("slow_send", round=state.round, peer=message.peer, url=url, seconds=round(took, 3),
                        bytes=len(message.payload), budget_s=round(budget, 3), taken=ok)
        return ok

    tasks = [asyncio.ensure_future(send(m, u)) for m, u in zip(messages, urls, strict=True)]
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=budget)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    delivered: dict[int, list[int]] = {}
    for message, url, task in zip(messages, urls, tasks, strict=True):
        if not task.cancelled() and task.result():
            delivered[message.peer] = [len(message.fragments), len(message.payload)]
            continue
        if task.cancelled():
            log.warning("send_abandoned", round=state.round, peer=message.peer, url=url, budget_s=round(budget, 3),
                        detail="the peer did not take its fragments within the round's budget (--round-deadline)")
        state.mark_unsent(message)
    return delivered


async def live_model(client: Client, options: DaemonOptions, addresses: list[str], peers: list[int],
                     layout: Layout | None, log: Any) -> np.ndarray:
    """The newest model (GET /v1/model) of the first of `peers` that gives one of this `layout`."""
    for rank in peers:
        url = f"{scheme(options)}://{addresses[rank]}/v1/model"
        try:
            _, body, _ = await client.request("GET", url)
            model = decode_model(body)
        except (HttpError, ValueError) as exc:
            log.warning("model_download_failed", peer=rank, error=str(exc))
            continue
        if layout is not None and model["layout"] != layout:
            log.warning("model_download_failed", peer=rank, error="another model layout")
            continue
        log.info("model_downloaded", peer=rank, round=model["round"])
        return model["vector"]
    raise RuntimeError(f"no live peer of {peers} gave its model")


async def arrive(client: Client, barrier_url: str, rank: int, t: int, report: dict[str, Any] | None, run: RunConfig,
                 options: DaemonOptions, log: Any) -> dict[str, Any]:
    """Long poll at the barrier until round t is released; while the barrier is unreachable (restarting), retry
    for --barrier-grace seconds. PeerDropped if the barrier dropped this node or it fell too far behind."""
    timeout = options.round_deadline + 2 * options.request_timeout + (600 if t >= run.rounds else 60)
    try:
        return await client.post_json_within(f"{barrier_url}/v1/arrive", {"rank": rank, "round": t, "report": report},
                                              timeout=timeout, grace=options.barrier_grace, flag="--barrier-grace",
                                              log=log, round=t)
    except HttpError as exc:
        if exc.status == 410:
            raise PeerDropped(f"node {rank} was dropped from the run: {exc.detail}") from None
        if exc.status == 409 and "stale_round" in exc.detail:  # it fell behind further than the barrier keeps
            raise PeerDropped(f"node {rank} fell behind the run: {exc.detail}") from None
        raise


class Peer:
    def __init__(self, options: DaemonOptions, model: Layout | Any = None, *, run: RunConfig | None = None,
                 evaluate: Callable[[list[np.ndarray]], dict] | None = None, rejoining: bool = False) -> None:
        """`model`: the model's Layout, or a torch module whose float state is the gossiped vector; None to
        give it after registration (`set_model`). `run` is needed only where this peer hosts the barrier
        (rank 0 of a --peer-list); `evaluate` is that barrier's network evaluation. `rejoining`: this process
        takes over from an earlier one (it has its checkpoint): fragments of the round it lost are refused
        at once instead of held until it is ready."""
        self.options, self.model, self.evaluate = options, model, evaluate
        self.run: RunConfig = run  # type: ignore[assignment]  # the barrier's, once registered
        self.log = get_logger(role="node")
        self.rank, self.round, self.phase = -1, 0, "starting"
        self.addresses: list[str] = []
        self.members: list[int] = []
        self.layout: Layout | None = None
        self.state: RoundState | None = None
        self.snapshots: dict[int, np.ndarray] = {}
        self.vector: np.ndarray | None = None
        self.last_report: dict[str, Any] | None = None
        self.loss = math.nan
        self.finished = False
        self.barrier: Barrier | None = None
        self.barrier_url = options.barrier_url
        self.address = ""
        self.metrics = NodeMetrics()
        self._ready = asyncio.Event()
        self._registered = asyncio.Event()
        secret = load_secret(options.secret_file)
        self.keyring = Keyring(secret) if secret else None
        self._aggregate_s = 0.0
        self._rejoining = rejoining
        self._opened = 0.0  # when this peer heard of the open round's start (the loop's clock)
        self._refused: Counter[str] = Counter()  # refusals not reported yet (some come after an arrival)
        self._runner: web.AppRunner | None = None
        self._client = Client(options.request_timeout, options.retries, signer=signer(
            lambda: self.keyring.credentials(self.run.run_id if self.rank >= 0 else REGISTER_RUN),
            lambda: str(self.rank) if self.rank >= 0 else self.address) if self.keyring else None,
            ssl_context=client_context(options))

    # -- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> Peer:
        await self._client.__aenter__()
        try:
            await self._serve()
            await self._register()
            if self.model is not None:
                self.set_model(self.model)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None
        await self._client.__aexit__()

    async def _serve(self) -> None:
        from mosaicd.daemon.barrier.routes import barrier_app
        from mosaicd.daemon.node.routes import node_app

        app = node_app(self)
        options = self.options
        check_listen(options, self.keyring)
        if options.peer_list is not None:
            self.barrier_url = self.barrier_url or embedded_barrier_url(options)
            self.barrier = _embedded_barrier(options, self.run, self.evaluate)
            if self.barrier is not None:
                app.add_subapp("/barrier", barrier_app(self.barrier))
        if not self.barrier_url:
            raise ValueError("--barrier-url or --peer-list is needed to find the other nodes")
        self._runner, port = await serve(app, options)
        self.address = own_address(options, port)
        self.log = self.log.bind(address=self.address)

    async def _register(self) -> None:
        self.phase = "rejoining" if self._rejoining else "registering"
        reply = await self._client.post_json_until(f"{self.barrier_url}/v1/register", {"address": self.address},
                                                   self.options.register_deadline, "--register-deadline", self.log)
        self._opened = asyncio.get_running_loop().time()
        self.rank, self.addresses = int(reply["rank"]), list(reply["members"])
        self.run = RunConfig.model_validate(reply["run"])
        self.round = int(reply.get("round", 0))
        self.members = [int(m) for m in reply.get("live", range(len(self.addresses)))]
        self.log = self.log.bind(node=self.rank, run=self.run.run_id)
        self.phase = "registered"
        self._registered.set()
        self.log.info("registered", rank=self.rank, members=len(self.members), round=self.round)

    async def rejoin(self) -> None:
        """Register again after the barrier dropped this peer: a member from the next round boundary on
        (`self.round`), with the membership of that round."""
        self._rejoining, self.rank = True, -1  # it registers as its address again, signed as one that registers
        try:
            await self._register()
        finally:
            self._rejoining = False
        self.state = self._round_state(self.round, self.members, ())
        self.phase = "ready"

    async def download_model(self) -> np.ndarray:
        """The newest model of a live peer, for a peer that starts after round 0 without a fresh checkpoint."""
        return await live_model(self._client, self.options, self.addresses, [m for m in self.members if m != self.rank],
                                self.layout, self.log)

    def set_model(self, model: Layout | Any) -> None:
        """The model's layout, once the run is known; from now on fragments are taken."""
        if not isinstance(model, Layout):
            from mosaicd.learning.tasks.torch_util import layout_of
            model = layout_of(model)
        self.layout = model
        run = self.run
        self.fragmentation = Fragmentation.build(model, run.fragments, run.seed, run.strategy)
        self.sampler = PeerSampler(run.sampler, run.fanout, run.seed)
        self.state = self._round_state(self.round, self.members, ())
        self.phase = "ready"
        self._ready.set()
        self.log.info("ready", dim=model.dim, fingerprint=self.fragmentation.fingerprint.hex())

    def _round_state(self, round: int, members: list[int], early: tuple) -> RoundState:
        state = RoundState(node=self.rank, round=round, members=members, fragmentation=self.fragmentation,
                           sampler=self.sampler, run_id=self.run.run_id, max_bytes=self.options.max_body_bytes,
                           early=early, planned_only=True, max_norm=self.options.max_norm,
                           **self.run.round_options(self.rank, round, self.vector),
                           on_refused=lambda why, n: (self.metrics.counted(why, n), self._refused.update({why: n})))
        self.metrics.taken(state.report)  # messages buffered for this round were accepted (or refused) just now
        self._refused.update(state.report.refused)
        return state

    # -- one round: train (the caller) -> fragment -> send -> barrier -> aggregate ------------------
    async def gossip(self, local: np.ndarray | Any, *, loss: float = math.nan, train_s: float = 0.0) -> np.ndarray:
        """Send this round's fragments of `local`, wait at the barrier, and return the aggregated vector.

        `local` is a flat float32 vector, or a torch module: then its state is gossiped and overwritten in place.
        """
        if not isinstance(local, np.ndarray) and hasattr(local, "state_dict"):
            from mosaicd.learning.tasks.torch_util import load_vector, to_vector
            vector = await self.gossip(to_vector(local), loss=loss, train_s=train_s)
            load_vector(local, vector)
            return vector
        state = self.state
        if state is None or self.finished:
            raise RuntimeError("gossip() needs a registered, unfinished peer with a model (set_model)")
        t = state.round
        self.phase = "sending"
        started = time.perf_counter()
        messages = state.outgoing(np.asarray(local, dtype=np.float32))
        urls = [f"{scheme(self.options)}://{self.addresses[m.peer]}/v1/fragments" for m in messages]
        budget = send_budget(self.options, asyncio.get_running_loop().time() - self._opened)
        delivered = await send_all(self._client, state, messages, urls, self.log, budget)
        report = {**state.report.to_json(), "refused": dict(self._refused), "loss": loss, "train_s": round(train_s, 6),
                  "send_s": round(time.perf_counter() - started, 6), "aggregate_s": round(self._aggregate_s, 6),
                  "delivered": delivered}
        self._refused.clear()
        self.phase = "barrier"
        waited = time.perf_counter()
        release = await self._arrive(t, report)
        self.phase = "aggregating"
        aggregating = time.perf_counter()
        outcome = state.finish()
        self.vector = self.snapshots[t] = outcome.vector
        self.snapshots.pop(t - SNAPSHOTS_KEPT, None)
        self._opened = asyncio.get_running_loop().time()
        for rank, address in sorted((int(r), a) for r, a in (release.get("addresses") or {}).items()):
            if rank == len(self.addresses):  # a node that joined: the next free rank
                self.addresses.append(address)
        self.members = [int(m) for m in release["members"]]
        if self.rank not in self.members:
            raise PeerDropped(f"node {self.rank} was dropped from the run after round {t}")
        self.state = self._round_state(t + 1, self.members, outcome.early)
        self._aggregate_s = time.perf_counter() - aggregating
        self.loss = loss
        self.last_report = {**report, **outcome.report.to_json(), "refused": report["refused"],
                            "wait_s": round(aggregating - waited, 6), "stragglers": release.get("stragglers", [])}
        self.metrics.sent(state.report)
        self.metrics.round_done(t + 1, loss, self.last_report)
        self.round = t + 1
        self.phase = "idle"
        return outcome.vector

    async def _arrive(self, t: int, report: dict[str, Any] | None) -> dict[str, Any]:
        return await arrive(self._client, self.barrier_url, self.rank, t, report, self.run, self.options, self.log)

    async def finish(self) -> None:
        """Tell the barrier this node is done; returns once the barrier has collected the final models."""
        self.state = None
        await self._arrive(self.round, None)
        self.finished = True
        self.phase = "done"

    # -- what the routes ask -----------------------------------------------------------------------------
    async def run_of(self) -> str | None:
        """The run whose key signs requests to this node, once it knows it (waits up to a request timeout)."""
        if not self._registered.is_set():
            try:
                await asyncio.wait_for(self._registered.wait(), self.options.request_timeout)
            except TimeoutError:
                return None
        return self.run.run_id

    async def receive(self, body: bytes, sender: str | None = None) -> tuple[int, dict[str, Any]]:
        """One fragment message: (HTTP status, JSON answer). Waits (up to a request timeout) until ready.
        `sender`: the member the request's signature proved (None without a cluster secret)."""
        if self.phase == "rejoining":
            return 503, {"reason": "not_ready", "detail": "node is rejoining the run"}
        if self.state is None and not self.finished:
            try:
                await asyncio.wait_for(self._ready.wait(), self.options.request_timeout)
            except TimeoutError:
                pass
        state = self.state  # read after the wait: the round may have moved on meanwhile
        if state is None:
            return (409, {"reason": "finished", "detail": "node is done"}) if self.finished else \
                (503, {"reason": "not_ready", "detail": f"node is {self.phase}"})
        before = state.report.fragments_in
        try:
            receipt = state.receive(body, sender=None if sender is None else int(sender) if sender.isdigit()
                                    else -1)
        except WireError as exc:
            self.metrics.refused(exc.reason)
            self._refused[exc.reason.value] += 1
            return _STATUS_OF_REASON.get(exc.reason, 400), exc.to_json()
        if receipt.value == "accepted":  # buffered ones are counted when their round's state takes them
            self.metrics.accepted(len(body), state.report.fragments_in - before)
        return 200, {"status": receipt.value, "round": state.round}

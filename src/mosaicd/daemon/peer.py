"""`Peer`: Mosaic gossip for any training loop. The built-in node daemon is one user of it.

    async with Peer(settings, layout) as peer:           # serve, register, learn rank and members
        vector = initial_vector
        for t in range(settings.rounds):
            vector = await peer.gossip(train(vector))     # send fragments, barrier, aggregate
        await peer.finish()                               # let the barrier collect the final models
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

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
from mosaicd.daemon.barrier import Barrier
from mosaicd.daemon.http import Client, HttpError, bad_request, healthz, json_error, json_errors, metrics_handler
from mosaicd.daemon.membership import read_peer_list
from mosaicd.daemon.model_codec import encode_model
from mosaicd.logs import get_logger
from mosaicd.settings import Settings

SNAPSHOTS_KEPT = 3
_STATUS_OF_REASON = {Reason.TOO_LARGE: 413, Reason.STALE_ROUND: 409, Reason.FUTURE_ROUND: 409,
                     Reason.DUPLICATE_FRAGMENT: 409, Reason.UNKNOWN_SENDER: 403, Reason.WRONG_RUN: 409,
                     Reason.ROUND_CLOSED: 409}


class PeerDropped(RuntimeError):
    """The barrier dropped this node from the run (it missed too many rounds)."""


def embedded_barrier_url(settings: Settings) -> str:
    """With --peer-list, rank 0 (the first address in sorted order) also serves the barrier under /barrier."""
    assert settings.peer_list is not None
    return f"http://{read_peer_list(settings.peer_list)[0]}/barrier"


def own_address(settings: Settings, port: int) -> str:
    """The address peers use to reach this node: --advertise, else the listening host, else (when listening
    on every interface) the local IP of the route towards the barrier."""
    if settings.advertise:
        return settings.advertise
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = route_ip(settings.barrier_url or (f"http://{read_peer_list(settings.peer_list)[0]}"
                                                 if settings.peer_list else None))
    return f"{host}:{port}"


def listed_addresses(settings: Settings) -> list[str]:
    """The --peer-list addresses in rank order; a ValueError naming --peer-list if this node is not among them."""
    assert settings.peer_list is not None
    addresses = read_peer_list(settings.peer_list)
    me = own_address(settings, settings.port)
    if me not in addresses:
        raise ValueError(f"--peer-list {settings.peer_list}: this node's address {me} is not listed "
                         f"(set --advertise host:port to the line that names this node)")
    return addresses


def route_ip(url: str | None) -> str:
    """The local IP the kernel would use to reach `url`'s host (a UDP connect sends nothing)."""
    from urllib.parse import urlsplit

    target = urlsplit(url).hostname if url else None
    if not target:
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(target), 9))
        return sock.getsockname()[0]


class Peer:
    def __init__(self, settings: Settings, layout: Layout | Any, *, evaluate: Any = None) -> None:
        """`layout` is the model's Layout, or a torch module whose float state is the gossiped vector."""
        if not isinstance(layout, Layout):
            from mosaicd.learning.tasks.torch_util import layout_of
            layout = layout_of(layout)
        self.settings, self.layout, self.evaluate = settings, layout, evaluate
        self.log = get_logger(role="node", run=settings.run_id)
        self.rank = -1
        self.round = 0
        self.phase = "starting"
        self.addresses: list[str] = []
        self.members: list[int] = []
        self.state: RoundState | None = None
        self.fragmentation: Fragmentation | None = None
        self.snapshots: dict[int, np.ndarray] = {}
        self.vector: np.ndarray | None = None
        self.last_report: dict[str, Any] | None = None
        self.evaluation: dict[str, Any] | None = None
        self.loss = math.nan
        self.finished = False
        self.barrier: Barrier | None = None
        self.barrier_url = settings.barrier_url
        self.address = ""
        self._runner: web.AppRunner | None = None
        self._client = Client(settings.request_timeout, settings.retries)
        self._metrics()

    def _metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_round = Gauge("mosaic_round", "current round", registry=r)
        self.m_bytes_out = Counter("mosaic_bytes_sent", "fragment bytes sent", registry=r)
        self.m_bytes_in = Counter("mosaic_bytes_received", "fragment bytes accepted", registry=r)
        self.m_frags_out = Counter("mosaic_fragments_sent", "fragments sent", registry=r)
        self.m_frags_in = Counter("mosaic_fragments_received", "fragments accepted", registry=r)
        self.m_msgs_in = Counter("mosaic_messages_received", "messages accepted", registry=r)
        self.m_refused = Counter("mosaic_messages_refused", "messages refused", ["reason"], registry=r)
        self.m_unsent = Counter("mosaic_fragments_unsent", "fragments the transport gave up on", registry=r)
        self.m_phase = Gauge("mosaic_round_phase_seconds", "time spent per phase in the last round", ["phase"],
                             registry=r)
        self.m_loss = Gauge("mosaic_train_loss", "training loss of the last round", registry=r)
        self.m_eval = Gauge("mosaic_eval", "latest evaluation of this node's model", ["metric"], registry=r)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> Peer:
        await self._client.__aenter__()
        try:
            await self._serve()
            await self._register()
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

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors], client_max_size=self.settings.max_body_bytes)
        app.add_routes([
            web.post("/v1/fragments", self.handle_fragments),
            web.get("/v1/status", self.handle_status),
            web.get("/v1/model", self.handle_model),
            web.get("/metrics", metrics_handler(self.registry)),
            web.get("/healthz", healthz),
        ])
        return app

    async def _serve(self) -> None:
        app = self.app()
        settings = self.settings
        if settings.peer_list is not None:
            addresses = listed_addresses(settings)
            me = own_address(settings, settings.port)
            self.barrier_url = self.barrier_url or embedded_barrier_url(settings)
            if addresses[0] == me and not settings.barrier_url:
                self.barrier = Barrier(settings.model_copy(update={"nodes": len(addresses), "expect_dns": None}),
                                       evaluate=self.evaluate)
                app.add_subapp("/barrier", self.barrier.app())
        if not self.barrier_url:
            raise ValueError("--barrier-url or --peer-list is needed to find the other nodes")
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, settings.host, settings.port)
        await site.start()
        port = self._runner.addresses[0][1] if settings.port == 0 else settings.port
        self.address = own_address(settings, port)
        self.log = self.log.bind(address=self.address)

    async def _register(self) -> None:
        self.phase = "registering"
        reply = await self._client.post_json(f"{self.barrier_url}/v1/register", {"address": self.address},
                                             timeout=self.settings.register_deadline + 30,
                                             retries=max(self.settings.retries, 10))
        self.rank, self.addresses = int(reply["rank"]), list(reply["members"])
        self.run_settings: dict[str, Any] = dict(reply.get("settings") or {})
        self.members = list(range(len(self.addresses)))
        self.log = self.log.bind(node=self.rank)
        s = self.settings
        self.fragmentation = Fragmentation.build(self.layout, s.fragments, s.seed, s.strategy)
        self.sampler = PeerSampler(s.sampler, s.fanout, s.seed)
        self.state = self._round_state(0, self.members, ())
        self.phase = "ready"
        self.log.info("registered", rank=self.rank, members=len(self.members), dim=self.layout.dim,
                      fingerprint=self.fragmentation.fingerprint.hex())

    def _round_state(self, round: int, members: list[int], early: tuple) -> RoundState:
        assert self.fragmentation is not None
        state = RoundState(node=self.rank, round=round, members=members, fragmentation=self.fragmentation,
                           sampler=self.sampler, run_id=self.settings.run_id,
                           max_bytes=self.settings.max_body_bytes, early=early)
        # messages buffered for this round were accepted (or refused) just now: count them like live ones
        report = state.report
        self.m_msgs_in.inc(report.messages_in)
        self.m_bytes_in.inc(report.bytes_in)
        self.m_frags_in.inc(report.fragments_in)
        for reason, count in report.refused.items():
            self.m_refused.labels(reason).inc(count)
        return state

    # -- one round -----------------------------------------------------------------------------------
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
            raise RuntimeError("gossip() needs a registered, unfinished peer")
        t = state.round
        log = self.log.bind(round=t)
        self.phase = "sending"
        started = time.perf_counter()
        messages = state.outgoing(np.asarray(local, dtype=np.float32))
        results = await asyncio.gather(*(self._send(m) for m in messages))
        for message, ok in zip(messages, results, strict=True):
            if not ok:
                state.mark_unsent(message)
                self.m_unsent.inc(len(message.fragments))
        sent = time.perf_counter()
        self.phase = "barrier"
        release = await self._arrive(t)
        waited = time.perf_counter()
        self.phase = "aggregating"
        outcome = state.finish()
        self.vector = outcome.vector
        self.snapshots[t] = outcome.vector
        self.snapshots.pop(t - SNAPSHOTS_KEPT, None)
        self.members = [int(m) for m in release["members"]]
        if self.rank not in self.members:
            raise PeerDropped(f"node {self.rank} was dropped from the run after round {t}")
        self.state = self._round_state(t + 1, self.members, outcome.early)
        done = time.perf_counter()
        report = outcome.report  # refusals and accepted messages were counted as they came (handle_fragments)
        self.m_bytes_out.inc(report.bytes_out)
        self.m_frags_out.inc(report.fragments_out)
        timings = {"train_s": train_s, "send_s": sent - started, "wait_s": waited - sent, "aggregate_s": done - waited}
        for phase, seconds in timings.items():
            self.m_phase.labels(phase.removesuffix("_s")).set(seconds)
        self.loss = loss
        if math.isfinite(loss):
            self.m_loss.set(loss)
        self.last_report = {**report.to_json(), "loss": loss, **{k: round(v, 6) for k, v in timings.items()},
                            "stragglers": release.get("stragglers", [])}
        self.round = t + 1
        self.m_round.set(self.round)
        self.phase = "idle"
        log.debug("round_done", **{k: v for k, v in self.last_report.items() if k != "refused"})
        return outcome.vector

    async def _send(self, message: OutgoingMessage) -> bool:
        url = f"http://{self.addresses[message.peer]}/v1/fragments"
        try:
            await self._client.request("POST", url, data=message.payload, headers={"Content-Type": CONTENT_TYPE})
            return True
        except HttpError as exc:
            self.log.warning("send_failed", round=self.round, peer=message.peer, status=exc.status, error=exc.detail)
            return False

    async def _arrive(self, round: int) -> dict[str, Any]:
        s = self.settings
        timeout = s.round_deadline + 2 * s.request_timeout + (600 if round >= s.rounds else 60)
        try:
            return await self._client.post_json(f"{self.barrier_url}/v1/arrive",
                                                {"rank": self.rank, "round": round, "report": self.last_report},
                                                timeout=timeout)
        except HttpError as exc:
            if exc.status == 410:
                raise PeerDropped(f"node {self.rank} was dropped from the run: {exc.detail}") from None
            raise

    async def finish(self) -> None:
        """Tell the barrier this node is done; returns once the barrier has collected the final models."""
        if self.state is not None:
            self.state = None
        await self._arrive(self.round)
        self.finished = True
        self.phase = "done"

    # -- handlers ------------------------------------------------------------------------------------
    async def handle_fragments(self, request: web.Request) -> web.Response:
        if request.content_type != CONTENT_TYPE:
            return json_error(415, "unsupported_media_type", f"expected {CONTENT_TYPE}, got {request.content_type}")
        body = await request.read()
        state = self.state  # read after the body: the round may have moved on meanwhile
        if state is None:
            reason = "finished" if self.finished else "not_ready"
            return json_error(409 if self.finished else 503, reason, f"node is {self.phase}")
        fragments_before = state.report.fragments_in
        try:
            receipt = state.receive(body)
        except WireError as exc:
            self.m_refused.labels(exc.reason.value).inc()
            return web.json_response(exc.to_json(), status=_STATUS_OF_REASON.get(exc.reason, 400))
        if receipt.value == "accepted":  # buffered ones are counted when their round's state takes them
            self.m_msgs_in.inc()
            self.m_bytes_in.inc(len(body))
            self.m_frags_in.inc(state.report.fragments_in - fragments_before)
        return web.json_response({"status": receipt.value, "round": state.round})

    async def handle_model(self, request: web.Request) -> web.Response:
        raw = request.query.get("round")
        if raw is None:
            round_ = max(self.snapshots) if self.snapshots else -1
            vector = self.snapshots.get(round_, self.vector)
        else:
            if not raw.lstrip("-").isdigit():
                raise bad_request("bad_round", f"round must be an integer, got {raw!r}")
            round_ = int(raw)
            vector = self.snapshots.get(round_)
            if vector is None:
                kept = sorted(self.snapshots)
                raise bad_request("no_snapshot", f"no model kept for round {round_} (have {kept})", 404)
        if vector is None:
            raise bad_request("no_model", "this node has no model yet", 404)
        return web.Response(body=encode_model(self.rank, round_, self.layout, vector), content_type="application/cbor")

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response({
            "node": self.rank, "rank": self.rank, "address": self.address, "run_id": self.settings.run_id,
            "round": self.round, "rounds": self.settings.rounds, "phase": self.phase, "members": self.members,
            "fragments": self.settings.fragments, "fanout": self.settings.fanout,
            "sampler": self.settings.sampler.value, "dim": self.layout.dim,
            "loss": self.loss if math.isfinite(self.loss) else None,
            "last_round": self.last_report, "evaluation": self.evaluation,
        })

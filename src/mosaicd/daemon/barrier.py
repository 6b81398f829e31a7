"""The barrier peer: registration, one barrier per round, stragglers, drops, and the run's outputs.

Protocol (JSON over HTTP, O(n) messages per round):
    POST /v1/register {"address"}          -> long poll until every expected node registered:
                                              {"rank", "members": [addresses], "settings": {...}}
    POST /v1/arrive {"rank", "round", "report"} -> long poll until the round is released:
                                              {"round", "members": [ranks of next round], "stragglers",
                                               "dropped", "finished"}
Arriving at round t means: done sending round t (and, for t = rounds, done with the run).
Before releasing round t the barrier collects the models after round t-1 at evaluation rounds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from mosaicd.daemon.http import Client, HttpError, bad_request, healthz, json_errors, metrics_handler, read_json
from mosaicd.daemon.membership import MembershipError, Roster, parse_address, rank_addresses, resolve_all
from mosaicd.daemon.model_codec import decode_model
from mosaicd.logs import get_logger
from mosaicd.outputs import NODE_COLUMNS, RunRecorder, is_eval_round
from mosaicd.settings import Settings, SettingsError


@dataclass
class Release:
    round: int
    members: list[int]
    stragglers: list[int]
    dropped: list[int]
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class MemberState:
    address: str
    missed: int = 0
    last_contact: float = field(default_factory=time.monotonic)
    last_round: int = -1


_REPORT_NUMBERS = [c for c in NODE_COLUMNS if c not in ("round", "node", "refused")]


def _checked_report(report: Any, round_: int) -> dict[str, Any] | None:
    """A node's report of its previous round, as sent with /v1/arrive; 400 (nothing recorded) if malformed."""
    if report is None:
        return None
    if not isinstance(report, dict):
        raise bad_request("bad_field", "field 'report' must be an object or null")
    r = report.get("round")
    if type(r) is not int or not 0 <= r < round_:
        raise bad_request("bad_field", f"report.round must be an integer in [0, {round_})")
    for key in _REPORT_NUMBERS:
        if report.get(key) is not None and type(report[key]) not in (int, float):
            raise bad_request("bad_field", f"report.{key} must be a number")
    refused = report.get("refused")
    if refused is not None and not (isinstance(refused, dict) and all(type(v) is int for v in refused.values())):
        raise bad_request("bad_field", "report.refused must map reasons to counts")
    return report


class Barrier:
    def __init__(self, settings: Settings, evaluate: Any = None) -> None:
        self.settings = settings
        self.log = get_logger(role="barrier", run=settings.run_id)
        self.evaluate = evaluate
        self.recorder = RunRecorder(settings.out, settings, mode="cluster")
        self.phase = "registering"
        self.pending: dict[str, asyncio.Future] = {}
        self.roster: Roster | None = None
        self.registered = asyncio.Event()
        self.register_error: str | None = None
        self.register_status = 503  # 422 when the run as registered is invalid: retrying cannot help
        self.members: dict[int, MemberState] = {}
        self.live: list[int] = []
        self.round = 0
        self.arrived: set[int] = set()
        self.first_arrival: float | None = None
        self.released: dict[int, Release] = {}
        self.release_event = asyncio.Event()
        self.dropped: list[int] = []
        self.last_metrics: dict[str, Any] | None = None
        self.final_vectors: dict[int, np.ndarray] = {}
        self.done = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self.registry = CollectorRegistry()
        self.m_round = Gauge("mosaic_barrier_round", "round the barrier waits on", registry=self.registry)
        self.m_members = Gauge("mosaic_barrier_members", "live members", registry=self.registry)
        self.m_registered = Gauge("mosaic_barrier_registered", "registered nodes", registry=self.registry)
        self.m_expected = Gauge("mosaic_barrier_expected", "nodes expected", registry=self.registry)
        self.m_stragglers = Counter("mosaic_barrier_stragglers", "straggler reports", registry=self.registry)
        self.m_dropped = Counter("mosaic_barrier_dropped", "members dropped", registry=self.registry)
        self.m_round_s = Gauge("mosaic_barrier_round_seconds", "duration of the last released round",
                               registry=self.registry)
        self.m_metric = Gauge("mosaic_barrier_metric", "latest network metrics", ["name"], registry=self.registry)
        self._round_started = time.monotonic()
        self._evaluation: asyncio.Future | None = None

    # -- app -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors], client_max_size=1024 * 1024)
        app.add_routes([
            web.post("/v1/register", self.handle_register),
            web.post("/v1/arrive", self.handle_arrive),
            web.get("/v1/run", self.handle_run),
            web.get("/v1/status", self.handle_status),
            web.get("/metrics", metrics_handler(self.registry)),
            web.get("/healthz", healthz),
        ])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._spawn(self._registration_deadline())
        if self.settings.expect_dns:
            self._spawn(self._watch_dns())
        self.m_expected.set(self.expected)

    async def _stop(self, app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- registration ------------------------------------------------------------------------------
    @property
    def expected(self) -> int:
        return self._dns_count if self.settings.expect_dns else self.settings.nodes

    _dns_count = 0

    async def _watch_dns(self) -> None:
        """Count nodes as the addresses the service name resolves to, once the count holds still."""
        stable_since, last = time.monotonic(), -1
        while self.roster is None:
            count = len(await asyncio.to_thread(resolve_all, self.settings.expect_dns))
            if count != last:  # still moving (replicas starting): nothing is counted until it holds still
                last, stable_since = count, time.monotonic()
                self._dns_count = 0
                self.m_expected.set(0)
            if count and time.monotonic() - stable_since >= self.settings.dns_settle:
                self._dns_count = count
                self.m_expected.set(count)
                self._maybe_close_registration()
            await asyncio.sleep(0.5)

    async def _registration_deadline(self) -> None:
        await asyncio.sleep(self.settings.register_deadline)
        if self.roster is None:
            self._fail_registration(f"registration deadline ({self.settings.register_deadline:g}s) passed with "
                                    f"{len(self.pending)} of {self.expected or '?'} nodes", 503)

    def _fail_registration(self, reason: str, status: int) -> None:
        self.register_error, self.register_status = reason, status
        self.log.error("registration_failed", detail=reason)
        self.phase = "failed"
        self.registered.set()
        self.done.set()

    async def handle_register(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"address": str})
        address = body["address"]
        try:
            parse_address(address)
        except MembershipError as exc:
            raise bad_request("bad_address", str(exc)) from None
        if self.roster is not None:
            if address in self.roster.addresses:
                return web.json_response(self._registration(address))
            raise bad_request("registration_closed", f"run {self.settings.run_id} started without {address}", 409)
        if self.register_error:
            raise bad_request("registration_failed", self.register_error, self.register_status)
        self.pending.setdefault(address, asyncio.get_running_loop().create_future())
        self.m_registered.set(len(self.pending))
        self.log.info("registered", address=address, registered=len(self.pending), expected=self.expected)
        self._maybe_close_registration()
        try:
            await asyncio.wait_for(self.registered.wait(), timeout=self.settings.register_deadline)
        except TimeoutError:
            pass
        if self.roster is None or address not in self.roster.addresses:
            raise bad_request("registration_failed", self.register_error or "registration did not complete",
                              self.register_status)
        return web.json_response(self._registration(address))

    def _maybe_close_registration(self) -> None:
        if self.roster is not None or not self.expected or len(self.pending) < self.expected:
            return
        try:  # the node count may be known only now (DNS): check the run as it will be
            settings = self.settings.updated(nodes=len(self.pending))
        except SettingsError as exc:
            dns = self.settings.expect_dns
            counted = f" ({dns} resolved to that many addresses)" if dns else ""
            self._fail_registration(f"{len(self.pending)} nodes registered{counted}, but the run is invalid with "
                                    f"them: {exc}", 422)
            return
        self.roster = Roster(tuple(rank_addresses(list(self.pending))))
        self.settings = settings
        self.members = {r: MemberState(a) for r, a in enumerate(self.roster.addresses)}
        self.live = self.roster.members
        self.phase = "running"
        self.m_members.set(len(self.live))
        self.log.info("registration_closed", members=len(self.live))
        self._round_started = time.monotonic()
        self.registered.set()

    def _registration(self, address: str) -> dict[str, Any]:
        assert self.roster is not None
        return {"rank": self.roster.rank_of(address), "members": list(self.roster.addresses),
                "settings": self.settings.run_fields()}

    # -- rounds ------------------------------------------------------------------------------------
    async def handle_arrive(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"rank": int, "round": int})
        rank, round_ = body["rank"], body["round"]
        if self.roster is None or rank not in self.members:
            raise bad_request("unknown_rank", f"rank {rank} is not registered", 404)
        if rank in self.dropped:
            raise bad_request("dropped", f"rank {rank} was dropped from the run", 410)
        if round_ > self.settings.rounds:
            raise bad_request("bad_round", f"round {round_} is past the run's {self.settings.rounds} rounds")
        report = _checked_report(body.get("report"), round_)
        member = self.members[rank]
        member.last_contact = time.monotonic()
        if round_ > self.round:  # checked before the report is recorded: a refused arrival records nothing
            raise bad_request("future_round", f"round {round_} is not open (the barrier is at {self.round})", 409)
        if report is not None and report["round"] > member.last_round:
            member.last_round = report["round"]
            self.recorder.node_round({**report, "node": rank})
        if round_ in self.released:
            return web.json_response(self.released[round_].to_json())
        self.arrived.add(rank)
        if self.first_arrival is None:
            self.first_arrival = time.monotonic()
            self._spawn(self._deadline(round_))
        member.missed = 0
        if set(self.live) <= self.arrived:
            await self._release(round_)
        deadline = self.settings.round_deadline + 60 + (self.settings.request_timeout * 2)
        while round_ not in self.released:
            try:
                await asyncio.wait_for(self.release_event.wait(), timeout=deadline)
            except TimeoutError:
                raise bad_request("barrier_timeout", f"round {round_} was not released in time", 503) from None
        return web.json_response(self.released[round_].to_json())

    async def _deadline(self, round_: int) -> None:
        await asyncio.sleep(self.settings.round_deadline)
        if round_ not in self.released and self.round == round_:
            await self._release(round_)

    async def _release(self, round_: int) -> None:
        async with self._lock:
            if round_ in self.released:
                return
            stragglers = [r for r in self.live if r not in self.arrived]
            dropped = []
            for r in stragglers:
                self.members[r].missed += 1
                if self.members[r].missed >= self.settings.drop_after:
                    dropped.append(r)
            if stragglers:
                self.m_stragglers.inc(len(stragglers))
                self.log.warning("stragglers", round=round_, stragglers=stragglers, dropped=dropped)
            self.dropped += dropped
            self.m_dropped.inc(len(dropped))
            self.live = [r for r in self.live if r not in dropped]
            finished = round_ >= self.settings.rounds
            if round_ >= 1 and is_eval_round(round_ - 1, self.settings):
                await self._collect(round_ - 1, final=finished)
            release = Release(round_, list(self.live), stragglers, list(self.dropped), finished)
            self.released[round_] = release
            self.released.pop(round_ - 3, None)
            self.round = round_ + 1
            self.arrived = set()
            self.first_arrival = None
            now = time.monotonic()
            self.m_round_s.set(now - self._round_started)
            self._round_started = now
            self.m_round.set(self.round)
            self.m_members.set(len(self.live))
            self.log.info("released", round=round_, members=len(self.live), finished=finished)
            if finished:
                self.phase = "finished"
                self._finish()
            self.release_event.set()
            self.release_event = asyncio.Event()

    async def _collect(self, round_: int, final: bool) -> None:
        """Fetch every live node's model after `round_` and evaluate the network (in a worker thread)."""
        vectors: dict[int, np.ndarray] = {}
        taken_at = time.time()
        async with Client(timeout=self.settings.request_timeout, retries=1) as client:
            async def fetch(rank: int) -> None:
                url = f"http://{self.members[rank].address}/v1/model?round={round_}"
                try:
                    _, body, _ = await client.request("GET", url)
                    vectors[rank] = decode_model(body)["vector"]
                except (HttpError, ValueError) as exc:
                    self.log.warning("collect_failed", rank=rank, round=round_, error=str(exc))
            await asyncio.gather(*(fetch(r) for r in self.live))
        if final:
            self.final_vectors = vectors
        if self.evaluate is None or not vectors:
            return
        previous = self._evaluation
        self._evaluation = asyncio.ensure_future(self._evaluate(round_, vectors, previous, taken_at))
        if final:
            await self._evaluation

    async def _evaluate(self, round_: int, vectors: dict[int, np.ndarray], previous: asyncio.Future | None,
                        taken_at: float) -> None:
        ranks = sorted(vectors)
        metrics = await asyncio.to_thread(self.evaluate, [vectors[r] for r in ranks])
        if previous is not None:
            await previous
        row = self.recorder.network_round(round_, {**metrics, "nodes": ranks}, taken_at)
        self.last_metrics = row
        for key in ("node_average", "average_model", "consensus_distance", "node_spread", "train_loss"):
            if isinstance(row.get(key), float):
                self.m_metric.labels(key).set(row[key])

    def _finish(self) -> None:
        self.recorder.finish(self.final_vectors, members=self.live, dropped=self.dropped,
                             addresses=list(self.roster.addresses) if self.roster else [])
        self.done.set()

    async def handle_run(self, request: web.Request) -> web.Response:
        return web.json_response({"run_id": self.settings.run_id, "settings": self.settings.run_fields()})

    async def handle_status(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({
            "role": "barrier", "run_id": self.settings.run_id, "phase": self.phase, "round": self.round,
            "rounds": self.settings.rounds, "expected": self.expected, "registered": len(self.pending),
            "live": self.live, "dropped": self.dropped,
            "stragglers": self.released[max(self.released)].stragglers if self.released else [],
            "members": [{"rank": r, "address": m.address, "missed": m.missed, "last_round": m.last_round,
                         "last_contact_s": round(now - m.last_contact, 3)} for r, m in self.members.items()],
            "metrics": self.last_metrics,
            "settings": self.settings.run_fields(),
        })

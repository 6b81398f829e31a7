"""Bounded under abuse: what a node or the barrier lets one connection, one address and everyone together hold.

aiohttp has no header or body read deadline and no connection cap of its own; this module adds them, so that
idle or slow connections and large bodies cannot take a daemon's file descriptors, memory or event loop while a
run of honest members goes on. Every refusal is JSON `{"reason", "detail"}`, counted in
`mosaic_limited_requests_total{reason}` and logged at most once per `LOG_EVERY` seconds per reason.

- Connections (`guard_connections`, from `serve`): the soft open-file limit is raised to the hard one and at
  most --max-connections connections are served at once, fewer where the open-file limit is lower (it keeps
  `FD_RESERVE` descriptors for the daemon's own clients and files), and a quarter of them from one address. A
  newcomer beyond a cap closes the oldest idle connection (one waiting for a request head) of that address, or
  of all; when none is idle it is answered 503 busy and closed. So accepting never fails for want of
  descriptors (no "Too many open files" flood), and idle connections cannot crowd out members.
- Request heads: aiohttp's keep-alive timer is armed at connect and after every answer, and it closes a
  connection still waiting for (the rest of) a request head when it fires: --header-timeout.
- Bodies (`Limits.bodies`, a middleware before authentication): a body not received in full when its request
  head is handled needs a slot: --max-bodies at once, half of them (at least one) per address, and together no
  more than --max-body-bytes of declared size (one body of any allowed size fits when no other is in flight).
  A body's bytes count until its handler is done with them (decoded), and a body is held once (`body.read_body`),
  so bodies never hold more than --max-body-bytes together, and the process grows by at most that plus
  `BODY_MEMORY_MARGIN` while it receives them (a node also reads a body only up to its run's largest message).
  A request waits `min(5 s, --request-timeout / 4)` for a slot, then gets 503 busy, without its body being read.
  A declared size over the app's limit gets 413 at once. The body must arrive within --request-timeout (an
  honest sender gives up by then anyway); a slower one is cut: 408 slow_body, connection closed.
- Registrations (`Limits.registrations`, barrier): while registration is open, one address may register at
  --register-rate per second, in bursts of the run's node count + 10; beyond it 429 rate_limited.

The buffer of messages for future rounds needs no limit here: `mosaic_proto.RoundState` keeps at most one per
(round, sender), for the next `window` (2) rounds only, each at most --max-body-bytes.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from mosaicd.daemon.http.errors import Handler, json_error
from mosaicd.logs import get_logger

FD_RESERVE = 384  # descriptors kept for the daemon's own client connections (256 at most), files and the rest
EVICT_SCAN = 64  # connections looked at for an idle one to close, before the newcomer is refused instead
BODY_WAIT_MAX = 5.0  # seconds a body waits for a slot at most
LINGERING = 2.0  # seconds aiohttp drains a body its handler did not read before closing (its default is 10)
LOG_EVERY = 10.0
# what a daemon's resident memory may grow by, beyond --max-body-bytes, while it receives bodies: aiohttp's queue of
# each body being received (2 x body.QUEUED_BYTES, --max-bodies of them), the pieces on their way into a body's
# buffer, and the allocator's slack; docs/security.md and --max-body-bytes' help state it
BODY_MEMORY_MARGIN = 64 << 20
# mosaic_limited_requests_total{reason}: connections closed idle or refused, bodies refused or cut, registrations
REASONS = ("idle_closed", "connections", "too_large", "busy", "slow_body", "rate_limited")
# on a request: the outer app (a node with the embedded barrier) took care of its body
_CHECKED = web.RequestKey("mosaic_body_checked", bool)


class SlowBody(TimeoutError):
    """A request body that did not arrive in time. A TimeoutError, so that aiohttp's draining of the body after
    the answer ends quietly on it (it stops on timeouts; any other error would be logged as unhandled)."""


def _host(peername: Any) -> str:
    if isinstance(peername, tuple | list) and peername:
        return str(peername[0])
    return str(peername or "unknown")


def refusal(status: int, reason: str, detail: str, *, retry_after: float | None = None,
            close: bool = False) -> web.Response:
    resp = json_error(status, reason, detail)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if close:
        resp.force_close()
    return resp


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (where allowed); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_caps(max_connections: int, open_files: int) -> tuple[int, int]:
    """(connections at once, connections from one address), below the open-file limit."""
    total = max(8, min(max_connections, open_files - FD_RESERVE))
    return total, max(8, total // 4)


def handler_options(options: Any) -> dict[str, Any]:
    """aiohttp RequestHandler settings (AppRunner keywords): the request-head deadline and the draining time."""
    return {"keepalive_timeout": options.header_timeout, "lingering_time": min(LINGERING, options.header_timeout)}


class TokenBuckets:
    """One token bucket per address: `rate` tokens a second, `burst` at most; full buckets are forgotten."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic, size: int = 4096) -> None:
        self.rate, self.clock, self.size = rate, clock, size
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when)

    def take(self, key: str, burst: int) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        now = self.clock()
        tokens, when = self._buckets.get(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - when) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate
        self._buckets[key] = (tokens - 1, now)
        if len(self._buckets) > self.size:  # spread addresses (IPv6) must not grow the table for ever
            for k, (t, w) in list(self._buckets.items()):
                if t + (now - w) * self.rate >= burst:
                    del self._buckets[k]
        return 0.0


class BodySlots:
    """Bodies being received: a count, a count per address and a sum of declared sizes, each capped. A body
    leaves the counts once it has arrived (`arrived`), its bytes once its handler is done with them (`done`):
    the handler holds them (a large message waits for a decoding slot), so they count against the budget until
    then, and no body beyond the budget is let in while another's bytes are held."""

    def __init__(self, count: int, per_peer: int, budget: int) -> None:
        self.max_count, self.per_peer, self.budget = count, per_peer, budget
        self.count, self.bytes = 0, 0
        self.per: Tally[str] = Tally()
        self._waiters: list[asyncio.Future] = []

    def fits(self, peer: str, size: int) -> bool:
        if self.count >= self.max_count or self.per[peer] >= self.per_peer:
            return False
        return self.bytes == 0 or self.bytes + size <= self.budget

    async def admit(self, peer: str, size: int, wait: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while not self.fits(peer, size):
            left = end - loop.time()
            if left <= 0:
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait([waiter], timeout=left)
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.count += 1
        self.bytes += size
        self.per[peer] += 1
        return True

    def release(self, peer: str, size: int) -> None:
        """Both at once: an admission that ends whole (a decoding)."""
        self.arrived(peer)
        self.done(size)

    def arrived(self, peer: str) -> None:
        """A body is in: it no longer counts as one being received."""
        self.count -= 1
        self.per[peer] -= 1
        if self.per[peer] <= 0:
            del self.per[peer]
        self._wake()

    def done(self, size: int) -> None:
        """A body's handler is done: its bytes are free."""
        self.bytes -= size
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each looks again whether it fits now
            if not waiter.done():
                waiter.set_result(None)


class Limits:
    """One app's limits on request bodies (and registrations, for the barrier) and their metrics."""

    def __init__(self, options: Any, registry: CollectorRegistry, *,
                 registration: Callable[[], int] | None = None) -> None:
        """`registration()`: how many registrations one address may make at once now (its burst), 0 while
        registration is closed (then registrations are refused at once, unlimited); None: not a barrier."""
        self.options, self.registration = options, registration
        self.body_timeout = options.request_timeout
        self.body_wait = min(BODY_WAIT_MAX, options.request_timeout / 4)
        self.slots = BodySlots(options.max_bodies, max(1, options.max_bodies // 2), options.max_body_bytes)
        self.buckets = TokenBuckets(options.register_rate)
        self.limited = Counter("mosaic_limited_requests", "requests and connections refused or cut by a limit",
                               ["reason"], registry=registry)
        for reason in REASONS if registration is not None else REASONS[:-1]:  # every series from the start, at 0
            self.limited.labels(reason)
        self.connections = Gauge("mosaic_open_connections", "connections this daemon serves now", registry=registry)
        self.log = get_logger(role="limits")
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last log time, refusals since)
        self._parked: set[Any] = set()  # connections (their aiohttp handlers) that wait for a stream's next frame

    def park(self, connection: Any) -> None:
        """`connection` (its aiohttp handler) waits for its peer's next frame on a stream (`http/stream.py`): idle,
        as a kept-alive connection between two requests is, so the connection guard may close it for a newcomer."""
        self._parked.add(connection)

    def unpark(self, connection: Any) -> None:
        self._parked.discard(connection)

    def parked(self, connection: Any) -> bool:
        return connection in self._parked

    @property
    def middlewares(self) -> list[Any]:
        return [self.bodies] + ([self.registrations] if self.registration is not None else [])

    def note(self, reason: str, **detail: Any) -> None:
        """Count a refusal; log it, at most once per LOG_EVERY seconds per reason (with how many since)."""
        self.limited.labels(reason).inc()
        now = time.monotonic()
        last, since = self._logged.get(reason, (-math.inf, 0))
        if now - last >= LOG_EVERY:
            self.log.warning("limited", reason=reason, refused_since_last_log=since + 1, **detail)
            self._logged[reason] = (now, 0)
        else:
            self._logged[reason] = (last, since + 1)

    @web.middleware
    async def bodies(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.get(_CHECKED) or not request.body_exists or request.content.is_eof():
            return await handler(request)  # no body, or all of it is here already
        request[_CHECKED] = True
        size, limit = request.content_length, request.client_max_size
        too_large = self.too_large(size, limit) if size is not None else None
        if too_large is not None:
            return refusal(413, "too_large", too_large, close=True)
        declared = size if size is not None else limit  # a chunked body may be as large as the limit
        peer = request.remote or "unknown"
        busy = await self.admit(peer, declared)
        if busy is not None:
            return refusal(503, "busy", busy, retry_after=1, close=True)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.body_timeout, self._cut, request, declared)
        arrived = False

        def arrive() -> None:
            nonlocal arrived
            if not arrived:
                arrived = True
                timer.cancel()
                self.slots.arrived(peer)

        request.content.on_eof(arrive)  # another body may come in once this one is in, within the bytes' budget
        try:
            return await handler(request)
        except SlowBody as exc:
            self.note("slow_body", peer=peer)
            return refusal(408, "slow_body", str(exc), close=True)
        finally:
            arrive()
            self.slots.done(declared)  # its bytes: held by the handler until now

    def too_large(self, size: int, limit: int) -> str | None:
        """Why a body declared `size` bytes is refused at once (noted), or None: over the app's `limit` (0: none)."""
        if not limit or size <= limit:
            return None
        self.note("too_large", size=size)
        return f"the body is {size} bytes, more than this daemon takes ({limit})"

    async def admit(self, peer: str, declared: int) -> str | None:
        """A body slot for `declared` bytes from `peer`, waiting up to `body_wait` for one; else why not (noted)."""
        if await self.slots.admit(peer, declared, self.body_wait):
            return None
        self.note("busy", peer=peer)
        return f"{self.slots.count} request bodies are being received ({self.slots.per[peer]} from {peer}); try again"

    def slow(self, came: int, declared: int) -> str:
        """What a body cut at its deadline is told (the caller notes `slow_body` where it answers)."""
        return f"the body did not arrive within {self.body_timeout:g} s (--request-timeout): {came} of {declared} " \
               "bytes came"

    def _cut(self, request: web.Request, declared: int) -> None:
        content = request.content
        if not content.is_eof() and content.exception() is None:
            content.set_exception(SlowBody(self.slow(content.total_bytes, declared)))

    @web.middleware
    async def registrations(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        assert self.registration is not None
        if request.method == "POST" and request.path.endswith("/v1/register"):
            burst = self.registration()
            peer = request.remote or "unknown"
            wait = self.buckets.take(peer, burst) if burst > 0 else 0.0
            if wait > 0:
                self.note("rate_limited", peer=peer)
                return refusal(429, "rate_limited", f"too many registrations from {peer}: at most "
                               f"{self.options.register_rate:g} a second (--register-rate) in bursts of {burst}",
                               retry_after=wait)
        return await handler(request)


LIMITS = web.AppKey("mosaic_limits", Limits)

_BUSY_BODY = b'{"reason": "busy", "detail": "too many open connections; try again"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" % len(_BUSY_BODY)) + _BUSY_BODY


def _idle(handler: Any) -> bool:
    """Waiting for a request head (aiohttp's own keep-alive test), or just accepted and not started, with no
    request head yet: nothing is being handled."""
    waiter = getattr(handler, "_waiter", None)
    if waiter is not None:
        return not waiter.done()
    return getattr(handler, "_request_count", 1) == 0 and not getattr(handler, "_messages", True)


class ConnectionGuard:
    """Counts an aiohttp Server's connections (its connection_made/lost hooks) and keeps them under the caps."""

    def __init__(self, server: Any, total: int, per_peer: int, limits: Limits | None = None) -> None:
        self.total, self.per_peer, self.limits = total, per_peer, limits
        self.all: OrderedDict[Any, str] = OrderedDict()  # handler -> address, oldest first
        self.by_peer: dict[str, OrderedDict[Any, None]] = {}
        self._made, self._lost = server.connection_made, server.connection_lost
        server.connection_made, server.connection_lost = self.connection_made, self.connection_lost

    def connection_made(self, handler: Any, transport: Any) -> None:
        self._made(handler, transport)
        peer = _host(transport.get_extra_info("peername"))
        mine = self.by_peer.get(peer)
        if (mine is not None and len(mine) >= self.per_peer and not self._evict(mine)) or \
                (len(self.all) >= self.total and not self._evict(self.all)):
            transport.write(BUSY)
            # closed once aiohttp has started the connection's task (that runs first): closing it now would make
            # the task find its connection gone and fail ("Task exception was never retrieved", once per refusal)
            asyncio.get_running_loop().call_soon(transport.close)
            self._note("connections", peer)
            return
        self.all[handler] = peer
        self.by_peer.setdefault(peer, OrderedDict())[handler] = None
        self._gauge()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        self._forget(handler)
        self._lost(handler, exc)

    def _forget(self, handler: Any) -> None:
        peer = self.all.pop(handler, None)
        if peer is not None:
            mine = self.by_peer[peer]
            mine.pop(handler, None)
            if not mine:
                del self.by_peer[peer]
            self._gauge()

    def _evict(self, order: OrderedDict) -> bool:
        """Close the oldest idle connection among the first EVICT_SCAN of `order` (busy ones go to its end): one
        between two requests, or a stream between two frames (`Limits.parked`)."""
        for handler in list(islice(order, EVICT_SCAN)):
            if _idle(handler) or (self.limits is not None and self.limits.parked(handler)):
                peer = self.all.get(handler)
                self._forget(handler)
                handler.force_close()
                self._note("idle_closed", peer)
                return True
            order.move_to_end(handler)
        return False

    def _note(self, reason: str, peer: str | None) -> None:
        if self.limits is not None:
            self.limits.note(reason, peer=peer, open=len(self.all), max_connections=self.total)

    def _gauge(self) -> None:
        if self.limits is not None:
            self.limits.connections.set(len(self.all))


def guard_connections(runner: web.AppRunner, options: Any, app: web.Application) -> ConnectionGuard:
    """Raise the open-file limit and cap the runner's connections under it (after runner.setup())."""
    total, per_peer = connection_caps(options.max_connections, raise_open_file_limit())
    limits = app.get(LIMITS)
    guard = ConnectionGuard(runner.server, total, per_peer, limits)
    get_logger(role="limits").debug("connection_caps", max_connections=total, per_address=per_peer,
                                    header_timeout_s=options.header_timeout)
    return guard

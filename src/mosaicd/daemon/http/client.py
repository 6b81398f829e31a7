"""The one HTTP client of the node and the barrier: deadlines, retries with backoff, signed requests."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, TraceConfig, payload

from mosaic_proto import BarrierReason
from mosaicd.daemon.http.body import hash_bytes
from mosaicd.logs import get_logger


class HttpError(Exception):
    """A peer answered 4xx (not retried) or every attempt failed (`status` None)."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}" if status else detail)
        self.status = status
        self.detail = detail


class Refused(HttpError):
    """A peer refused the request with a reason code (its JSON error body): callers compare `reason` with the
    code (a `Reason` or `BarrierReason` value), never the text."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(status, f"{reason}: {detail}")
        self.reason = reason


def refusal(status: int, body: bytes) -> HttpError:
    """The error a 4xx/5xx answer is: `Refused` when its body is our JSON error, else a plain HttpError."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("reason"), str):
            return Refused(status, data["reason"], str(data.get("detail", "")))
    except ValueError:
        pass
    return HttpError(status, body.decode(errors="replace")[:300])


class _PiecewiseBody(payload.BytesPayload):
    """A large request body sent as its first piece (together with the request head) and then the rest, as
    views: aiohttp otherwise joins head and body into one new bytes (a copy of every body) on Python < 3.12."""

    FIRST = 1 << 16

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = memoryview(self._value)[:content_length]
        await writer.write(view[:self.FIRST])
        if len(view) > self.FIRST:
            await writer.write(view[self.FIRST:])

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)


def _body(data: bytes) -> bytes | payload.Payload | None:
    return _PiecewiseBody(data) if len(data) > 4 * _PiecewiseBody.FIRST else (data or None)


class Client:
    """One shared aiohttp session; per-request deadlines; retries with exponential backoff on 5xx/network errors."""

    def __init__(self, timeout: float, retries: int, backoff: float = 0.1,
                 signer: Callable[[str, str, bytes, int, str | None], dict[str, str]] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`signer(method, url, body, round, digest)`: the authentication headers of one attempt (daemon/auth.py;
        `digest`: the body's, hashed once per request);
        `ssl_context`: how https:// peers are verified and this client shows itself (daemon/tls.py)."""
        self.timeout, self.retries, self.backoff, self.signer = timeout, retries, backoff, signer
        self.ssl_context = ssl_context
        self._session: ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._session = ClientSession(connector=TCPConnector(limit=256, force_close=False,
                                                             ssl=self.ssl_context or True),
                                      trace_configs=[SlowConnects().trace_config()])
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session:
            await self._session.close()

    async def request(self, method: str, url: str, *, timeout: float | None = None, retries: int | None = None,
                      round: int = 0, data: bytes = b"", json_body: Any = None,
                      headers: dict[str, str] | None = None, digest: str | None = None) -> tuple[int, bytes, str]:
        """`digest`: `data`'s body digest where the caller has it (one body sent to several peers is hashed once)."""
        assert self._session is not None, "Client used outside 'async with'"
        headers = dict(headers or {})
        if json_body is not None:
            data = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        if self.signer and digest is None:
            digest = await hash_bytes(data)  # once per request, off the loop when large
        attempts = 1 + (self.retries if retries is None else retries)
        last, refused = "no attempt", None
        for attempt in range(attempts):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                get_logger(role="client").warning("retrying", method=method, url=url, attempt=attempt + 1,
                                                  attempts=attempts, delay_s=float(f"{delay:.3f}"), error=last)
                await asyncio.sleep(delay)
            signed = {**headers, **self.signer(method, url, data, round, digest)} if self.signer else headers
            try:
                async with self._session.request(method, url, timeout=ClientTimeout(total=timeout or self.timeout),
                                                 data=_body(data), headers=signed) as resp:
                    body = await resp.read()
                    if resp.status < 400:
                        return resp.status, body, resp.content_type
                    error = refusal(resp.status, body)
                    if resp.status < 500:
                        raise error
                    last, refused = error.detail, error if isinstance(error, Refused) else None
            except (TimeoutError, ClientError, OSError) as exc:
                last, refused = f"{type(exc).__name__}: {exc}", None
        if refused is not None:  # the last answer gave a reason (registration failed...): the caller may stop on it
            raise refused
        raise HttpError(None, f"{method} {url} failed after {attempts} attempts: {last}")

    async def post_json(self, url: str, payload: dict, **kwargs: Any) -> dict:
        _, body, _ = await self.request("POST", url, json_body=payload, **kwargs)
        return json.loads(body)

    async def post_json_until(self, url: str, payload: dict, deadline: float, flag: str, log: Any) -> dict:
        """POST (a long poll) until `url` answers, retrying an unreachable or 5xx peer every few seconds until
        `deadline` seconds have passed; every failed attempt is logged, so a wrong URL shows at once."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        for attempt in itertools.count(1):
            try:
                return await self.post_json(url, payload, timeout=max(end - loop.time(), 1.0) + 5, retries=0)
            except HttpError as exc:
                if exc.status is not None and exc.status != 429 and (exc.status < 500 or getattr(
                        exc, "reason", None) == BarrierReason.REGISTRATION_FAILED):
                    raise
                delay = min(0.25 * 2 ** attempt, 5.0)
                left = end - loop.time()
                if left < delay:
                    raise TimeoutError(f"{url} did not answer within {flag} {deadline:g}s: {exc.detail}") from None
                log.warning("unreachable", url=url, attempt=attempt, retry_in_s=delay, left_s=round(left, 1),
                            error=exc.detail)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def post_json_within(self, url: str, payload: dict, *, timeout: float, grace: float, flag: str, log: Any,
                               round: int = 0) -> dict:
        """POST (a long poll of up to `timeout` s); while the peer is unreachable or answers 5xx, retry with
        backoff for `grace` seconds from the first failure, logging every retry. 4xx is raised at once."""
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        for attempt in itertools.count():
            try:
                return await self.post_json(url, payload, timeout=timeout, retries=0, round=round)
            except HttpError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                left = grace - (now - failing_since)
                if left <= 0:
                    raise HttpError(None, f"{url} did not answer for {flag} {grace:g}s: {exc.detail}") from None
                delay = min(0.25 * 2 ** attempt, 5.0, left)
                log.warning("barrier_unreachable", url=url, attempt=attempt + 1, retry_in_s=delay,
                            left_s=float(f"{left:.1f}"), error=exc.detail)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")


class SlowConnects:
    """Logs TCP connections that take over SLOW_CONNECT_S to open, and, from the third in a process, the likely
    causes: connects stall when the kernel drops packets to peers it cannot resolve (a full neighbour table,
    e.g. many containers on one host) or when the network or the peer is overloaded."""

    SLOW_CONNECT_S = 1.0
    seen = 0  # slow connects in this process

    def trace_config(self) -> TraceConfig:
        config = TraceConfig()
        config.on_request_start.append(self._request)
        config.on_connection_create_start.append(self._start)
        config.on_connection_create_end.append(self._end)
        return config

    async def _request(self, session: Any, context: Any, params: Any) -> None:
        context.peer = f"{params.url.host}:{params.url.port}"

    async def _start(self, session: Any, context: Any, params: Any) -> None:
        context.connect_started = asyncio.get_running_loop().time()

    async def _end(self, session: Any, context: Any, params: Any) -> None:
        took = asyncio.get_running_loop().time() - getattr(context, "connect_started", 0.0)
        if took <= self.SLOW_CONNECT_S:
            return
        SlowConnects.seen += 1
        hint = {}
        peer = getattr(context, "peer", None) or ""
        if SlowConnects.seen >= 3 and peer.startswith("127."):
            hint = {"likely_cause": "connections to this host's own peers take seconds to open: the peers are too "
                    "busy to accept them (more processes than cores, e.g. many containers starting at once)"}
        elif SlowConnects.seen >= 3:
            hint = {"likely_cause": "connections take seconds to open: on one host with many containers on a bridge "
                    "the kernel's neighbour (ARP) table may be full ('neighbor table overflow' in dmesg; raise "
                    "net.ipv4.neigh.default.gc_thresh1/2/3, see docs/deploy.md); else the network or the peer is "
                    "overloaded"}
        get_logger(role="client").warning("slow_connect", peer=getattr(context, "peer", None), seconds=round(took, 3),
                                          slow_connects=SlowConnects.seen,
                                          **hint)

"""The one HTTP client of the node and the barrier: deadlines, retries with backoff, signed requests, over
`connections.Connections` (kept-alive HTTP/1.1)."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import Callable
from typing import Any

from mosaic_proto import BarrierReason
from mosaic_proto.auth import parts_digest
from mosaicd.daemon.http.body import OFF_LOOP_BYTES, hash_bytes
from mosaicd.daemon.http.connections import Body, Connections, SlowConnects, body_size
from mosaicd.logs import get_logger

HOPELESS_AFTER_S = 2.0  # failures this long before a retried request asks whether there is any point
QUIET_S = 15.0  # a barrier unreachable this long is worth a warning; sooner, it is most likely starting again


class HttpError(Exception):
    """A peer answered 4xx (not retried) or every attempt failed (`status` None)."""

    def __init__(self, status: int | None, detail: str, closed: bool = False) -> None:
        super().__init__(f"HTTP {status}: {detail}" if status else detail)
        self.status = status
        self.detail = detail
        self.closed = closed  # the last attempt found the peer's port closed: it is down, not slow


class Refused(HttpError):
    """A peer refused the request with a reason code (its JSON error body): callers compare `reason` with the
    code (a `Reason` or `BarrierReason` value), never the text."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(status, f"{reason}: {detail}")
        self.reason, self.told = reason, detail  # `told`: its detail alone, as the peer wrote it


class Abandoned(HttpError):
    """A retried request given up before its grace ran out, because the caller learned it cannot succeed (the
    barrier and every peer gone: the run is over); `detail` says how it knows."""

    def __init__(self, detail: str) -> None:
        super().__init__(None, detail)


def refusal(status: int, body: bytes) -> HttpError:
    """The error a 4xx/5xx answer is: `Refused` when its body is our JSON error, else a plain HttpError."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("reason"), str):
            return Refused(status, data["reason"], str(data.get("detail", "")))
    except ValueError:
        pass
    return HttpError(status, body.decode(errors="replace")[:300])


async def hash_body(body: Body) -> str:
    """The hex `body_digest` of a request's body (pieces: of them one after the other, not joined), in a worker
    thread when it is large."""
    if type(body) is not tuple:
        return await hash_bytes(body)
    return digest_on_loop(body) or await asyncio.to_thread(parts_digest, body)


def digest_on_loop(body: tuple[bytes | bytearray | memoryview, ...]) -> str | None:
    """`hash_body` of a body in pieces where it is small enough to hash on the event loop, else None."""
    return parts_digest(body) if body_size(body) < OFF_LOOP_BYTES else None


class Client:
    """Kept-alive connections shared by all requests; per-request deadlines; retries with exponential backoff on
    5xx/network errors."""

    def __init__(self, timeout: float, retries: int, backoff: float = 0.1,
                 signer: Callable[[str, str, bytes, int, str | None], dict[str, str]] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`signer(method, url, body, round, digest)`: the authentication headers of one attempt (daemon/auth.py;
        `digest`: the body's, hashed once per request);
        `ssl_context`: how https:// peers are verified and this client shows itself (daemon/tls.py)."""
        self.timeout, self.retries, self.backoff, self.signer = timeout, retries, backoff, signer
        self.ssl_context = ssl_context
        self._connections: Connections | None = None

    async def __aenter__(self) -> Client:
        self._connections = Connections(self.ssl_context, on_connect=SlowConnects())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._connections:
            self._connections.close()

    async def request(self, method: str, url: str, *, timeout: float | None = None, retries: int | None = None,
                      round: int = 0, data: Body = b"", json_body: Any = None,
                      headers: dict[str, str] | None = None, digest: str | None = None,
                      give_up: frozenset[str] = frozenset(), stream: bool = False) -> tuple[int, bytes, str]:
        """`data`: the body, one buffer or pieces sent one after the other (`connections.Body`, never joined);
        `digest`: `data`'s body digest where the caller has it (one body sent to several peers is hashed once);
        `give_up`: the reasons of 5xx answers not retried (raised at once as `Refused`); `stream`: a POST of
        fragments, sent as a frame on the peer's fragments stream where it serves one (`Connections.request`)."""
        assert self._connections is not None, "Client used outside 'async with'"
        headers = dict(headers or {})
        if json_body is not None:
            data = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        if self.signer and digest is None:
            digest = await hash_body(data)  # once per request, off the loop when large
        attempts = 1 + (self.retries if retries is None else retries)
        last, refused, closed = "no attempt", None, False
        for attempt in range(attempts):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                # the caller says what the retries came to, where it matters
                get_logger(role="client").info("retrying", method=method, url=url, attempt=attempt + 1,
                                               attempts=attempts, delay_s=float(f"{delay:.3f}"), error=last)
                await asyncio.sleep(delay)
            signed = {**headers, **self.signer(method, url, data, round, digest)} if self.signer else headers
            try:
                async with asyncio.timeout(timeout or self.timeout):
                    answer = await self._connections.request(method, url, signed, data, stream=stream)
            except (TimeoutError, OSError, ValueError) as exc:  # ValueError: a URL or certificate it cannot use
                last, refused = f"{type(exc).__name__}: {str(exc) or 'no answer in time'}", None
                closed = isinstance(exc, ConnectionRefusedError)
                continue
            if answer.status < 400:
                return answer.status, answer.body, answer.content_type
            error = refusal(answer.status, answer.body)
            if answer.status < 500 or isinstance(error, Refused) and error.reason in give_up:
                raise error
            last, refused, closed = error.detail, error if isinstance(error, Refused) else None, False
        if refused is not None:  # the last answer gave a reason (registration failed...): the caller may stop on it
            raise refused
        raise HttpError(None, f"{method} {url} failed after {attempts} attempts: {last}", closed=closed)

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
                               round: int = 0, hopeless: Callable[[], Any] | None = None) -> dict:
        """POST (a long poll of up to `timeout` s); while the peer is unreachable or answers 5xx, retry with
        backoff for `grace` seconds from the first failure, logging every retry. 4xx is raised at once.
        `hopeless()`: awaited before each retry from `HOPELESS_AFTER_S` of failures on; a reason (a string) ends
        the retries at once (`Abandoned`), None goes on."""
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
                    raise HttpError(None, f"{url} did not answer for {flag} {grace:g}s: {exc.detail}",
                                    closed=exc.closed) from None
                if hopeless is not None and now - failing_since >= HOPELESS_AFTER_S and \
                        (why := await hopeless()) is not None:
                    raise Abandoned(f"{url} did not answer ({exc.detail}), and {why}") from None
                delay = min(0.25 * 2 ** attempt, 5.0, left)
                # a barrier started again is back within seconds: an alarm only once it stays away
                say = log.info if now - failing_since < QUIET_S else log.warning
                say("barrier_unreachable", url=url, attempt=attempt + 1, retry_in_s=delay,
                    left_s=float(f"{left:.1f}"), error=exc.detail)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

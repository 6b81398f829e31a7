"""A node's fragments stream: `GET /v1/fragments/stream` upgraded (101), then fragment messages as frames
(`mosaic_proto.frames`), each checked and answered as the POST /v1/fragments it stands for.

Why: aiohttp hands a POST's body over in pieces it copies out of the socket's reads, through its parser and a
stream reader that wakes the handler for each; on a real-size model's messages that costs the receiving server about
three times the CPU of this stream (bench/transport.py, `node` against `upgraded`; bench/README.md). After the
upgrade, aiohttp gives every read to
`_Frames.feed_data`, which copies a body's bytes once, straight into the buffer it is handed on in (a kept one for a
large message, `body.BodyBuffers`), hashing them as they come; the handler wakes once per frame.

What a POST gets, a frame gets, with the same answers (docs/security.md), and every check that needs no body
before the body slot is taken, so that no unsigned frame holds one: a declared size over what the node takes, 413
(`too_large`); the signature (401); the content type (415); a body slot (`limits.BodySlots`, shared with the POSTs:
503 `busy`); the body within --request-timeout (408 `slow_body`); then the body's digest (401 `bad_body`). A
refusal before the body is read closes the connection, as the POST's does. The upgrade itself
needs no signature: it grants nothing but the carrying of frames, and a connection that carries none for
--header-timeout is closed (as an idle keep-alive one is), under the server's connection caps; between two frames
a stream is idle as a kept-alive connection between two requests is, and the connection guard may close it for a
newcomer (`Limits.park`).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.auth import AuthError, body_hasher, check_digest
from mosaic_proto.frames import (
    FRAGMENTS_PATH,
    STREAM_PATH,
    UPGRADE,
    End,
    FrameError,
    Head,
    Piece,
    RequestReader,
    answer_frame,
)
from mosaicd.daemon.http.auth import AUTHENTICATOR, Refusal
from mosaicd.daemon.http.body import ARRAY_FROM, QUEUED_BYTES, kept_buffers
from mosaicd.daemon.http.errors import json_error
from mosaicd.daemon.http.limits import LIMITS

Receive = Callable[[memoryview, str | None], Awaitable[tuple[int, dict[str, Any]]]]


class _Frames:
    """What aiohttp feeds an upgraded connection's reads to (`set_parser`): frames read, bodies copied into their
    buffers; the stream's handler awaits each head and each body."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.reader = RequestReader()
        self._head: asyncio.Future[Head | None] | None = None  # awaited by the handler (None: the connection ended)
        self._heads: list[Head | None] = []  # come before the handler awaited them (None: the connection ended)
        self.done: asyncio.Future[bool] | None = None  # the current body is complete (False: the connection ended)
        self.hasher: Any = None
        self._into: memoryview | None = None  # where the current body goes (None: not accepted yet)
        self._at = 0
        self._waiting: list[memoryview] = []  # pieces that came before the body was accepted
        self._waiting_bytes = 0
        self._paused = False

    # -- aiohttp's side
    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        try:
            events = self.reader.feed(data)
        except FrameError:  # not this protocol, or a frame before the last was answered: the connection closes
            self._end()
            return True, b""
        for event in events:
            if isinstance(event, Head):
                self._put(event)
            elif isinstance(event, Piece):
                if self._into is None:
                    self._waiting.append(event.data)
                    self._waiting_bytes += len(event.data)
                    if self._waiting_bytes >= QUEUED_BYTES and not self._paused:
                        self._paused = True
                        self.transport.pause_reading()
                else:
                    self._copy(event.data)
            elif isinstance(event, End) and self._into is not None:
                self._complete(True)
        return False, b""

    def feed_eof(self) -> None:
        self._end()

    def stop(self) -> None:
        """The server stops: the stream ends once the frame being answered (if any) is."""
        self._end()

    def _put(self, head: Head | None) -> None:
        waiter, self._head = self._head, None
        if waiter is not None and not waiter.done():
            waiter.set_result(head)
        else:
            self._heads.append(head)

    # -- the handler's side
    async def head(self) -> Head | None:
        """The next frame's head, once it came (None: the connection ended)."""
        if self._heads:
            return self._heads.pop(0)
        self._head = asyncio.get_running_loop().create_future()
        return await self._head

    def accept(self, into: memoryview, hashed: bool) -> asyncio.Future[bool]:
        """The current frame's body goes into `into` (hashed as it comes where `hashed`); the future is done when
        it is complete."""
        self.done = asyncio.get_running_loop().create_future()
        self.hasher = body_hasher() if hashed else None
        self._into, self._at = into, 0
        waiting, self._waiting, self._waiting_bytes = self._waiting, [], 0
        for piece in waiting:
            self._copy(piece)
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        if self._at == len(into) and not self.done.done():
            self._complete(True)
        return self.done

    @property
    def received(self) -> int:
        """Bytes of the current body received so far."""
        return self._at + self._waiting_bytes

    def answered(self) -> None:
        """The current frame is answered: the next may come."""
        self._into, self.done = None, None
        self.reader.ready()

    def _copy(self, piece: memoryview) -> None:
        assert self._into is not None
        end = self._at + len(piece)
        self._into[self._at:end] = piece
        if self.hasher is not None:
            self.hasher.update(piece)
        self._at = end

    def _complete(self, whole: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(whole)

    def _end(self) -> None:
        self._complete(False)
        self._put(None)


class FragmentsStreams:
    """GET /v1/fragments/stream's handler (`handle`) and the streams it serves: `receive(body, sender)` takes one
    message, as the POST's handler does (its status and JSON answer); `oversized(size)` says why a body of `size`
    bytes cannot be a message of the run (None where it can). Frames answered are counted in
    `mosaic_fragment_frames_total{status}`. `close`, an `on_shutdown` hook, ends every stream when the server
    stops: a stream waiting for its peer's next frame would otherwise hold the shutdown for its whole grace."""

    def __init__(self, receive: Receive, oversized: Callable[[int], str | None], largest: Callable[[], int | None],
                 header_timeout: float, registry: CollectorRegistry) -> None:
        self.receive, self.oversized, self.largest, self.header_timeout = receive, oversized, largest, header_timeout
        counter = Counter("mosaic_fragment_frames", "fragment messages received as frames on a fragments stream, "
                          "by the status they were answered with", ["status"], registry=registry)
        self.answered = functools.lru_cache(maxsize=None)(lambda status: counter.labels(str(status)))
        self.answered(200)  # the accepted frames' series from the start; a refusal's from its first
        self._open: set[_Frames] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET" or request.headers.get("Upgrade", "").lower() != UPGRADE or \
                "upgrade" not in request.headers.get("Connection", "").lower():
            return json_error(426, "upgrade_required", f"GET {STREAM_PATH} upgrades the connection: send "
                              f"'Connection: Upgrade' and 'Upgrade: {UPGRADE}' (or POST {FRAGMENTS_PATH})")
        switched = web.StreamResponse(status=101, headers={"Connection": "Upgrade", "Upgrade": UPGRADE})
        await switched.prepare(request)
        transport = request.transport
        assert transport is not None
        frames = _Frames(transport)
        request.protocol.set_parser(frames)
        self._open.add(frames)
        try:
            await _serve(request, frames, self)
        finally:
            self._open.discard(frames)
            transport.close()
        return switched

    async def close(self, app: web.Application) -> None:
        for frames in list(self._open):
            frames.stop()


async def _serve(request: web.Request, frames: _Frames, streams: FragmentsStreams) -> None:
    """Frames one after the other until the client closes, stays idle past `header_timeout`, or is refused in a
    way that leaves the connection unusable (its body not read)."""
    app, transport = request.app, request.transport
    assert transport is not None
    limits, authenticator = app[LIMITS], app.get(AUTHENTICATOR)
    fragments_path = request.path[:-len(STREAM_PATH)] + FRAGMENTS_PATH
    peer = request.remote or "unknown"
    max_body = request.client_max_size
    receive, oversized, header_timeout = streams.receive, streams.oversized, streams.header_timeout

    def answer(status: int, body: dict[str, Any]) -> None:
        streams.answered(status).inc()
        transport.write(answer_frame(status, json.dumps(body).encode()))

    def refuse(status: int, reason: str, detail: str) -> None:
        answer(status, {"reason": reason, "detail": detail})  # as `json_error`'s body

    carried = False
    while True:
        limits.park(request.protocol)  # between frames: the connection guard may close it for a newcomer
        try:  # asyncio.timeout, not wait_for: no task per frame (bench/transport.py, 59 kB messages)
            async with asyncio.timeout(header_timeout):
                head = await frames.head()
        except TimeoutError:
            # idle after a frame: a kept-alive connection expiring (closed without a word, as aiohttp closes one
            # between requests; rounds stall that long when the barrier restarts); idle before any: a refusal
            if not carried:
                limits.note("idle_closed", peer=peer)
            return
        finally:
            limits.unpark(request.protocol)
        if head is None:
            return
        size = head.length
        too_large = limits.too_large(size, max_body) or oversized(size)
        if too_large is not None:
            return refuse(413, "too_large", too_large)
        signed = None
        if authenticator is not None:
            try:
                signed = await authenticator.check(request, "POST", fragments_path, head.headers)
            except Refusal as exc:
                return refuse(exc.status, exc.reason, exc.detail)
        kind = head.header("content-type").split(";", 1)[0].strip().lower()
        if kind != CONTENT_TYPE:
            return refuse(415, "unsupported_media_type", f"expected {CONTENT_TYPE}, got {kind}")
        busy = await limits.admit(peer, size)
        if busy is not None:
            return refuse(503, "busy", busy)
        try:
            if size >= ARRAY_FROM:  # spanning the run's largest message, as `read_body`'s
                buffer = kept_buffers().take(size, room=min(filter(None, (streams.largest(), max_body)), default=size))
            else:
                buffer = np.empty(size, dtype=np.uint8)
            into = memoryview(buffer)[:size]
            try:
                complete = frames.accept(into, signed is not None)
                if complete.done():  # it came with its head (a message of a few reads): no deadline to arm
                    whole = complete.result()
                else:
                    async with asyncio.timeout(limits.body_timeout):
                        whole = await complete
            except TimeoutError:
                limits.note("slow_body", peer=peer)
                return refuse(408, "slow_body", limits.slow(frames.received, size))
            finally:
                limits.slots.arrived(peer)
            if not whole:
                return
            body = into.toreadonly()
            del into
            sender = None
            if signed is not None and authenticator is not None:
                try:
                    check_digest(signed, frames.hasher.hexdigest())
                except AuthError as exc:
                    failed = authenticator.refusal(exc, request)
                    refuse(failed.status, failed.reason, failed.detail)
                    frames.answered()
                    continue
                sender = signed.sender
            status, reply = await receive(body, sender)
            del body, buffer
            answer(status, reply)
            frames.answered()
            carried = True
        finally:
            limits.slots.done(size)

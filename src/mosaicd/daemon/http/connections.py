"""A thin HTTP/1.1 client: kept-alive connections per peer, one request at a time on each, answers parsed by
httptools (llhttp, in C). The one transport under `client.Client`.

Why not aiohttp's ClientSession: a node posts ~9 small-to-large messages per round, and the session's machinery
(request and response objects, URL objects, header multidicts, trace hooks, timers, the payload writer, a stream
reader per answer) cost several times this client's CPU per request, more than moving a fragment's body both ways
(bench/transport.py measures all three; bench/README.md "Speed 4, item 2"). Here a request
is one `bytes` head written before its body (no copy of a large body), an answer is a status, its content type
and its body's pieces joined once. The wire stays standard HTTP/1.1, so any server answers, and the daemons'
servers stay aiohttp's.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httptools

from mosaic_proto.frames import FRAGMENTS_PATH, STREAM_PATH, UPGRADE, AnswerReader, FrameError, request_head
from mosaicd.logs import get_logger

MAX_CONNECTIONS = 256  # connections open at once, to all peers (aiohttp's TCPConnector limit before)
IDLE_KEPT = 16  # idle connections kept per peer
POSTED_FOR_S = 60.0  # a peer that served no fragments stream is POSTed to this long, then asked for the stream again
JOIN_BELOW = 1 << 18  # a body up to this size is sent in one piece with its head (a copy), a larger one after it
_FRAGMENTS, _STREAM = FRAGMENTS_PATH.encode(), STREAM_PATH.encode()
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})  # Content-Length: 0 when sent without a body


Body = bytes | memoryview | tuple[bytes | memoryview, ...]  # a request's body: one buffer, or pieces sent in turn


def body_size(body: Body) -> int:
    """Its bytes (a view's, whatever its item size)."""
    return sum(memoryview(part).nbytes for part in body) if type(body) is tuple else memoryview(body).nbytes


class Answer:
    """An answer: its status, body and content type (lower case, parameters dropped; RFC 9110's
    application/octet-stream when it names none)."""

    __slots__ = ("status", "body", "content_type")

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status, self.body, self.content_type = status, body, content_type


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[tuple[str, int, bool], bytes, bytes]:
    """((host, port, tls), request target, Host header's value) of an http(s) URL; parsed once per URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, port, tls), target.encode("ascii"), parts.netloc.encode("idna")


def _header_bytes(headers: dict[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        line = f"{name}: {value}\r\n"
        if "\r" in line[:-2] or "\n" in line[:-2]:
            raise ValueError(f"header {name!r}: line breaks are not allowed in a header")
        lines.append(line)
    return "".join(lines).encode("latin-1")


def _send(transport: asyncio.Transport, head: bytes, body: Body, size: int) -> None:
    """`head`, then `body` of `size` bytes as it is, pieces in turn (no copy of a large one)."""
    if size <= JOIN_BELOW:  # one write, one system call: the copy costs less
        transport.write(b"".join((head, *body)) if type(body) is tuple else head + body if body else head)
    else:  # the transport keeps the pieces it could not write at once, not a copy of them (uvloop)
        transport.writelines((head, *body) if type(body) is tuple else (head, body))


class _Kept(asyncio.Protocol):
    """What a kept connection of either kind has: its transport, the answer awaited, whether a byte of it came."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._answer: asyncio.Future[Answer] | None = None
        self._started = False  # a byte of the answer came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    @property
    def answered_nothing(self) -> bool:
        """Whether no byte of an answer came: a reused connection closed by its server as the request left."""
        return not self._started

    def _fail(self, exc: BaseException) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is not written yet: a request that failed leaves no body behind, whose
        pieces may be views of arrays the caller goes on with."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Connection(_Kept):
    """One kept-alive connection; `exchange` sends a request and waits for its whole answer."""

    def __init__(self) -> None:
        super().__init__()
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []
        self._content_type = b""
        self._keep = True
        self._framed = False  # the answer's length is known (Content-Length, chunked), not "until the server closes"
        self._headed = False  # the answer's head came whole

    # -- asyncio.Protocol ----------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._started = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        if self._headed and not self._framed and self._answer is not None:  # a body that ends with the connection
            self.on_message_complete()
        return False  # close: a kept-alive connection whose server said goodbye is of no more use

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("the server closed the connection before it answered"))

    # -- httptools' callbacks ------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self._content_type = value
        elif name == b"content-length" or name == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headed = True
        self._keep = self._parser.should_keep_alive()
        status = self._parser.get_status_code()
        self._framed = self._framed or status in (204, 304) or 100 <= status < 200

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        chunks, self._chunks = self._chunks, []
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        kind = self._content_type.split(b";", 1)[0].strip().lower().decode("latin-1") or "application/octet-stream"
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_result(Answer(self._parser.get_status_code(), body, kind))
        if not self._keep:
            self.close()

    # -- use -----------------------------------------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        return not self.closed and self._keep and self.transport is not None and not self.transport.is_closing()

    async def exchange(self, head: bytes, body: Body, size: int) -> Answer:
        """Send one request (its head, then its body of `size` bytes as it is, pieces in turn: no copy) and wait
        for the whole answer."""
        assert self.transport is not None and self._answer is None
        self._answer = asyncio.get_running_loop().create_future()
        self._started, self._content_type, self._chunks, self._framed, self._headed = False, b"", [], False, False
        _send(self.transport, head, body, size)
        return await self._answer



class _Stream(_Kept):
    """One connection upgraded to a peer's fragments stream (`mosaic_proto.frames`): `upgraded` is the status the
    upgrade was answered with (101: frames from now on); `exchange` sends one frame and waits for its answer."""

    def __init__(self) -> None:
        super().__init__()
        self.upgraded: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._answers = AnswerReader()

    def data_received(self, data: bytes) -> None:
        if self._parser is not None:  # the upgrade's answer
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                self._parser = None
                if not self.upgraded.done():
                    self.upgraded.set_result(101)
                data = data[exc.args[0]:]
            except httptools.HttpParserError as exc:
                self._fail(ConnectionError(f"malformed HTTP answer to the upgrade: {exc}"))
                self.close()
                return
            if self._parser is not None or not data:
                return
        self._started = True
        try:
            answers = self._answers.feed(data)
        except FrameError as exc:
            self._fail(ConnectionError(f"malformed answer frame: {exc}"))
            self.close()
            return
        for status, body in answers:
            answer, self._answer = self._answer, None
            if answer is None:  # an answer to no frame
                self._fail(ConnectionError("an answer frame came with no frame sent"))
                self.close()
                return
            if not answer.done():
                answer.set_result(Answer(status, body, "application/json"))

    def on_headers_complete(self) -> None:  # httptools': the upgrade's answer
        assert self._parser is not None
        status = self._parser.get_status_code()
        if status != 101 and not self.upgraded.done():  # no stream: its body is of no use
            self.upgraded.set_result(status)
            self.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("the peer closed the fragments stream before it answered"))

    @property
    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    async def exchange(self, headers: dict[str, str], body: Body, size: int) -> Answer:
        assert self.transport is not None and self._answer is None
        self._answer = asyncio.get_running_loop().create_future()
        self._started = False
        _send(self.transport, request_head(headers, size), body, size)
        return await self._answer

    def _fail(self, exc: BaseException) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(exc)
        super()._fail(exc)


_Kind = TypeVar("_Kind", _Connection, _Stream)


class Connections:
    """Kept-alive connections per (host, port, tls): a request takes an idle one or opens one (at most
    MAX_CONNECTIONS at once), and gives it back when its answer came whole and the server keeps it open."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None,
                 on_connect: Callable[[str, float], None] | None = None) -> None:
        """`ssl_context`: for https:// peers (the system's defaults when None); `on_connect(peer, seconds)`: told
        how long each new connection took to open."""
        self.ssl_context = ssl_context
        self.on_connect = on_connect
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._open: set[_Connection | _Stream] = set()
        self._streams: dict[tuple[str, int, bool], list[_Stream]] = {}  # idle fragments streams per peer
        self._posted: dict[tuple[str, int, bool], float] = {}  # peer -> until when it is POSTed to (no stream)

    async def request(self, method: str, url: str, headers: dict[str, str], body: Body, *,
                      stream: bool = False) -> Answer:
        """One request and its answer. A connection that fails is closed; a kept-alive one that its server closed
        before it answered is replaced by a new one once (the request had not reached the server's handler).
        `stream`: a POST of fragments goes as a frame on a fragments stream to its peer (one per message in
        flight, kept between messages like a connection), and as a POST to a peer that serves none."""
        peer, target, host = _target(url)
        length = body_size(body)
        if stream and method == "POST" and target.endswith(_FRAGMENTS) and not self._posting(peer):
            answer = await self._framed(peer, target[:-len(_FRAGMENTS)] + _STREAM, host, headers, body, length)
            if answer is not None:
                return answer
        head = b"".join((method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n",
                         (b"Content-Length: %d\r\n" % length) if length or method in _BODY_METHODS else b"",
                         _header_bytes(headers), b"\r\n"))
        answer = await self._exchanged(self._idle, peer, functools.partial(self._connect, peer, _Connection),
                                       lambda conn: conn.exchange(head, body, length))
        assert answer is not None  # a connection is always to be had (or its opening raised)
        return answer

    def _posting(self, peer: tuple[str, int, bool]) -> bool:
        """Whether `peer` served no fragments stream within POSTED_FOR_S: a peer restarted with the stream (a newer
        version, or `mosaicd` after another server at its address) gets frames again."""
        until = self._posted.get(peer)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._posted[peer]
        return False

    async def _framed(self, peer: tuple[str, int, bool], target: bytes, host: bytes, headers: dict[str, str],
                      body: Body, length: int) -> Answer | None:
        """The message sent as a frame and its answer; None where the peer does not upgrade (then it is POSTed)."""
        return await self._exchanged(self._streams, peer, functools.partial(self._open_stream, peer, target, host),
                                     lambda conn: conn.exchange(headers, body, length))

    async def _exchanged(self, kept: dict[tuple[str, int, bool], list[_Kind]], peer: tuple[str, int, bool],
                         open_one: Callable[[], Awaitable[_Kind | None]],
                         send: Callable[[_Kind], Awaitable[Answer]]) -> Answer | None:
        """`send` on one of the peer's `kept` connections, else on a new one (`open_one`; None where it has none to
        give: then None), which is kept for the next exchange if it stays usable. A connection that fails is
        closed; a kept one that its peer closed before it answered is replaced by a new one once (the request had
        not reached the peer's handler)."""
        async with self._slots:
            idle, conn, reused = kept.get(peer), None, True
            while idle and conn is None:
                conn = idle.pop()
                if not conn.reusable:
                    self._open.discard(conn)
                    conn = None
            if conn is None:
                conn, reused = await open_one(), False
            while conn is not None:
                try:
                    answer = await send(conn)
                except BaseException as exc:  # failed, timed out or cancelled: the connection's state is unknown
                    conn.abort()
                    self._open.discard(conn)
                    if reused and isinstance(exc, ConnectionError) and conn.answered_nothing:
                        conn, reused = await open_one(), False
                        continue
                    raise
                idle = kept.setdefault(peer, [])
                if conn.reusable and len(idle) < IDLE_KEPT:
                    idle.append(conn)
                else:
                    conn.close()
                    self._open.discard(conn)
                return answer
            return None

    async def _open_stream(self, peer: tuple[str, int, bool], target: bytes, host: bytes) -> _Stream | None:
        """A new connection upgraded to the peer's fragments stream; None where the peer answered otherwise (a
        peer without the route, 404 or 405, or that refuses the upgrade, 426, is POSTed to for POSTED_FOR_S)."""
        conn = await self._connect(peer, _Stream)
        assert conn.transport is not None
        conn.transport.write(b"".join((b"GET ", target, b" HTTP/1.1\r\nHost: ", host,
                                       b"\r\nConnection: Upgrade\r\nUpgrade: ", UPGRADE.encode(), b"\r\n\r\n")))
        try:
            status = await conn.upgraded
        except BaseException:
            conn.abort()
            self._open.discard(conn)
            raise
        if status == 101:
            return conn
        conn.close()
        self._open.discard(conn)
        if status in (404, 405, 426):
            now = asyncio.get_running_loop().time()
            self._posted = {p: until for p, until in self._posted.items() if until > now}  # none kept past its time
            self._posted[peer] = now + POSTED_FOR_S
        return None

    async def _connect(self, peer: tuple[str, int, bool], kind: type[_Kind]) -> _Kind:
        host, port, tls = peer
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if tls:
            context = self.ssl_context or ssl.create_default_context()
        started = loop.time()
        _, conn = await loop.create_connection(kind, host, port, ssl=context, server_hostname=host if tls else None)
        self._open.add(conn)
        if self.on_connect is not None:
            self.on_connect(f"{host}:{port}", loop.time() - started)
        return conn

    def close(self) -> None:
        """Close every connection (idle or in use)."""
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
        self._streams.clear()


class SlowConnects:
    """Logs TCP connections that take over SLOW_CONNECT_S to open, and, from the third in a process, the likely
    causes: connects stall when the kernel drops packets to peers it cannot resolve (a full neighbour table,
    e.g. many containers on one host) or when the network or the peer is overloaded."""

    SLOW_CONNECT_S = 1.0
    seen = 0  # slow connects in this process

    def __call__(self, peer: str, took: float) -> None:
        if took <= self.SLOW_CONNECT_S:
            return
        SlowConnects.seen += 1
        hint: dict[str, Any] = {}
        if SlowConnects.seen >= 3 and peer.startswith("127."):
            hint = {"likely_cause": "connections to this host's own peers take seconds to open: the peers are too "
                    "busy to accept them (more processes than cores, e.g. many containers starting at once)"}
        elif SlowConnects.seen >= 3:
            hint = {"likely_cause": "connections take seconds to open: on one host with many containers on a bridge "
                    "the kernel's neighbour (ARP) table may be full ('neighbor table overflow' in dmesg; raise "
                    "net.ipv4.neigh.default.gc_thresh1/2/3, see docs/deploy.md); else the network or the peer is "
                    "overloaded"}
        get_logger(role="client").warning("slow_connect", peer=peer, seconds=round(took, 3),
                                          slow_connects=SlowConnects.seen, **hint)

"""Request bodies read once: straight off the socket into one buffer, hashed while they arrive, held once.

A fragments body is megabytes per peer and round. `request.read()` copies every byte twice (into a growing
bytearray, then into bytes), and the cluster secret's check used to hash the whole body on the event loop
after that. Here each piece is copied into the body's one buffer as it comes off the socket and then dropped,
and hashed as it arrives (so the loop is never held by more than one piece; a piece of `OFF_LOOP_BYTES` or more
goes to a worker thread: the hasher releases the GIL for large buffers). The buffer is an `io.BytesIO` sized by
Content-Length where there is one, whose `getvalue()` hands over its own `bytes` without a copy: a body of N
bytes holds N bytes (plus at most `QUEUED_BYTES` x 2 waiting in the socket's queue), never the 2N of pieces kept
and then joined, so --max-body-bytes bounds what bodies hold (docs/security.md). A chunked body, whose size is known
only at its end, past `RESERVE_AFTER` bytes is read into a mapping of the limit's size, of which only the pages
written are memory, so growing it never moves it.

A fragments message of `ARRAY_FROM` bytes or more with a declared length goes into a buffer the process keeps for
the next rounds (`BodyBuffers`), handed on as a read-only view (`wire.decode` takes its fragments as views of it):
a fresh buffer of a real-size model's message faults in every page again each round (44 MB: 10.7k pages the kernel
zeroes), a kept one has them.
"""

from __future__ import annotations

import asyncio
import io
import mmap
import sys

import numpy as np
from aiohttp import web

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.auth import body_digest, body_hasher
from mosaicd.daemon.http.server import MMAP_BELOW

# A buffer at least this large is hashed in a worker thread; smaller ones on the loop, since handing a piece to a
# thread and back (a queue put, a wake-up and GIL hand-offs) costs more than hashing it, and a body arrives in pieces
# of at most 256 KiB, asyncio's read size (bench/bodies.py; bench/README.md, "Figures behind design choices").
OFF_LOOP_BYTES = 8 << 20
# aiohttp's queue of a body's bytes read off the socket and not yet taken is paused at twice this (its high water
# mark); large enough that a megabytes-long body does not pause the socket every 128 KiB (aiohttp's default)
QUEUED_BYTES = 4 << 20
RESERVE_AFTER = 1 << 20  # a chunked body past this many bytes is read into a mapping of its own (`_mapping`)
# bodies whose handlers take any buffer (`wire.decode`, `np.frombuffer`), so a large one can be handed on as a
# read-only view of a mapping; any other (JSON, kilobytes) is handed on as `bytes`, the type `json.loads` takes
VIEWED_TYPES = frozenset({CONTENT_TYPE, "application/octet-stream"})
_BODY_DIGEST = web.RequestKey("mosaic_body_digest", str)
ARRAY_FROM = 4 << 20  # a fragments message declared this large or larger is read into a kept buffer
BUFFERS_KEPT = 16  # buffers a process keeps: a round's messages, s of them at K=1, at most K x s
# and their bytes at most (--max-body-bytes' default): past it a buffer is not kept. An 11M-value model's round
# (4 x 44 MB at K=1) fits; what bodies may hold while received is --max-body-bytes, these stay after (docs/security.md)
KEPT_BYTES = 256 << 20


class BodyBuffers:
    """Buffers for large fragments messages, kept across rounds: anonymous mappings, each handed out as a numpy
    array over it. One is handed out again only where nothing but this pool refers to it (its reference count: a
    fragment decoded from it, the request that read it, any view of it refers to the mapping), so no view of an
    earlier message is ever written over.

    A buffer spans the largest message it may have to hold (`take`'s `room`) but only the pages written into it are
    memory: a mapping's page is faulted in (and zeroed) the first time it is written. So one buffer serves messages
    of every size, as a K > 1 round's are (each peer gets the fragments drawn for it: 1 to K of them), and what a
    buffer holds, and the pool counts against its bytes, is the largest message written into it."""

    def __init__(self, kept: int = BUFFERS_KEPT, kept_bytes: int = KEPT_BYTES) -> None:
        self.kept, self.kept_bytes = kept, kept_bytes
        self._buffers: list[mmap.mmap] = []
        self._written: list[int] = []  # the bytes of each buffer's pages faulted in: its largest message so far

    def _viewed(self, at: int) -> bool:
        """Whether anything but the pool refers to buffer `at` (the list and getrefcount's argument: 2 where not)."""
        return sys.getrefcount(self._buffers[at]) > 2

    def take(self, size: int, room: int = 0) -> np.ndarray:
        """A writable array of at least `size` bytes over a buffer nothing refers to: of the free ones, the smallest
        already written as far as `size` (no page to fault in), else the one written furthest; a new one spans
        `room` bytes (at most the pool's) where that is more than `size`."""
        held = self.held

        def within(at: int | None, written: int) -> bool:
            """Whether the pool stays within its bytes with buffer `at` (None: a new one) written `written` far."""
            return held - (self._written[at] if at is not None else 0) + written <= self.kept_bytes

        free = [at for at in range(len(self._buffers)) if not self._viewed(at)]
        fits = [at for at in free
                if len(self._buffers[at]) >= size and within(at, max(self._written[at], size))]
        if fits:
            at = min(fits, key=lambda at: (0, self._written[at]) if self._written[at] >= size
                     else (1, -self._written[at]))
            self._written[at] = max(self._written[at], size)
            return np.frombuffer(self._buffers[at], dtype=np.uint8)
        buffer = mmap.mmap(-1, max(size, min(room, self.kept_bytes)))
        if len(self._buffers) < self.kept and within(None, size):
            self._buffers.append(buffer)
            self._written.append(size)
        elif free:  # the pool is full: a free buffer too small for this message makes way for it
            at = min(free, key=lambda at: self._written[at])
            if within(at, size):
                self._buffers[at], self._written[at] = buffer, size
        return np.frombuffer(buffer, dtype=np.uint8)

    @property
    def held(self) -> int:
        """Bytes kept (the pages written), in use or not."""
        return sum(self._written)

    def in_use(self) -> list[int]:
        """The bytes held by the kept buffers something refers to now (a message being read, or its fragments)."""
        return [self._written[at] for at in range(len(self._buffers)) if self._viewed(at)]


def kept_buffers() -> BodyBuffers:
    """This process's pool (what a probe reads: `bench/model_copies.py`)."""
    return _BUFFERS


_BUFFERS = BodyBuffers()  # this process's


async def read_body(request: web.Request, *, digest: bool = False, limit: int | None = None) -> bytes | memoryview:
    """The request's body, held once: each piece copied into one buffer as it comes, then dropped.

    The result is immutable (`bytes`, or a read-only view: of a kept buffer for a fragments message of `ARRAY_FROM`
    bytes or more, of its own mapping for a chunked binary body past `RESERVE_AFTER`), so `wire.decode` takes its
    fragments as views without a further copy. With
    `digest`, the body's digest is computed while it arrives (`body_digest_of` gives it) and the body is kept as
    aiohttp's own cache for the handler (`request.read()` returns it; `release_body` drops it). A body already
    read comes from that cache. Bodies over the app's limit, or over `limit` where that is lower (what the
    handler can take: a node's largest message of its run), get 413 as soon as they pass it.
    """
    content = request.content
    if content.at_eof():  # read already, or empty
        body = await request.read()
        if digest and _BODY_DIGEST not in request:
            request[_BODY_DIGEST] = await hash_bytes(body)
        return body
    if request.client_max_size and (limit is None or request.client_max_size < limit):
        limit = request.client_max_size
    expected = request.content_length or 0
    if expected > 0 and (not limit or expected <= limit):
        # the whole body is wanted: let a few megabytes queue up, instead of pausing the socket every 128 KiB
        # (aiohttp's default high water mark) and waking up to resume it dozens of times per megabytes-long body
        content.set_read_chunk_size(min(expected, QUEUED_BYTES))
    hasher = body_hasher() if digest else None
    buffer = io.BytesIO()
    reserved = expected > 0 and (not limit or expected <= limit)
    kept = _BUFFERS.take(expected, room=limit or expected) \
        if reserved and expected >= ARRAY_FROM and request.content_type == CONTENT_TYPE else None
    if reserved and kept is None:
        await _reserve(buffer, expected)  # one allocation of the declared size
    into = memoryview(kept)[:expected] if kept is not None else None
    size = 0
    while True:
        chunk, http_chunk_end = await content.readchunk()  # one piece as it came (readany() joins what is queued)
        if not chunk:
            if http_chunk_end:  # a chunked body's chunk boundary, not its end
                continue
            break
        start, size = size, size + len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        if not reserved and size > RESERVE_AFTER:  # a chunked body that is not small: a mapping of its own
            reserved = True
            if limit and request.content_type in VIEWED_TYPES:
                kept = _mapping(buffer.getvalue(), limit)
                into, buffer = memoryview(kept), io.BytesIO()
            else:
                await _reserve(buffer, MMAP_BELOW)
        if into is not None and size <= len(into):
            into[start:size] = chunk
        else:  # more than it declared (the parser refuses those; a guard all the same): as bytes from here
            if into is not None:
                buffer.write(into[:start])
                into = kept = None
            buffer.write(chunk)
        if hasher is not None:
            if len(chunk) < OFF_LOOP_BYTES:
                hasher.update(chunk)
            else:
                await asyncio.to_thread(hasher.update, chunk)
        del chunk
    if hasher is not None:
        request[_BODY_DIGEST] = hasher.hexdigest()
    if kept is not None:
        del into
        view = kept[:size]  # a body shorter than it declared (the parser refuses those; a guard all the same)
        view.flags.writeable = False
        body: bytes | memoryview = memoryview(view)
    else:
        buffer.truncate(size)  # a body shorter than it declared (the parser refuses those; a guard all the same)
        body = buffer.getvalue()  # the buffer's own bytes object, shrunk to size: no copy
    del buffer
    if digest:  # read ahead of the handler (the secret's check): request.read() returns it from now on
        request._read_bytes = body  # aiohttp's own cache; `release_body` drops it once the handler is done
    return body


def _mapping(start: bytes, size: int) -> np.ndarray:
    """An anonymous mapping of `size` bytes (a chunked body's limit) that begins with `start`: it is never moved or
    copied as the body grows, and only the pages written into it are memory. A buffer that grows by `realloc`
    instead is moved (old and new held at once) whenever a live block lies past its end, which in a node, whose
    blocks all come from the heap (`keep_freed_memory`), held a 190 MiB body 1.9 times over."""
    mapped = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    mapped[:len(start)] = np.frombuffer(start, dtype=np.uint8)
    return mapped


async def _reserve(buffer: io.BytesIO, size: int) -> None:
    """Allocate `size` bytes of `buffer` now (zeros, written over as the body comes): a buffer of MMAP_BELOW or more
    is its own mapping where glibc maps large blocks (not in a node: `keep_freed_memory`), which grows in place
    (mremap), where one on the heap is moved and copied as it grows. A large one is zeroed (its pages faulted in)
    in a worker thread, not on the loop."""
    def grow() -> None:
        at = buffer.tell()
        if buffer.seek(0, io.SEEK_END) < size:
            buffer.seek(size - 1)
            buffer.write(b"\0")
        buffer.seek(at)

    if size < OFF_LOOP_BYTES:
        grow()
    else:
        await asyncio.to_thread(grow)


def release_body(request: web.Request) -> None:
    """Drop the cached body once its handler is done: a request object can outlive its handler (a keep-alive
    connection, a reference cycle), and megabytes it holds on to make every new body fault in fresh pages."""
    request._read_bytes = None


def body_digest_of(request: web.Request) -> str:
    """The hex `body_digest` that `read_body(request, digest=True)` computed while it read the body."""
    return request[_BODY_DIGEST]


async def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """The hex `body_digest` of `data`, in a worker thread when it is large (the event loop goes on meanwhile)."""
    if len(data) < OFF_LOOP_BYTES:
        return body_digest(data)
    return await asyncio.to_thread(body_digest, data)

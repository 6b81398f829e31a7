"""Request bodies read once: straight off the socket, hashed while they arrive, never copied twice.

A fragments body is megabytes per peer and round. `request.read()` copies every byte twice (into a growing
bytearray, then into bytes), and the cluster secret's check used to hash the whole body on the event loop
after that. Here the chunks are kept as they came off the socket, hashed one by one as they arrive (so the loop
is never held by more than one piece; a piece of `OFF_LOOP_BYTES` or more goes to a worker thread: the hasher
releases the GIL for large buffers), and joined once (in a worker thread from `OFF_LOOP_BYTES` on: bytes.join
releases the GIL while it copies).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from mosaic_proto.auth import body_digest, body_hasher

# A buffer at least this large is hashed in a worker thread; smaller ones on the loop, since handing a piece to a
# thread and back (a queue put, a wake-up and GIL hand-offs) costs more than hashing it, and a body arrives in pieces
# of at most 256 KiB, asyncio's read size (bench/bodies.py; bench/README.md, "Figures behind design choices").
OFF_LOOP_BYTES = 8 << 20
_BODY_DIGEST = web.RequestKey("mosaic_body_digest", str)


async def read_body(request: web.Request, *, digest: bool = False) -> bytes:
    """The request's body as one `bytes`, copied once: the chunks as they came off the socket, joined.

    The result is immutable, so `wire.decode` takes its fragments as views without a further copy. With
    `digest`, the body's digest is computed while it arrives (`body_digest_of` gives it) and the body is kept as
    aiohttp's own cache for the handler (`request.read()` returns it; `release_body` drops it). A body already
    read comes from that cache. Bodies over the app's limit get 413, as with `request.read()`.
    """
    content = request.content
    if content.at_eof():  # read already, or empty
        body = await request.read()
        if digest and _BODY_DIGEST not in request:
            request[_BODY_DIGEST] = await hash_bytes(body)
        return body
    limit = request.client_max_size
    expected = request.content_length or 0
    if expected > 0 and (not limit or expected <= limit):
        # the whole body is wanted: let it queue up, instead of pausing the socket every 128 KiB (aiohttp's
        # default high water mark) and waking up to resume it, dozens of times per megabytes-long body
        content.set_read_chunk_size(expected)
    hasher = body_hasher() if digest else None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk, http_chunk_end = await content.readchunk()  # one piece as it came (readany() joins what is queued)
        if not chunk:
            if http_chunk_end:  # a chunked body's chunk boundary, not its end
                continue
            break
        size += len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)
        if hasher is not None:
            if len(chunk) < OFF_LOOP_BYTES:
                hasher.update(chunk)
            else:
                await asyncio.to_thread(hasher.update, chunk)
    if hasher is not None:
        request[_BODY_DIGEST] = hasher.hexdigest()
    if len(chunks) == 1 and type(chunks[0]) is bytes:
        body = chunks[0]
    elif size < OFF_LOOP_BYTES:
        body = b"".join(chunks)
    else:  # bytes.join releases the GIL while it copies: a large body's copy is not the loop's time
        body = await asyncio.to_thread(b"".join, chunks)
    if digest:  # read ahead of the handler (the secret's check): request.read() returns it from now on
        request._read_bytes = body  # aiohttp's own cache; `release_body` drops it once the handler is done
    return body


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

"""Where TLS costs: bulk transfer over 127.0.0.1 through asyncio, plain against TLS, and what the cipher itself costs.

A node's fragments travel as large request bodies; with mutual TLS every byte is encrypted by the sender and
decrypted by the receiver. This moves --megabytes (default 256 MB) from one asyncio connection to another in
--chunk-byte writes and times, in the same run (best of --repeats each):

- `plain`: asyncio's TCP transport (the reference);
- `tls`: asyncio's TLS transport (`asyncio.sslproto`: OpenSSL through `ssl.SSLObject` and memory BIOs, Python
  code per record batch: every byte crosses Python's buffers once more than in `plain`);
- `tls_blocking`: the same certificates, blocking `ssl.SSLSocket`s in two threads (OpenSSL reads and writes the
  socket itself; no asyncio): what the cipher and OpenSSL's record layer cost without Python's transport;
- `tls_uvloop`: uvloop's TLS transport, if uvloop is importable (it is not a dependency of this project).

Ratios are against `plain`. The cipher is whatever Python's defaults negotiate (TLS 1.3, AES-256-GCM with AES-NI
here). The certificates come from trustme (the test extra).

Usage: .venv/bin/python bench/tls.py [--megabytes 256] [--chunk 4194304] [--repeats 3]
The last line of stdout is a JSON object {"seconds": {...}, "ratio": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable


def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    try:
        import trustme
    except ImportError:
        sys.exit("bench/tls.py needs trustme (pip install trustme; it is in the test extra)")
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client)
    return server, client


class _Sink(asyncio.Protocol):
    def __init__(self, total: int, done: asyncio.Future[float]) -> None:
        self.total, self.done, self.got = total, done, 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.total and not self.done.done():
            self.done.set_result(time.perf_counter())


async def _asyncio_transfer(total: int, chunk: int, server_ctx: ssl.SSLContext | None,
                            client_ctx: ssl.SSLContext | None) -> float:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    server = await loop.create_server(lambda: _Sink(total, done), "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
    payload = memoryview(bytes(chunk))
    await writer.drain()
    started = time.perf_counter()
    sent = 0
    while sent < total:
        writer.write(payload)
        sent += chunk
        await writer.drain()
    finished = await done
    writer.close()
    server.close()
    return finished - started


def _blocking_transfer(total: int, chunk: int, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ready = threading.Event()
    result: list[float] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            buf = memoryview(bytearray(1 << 20))
            got = 0
            ready.set()
            while got < total:
                n = tls.recv_into(buf)
                if not n:
                    break
                got += n
            result.append(time.perf_counter())

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as tls:
        tls.sendall(b"")
        ready.wait()
        payload = bytes(chunk)
        started = time.perf_counter()
        sent = 0
        while sent < total:
            tls.sendall(payload)
            sent += chunk
        thread.join()
    listener.close()
    return result[0] - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=4 << 20, help="bytes per write (a fragments body: d*4/...)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = args.megabytes * 1_000_000
    server_ctx, client_ctx = contexts()
    runs: dict[str, Callable[[], float]] = {
        "plain": lambda: asyncio.run(_asyncio_transfer(total, args.chunk, None, None)),
        "tls": lambda: asyncio.run(_asyncio_transfer(total, args.chunk, server_ctx, client_ctx)),
        "tls_blocking": lambda: _blocking_transfer(total, args.chunk, server_ctx, client_ctx),
    }
    try:
        import uvloop  # type: ignore[import-not-found]
        runs["tls_uvloop"] = lambda: uvloop.run(_asyncio_transfer(total, args.chunk, server_ctx, client_ctx))
        runs["plain_uvloop"] = lambda: uvloop.run(_asyncio_transfer(total, args.chunk, None, None))
    except ImportError:
        pass
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):  # in turn, so that load that comes and goes hits every variant alike
        for name, run in runs.items():
            best[name] = min(best[name], run())
    print(f"{args.megabytes} MB over 127.0.0.1 in {args.chunk}-byte writes, best of {args.repeats} "
          f"({ssl.OPENSSL_VERSION})")
    for name, seconds in best.items():
        print(f"{name:>14}: {seconds:7.3f} s  {total / seconds / 1e6:7.0f} MB/s  {seconds / best['plain']:5.2f}x plain")
    print(json.dumps({"seconds": best, "ratio": {name: s / best["plain"] for name, s in best.items()}}))


if __name__ == "__main__":
    main()

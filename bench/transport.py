"""What HTTP costs a fragment: CPU per message through aiohttp against a framed stream, on loopback.

The tutorial job's nodes spend ~9-10 ms of event-loop CPU per node and round (`tutorial.py`), about 9 HTTP
exchanges of ~59 kB. This measures the floor each way of moving such a message from one asyncio process to
another and getting an answer, with nothing of ours in between:

- `http`: an aiohttp client session POSTs the body to an aiohttp server, whose handler reads it and answers a
  small JSON object (keep-alive; the way nodes talked before "Speed 4, item 2", without our middlewares,
  signing or decoding);
- `thin`: the same server, the client `mosaicd.daemon.http.connections.Connections` (the nodes' client since
  then: kept-alive HTTP/1.1, httptools), so `client_cpu_s` against `http`'s is what the client change saves;
- `node`: the thin client, and a server that reads the body as a node's fragments route does
  (`mosaicd.daemon.http.body.read_body`, the message's content type: a body of 4 MB or more goes into a kept
  buffer, copied once off aiohttp's pieces), so `node` against `framed` is what HTTP still costs a node;
- `framed`: one asyncio connection carries length-prefixed messages, and the server answers each with 4 bytes
  (a `BufferedProtocol` reading straight into a buffer: what a transport below HTTP would do);
- `upgraded`: the same messages and answers on a connection an aiohttp server upgraded (GET with `Upgrade`, 101,
  then aiohttp's `set_parser` hands each piece the socket read to our frame reader, as its websockets do): a framed
  transport inside the nodes' server, on its port, behind its TLS and connection caps, against `framed`'s own
  server. aiohttp hands over each piece as `bytes`, so it copies once more than `framed`;
- `stream`: the nodes' own fragments stream (`http/stream.py` behind a node's limits, its client
  `Connections.request(..., stream=True)`): `upgraded` with our framing and a frame's checks in place (size, content
  type, body slot, deadline; no secret, as `node`), the body copied into a kept buffer as a node reads it.

The server's process keeps the memory it frees, as a node's does (`keep_freed_memory`; before the fourteenth pass in
bench/README.md it did not, and a large POST's server side paid for memory mapped afresh). Each runs `--messages`
round trips with `--concurrency` in flight; the figure is CPU seconds (user + system) of
client and server together per message (and each side's), and the wall. The variants alternate `--repeat` times;
the best counts. `--event-loop uvloop`: both processes on uvloop, as the daemons run; `--tls`: every variant over
TLS, as a run with --tls-cert sends.

Usage: .venv/bin/python bench/transport.py [--messages 4000] [--size 59000] [--concurrency 4] [--repeat 3]
                                           [--event-loop asyncio|uvloop] [--tls]
Last line of stdout: a JSON object {"http": {...}, "thin": {...}, "node": {...}, "framed": {...}, "upgraded": {...},
"stream": {...}, "ratio_cpu": http / framed, "ratio_cpu_thin": thin / framed, "ratio_cpu_node": node / framed,
"ratio_cpu_upgraded": upgraded / framed, "ratio_cpu_stream": stream / framed}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import ssl
import struct
import time
from typing import Any

from aiohttp import ClientSession, TCPConnector, web
from prometheus_client import CollectorRegistry

from mosaic_proto import CONTENT_TYPE
from mosaic_proto.frames import STREAM_PATH
from mosaicd.daemon.http.body import read_body
from mosaicd.daemon.http.connections import Connections
from mosaicd.daemon.http.limits import LIMITS, Limits
from mosaicd.daemon.http.server import keep_freed_memory
from mosaicd.daemon.http.stream import FragmentsStreams
from mosaicd.daemon.loop import run
from mosaicd.settings import DaemonOptions

HEAD = struct.Struct("!I")
UPGRADE = b"GET /v1/stream HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: mosaic-frames\r\n\r\n"
LOOP = ["asyncio"]  # --event-loop, for the forked server too
# --tls: the server's context and the client's (None, None: plain TCP), made before the server is forked
TLS: list[ssl.SSLContext | None] = [None, None]


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for 127.0.0.1 from a throwaway CA (trustme), and a client trusting it."""
    import trustme
    ca = trustme.CA()
    server, client = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), ssl.create_default_context()
    ca.issue_cert("127.0.0.1").configure_cert(server)
    ca.configure_trust(client)
    return server, client


def scheme() -> str:
    return "https" if TLS[1] else "http"


class FramedServer(asyncio.BufferedProtocol):
    """Reads length-prefixed messages into one buffer; answers each with its length."""

    def __init__(self) -> None:
        self.buffer = bytearray(1 << 20)
        self.filled = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.filled == len(self.buffer):
            self.buffer.extend(bytes(len(self.buffer)))
        return memoryview(self.buffer)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        start = 0
        while self.filled - start >= HEAD.size:
            (length,) = HEAD.unpack_from(self.buffer, start)
            if self.filled - start < HEAD.size + length:
                break
            start += HEAD.size + length
            self.transport.write(HEAD.pack(length))
        if start:
            self.buffer[:self.filled - start] = self.buffer[start:self.filled]
            self.filled -= start


class UpgradedFrames(FramedServer):
    """The same reader on a connection aiohttp upgraded: aiohttp feeds it what the socket read (`set_parser`)."""

    def __init__(self, transport: Any, closed: asyncio.Future) -> None:
        super().__init__()
        self.transport, self.closed = transport, closed

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        while len(self.buffer) - self.filled < len(data):
            self.buffer.extend(bytes(len(self.buffer)))
        self.buffer[self.filled:self.filled + len(data)] = data
        self.buffer_updated(len(data))
        return False, b""

    def feed_eof(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream with `Upgrade`: 101, then the connection carries frames until the client closes it."""
    answer = web.StreamResponse(status=101, headers={"Connection": "Upgrade", "Upgrade": "mosaic-frames"})
    await answer.prepare(request)
    closed = asyncio.get_running_loop().create_future()
    request.protocol.set_parser(UpgradedFrames(request.transport, closed))
    await closed
    return answer


async def serve(kind: str, sock: socket.socket, ready: Any, done: Any) -> None:
    if kind != "framed":
        async def fragments(request: web.Request) -> web.Response:
            body = await (read_body(request) if kind == "node" else request.read())
            return web.json_response({"accepted": len(body)})
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/v1/fragments", fragments)
        app.router.add_get("/v1/stream", stream)
        if kind == "stream":
            async def receive(body: memoryview, sender: str | None) -> tuple[int, dict[str, Any]]:
                return 200, {"accepted": len(body)}
            options = DaemonOptions(max_body_bytes=1 << 26)
            app[LIMITS] = Limits(options, CollectorRegistry())
            streams = FragmentsStreams(receive, lambda size: None, lambda: None, options.header_timeout,
                                       CollectorRegistry())
            app.router.add_get(STREAM_PATH, streams.handle)
            app.on_shutdown.append(streams.close)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock, ssl_context=TLS[0]).start()
    else:
        server = await asyncio.get_running_loop().create_server(FramedServer, sock=sock, ssl=TLS[0])
    started = time.process_time()
    ready.send(True)
    await asyncio.get_running_loop().run_in_executor(None, done.recv)
    ready.send(time.process_time() - started)
    if kind != "framed":
        await runner.cleanup()
    else:
        server.close()


def server_main(kind: str, sock: socket.socket, ready: Any, done: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle: it stops this process
    keep_freed_memory()  # as a node's process: a body freed is the next one's memory, not a new mapping
    run(serve(kind, sock, ready, done), LOOP[0])


async def http_client(port: int, body: bytes, messages: int, concurrency: int) -> None:
    async with ClientSession(connector=TCPConnector(limit=concurrency, ssl=TLS[1] or True)) as session:
        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.post(f"{scheme()}://127.0.0.1:{port}/v1/fragments", data=body) as resp:
                    await resp.read()
                    assert resp.status == 200
        await asyncio.gather(*(worker(messages // concurrency) for _ in range(concurrency)))


async def thin_client(port: int, body: bytes, messages: int, concurrency: int,
                      content_type: str = "application/octet-stream") -> None:
    connections = Connections(TLS[1])
    url = f"{scheme()}://127.0.0.1:{port}/v1/fragments"

    async def worker(n: int) -> None:
        for _ in range(n):
            answer = await connections.request("POST", url, {"Content-Type": content_type}, body)
            assert answer.status == 200
    await asyncio.gather(*(worker(messages // concurrency) for _ in range(concurrency)))
    connections.close()


async def node_client(port: int, body: bytes, messages: int, concurrency: int) -> None:
    await thin_client(port, body, messages, concurrency, CONTENT_TYPE)


async def framed_client(port: int, body: bytes, messages: int, concurrency: int, upgrade: bool = False) -> None:
    async def worker(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=TLS[1])
        if upgrade:
            writer.write(UPGRADE % f"127.0.0.1:{port}".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101 "), head
        for _ in range(n):
            writer.writelines([HEAD.pack(len(body)), body])
            (length,) = HEAD.unpack(await reader.readexactly(HEAD.size))
            assert length == len(body)
        writer.close()
        await writer.wait_closed()
    await asyncio.gather(*(worker(messages // concurrency) for _ in range(concurrency)))


async def upgraded_client(port: int, body: bytes, messages: int, concurrency: int) -> None:
    await framed_client(port, body, messages, concurrency, upgrade=True)


async def stream_client(port: int, body: bytes, messages: int, concurrency: int) -> None:
    connections = Connections(TLS[1])
    url = f"{scheme()}://127.0.0.1:{port}/v1/fragments"

    async def worker(n: int) -> None:
        for _ in range(n):
            answer = await connections.request("POST", url, {"Content-Type": CONTENT_TYPE}, body, stream=True)
            assert answer.status == 200
    await asyncio.gather(*(worker(messages // concurrency) for _ in range(concurrency)))
    connections.close()


CLIENTS = {"http": http_client, "thin": thin_client, "node": node_client, "framed": framed_client,
           "upgraded": upgraded_client, "stream": stream_client}  # run in turn


def measure(kind: str, messages: int, size: int, concurrency: int) -> dict[str, float]:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    done_recv, done_send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=server_main, args=(kind, sock, ready_send, done_recv), daemon=True)
    server.start()
    sock.close()
    try:
        if not ready_recv.poll(30):
            raise SystemExit(f"the {kind} server did not start within 30 s")
        ready_recv.recv()
        body = os.urandom(size)
        client = CLIENTS[kind]
        started_cpu, started = time.process_time(), time.perf_counter()
        run(client(port, body, messages, concurrency), LOOP[0])
        wall, client_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        done_send.send(True)
        if not ready_recv.poll(30):
            raise SystemExit(f"the {kind} server did not report within 30 s")
        server_cpu = ready_recv.recv()
        server.join(10)
    finally:  # interrupted or failed: the server, still waiting for `done`, is stopped, not left behind
        if server.is_alive():
            server.terminate()
            server.join(10)
    sent = messages // concurrency * concurrency
    return {"wall_s": round(wall, 3), "client_cpu_s": round(client_cpu, 3), "server_cpu_s": round(server_cpu, 3),
            "cpu_us_per_message": round(1e6 * (client_cpu + server_cpu) / sent, 1),
            "wall_us_per_message": round(1e6 * wall / sent, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--size", type=int, default=59000, help="bytes per message (the tutorial job's: ~59 kB)")
    parser.add_argument("--concurrency", type=int, default=4, help="messages in flight")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tls", action="store_true",
                        help="every variant over TLS (a throwaway CA's certificate for 127.0.0.1: trustme)")
    parser.add_argument("--event-loop", default="asyncio", choices=("asyncio", "uvloop"),
                        help="both processes' loop (the daemons run on uvloop where it is installed)")
    args = parser.parse_args()
    LOOP[0] = args.event_loop
    if args.tls:
        TLS[:] = tls_contexts()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):
        for kind in CLIENTS:
            result = measure(kind, args.messages, args.size, args.concurrency)
            client_us, server_us = (1e6 * result[f"{side}_cpu_s"] / args.messages for side in ("client", "server"))
            print(f"{kind:7s} {result['cpu_us_per_message']:8.1f} us CPU per message (client + server: "
                  f"{client_us:.1f} + {server_us:.1f}), "
                  f"{result['wall_us_per_message']:8.1f} us wall", flush=True)
            if kind not in best or result["cpu_us_per_message"] < best[kind]["cpu_us_per_message"]:
                best[kind] = result
    ratio = best["http"]["cpu_us_per_message"] / best["framed"]["cpu_us_per_message"]
    thin = best["thin"]["cpu_us_per_message"] / best["framed"]["cpu_us_per_message"]
    node = best["node"]["cpu_us_per_message"] / best["framed"]["cpu_us_per_message"]
    upgraded = best["upgraded"]["cpu_us_per_message"] / best["framed"]["cpu_us_per_message"]
    stream = best["stream"]["cpu_us_per_message"] / best["framed"]["cpu_us_per_message"]
    print(f"{args.messages} messages of {args.size} bytes, {args.concurrency} in flight, {args.event_loop}, best of "
          f"{args.repeat}: http {best['http']['cpu_us_per_message']} us ({ratio:.2f}x framed), thin "
          f"{best['thin']['cpu_us_per_message']} us ({thin:.2f}x), node {best['node']['cpu_us_per_message']} us "
          f"({node:.2f}x), upgraded {best['upgraded']['cpu_us_per_message']} us ({upgraded:.2f}x), stream "
          f"{best['stream']['cpu_us_per_message']} us ({stream:.2f}x), framed "
          f"{best['framed']['cpu_us_per_message']} us CPU per message")
    print(json.dumps({"messages": args.messages, "size": args.size, "concurrency": args.concurrency, "tls": args.tls,
                      **best,
                      "event_loop": args.event_loop, "ratio_cpu": round(ratio, 3), "ratio_cpu_thin": round(thin, 3),
                      "ratio_cpu_node": round(node, 3), "ratio_cpu_upgraded": round(upgraded, 3),
                      "ratio_cpu_stream": round(stream, 3)}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit("interrupted: no figures") from None

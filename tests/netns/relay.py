"""A delaying TCP relay: this kernel has no `netem`, so delay comes from here.

    python relay.py --delay 0.05 LISTEN_HOST:PORT=TARGET_HOST:PORT [...]

Every byte read from one side is written to the other `--delay` seconds later, in order and pipelined (a chunk
read at time t leaves at t + delay whatever came before it), in both directions: a request and its answer each
take `delay` more, so the round trip grows by twice it. Connection set-up is not delayed. The harness runs it in
the relay namespace and advertises its ports as the nodes' addresses, so every request between nodes (fragments,
the barrier's long polls, model collection) crosses it. Prints "ready" once every port listens; runs until
killed (SIGTERM: it exits at once, the kernel closing its connections).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk `delay` seconds after it was read; pass the end of stream on."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay, chunk))
        except OSError:
            pass  # a reset ends this direction like an end of stream
        finally:
            queue.put_nowait((loop.time() + delay, b""))

    reading = asyncio.create_task(read())
    try:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                break
            writer.write(chunk)
            await writer.drain()
    finally:
        reading.cancel()


async def _connection(target: tuple[str, int], delay: float, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*target), 30)
    except (OSError, TimeoutError):
        writer.close()
        return
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_pump(reader, up_writer, delay))
            group.create_task(_pump(up_reader, writer, delay))
    except* OSError:
        pass  # a reset on either side ends the connection on both
    finally:
        for w in (writer, up_writer):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main(delay: float, routes: list[tuple[tuple[str, int], tuple[str, int]]]) -> None:
    servers = []
    for listen, target in routes:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, target: tuple[str, int] = target) -> None:
            await _connection(target, delay, r, w)
        servers.append(await asyncio.start_server(handler, *listen))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):  # stop at once: the kernel closes every socket
        loop.add_signal_handler(signum, os._exit, 0)
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every chunk, each direction")
    parser.add_argument("routes", nargs="+", metavar="LISTEN=TARGET", help="host:port=host:port")
    args = parser.parse_args()
    pairs = [tuple(_address(p) for p in route.split("=", 1)) for route in args.routes]
    asyncio.run(main(args.delay, pairs))  # type: ignore[arg-type]

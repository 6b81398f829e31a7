"""A transparent delaying TCP relay: tests/netns/relay.py's pumps, for connections the kernel redirects to it.

    python tproxy.py --delay 0.02 --port 9999

The lab routes every packet between its hosts through the relay namespace; there an iptables REDIRECT rule sends
each new TCP connection between hosts to this port, and the relay connects on to the connection's original
destination (SO_ORIGINAL_DST), delaying every chunk `--delay` seconds in both directions (a round trip grows by
twice it; set-up is not delayed). So processes that cannot be told a relay's address (containers on the host
network, listening on ports they pick) are delayed all the same. Prints "ready" once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "netns"))
from relay import _connection  # noqa: E402

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


def original_destination(writer: asyncio.StreamWriter) -> tuple[str, int]:
    sock: socket.socket = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


async def main(delay: float, port: int) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _connection(original_destination(writer), delay, reader, writer)

    server = await asyncio.start_server(handler, "0.0.0.0", port, backlog=1024)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, os._exit, 0)
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every chunk, each direction")
    parser.add_argument("--port", type=int, default=9999)
    args = parser.parse_args()
    asyncio.run(main(args.delay, args.port))

"""HEALTHCHECK of the mosaicd image: GET /healthz answers 200, on the port MOSAIC_PORT_FILE names (mosaicd writes it
there: `--port 0` under compose's host network) or MOSAIC_PORT (default 8000). A container of several nodes
(MOSAIC_NODES_PER_PROCESS=N: `mosaicd node --nodes-per-process`) is healthy when every member is: member I's port
is in MOSAIC_PORT_FILE.I, or MOSAIC_PORT + I (`DaemonOptions.member_fields`).

Run as `python -S mosaic-healthcheck`: a raw HTTP/1.0 request without site or urllib costs ~10 ms of CPU,
which matters when dozens of node containers share a few cores.
"""

import os
import socket


def port_of(member: int | None) -> int:
    port_file = os.environ.get("MOSAIC_PORT_FILE")
    port = int(os.environ.get("MOSAIC_PORT") or 8000)
    if port_file:
        try:
            with open(port_file if member is None else f"{port_file}.{member}") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            raise SystemExit(1) from None  # not listening yet
    return port + (member or 0)


def healthy(port: int) -> bool:
    host = os.environ.get("MOSAIC_HOST") or "127.0.0.1"
    with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port), 3) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        status = s.recv(64).split()
    return len(status) > 1 and status[1] == b"200"


count = int(os.environ.get("MOSAIC_NODES_PER_PROCESS") or 1)
members = [None] if count == 1 else list(range(count))
raise SystemExit(0 if all(healthy(port_of(m)) for m in members) else 1)

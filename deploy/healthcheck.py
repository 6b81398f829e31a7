"""HEALTHCHECK of the mosaicd image: GET /healthz on MOSAIC_PORT (default 8000) answers 200.

Run as `python -S mosaic-healthcheck`: a raw HTTP/1.0 request without site or urllib costs ~10 ms of CPU,
which matters when dozens of node containers share a few cores.
"""

import os
import socket

with socket.create_connection(("127.0.0.1", int(os.environ.get("MOSAIC_PORT") or 8000)), 3) as s:
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    status = s.recv(64).split()
raise SystemExit(0 if len(status) > 1 and status[1] == b"200" else 1)

"""HEALTHCHECK of the mosaicd image: GET /healthz answers 200, on the port MOSAIC_PORT_FILE names (mosaicd writes it
there: `--port 0` under compose's host network) or MOSAIC_PORT (default 8000).

Run as `python -S mosaic-healthcheck`: a raw HTTP/1.0 request without site or urllib costs ~10 ms of CPU,
which matters when dozens of node containers share a few cores.
"""

import os
import socket

port_file = os.environ.get("MOSAIC_PORT_FILE")
if port_file:
    try:
        with open(port_file) as f:
            port = int(f.read().strip())
    except (OSError, ValueError):
        raise SystemExit(1) from None  # not listening yet
else:
    port = int(os.environ.get("MOSAIC_PORT") or 8000)
host = os.environ.get("MOSAIC_HOST") or "127.0.0.1"
with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::") else host, port), 3) as s:
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    status = s.recv(64).split()
raise SystemExit(0 if len(status) > 1 and status[1] == b"200" else 1)

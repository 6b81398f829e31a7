"""A body's memory stays within --max-body-bytes until its handler is done, with or without a secret: four chunked
190 MiB bodies at once to an --insecure node (256 MiB limit) keep its peak RSS under twice the limit."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mosaicd.experiments.cluster import free_ports

LIMIT, BODY, PIECE = 256 << 20, 190 << 20, 1 << 20


def post_chunked(port: int) -> int:
    """POST a 190 MiB body in 1 MiB chunks (no Content-Length: the node cannot tell its size before reading it);
    the answer's status, or 0 where the node closed the connection (refused while it was sent)."""
    piece = b"\x00" * PIECE
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/fragments", body=(piece for _ in range(BODY // PIECE)),
                           headers={"Content-Type": "application/cbor"}, encode_chunked=True)
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_four_large_bodies_at_once_keep_the_insecure_nodes_memory_under_twice_the_limit(tmp_path: Path,
                                                                                          kit: Any) -> None:
    port = free_ports(1)[0]
    node = subprocess.Popen([sys.executable, "-m", "mosaicd", "node", "--insecure", "--host", "127.0.0.1", "--port",
                             str(port), "--barrier-url", f"http://127.0.0.1:{free_ports(1)[0]}", "--register-deadline",
                             "300", "--max-body-bytes", str(LIMIT), "--request-timeout", "5", "--out",
                             str(tmp_path / "node")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def healthy() -> bool:
            try:
                return kit.http("GET", f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200
            except OSError:
                return False

        kit.wait_until(healthy, 60, "the node's /healthz")
        before = peak_rss_mb(node.pid)
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(post_chunked, [port] * 4))
        took = time.monotonic() - started
        peak = peak_rss_mb(node.pid)
    finally:
        node.send_signal(signal.SIGINT)
        node.wait(timeout=30)
    print(f"figures: peak RSS {peak:.0f} MiB (before the bodies {before:.0f} MiB), 4 x 190 MiB in {took:.1f}s, "
          f"answers {statuses}")
    assert all(s in (0, 503) for s in statuses), statuses  # a registering node takes no fragments: 503 each
    assert peak < 2 * LIMIT / (1 << 20), f"peak RSS {peak:.0f} MiB with a {LIMIT >> 20} MiB body limit"


"""Every line of a --log-json log is JSON, the libraries' own included: aiohttp's "Error handling request" with its
traceback (a client that resets its connection mid-body) comes as one JSON line whose `exception` holds it."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any


def reset_mid_body(port: int, path: str) -> None:
    """A request whose body stops halfway, then a TCP reset (SO_LINGER 0): what a peer killed mid-send leaves."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000"
                  "\r\n\r\n".encode() + b"{" * 5000)
        time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_json_log_parses_line_by_line_after_connection_resets(tmp_path: Path, kit: Any) -> None:
    port_file, log = tmp_path / "port", tmp_path / "barrier.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*kit.by_hand, "barrier", "--log-json", "--nodes", "3", "--fanout", "2", "--host",
                                 "127.0.0.1", "--port", "0", "--port-file", str(port_file), "--out",
                                 str(tmp_path / "run")], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        kit.wait_until(lambda: port_file.exists() and port_file.read_text().strip(), 60, "the barrier's port file")
        port = int(port_file.read_text())
        for path in ("/v1/register", "/v1/arrive"):
            reset_mid_body(port, path)
        kit.wait_until(lambda: log.read_text().count("Error handling request") >= 2, 30,
                       "the barrier to log both resets")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    lines = log.read_text().splitlines()
    assert all(line.startswith("{") for line in lines), [line for line in lines if not line.startswith("{")]
    records = [json.loads(line) for line in lines]
    errors = [r for r in records if r.get("logger") == "aiohttp.server"]
    assert len(errors) == 2 and all("ConnectionResetError" in r["exception"] for r in errors), errors
    assert all(r["level"] == "error" and "timestamp" in r for r in errors)

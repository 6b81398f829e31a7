"""bench/transport.py: every variant (the upgraded connection and the nodes' fragments stream too) moves messages of
the size a node reads into a kept buffer, with nothing on stderr (no server error), over TCP and over TLS, and the
last line gives each one's CPU per message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mosaicd.daemon.http.body import ARRAY_FROM

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tls", [False, True])
def test_each_variant_moves_a_message_past_the_kept_buffers_size(tls: bool) -> None:
    size = ARRAY_FROM + 12_345  # over the size a node reads into a kept buffer, and no round number
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "transport.py"), "--messages", "4", "--size",
                           str(size), "--concurrency", "1", "--repeat", "1", *(["--tls"] if tls else [])],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["size"] == size and report["messages"] == 4 and report["tls"] is tls
    for kind in ("http", "thin", "node", "framed", "upgraded", "stream"):
        assert report[kind]["cpu_us_per_message"] > 0 and report[kind]["wall_s"] > 0, report
    for kind in ("node", "upgraded", "stream"):
        assert report[f"ratio_cpu_{kind}"] == round(report[kind]["cpu_us_per_message"]
                                                    / report["framed"]["cpu_us_per_message"], 3)

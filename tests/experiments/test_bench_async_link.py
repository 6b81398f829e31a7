"""bench/async_link.py: a real asynchronous cluster of daemons, signed, whose links send messages; the last line
gives each run's link seconds per message, the node processes' CPU and the medians, with nothing on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_asynchronous_cluster_reports_its_links() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "async_link.py"), "--nodes", "3", "--dim", "20000",
                           "--rounds", "8", "--repeat", "1"], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    (run,) = report["runs"]
    assert report["settings"]["insecure"] is False and report["settings"]["train"] is True
    assert run["steps"] == 3 * 8 and run["messages"] > 0 and run["ms_per_message"] > 0 and run["nodes_cpu_s"] > 0
    assert report["ms_per_message"] == run["ms_per_message"]  # the median of one run

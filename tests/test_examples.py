"""`examples/own_training_loop.py`, the `mosaicd.Peer` example the README points to: it runs to its end, and Ctrl-C
stops it cleanly with its run's summary saying so. A real process; four peers and a barrier on 127.0.0.1."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_training_loop.py"


def start() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(EXAMPLE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_peer_example_runs_to_its_end() -> None:
    proc = start()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    accuracies = [float(a) for a in re.findall(r"'(\d\.\d+)'", err.splitlines()[-1])]
    assert len(accuracies) == 4 and min(accuracies) > 0.5, err[-2000:]
    out = Path(re.search(r"outputs in (\S+)\)", err).group(1))  # type: ignore[union-attr]
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_ctrl_c_stops_the_peer_example_cleanly() -> None:
    proc = start()
    assert proc.stderr is not None
    first = proc.stderr.readline()
    out = Path(re.search(r"outputs in (\S+)", first).group(1))  # type: ignore[union-attr]
    end = time.monotonic() + 120
    while time.monotonic() < end and not (out / "summary.json").exists():  # the first round is released
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "interrupted" in summary["error"], summary

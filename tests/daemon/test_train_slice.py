"""--train-slice-ms (mosaicd/daemon/node/cpu_slice.py): a node's training thread asks the kernel for a longer CPU
slice; the nodes' training threads get the slice asked for, and the models do not depend on it."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.daemon.node.cpu_slice import get_slice_ms, set_slice, sliced

RUN = dict(nodes=4, rounds=4, fragments=2, fanout=2, seed=3)  # the quadratic task


def in_a_thread(fn: Any) -> Any:
    """`fn()` in a fresh thread (a slice is a thread's own), its result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


SUPPORTED = in_a_thread(lambda: set_slice(20)) and in_a_thread(lambda: (set_slice(20), get_slice_ms())[1]) == 20


def logged(path: Path, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x[:1] == "{"]
    return [x for x in lines if x.get("event") == event]


@pytest.mark.skipif(not SUPPORTED, reason="this kernel sets no custom slice (Linux >= 6.12)")
def test_a_sliced_call_runs_with_the_slice_asked_for_in_its_own_thread_only() -> None:
    told: list[float | None] = []
    call = sliced(lambda: get_slice_ms(), 37.5, told.append)
    assert in_a_thread(lambda: (call(), call())) == (37.5, 37.5)
    assert told == [37.5]  # once per thread
    assert in_a_thread(get_slice_ms) != 37.5  # another thread keeps the kernel's
    assert sliced(len, 0) is len  # 0: the kernel's slice, nothing wrapped


@pytest.mark.slow  # about 4 s each on 2 idle cores (5 processes start)
@pytest.mark.parametrize("secret", [True, False], ids=["signed", "plain"])
def test_cluster_with_a_training_slice_gives_simulates_models(tmp_path: Path, kit: Any, secret: bool) -> None:
    out = tmp_path / "run"
    command = kit.mosaicd if secret else kit.by_hand  # a user's `mosaicd cluster` makes a run secret; by hand: none
    proc = subprocess.run([*command, "cluster", *kit.flags(RUN), *([] if secret else ["--insecure"]),
                           "--train-slice-ms", "50", "--out", str(out), "--quiet"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN))  # what `mosaicd simulate` gives
    for rank in range(RUN["nodes"]):
        told = logged(out / "logs" / f"node-{rank}.log", "train_slice")
        assert told and {x["asked_ms"] for x in told} == {50}
        assert {x["kernel_ms"] for x in told} == ({50} if SUPPORTED else {None})

"""--event-loop (mosaicd/daemon/loop.py): every role runs on uvloop or on asyncio's own loop, says which, and the
models do not depend on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd import Settings
from mosaicd.cli import main
from mosaicd.daemon.loop import loop_factory, run
from mosaicd.settings import SettingsError

RUN = dict(nodes=4, rounds=4, fragments=2, fanout=2, seed=3)  # the quadratic task


def logged(path: Path, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of `event` in one of a run's logs."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x[:1] == "{"]
    return [x for x in lines if x.get("event") == event]


@pytest.mark.slow  # about 4 s each on 2 idle cores (5 processes start)
@pytest.mark.parametrize("secret", [True, False], ids=["signed", "plain"])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_cluster_on_either_loop_gives_simulates_models(tmp_path: Path, kit: Any, loop: str, secret: bool) -> None:
    out = tmp_path / "run"
    command = kit.mosaicd if secret else kit.by_hand  # a user's `mosaicd cluster` makes a run secret; by hand: none
    proc = subprocess.run([*command, "cluster", *kit.flags(RUN), *([] if secret else ["--insecure"]),
                           "--event-loop", loop, "--out", str(out), "--quiet"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_sha256"] == kit.reference_hashes(Settings(**RUN))  # what `mosaicd simulate` gives
    assert [x["event_loop"] for x in logged(out / "logs" / "barrier.log", "listening")] == [loop]
    for rank in range(RUN["nodes"]):
        assert [x["event_loop"] for x in logged(out / "logs" / f"node-{rank}.log", "registered")] == [loop]


def test_each_daemon_says_its_loop_in_its_status(tmp_path: Path, kit: Any) -> None:
    """The setting is each process's own (DaemonOptions): a barrier on asyncio, a node on uvloop, one run."""
    procs: dict[str, subprocess.Popen] = {}

    def start(role: str, *argv: str) -> int:
        """`role` started with `argv`; the port it listens on, once it does."""
        port_file = tmp_path / f"{role}.port"
        with open(tmp_path / f"{role}.log", "wb") as log:
            procs[role] = subprocess.Popen([*kit.by_hand, role, *argv, "--port", "0", "--port-file", str(port_file),
                                            "--out", str(tmp_path / role)], stdout=log, stderr=subprocess.STDOUT)

        def listening() -> str | None:
            if procs[role].poll() is not None:
                pytest.fail(f"{role} exited: {(tmp_path / f'{role}.log').read_text()[-2000:]}")
            return port_file.exists() and port_file.read_text() or None
        return int(kit.wait_until(listening, 60, f"the {role}'s port"))

    try:
        barrier = start("barrier", "--nodes", "3", "--event-loop", "asyncio")
        node = start("node", "--barrier-url", f"http://127.0.0.1:{barrier}", "--event-loop", "uvloop")
        views = {role: kit.http("GET", f"http://127.0.0.1:{port}/v1/status", timeout=5).json()
                 for role, port in (("barrier", barrier), ("node", node))}
    finally:
        kit.stop_all(procs)
    assert views["barrier"]["event_loop"] == "asyncio" and views["barrier"]["role"] == "barrier"
    assert views["node"]["event_loop"] == "uvloop" and views["node"]["phase"] == "registering"


@pytest.mark.parametrize("command", ["node", "barrier", "cluster"])
def test_a_bad_event_loop_is_a_usage_error_naming_the_flag(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--event-loop", "fast"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--event-loop (MOSAIC_EVENT_LOOP)" in err and "'auto', 'uvloop' or 'asyncio'" in err and "'fast'" in err


def test_uvloop_asked_for_where_it_is_missing_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails here as where it is not installed
    with pytest.raises(SettingsError, match=r"--event-loop \(MOSAIC_EVENT_LOOP\): uvloop is not installed"):
        Settings.load(event_loop="uvloop")
    with pytest.raises(SettingsError, match="--event-loop"):
        loop_factory("uvloop")
    assert loop_factory("auto") is None and Settings.load().event_loop == "auto"  # auto: asyncio's own loop


def test_auto_runs_on_uvloop_where_installed_and_asyncio_on_its_own() -> None:
    async def name() -> str:
        from mosaicd.daemon.loop import loop_name
        return loop_name()

    assert run(name(), "auto") == "uvloop" and run(name(), "uvloop") == "uvloop"
    assert run(name(), "asyncio") == "asyncio"

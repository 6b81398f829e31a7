"""Nodes pinned to one core take turns computing (`daemon/node/core_turn.py`): one at a time, each through its own
open file description of the core's file, and a holder that dies frees the turn."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from typing import Any

import pytest

from mosaicd.daemon.node import core_turn
from mosaicd.experiments.warm import core_turns

pytestmark = pytest.mark.quick

HOLD_S = 0.15


def _turns(shared_fd: int, spans: Any, starts: Any) -> None:
    core_turn.take_turns(shared_fd)
    starts.wait(10)
    for _ in range(2):
        spans.put(core_turn.on_core(_hold, os.getpid()))


def _hold(pid: int) -> tuple[int, float, float]:
    began = time.monotonic()
    time.sleep(HOLD_S)
    return pid, began, time.monotonic()


def test_processes_of_one_core_compute_one_at_a_time() -> None:
    ctx = multiprocessing.get_context("fork")
    spans, starts = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryFile() as file:
        procs = [ctx.Process(target=_turns, args=(file.fileno(), spans, starts)) for _ in range(3)]
        for proc in procs:
            proc.start()
    starts.set()
    got = sorted((spans.get(timeout=20) for _ in range(6)), key=lambda span: span[1])
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    assert len({pid for pid, _, _ in got}) == 3
    for (_, _, ended), (_, began, _) in zip(got, got[1:], strict=False):
        assert began >= ended - 0.005, got  # each turn begins once the one before it ended


def _holds_forever(shared_fd: int, inside: Any) -> None:
    core_turn.take_turns(shared_fd)
    core_turn.on_core(lambda: (inside.set(), time.sleep(60)))


def test_a_turn_held_by_a_process_that_dies_passes_on() -> None:
    ctx = multiprocessing.get_context("fork")
    inside = ctx.Event()
    with tempfile.TemporaryFile() as file:
        holder = ctx.Process(target=_holds_forever, args=(file.fileno(), inside))
        holder.start()
        assert inside.wait(10)
        mine = core_turn.CoreTurn.opened(os.dup(file.fileno()))
    assert mine is not None
    ran: list[str] = []
    waiting = threading.Thread(target=lambda: ran.append(mine.run(str, "ran")), daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not ran  # held by the other process
    os.kill(holder.pid, signal.SIGKILL)
    waiting.join(10)
    holder.join(10)
    assert ran == ["ran"] and holder.exitcode == -signal.SIGKILL


def test_a_process_without_turns_computes_at_once() -> None:
    assert core_turn.on_core(sum, [1, 2, 3]) == 6


def test_only_cores_that_two_or_more_nodes_share_get_a_turn() -> None:
    children = [{"name": "node-0", "cores": [0]}, {"name": "node-1", "cores": [1]}, {"name": "node-2", "cores": [0]},
                {"name": "node-3"}, {"name": "node-4", "cores": [0, 1]}, {"name": "node-5", "cores": [0, 1]}]
    turns = core_turns(children)
    try:
        assert list(turns) == [(0,)]
        assert os.fstat(turns[(0,)]).st_nlink == 0  # unlinked: gone with the last process that holds it
    finally:
        for fd in turns.values():
            os.close(fd)

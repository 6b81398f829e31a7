"""Nodes pinned to one core take turns computing (`daemon/node/core_turn.py`): one at a time, passing one token
through the core's pipe; a holder frozen or killed in its turn holds the others once, for their wait, and its token
is replaced."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest

from mosaicd.daemon.node import core_turn
from mosaicd.experiments.warm import core_turns

pytestmark = pytest.mark.quick

HOLD_S = 0.15


def one_token() -> tuple[int, int]:
    read, write = os.pipe()
    os.write(write, core_turn.TOKEN)
    return read, write


def _turns(read: int, write: int, spans: Any, starts: Any) -> None:
    core_turn.take_turns(read, write, 3)
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
    read, write = one_token()
    procs = [ctx.Process(target=_turns, args=(read, write, spans, starts)) for _ in range(3)]
    for proc in procs:
        proc.start()
    os.close(read)
    os.close(write)
    starts.set()
    got = sorted((spans.get(timeout=20) for _ in range(6)), key=lambda span: span[1])
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    assert len({pid for pid, _, _ in got}) == 3
    for (_, _, ended), (_, began, _) in zip(got, got[1:], strict=False):
        assert began >= ended - 0.005, got  # each turn begins once the one before it ended


def _holds_forever(read: int, write: int, inside: Any) -> None:
    core_turn.take_turns(read, write, 2)
    core_turn.on_core(lambda: (inside.set(), time.sleep(60)))


@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_a_holder_that_keeps_its_turn_holds_the_others_once_for_their_wait(how: str) -> None:
    """SIGSTOP or SIGKILL in its turn: the other node computes once its wait is over, and the token it writes then
    replaces the one kept: its next turn comes at once, the holder still frozen or gone."""
    ctx = multiprocessing.get_context("fork")
    inside = ctx.Event()
    read, write = one_token()
    holder = ctx.Process(target=_holds_forever, args=(read, write, inside))
    holder.start()
    try:
        assert inside.wait(10)
        mine = core_turn.CoreTurn(read, write, 2)
        assert mine.wait_s() == core_turn.WAIT_MIN_S
        os.kill(holder.pid, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        started = time.monotonic()
        held: list[bool] = []
        waiting = threading.Thread(target=lambda: held.append(mine.run(mine.held)), daemon=True)
        waiting.start()
        waiting.join(core_turn.WAIT_MIN_S + 10)
        waited = time.monotonic() - started
        assert held == [False], held  # computed without the turn, once its wait was over
        assert core_turn.WAIT_MIN_S - 0.05 <= waited < core_turn.WAIT_MIN_S + 5, waited
        started = time.monotonic()
        assert mine.run(mine.held) is True and time.monotonic() - started < 0.5  # the new token
        os.kill(holder.pid, signal.SIGKILL)  # frozen or gone, it never gave its token back
        holder.join(10)
    finally:
        if holder.is_alive():
            os.kill(holder.pid, signal.SIGKILL)
    os.set_blocking(read, False)
    tokens = os.read(read, 16)
    assert tokens == core_turn.TOKEN, tokens  # one: the new token
    os.close(read)
    os.close(write)


def test_a_process_without_turns_computes_at_once() -> None:
    assert core_turn.on_core(sum, [1, 2, 3]) == 6


def test_only_cores_that_two_or_more_nodes_share_get_a_turn_holding_one_token() -> None:
    children = [{"name": "node-0", "cores": [0]}, {"name": "node-1", "cores": [1]}, {"name": "node-2", "cores": [0]},
                {"name": "node-3"}, {"name": "node-4", "cores": [0, 1]}, {"name": "node-5", "cores": [0, 1]}]
    turns = core_turns(children)
    try:
        assert list(turns) == [(0,)] and turns[(0,)][2] == 2
        read, _, _ = turns[(0,)]
        os.set_blocking(read, False)
        assert os.read(read, 16) == core_turn.TOKEN
    finally:
        for read, write, _ in turns.values():
            os.close(read)
            os.close(write)

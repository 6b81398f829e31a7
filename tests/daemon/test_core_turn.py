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
from mosaicd.experiments.warm import core_turns, idle_turns

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


def _two_cores() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one core: no other core's turn to take")
    return cpus[0], cpus[1]


def _cores(a: int, b: int) -> tuple[dict[int, core_turn.Core], tuple[int, int]]:
    return {a: core_turn.Core(a, one_token(), os.pipe()), b: core_turn.Core(b, one_token(), os.pipe())}, os.pipe()


def _close(cores: dict[int, core_turn.Core], idle: tuple[int, int]) -> None:
    for fd in [*(fd for core in cores.values() for fd in core.fds()), *idle]:
        os.close(fd)


def _on(core: int, cores: dict[int, core_turn.Core], idle: tuple[int, int]) -> core_turn.CoreTurn:
    return core_turn.CoreTurn(*cores[core].token, 2, core, cores, idle)


def _where() -> set[int]:
    return os.sched_getaffinity(0)


def _tokens(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 16)
    except BlockingIOError:
        return b""


def test_a_node_waiting_for_its_core_computes_on_a_core_left_idle_and_gives_that_core_its_token_back() -> None:
    """Core a's last node gives its token back with none of a's waiting: a node of core b, whose turn another
    holds, takes a's turn and computes on core a, then gives a its token back and comes back to b."""
    a, b = _two_cores()
    cores, idle = _cores(a, b)
    mine: list[Any] = []
    try:
        assert _tokens(cores[b].token[0]) == core_turn.TOKEN  # b's turn is held, and stays held
        last_of_a = _on(a, cores, idle)
        assert last_of_a.run(lambda: "done") == "done"  # a's token back, nobody of a waiting: a says it is idle
        os.sched_setaffinity(0, {b})
        try:
            waiting = _on(b, cores, idle)
            started = time.monotonic()
            ran = threading.Thread(target=lambda: mine.append(waiting.run(lambda: (_where(), waiting.held()))))
            ran.start()
            ran.join(10)
            assert time.monotonic() - started < 0.5  # at once, not after its wait for b's turn
            assert mine == [({a}, True)]  # on core a, in a's turn
            assert _where() == {b}
            assert _tokens(cores[a].token[0]) == core_turn.TOKEN and _tokens(cores[b].token[0]) == b""
            assert cores[a].waiters() == 0 and cores[b].waiters() == 0
        finally:
            os.sched_setaffinity(0, {a, b})
    finally:
        _close(cores, idle)


def test_a_core_whose_own_node_waits_is_not_taken_and_the_waiting_node_stays_on_its_core() -> None:
    """Core a said it was idle, but one of its own nodes waits for its turn now: a node of core b leaves a's token
    to it, and computes on b once b's turn comes."""
    a, b = _two_cores()
    cores, idle = _cores(a, b)
    mine: list[Any] = []
    try:
        assert _tokens(cores[b].token[0]) == core_turn.TOKEN
        os.write(idle[1], core_turn.IDLE.pack(a))
        os.write(cores[a].waiting[1], core_turn.WAITING)  # a's own node, waiting
        os.sched_setaffinity(0, {b})
        try:
            waiting = _on(b, cores, idle)
            ran = threading.Thread(target=lambda: mine.append(waiting.run(_where)))
            ran.start()
            time.sleep(0.3)
            assert not mine and cores[b].waiters() == 1  # still waiting, and counted as b's
            os.write(cores[b].token[1], core_turn.TOKEN)  # b's turn comes
            ran.join(10)
            assert mine == [{b}]
            assert _tokens(cores[a].token[0]) == core_turn.TOKEN  # a's token left where it was
            assert cores[b].waiters() == 0
        finally:
            os.sched_setaffinity(0, {a, b})
    finally:
        _close(cores, idle)


def test_two_or_more_cores_with_turns_count_their_waiters_and_share_one_idle_pipe() -> None:
    children = [{"name": f"node-{i}", "cores": [i % 2]} for i in range(4)]
    turns = core_turns(children)
    made = idle_turns(turns)
    try:
        assert made is not None
        cores, idle = made
        assert sorted(cores) == [0, 1] and all(core.waiters() == 0 for core in cores.values())
        assert [cores[key[0]].token for key in turns] == [turn[:2] for turn in turns.values()]
        assert idle_turns({(0,): turns[(0,)]}) is None  # one core with turns: no other to take
    finally:
        if made is not None:
            for fd in [*(fd for core in made[0].values() for fd in core.waiting), *made[1]]:
                os.close(fd)
        for read, write, _ in turns.values():
            os.close(read)
            os.close(write)

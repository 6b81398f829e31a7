"""Turns on a shared core: where `mosaicd cluster` pins several nodes to one core (`--pin-nodes`), they compute one
at a time instead of the kernel slicing the core among all their trainers.

Eight trainers sliced on one core every millisecond or so each find the core's caches holding another's model and
batches: the tutorial job's trainers took ~17% more CPU than the same training in `simulate`, and one at a time
most of that goes (bench/README.md, issue 59 item 3). A node's event loop is not in a turn: its requests are
answered while another node of its core trains.

A core's turn is a token, one byte in a pipe its nodes share (the warm start's, `experiments/warm.py`: made before
the fork, so nothing is left behind): a node takes it by reading the byte and gives it back by writing one. A turn
is a hint, never a reason to stop: a node waits for it at most two turns of every node of its core (as long as its
own last computation took, `WAIT_ROUNDS` times per node) or `WAIT_MIN_S`, then computes without it and writes a
byte all the same. So a holder frozen (SIGSTOP, a debugger) or killed in its turn holds the others once, for that
wait, and the token it took is replaced; should the frozen one come back, two tokens go round, and the turns are
looser from then on, the models the same.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WAIT_MIN_S = 1.0
WAIT_ROUNDS = 2
TOKEN = b"t"


class CoreTurn:
    """One core's turn among the `sharing` node processes pinned to it: the ends of its pipe."""

    def __init__(self, read_fd: int, write_fd: int, sharing: int) -> None:
        os.set_blocking(read_fd, False)  # a token another node read first is not waited for here, but in select
        self._read, self._write, self._sharing = read_fd, write_fd, sharing
        self._last_s = 0.0
        self._holding = False

    def wait_s(self) -> float:
        """How long a node waits for its turn before it computes without."""
        return max(WAIT_MIN_S, WAIT_ROUNDS * self._sharing * self._last_s)

    def held(self) -> bool:
        """Whether this process computes in its core's turn now (for tests)."""
        return self._holding

    def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` in this core's turn: it waits while another node of the core holds it (`wait_s` at most)."""
        self._holding = self._take(time.monotonic() + self.wait_s())
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            self._last_s = time.perf_counter() - started
            self._holding = False
            os.write(self._write, TOKEN)  # the token taken back, or a new one for the one a holder kept

    def _take(self, deadline: float) -> bool:
        while True:
            try:
                if os.read(self._read, 1):
                    return True
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([self._read], [], [], left)


_turn: CoreTurn | None = None


def take_turns(read_fd: int, write_fd: int, sharing: int) -> None:
    """From now on this process computes in its core's turn, through the ends of the core's pipe, shared with
    `sharing` node processes in all (a forked node, before it starts: process-wide, as its pinning to the core is)."""
    global _turn
    _turn = CoreTurn(read_fd, write_fd, sharing)


def on_core(work: Callable[..., T], *args: object) -> T:
    """`work(*args)` (a node's training or evaluation, in its worker thread), in this process's turn where it takes
    turns."""
    if _turn is None:
        return work(*args)
    return _turn.run(work, *args)

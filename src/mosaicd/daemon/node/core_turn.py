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

No core stands idle while another's nodes queue. The cores' loads differ by what is not pinned (the barrier, the
launcher), so at a round's end one core's nodes are done while the other's still wait their turns: the tutorial job
left 25 core-ms of every ~450 idle so (bench/README.md, issue 59 item 3). Each core also counts its nodes waiting (a
byte each in a second pipe of its own), and a node that gives a core's token back with none of them waiting says so
in a pipe all the cores' nodes share (the core's number). A node waiting for its own core's turn reads that notice,
takes the idle core's token (where still none of its own waits) and computes on that core, its worker thread moved
there for the call (its event loop stays). A notice that comes late finds the token taken, and is dropped.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

WAIT_MIN_S = 1.0
WAIT_ROUNDS = 2
TOKEN = b"t"
WAITING = b"w"
IDLE = struct.Struct("!H")  # a core's number: its token came back and none of its nodes waits for it


@dataclass(frozen=True)
class Core:
    """One core's turn as every node of the run sees it: the token's pipe, and the waiters' (a byte per node of the
    core waiting for its turn: how many wait is how many bytes it holds)."""

    core: int
    token: tuple[int, int]
    waiting: tuple[int, int]

    def waiters(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self.waiting[0], termios.FIONREAD, b"\0\0\0\0"))[0]

    def fds(self) -> tuple[int, ...]:
        return (*self.token, *self.waiting)


class CoreTurn:
    """One core's turn among the `sharing` node processes pinned to it: the ends of its pipe. Where it knows the
    other cores' turns (`cores`, `idle`: a pipe where a core whose token came back with none of its nodes waiting
    says so), a node that waits takes an idle core's turn and computes there, so that no core stands idle while
    another's nodes queue (a round's end: the core with the barrier beside its nodes finishes last)."""

    def __init__(self, read_fd: int, write_fd: int, sharing: int, core: int | None = None,
                 cores: Mapping[int, Core] | None = None, idle: tuple[int, int] | None = None) -> None:
        os.set_blocking(read_fd, False)  # a token another node read first is not waited for here, but in select
        self._read, self._write, self._sharing = read_fd, write_fd, sharing
        self._last_s = 0.0
        self._holding = False
        self._core, self._cores, self._idle = core, dict(cores or {}), idle
        self._own = core if core is not None else -1  # -1: a core's number not known (no other core's turn)
        if idle is not None and core is not None and core in self._cores:
            os.set_blocking(idle[0], False)
            os.set_blocking(idle[1], False)
            for other in self._cores.values():
                os.set_blocking(other.token[0], False)
            self._own_cpus = os.sched_getaffinity(0)
        else:
            self._idle = None

    def wait_s(self) -> float:
        """How long a node waits for its turn before it computes without."""
        return max(WAIT_MIN_S, WAIT_ROUNDS * self._sharing * self._last_s)

    def held(self) -> bool:
        """Whether this process computes in its core's turn now (for tests)."""
        return self._holding

    def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` in this core's turn: it waits while another node of the core holds it (`wait_s` at most),
        or in an idle core's turn, on that core."""
        taken = self._take(time.monotonic() + self.wait_s())
        self._holding = taken is not None
        elsewhere = taken is not None and taken != self._own
        if elsewhere:
            _move_to({taken})  # this thread only: the node's event loop stays on its core
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            self._last_s = time.perf_counter() - started
            self._holding = False
            if elsewhere:
                os.write(self._cores[taken].token[1], TOKEN)
                _move_to(self._own_cpus)
            else:
                os.write(self._write, TOKEN)  # the token taken back, or a new one for the one a holder kept
            self._said_idle(taken if elsewhere else self._core)

    def _take(self, deadline: float) -> int | None:
        """The core whose turn this node took (its own: `_own`), or None: its wait ran out. Waiting, it is counted
        among its core's waiters, and hears of idle cores (where it knows the others)."""
        if self._got(self._read):
            return self._own
        mine = self._cores[self._own] if self._idle is not None else None
        watched = [self._read] if self._idle is None else [self._read, self._idle[0]]
        if mine is not None:
            os.write(mine.waiting[1], WAITING)
        try:
            while (left := deadline - time.monotonic()) > 0:
                ready = select.select(watched, [], [], left)[0]
                if self._got(self._read):
                    return self._own
                if self._idle is not None and self._idle[0] in ready and (core := self._idle_core()) is not None:
                    return core
            return None
        finally:
            if mine is not None:
                os.read(mine.waiting[0], 1)  # one waiter fewer (the bytes are alike: any one will do)

    def _idle_core(self) -> int | None:
        """The core an idle notice names, if its turn could be taken now (its token read): no node of its own waits."""
        try:
            said = os.read(self._idle[0], IDLE.size)  # type: ignore[index]
        except BlockingIOError:
            return None
        core = IDLE.unpack(said)[0] if len(said) == IDLE.size else None
        other = self._cores.get(core) if core is not None and core != self._core else None
        if other is None or other.waiters():
            return None
        return core if self._got(other.token[0]) else None

    def _said_idle(self, core: int | None) -> None:
        """Where no node of `core` waits for the token just given back, say so to the other cores' nodes."""
        if self._idle is None or core is None or self._cores[core].waiters():
            return
        try:
            os.write(self._idle[1], IDLE.pack(core))
        except BlockingIOError:  # notices nobody read fill the pipe: one more is not needed
            pass

    @staticmethod
    def _got(fd: int) -> bool:
        try:
            return bool(os.read(fd, 1))
        except BlockingIOError:
            return False


def _move_to(cpus: set[int]) -> None:
    """The calling thread on `cpus`; where it cannot go (a cpuset narrowed since), it stays: a turn taken elsewhere
    only makes a round shorter."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass


_turn: CoreTurn | None = None


def take_turns(read_fd: int, write_fd: int, sharing: int, core: int | None = None,
               cores: Mapping[int, Core] | None = None, idle: tuple[int, int] | None = None) -> None:
    """From now on this process computes in its core's turn, through the ends of the core's pipe, shared with
    `sharing` node processes in all (a forked node, before it starts: process-wide, as its pinning to the core is),
    or in an idle core's (`cores`, `idle`: `CoreTurn`)."""
    global _turn
    _turn = CoreTurn(read_fd, write_fd, sharing, core, cores, idle)


def on_core(work: Callable[..., T], *args: object) -> T:
    """`work(*args)` (a node's training or evaluation, in its worker thread), in this process's turn where it takes
    turns."""
    if _turn is None:
        return work(*args)
    return _turn.run(work, *args)

"""Turns on a shared core: where `mosaicd cluster` pins several nodes to one core (`--pin-nodes`), they compute one
at a time instead of the kernel slicing the core among all their trainers.

Eight trainers sliced on one core every millisecond or so each find the core's caches holding another's model and
batches: the tutorial job's trainers took ~10% more CPU than the same training in `simulate`, and one at a time
they take that much less (bench/README.md, issue 59 item 3). A node's event loop is not in a turn: its requests
are answered while another node of its core trains.

A turn is an exclusive `flock` on a file the nodes of a core share, each through an open file description of its
own (flock's locks belong to those): the kernel releases it when its holder exits, however it ends, so a turn
waits at most for the train or evaluation call of the node holding it. The file is the warm start's (`experiments/
warm.py`): opened and unlinked before the fork, so no run leaves one behind.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class CoreTurn:
    """One core's turn among the node processes pinned to it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def opened(cls, shared_fd: int) -> CoreTurn | None:
        """This process's own open file description of the file behind `shared_fd` (inherited at the fork, whose
        description, and so whose lock, every sibling shares); None where it cannot be reopened (no /proc): the
        node then computes without turns."""
        try:
            fd = os.open(f"/proc/self/fd/{shared_fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        os.close(shared_fd)
        return cls(fd)

    def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` within this core's turn: it waits while another node of the core holds it."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            return work(*args)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


_turn: CoreTurn | None = None


def take_turns(shared_fd: int) -> None:
    """From now on this process computes in its core's turn (a forked node, before it starts: process-wide, as its
    pinning to the core is)."""
    global _turn
    _turn = CoreTurn.opened(shared_fd)


def on_core(work: Callable[..., T], *args: object) -> T:
    """`work(*args)` (a node's training or evaluation, in its worker thread), in this process's turn where it takes
    turns."""
    if _turn is None:
        return work(*args)
    return _turn.run(work, *args)

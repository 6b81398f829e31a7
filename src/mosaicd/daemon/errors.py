"""How a run can end for one process before it is done: what the node and the barrier raise to their entry point
(`entry.run_entry` prints it as one line and exits 1)."""

from __future__ import annotations


class PeerDropped(RuntimeError):
    """The barrier dropped this node from the run (it missed too many rounds, or fell too far behind)."""


class RunEnded(RuntimeError):
    """The run ended before this process was done: it failed (too few members left, a write that could not be
    made, the barrier's host stopped...), or this node left it."""


class OutputError(RuntimeError):
    """A write this process could not make (a full disk...): the run ends, failed, at its last saved decision, so
    that it can be resumed once there is room."""

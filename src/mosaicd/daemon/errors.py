"""How a run can end for one process before it is done: what the node and the barrier raise to their entry point
(`entry.run_entry` prints it as one line and exits 1; 130 for a run a person stopped)."""

from __future__ import annotations

from mosaic_proto.barrier_rules import ended_status


class PeerDropped(RuntimeError):
    """The barrier dropped this node from the run (it missed too many rounds, or fell too far behind)."""


class RunEnded(RuntimeError):
    """The run ended before this process was done: it failed (too few members left, a write that could not be
    made, the barrier's host stopped...), or this node left it."""


class RunInterrupted(RunEnded):
    """The run ended because a person stopped it (its members told to stop, or rank 0 of a peer list, which hosts
    the barrier): no error, and resumable; `entry.run_entry` says it as it is and exits 130."""


def run_ended(reason: str, when: str = "") -> RunEnded:
    """The error of a run that ended early for `reason` (`when`: after which round): RunInterrupted where a person
    stopped it (the one rule: `ended_status`), else RunEnded, "the run failed"."""
    if ended_status(reason) == "interrupted":
        return RunInterrupted(f"the run ended{when}: {reason}")
    return RunEnded(f"the run failed{when}: {reason}")


class OutputError(RuntimeError):
    """A write this process could not make (a full disk...): the run ends, failed, at its last saved decision, so
    that it can be resumed once there is room."""

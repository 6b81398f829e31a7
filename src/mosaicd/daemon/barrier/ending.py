"""A run the barrier ends early, failed: a write that could not be made (a full disk...), or the process hosting
it told to stop. Nothing more is journaled, so the run can be resumed from its last saved decision."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier


def fail_output(barrier: Barrier, exc: OSError) -> None:
    """A write failed (a full disk...): the run ends, failed, at its last saved decision (the journal is
    replaced atomically, so it stays whole); once there is room, `--resume` (or the barrier started again)
    goes on from that decision."""
    path = exc.filename or barrier.options.out
    barrier.log.error("output_failed", path=str(path), error=str(exc), detail="the run stops at its last saved "
                   "decision: free space, then resume it")
    end_failed(barrier, f"cannot write {path}: {exc.strerror or exc}")

def end_failed(barrier: Barrier, reason: str) -> None:
    """End the run now, failed (a write that failed, the process told to stop): nothing more is saved to the
    journal, so the run can be resumed from its last decision; every waiting node hears `reason`."""
    if barrier.output_error is not None or barrier.done.is_set():
        return
    barrier.output_error = reason
    barrier.log.error("run_failed", detail=reason)
    barrier.state.fail(reason)
    try:
        barrier.recorder.fail(reason, left=list(barrier.state.left))
    except OSError:
        pass
    barrier._published.set()
    barrier._published = asyncio.Event()
    barrier.done.set()

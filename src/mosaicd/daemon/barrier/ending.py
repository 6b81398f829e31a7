"""How the barrier ends a run: summary.json after the last release, once its evaluations are done; or early,
failed: a write that could not be made (a full disk...), or the process hosting it told to stop. Nothing more
is journaled after a failure, so the run can be resumed from its last saved decision."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mosaic_proto import BarrierPhase, Release
from mosaicd.outputs import robustness_summary

if TYPE_CHECKING:
    from mosaicd.daemon.barrier.barrier import Barrier


async def end_after_evaluations(barrier: Barrier, release: Release) -> None:
    """The run's last release: summary.json once its evaluations are done (nobody waits for them meanwhile)."""
    try:
        await barrier.evaluator.drain()
        record_end(barrier, release)
    except OSError as exc:
        fail_output(barrier, exc)


def record_end(barrier: Barrier, release: Release) -> None:
    """summary.json says how the run ended (failed: why, and who left first); then `done`. Also called when the
    barrier's process stops while a failed run still evaluates its last models: it is recorded failed at once.
    OSError: it could not be written (`fail_output`)."""
    if barrier.done.is_set():
        return
    outcome = {"members": list(release.members), "dropped": list(release.dropped),
               "addresses": list(barrier.state.addresses), "events": [e.to_json() for e in barrier.state.events],
               **robustness_summary(barrier.run),
               **({"resumed_at": barrier.resumed_at} if barrier.resumed_at is not None else {})}
    if barrier.state.phase is BarrierPhase.FAILED:
        barrier.log.error("run_failed", detail=barrier.state.failure)
        first = next(iter(barrier.leave_reasons.items()), None)
        why = f"; rank {first[0]} left first: {first[1]}" if first else ""
        barrier.recorder.fail(f"{barrier.state.failure or 'failed'}{why}", **outcome, left=list(barrier.state.left))
    else:
        barrier.recorder.finish(barrier.evaluator.final_vectors, **outcome, left=list(barrier.state.left))
    barrier.done.set()


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


def answered(barrier: Barrier, rank: int) -> None:
    """`rank` got an answer to an arrival or a leave: if the run has failed, that answer said so."""
    if barrier.state.phase is BarrierPhase.FAILED and rank in barrier.state.live:
        barrier.heard_failure.add(rank)


def unheard(barrier: Barrier, own: int) -> list[int]:
    """The live members other than `own` not yet told that the run failed: rank 0 serves until this is empty."""
    return [r for r in barrier.state.live if r != own and r not in barrier.heard_failure]

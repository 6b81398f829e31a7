"""How the barrier ends a run: summary.json after the last release, once its evaluations are done; or early,
failed: a write that could not be made (a full disk...), or the process hosting it told to stop. Nothing more
is journaled after a failure, so the run can be resumed from its last saved decision.

`RunEnd` writes the outcome, once, and then sets `done`; `Barrier` decides when (`Barrier.apply`, for a
`Failure` of the state: `Barrier.end_failed`, `Barrier.fail_output`, `Barrier.fail_registration`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from mosaic_proto import BarrierState, Release
from mosaic_proto.barrier_rules import ended_status
from mosaicd.outputs import RunRecorder, robustness_summary
from mosaicd.settings import RunConfig


class RunEnd:
    """The run's outcome in summary.json (finished, or failed and why, and who left first), then `done`."""

    def __init__(self, recorder: RunRecorder, log: Any, resumed_at: int | None = None,
                 stopped: dict[str, Any] | None = None, stopped_at: int | None = None) -> None:
        """`resumed_at`: the open round a barrier resumed the run at (its journal; where it is chosen later,
        `resumed`); summary.json says so. `stopped`: the summary the run left when it stopped (its resumes before
        this one, and why it stopped), at the open round `stopped_at`."""
        self.recorder, self.log, self.resumed_at = recorder, log, None
        self.stopped, self.stopped_at = stopped or {}, stopped_at
        self.done = asyncio.Event()
        self.output_error: str | None = None  # why the run was ended early (`ended_early`): nothing more is saved
        self.leave_reasons: dict[int, str] = {}  # rank -> why it left, in the order they left
        self.interrupted_by: list[int] = []  # the members whose stop interrupted the run (`interrupted`)
        self.collected: dict[str, Any] | None = None  # --sync async: the summary the collector wrote (`reported`)
        if resumed_at is not None:
            self.resumed(resumed_at)

    def resumed(self, round: int) -> None:
        """The run goes on at `round`: summary.json says so from now on (`resumed_at`), and keeps every resume of
        the run (`resumed`: the round it went on at, the round it had stopped at, when, and why it had stopped
        where its summary said so)."""
        self.resumed_at = round
        earlier = self.stopped.get("resumed")
        why = self.stopped.get("error") if self.stopped.get("status") in ("failed", "interrupted") else None
        self.recorder.note("resumed", [*(earlier if isinstance(earlier, list) else []), {
            "round": round, "stopped_at_round": self.stopped_at, "at": utc_now(), "stopped": why}])

    def interrupted(self, reason: str, ranks: list[int], left: list[int]) -> None:
        """The run is interrupted because members were told to stop (`ranks`: every one so far; one told to stop
        after that is counted too, and summary.json said again): summary.json says so (`members_stopped`), a barrier
        started again on it waits for every member to come back with its checkpoints (`BarrierState.stop`); then
        `done`. Said at warning by the runner, not as a failure."""
        if (self.output_error is not None or self.done.is_set()) and not self.interrupted_by:
            return
        self.interrupted_by, self.output_error = ranks, reason
        self.recorder.note("members_stopped", ranks)
        try:
            self.recorder.fail(reason, left=list(left))
        except OSError:
            pass
        self.done.set()

    def left(self, rank: int, reason: str) -> None:
        self.leave_reasons.setdefault(rank, reason)

    def record(self, release: Release, state: BarrierState, run: RunConfig, final_vectors: dict[int, np.ndarray]
               ) -> None:
        """summary.json says how the run ended with `release` (failed: why, and who left first); then `done`. Also
        called when the barrier's process stops while a failed run still evaluates its last models: it is recorded
        failed at once. OSError: it could not be written (`Barrier.fail_output`)."""
        if self.done.is_set():
            return
        resumed = {"resumed_at": self.resumed_at} if self.resumed_at is not None else {}
        outcome = {"members": list(release.members), "dropped": list(release.dropped),
                   "addresses": list(state.addresses), "events": [e.to_json() for e in state.events],
                   **robustness_summary(run), **resumed}
        if state.phases.failed:
            self.log.error("run_failed", detail=state.failure)
            first = next(iter(self.leave_reasons.items()), None)
            why = f"; rank {first[0]} left first: {first[1]}" if first else ""
            self.recorder.fail(f"{state.failure or 'failed'}{why}", **outcome, left=list(state.left))
        else:
            self.recorder.finish(final_vectors, **outcome, left=list(state.left))
        self.done.set()

    def ended_early(self, reason: str, left: list[int]) -> bool:
        """The run ends now, failed, for `reason` (False: it has ended already): summary.json says why, then `done`.
        Interrupted (a peer list's rank 0 told to stop: `ended_status`) is said at warning, not an error."""
        if self.output_error is not None or self.done.is_set():
            return False
        self.output_error = reason
        if ended_status(reason) == "interrupted":
            self.log.warning("interrupted", detail=reason)
        else:
            self.log.error("run_failed", detail=reason)
        try:
            self.recorder.fail(reason, left=list(left))
        except OSError:
            pass
        self.done.set()
        return True

    def reported(self, summary: dict[str, Any]) -> None:
        """--sync async: the members' reports collected and summary.json written (`daemon/barrier/collector.py`):
        the run ended, as that summary says; then `done`."""
        if self.done.is_set():
            return
        self.collected = summary
        self.done.set()

    def registration_failed(self, reason: str) -> None:
        """Registration could not complete: the run ends (summary.json says why). OSError: it could not be written."""
        self.log.error("registration_failed", detail=reason)
        self.recorder.fail(f"registration failed: {reason}")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

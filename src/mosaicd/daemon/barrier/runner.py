"""The one place the barrier runs what `mosaic_proto.BarrierState` decides, in the one order: journal, timers, records,
notices (as hyper-h2's connection runs one side effect per transition of its table).

`DecisionRunner.decide` is the one way in: it feeds the state one input (a request, the clock, the daemon) and `apply`
runs the decision it returns: save it where the decision says it is `journaled` (journal.py, before anyone hears of
it: a restarted barrier never takes back what a node heard), re-arm the timers at the times the state says (the open
round's `deadline`, the registration's `registration_deadline`, the held leaves' `held.until`), record it (logs,
metrics, nodes.csv, the collections of evaluation rounds), then tell whoever waits for it (`Notices`, the
registration's long polls). A failure is never saved: the run resumes from the last decision before it. `Barrier`
(barrier.py) is this runner with the barrier's requests around it; it decides nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from mosaic_proto import (
    SNAPSHOTS_KEPT,
    STOP_HOLD_S,
    BarrierDecision,
    BarrierError,
    BarrierReason,
    BarrierState,
    Failure,
    Held,
    Joined,
    Left,
    Rebound,
    Release,
    Roster,
    Withdrawal,
)
from mosaic_proto.barrier_rules import ended_line
from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.barrier.ending import RunEnd
from mosaicd.daemon.barrier.evaluator import NetworkEvaluator
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.daemon.barrier.release_log import ReleaseLog
from mosaicd.outputs import RunRecorder, is_eval_round
from mosaicd.settings import DaemonOptions, RunConfig

Asked = TypeVar("Asked")  # what a call on the state returns (`decide`)


class DecisionRunner:
    """A `BarrierState` and what runs its decisions: the journal, the deadline timer, the records, the notices."""

    def __init__(self, state: BarrierState, run: RunConfig, options: DaemonOptions, recorder: RunRecorder, log: Any,
                 ending: RunEnd, keyring: Any, evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None
                 ) -> None:
        """`keyring`: the run's (empty: unsigned); `evaluate(run, vectors)`: the models' network metrics (None:
        final models only)."""
        self.state, self.run, self.options, self.recorder, self.log = state, run, options, recorder, log
        self.ending, self.keyring = ending, keyring
        self.done = ending.done
        self.metrics = BarrierMetrics(run)
        self.notices = Notices({t: state.notice(r).to_json() for t, r in state.released.items()})
        self.evaluator = NetworkEvaluator(options, keyring, evaluate, recorder, self.metrics, log,
                                          on_output_error=self.fail_output)
        self.releases = ReleaseLog(recorder, self.metrics, log)
        self.history = self.releases.history  # per released round: duration, mean phase seconds, stragglers
        self.stopping = False  # interrupt(): nothing more is decided
        self._collections: dict[int, asyncio.Task] = {}
        self.recollect: list[int] = []  # evaluations a resumed run collects with its first release (`collect_again`)
        self._deadline = _Timer(self._on_deadline)  # at the open round's deadline
        self._registration = _Timer(self._on_deadline)  # at the registration's (or a resumed run's members')
        self._held = _Timer(self._on_held)  # when the leaves of members told to stop apply
        self._tasks: set[asyncio.Task] = set()
        self._ending: Release | None = None  # the last release, while its evaluations drain

    def go_on_from(self, state: BarrierState) -> None:
        """The run goes on from `state` (an earlier round the journal keeps): what the nodes heard is its."""
        self.state = state
        self.notices.heard = {t: state.notice(r).to_json() for t, r in state.released.items()}

    def collect_again(self, missing: list[int]) -> None:
        """Evaluations a crash cut short: collected with the next release's (its members are back and running then,
        whether they kept running or started again)."""
        self.recollect = missing

    def heard(self, decision: BarrierDecision) -> None:
        """Those waiting for a `Roster`, every member back or the registration's `Failure` hear it (the registration's
        long polls: `Barrier`)."""

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    @property
    def output_error(self) -> str | None:
        """Why the run was ended early (`end_failed`): nothing more is saved."""
        return self.ending.output_error

    @property
    def failure(self) -> str | None:
        """Why the run failed, as the nodes and people hear it (the last reason it was ended for)."""
        return self.ending.output_error or self.state.failure

    def close_roster(self, run: RunConfig) -> None:
        """Every expected node registered: the roster is made, the run (`run`: with the node count) begins."""
        self.run = run
        self.decide(lambda state, now: state.close(now, run.min_members))

    def decide(self, ask: Callable[[BarrierState, float], Asked]) -> Asked:
        """Feed the state one input (`ask(state, now)`: a call on it) and run what it decided (`apply`): the one way
        a request, the clock or the daemon changes the run. BarrierError: the state refused it, or its decision
        could not be saved (the run ended, failed: `fail_output`)."""
        decided = ask(self.state, self.now())
        self.apply(decided if isinstance(decided, BarrierDecision) else None)
        return decided

    def apply(self, decision: BarrierDecision | None) -> None:
        """The one place a decision is run, in the one order: journal (where the decision is `journaled`: before
        anyone hears of it), the timers (at the times the state says now; `decision` None: nothing was decided,
        only they are run), records, notices. BarrierError (run_failed) where the journal cannot be saved: the run
        ends at its last saved decision, and `fail_output` told everyone. A failure is never saved: the run resumes
        from before it."""
        if decision is not None and decision.journaled:
            self.save_journal()
        self._arm_timers()
        if decision is None:
            return
        release = decision if isinstance(decision, Release) else getattr(decision, "release", None)
        try:
            self._record(decision)
            if release is not None:
                self._record_release(release)
        except OSError as exc:
            self.fail_output(exc)
            if release is not None:  # its nodes hear that the run failed, not the release
                return
        self._tell(decision)
        if release is not None:
            self._tell_release(release)

    def _arm_timers(self) -> None:
        """Step 2 of `apply`: the timers at the times the state says (the open round's deadline: every wait ends,
        whether or not anyone arrives; the registration's, which ends the run unless it completed; when the held
        leaves apply), none once the barrier stops. An asynchronous run (--sync async) opens no round: its roster is
        the membership only, and no round's deadline runs."""
        self._deadline.at(None if self.stopping or str(self.run.sync) == "async" else self.state.deadline)
        self._registration.at(None if self.stopping else self.state.registration_deadline)
        self._held.at(None if self.stopping else self.state.held.until)

    def _record(self, decision: BarrierDecision) -> None:
        """Step 3 of `apply`: the decision in the logs, metrics and files."""
        state = self.state
        if isinstance(decision, Roster):
            self.recorder.settings["nodes"] = len(decision.addresses)
            self.recorder.settings.update(decision.ran)  # what the nodes said they run
            self.metrics.members.set(len(decision.addresses))
            self.log.info("registration_closed", members=len(decision.addresses))
            self.evaluator.prepare(self.run)
        elif isinstance(decision, Withdrawal):
            self.metrics.registered.set(decision.registered)
            self.log.warning("withdrew", address=decision.address, reason=decision.reason,
                             registered=decision.registered,
                             expected=state.expected)
        elif isinstance(decision, Rebound):
            self.log.info("rebound", rank=decision.rank, address=decision.address,
                          waiting_for=list(decision.waiting_for))
            if decision.all_back:
                self.log.info("resumed_all", round=decision.round, live=len(state.live))
        elif isinstance(decision, Joined):
            self.log.info("joining", rank=decision.rank, address=decision.address, from_round=decision.from_round)
        elif isinstance(decision, Left):
            self.ending.left(decision.rank, decision.reason)
            self.metrics.left.inc()
            self.log.info("left", rank=decision.rank, reason=decision.reason, live=len(state.live), round=state.round)
        elif isinstance(decision, Held):
            self.log.info("leave_held", rank=decision.rank, reason=decision.reason, seconds=STOP_HOLD_S)
        elif isinstance(decision, Failure) and decision.registration:
            self.ending.registration_failed(decision.reason)
        elif isinstance(decision, Failure) and decision.stopped:  # a person stopped the run: resumable (comeback.py)
            self.log.warning("interrupted", ranks=list(decision.stopped), detail=decision.reason)
            self.ending.interrupted(decision.reason, list(decision.stopped), state.left)
        elif isinstance(decision, Failure):
            self.ending.ended_early(decision.reason, state.left)

    def _record_release(self, release: Release) -> None:
        """Step 3 for a release: its rows, and the collections of the models of an evaluation round."""
        t = release.round
        self.releases.record(release, self.state.closed[release.round], self.now(), self.evaluator.last_metrics)
        due = [*self.recollect, *([t - 1] if t >= 1 and is_eval_round(t - 1, self.run) else [])]
        self.recollect = []
        if due:  # one after the other, so that their rows are written in round order
            live = {r: self.state.addresses[r] for r in self.state.live}
            self._collections[due[0]] = self._spawn(self.evaluator.collect_rounds(self.run, due, live,
                                                                                  release.finished))

    def _tell(self, decision: BarrierDecision) -> None:
        """Step 4 of `apply`: whoever waits for the decision hears it."""
        if isinstance(decision, Roster | Rebound):
            self.heard(decision)
        elif isinstance(decision, Failure):
            if decision.registration:
                self.done.set()
                self.heard(decision)
            self.notices.wake()

    def _tell_release(self, release: Release) -> None:
        """Step 4 for a release: its notice, once the collections whose snapshots the nodes would drop on moving on
        are done (at the end, after the final models are collected, but before they are evaluated: nodes never
        wait for an evaluation)."""
        waits = [self._collections.pop(e) for e in [e for e in self._collections
                                                    if e + SNAPSHOTS_KEPT <= release.round or release.finished]]
        if waits:
            self._spawn(self._tell_after(waits, release))
            return
        self.notices.put(release.round, self.state.notice(release).to_json(), SNAPSHOTS_KEPT)
        if release.finished:  # the nodes are free to go once their models are collected; evaluation goes on
            self._ending = release
            self._spawn(self._end_after_evaluations(release))

    async def _tell_after(self, waits: list[asyncio.Task], release: Release) -> None:
        try:
            for task in waits:
                await task
        except OSError as exc:
            self.fail_output(exc)
            return
        self._tell_release(release)

    def save_journal(self) -> None:
        """Save the state before anyone hears of it; a write that fails ends the run (`fail_output`)."""
        if self.stopping:
            raise stopping()
        if self.output_error is not None:  # the journal stays at the last decision that could be saved
            raise BarrierError(BarrierReason.RUN_FAILED, ended_line(self.output_error))
        try:
            barrier_journal.save(self.options.out, self.run, self.state, self.recorder.started, bool(self.keyring))
        except OSError as exc:
            self.fail_output(exc)
            raise BarrierError(BarrierReason.RUN_FAILED, ended_line(str(self.output_error))) from None

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_published(self, round: int, limit: float) -> dict[str, Any]:
        return await self.notices.wait(round, limit, self.now, self._refusal)

    def _refusal(self) -> BarrierError | None:
        """Why a long poll ends now, unanswered (None: it goes on waiting)."""
        if self.stopping:
            return stopping()
        if self.state.phases.failed:
            return BarrierError(BarrierReason.RUN_FAILED, ended_line(str(self.failure)))
        return None

    def _on_deadline(self, due: float) -> None:
        """The clock reached the open round's deadline (the timer was `due` then): the state releases it (or, early,
        or taken late by a barrier that was frozen, `apply` re-arms: `BarrierState.tick`); or the registration's:
        the run fails unless it completed."""
        with _nobody_waits():
            self.decide(lambda state, now: state.tick(now, due))

    def _on_held(self, due: float) -> None:
        """The clock reached `held.until`: the held leaves apply, one decision each."""
        with _nobody_waits():
            while not self.stopping and self.decide(lambda state, now: state.leave_held(now)) is not None:
                pass

    async def _end_after_evaluations(self, release: Release) -> None:
        """The run's last release: summary.json once its evaluations are done (nobody waits for them meanwhile)."""
        try:
            await self.evaluator.drain()
            self.ending.record(release, self.state, self.run, self.evaluator.final_vectors)
        except OSError as exc:
            self.fail_output(exc)

    def end_failed(self, reason: str) -> None:
        """End the run now, failed (a write that failed, the process told to stop): nothing more is saved to the
        journal, so the run can be resumed from its last decision; every waiting node hears `reason`."""
        if self.output_error is not None or self.done.is_set():
            return
        self.decide(lambda state, now: state.end(reason))

    def fail_output(self, exc: OSError) -> None:
        """A write failed (a full disk...): the run ends, failed, at its last saved decision (the journal is
        replaced atomically, so it stays whole); once there is room, `--resume` (or the barrier started again)
        goes on from that decision."""
        path = exc.filename or self.options.out
        self.log.error("output_failed", path=str(path), error=str(exc), detail="the run stops at its last saved "
                       "decision: free space, then resume it")
        self.end_failed(f"cannot write {path}: {exc.strerror or exc}")

    async def stop(self) -> None:
        """The process stops: a failed run still evaluating its last models is recorded as failed now."""
        if self._ending is not None and self.state.phases.failed:
            try:
                self.ending.record(self._ending, self.state, self.run, self.evaluator.final_vectors)
            except OSError as exc:
                self.fail_output(exc)
        self.interrupt()

    async def settle(self, limit: float) -> None:
        """The run stopped before its end (failed, interrupted, the process told to stop): the evaluations whose models
        were collected get up to `limit` seconds to write their rows, which a restart could not have again."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.evaluator.drain()), limit)

    def interrupt(self) -> None:
        """Decide nothing more; every waiting arrival is answered 503 barrier_stopping now. On Ctrl-C the journal so
        stays where the console says (as after a SIGKILL): the nodes retry against the barrier started again."""
        self.stopping = True
        self._deadline.at(None)
        self._registration.at(None)
        self._held.at(None)
        for task in list(self._tasks):
            task.cancel()
        self.notices.wake()


def _nobody_waits() -> contextlib.suppress:
    """The clock as an input: nobody waits on it for an answer. A decision that could not be saved (BarrierError)
    ended the run, and `fail_output` told every waiting node."""
    return contextlib.suppress(BarrierError)


class _Timer:
    """One timer of the runner's (`DecisionRunner._arm_timers`, step 2 of `apply`): armed at the time the state
    says, re-armed where it moved, none at None."""

    def __init__(self, fire: Callable[[float], None]) -> None:
        """`fire(due)`: called with the time the timer was due (the loop may take it later: a frozen process)."""
        self._fire = fire
        self._when: float | None = None
        self._handle: asyncio.TimerHandle | None = None

    def at(self, when: float | None) -> None:
        if when == self._when and (self._handle is not None or when is None):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._when, self._handle = when, None
        if when is not None:
            self._handle = asyncio.get_running_loop().call_at(when, self._fired)

    def _fired(self) -> None:
        due, self._when, self._handle = self._when, None, None
        self._fire(due)


def stopping() -> BarrierError:
    return BarrierError(BarrierReason.BARRIER_STOPPING, "the barrier is stopping (Ctrl-C): retry; started again "
                        "with the same --out, it goes on with the run")


class Notices:
    """The kept releases as the nodes heard them (`ReleaseNotice` JSON, by round), and the long polls waiting for the
    next one."""

    def __init__(self, heard: dict[int, dict[str, Any]]) -> None:
        self.heard = heard
        self._event = asyncio.Event()

    def put(self, round: int, notice: dict[str, Any], kept: int) -> None:
        self.heard[round] = notice
        self.heard.pop(round - kept, None)
        self.wake()

    def wake(self) -> None:
        """Every long poll looks again (a release, or the run ended)."""
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, round: int, limit: float, now: Callable[[], float],
                   refusal: Callable[[], BarrierError | None]) -> dict[str, Any]:
        """Until round `round` is released (its notice), `refusal()` says why not, or `limit` seconds passed."""
        end = now() + limit
        while round not in self.heard:
            if (refused := refusal()) is not None:
                raise refused
            try:  # asyncio.timeout, not wait_for: no task per long poll
                async with asyncio.timeout(max(end - now(), 0)):
                    await self._event.wait()
            except TimeoutError:
                raise BarrierError(BarrierReason.BARRIER_TIMEOUT, f"round {round} was not released in time") from None
        return self.heard[round]

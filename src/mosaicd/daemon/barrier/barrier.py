"""The barrier process around `mosaic_proto.BarrierState`: long polls, the clock, snapshots, outputs.

`BarrierState` decides (ranks, releases, stragglers, drops, who is back, how the run ends); this adapter feeds it
requests and the clock and runs what each decision calls for: save it (barrier_journal.py, before anyone hears of
it), re-arm the deadline timer, record it, then tell the waiting nodes. The I/O that follows a release is off the
round's critical path: it writes the round's node rows, then pulls the nodes' model snapshots at evaluation
rounds and evaluates them in a worker thread while the next rounds go on. Nodes keep their last
`SNAPSHOTS_KEPT` snapshots, so a collection must end before the release that would drop its snapshot.

A barrier started again with the same --out resumes the run from its journal, while the nodes retry their arrivals
(--barrier-grace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mosaic_proto import (
    SNAPSHOTS_KEPT,
    BarrierError,
    BarrierPhase,
    BarrierReason,
    BarrierState,
    Left,
    NodeReport,
    Release,
)
from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.barrier.comeback import Comeback
from mosaicd.daemon.barrier.ending import RunEnd
from mosaicd.daemon.barrier.evaluator import NetworkEvaluator
from mosaicd.daemon.barrier.layouts import LayoutClaims
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.daemon.barrier.refusals import WHY, Refusals
from mosaicd.daemon.barrier.registration import Registrar
from mosaicd.daemon.barrier.release_log import ReleaseLog
from mosaicd.daemon.barrier.stops import STOP_HOLD_S, StoppedMembers
from mosaicd.daemon.deadlines import release_wait
from mosaicd.daemon.errors import OutputError
from mosaicd.daemon.http.auth import Secret
from mosaicd.logs import get_logger
from mosaicd.outputs import RunRecorder, drop_rows_from, is_eval_round
from mosaicd.rundir import EARLIER, hold_barrier, keep_earlier_run, occupant, read_summary
from mosaicd.settings import DaemonOptions, RunConfig, SettingsError

P = BarrierPhase


class Barrier:
    def __init__(self, run: RunConfig, options: DaemonOptions, *, secret: Secret,
                 evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None = None, hold_out: bool = False,
                 members_return: bool = False) -> None:
        """`secret`: the run's, as its entry point resolved it (none: --insecure); `evaluate(run, vectors)`: the
        models' network metrics (None: final models only); `hold_out`: take --out (`open_outputs`);
        `members_return`: its members start again with it (rank 0 of a peer list: comeback.py). ResumeError: OUT
        holds another run in progress (or not the round asked for)."""
        self.resumed = barrier_journal.load(options.out, run, options.resume_round, options.nodes_counted, bool(secret))
        stopped = read_summary(options.out) if self.resumed else None  # how the run ended before: kept in `resumed`
        # its members start again with it: rank 0 of a peer list, or a run its members were stopped in (stops.py)
        choose = (members_return or bool((stopped or {}).get("members_stopped"))) and options.resume_round is None
        if self.resumed:  # --resume-round: every member comes back at a new address and takes its rank back
            run = self.resumed["run"]
            self.state = BarrierState.from_json(self.resumed["state"], _now(),
                                                rebind=options.resume_round is not None or choose)
        else:
            counted = options.expect_dns or options.expect_settle  # the count is known once nodes register
            self.state = BarrierState(rounds=run.rounds, round_deadline=run.round_deadline,
                                      drop_after=options.drop_after, expected=0 if counted else run.nodes,
                                      min_members=run.min_members)
        self.run, self.options = run, options
        self.log = get_logger(role="barrier", run=run.run_id)
        rebinding = self.state.phase is P.REBINDING
        self.recorder = open_outputs(options, run, self.resumed, self.state.round if rebinding else None, self.log,
                                     hold_out)
        self.metrics = BarrierMetrics(run)
        self.keyring = secret.keyring()
        self.registrar = Registrar(self)  # the registration's long polls (registration.py)
        self.refusals = Refusals()  # requests refused, by reason and source (refusals.py)
        self.layouts = LayoutClaims()  # the model every member must build (layouts.py)
        self.notices = Notices({t: self.state.notice(r).to_json() for t, r in self.state.released.items()})
        self.comeback = Comeback(options, run, bool(secret)) if choose and rebinding else None
        self.ending = RunEnd(self.recorder, self.log, self.state.round if self.resumed and not self.comeback else None,
                             stopped, self.state.round)
        self.done = self.ending.done
        self.evaluator = NetworkEvaluator(options, self.keyring, evaluate, self.recorder, self.metrics, self.log,
                                          on_output_error=self.fail_output)
        self.stopping = False  # interrupt(): nothing more is decided
        self.stops = StoppedMembers()  # leaves of members told to stop, held a moment (stops.py)
        self.members_stopped: list[int] = []  # the members whose stop interrupted the run
        self._collections: dict[int, asyncio.Task] = {}
        self.recollect: list[int] = []  # evaluations a resumed run collects with its first release (_resume)
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._ending: Release | None = None  # the last release, while its evaluations drain
        self.releases = ReleaseLog(self.recorder, self.metrics, self.log)
        self.history = self.releases.history  # per released round: duration, mean phase seconds, stragglers

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

    async def start(self) -> None:
        self.metrics.expected.set(self.state.expected)
        if self.comeback is not None:  # the round it goes on at is chosen once every member is back (resume_at)
            return self.registrar.resumed()
        if self.resumed:
            return self._resume()
        for task in self.registrar.tasks():
            self._spawn(task)

    def _resume(self) -> None:
        """Go on with the saved run: the open round starts again now (rebinding: once every member is back);
        evaluations that the crash cut short are collected again where the nodes still keep their snapshots (nodes
        started again: at their next release)."""
        state, rebinding = self.state, self.state.phase is P.REBINDING
        self.evaluator.prepare(self.run)
        self.registrar.resumed()
        self.metrics.members.set(len(state.live))
        if not rebinding:
            self.arm_deadline()
        missing, lost = evaluations_cut_short(state.round, self.run, self.recorder, rebinding)
        if rebinding:  # not at the addresses the journal keeps: collected with the next release's (publish)
            self.recollect = missing
        else:
            live = {r: state.addresses[r] for r in state.live}
            for e in missing:
                self._collections[e] = self._spawn(self.evaluator.collect(self.run, e, live, False))
        self.log.info("resumed", round=state.round, live=len(state.live), dropped=state.dropped,
                         evaluations_recollected=missing, **({"evaluations_lost": lost} if lost else {}))

    def resume_at(self, round: int) -> None:
        """Its members back, the run goes on at `round` (comeback.py): the journal's state of that round."""
        if round != self.state.round:
            saved = barrier_journal.load(self.options.out, self.run, round, self.options.nodes_counted,
                                         bool(self.keyring))
            self.state = BarrierState.from_json(saved["state"], self.now(), rebind=True)
            self.notices.heard = {t: self.state.notice(r).to_json() for t, r in self.state.released.items()}
            self.recorder.cut_back(round)
        self.ending.resumed(round)
        self._resume()

    # -- registration (registration.py: its long polls) -----------------------------------------------------
    async def register(self, address: str, rank: int | None = None, held: list[int] | None = None
                       ) -> dict[str, Any]:
        """Long poll until the roster is made (`Registrar.register`)."""
        return await self.registrar.register(address, rank, held)

    async def withdraw(self, address: str, reason: str) -> dict[str, Any]:
        """`address` withdraws its registration, or leaves if it is a member (`Registrar.withdraw`)."""
        return await self.registrar.withdraw(address, reason)

    def close_roster(self, run: RunConfig) -> None:
        """Every expected node registered: the roster is made, the run (`run`: with the node count) begins."""
        self.run = run
        roster = self.state.close(self.now(), run.min_members)
        self.save_journal()
        self.arm_deadline()
        self.recorder.settings["nodes"] = len(roster.addresses)
        self.metrics.members.set(len(roster.addresses))
        self.log.info("registration_closed", members=len(roster.addresses))
        self.evaluator.prepare(run)

    def refused(self, reason: str, source: str, path: str) -> None:
        """A request refused (a bad signature, another run's, a closed roster): counted, the first of its kind
        from its source said in a line, and kept in summary.json (what the node was told, never the secret)."""
        if self.refusals.note(reason, source, path):
            self.log.warning("refused", reason=reason, source=source, path=path, detail=WHY.get(reason, ""))
        self.recorder.note("refused", self.refusals.as_json())

    def fail_registration(self, reason: str) -> None:
        """Registration cannot complete (`reason`, with what was refused meanwhile): the run ends."""
        if self.refusals.total:
            reason = f"{reason}; {self.refusals.text()}"
        self.state.fail(reason)
        self.ending.registration_failed(reason)
        self.done.set()

    # -- rounds --------------------------------------------------------------------------------------
    def save_journal(self) -> None:
        """Save the state before anyone hears of it; a write that fails ends the run (`fail_output`)."""
        if self.stopping:
            raise stopping()
        if self.output_error is not None:  # the journal stays at the last decision that could be saved
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.output_error}")
        try:
            barrier_journal.save(self.options.out, self.run, self.state, self.recorder.started, bool(self.keyring))
        except OSError as exc:
            self.fail_output(exc)
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.output_error}") from None

    def arm_deadline(self) -> None:
        """One timer, at the open round's deadline (every wait ends, whether or not anyone arrives)."""
        if self._timer:
            self._timer.cancel()
            self._timer = None
        if self.state.deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self.state.deadline, self._on_deadline)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def check_layout(self, rank: int, claim: tuple[int, str] | None) -> None:
        """An arrival's layout against the run's: one that differs ends the run (BarrierError run_failed, its
        reason)."""
        why = self.layouts.differs(rank, claim)
        if why is not None:
            self.end_failed(why)
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {why}")

    async def arrive(self, rank: int, round: int, report: NodeReport | None) -> dict[str, Any]:
        """Long poll until `round` is released: the release as the nodes hear it (JSON). BarrierError if refused."""
        retry = round < self.state.round  # a round released already: its release again, recorded once
        release = self.state.arrive(rank, round, self.now(), report)
        if release is not None and not retry:
            await self.publish(release)
        return await self.wait_published(round, release_wait(self.run.round_deadline, self.options.request_timeout))

    async def wait_published(self, round: int, limit: float) -> dict[str, Any]:
        return await self.notices.wait(round, limit, self.now, self._refusal)

    def _refusal(self) -> BarrierError | None:
        """Why a long poll ends now, unanswered (None: it goes on waiting)."""
        if self.stopping:
            return stopping()
        if self.state.phase is P.FAILED:
            return BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.failure}")
        return None

    def _on_deadline(self) -> None:
        self._timer = None
        release = self.state.tick(self.now())
        if release is not None:
            self._spawn(self.publish(release))
        else:
            self.arm_deadline()

    async def publish(self, release: Release) -> None:
        """Save and record what the release decided, then tell the waiting nodes (after any collection whose
        snapshots the nodes would drop once they move on; at the end, after the final models are collected, but
        before they are evaluated: nodes never wait for an evaluation). A write that fails ends the run."""
        try:
            await self._publish_saved(release)
        except OSError as exc:
            self.fail_output(exc)
        except BarrierError:  # the journal could not be saved: fail_output told everyone
            pass

    async def _publish_saved(self, release: Release) -> None:
        self.save_journal()
        self.arm_deadline()
        t = release.round
        self.releases.record(release, self.state.closed[release.round], self.now(), self.evaluator.last_metrics)
        due = [*self.recollect, *([t - 1] if t >= 1 and is_eval_round(t - 1, self.run) else [])]
        self.recollect = []
        if due:  # one after the other, so that their rows are written in round order
            live = {r: self.state.addresses[r] for r in self.state.live}
            self._collections[due[0]] = self._spawn(self.evaluator.collect_rounds(self.run, due, live,
                                                                                  release.finished))
        for e in [e for e in self._collections if e + SNAPSHOTS_KEPT <= t or release.finished]:
            await self._collections.pop(e)
        self.notices.put(t, self.state.notice(release).to_json(), SNAPSHOTS_KEPT)
        if release.finished:  # the nodes are free to go once their models are collected; evaluation goes on
            self._ending = release
            self._spawn(self._end_after_evaluations(release))

    async def leave(self, rank: int, reason: str, ends_run: bool = False, stopped: bool = False) -> dict[str, Any]:
        """`rank` leaves the run (a signal, or an error it could not go on after): nobody waits for it from now
        on, it is not sampled from the next round, and a round that waited only for it is released now.
        `ends_run`: the run cannot go on exactly without it (its checkpoint could not be written): the run ends,
        failed, at its last saved decision (the leave is not saved), so that it can be resumed. `stopped`: it was
        told to stop (a signal): its leave is held a moment, and the run interrupted if too many are (stops.py)."""
        if ends_run:
            self.state.check(rank, self.state.round)
            self.end_failed(f"rank {rank}: {reason}")
            return Left(rank, self.state.round, tuple(self.state.live)).to_json()
        if stopped and self.state.phase is P.RUNNING and rank in self.state.live:
            if self.stops.hold(rank, reason):
                self.log.info("leave_held", rank=rank, reason=reason, seconds=STOP_HOLD_S)
                if self.stops.too_many(self.state.live, self.state.min_members):
                    self.interrupted_by_members()
                else:
                    asyncio.get_running_loop().call_later(STOP_HOLD_S, lambda: self._spawn(self._held_leave(rank)))
            return Left(rank, self.state.round, tuple(self.state.live)).to_json()
        return await self._leave_now(rank, reason)

    async def _held_leave(self, rank: int) -> None:
        reason = self.stops.release(rank)
        if reason is not None and self.state.phase is P.RUNNING and not self.stopping and rank in self.state.live:
            try:
                await self._leave_now(rank, reason)
            except BarrierError:  # the run ended meanwhile: nothing to apply
                pass

    def interrupted_by_members(self) -> None:
        """Too many members were told to stop for the run to go on: a person stopped the run. It ends interrupted,
        its journal at the last decision (every member in it), resumable from the members' checkpoints."""
        ranks = self.stops.ranks()
        reason = self.stops.interruption(len(self.state.addresses))
        self.stops.forget()
        self.members_stopped = ranks
        self.log.warning("interrupted", ranks=ranks, detail=reason)
        self.ending.members_stopped(ranks)
        self.end_failed(reason)

    def stopped_by_members(self) -> bool:
        """Whether the run ended because its members were told to stop (`interrupted_by_members`)."""
        return bool(self.members_stopped) and self.state.phase is P.FAILED

    async def _leave_now(self, rank: int, reason: str) -> dict[str, Any]:
        left = self.state.leave(rank, self.now())
        self.ending.left(rank, reason)
        self.save_journal()
        self.metrics.left.inc()
        self.log.info("left", rank=rank, reason=reason, live=len(self.state.live), round=self.state.round)
        if left.release is not None:
            await self.publish(left.release)
        return Left(rank, self.state.round, tuple(self.state.live)).to_json()

    def answered(self, rank: int) -> None:
        """`rank` got an answer to an arrival or a leave: if the run has failed, that answer said so."""
        self.state.answered(rank)

    def unheard(self, own: int) -> list[int]:
        """The live members other than `own` not yet told that the run failed: rank 0 serves until this is empty."""
        return self.state.unheard(own)

    # -- the end -------------------------------------------------------------------------------------
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
        if self.state.phase is not P.FAILED:
            self.state.fail(reason)
        self.ending.ended_early(reason, self.state.left)
        self.notices.wake()

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
        if self._ending is not None and self.state.phase is P.FAILED:
            try:
                self.ending.record(self._ending, self.state, self.run, self.evaluator.final_vectors)
            except OSError as exc:
                self.fail_output(exc)
        self.interrupt()

    def interrupt(self) -> None:
        """Decide nothing more; every waiting arrival is answered 503 barrier_stopping now. On Ctrl-C the journal so
        stays where the console says (as after a SIGKILL): the nodes retry against the barrier started again."""
        self.stopping = True
        if self._timer:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.notices.wake()


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
            try:
                await asyncio.wait_for(self._event.wait(), timeout=max(end - now(), 0))
            except TimeoutError:
                raise BarrierError(BarrierReason.BARRIER_TIMEOUT, f"round {round} was not released in time") from None
        return self.heard[round]


def stopping() -> BarrierError:
    return BarrierError(BarrierReason.BARRIER_STOPPING, "the barrier is stopping (Ctrl-C): retry; started again "
                        "with the same --out, it goes on with the run")


def open_outputs(options: DaemonOptions, run: RunConfig, resumed: dict[str, Any] | None, rebind_round: int | None,
                 log: Any, hold_out: bool = False) -> RunRecorder:
    """The run's files in --out: a new run keeps the run there before aside (never replaced unasked), a run resumed
    with --resume-round drops the rows from `rebind_round` on, and the recorder opens them. A folder that cannot be
    written (read-only, full) ends the barrier in one line naming --out, not a traceback. `hold_out`: one barrier
    per --out, and no `simulate`/`cluster` there meanwhile (`rundir.hold_barrier`)."""
    if hold_out:
        hold_barrier(options.out)
    if resumed is None and not options.replace and (held := occupant(options.out)).kind == "finished":
        raise SettingsError(f"--out {options.out} holds a finished run ({held.text}): there is nothing to wait "
                            "for. Give another --out, or --replace (MOSAIC_REPLACE=true) to keep its files in "
                            f"{options.out / EARLIER} and start a new run there")
    try:
        if resumed is None and (kept := keep_earlier_run(options.out)) is not None:
            log.warning("earlier_run_kept", folder=str(kept), detail=f"its files are now in {kept}")
        if rebind_round is not None:
            drop_rows_from(options.out, nodes=rebind_round, rounds=rebind_round - 1)
        return RunRecorder(options.out, {**options.model_dump(mode="json"), **run.model_dump(mode="json")},
                           mode="cluster", resume_from=resumed["started"] if resumed else None)
    except OSError as exc:
        raise OutputError(f"--out {options.out}: cannot write {exc.filename or options.out}: "
                          f"{exc.strerror or exc}") from None


def evaluations_cut_short(round: int, run: RunConfig, recorder: RunRecorder,
                          rebinding: bool) -> tuple[list[int], list[int]]:
    """The evaluations a barrier resuming the run at `round` collects again, and those it cannot: the rounds whose
    models the nodes may still keep (`SNAPSHOTS_KEPT`) and rounds.csv has no row of. Nodes started again at new
    addresses (`rebinding`) keep only their two checkpoints: the models after `round` - 1 and `round` - 2."""
    done = {row.get("round") for row in recorder.rounds}
    missing = [e for e in range(max(0, round - SNAPSHOTS_KEPT), round - 1) if is_eval_round(e, run) and e not in done]
    kept = [e for e in missing if not rebinding or e >= round - 2]
    return kept, [e for e in missing if e not in kept]


def _now() -> float:
    """The event loop's clock (asyncio's default is time.monotonic), also before a loop runs."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()

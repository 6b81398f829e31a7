"""The barrier process around `mosaic_proto.BarrierState`: long polls, the clock, snapshots, outputs.

`BarrierState` decides (ranks, releases, stragglers, drops); this adapter feeds it requests and the
clock, tells waiting nodes what it decided, and does the I/O that follows a release, off the round's
critical path: it writes the round's node rows, then pulls the nodes' model snapshots at evaluation
rounds and evaluates them in a worker thread while the next rounds go on. Nodes keep their last
`SNAPSHOTS_KEPT` snapshots, so a collection must end before the release that would drop its snapshot.

Every decision is saved (barrier_journal.py) before the nodes hear of it; a barrier started again with the
same --out resumes the run from there, while the nodes retry their arrivals (--barrier-grace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mosaic_proto import SNAPSHOTS_KEPT, BarrierError, BarrierPhase, BarrierReason, BarrierState, NodeReport, Release
from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.barrier.ending import end_after_evaluations, end_failed, fail_output, record_end
from mosaicd.daemon.barrier.evaluator import NetworkEvaluator
from mosaicd.daemon.barrier.layouts import LayoutClaims
from mosaicd.daemon.barrier.metrics import BarrierMetrics
from mosaicd.daemon.barrier.registration import count_nodes, registration_deadline
from mosaicd.daemon.barrier.release_log import ReleaseLog
from mosaicd.daemon.deadlines import release_wait
from mosaicd.daemon.errors import OutputError
from mosaicd.daemon.http.auth import Keyring, load_secret
from mosaicd.logs import get_logger
from mosaicd.outputs import RunRecorder, drop_rows_from, is_eval_round
from mosaicd.rundir import hold_barrier, keep_earlier_run
from mosaicd.settings import DaemonOptions, RunConfig


class Barrier:
    def __init__(self, run: RunConfig, options: DaemonOptions, *,
                 evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None = None, hold_out: bool = False) -> None:
        """`evaluate(run, vectors)`: the models' network metrics (None: final models only); `hold_out`: take --out
        (`open_outputs`). ResumeError: OUT holds another run in progress (or not the round asked for)."""
        secret = load_secret(options.secret_file)  # a run started with one is not resumed without it
        self.resumed = barrier_journal.load(options.out, run, options.resume_round, options.nodes_counted, bool(secret))
        if self.resumed:
            run = self.resumed["run"]
            self.state = BarrierState.from_json(self.resumed["state"], _now())
        else:
            counted = options.expect_dns or options.expect_settle  # the count is known once nodes register
            self.state = BarrierState(rounds=run.rounds, round_deadline=run.round_deadline,
                                      drop_after=options.drop_after, expected=0 if counted else run.nodes,
                                      min_members=run.min_members)
        self.run, self.options = run, options
        self.log = get_logger(role="barrier", run=run.run_id)
        # --resume-round: every member comes back at a new address and takes its rank back (registration.rebind)
        self.rebinding = set(self.state.live) | set(self.state.joining) \
            if self.resumed and options.resume_round is not None else set()
        self.rebound = asyncio.Event()
        self.recorder = open_outputs(options, run, self.resumed, self.state.round if self.rebinding else None,
                                     self.log, hold_out)
        self.metrics = BarrierMetrics(run)
        self.keyring = Keyring(secret) if secret else None
        self.register_status = 503  # 422 when the run as registered is invalid: retrying cannot help
        self.registered, self.done = asyncio.Event(), asyncio.Event()
        self.layouts = LayoutClaims()  # the model every member must build (layouts.py)
        self.published: dict[int, dict[str, Any]] = {}
        self.evaluator = NetworkEvaluator(options, self.keyring, evaluate, self.recorder, self.metrics, self.log,
                                          on_output_error=lambda exc: fail_output(self, exc))
        self._published = asyncio.Event()
        self.resumed_at: int | None = None  # the open round this barrier resumed the run at (its journal)
        self.leave_reasons: dict[int, str] = {}  # rank -> why it left, in the order they left
        self.heard_failure: set[int] = set()  # ranks answered since the run failed (`ending.unheard`)
        self.output_error: str | None = None  # why the run was ended early (end_failed): nothing more is saved
        self.stopping = False  # interrupt(): nothing more is decided
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

    async def start(self) -> None:
        self.metrics.expected.set(self.state.expected)
        if self.resumed:
            return self._resume()
        self._spawn(registration_deadline(self))
        self._spawn(count_nodes(self))

    def _resume(self) -> None:
        """Go on with the saved run: the open round starts again now; evaluations that the crash cut short are
        collected again where the nodes still keep their snapshots (nodes started again: at their next release)."""
        state = self.state
        self.registered.set()
        self.metrics.members.set(len(state.live))
        if not self.rebinding:  # else once every member is back (registration.rebind)
            self.arm_deadline()
        self.published = {t: told(self.state, r) for t, r in state.released.items()}
        missing, lost = evaluations_cut_short(state.round, self.run, self.recorder, bool(self.rebinding))
        if self.rebinding:  # not at the addresses the journal keeps: collected with the next release's (publish)
            self.recollect = missing
        else:
            live = {r: state.addresses[r] for r in state.live}
            for e in missing:
                self._collections[e] = self._spawn(self.evaluator.collect(self.run, e, live, False))
        self.resumed_at = state.round  # summary.json says so: this barrier went on from the journal
        self.log.warning("resumed", round=state.round, live=len(state.live), dropped=state.dropped,
                         evaluations_recollected=missing, **({"evaluations_lost": lost} if lost else {}))

    def save_journal(self) -> None:
        """Save the state before anyone hears of it; a write that fails ends the run (`fail_output`)."""
        if self.stopping:
            raise stopping()
        if self.output_error is not None:  # the journal stays at the last decision that could be saved
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.output_error}")
        try:
            barrier_journal.save(self.options.out, self.run, self.state, self.recorder.started, bool(self.keyring))
        except OSError as exc:
            fail_output(self, exc)
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.output_error}") from None

    def arm_deadline(self) -> None:
        """One timer, at the open round's deadline (every wait ends, whether or not anyone arrives)."""
        if self._timer:
            self._timer.cancel()
            self._timer = None
        if self.state.deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self.state.deadline, self._on_deadline)

    async def stop(self) -> None:
        """The process stops: a failed run still evaluating its last models is recorded as failed now."""
        if self._ending is not None and self.state.phase is BarrierPhase.FAILED:
            try:
                record_end(self, self._ending)
            except OSError as exc:
                fail_output(self, exc)
        self.interrupt()

    def interrupt(self) -> None:
        """Decide nothing more; every waiting arrival is answered 503 barrier_stopping now. On Ctrl-C the journal so
        stays where the console says (as after a SIGKILL): the nodes retry against the barrier started again."""
        self.stopping = True
        if self._timer:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._published.set()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def arrive(self, rank: int, round: int, report: NodeReport | None) -> dict[str, Any]:
        """Long poll until `round` is released: the release as JSON. BarrierError if refused."""
        retry = round < self.state.round  # a round released already: its release again, recorded once
        release = self.state.arrive(rank, round, self.now(), report)
        if release is not None and not retry:
            await self.publish(release)
        return await self.wait_published(round, release_wait(self.run.round_deadline, self.options.request_timeout))

    async def wait_published(self, round: int, limit: float) -> dict[str, Any]:
        end = self.now() + limit
        while round not in self.published:
            if self.stopping:
                raise stopping()
            if self.state.phase is BarrierPhase.FAILED:
                raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.state.failure}")
            event = self._published
            try:
                await asyncio.wait_for(event.wait(), timeout=max(end - self.now(), 0))
            except TimeoutError:
                raise BarrierError(BarrierReason.BARRIER_TIMEOUT, f"round {round} was not released in time") from None
        return self.published[round]

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
            fail_output(self, exc)
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
        self.published[t] = told(self.state, release)
        self.published.pop(t - SNAPSHOTS_KEPT, None)
        self._published.set()
        self._published = asyncio.Event()
        if release.finished:  # the nodes are free to go once their models are collected; evaluation goes on
            self._ending = release
            self._spawn(end_after_evaluations(self, release))

    async def leave(self, rank: int, reason: str, ends_run: bool = False) -> dict[str, Any]:
        """`rank` leaves the run (a signal, or an error it could not go on after): nobody waits for it from now
        on, it is not sampled from the next round, and a round that waited only for it is released now.
        `ends_run`: the run cannot go on exactly without it (its checkpoint could not be written): the run ends,
        failed, at its last saved decision (the leave is not saved), so that it can be resumed."""
        if ends_run:
            self.state.check(rank, self.state.round)
            end_failed(self, f"rank {rank}: {reason}")
            return {"left": rank, "round": self.state.round, "live": list(self.state.live)}
        release = self.state.leave(rank, self.now())
        self.leave_reasons.setdefault(rank, reason)
        self.save_journal()
        self.metrics.left.inc()
        self.log.warning("left", rank=rank, reason=reason, live=len(self.state.live), round=self.state.round)
        if release is not None:
            await self.publish(release)
        return {"left": rank, "round": self.state.round, "live": list(self.state.live)}


def told(state: BarrierState, release: Release) -> dict[str, Any]:
    """A release as the nodes hear it: with the addresses of the members that join, and why the run failed if this
    release ends it so."""
    failed = {"failure": state.failure} if release.finished and state.phase is BarrierPhase.FAILED else {}
    return {**release.to_json(), "addresses": {str(r): state.addresses[r] for r in release.joined}, **failed}


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

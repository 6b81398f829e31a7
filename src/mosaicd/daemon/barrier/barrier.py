"""The barrier process around `mosaic_proto.BarrierState`: long polls, the clock, snapshots, outputs.

`BarrierState` decides (ranks, releases, stragglers, drops, who is back, held stops and interruptions, layouts that
differ, how the run ends); this adapter feeds it requests and the clock through one door (`decide`), and runs what
each decision calls for in one place, in one order (runner.py: save it before anyone hears of it, re-arm the timers
the state asks for, record it, then tell the waiting nodes); around it, the requests of the nodes (registration.py,
arrivals, leaves). It decides nothing. The I/O that follows a release is off the
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
    BarrierDecision,
    BarrierError,
    BarrierReason,
    BarrierState,
    CountRule,
    Failure,
    Left,
    NodeReport,
    Rebound,
    Roster,
    RunTask,
    TaskClaim,
)
from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.daemon.barrier.comeback import Comeback
from mosaicd.daemon.barrier.ending import RunEnd
from mosaicd.daemon.barrier.evaluator import NetworkEvaluation
from mosaicd.daemon.barrier.refusals import WHY, Refusals
from mosaicd.daemon.barrier.registration import Registrar, peer_list_names
from mosaicd.daemon.barrier.runner import DecisionRunner
from mosaicd.daemon.deadlines import release_wait
from mosaicd.daemon.errors import OutputError
from mosaicd.daemon.http.auth import Secret
from mosaicd.logs import get_logger
from mosaicd.outputs import RunRecorder, drop_rows_from, is_eval_round
from mosaicd.rundir import EARLIER, hold_barrier, keep_earlier_run, occupant, read_rounds, read_summary
from mosaicd.settings import DaemonOptions, RunConfig, SettingsError


class Barrier(DecisionRunner):
    """The barrier of one run: its `DecisionRunner`, and the requests of its members around it."""

    def __init__(self, run: RunConfig, options: DaemonOptions, *, secret: Secret,
                 evaluate: Callable[[RunConfig, list[np.ndarray]], dict] | None = None, hold_out: bool = False,
                 members_return: bool = False, mode: str = "barrier") -> None:
        """`secret`: the run's, as its entry point resolved it (none: --insecure); `evaluate(run, vectors)`: the
        models' network metrics (None: final models only); `hold_out`: take --out (`open_outputs`);
        `members_return`: its members start again with it (rank 0 of a peer list: comeback.py); `mode`: summary.json's
        ("cluster" where `mosaicd cluster` started it, else "barrier": by hand, a peer list's rank 0). ResumeError: OUT
        holds another run in progress (or not the round asked for)."""
        self.resumed = barrier_journal.load(options.out, run, options.resume_round, options.nodes_counted, bool(secret))
        stopped = read_summary(options.out) if self.resumed else None  # how the run ended before: kept in `resumed`
        # its members start again with it: rank 0 of a peer list, or a run its members were stopped in (`stop`)
        choose = (members_return or bool((stopped or {}).get("members_stopped"))) and options.resume_round is None
        if self.resumed:  # --resume-round: every member comes back at a new address and takes its rank back
            run = self.resumed["run"]
            state = BarrierState.from_json(self.resumed["state"], _now(),
                                           rebind=options.resume_round is not None or choose)
        else:
            counted = options.expect_dns or options.expect_settle  # the count is known once nodes register
            state = BarrierState(rounds=run.rounds, round_deadline=run.round_deadline,
                                 drop_after=options.drop_after, expected=0 if counted else run.nodes,
                                 min_members=run.min_members, count_rule=count_rule(options, run.fanout),
                                 task=run_task(run, isinstance(evaluate, NetworkEvaluation)))
        log = get_logger(role="barrier", run=run.run_id)
        rebinding = state.phases.rebinding
        recorder = open_outputs(options, run, self.resumed, state.round if rebinding else None, log, hold_out, mode)
        self.comeback = Comeback(options, run, bool(secret)) if choose and rebinding else None
        ending = RunEnd(recorder, log, state.round if self.resumed and not self.comeback else None, stopped,
                        state.round)
        super().__init__(state, run, options, recorder, log, ending, secret.keyring(), evaluate)
        self.registrar = Registrar(self, self.comeback)  # the registration's long polls (registration.py)
        self.refusals = Refusals()  # requests refused, by reason and source (refusals.py)

    async def start(self) -> None:
        self.metrics.expected.set(self.state.expected)
        if self.comeback is not None:  # the round it goes on at is chosen once every member is back (resume_at)
            return self.registrar.roster_made()
        if self.resumed:
            return self._resume()
        seconds, listed = self.options.register_deadline, peer_list_names(self.options)  # the failure line's names
        self.decide(lambda state, now: state.registration.begin(now, seconds, listed))  # the runner's timer fires it
        for task in self.registrar.tasks():
            self._spawn(task)

    def _resume(self) -> None:
        """Go on with the saved run: the open round starts again now (rebinding: once every member is back);
        evaluations that the crash cut short are collected again where the nodes still keep their snapshots (nodes
        started again: at their next release)."""
        state, rebinding = self.state, self.state.phases.rebinding
        self.evaluator.prepare(self.run)
        self.registrar.roster_made()
        self.metrics.members.set(len(state.live))
        self.apply(None)  # its timers, at the times the state says (rebinding: none until every member is back)
        missing, lost = evaluations_cut_short(state.round, self.run, self.recorder, rebinding)
        self.collect_again(missing)
        reason = "its models were gone when the barrier resumed the run (nodes started again keep only their " \
                 "checkpoints; running ones their last snapshots)"
        try:
            for e in lost:
                self.recorder.lost_round(e, reason)
        except OSError as exc:
            self.fail_output(exc)
        (self.log.warning if lost else self.log.info)(
            "resumed", round=state.round, live=len(state.live), dropped=state.dropped,
            evaluations_recollected=missing, **({"evaluations_lost": lost, "detail": reason} if lost else {}))

    def resume_at(self, round: int) -> None:
        """Its members back, the run goes on at `round` (comeback.py): the journal's state of that round."""
        if round != self.state.round:
            saved = barrier_journal.load(self.options.out, self.run, round, self.options.nodes_counted,
                                         bool(self.keyring))
            self.go_on_from(BarrierState.from_json(saved["state"], self.now(), rebind=True))
            self.recorder.cut_back(round)
        self.ending.resumed(round)
        self._resume()

    def members_restarted(self, address: str) -> None:
        """A member registered again with its checkpoints as the first word of the run this barrier resumed
        (`BarrierState.returned`): they all stopped with it (a full disk, a failure), and the run goes on as a peer
        list's comeback does, every member from its checkpoint of the newest round all hold (or says why not)."""
        self.comeback = Comeback(self.options, self.run, bool(self.keyring))
        self.registrar.members_return(self.comeback)
        self.log.warning("members_restarted", address=address, round=self.state.round,
                         waiting_for=sorted(self.state.awaited),
                         detail="a member came back started again: the run waits for every live member and goes "
                         "on exactly from the newest round all hold a checkpoint of")

    # -- registration (registration.py: its long polls) -----------------------------------------------------
    async def register(self, address: str, rank: int | None = None, held: list[int] | None = None,
                       runs: TaskClaim | None = None) -> dict[str, Any]:
        """Long poll until the roster is made (`Registrar.register`; `runs`: what the node says it runs). A member
        told to stop that is back already does not leave; one started again (its checkpoints `held`) as the resumed
        run's first word stopped with the barrier, as all did: all are awaited back (`BarrierState.returned`,
        `members_restarted`). In an asynchronous run a member started again hears its place at once
        (`Registrar.member_again`)."""
        if str(self.run.sync) == "async" and address in self.state.addresses:
            return self.registrar.member_again(address)
        if self.decide(lambda state, now: state.returned(address, restarted=held is not None)) is not None:
            self.members_restarted(address)
        return await self.registrar.register(address, rank, held, runs)

    async def withdraw(self, address: str, reason: str) -> dict[str, Any]:
        """`address` withdraws its registration, or leaves if it is a member (`Registrar.withdraw`)."""
        return await self.registrar.withdraw(address, reason)

    def heard(self, decision: BarrierDecision) -> None:
        """The registration's long polls hear that the roster is made, that every member is back, or that the
        registration failed."""
        if isinstance(decision, Roster):
            self.registrar.roster_made()
        elif isinstance(decision, Rebound) and decision.all_back:
            self.registrar.all_back()
        elif isinstance(decision, Failure) and decision.registration:
            self.registrar.failed()

    async def await_roster(self) -> None:
        """Until the roster is made, or the registration failed (the registration's long polls hear the same)."""
        await self.registrar.registered.wait()

    def reported(self, summary: dict[str, Any]) -> None:
        """--sync async: the members' reports are collected and summary.json written (collector.py): the run ended."""
        self.ending.reported(summary)

    @property
    def registration_status(self) -> int:
        """What a failed registration answers (`Registrar.status`)."""
        return self.registrar.status

    def refused(self, reason: str, source: str, path: str) -> None:
        """A request refused (a bad signature, another run's, a closed roster): counted, the first of its kind
        from its source said in a line, and kept in summary.json (what the node was told, never the secret)."""
        if self.refusals.note(reason, source, path):
            self.log.warning("refused", reason=reason, source=source, path=path, detail=WHY.get(reason, ""))
        if self.state.phases.registering or self.state.phases.rebinding:  # a registration that fails says them
            said = self.refusals.text()
            self.decide(lambda state, now: state.registration.saw_refused(said))
        self.recorder.note("refused", self.refusals.as_json())

    def fail_registration(self, reason: str) -> None:
        """Registration cannot complete (`reason`; the state adds what was refused meanwhile): the run ends."""
        self.decide(lambda state, now: state.fail(reason, registration=True))

    # -- rounds (runner.py runs what they decide) ----------------------------------------------------------

    def check(self, rank: int, round: int) -> None:
        """The BarrierError an arrival of `rank` at `round` would get now (`BarrierState.check`: changes nothing)."""
        self.state.check(rank, round)

    def check_layout(self, rank: int, round: int, claim: tuple[int, str] | None, sender: str) -> None:
        """An arrival's layout against the run's (`BarrierState.claim_layout`): one that differs ends the run
        (BarrierError run_failed, its reason and the `sender`'s host:port: an unsigned request may claim any rank);
        a stale one fails nothing, a rank's changed one is refused alone (layout_changed)."""
        why = self.decide(lambda state, now: state.claim_layout(rank, claim, round))
        if why is not None:
            why = f"{why} (the arrival came from {sender})"
            self.end_failed(why)
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {why}")

    async def arrive(self, rank: int, round: int, report: NodeReport | None) -> dict[str, Any]:
        """Long poll until `round` is released: the release as the nodes hear it (JSON). BarrierError if refused."""
        self.decide(lambda state, now: state.arrive(rank, round, now, report))  # a retry: its release, kept
        return await self.wait_published(round, release_wait(self.run.round_deadline, self.options.request_timeout))

    async def leave(self, rank: int, reason: str, ends_run: bool = False, stopped: bool = False,
                    sender: str = "?") -> dict[str, Any]:
        """`rank` leaves the run (a signal, or an error it could not go on after): nobody waits for it from now
        on, it is not sampled from the next round, and a round that waited only for it is released now.
        `ends_run`: the run cannot go on exactly without it (its checkpoint could not be written): the run ends,
        failed, at its last saved decision (the leave is not saved), so that it can be resumed. `stopped`: it was
        told to stop (a signal): its leave is held a moment, and the run interrupted if too many are
        (`BarrierState.stop`). `sender`: the host:port the request came from, which a run it ended names."""
        if ends_run:
            self.state.check(rank, self.state.round)
            self.end_failed(f"rank {rank} left, asked by {sender} with ends_run" + (f": {reason}" if reason else ""))
        elif stopped:
            self.decide(lambda state, now: state.stop(rank, reason, now))
        else:
            self.decide(lambda state, now: state.leave(rank, now, reason))
        return Left(rank, self.state.round, tuple(self.state.live)).to_json()

    def stopped_by_members(self) -> bool:
        """Whether the run ended because its members were told to stop (`BarrierState.stop`)."""
        return bool(self.ending.interrupted_by) and self.state.phases.failed

    def answered(self, rank: int) -> None:
        """`rank` got an answer to an arrival or a leave: if the run has failed, that answer said so."""
        self.decide(lambda state, now: state.answered(rank))

    def unheard(self, own: int) -> list[int]:
        """The live members other than `own` not yet told that the run failed: rank 0 serves until this is empty."""
        return self.state.unheard(own)

    # -- the end -------------------------------------------------------------------------------------

    def interrupted(self, how: str) -> bool:
        """Stopped before the run ended (`how`: Ctrl-C, an error): summary.json says so, unless it says how the run
        ended already (False then)."""
        if self.recorder.ended is not None:
            return False
        try:
            self.recorder.fail(f"interrupted ({how})")
        except OSError:
            pass
        return True


def run_task(run: RunConfig, evaluates: bool) -> RunTask:
    """What the barrier runs (`RunTask`): its task, or its nodes' own loops; `evaluates`: it evaluates the average
    model with the run's task (a `NetworkEvaluation`; a function of a program's own, `mosaicd.Barrier(evaluate=)`,
    evaluates what that program's loops build); the size of that model where it is known without building the task
    (the quadratic task's)."""
    quadratic = not run.own_loop and str(run.task) == "quadratic"
    return RunTask(str(run.task), run.own_loop, evaluates, run.dim if quadratic else None)


def count_rule(options: DaemonOptions, fanout: int) -> CountRule | None:
    """How the node count is taken where it is not given (`BarrierState.count`): the addresses --expect-dns resolves
    to once they hold still for --dns-settle seconds; the nodes registered once none new came for --expect-settle
    seconds, or twice the longest pause between two registrations so far, three times as long while too few came for
    the run's fanout (`CountRule`: replicas that start on a loaded host come in bursts)."""
    if options.expect_dns:
        return CountRule(options.dns_settle)
    if options.expect_settle:
        return CountRule(options.expect_settle, stretched=True, fanout=fanout)
    return None


def open_outputs(options: DaemonOptions, run: RunConfig, resumed: dict[str, Any] | None, rebind_round: int | None,
                 log: Any, hold_out: bool = False, mode: str = "barrier") -> RunRecorder:
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
                           mode=mode, resume_from=resumed["started"] if resumed else None)
    except OSError as exc:
        raise OutputError(f"--out {options.out}: cannot write {exc.filename or options.out}: "
                          f"{exc.strerror or exc}") from None


def evaluations_cut_short(round: int, run: RunConfig, recorder: RunRecorder,
                          rebinding: bool) -> tuple[list[int], list[int]]:
    """The evaluations a barrier resuming the run at `round` collects again, and those it cannot (lost): the
    evaluation rounds before `round` - 1 (whose models the release of `round` collects) that rounds.csv has no row
    of; collected again where the nodes may still keep their models (`SNAPSHOTS_KEPT`; nodes started again at new
    addresses, `rebinding`, keep only their two checkpoints: the models after `round` - 1 and `round` - 2)."""
    done = {row.get("round") for row in read_rounds(recorder.out)}
    missing = [e for e in range(round - 1) if is_eval_round(e, run) and e not in done]
    kept = [e for e in missing if e >= round - (2 if rebinding else SNAPSHOTS_KEPT)]
    return kept, [e for e in missing if e not in kept]


def _now() -> float:
    """The event loop's clock (asyncio's default is time.monotonic), also before a loop runs."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()

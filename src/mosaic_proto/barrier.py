"""`BarrierState`: the barrier's decisions, with no I/O (as `NodeState` is a node's; h11's `_state.py` is the model).

The daemon (or the in-memory network) feeds it registrations, arrivals and the clock, and gets decisions
back: who has which rank, when a round is released, who straggled, who is dropped, when the run is over.
Its phase lives in `BarrierPhases`, apart from the roster and the rounds (h11's `ConnectionState`), and moves only
along `BARRIER_TRANSITIONS`, the one table of which input (`BarrierInput`), with which outcome (`BarrierOutcome`),
moves which phase where: one call, one input, one transition. Every call returns its decision as a value
(`BarrierDecision`), which the daemon runs. A refusal (`BarrierError`, with its `BarrierReason`) changes nothing, and
an input its phase has no row for is a bug in the caller (`BarrierStateError`), which changes nothing either.

    state = BarrierState(rounds=T, round_deadline=30.0, drop_after=2, expected=n)
    state.register("10.0.0.5:9000", now)        # until state.complete, then:
    roster = state.close(now)                   # ranks = sorted addresses
    release = state.arrive(rank, t, now, report)   # a Release once every live member arrived at t
    release = state.tick(now)                   # or once the round's deadline has passed

Arriving at round t means: done sending round t (t = rounds means done with the run). The deadline of
round t runs from the round's opening (the release of round t-1, or the roster for round 0), so that every
wait ends even if nobody arrives; members that have not arrived by then are stragglers, and a member that
straggles `drop_after` rounds in a row is dropped from the next round on. A run whose members are all
dropped ends, failed.

    joined = state.join(address, now)           # a member that restarted (or, allow_new, a newcomer):
                                                # it sits out the open round and is a member from the next
    saved = state.to_json(); BarrierState.from_json(saved, now)   # what a restarted barrier resumes from
    state = BarrierState.from_json(saved, now, rebind=True)       # ... with its members at new addresses:
    rebound = state.rebind(rank, address, now)  # REBINDING until every live member is back, then RUNNING

Every policy of the run is here, fed by the daemon: the clock (`tick`, and `held.until` for the leaves of members
told to stop, `stop`), the node count read while nodes register (`count`, settled by its `CountRule`), the layouts
the arrivals claim (`claim_layout`), the rounds a resumed run can go on from (`resume_point`), and when the
registration (or a resumed run's members coming back) gives up (`registration`, a `RegistrationWait`: begun, the
peer list's names, the members back and the requests refused fed in as they happen; `tick` fails the run at its
`registration_deadline`, saying them). Each decision says whether it is journaled (`journaled`: saved before anyone
hears of it), and the timers it calls for are the state's values (`deadline`, `registration_deadline`, `held.until`),
so the daemon runs decisions and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar

from .barrier_rules import (
    STOP_HOLD_S,
    CountRule,
    HeldStops,
    LateClock,
    LayoutClaim,
    NodeCount,
    RegistrationWait,
    RunTask,
    TaskClaim,
    ended_line,
    resume_point,
    too_few_reason,
)
from .membership import MembershipError, parse_address, rank_addresses
from .messages import Release, ReleaseNotice
from .report import NodeReport

__all__ = ["BARRIER_TRANSITIONS", "STOP_HOLD_S", "BarrierDecision", "BarrierError", "BarrierInput", "BarrierOutcome",
           "BarrierPhase", "BarrierPhases", "BarrierReason", "BarrierState", "BarrierStateError", "CountRule",
           "Failure", "Held", "Joined", "Left", "Member", "Rebound", "Release", "Roster", "RunTask", "TaskClaim",
           "Withdrawal", "resume_point"]


class BarrierPhase(StrEnum):
    REGISTERING = "registering"
    REBINDING = "rebinding"  # a resumed run (--resume-round, a peer list's) waits for its members to come back
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class BarrierInput(StrEnum):
    """What comes in: a call on the state (a node's request, the clock, the daemon)."""

    REGISTER = "register"  # a node registers before the roster is made
    WITHDRAW = "withdraw"  # ... and withdraws (it was told to stop)
    COUNT = "count"  # a node count read (DNS, the nodes registered): the roster waits for it once it holds still
    CLOSE = "close"  # the roster is made
    RESTART = "restart"  # a resumed run's members start again at new addresses: it waits for them
    REBIND = "rebind"  # one of them is back
    ARRIVE = "arrive"
    TICK = "tick"  # the clock: the open round's deadline passed, or the registration's (`registration_deadline`)
    JOIN = "join"
    LEAVE = "leave"
    STOP = "stop"  # a member was told to stop (a signal): its leave is held, or the run is interrupted
    FAIL = "fail"  # the run ends, failed (too few members, a deadline, the daemon's outputs)


class BarrierOutcome(StrEnum):
    """What an input decided, as far as the phase goes: one input, one outcome, one transition (h2's side effect)."""

    NOTED = "noted"  # taken; nothing more is decided yet
    CLOSED = "closed"  # the roster is made
    AWAITING = "awaiting"  # a resumed run waits for its members to come back
    REOPENED = "reopened"  # every one is back: the open round starts again
    RELEASED = "released"  # a round is released and the run goes on
    FINISHED = "finished"  # the final release
    FAILED = "failed"  # the run ends, failed


P, In, Out = BarrierPhase, BarrierInput, BarrierOutcome
_RELEASING = {Out.NOTED: P.RUNNING, Out.RELEASED: P.RUNNING, Out.FINISHED: P.FINISHED, Out.FAILED: P.FAILED}
# phase -> {input: {outcome: next phase}}: every transition, and nothing else (an input a phase has no row for, or an
# outcome its row lacks, is a bug). A finished run can still fail: its outcome is written after the final release
# (summary.json once the last evaluations are done), and a write that fails there, or the host told to stop
# meanwhile, ends it failed.
BARRIER_TRANSITIONS: dict[BarrierPhase, dict[BarrierInput, dict[BarrierOutcome, BarrierPhase]]] = {
    P.REGISTERING: {In.REGISTER: {Out.NOTED: P.REGISTERING}, In.WITHDRAW: {Out.NOTED: P.REGISTERING},
                    In.COUNT: {Out.NOTED: P.REGISTERING}, In.CLOSE: {Out.CLOSED: P.RUNNING},
                    In.TICK: {Out.FAILED: P.FAILED}, In.FAIL: {Out.FAILED: P.FAILED}},
    P.REBINDING: {In.REBIND: {Out.NOTED: P.REBINDING, Out.REOPENED: P.RUNNING}, In.TICK: {Out.FAILED: P.FAILED},
                  In.FAIL: {Out.FAILED: P.FAILED}},
    P.RUNNING: {In.ARRIVE: _RELEASING, In.TICK: {o: p for o, p in _RELEASING.items() if o is not Out.NOTED},
                In.JOIN: _RELEASING, In.LEAVE: _RELEASING, In.RESTART: {Out.AWAITING: P.REBINDING},
                In.STOP: {Out.NOTED: P.RUNNING, Out.FAILED: P.FAILED},
                In.FAIL: {Out.FAILED: P.FAILED}},
    P.FINISHED: {In.FAIL: {Out.FAILED: P.FAILED}},
    P.FAILED: {},
}


class BarrierPhases:
    """The barrier's phase and the one table it moves along, apart from the roster and the rounds it guards (h11's
    `ConnectionState`): every phase check is here, so that what a phase allows is read off the table."""

    def __init__(self, phase: BarrierPhase = BarrierPhase.REGISTERING) -> None:
        self._phase = phase

    @classmethod
    def saved(cls, phase: str) -> BarrierPhases:
        """The phases of a run as `BarrierState.to_json` saved it (its `phase`)."""
        return cls(BarrierPhase(phase))

    @property
    def phase(self) -> BarrierPhase:
        return self._phase

    def allows(self, input: BarrierInput) -> bool:
        """Whether `input` may come in this phase."""
        return input in BARRIER_TRANSITIONS[self._phase]

    def expect(self, input: BarrierInput) -> None:
        """BarrierStateError unless `input` may come in this phase (nothing changes either way)."""
        if not self.allows(input):
            raise BarrierStateError(f"barrier: {input.value} is not possible while {self._phase.value}")

    def fire(self, input: BarrierInput, outcome: BarrierOutcome) -> BarrierPhase:
        """The one place the phase changes: along `BARRIER_TRANSITIONS`, or BarrierStateError (nothing changes)."""
        self.expect(input)
        to = BARRIER_TRANSITIONS[self._phase][input].get(outcome)
        if to is None:
            raise BarrierStateError(f"barrier: {input.value} cannot end {outcome.value} while {self._phase.value}")
        self._phase = to
        return to

    @property
    def registering(self) -> bool:
        """The roster is not made yet."""
        return self._phase is BarrierPhase.REGISTERING

    @property
    def rebinding(self) -> bool:
        """A resumed run waits for its members to come back."""
        return self._phase is BarrierPhase.REBINDING

    @property
    def running(self) -> bool:
        """A round is open: arrivals, joins, leaves and the clock decide."""
        return self._phase is BarrierPhase.RUNNING

    @property
    def finished(self) -> bool:
        return self._phase is BarrierPhase.FINISHED

    @property
    def failed(self) -> bool:
        return self._phase is BarrierPhase.FAILED

    @property
    def goes_on(self) -> bool:
        """The run has begun and not ended (running, or waiting for its members to come back)."""
        return self._phase in (BarrierPhase.RUNNING, BarrierPhase.REBINDING)

    @property
    def takes_members_back(self) -> bool:
        """Members that start again come back to it: while it waits for them, or failed so (they hear why)."""
        return self._phase in (BarrierPhase.REBINDING, BarrierPhase.FAILED)

    @property
    def run_phase(self) -> BarrierPhase:
        """The phase as the journal and /v1/status say it: a run waiting for its members to come back is running."""
        return BarrierPhase.RUNNING if self.goes_on else self._phase

    def said(self, written: bool) -> BarrierPhase:
        """The phase as /v1/status says it: finished only once its outcome is `written` (summary.json)."""
        return BarrierPhase.RUNNING if self.finished and not written else self.run_phase


class BarrierReason(StrEnum):
    """Why the barrier refuses a request: the code that crosses HTTP as `reason` and comes back out of the client."""

    BAD_ADDRESS = "bad_address"
    REGISTRATION_CLOSED = "registration_closed"
    REGISTRATION_FAILED = "registration_failed"
    RUN_NOT_JOINABLE = "run_not_joinable"
    UNKNOWN_RANK = "unknown_rank"
    DROPPED = "dropped"
    JOINING = "joining"
    BAD_ROUND = "bad_round"
    FUTURE_ROUND = "future_round"
    STALE_ROUND = "stale_round"
    BARRIER_TIMEOUT = "barrier_timeout"
    BARRIER_STOPPING = "barrier_stopping"
    LEFT = "left"
    RUN_FAILED = "run_failed"
    LAYOUT_CHANGED = "layout_changed"
    TASK_DIFFERS = "task_differs"
    NOT_FROM_MEMBER = "not_from_member"


class BarrierError(Exception):
    """A request the barrier refuses; the state is unchanged. `reason` is machine-readable."""

    def __init__(self, reason: BarrierReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class BarrierStateError(RuntimeError):
    """An event the barrier's phase has no row for (a bug in the caller, like h11's LocalProtocolError); the state is
    unchanged."""


@dataclass(frozen=True)
class Roster:
    """The roster is made: ranks are the addresses in this order; the run needs `min_members` live members."""

    addresses: tuple[str, ...]
    min_members: int
    ran: dict[str, Any] = field(default_factory=dict)  # what the nodes said they run (`RunTask.ran`)
    journaled: ClassVar[bool] = True  # saved before anyone hears of it (`DecisionRunner.apply`)


@dataclass(frozen=True)
class Withdrawal:
    """`address` withdrew its registration before the roster was made; `registered` nodes are left."""

    address: str
    registered: int
    reason: str = ""
    journaled: ClassVar[bool] = False  # before the roster: nobody heard of the registration

    def to_json(self) -> dict[str, Any]:
        return {"withdrawn": self.address, "registered": self.registered}


@dataclass(frozen=True)
class Rebound:
    """A member of a resumed run is back at `address`; `waiting_for`: those still awaited (none: the run goes on,
    its open round `round` started again now)."""

    rank: int
    address: str
    waiting_for: tuple[int, ...]
    round: int

    @property
    def all_back(self) -> bool:
        return not self.waiting_for

    @property
    def journaled(self) -> bool:
        """Only once every member is back: a run resumed before that waits for them all again."""
        return self.all_back


@dataclass(frozen=True)
class Joined:
    """`rank` (at `address`) sits out the open round `round` and is a member from the next one on; `release`: the
    open round's, if nobody else was awaited."""

    rank: int
    address: str
    round: int
    release: Release | None
    incarnation: bool = False  # a member's new process (restarted, with or without state), placed by this call
    journaled: ClassVar[bool] = True

    @property
    def from_round(self) -> int:
        return self.round + 1


@dataclass(frozen=True)
class Left:
    """`rank` left (or had left already): the run is at `round` with `live` members; `release`: the open round's, if
    it waited only for it (or too few are left)."""

    rank: int
    round: int
    live: tuple[int, ...]
    release: Release | None = None
    reason: str = ""
    journaled: ClassVar[bool] = True

    def to_json(self) -> dict[str, Any]:
        return {"left": self.rank, "round": self.round, "live": list(self.live)}


@dataclass(frozen=True)
class Failure:
    """The run ended, failed, at `round`, for `reason`; `registration`: the registration (or a resumed run's members
    coming back) could not complete (its deadline passed, `BarrierState.tick`, or the daemon said why, `fail`: the
    reason says the requests refused meanwhile); `stopped`: the members whose stop interrupted the run
    (`BarrierState.stop`). Never journaled: the run resumes from its last decision before it."""

    reason: str
    round: int
    registration: bool = False
    stopped: tuple[int, ...] = ()
    journaled: ClassVar[bool] = False


@dataclass(frozen=True)
class Held:
    """`rank` was told to stop: its leave is held until `until` (`BarrierState.leave_held`); not journaled."""

    rank: int
    reason: str
    until: float
    journaled: ClassVar[bool] = False


# what the state returns, each run by the daemon in the one order (journal, timers, records, notices)
BarrierDecision = Roster | Withdrawal | Rebound | Joined | Left | Failure | Held | Release


@dataclass
class Member:
    address: str
    missed: int = 0
    last_contact: float = 0.0
    last_round: int = -1  # the last round it finished sending (the final arrival at `rounds` is not one)
    placed_from: int = 0  # the round its last join placed it from (not journaled: a resumed run rebinds them all)


@dataclass
class _Round:
    """Arrivals at the open round: rank -> (time, report)."""

    opened: float = 0.0
    arrivals: dict[int, tuple[float, NodeReport | None]] = field(default_factory=dict)
    clock: LateClock = field(default_factory=LateClock)
    resumed: bool = False  # reopened from the journal (`BarrierState.returned`)


class BarrierState:
    def __init__(self, *, rounds: int, round_deadline: float, drop_after: int, expected: int = 0,
                 kept: int = 3, min_members: int = 1, count_rule: CountRule | None = None,
                 task: RunTask | None = None) -> None:
        """`min_members`: the fewest live members the run can go on with (fanout s needs s + 1; fewer: it fails);
        `count_rule`: the node count, taken once it holds still; `task`: what it runs (each registration must fit)."""
        self.rounds, self.round_deadline, self.drop_after, self.kept = rounds, round_deadline, drop_after, kept
        self.min_members, self.expected = min_members, expected
        self.phases = BarrierPhases()  # the phase and its table, apart from the roster and rounds below
        self.failure: str | None = None
        self.pending: dict[str, float] = {}
        self.addresses: tuple[str, ...] = ()
        self.members: dict[int, Member] = {}
        self.live: list[int] = []
        self.dropped: list[int] = []
        self.round = 0
        self.released: dict[int, Release] = {}
        self.closed: dict[int, dict[int, tuple[float, NodeReport | None]]] = {}
        self.events: list[Release] = []  # the releases with stragglers or joins (and so every drop)
        self.joining: list[int] = []  # members from the next round on
        self.left: list[int] = []  # members that said they leave (they are not waited for, nor sampled)
        self._gone: set[int] = set()  # dropped or left: what every arrival is checked against, in O(1)
        self.awaited: set[int] = set()  # REBINDING: the members not back yet
        self.heard_failure: set[int] = set()  # FAILED: the live members answered since (`unheard`)
        self._leaving: list[int] = []  # those that left during the open round (its release says so)
        self._open = _Round()
        self._count = NodeCount(count_rule) if count_rule is not None else None  # read as nodes register
        self.held = HeldStops()  # the leaves of members told to stop (`stop`), until `held.until`
        self._layout = LayoutClaim()  # the model every member must build
        self.task = task or RunTask("", own_loop=False, evaluates=False)
        self.registration = RegistrationWait()  # when the registration gives up, and what its failure line says

    phase = property(lambda self: self.phases.phase, doc="the barrier's phase (`BarrierPhases`)")

    # -- registration ------------------------------------------------------------------------------
    @property
    def registration_deadline(self) -> float | None:
        """When the registration, or a resumed run's members coming back with their checkpoints, fails (`tick`)."""
        return self.registration.due if self.phases.registering or self.phases.rebinding else None

    @property
    def complete(self) -> bool:
        """Every expected node has registered and the roster is not made yet: call close()."""
        return self.phases.registering and 0 < self.expected <= len(self.pending)

    def register(self, address: str, now: float, allow_new: bool = False, waited: bool = False) -> int | Joined | None:
        """None until the roster is made, then (`waited`) its rank; while the run goes on, `join`, or `_placed`."""
        _checked(address)
        if not waited and self.phases.goes_on and (allow_new or address in self.addresses):
            placed = address in self.addresses and _placed(self, rank := self.addresses.index(address))
            return rank if placed else self.join(address, now, allow_new)
        if self.addresses:
            if address in self.addresses:
                return self.addresses.index(address)
            raise _closed_to(address)
        if self.failure:
            raise BarrierError(BarrierReason.REGISTRATION_FAILED, self.failure)
        self.phases.fire(In.REGISTER, Out.NOTED)
        self.pending.setdefault(address, now)
        return None

    def withdraw(self, address: str, reason: str = "") -> Withdrawal | None:
        """A node that registered withdraws before the roster is made (told to stop): the roster is made without it.
        None where there is nothing to withdraw: it never registered, or the roster is made (it leaves, a member)."""
        if not self.phases.allows(In.WITHDRAW) or address not in self.pending:
            return None
        self.phases.fire(In.WITHDRAW, Out.NOTED)
        del self.pending[address]
        return Withdrawal(address, len(self.pending), reason)

    def count(self, reading: int, now: float = 0.0) -> None:
        """The node count read now (DNS, the nodes registered): taken once it holds still (`count_rule`), else 0."""
        self.phases.fire(In.COUNT, Out.NOTED)
        self.expected = self._count.read(reading, now) if self._count is not None else reading

    def close(self, now: float, min_members: int | None = None) -> Roster:
        """Make the roster: ranks are the registered addresses in sorted order. `min_members`: the run's, where it is
        known only now (the node count was)."""
        self.phases.fire(In.CLOSE, Out.CLOSED)
        if min_members is not None:
            self.min_members = min_members
        self.addresses = tuple(rank_addresses(list(self.pending)))
        self.members = {r: Member(a, last_contact=now) for r, a in enumerate(self.addresses)}
        self.live = list(self.members)
        self._open = _Round(opened=now)
        return Roster(self.addresses, self.min_members, self.task.ran())

    def rebind(self, rank: int, address: str, now: float) -> Rebound:
        """A member of a resumed run started again at another address: it keeps its rank (ranks never move). Once
        every awaited member is back, the open round starts again now: its deadline counts from now."""
        _check_rebind(self, rank, address)
        self.phases.expect(In.REBIND)
        self.addresses = tuple(address if r == rank else a for r, a in enumerate(self.addresses))
        self.members[rank].address, self.members[rank].last_contact = address, now
        self.awaited.discard(rank)
        if not self.awaited:
            self._open = _Round(opened=now)
        self.phases.fire(In.REBIND, Out.NOTED if self.awaited else Out.REOPENED)
        return Rebound(rank, address, tuple(sorted(self.awaited)), self.round)

    def join(self, address: str, now: float, allow_new: bool = False) -> Joined:
        """A member that lost its round (it restarted) or, with `allow_new`, a new node: its rank, and the release if
        nobody else is awaited now. It sits out the open round and is a member again from the next round on; new
        nodes get the next free rank, so no member's rank moves."""
        _check_join(self, address, allow_new)
        rank = self.addresses.index(address) if address in self.addresses else len(self.addresses)
        incarnation = rank < len(self.addresses) and _new_incarnation(self, rank)
        if rank == len(self.addresses):
            self.addresses, self.members[rank] = (*self.addresses, address), Member(address, last_contact=now)
        if rank in self.live:
            self.live.remove(rank)
            self._open.arrivals.pop(rank, None)
        self.dropped, self.left = [r for r in self.dropped if r != rank], [r for r in self.left if r != rank]
        self._gone.discard(rank)
        self.members[rank] = replace(self.members[rank], missed=0, last_contact=now, placed_from=self.round + 1)
        if rank not in self.joining:
            self.joining.append(rank)
        round, (release, outcome) = self.round, self._release(now) if set(self.live) <= set(self._open.arrivals) \
            else (None, Out.NOTED)
        self.phases.fire(In.JOIN, outcome)
        return Joined(rank, address, round, release, incarnation)

    def fail(self, reason: str, registration: bool = False) -> Failure:
        """The run ends now, failed, for `reason` (`registration`: the registration could not complete; said so)."""
        self.phases.fire(In.FAIL, Out.FAILED)
        self.failure = self.registration.said(reason) if registration else reason
        return Failure(self.failure, self.round, registration)

    def end(self, reason: str) -> Failure:
        """The run ends now for `reason` (a write failed, a stop): failed, or, failed already, recorded so."""
        return Failure(reason, self.round) if self.phases.failed else self.fail(reason)

    def stop(self, rank: int, reason: str, now: float) -> Held | Left | Failure | None:
        """`rank` was told to stop (a signal): its leave held (`HeldStops`), or, too few left, the run interrupted (a
        `Failure` naming them all, one stopped later too: resumable exactly). Not live: it leaves. None: held before."""
        if self.phases.failed and self.held.stopped and rank in self.live:
            return self._stopped(self.held.count(rank, len(self.addresses)))
        if not (self.phases.running and rank in self.live):
            return self.leave(rank, now, reason)
        if rank in self.held:
            self.phases.fire(In.STOP, Out.NOTED)
            return None
        until = self.held.hold(rank, reason, now)
        if not self.held.too_many(self.live, self.min_members):
            self.phases.fire(In.STOP, Out.NOTED)
            return Held(rank, reason, until)
        self.phases.fire(In.STOP, Out.FAILED)
        return self._stopped(self.held.interruption(len(self.addresses)))

    def _stopped(self, why: tuple[str, tuple[int, ...]] | None) -> Failure | None:
        self.failure = why[0] if why is not None else self.failure
        return Failure(why[0], self.round, stopped=why[1]) if why is not None else None

    def leave_held(self, now: float) -> Left | None:
        """The clock reached `held.until`: the next held leave applies (call again until None: none is left)."""
        while (due := self.held.due(now)) is not None:
            if self.phases.running and due[0] in self.live:
                return self.leave(due[0], now, due[1])
        return None

    def returned(self, address: str, restarted: bool = False) -> tuple[int, ...] | None:
        """`address` registers again: a member told to stop that is back does not leave; one `restarted` as a resumed
        run's first word stopped with the barrier (a full disk) as all did: all awaited back (returned; `rebind`)."""
        self.held.drop(rank := self.addresses.index(address) if address in self.addresses else -1)
        if not (restarted and _untouched(self, rank) and self.phases.allows(In.RESTART)):
            return None
        self.phases.fire(In.RESTART, Out.AWAITING)
        self.awaited = set(self.live) | set(self.joining)
        return tuple(sorted(self.awaited))

    def leave(self, rank: int, now: float, reason: str = "") -> Left:
        """`rank` leaves the run (it was told to stop, or it failed): nobody waits for it from now on and it is
        not sampled from the next round; the release if the open round needed only it (or if too few are left)."""
        _check_leave(self, rank)
        release, outcome = None, Out.NOTED
        if rank not in self.left and rank not in self.dropped:
            self.live, self.joining = [r for r in self.live if r != rank], [r for r in self.joining if r != rank]
            self._open.arrivals.pop(rank, None)
            self.left.append(rank), self._leaving.append(rank)
            self._gone.add(rank)
            if len(self.live) < self.min_members or set(self.live) <= set(self._open.arrivals):
                release, outcome = self._release(now)
        self.phases.fire(In.LEAVE, outcome)
        return Left(rank, self.round, tuple(self.live), release, reason)

    # -- rounds ------------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        """When the open round is released whoever has arrived (a little later where the clock came late: `tick`)."""
        return self._open.clock.deadline(self._open.opened + self.round_deadline) if self.phases.running else None

    def arrive(self, rank: int, round: int, now: float, report: NodeReport | None = None) -> Release | None:
        """`rank` is done sending `round`; the release if this arrival completes the round. An arrival at a round
        already released (a retry) is contact only: None (its answer is that release, `released[round]`, kept)."""
        self.check(rank, round)
        if round < self.round:
            self.members[rank].last_contact = now
            return None
        self.phases.expect(In.ARRIVE)
        member = self.members[rank]
        member.last_contact, member.last_round, member.missed = now, min(round, self.rounds - 1), 0
        (arrivals := self._open.arrivals).setdefault(rank, (now, report))  # a live member's (`check`): complete
        complete = len(arrivals) >= len(self.live) and all(r in arrivals for r in self.live)  # once as many
        release, outcome = self._release(now) if complete else (None, Out.NOTED)
        self.phases.fire(In.ARRIVE, outcome)
        return release

    def check(self, rank: int, round: int) -> None:
        """Raise the BarrierError that an arrival of `rank` at `round` would get now (changes nothing)."""
        _check_arrival(self, rank, round)

    def claim_layout(self, rank: int, claim: tuple[int, str] | None, round: int | None = None) -> str | None:
        """Why `rank`'s claimed layout (values, fingerprint) cannot take part in the run (it ends then: `end`); a
        stale `round` claims nothing, a changed claim is not that member's (BarrierError layout_changed)."""
        return _layout_claimed(self._layout, rank, claim, round is not None and round < self.round)

    def tick(self, now: float, due: float | None = None) -> Release | Failure | None:
        """The clock moved: the open round's release at its deadline (`due`: the timer's; late: `LateClock`), or the
        run's failure at the registration's."""
        if (deadline := self.registration_deadline) is not None and now >= deadline:
            why = self.registration.failure(self.pending, self.expected, self.awaited, self.phases.rebinding)
            self.phases.fire(In.TICK, Out.FAILED)
            self.failure = why
            return Failure(why, self.round, registration=True)
        if (deadline := self.deadline) is None or now < deadline or self._open.clock.woke_late(now, due):
            return None
        release, outcome = self._release(now)
        self.phases.fire(In.TICK, outcome)
        return release

    def _release(self, now: float) -> tuple[Release, BarrierOutcome]:
        """Release the open round: the release, and how it moves the phase (the caller's input fires it, once)."""
        t, arrivals = self.round, self._open.arrivals
        stragglers = tuple(r for r in self.live if r not in arrivals)
        newly = _missed([self.members[r] for r in stragglers], stragglers, self.drop_after)
        self.dropped += newly
        self._gone.update(newly)
        joined = tuple(sorted(self.joining))
        self.live = sorted(r for r in [*self.live, *joined] if r not in self._gone)
        self.joining = [r for r in self.joining if r not in joined]
        too_few = len(self.live) < self.min_members
        finished = t >= self.rounds or too_few
        left, self._leaving = tuple(self._leaving), []
        release = Release(t, tuple(self.live), stragglers, tuple(self.dropped), finished, joined, left)
        self.released[t] = release
        if stragglers or joined or left:
            self.events.append(release)
        self.closed[t] = {r: (now - at, report) for r, (at, report) in sorted(arrivals.items())}
        self.released.pop(t - self.kept, None), self.closed.pop(t - self.kept, None)
        self.round = t + 1
        self._open = _Round(opened=now)
        if too_few and (t < self.rounds or not self.live):
            missed = f"missed the round deadline {self.round_deadline:g}s {self.drop_after} rounds in a row"
            self.failure = too_few_reason(t, self.live, self.dropped, self.left, self.min_members, missed)
            return release, Out.FAILED
        return release, Out.FINISHED if finished else Out.RELEASED

    # -- what the nodes hear -------------------------------------------------------------------------
    def notice(self, release: Release) -> ReleaseNotice:
        """`release` as the nodes hear it: with the joining members' addresses, and why the run failed if it did."""
        failed = release.finished and self.phases.failed
        return ReleaseNotice(release, tuple((r, self.addresses[r]) for r in release.joined),
                             self.failure if failed else None)

    def answered(self, rank: int) -> None:
        """`rank` got an answer to an arrival or a leave: if the run has failed, that answer said so."""
        if self.phases.failed and rank in self.live:
            self.heard_failure.add(rank)

    def unheard(self, own: int) -> list[int]:
        """The live members other than `own` not yet told that the run failed."""
        return [r for r in self.live if r != own and r not in self.heard_failure]

    # -- persistence ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """What a restarted barrier needs to decide as this one would (not the open round's arrivals: retried)."""
        return _saved(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], now: float, rebind: bool = False) -> BarrierState:
        """The state `to_json` saved; the open round (re)opens at `now`. `rebind`: a running run's members start
        again at new addresses (--resume-round): REBINDING until every live member is back (`rebind`)."""
        state = cls(rounds=data["rounds"], round_deadline=data["round_deadline"], drop_after=data["drop_after"],
                    expected=data["expected"], kept=data["kept"], min_members=data.get("min_members", 1))
        state.phases, state.failure = BarrierPhases.saved(data["phase"]), data["failure"]  # loaded, not moved
        state.addresses = tuple(data["addresses"])
        state.members = {r: Member(a, missed=m[0], last_contact=now, last_round=m[1])
                         for r, (a, m) in enumerate(zip(state.addresses, data["members"], strict=True))}
        state.round, state.live = data["round"], list(data["live"])
        state.dropped, state.joining = list(data["dropped"]), list(data["joining"])
        state.left, state._leaving = list(data.get("left", [])), list(data.get("leaving", []))
        state._gone = set(state.dropped) | set(state.left)
        state.released = {r["round"]: Release.from_json(r) for r in data["released"]}
        state.events = [Release.from_json(e) for e in data["events"]]
        state._open = _Round(opened=now, resumed=True)
        awaited = set(state.live) | set(state.joining)
        if rebind and awaited and state.phases.allows(In.RESTART):
            state.phases.fire(In.RESTART, Out.AWAITING)
            state.awaited = awaited
        return state


def _saved(state: BarrierState) -> dict[str, Any]:
    return {"rounds": state.rounds, "round_deadline": state.round_deadline, "drop_after": state.drop_after,
            "kept": state.kept, "expected": state.expected, "phase": state.phases.run_phase.value,
            "failure": state.failure,
            "addresses": list(state.addresses), "round": state.round, "live": state.live,
            "dropped": state.dropped, "joining": state.joining, "left": state.left, "leaving": state._leaving,
            "min_members": state.min_members,
            "members": [[m.missed, m.last_round] for m in state.members.values()],
            "released": [r.to_json() for _, r in sorted(state.released.items())],
            "events": [e.to_json() for e in state.events]}


def _placed(state: BarrierState, rank: int) -> bool:
    """`rank` joined (told so: 409 `joining`), and asks again for its place once the release that placed it opened
    the round: a live member of the open round that has sent nothing since, as every member starting a round."""
    member = state.members[rank]
    return state.phases.running and rank in state.live and 0 < member.placed_from == state.round > member.last_round


def _new_incarnation(state: BarrierState, rank: int) -> bool:
    """A member's registration while the run goes on (in round 0 too) is a new process of it, unless it is the one
    told so asking again for its place: placed by a join (`joining`, or a member again from a round since) and not
    done sending a round since."""
    member = state.members[rank]
    return rank not in state.joining and (member.placed_from == 0 or member.last_round >= member.placed_from)


def _check_arrival(state: BarrierState, rank: int, round: int) -> None:
    """`BarrierState.check`: reads it, writes nothing."""
    if not state.members or rank not in state.members:
        raise BarrierError(BarrierReason.UNKNOWN_RANK, f"rank {rank} is not registered")
    if state.phases.failed:
        raise BarrierError(BarrierReason.RUN_FAILED, ended_line(str(state.failure)))
    if state.phases.rebinding:
        raise BarrierError(BarrierReason.BAD_ROUND, f"the resumed run waits for members {sorted(state.awaited)} "
                           "to come back, started again: no round is open (one running from before: restart it)")
    if rank in state._gone and rank in state.dropped:
        raise BarrierError(BarrierReason.DROPPED, f"rank {rank} was dropped from the run")
    if rank in state._gone:
        raise BarrierError(BarrierReason.LEFT, f"rank {rank} left the run")
    if rank in state.joining and round >= state.round:
        raise BarrierError(BarrierReason.JOINING, f"rank {rank} is a member again from round {state.round + 1} on")
    if round > state.rounds:
        raise BarrierError(BarrierReason.BAD_ROUND, f"round {round} is past the run's {state.rounds} rounds")
    if round > state.round:
        raise BarrierError(BarrierReason.FUTURE_ROUND, f"round {round} is not open (the barrier is at "
                           f"{state.round})")
    if round < state.round and round not in state.released:
        raise BarrierError(BarrierReason.STALE_ROUND,
                           f"round {round} was released long ago (the barrier is at {state.round})")


def _check_rebind(state: BarrierState, rank: int, address: str) -> None:
    """The BarrierError a rebind of `rank` at `address` gets now (`BarrierState.rebind`: reads it, writes nothing)."""
    if rank not in state.awaited:
        raise BarrierError(BarrierReason.REGISTRATION_CLOSED, f"rank {rank} is not a member the resumed run waits "
                           f"for (it waits for {sorted(state.awaited)})")
    _checked(address)


def _check_join(state: BarrierState, address: str, allow_new: bool) -> None:
    """The BarrierError a join of `address` gets now (`BarrierState.join`: reads it, writes nothing)."""
    _checked(address)
    if not state.phases.allows(In.JOIN) or state.round + 1 >= state.rounds:
        raise BarrierError(BarrierReason.RUN_NOT_JOINABLE, f"the run is {state.phase.value}, at round {state.round} "
                           f"of {state.rounds}: no round is left to join")
    if address not in state.addresses and not allow_new:
        raise _closed_to(address)


def _check_leave(state: BarrierState, rank: int) -> None:
    """The BarrierError a leave of `rank` gets now (`BarrierState.leave`: reads it, writes nothing)."""
    if not state.members or rank not in state.members:
        raise BarrierError(BarrierReason.UNKNOWN_RANK, f"rank {rank} is not registered")
    if not state.phases.allows(In.LEAVE):
        raise BarrierError(BarrierReason.RUN_FAILED if state.phases.failed
                           else BarrierReason.BAD_ROUND, f"the run is {state.phase.value}")


def _layout_claimed(layout: LayoutClaim, rank: int, claim: tuple[int, str] | None, stale: bool) -> str | None:
    """`BarrierState.claim_layout`: a `stale` arrival claims nothing; a changed claim is refused alone."""
    if stale:
        return None
    if (changed := layout.changed(rank, claim)) is not None:
        raise BarrierError(BarrierReason.LAYOUT_CHANGED, changed)
    return layout.differs(rank, claim)


def _missed(members: list[Member], ranks: tuple[int, ...], drop_after: int) -> list[int]:
    """The stragglers `ranks` (`members`) missed one more round: those that missed `drop_after` in a row."""
    for member in members:
        member.missed += 1
    return [r for r, m in zip(ranks, members, strict=True) if m.missed >= drop_after]


def _untouched(state: BarrierState, rank: int) -> bool:
    """`rank` is a live member of a resumed run's reopened round, and no member was heard from since it reopened."""
    return state._open.resumed and rank in (*state.live, *state.joining) and \
        all(m.last_contact <= state._open.opened for m in state.members.values())


def _checked(address: str) -> None:
    try:
        parse_address(address)
    except MembershipError as exc:
        raise BarrierError(BarrierReason.BAD_ADDRESS, str(exc)) from None


def _closed_to(address: str) -> BarrierError:
    return BarrierError(BarrierReason.REGISTRATION_CLOSED, f"the run started without {address} (a barrier started "
                        "that allows joins takes new nodes during the run)")

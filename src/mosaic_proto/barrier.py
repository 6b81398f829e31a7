"""`BarrierState`: the barrier's decisions, with no I/O.

The daemon (or the in-memory network) feeds it registrations, arrivals and the clock, and gets decisions
back: who has which rank, when a round is released, who straggled, who is dropped, when the run is over.

    state = BarrierState(rounds=T, round_deadline=30.0, drop_after=2, expected=n)
    state.register("10.0.0.5:9000", now)        # until state.complete, then:
    state.close(now)                            # ranks = sorted addresses
    release = state.arrive(rank, t, now, report)   # a Release once every live member arrived at t
    release = state.tick(now)                   # or once the round's deadline has passed

Arriving at round t means: done sending round t (t = rounds means done with the run). The deadline of
round t runs from the round's opening (the release of round t-1, or the roster for round 0), so that every
wait ends even if nobody arrives; members that have not arrived by then are stragglers, and a member that
straggles `drop_after` rounds in a row is dropped from the next round on. A run whose members are all
dropped ends, failed.

    rank = state.join(address, now)             # a member that restarted (or, allow_new, a newcomer):
                                                # it sits out the open round and is a member from the next
    saved = state.to_json(); BarrierState.from_json(saved, now)   # what a restarted barrier resumes from
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .membership import MembershipError, parse_address, rank_addresses
from .report import NodeReport

__all__ = ["BarrierError", "BarrierPhase", "BarrierReason", "BarrierState", "Member", "Release", "rebind", "reopen"]


class BarrierPhase(StrEnum):
    REGISTERING = "registering"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


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


class BarrierError(Exception):
    """A request the barrier refuses; the state is unchanged. `reason` is machine-readable."""

    def __init__(self, reason: BarrierReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Release:
    """Round `round` is over: `members` go on to the next round."""

    round: int
    members: tuple[int, ...]
    stragglers: tuple[int, ...]
    dropped: tuple[int, ...]  # every member dropped so far
    finished: bool = False
    joined: tuple[int, ...] = ()  # members from the next round on that were not in this one
    left: tuple[int, ...] = ()  # members that said they leave during this round

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "members": list(self.members), "stragglers": list(self.stragglers),
                "dropped": list(self.dropped), "finished": self.finished, "joined": list(self.joined),
                "left": list(self.left)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        return cls(int(data["round"]), tuple(data["members"]), tuple(data["stragglers"]), tuple(data["dropped"]),
                   bool(data["finished"]), tuple(data.get("joined", ())), tuple(data.get("left", ())))


@dataclass
class Member:
    address: str
    missed: int = 0
    last_contact: float = 0.0
    last_round: int = -1  # the last round it finished sending (the final arrival at `rounds` is not one)


@dataclass
class _Round:
    """Arrivals at the open round: rank -> (time, report)."""

    opened: float = 0.0
    arrivals: dict[int, tuple[float, NodeReport | None]] = field(default_factory=dict)


class BarrierState:
    def __init__(self, *, rounds: int, round_deadline: float, drop_after: int, expected: int = 0,
                 kept: int = 3, min_members: int = 1) -> None:
        """`min_members`: the fewest live members the run can go on with (fanout s needs s + 1): with fewer, the
        run ends at once, failed, instead of every node failing to sample its peers."""
        self.rounds, self.round_deadline, self.drop_after, self.kept = rounds, round_deadline, drop_after, kept
        self.min_members = min_members
        self.expected = expected
        self.phase = BarrierPhase.REGISTERING
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
        self._leaving: list[int] = []  # those that left during the open round (its release says so)
        self._open = _Round()

    # -- registration ------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Every expected node has registered and the roster is not made yet: call close()."""
        return self.phase is BarrierPhase.REGISTERING and 0 < self.expected <= len(self.pending)

    def register(self, address: str, now: float) -> int | None:
        """Record a registration; its rank once the roster is made, else None (ask again after close())."""
        try:
            parse_address(address)
        except MembershipError as exc:
            raise BarrierError(BarrierReason.BAD_ADDRESS, str(exc)) from None
        if self.addresses:
            if address in self.addresses:
                return self.addresses.index(address)
            raise BarrierError(BarrierReason.REGISTRATION_CLOSED,
                               f"the run started without {address} (a barrier started "
                               "that allows joins takes new nodes during the run)")
        if self.failure:
            raise BarrierError(BarrierReason.REGISTRATION_FAILED, self.failure)
        self.pending.setdefault(address, now)
        return None

    def close(self, now: float) -> tuple[str, ...]:
        """Make the roster: ranks are the registered addresses in sorted order."""
        self.addresses = tuple(rank_addresses(list(self.pending)))
        self.members = {r: Member(a, last_contact=now) for r, a in enumerate(self.addresses)}
        self.live = list(self.members)
        self.phase = BarrierPhase.RUNNING
        self._open = _Round(opened=now)
        return self.addresses

    def join(self, address: str, now: float, allow_new: bool = False) -> tuple[int, Release | None]:
        """A member that lost its round (it restarted) or, with `allow_new`, a new node: its rank, and the
        release if nobody else is awaited now. It sits out the open round (nobody waits for it there) and is a
        member again from the next round on.

        New nodes get the next free rank, so no member's rank moves; the member list stays sorted by rank."""
        try:
            parse_address(address)
        except MembershipError as exc:
            raise BarrierError(BarrierReason.BAD_ADDRESS, str(exc)) from None
        if self.phase is not BarrierPhase.RUNNING or self.round + 1 >= self.rounds:
            raise BarrierError(BarrierReason.RUN_NOT_JOINABLE,
                               f"the run is {self.phase.value}, at round {self.round} of "
                                                   f"{self.rounds}: no round is left to join")
        if address in self.addresses:
            rank = self.addresses.index(address)
        elif not allow_new:
            raise BarrierError(BarrierReason.REGISTRATION_CLOSED,
                               f"the run started without {address} (a barrier started "
                               "that allows joins takes new nodes during the run)")
        else:
            rank = len(self.addresses)
            self.addresses = (*self.addresses, address)
            self.members[rank] = Member(address, last_contact=now)
        if rank in self.live:
            self.live.remove(rank)
            self._open.arrivals.pop(rank, None)
        self.dropped, self.left = [r for r in self.dropped if r != rank], [r for r in self.left if r != rank]
        self.members[rank].missed, self.members[rank].last_contact = 0, now
        if rank not in self.joining:
            self.joining.append(rank)
        return rank, self._release(now) if set(self.live) <= set(self._open.arrivals) else None

    def fail(self, reason: str) -> None:
        self.failure = reason
        self.phase = BarrierPhase.FAILED

    def leave(self, rank: int, now: float) -> Release | None:
        """`rank` leaves the run (it was told to stop, or it failed): nobody waits for it from now on and it is
        not sampled from the next round; the release if the open round needed only it (or if too few are left)."""
        if not self.members or rank not in self.members:
            raise BarrierError(BarrierReason.UNKNOWN_RANK, f"rank {rank} is not registered")
        if self.phase is not BarrierPhase.RUNNING:
            raise BarrierError(BarrierReason.RUN_FAILED if self.phase is BarrierPhase.FAILED
                               else BarrierReason.BAD_ROUND, f"the run is {self.phase.value}")
        if rank in self.left or rank in self.dropped:
            return None
        self.live, self.joining = [r for r in self.live if r != rank], [r for r in self.joining if r != rank]
        self._open.arrivals.pop(rank, None)
        self.left.append(rank), self._leaving.append(rank)
        if len(self.live) < self.min_members or set(self.live) <= set(self._open.arrivals):
            return self._release(now)
        return None

    # -- rounds ------------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        """When the open round is released whoever has arrived."""
        if self.phase is not BarrierPhase.RUNNING:
            return None
        return self._open.opened + self.round_deadline

    def arrive(self, rank: int, round: int, now: float, report: NodeReport | None = None) -> Release | None:
        """`rank` is done sending `round`; the release if this arrival completes the round.

        An arrival at a round already released returns that release (a retry), as long as it is kept.
        """
        self.check(rank, round)
        if round < self.round:
            self.members[rank].last_contact = now
            return self.released[round]
        member = self.members[rank]
        member.last_contact, member.last_round, member.missed = now, min(round, self.rounds - 1), 0
        self._open.arrivals.setdefault(rank, (now, report))
        if set(self.live) <= set(self._open.arrivals):
            return self._release(now)
        return None

    def check(self, rank: int, round: int) -> None:
        """Raise the BarrierError that an arrival of `rank` at `round` would get now (changes nothing)."""
        if not self.members or rank not in self.members:
            raise BarrierError(BarrierReason.UNKNOWN_RANK, f"rank {rank} is not registered")
        if self.phase is BarrierPhase.FAILED:
            raise BarrierError(BarrierReason.RUN_FAILED, f"the run failed: {self.failure}")
        if rank in self.dropped:
            raise BarrierError(BarrierReason.DROPPED, f"rank {rank} was dropped from the run")
        if rank in self.left:
            raise BarrierError(BarrierReason.LEFT, f"rank {rank} left the run")
        if rank in self.joining and round >= self.round:
            raise BarrierError(BarrierReason.JOINING, f"rank {rank} is a member again from round {self.round + 1} on")
        if round > self.rounds:
            raise BarrierError(BarrierReason.BAD_ROUND, f"round {round} is past the run's {self.rounds} rounds")
        if round > self.round:
            raise BarrierError(BarrierReason.FUTURE_ROUND,
                               f"round {round} is not open (the barrier is at {self.round})")
        if round < self.round and round not in self.released:
            raise BarrierError(BarrierReason.STALE_ROUND,
                               f"round {round} was released long ago (the barrier is at {self.round})")

    def tick(self, now: float) -> Release | None:
        """The clock moved: the release if the open round's deadline has passed."""
        deadline = self.deadline
        return self._release(now) if deadline is not None and now >= deadline else None

    def _release(self, now: float) -> Release:
        t, arrivals = self.round, self._open.arrivals
        stragglers = tuple(r for r in self.live if r not in arrivals)
        newly = []
        for r in stragglers:
            self.members[r].missed += 1
            if self.members[r].missed >= self.drop_after:
                newly.append(r)
        self.dropped += newly
        joined = tuple(sorted(self.joining))
        self.live = sorted(r for r in [*self.live, *joined] if r not in newly)
        self.joining = [r for r in self.joining if r not in joined]
        too_few = len(self.live) < self.min_members
        finished = t >= self.rounds or too_few
        left, self._leaving = tuple(self._leaving), []
        release = Release(t, tuple(self.live), stragglers, tuple(self.dropped), finished, joined, left)
        self.released[t] = release
        if stragglers or joined or left:
            self.events.append(release)
        self.closed[t] = {r: (now - at, report) for r, (at, report) in sorted(arrivals.items())}
        self.released.pop(t - self.kept, None)
        self.closed.pop(t - self.kept, None)
        self.round = t + 1
        self._open = _Round(opened=now)
        if too_few and (t < self.rounds or not self.live):
            self.fail(too_few_reason(self, t))
        elif finished:
            self.phase = BarrierPhase.FINISHED
        return release

    # -- persistence ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """What a restarted barrier needs to go on deciding as this one would (`dump_state`)."""
        return dump_state(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], now: float) -> BarrierState:
        """The state `to_json` saved; the open round (re)opens at `now`."""
        return load_state(data, now)


def rebind(state: BarrierState, rank: int, address: str, now: float) -> None:
    """A member of a resumed run started again at another address: it keeps its rank (ranks never move)."""
    parse_address(address)
    state.addresses = tuple(address if r == rank else a for r, a in enumerate(state.addresses))
    state.members[rank].address, state.members[rank].last_contact = address, now


def withdraw(state: BarrierState, address: str) -> bool:
    """A node that registered withdraws before the roster is made (it was told to stop): the roster is made without
    it. False where there is nothing to withdraw: it never registered, or the roster is made (it is a member then,
    and leaves as one)."""
    if state.phase is not BarrierPhase.REGISTERING or address not in state.pending:
        return False
    del state.pending[address]
    return True


def reopen(state: BarrierState, now: float) -> None:
    """The open round starts again now (a resumed run whose members are all back): its deadline counts from now."""
    state._open = _Round(opened=now)


def too_few_reason(state: BarrierState, t: int) -> str:
    """Why a run with too few live members after round `t` ends."""
    parts = [f"dropped {state.dropped} (missed the round deadline {state.round_deadline:g}s {state.drop_after} "
             f"rounds in a row)"] if state.dropped else []
    gone = ", ".join(parts + ([f"left {state.left}"] if state.left else []))
    if not state.live:
        return f"every member was dropped or left by round {t}; {gone}"
    return (f"{len(state.live)} members are left after round {t} ({list(state.live)}), fewer than the "
            f"{state.min_members} the run needs (each sends every fragment to {state.min_members - 1} others); {gone}")


def dump_state(self: BarrierState) -> dict[str, Any]:
    """What a restarted barrier needs to go on deciding as this one would (arrivals at the open round are
    not kept: the nodes retry them)."""
    return {"rounds": self.rounds, "round_deadline": self.round_deadline, "drop_after": self.drop_after,
            "kept": self.kept, "expected": self.expected, "phase": self.phase.value, "failure": self.failure,
            "addresses": list(self.addresses), "round": self.round, "live": self.live,
            "dropped": self.dropped, "joining": self.joining, "left": self.left, "leaving": self._leaving,
            "min_members": self.min_members,
            "members": [[m.missed, m.last_round] for m in self.members.values()],
            "released": [r.to_json() for _, r in sorted(self.released.items())],
            "events": [e.to_json() for e in self.events]}


def load_state(data: dict[str, Any], now: float) -> BarrierState:
    """The state `to_json` saved; the open round (re)opens at `now`."""
    state = BarrierState(rounds=data["rounds"], round_deadline=data["round_deadline"], drop_after=data["drop_after"],
                expected=data["expected"], kept=data["kept"], min_members=data.get("min_members", 1))
    state.phase, state.failure = BarrierPhase(data["phase"]), data["failure"]
    state.addresses = tuple(data["addresses"])
    state.members = {r: Member(a, missed=m[0], last_contact=now, last_round=m[1])
                     for r, (a, m) in enumerate(zip(state.addresses, data["members"], strict=True))}
    state.round, state.live = data["round"], list(data["live"])
    state.dropped, state.joining = list(data["dropped"]), list(data["joining"])
    state.left, state._leaving = list(data.get("left", [])), list(data.get("leaving", []))
    state.released = {r["round"]: Release.from_json(r) for r in data["released"]}
    state.events = [Release.from_json(e) for e in data["events"]]
    state._open = _Round(opened=now)
    return state

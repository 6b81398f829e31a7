"""`BarrierState`: the barrier's decisions, with no I/O.

The daemon (or the in-memory network) feeds it registrations, arrivals and the clock, and gets decisions
back: who has which rank, when a round is released, who straggled, who is dropped, when the run is over.

    state = BarrierState(rounds=T, round_deadline=30.0, drop_after=2, expected=n)
    state.register("10.0.0.5:9000", now)        # until state.complete, then:
    state.close(now)                            # ranks = sorted addresses
    release = state.arrive(rank, t, now, report)   # a Release once every live member arrived at t
    release = state.tick(now)                   # or once the round's deadline has passed

Arriving at round t means: done sending round t (t = rounds means done with the run). The deadline of
round t runs from its first arrival; members that have not arrived by then are stragglers, and a member
that straggles `drop_after` rounds in a row is dropped from the next round on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .membership import MembershipError, parse_address, rank_addresses

__all__ = ["BarrierError", "BarrierPhase", "BarrierState", "Member", "Release", "received_counts"]


class BarrierPhase(StrEnum):
    REGISTERING = "registering"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class BarrierError(Exception):
    """A request the barrier refuses; the state is unchanged. `reason` is machine-readable."""

    def __init__(self, reason: str, detail: str) -> None:
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

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "members": list(self.members), "stragglers": list(self.stragglers),
                "dropped": list(self.dropped), "finished": self.finished}


@dataclass
class Member:
    address: str
    missed: int = 0
    last_contact: float = 0.0
    last_round: int = -1  # the last round it finished sending (the final arrival at `rounds` is not one)


@dataclass
class _Round:
    """Arrivals at the open round: rank -> (time, report)."""

    arrivals: dict[int, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)
    first: float | None = None


class BarrierState:
    def __init__(self, *, rounds: int, round_deadline: float, drop_after: int, expected: int = 0,
                 kept: int = 3) -> None:
        self.rounds, self.round_deadline, self.drop_after, self.kept = rounds, round_deadline, drop_after, kept
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
        self.closed: dict[int, dict[int, tuple[float, dict[str, Any] | None]]] = {}
        self.events: list[Release] = []  # the releases with stragglers (and so every drop)
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
            raise BarrierError("bad_address", str(exc)) from None
        if self.addresses:
            if address in self.addresses:
                return self.addresses.index(address)
            raise BarrierError("registration_closed", f"the run started without {address}")
        if self.failure:
            raise BarrierError("registration_failed", self.failure)
        self.pending.setdefault(address, now)
        return None

    def close(self, now: float) -> tuple[str, ...]:
        """Make the roster: ranks are the registered addresses in sorted order."""
        self.addresses = tuple(rank_addresses(list(self.pending)))
        self.members = {r: Member(a, last_contact=now) for r, a in enumerate(self.addresses)}
        self.live = list(self.members)
        self.phase = BarrierPhase.RUNNING
        return self.addresses

    def fail(self, reason: str) -> None:
        self.failure = reason
        self.phase = BarrierPhase.FAILED

    # -- rounds ------------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        """When the open round is released whoever has arrived (None: nobody has arrived yet)."""
        if self.phase is not BarrierPhase.RUNNING or self._open.first is None:
            return None
        return self._open.first + self.round_deadline

    def arrive(self, rank: int, round: int, now: float, report: dict[str, Any] | None = None) -> Release | None:
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
        if self._open.first is None:
            self._open.first = now
        if set(self.live) <= set(self._open.arrivals):
            return self._release(now)
        return None

    def check(self, rank: int, round: int) -> None:
        """Raise the BarrierError that an arrival of `rank` at `round` would get now (changes nothing)."""
        if not self.members or rank not in self.members:
            raise BarrierError("unknown_rank", f"rank {rank} is not registered")
        if rank in self.dropped:
            raise BarrierError("dropped", f"rank {rank} was dropped from the run")
        if round > self.rounds:
            raise BarrierError("bad_round", f"round {round} is past the run's {self.rounds} rounds")
        if round > self.round:
            raise BarrierError("future_round", f"round {round} is not open (the barrier is at {self.round})")
        if round < self.round and round not in self.released:
            raise BarrierError("stale_round", f"round {round} was released long ago (the barrier is at {self.round})")

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
        self.live = [r for r in self.live if r not in newly]
        finished = t >= self.rounds
        release = Release(t, tuple(self.live), stragglers, tuple(self.dropped), finished)
        self.released[t] = release
        if stragglers:
            self.events.append(release)
        self.closed[t] = {r: (now - at, report) for r, (at, report) in sorted(arrivals.items())}
        self.released.pop(t - self.kept, None)
        self.closed.pop(t - self.kept, None)
        self.round = t + 1
        self._open = _Round()
        if finished:
            self.phase = BarrierPhase.FINISHED
        return release


def received_counts(reports: dict[int, dict[str, Any] | None]) -> dict[int, tuple[int, int, int]]:
    """receiver -> (messages, fragments, bytes) delivered to it, summed from the senders' `delivered` maps.

    A sender knows which of its messages a peer accepted as soon as it is done sending, so a round's
    incoming traffic is complete when the round is released, without asking the receivers again.
    """
    counts: dict[int, list[int]] = {}
    for report in reports.values():
        for peer, (fragments, nbytes) in ((report or {}).get("delivered") or {}).items():
            c = counts.setdefault(int(peer), [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + fragments, c[2] + nbytes
    return {peer: (c[0], c[1], c[2]) for peer, c in sorted(counts.items())}

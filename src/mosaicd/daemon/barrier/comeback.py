"""A run resumed by a barrier whose members start again with it: rank 0 of a peer list, stopped and started again
with the others (`Barrier(members_return=True)`). Its journal keeps the open round and the one before; each member
says, as it registers again, the rounds of its checkpoints; once every live member is back, the run goes on at the
newest kept round of which every live member has a checkpoint (`mosaic_proto.resume_point`, the rule of `mosaicd
cluster --resume` too, fed the journal's kept states by `barrier_journal.resume_point`), every member from its
checkpoint of that round: exactly the run that was never stopped. Where there is no such round the run says so and
why, and does not go on otherwise (`NotExact`).

`Comeback` keeps who is back and what each holds, and feeds the rule; the registration's long polls are the
`Registrar`'s (registration.py), the state of the chosen round the `Barrier`'s (`resume_at`).
"""

from __future__ import annotations

from collections.abc import Iterable

from mosaic_proto import BarrierError, BarrierReason, BarrierState
from mosaicd.daemon.barrier import journal as barrier_journal
from mosaicd.settings import DaemonOptions, RunConfig


class NotExact(ValueError):
    """The members that came back hold no checkpoint of one same round the journal keeps (the message says which)."""


class Comeback:
    """The members of a resumed run that registered again, at which address, with the rounds of their
    checkpoints; and the round the run goes on at once all are back (`choose`)."""

    def __init__(self, options: DaemonOptions, run: RunConfig, secured: bool) -> None:
        self.options, self.run, self.secured = options, run, secured
        self.addresses: dict[int, str] = {}  # rank -> the address it registered again at
        self.held: dict[int, set[int]] = {}  # rank -> the rounds it can go on from
        self.round: int | None = None  # chosen (`choose`)

    def waits(self, state: BarrierState, address: str) -> bool:
        """Whether a registration of `address` is a member's that comes back: while the run waits for them (or
        failed so), and (a long poll sent again) at the chosen round, before its release."""
        return state.phases.takes_members_back or \
            (self.round == state.round and address in self.addresses.values())

    def back(self, state: BarrierState, address: str, held: Iterable[int]) -> int:
        """`address` registered again, with checkpoints of the rounds `held`: its rank (BarrierError where it is
        not a live member of the run). Round 0 needs none: every member starts it from the task's initial model."""
        if address not in state.addresses:
            raise BarrierError(BarrierReason.REGISTRATION_CLOSED, f"the run resumed in {self.options.out} has no "
                               f"member {address} (its members: {', '.join(state.addresses)})")
        rank = state.addresses.index(address)
        if rank not in state.awaited:
            raise BarrierError(BarrierReason.REGISTRATION_CLOSED, f"rank {rank} ({address}) is not a live member of "
                               f"the resumed run (it waits for {sorted(state.awaited)})")
        self.addresses[rank], self.held[rank] = address, {*held, 0}
        return rank

    def forget(self, address: str) -> bool:
        """A member that came back withdraws (it was told to stop before the others were back)."""
        rank = next((r for r, a in self.addresses.items() if a == address), None)
        if rank is None:
            return False
        del self.addresses[rank], self.held[rank]
        return True

    def missing(self, state: BarrierState) -> list[int]:
        """The live members not back yet."""
        return sorted(state.awaited - set(self.addresses))

    def choose(self) -> int:
        """The round the run goes on at (every member back): the newest the journal keeps of which every live
        member of that round holds a checkpoint; NotExact where there is none."""
        point = barrier_journal.resume_point(self.options.out, self.run, self.held, self.options.nodes_counted,
                                             self.secured)
        if point is None:
            raise NotExact(self.why_not())
        self.round = point[0]
        return self.round

    def why_not(self) -> str:
        kept = barrier_journal.rounds(self.options.out)
        holds = "; ".join(f"rank {r} ({self.addresses[r]}) has checkpoints of rounds "
                          f"{sorted(h - {0}, reverse=True) or 'none'}" for r, h in sorted(self.held.items())
                          if not h & set(kept) or len(kept) > 1)
        return (f"the run in {self.options.out} cannot be resumed exactly: every live member needs its checkpoint of "
                f"one same round that the journal keeps ({', '.join(map(str, kept))}), but {holds}. Nothing was "
                "changed: start the members again with their checkpoints (--state-dir), or start the run afresh "
                f"(rank 0 with another --out, or {barrier_journal.STATE_FILE} moved out of it)")

"""Members told to stop. A member stopped by a signal (`docker stop`, `docker compose down`, scancel, Ctrl-C on its
host) leaves the run; but a person who stops the whole run stops every member within moments, and a run whose
members left one by one is journaled without them, so it could not go on where it was. So the leave of a member
told to stop is held until no member has been told to stop for `STOP_HOLD_S` (it is still waited for meanwhile):
where the members held would leave fewer than the run needs, the run is interrupted instead, its journal at its last
decision with every member in it, and a barrier started again with the same --out goes on exactly once every member
is back from its checkpoints (comeback.py); otherwise the held leaves are applied as any other leave, together.
"""

from __future__ import annotations

from collections.abc import Iterable

STOP_HOLD_S = 3.0  # longer than the spread of the signals of one `docker compose down`, short for one `docker stop`


class StoppedMembers:
    """The leaves held: rank -> why it left, in the order heard."""

    def __init__(self) -> None:
        self._held: dict[int, str] = {}

    def hold(self, rank: int, reason: str) -> bool:
        """Hold `rank`'s leave; False if it is held already (a leave sent again)."""
        if rank in self._held:
            return False
        self._held[rank] = reason
        return True

    def release(self, rank: int) -> str | None:
        """`rank`'s held leave, now to be applied (None: not held, or the run was interrupted meanwhile)."""
        return self._held.pop(rank, None)

    def ranks(self) -> list[int]:
        return sorted(self._held)

    def too_many(self, live: Iterable[int], min_members: int) -> bool:
        """Whether the members held would leave fewer live members than the run needs."""
        return sum(1 for r in live if r not in self._held) < min_members

    def interruption(self, members: int) -> str:
        """Why the run stops, for summary.json and every console (starts "interrupted (": outputs.py)."""
        first = next(iter(self._held.values()), "")
        how = first.removeprefix("it was told to stop ").strip("()") or "a signal"
        return (f"interrupted ({len(self._held)} of {members} members were told to stop ({how}), ranks "
                f"{self.ranks()}: the run was stopped, not failed)")

    def forget(self) -> None:
        """The run was interrupted: nothing held is applied."""
        self._held.clear()

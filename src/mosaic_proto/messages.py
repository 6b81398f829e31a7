"""What the barrier tells nodes, as typed values with the JSON they cross HTTP as (`to_json` / `from_json`).

    Registration   the answer to POST /v1/register: {"rank", "members", "run", "round", "live"} (and "resumed": true
                   where a resumed run goes on at "round" from every member's checkpoint of it)
    Release        a round is over: {"round", "members", "stragglers", "dropped", "finished", "joined", "left"}
    ReleaseNotice  a release as the nodes hear it (the answer to POST /v1/arrive): the release's keys, "addresses"
                   (rank -> address of the members that join) and, where the release ends the run failed, "failure"

The JSON is the wire format: `from_json(x.to_json()) == x`, and its keys and values never change for a node of an
earlier version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Registration", "Release", "ReleaseNotice"]


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
    journaled: ClassVar[bool] = True  # the barrier saves it before any node hears of it

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "members": list(self.members), "stragglers": list(self.stragglers),
                "dropped": list(self.dropped), "finished": self.finished, "joined": list(self.joined),
                "left": list(self.left)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        return cls(int(data["round"]), tuple(data["members"]), tuple(data["stragglers"]), tuple(data["dropped"]),
                   bool(data["finished"]), tuple(data.get("joined", ())), tuple(data.get("left", ())))


@dataclass(frozen=True)
class ReleaseNotice:
    """A release as the nodes hear it: with the addresses of the members that join (rank, address), and why the run
    failed where this release ends it so."""

    release: Release
    addresses: tuple[tuple[int, str], ...] = ()
    failure: str | None = None

    def to_json(self) -> dict[str, Any]:
        failed = {"failure": self.failure} if self.failure is not None else {}
        return {**self.release.to_json(), "addresses": {str(r): a for r, a in self.addresses}, **failed}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReleaseNotice:
        return cls(Release.from_json(data), tuple((int(r), str(a)) for r, a in data.get("addresses", {}).items()),
                   data.get("failure"))


@dataclass(frozen=True)
class Registration:
    """The barrier's answer to a registration: this node's rank, every member's address (by rank), the run's
    settings, the round it takes part from (> 0 for a node that joins late or comes back) and the live members.
    `resumed`: the run was resumed exactly at `round`: this node goes on from its own checkpoint of that round."""

    rank: int
    members: tuple[str, ...]
    run: dict[str, Any] = field(hash=False)
    round: int = 0
    live: tuple[int, ...] = ()
    resumed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "members": list(self.members), "run": self.run, "round": self.round,
                "live": list(self.live), **({"resumed": True} if self.resumed else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Registration:
        return cls(int(data["rank"]), tuple(data["members"]), dict(data["run"]), int(data.get("round", 0)),
                   tuple(data.get("live", ())), bool(data.get("resumed", False)))

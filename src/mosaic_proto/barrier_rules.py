"""The barrier's policies beside its phase table, each a small pure class that `BarrierState` holds and feeds (the
daemon feeds the state: the clock, the node count it reads, the layouts the arrivals claim, the checkpoints its members
hold), or a pure function: when a node count has settled, when the registration gives up and what it says then, the
leaves of members told to stop (held, or the run interrupted), a layout that differs, the round an exact resume goes on
at. No I/O, no clock of their own."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LATE_GRACE_S", "LATE_TICK_S", "STOP_HOLD_S", "CountRule", "HeldStops", "LateClock", "LayoutClaim",
           "NodeCount", "RegistrationWait", "RunTask", "TaskClaim", "ended_line", "ended_status", "resume_point",
           "too_few_reason"]

OWN_LOOP = "own loop"  # what an own loop's run is called where it gives no name

# a member told to stop (a signal) has its leave held until no member was told to stop for this long: longer than the
# spread of the signals of one `docker compose down`, short for one `docker stop`
STOP_HOLD_S = 3.0
LATE_TICK_S = 1.0  # a deadline's timer taken this much later than due: the barrier was frozen (`LateClock`)
LATE_GRACE_S = 1.0  # ... and then reads what arrived meanwhile for this long before it releases the round


class LateClock:
    """The open round's deadline where the clock came to it late: a barrier frozen past it (SIGSTOP, a suspended
    host) reads the arrivals sent meanwhile, still unread, before it releases the round (`LATE_GRACE_S` after it
    woke, or with the last arrival), so that its freeze makes nobody a straggler."""

    def __init__(self) -> None:
        self.woke: float | None = None  # when the clock came late to the deadline

    def deadline(self, due: float) -> float:
        """The deadline `due`, or the grace after a late wake."""
        return due if self.woke is None else max(due, self.woke + LATE_GRACE_S)

    def woke_late(self, now: float, fired: float | None) -> bool:
        """The timer due at `fired` is taken at `now`: whether it is more than `LATE_TICK_S` late (the first time)."""
        if self.woke is not None or fired is None or now - fired <= LATE_TICK_S:
            return False
        self.woke = now
        return True


@dataclass(frozen=True)
class CountRule:
    """How long the node count read while nodes register must hold still to be taken: `seconds`; `stretched`
    (--expect-settle): at least twice the longest pause between two changes so far, and three times as long while no
    more than `fanout` came (replicas that start on a loaded host come in bursts; if no more come, the run fails saying
    why)."""

    seconds: float
    stretched: bool = False
    fanout: int = 0

    def settle(self, count: int, longest: float) -> float:
        if not self.stretched:
            return self.seconds
        return max(self.seconds, 2 * longest) * (1 if count > self.fanout else 3)


class NodeCount:
    """The node count as read (DNS, the nodes registered), and when it last changed: taken once it held still."""

    def __init__(self, rule: CountRule) -> None:
        self.rule = rule
        self._read, self._changed, self._longest = -1, 0.0, 0.0

    def read(self, reading: int, now: float) -> int:
        """The count read `now`: itself once it held still for the rule's time, else 0 (not known yet)."""
        if reading != self._read:
            if self._read > 0:
                self._longest = max(self._longest, now - self._changed)
            self._read, self._changed = reading, now
        return reading if reading and now - self._changed >= self.rule.settle(reading, self._longest) else 0


class RegistrationWait:
    """When the waits that end the run if they give up do (--register-deadline): the registration, from when it opened
    (`begin`), and a resumed run's members coming back with their checkpoints, from the first one back (`came_back`);
    and what the run's failure line says then, from what was fed in as it happened: the addresses a peer list names
    (those that did not register are named), the members back, the requests refused meanwhile (`saw_refused`).
    `BarrierState` holds it (`registration`) and fails the run at its `due` (`BarrierState.tick`)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the wait began (None: it has not)
        self.seconds = 0.0  # --register-deadline
        self.listed: tuple[str, ...] = ()  # the addresses a peer list names, in rank order
        self.back: set[int] = set()  # a resumed run's members back so far
        self.refused = ""  # the requests refused so far, in one line ("" none)

    def begin(self, now: float, seconds: float, listed: Iterable[str] = ()) -> None:
        """The wait begins `now` for `seconds`, unless it began before (`listed`: a peer list's addresses)."""
        if self.since is None:
            self.since, self.seconds = now, seconds
        self.listed = tuple(listed) or self.listed

    def came_back(self, rank: int, now: float, seconds: float, withdrew: bool = False) -> None:
        """A member of a resumed run is back (`withdrew`: it withdrew since): the wait began with the first one."""
        self.begin(now, seconds)
        if withdrew:
            self.back.discard(rank)
        else:
            self.back.add(rank)

    def saw_refused(self, said: str) -> None:
        """The requests refused so far, in one line (the daemon counts them)."""
        self.refused = said

    @property
    def due(self) -> float | None:
        """When it gives up (None: it has not begun)."""
        return None if self.since is None else self.since + self.seconds

    def unregistered(self, registered: Collection[str]) -> list[str]:
        """The addresses the peer list names that have not registered (without a list, no names are known)."""
        return [a for a in self.listed if a not in registered]

    def failure(self, registered: Collection[str], expected: int, awaited: Collection[int], rebinding: bool) -> str:
        """Why the run fails at `due`: too few nodes `registered` of `expected` (the listed ones that did not are
        named), or, `rebinding`, the members `awaited` that did not come back; with the requests refused meanwhile."""
        if rebinding:
            return self.said(f"members {sorted(set(awaited) - self.back)} did not come back within --register-deadline "
                             f"{self.seconds:g}s")
        missing = self.unregistered(registered)
        return self.said(f"registration deadline ({self.seconds:g}s) passed with {len(registered)} of "
                         f"{expected or '?'} nodes" + (f"; not registered: {', '.join(missing)}" if missing else ""))

    def said(self, reason: str) -> str:
        """A registration's failure line: `reason`, with the requests refused meanwhile."""
        return f"{reason}; {self.refused}" if self.refused else reason


class HeldStops:
    """The leaves of members told to stop, held (rank -> why, in the order heard) until `until`, when no member was
    told to stop for `STOP_HOLD_S`. A person who stops the whole run stops every member within moments, and a run
    whose members left one by one is journaled without them, so it could not go on where it was."""

    def __init__(self) -> None:
        self._held: dict[int, str] = {}
        self.until: float | None = None
        self.stopped: list[int] = []  # once the run is interrupted: every member told to stop, counted (`count`)
        self._how = ""

    def __contains__(self, rank: int) -> bool:
        return rank in self._held

    def hold(self, rank: int, reason: str, now: float) -> float:
        """Hold `rank`'s leave: when the held leaves apply now."""
        self._held[rank] = reason
        self.until = now + STOP_HOLD_S
        return self.until

    def too_many(self, live: Iterable[int], min_members: int) -> bool:
        """Whether the members held would leave fewer live members than the run needs."""
        return sum(1 for r in live if r not in self._held) < min_members

    def interruption(self, members: int) -> tuple[str, tuple[int, ...]]:
        """The run is interrupted instead (nothing held applies): why (for summary.json and every console: starts
        "interrupted (", outputs.py), and the members held."""
        first = next(iter(self._held.values()), "")
        self._how = first.removeprefix("it was told to stop ").strip("()") or "a signal"
        self.stopped = sorted(self._held)
        self._held.clear()
        self.until = None
        return self._why(members)

    def count(self, rank: int, members: int) -> tuple[str, tuple[int, ...]] | None:
        """A member told to stop after the run was interrupted is counted too: why now, and who (None: counted)."""
        if rank in self.stopped:
            return None
        self.stopped = sorted([*self.stopped, rank])
        return self._why(members)

    def _why(self, members: int) -> tuple[str, tuple[int, ...]]:
        ranks = tuple(self.stopped)
        return (f"interrupted ({len(ranks)} of {members} members were told to stop ({self._how}), ranks "
                f"{list(ranks)}: the run was stopped, not failed)"), ranks

    def due(self, now: float) -> tuple[int, str] | None:
        """The next held leave to apply (rank, why), once `until` is reached; None: none (left), or not yet."""
        if self.until is None or now < self.until:
            return None
        if not self._held:
            self.until = None
            return None
        rank = min(self._held)
        return rank, self._held.pop(rank)

    def drop(self, rank: int) -> None:
        """`rank` is back (it registered again): it does not leave."""
        self._held.pop(rank, None)


class LayoutClaim:
    """Every member must build the same model: the layout the first arrival claimed (rank, values, fingerprint), and
    the ranks whose claim matched it. A member's model never changes, so a rank that claimed the run's layout and
    then another is not that member speaking (an unsigned request under --insecure): refused, blaming nobody."""

    def __init__(self) -> None:
        self.first: tuple[int, int, str] | None = None
        self.matched: set[int] = set()

    def differs(self, rank: int, claim: tuple[int, str] | None) -> str | None:
        """Why `rank`'s layout (values, fingerprint; None: it claims none) cannot take part in the run, or None."""
        if claim is None:
            return None
        if self.first is None:
            self.first = (rank, *claim)
            self.matched.add(rank)
            return None
        first, values, fingerprint = self.first
        if claim[1] == fingerprint:
            self.matched.add(rank)
            return None
        how = (f"a model of {claim[0]} values, rank {first}'s of {values}" if claim[0] != values else
               f"the same {values} values as rank {first}, in another layout (tensor names or shapes)")
        return (f"the members build different models: rank {rank} fragments {how} (fingerprints {claim[1][:12]} and "
                f"{fingerprint[:12]}); every member must build the same model")

    def changed(self, rank: int, claim: tuple[int, str] | None) -> str | None:
        """Why `rank`'s request is not that member's: it claimed the run's layout before and another now (refuse the
        request alone, fail nothing, blame no rank), or None."""
        if claim is None or self.first is None or rank not in self.matched or claim[1] == self.first[2]:
            return None
        return (f"rank {rank} claimed the run's layout before: this arrival's is another, so it is not that "
                "member's (refused; the run goes on)")


@dataclass(frozen=True)
class TaskClaim:
    """What a node says it runs when it registers: a training loop of its own (`own_loop`, called `name`), or the run's
    task, which the node daemon builds from the run the barrier hands out (`name` empty); `values`: its model's size,
    where it knows it then (an own loop's `Peer` given its model)."""

    own_loop: bool
    name: str = ""
    values: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"own_loop": self.own_loop, "name": self.name, "values": self.values}

    @classmethod
    def from_json(cls, data: Any) -> TaskClaim:
        """A registration's "task"; ValueError naming what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("own_loop"), bool) \
                or not isinstance(data.get("name", ""), str) or len(data.get("name", "")) > 200 \
                or not (data.get("values") is None or type(data["values"]) is int and 0 < data["values"] < 2**63):
            raise ValueError("field 'task' must be {\"own_loop\": a boolean, \"name\": a string of at most 200 "
                             "characters, \"values\": a positive integer or null}")
        return cls(data["own_loop"], data.get("name", ""), data.get("values"))

    @property
    def said(self) -> str:
        return (f"a training loop of its own ({self.name or OWN_LOOP}" + (f", a model of {self.values} values)"
                if self.values else ")")) if self.own_loop else "the run's task (mosaicd node)"


class RunTask:
    """The task a barrier runs (`name`; `own_loop`: its nodes' own loops), whether it evaluates the average model with
    it (`evaluates`) and that model's size where it knows it (`values`: the quadratic task's dim). A node that runs
    something else is refused at its registration, naming the barrier's flag that would fit, and what the nodes said
    they run is what the run records (`claimed`)."""

    def __init__(self, name: str, own_loop: bool, evaluates: bool, values: int | None = None) -> None:
        self.name, self.own_loop, self.evaluates, self.values = name, own_loop, evaluates, values
        self.claimed: TaskClaim | None = None  # the first registration's (None: it said nothing, an older node)

    def differs(self, address: str, claim: TaskClaim | None) -> str | None:
        """Why the node at `address`, which runs `claim` (None: an older node, which says nothing), cannot take part in
        this barrier's run, or None (and the claim is kept, the first one, as what ran)."""
        if claim is None:
            return None
        why = None
        if self.own_loop and not claim.own_loop:
            why = (f"{address} runs the run's task (mosaicd node), but this barrier was started --own-loop (its nodes "
                   f"are training loops of their own): start the barrier with --task NAME, the task to run, instead")
        elif not self.own_loop and claim.own_loop and self.evaluates and (claim.values is None
                                                                           or claim.values != self.values):
            size = f"a model of {self.values} values" if self.values else "its model"
            why = (f"{address} is {claim.said}, but this barrier runs --task {self.name} and would evaluate the "
                   f"average model with it ({size}): start the barrier with --own-loop (--task NAME names the loop)")
        if why is None and self.claimed is None:
            self.claimed = claim
        return why

    def ran(self) -> dict[str, Any]:
        """What the run records it ran where that is not what the barrier was started for (its settings): the nodes'
        own loops, at a barrier that does not evaluate with its task."""
        if self.claimed is not None and self.claimed.own_loop and not self.own_loop and not self.evaluates:
            return {"own_loop": True, "task": self.claimed.name or OWN_LOOP}
        return {}


def resume_point(kept: Iterable[dict[str, Any]], held: Mapping[int, Collection[int]]) -> tuple[int, set[int]] | None:
    """The one rule of an exact resume: the newest of the `kept` states (`BarrierState.to_json`, newest first) of
    whose open round every live member (joining ones too) holds a checkpoint (`held`: rank -> the rounds of its
    checkpoints), and those members; None where there is none."""
    for state in kept:
        members = set(state["live"]) | set(state["joining"])
        if all(state["round"] in held.get(rank, ()) for rank in members):
            return state["round"], members
    return None


def ended_status(reason: str) -> str:
    """How a run that did not finish ended, by its one-line reason: "interrupted" (a person stopped it: Ctrl-C,
    SIGTERM, its members or a peer list's rank 0 told to stop; resumable) or "failed". The one rule: summary.json,
    /v1/status and every member's last line read it."""
    return "interrupted" if str(reason).startswith("interrupted (") else "failed"


def ended_line(reason: str) -> str:
    """What a member hears of a run that ended early for `reason` (410 `run_failed`): "the run failed: ...", or the
    reason itself where a person stopped it ("interrupted (...": the member says so, not an error)."""
    return reason if ended_status(reason) == "interrupted" else f"the run failed: {reason}"


def too_few_reason(t: int, live: Collection[int], dropped: list[int], left: list[int], min_members: int,
                   missed: str) -> str:
    """Why a run with too few `live` members after round `t` ends (`missed`: what made the `dropped` ones drop)."""
    gone = ", ".join(([f"dropped {dropped} ({missed})"] if dropped else []) + ([f"left {left}"] if left else []))
    if not live:
        return f"every member was dropped or left by round {t}; {gone}"
    return (f"{len(live)} members are left after round {t} ({list(live)}), fewer than the {min_members} the run needs "
            f"(each sends every fragment to {min_members - 1} others); {gone}")

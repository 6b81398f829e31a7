"""`NodeState`: one node's side of the protocol over a whole run, with no I/O (as `BarrierState` is the barrier's).

The daemon (or any training loop) feeds it the registration, the trained vector, the sends' outcome, the
barrier's release and incoming bytes, and gets messages, reports and decisions back. Its phase moves only along
`TRANSITIONS`, the one table of which event moves which phase where (h11's `_state.py` is the model):

    state = NodeState(max_bytes=..., rejoining=False)     # REGISTERING (REJOINING: a member before, restarted)
    state.registered(rank, addresses, live, round, run_id) # the barrier's answer
    state.start(fragmentation, sampler, vector)             # the model is known: TRAINING
    messages = state.outgoing(local)                        # SENDING
    report = state.sent(delivered, unsent, loss, train_s)   # WAITING: the arrival carries `report`
    advance = state.released(members, joined, stragglers)   # AGGREGATING -> TRAINING (or DROPPED)
    state.receive(data, sender)                             # any time: accept, buffer or refuse (NodeRefused)
    state.finishing(); state.finished()                     # FINISHING: the final arrival, then FINISHED
    state.run_failed()                                      # a release that ends the run, failed: FINISHED
    state.leaving(); state.left()                           # a node that stops tells the barrier: LEFT
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from .attacks import Attack
from .compression import Compressor
from .fragmentation import Fragmentation
from .profiles import MIN_SEND_BUDGET_S, send_margin
from .report import NodeReport
from .robust import Aggregator
from .round import OutgoingMessage, Receipt, RoundReport, RoundState, decoded
from .sampling import PeerSampler
from .wire import DEFAULT_MAX_BYTES, FragmentBatch, WireError

__all__ = ["GONE", "REASON_FINISHED", "REASON_REJOINING", "SNAPSHOTS_KEPT", "TAKES_FRAGMENTS", "TRANSITIONS",
           "WAITS_FOR_MODEL", "Advance", "NodeEvent", "NodePhase", "NodePhases", "NodeRefused", "NodeState",
           "NodeStateError", "Snapshots", "rejoining_refusal"]

SNAPSHOTS_KEPT = 3  # models after the last rounds a node keeps for the barrier's evaluation (and a rejoining peer)


class NodePhase(StrEnum):
    REGISTERING = "registering"
    TRAINING = "training"
    SENDING = "sending"
    WAITING = "waiting"
    AGGREGATING = "aggregating"
    FINISHING = "finishing"  # the final arrival waits at the barrier
    REJOINING = "rejoining"
    LEAVING = "leaving"
    LEFT = "left"
    DROPPED = "dropped"
    FINISHED = "finished"


class NodeEvent(StrEnum):
    REGISTERED = "registered"  # the barrier answered the registration (the model is not known yet)
    READMITTED = "readmitted"  # a dropped node's new registration was answered: it knows the model, it goes on
    STARTED = "started"  # the model is known
    OUTGOING = "outgoing"  # the trained vector is in, the round's messages out
    SENT = "sent"  # the sends are over: the arrival goes to the barrier
    RELEASED = "released"  # the barrier released the round
    AGGREGATED = "aggregated"  # the next round is open
    LEFT_OUT = "left_out"  # the release does not name this node: dropped
    DROPPED = "dropped"  # the barrier refused an arrival: dropped (or too far behind)
    REJOIN = "rejoin"  # a dropped node registers again
    NEW_RUN = "new_run"  # a node with a checkpoint registered for a run at round 0: it lost nothing, it starts anew
    FINISHING = "finishing"  # the final arrival
    FINISHED = "finished"  # the barrier answered the final arrival
    RUN_FAILED = "run_failed"  # the release said the run ended, failed
    LEAVE = "leave"  # a signal: tell the barrier, then stop
    LEFT = "left"


P, E = NodePhase, NodeEvent
# phase -> {event: next phase}: every transition, and nothing else (an event a phase has no row for is a bug)
TRANSITIONS: dict[NodePhase, dict[NodeEvent, NodePhase]] = {
    P.REGISTERING: {E.REGISTERED: P.REGISTERING, E.STARTED: P.TRAINING, E.LEAVE: P.LEAVING},
    P.REJOINING: {E.REGISTERED: P.REJOINING, E.READMITTED: P.TRAINING, E.NEW_RUN: P.REGISTERING,
                  E.STARTED: P.TRAINING, E.LEAVE: P.LEAVING},
    P.TRAINING: {E.OUTGOING: P.SENDING, E.FINISHING: P.FINISHING, E.RUN_FAILED: P.FINISHED, E.LEAVE: P.LEAVING},
    P.SENDING: {E.SENT: P.WAITING, E.LEAVE: P.LEAVING},
    P.WAITING: {E.RELEASED: P.AGGREGATING, E.DROPPED: P.DROPPED, E.LEAVE: P.LEAVING},
    P.AGGREGATING: {E.AGGREGATED: P.TRAINING, E.LEFT_OUT: P.DROPPED},
    P.FINISHING: {E.FINISHED: P.FINISHED, E.DROPPED: P.DROPPED, E.LEAVE: P.LEAVING},
    P.DROPPED: {E.REJOIN: P.REJOINING, E.LEAVE: P.LEAVING},
    P.LEAVING: {E.LEFT: P.LEFT},
    P.LEFT: {},
    P.FINISHED: {},
}
TAKES_FRAGMENTS = frozenset({P.TRAINING, P.SENDING, P.WAITING, P.AGGREGATING})  # a round is open: it takes them
WAITS_FOR_MODEL = frozenset({P.REGISTERING})  # fragments that come now may wait for the model (it comes soon)
GONE = frozenset({P.LEAVING, P.LEFT, P.FINISHED})  # the run is over for the node, or it tells the barrier it leaves
_REFUSED_FOR_GOOD = GONE | {P.FINISHING}  # phases that take no fragment again: a sender must not retry


class NodeStateError(RuntimeError):
    """A call the node's phase does not allow (a bug in the caller, like h11's LocalProtocolError)."""


class NodeRefused(Exception):
    """A message this node cannot take in its phase: `reason` is machine-readable, `retry` whether a sender may
    try again (the node will take fragments soon)."""

    def __init__(self, reason: str, detail: str, retry: bool) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.retry = reason, detail, retry


@dataclass(frozen=True)
class Advance:
    """What a release did: the round's aggregated vector and full report, the next round's early messages."""

    vector: np.ndarray
    report: NodeReport
    taken: RoundReport  # the messages buffered for the next round, accepted (or refused) by its state just now
    sent: RoundReport  # the finished round's outgoing traffic
    left_out: bool = False  # the release does not name this node: it is DROPPED


def _not_taking(phase: NodePhase) -> NodeRefused:
    """Why a node in `phase` takes no fragment messages (`NodeState.taking`)."""
    if phase in _REFUSED_FOR_GOOD:
        return NodeRefused(REASON_FINISHED, f"node is {phase.value}: it takes no more fragments", retry=False)
    refusal = _REFUSALS.get(phase)
    return refusal() if refusal is not None else NodeRefused("not_ready", f"node is {phase.value}", retry=True)


def rejoining_refusal() -> NodeRefused:
    """A node that came back (restarted, or dropped and registering again) refuses fragments until it takes part
    again, with reason `rejoining`: it is no member of the round it lost, so a sender gives that round's fragments
    up at once unless the node is one of its round's `starting` members (docs/spec.md, step 7)."""
    return NodeRefused(REASON_REJOINING, "node is rejoining the run: a member again from the round the barrier "
                       "places it at", retry=True)


REASON_REJOINING = "rejoining"  # the reason of `rejoining_refusal`, which a sender compares
REASON_FINISHED = "finished"  # a node whose run is over (or that is leaving) refuses fragments for good
_REFUSALS = {P.REJOINING: rejoining_refusal}  # phase -> its own refusal of fragments (else "not_ready")


class Snapshots(dict[int, np.ndarray]):
    """round -> this node's model after that round: the last `SNAPSHOTS_KEPT`, for the barrier's evaluations (and
    peers that rejoin); `metrics`: round -> the node's metrics of that round (its own evaluation of the model after
    it, or what a training loop reported), served with the snapshot and dropped with it."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, Any]] = {}

    def keep(self, round: int, vector: np.ndarray) -> None:
        self[round] = vector
        self.pop(round - SNAPSHOTS_KEPT, None)
        for old in [r for r in self.metrics if r <= round - SNAPSHOTS_KEPT]:
            del self.metrics[old]

    def keep_metrics(self, round: int, metrics: dict[str, Any]) -> None:
        """The node's metrics of `round` (kept until its snapshot is dropped)."""
        self.metrics[round] = metrics

    def resumed(self, round: int, vector: np.ndarray, before: np.ndarray | None) -> None:
        """A resumed run's checkpoint: its model after `round`, and `before` after the round before (where kept)."""
        kept = {round: vector, round - 1: before}
        self.update({t: v for t, v in kept.items() if t >= 0 and v is not None})

    def model(self, round: int | None, newest: np.ndarray | None) -> tuple[int, np.ndarray] | None:
        """(round, model) kept for `round`, or None; for None, the newest kept (else `newest`, as of round -1)."""
        if round is not None:
            vector = self.get(round)
            return None if vector is None else (round, vector)
        last = max(self) if self else -1
        vector = self.get(last, newest)
        return None if vector is None else (last, vector)


class NodePhases:
    """A node's phase, moved only along `TRANSITIONS` (`_fire`), and what the phase allows."""

    rank: int

    def __init__(self, phase: NodePhase) -> None:
        self.phase = phase

    def allows(self, event: NodeEvent) -> bool:
        """Whether `event` may happen in this node's phase."""
        return event in TRANSITIONS[self.phase]

    @property
    def gone(self) -> bool:
        """The run is over for this node (finished, left), or it is telling the barrier it leaves."""
        return self.phase in GONE

    @property
    def takes_fragments(self) -> bool:
        return self.phase in TAKES_FRAGMENTS

    @property
    def restarting(self) -> bool:
        """It took over a checkpoint and is not registered again yet: the run's open round goes on without it."""
        return self.phase is P.REJOINING

    @property
    def waits_for_model(self) -> bool:
        """Fragments that come now may wait for the model: it comes soon (`WAITS_FOR_MODEL`)."""
        return self.phase in WAITS_FOR_MODEL

    def _fire(self, event: NodeEvent) -> None:
        to = TRANSITIONS[self.phase].get(event)
        if to is None:
            raise NodeStateError(f"node {self.rank}: {event.value} is not possible while {self.phase.value}")
        self.phase = to


class NodeState(NodePhases):
    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, max_norm: float | None = None, rejoining: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[str, int], None] | None = None) -> None:
        """`rejoining`: it was a member of the run before (a checkpoint, or the daemon's note of its
        registration), so fragments of rounds it lost are refused at once (retry), not held until it is ready.
        `clock`: seconds, for the phase times. `on_refused(reason, count)`: told of what a round refuses on its own
        (--max-norm, the aggregator's cuts), for a daemon's counters (reports count them)."""
        self.max_bytes, self.max_norm, self.clock, self.on_refused = max_bytes, max_norm, clock, on_refused
        self.aggregator: Aggregator | None = None
        self.attack: Attack | None = None
        self.compressor: Compressor | None = None
        super().__init__(P.REJOINING if rejoining else P.REGISTERING)
        self.rank, self.round, self.run_id = -1, 0, ""
        self.addresses: list[str] = []
        self.members: list[int] = []
        self.starting: frozenset[int] = frozenset()  # members of the open round that may still be starting
        self.snapshots = Snapshots()
        self.vector: np.ndarray | None = None
        self.last_report: NodeReport | None = None
        self.loss = math.nan
        self.fragmentation: Fragmentation | None = None
        self.sampler: PeerSampler | None = None
        self._round: RoundState | None = None
        self._refused: Counter[str] = Counter()  # refusals not reported yet (some come after an arrival)
        self._aggregate_s = 0.0
        self._opened = clock()  # when this node heard that its open round started
        self._sending = self._waiting = 0.0
        self._report: NodeReport | None = None

    # -- membership --------------------------------------------------------------------------------
    def registered(self, rank: int, addresses: Sequence[str], live: Iterable[int], round: int, run_id: str) -> None:
        """The barrier's answer to a registration: this node's rank, the members' addresses, who is live, and the
        round it takes part from (> 0 for a node that rejoins or joins late)."""
        if self.fragmentation is not None:  # a rejoin after a drop: the model is known, go on at once
            event = E.READMITTED
        elif round == 0 and self.allows(E.NEW_RUN):  # a checkpoint of an earlier run (this run's are of round >= 1)
            event = E.NEW_RUN
        else:
            event = E.REGISTERED
        self._fire(event)
        self.rank, self.addresses, self.round, self.run_id = rank, list(addresses), round, run_id
        self.members = sorted(int(m) for m in live)
        self.starting = frozenset(self.members)  # every one was answered as this node was: some may still start
        self._opened = self.clock()
        if event is E.READMITTED:
            self._open_round(())

    def start(self, fragmentation: Fragmentation, sampler: PeerSampler, vector: np.ndarray | None = None, *,
              aggregator: Aggregator | None = None, attack: Attack | None = None,
              compressor: Compressor | None = None) -> None:
        """The model's fragmentation is known (and its starting vector, where known): from now on fragments are
        taken. `aggregator`: the run's rule (None: mean); `attack`: how this node lies, if it is an attacker;
        `compressor`: the run's codec with this node's error feedback (None: --compress none)."""
        if self.rank < 0:
            raise NodeStateError("start() before registered()")
        self._fire(E.STARTED)
        self.fragmentation, self.sampler, self.aggregator, self.attack = fragmentation, sampler, aggregator, attack
        self.compressor = compressor
        self._open_round(())
        if vector is not None:
            self.begin(vector)

    def begin(self, vector: np.ndarray, kept_as: int | None = None, before: np.ndarray | None = None) -> None:
        """The model this node starts the run (or its rejoin) from; `kept_as`: the round it is the model after (a
        resumed run's checkpoint), kept as that round's snapshot for the barrier's evaluation, `before` too."""
        self.vector = vector
        if kept_as is not None:
            self.snapshots.resumed(kept_as, vector, before)

    def rejoining(self) -> None:
        """A dropped node registers again (--rejoin-dropped)."""
        self._fire(E.REJOIN)
        self.rank, self._round = -1, None

    def leaving(self) -> None:
        """This node stops (a signal): it tells the barrier, then is LEFT (nothing changes once it is `gone`)."""
        if not self.gone:
            self._fire(E.LEAVE)

    def left(self) -> None:
        self._fire(E.LEFT)
        self._round = None

    # -- one round: outgoing -> sent -> released ---------------------------------------------------------
    def outgoing(self, local: np.ndarray) -> list[OutgoingMessage]:
        """Record the locally trained vector; this round's messages, one per receiving peer."""
        self._fire(E.OUTGOING)
        self._sending = self.clock()
        return self._round.outgoing(np.asarray(local, dtype=np.float32))

    def send_budget(self, round_deadline: float) -> float:
        """Seconds the sends may take now: what is left of the round's deadline (counted from its release) less
        a margin for the arrival (a tenth of it, 1 s to half of it), at least 0.5 s."""
        return max(round_deadline - send_margin(round_deadline) - (self.clock() - self._opened), MIN_SEND_BUDGET_S)

    def sent(self, delivered: Mapping[int, tuple[int, int]], unsent: Iterable[OutgoingMessage], loss: float = math.nan,
             train_s: float = 0.0) -> NodeReport:
        """The sends are over: `delivered` peer -> (fragments, bytes) it took; the report the arrival carries."""
        self._fire(E.SENT)
        assert self._round is not None
        for message in unsent:
            self._round.mark_unsent(message)
        self.loss = loss
        self._report = NodeReport.of_traffic(
            self._round.report, loss=loss, refused=dict(self._refused), train_s=round(train_s, 6),
            send_s=round(self.clock() - self._sending, 6), aggregate_s=round(self._aggregate_s, 6),
            delivered=dict(delivered))
        self._refused.clear()
        self._waiting = self.clock()
        return self._report

    def released(self, members: Iterable[int], joined: Mapping[int, str], stragglers: Iterable[int]) -> Advance:
        """The barrier released the round: aggregate, keep the snapshot, open the next round (DROPPED if this
        node is not among the next round's `members`; `joined`: rank -> address of members new to it)."""
        self._fire(E.RELEASED)
        assert self._round is not None and self._report is not None
        waited = self.clock() - self._waiting
        aggregating = self.clock()
        outcome = self._round.finish()
        t = self.round
        self.vector = outcome.vector
        self.snapshots.keep(t, outcome.vector)
        self._opened = self.clock()
        for rank, address in sorted(joined.items()):
            if rank == len(self.addresses):  # a node that joined: the next free rank
                self.addresses.append(address)
        self.members = sorted(int(m) for m in members)
        self.starting = frozenset(int(r) for r in joined)  # they heard of their place with this release, as we did
        report = self._report.with_release(round(waited, 6), tuple(stragglers), messages_in=outcome.report.messages_in,
                                           fragments_in=outcome.report.fragments_in, bytes_in=outcome.report.bytes_in)
        self.last_report, self.round = report, t + 1
        if self.rank not in self.members:
            self._fire(E.LEFT_OUT)
            self._round = None
            return Advance(outcome.vector, report, RoundReport(t + 1), outcome.report, left_out=True)
        taken = self._open_round(outcome.early)
        self._aggregate_s = self.clock() - aggregating
        self._fire(E.AGGREGATED)
        return Advance(outcome.vector, report, taken, outcome.report)

    def dropped(self) -> None:
        """The barrier said this node was dropped (or fell further behind than it keeps)."""
        self._fire(E.DROPPED)
        self._round = None

    def finishing(self) -> None:
        """The final arrival (round == rounds): no more fragments are taken."""
        self._fire(E.FINISHING)
        self._round = None

    def finished(self) -> None:
        """The barrier answered the final arrival: the run is over for this node."""
        self._fire(E.FINISHED)

    def run_failed(self) -> None:
        """The release said the run ended, failed: it is over for this node (as if finished), no round is open."""
        self._fire(E.RUN_FAILED)
        self._round = None

    def _open_round(self, early: tuple) -> RoundReport:
        assert self.fragmentation is not None and self.sampler is not None
        self._round = RoundState(node=self.rank, round=self.round, members=self.members,
                                 fragmentation=self.fragmentation, sampler=self.sampler, run_id=self.run_id,
                                 max_bytes=self.max_bytes, early=early, planned_only=True, max_norm=self.max_norm,
                                 aggregator=self.aggregator, attack=self.attack, on_refused=self._counted,
                                 start=self.vector if self.attack is not None and self.round > 0 else None,
                                 compressor=self.compressor)
        self._refused.update(self._round.report.refused)
        return self._round.report

    def _counted(self, reason: str, count: int) -> None:
        self._refused[reason] += count
        if self.on_refused is not None:
            self.on_refused(reason, count)

    # -- incoming ------------------------------------------------------------------------------------------
    def receive(self, data: bytes | bytearray | memoryview, sender: int | None = None) -> tuple[Receipt, int]:
        """Take one message: (accepted or buffered, fragments accepted now). WireError if the message is refused,
        NodeRefused if this node cannot take messages in its phase; the state is unchanged then."""
        return self.take(decoded(self.taking(), data), len(data), sender)

    def taking(self) -> RoundState:
        """The open round's state (for `decoded`, in a worker thread if need be); NodeRefused if none takes any."""
        if not self.takes_fragments:
            raise _not_taking(self.phase)
        assert self._round is not None  # every phase that takes fragments has its round open
        return self._round

    def take(self, batch: FragmentBatch | WireError, nbytes: int, sender: int | None = None) -> tuple[Receipt, int]:
        """`receive` of a message `decoded` already, maybe while the node moved on: it goes to the round open now."""
        before = (round_state := self.taking()).report.fragments_in
        try:
            receipt = round_state.take(batch, nbytes, sender=sender)
        except WireError as exc:
            self._refused[exc.reason.value] += 1
            raise
        return receipt, round_state.report.fragments_in - before

    def model(self, round: int | None = None) -> tuple[int, np.ndarray] | None:
        """(round, model) kept for `round` (None: the newest model), or None."""
        return self.snapshots.model(round, self.vector)

    def keep_metrics(self, round: int, metrics: dict[str, Any]) -> None:
        """This node's metrics of `round`, served with its snapshot (`Snapshots.keep_metrics`)."""
        self.snapshots.keep_metrics(round, metrics)

    def metrics_of(self, round: int) -> dict[str, Any] | None:
        """This node's metrics of `round`, where kept."""
        return self.snapshots.metrics.get(round)

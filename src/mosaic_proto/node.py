"""`NodeState`: one node's side of the protocol over a whole run, with no I/O (as `BarrierState` is the barrier's).

The daemon (or the in-memory network, or any training loop) feeds it the registration, the trained vector, the
sends' outcome, the barrier's release and incoming bytes, and the clock (`now`), and gets messages, reports and
decisions back. Its phase lives in `NodePhases`, apart from the rounds and models (h11's `ConnectionState`), and
moves only along `NODE_TRANSITIONS`, the one table of which input (`NodeInput`), with which outcome
(`NodeOutcome`), moves which phase where: one call, one input, one transition. What a call decided comes back as a
value (`Sending`, `Advance`, a `NodeOutcome`), which the caller runs (`Peer`, `InMemoryNetwork`):

    state = NodeState(max_bytes=..., rejoining=False)          # REGISTERING (REJOINING: a member before, restarted)
    state.registered(rank, addresses, live, round, run_id, now) # the barrier's answer
    state.start(fragmentation, sampler, vector)                 # the model is known: TRAINING
    sending = state.outgoing(local, now)                        # SENDING (or `refused`: no round to send in)
    report = state.sent(delivered, unsent, now, loss, train_s)  # WAITING: the arrival carries `report`
    advance = state.released(members, joined, stragglers, now, failure)  # TRAINING, or DROPPED / FINISHED
    state.receive(data, sender)                                 # any time: accept, buffer or refuse (NodeRefused)
    state.finishing(); state.finished()                         # FINISHING: the final arrival, then FINISHED
    state.dropped()                                             # the barrier refused an arrival: DROPPED
    state.leaving(); state.left()                               # a node that stops tells the barrier: LEFT
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np

from .attacks import Attack
from .compression import Compressor
from .fragmentation import Fragmentation
from .profiles import MIN_SEND_BUDGET_S, send_margin
from .report import NodeReport
from .robust import Aggregator
from .round import OutgoingMessage, Receipt, RoundOutcome, RoundReport, RoundState, decoded
from .sampling import PeerSampler
from .wire import DEFAULT_MAX_BYTES, FragmentBatch, WireError

__all__ = ["GONE", "NODE_TRANSITIONS", "REASON_FINISHED", "REASON_REJOINING", "SNAPSHOTS_KEPT", "TAKES_FRAGMENTS",
           "WAITS_FOR_MODEL", "Advance", "NodeInput", "NodeOutcome", "NodePhase", "NodePhases", "NodeRefused",
           "NodeState", "NodeStateError", "Sending", "Snapshots", "rejoining_refusal"]

SNAPSHOTS_KEPT = 3  # the last rounds whose models a node keeps: its newest, and the barrier's evaluation rounds


class NodePhase(StrEnum):
    REGISTERING = "registering"
    TRAINING = "training"
    SENDING = "sending"
    WAITING = "waiting"
    FINISHING = "finishing"  # the final arrival waits at the barrier
    REJOINING = "rejoining"
    SITTING_OUT = "sitting_out"  # a member's new incarnation the barrier placed from a later round: it waits for it
    LEAVING = "leaving"
    LEFT = "left"
    DROPPED = "dropped"
    FINISHED = "finished"


class NodeInput(StrEnum):
    """What comes in: a call on the state (the barrier's answers, the training loop, the sends, a signal)."""

    REGISTERED = "registered"  # the barrier answered a registration
    STARTED = "started"  # the model is known
    OUTGOING = "outgoing"  # the trained vector is in: the round's messages out
    SENT = "sent"  # the sends are over: the arrival goes to the barrier
    RELEASED = "released"  # the barrier released the round
    DROPPED = "dropped"  # the barrier refused an arrival: dropped (or too far behind)
    REJOIN = "rejoin"  # a dropped node registers again
    SIT_OUT = "sit_out"  # the barrier answered: a member's new incarnation, which sits out the open round
    FINISHING = "finishing"  # the final arrival
    FINISHED = "finished"  # the barrier answered the final arrival
    LEAVE = "leave"  # a signal, or a loop that failed: tell the barrier, then stop
    LEFT = "left"  # the barrier heard it (or had its chance to)


class NodeOutcome(StrEnum):
    """What an input decided, as far as the phase goes: one input, one outcome, one transition."""

    NOTED = "noted"  # taken; the phase moves as its row says
    NEW_RUN = "new_run"  # a checkpoint's node registered for a run at round 0: it lost nothing, it starts anew
    READMITTED = "readmitted"  # a dropped node's new registration was answered: it knows the model, it goes on
    AGGREGATED = "aggregated"  # the release names it: the next round is open
    LEFT_OUT = "left_out"  # the release does not name it: dropped
    FAILED = "failed"  # the release said the run ended, failed: it is over for this node
    REFUSED = "refused"  # no round to send in (no model yet, or the run is over for it): the caller's mistake
    IGNORED = "ignored"  # the run is over for it already (or it never registered): nothing changes


P, In, Out = NodePhase, NodeInput, NodeOutcome
_LEAVES = {In.LEAVE: {Out.NOTED: P.LEAVING}}
# phase -> {input: {outcome: next phase}}: every transition, and nothing else (an input a phase has no row for, or an
# outcome its row lacks, is a bug in the caller). A phase the run is over in takes a leave or a drop and ignores it;
# only a training node has a round to send in: `outgoing` elsewhere is refused, and nothing changes.
NODE_TRANSITIONS: dict[NodePhase, dict[NodeInput, dict[NodeOutcome, NodePhase]]] = {
    P.REGISTERING: {In.REGISTERED: {Out.NOTED: P.REGISTERING}, In.STARTED: {Out.NOTED: P.TRAINING},
                    In.LEAVE: {Out.NOTED: P.LEAVING, Out.IGNORED: P.REGISTERING},
                    In.SIT_OUT: {Out.NOTED: P.SITTING_OUT}},
    P.REJOINING: {In.REGISTERED: {Out.NOTED: P.REJOINING, Out.READMITTED: P.TRAINING, Out.NEW_RUN: P.REGISTERING},
                  In.STARTED: {Out.NOTED: P.TRAINING}, In.LEAVE: {Out.NOTED: P.LEAVING, Out.IGNORED: P.REJOINING},
                  In.SIT_OUT: {Out.NOTED: P.SITTING_OUT}},
    P.SITTING_OUT: {In.REGISTERED: {Out.NOTED: P.REJOINING, Out.READMITTED: P.TRAINING},  # placed: it starts
                    In.STARTED: {Out.NOTED: P.TRAINING}, In.SIT_OUT: {Out.NOTED: P.SITTING_OUT},
                    In.LEAVE: {Out.NOTED: P.LEAVING, Out.IGNORED: P.SITTING_OUT}},
    P.TRAINING: {In.OUTGOING: {Out.NOTED: P.SENDING}, In.FINISHING: {Out.NOTED: P.FINISHING}, **_LEAVES},
    P.SENDING: {In.SENT: {Out.NOTED: P.WAITING}, **_LEAVES},
    P.WAITING: {In.RELEASED: {Out.AGGREGATED: P.TRAINING, Out.LEFT_OUT: P.DROPPED, Out.FAILED: P.FINISHED},
                In.DROPPED: {Out.NOTED: P.DROPPED}, **_LEAVES},
    P.FINISHING: {In.FINISHED: {Out.NOTED: P.FINISHED}, In.DROPPED: {Out.NOTED: P.DROPPED}, **_LEAVES},
    P.DROPPED: {In.REJOIN: {Out.NOTED: P.REJOINING}, **_LEAVES},
    P.LEAVING: {In.LEFT: {Out.NOTED: P.LEFT}, In.LEAVE: {Out.IGNORED: P.LEAVING}, In.DROPPED: {Out.IGNORED: P.LEAVING}},
    P.LEFT: {In.LEAVE: {Out.IGNORED: P.LEFT}, In.DROPPED: {Out.IGNORED: P.LEFT}},
    P.FINISHED: {In.LEAVE: {Out.IGNORED: P.FINISHED}, In.DROPPED: {Out.IGNORED: P.FINISHED}},
}
for _phase in P:
    NODE_TRANSITIONS[_phase].setdefault(In.OUTGOING, {Out.REFUSED: _phase})
TAKES_FRAGMENTS = frozenset({P.TRAINING, P.SENDING, P.WAITING})  # a round is open: it takes them
WAITS_FOR_MODEL = frozenset({P.REGISTERING})  # fragments that come now may wait for the model (it comes soon)
GONE = frozenset({P.LEAVING, P.LEFT, P.FINISHED})  # the run is over for the node, or it tells the barrier it leaves
_REFUSED_FOR_GOOD = GONE | {P.FINISHING}  # phases that take no fragment again: a sender must not retry
_NOBODY: frozenset[int] = frozenset()


class NodeStateError(RuntimeError):
    """A call the node's phase does not allow (a bug in the caller, like h11's LocalProtocolError)."""


class NodeRefused(Exception):
    """A message this node cannot take in its phase: `reason` is machine-readable, `retry` whether a sender may
    try again (the node will take fragments soon)."""

    def __init__(self, reason: str, detail: str, retry: bool) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.retry = reason, detail, retry


class Sending(NamedTuple):
    """What `outgoing` decided: the round's messages, one per receiving peer (NOTED), or REFUSED (`why`): this node
    has no round to send in (no model yet, or its run is over)."""

    outcome: NodeOutcome
    messages: Sequence[OutgoingMessage]
    why: str = ""


class Advance(NamedTuple):
    """What a release decided (`outcome`): AGGREGATED (the next round is open), LEFT_OUT (the release does not name
    this node: it is DROPPED) or FAILED (the run ended, failed: `failure` says why); and the round's aggregated
    vector and full report, the next round's early messages."""

    outcome: NodeOutcome
    vector: np.ndarray
    report: NodeReport | None  # None where the caller computes the rounds (`NodeState(own_rounds=False)`)
    taken: RoundReport | None  # the next round's messages taken early (None where the caller computes the rounds)
    sent: RoundReport  # the finished round's outgoing traffic
    failure: str | None = None

    @property
    def left_out(self) -> bool:
        return self.outcome is NodeOutcome.LEFT_OUT


def rejoining_refusal(sits_out: bool = False) -> NodeRefused:
    """A node that came back (restarted, or dropped and registering again) refuses fragments until it takes part
    again, with reason `rejoining`: it is no member of the round it lost, so a sender gives that round's fragments
    up at once unless the node is one of its round's `starting` members (docs/spec.md, step 7). `sits_out`: the
    barrier told it that it sits out the open round (a member's new incarnation, with or without state): no
    sender may try again (409), starting or not."""
    if sits_out:
        return NodeRefused(REASON_REJOINING, "node started again: the barrier placed it from the next round on, and "
                           "it takes no fragment of this one", retry=False)
    return NodeRefused(REASON_REJOINING, "node is rejoining the run: a member again from the round the barrier "
                       "places it at", retry=True)


REASON_REJOINING = "rejoining"  # the reason of `rejoining_refusal`, which a sender compares
REASON_FINISHED = "finished"  # a node whose run is over (or that is leaving) refuses fragments for good


def _every_round(round: int) -> bool:
    return True


class Snapshots(dict[int, np.ndarray]):
    """round -> this node's model after that round: the newest (the node's model: no copy), and, of the last
    `SNAPSHOTS_KEPT` rounds, those someone will ask for after a newer one exists (`evaluated`: the barrier's
    evaluation rounds, which it pulls; every round where not told); a peer that rejoins asks for the newest only.
    `metrics`: round -> the node's metrics of that round (its own evaluation of the model after it, or what a
    training loop reported), served with the snapshot and dropped with it."""

    def __init__(self, kept: int = SNAPSHOTS_KEPT) -> None:
        super().__init__()
        self.kept = kept  # 0: none (nobody asks for them: the in-memory network)
        self.metrics: dict[int, dict[str, Any]] = {}
        self._evaluated: Callable[[int], bool] = _every_round

    def evaluating(self, evaluated: Callable[[int], bool]) -> None:
        """The rounds whose models are asked for once older than the newest (the run's evaluation rounds): the
        only older ones kept from now on."""
        self._evaluated = evaluated

    def keep(self, round: int, vector: np.ndarray) -> None:
        if not self.kept:
            return
        for old in [r for r in self if self._dropped(r, round)]:
            del self[old]
        self[round] = vector
        for old in [r for r in self.metrics if self._dropped(r, round)]:
            del self.metrics[old]

    def _dropped(self, old: int, round: int) -> bool:
        """Whether round `old`'s model (and metrics) go once `round`'s is kept: too old, or older and not evaluated."""
        return old <= round - self.kept or (old < round and not self._evaluated(old))

    def keep_metrics(self, round: int, metrics: dict[str, Any]) -> None:
        """The node's metrics of `round` (kept until its snapshot is dropped)."""
        self.metrics[round] = metrics

    def resumed(self, round: int, vector: np.ndarray, before: np.ndarray | None) -> None:
        """A resumed run's checkpoint: its model after `round`, and `before` after the round before (where kept)."""
        kept = {round: vector, round - 1: before if self._evaluated(round - 1) else None}
        self.update({t: v for t, v in kept.items() if t >= 0 and v is not None})

    def model(self, round: int | None, newest: np.ndarray | None) -> tuple[int, np.ndarray] | None:
        """(round, model) kept for `round`, or None; for None, the newest kept (else `newest`, as of round -1)."""
        if round is not None:
            vector = self.get(round)
            return None if vector is None else (round, vector)
        last = max(self) if self else -1
        vector = self.get(last, newest)
        return None if vector is None else (last, vector)


_SENDS_NOTHING = Sending(NodeOutcome.NOTED, ())  # a state whose caller computes its rounds


def _ascending(ranks: Iterable[int]) -> tuple[int, ...]:
    """Members as ascending ranks: a tuple as it is (a `Release`'s: the barrier's are ascending, and n nodes of an
    in-memory network share one), anything else sorted."""
    return ranks if isinstance(ranks, tuple) else tuple(sorted(int(m) for m in ranks))


class NodePhases:
    """A node's phase and the one table it moves along, apart from the rounds and models (h11's `ConnectionState`):
    every phase check is here, so that what a phase allows is read off the table."""

    def __init__(self, phase: NodePhase = NodePhase.REGISTERING) -> None:
        self._phase = phase

    @property
    def phase(self) -> NodePhase:
        return self._phase

    def allows(self, input: NodeInput) -> bool:
        """Whether `input` may come in this phase."""
        return input in NODE_TRANSITIONS[self._phase]

    def fire(self, input: NodeInput, outcome: NodeOutcome, rank: int = -1) -> NodePhase:
        """The one place the phase changes: along `NODE_TRANSITIONS`, or NodeStateError (nothing changes)."""
        try:
            self._phase = to = NODE_TRANSITIONS[self._phase][input][outcome]
        except KeyError:
            raise NodeStateError(f"node {rank}: {input.value} cannot end {outcome.value} while "
                                 f"{self._phase.value}") from None
        return to

    def expect(self, input: NodeInput, rank: int = -1) -> None:
        """NodeStateError unless `input` may come in this phase (nothing changes either way)."""
        if not self.allows(input):
            raise NodeStateError(f"node {rank}: {input.value} is not possible while {self._phase.value}")

    @property
    def gone(self) -> bool:
        """The run is over for this node (finished, left), or it is telling the barrier it leaves."""
        return self._phase in GONE

    @property
    def takes_fragments(self) -> bool:
        return self._phase in TAKES_FRAGMENTS

    @property
    def restarting(self) -> bool:
        """It took over a checkpoint (or the barrier placed it later) and is not registered again yet: the run's open
        round goes on without it."""
        return self._phase in (P.REJOINING, P.SITTING_OUT)

    @property
    def waits_for_model(self) -> bool:
        """Fragments that come now may wait for the model: it comes soon (`WAITS_FOR_MODEL`)."""
        return self._phase in WAITS_FOR_MODEL

    @property
    def sends(self) -> bool:
        """A round is open for its trained vector: `outgoing` is not refused."""
        return self._phase is P.TRAINING

    def refusal(self) -> NodeRefused:
        """Why a node in this phase takes no fragment messages (`NodeState.taking`)."""
        if self._phase in _REFUSED_FOR_GOOD:
            return NodeRefused(REASON_FINISHED, f"node is {self._phase.value}: it takes no more fragments", retry=False)
        if self._phase is P.REJOINING:
            return rejoining_refusal()
        if self._phase is P.SITTING_OUT:
            return rejoining_refusal(sits_out=True)
        return NodeRefused("not_ready", f"node is {self._phase.value}", retry=True)


class NodeState:
    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, max_norm: float | None = None, rejoining: bool = False,
                 on_refused: Callable[[str, int], None] | None = None, own_rounds: bool = True,
                 snapshots: int = SNAPSHOTS_KEPT) -> None:
        """`rejoining`: it was a member of the run before (a checkpoint, or the daemon's note of its
        registration), so fragments of rounds it lost are refused at once (retry), not held until it is ready.
        `on_refused(reason, count)`: told of what a round refuses on its own (--max-norm, the aggregator's cuts),
        for a daemon's counters (reports count them). The clock is the caller's: every call that times a phase
        takes `now` (seconds). `own_rounds=False`: its caller computes each round (`InMemoryNetwork`: every node's at
        once) and hands `released` its outcome; the state still decides every move of the node's phase.
        `snapshots`: how many models after the last rounds it keeps (0: none)."""
        self.max_bytes, self.max_norm, self.on_refused, self.own_rounds = max_bytes, max_norm, on_refused, own_rounds
        self.aggregator: Aggregator | None = None
        self.attack: Attack | None = None
        self.compressor: Compressor | None = None
        self.phases = NodePhases(P.REJOINING if rejoining else P.REGISTERING)
        self.rank, self.round, self.run_id = -1, 0, ""
        self.addresses: list[str] = []
        self.members: tuple[int, ...] = ()  # ascending
        self._starting: frozenset[int] | None = frozenset()  # None: every member (`starting`)
        self.snapshots = Snapshots(snapshots)
        self.vector: np.ndarray | None = None
        self.last_report: NodeReport | None = None
        self.loss = math.nan
        self.fragmentation: Fragmentation | None = None
        self.sampler: PeerSampler | None = None
        self._round: RoundState | None = None
        self._refused: Counter[str] = Counter()  # refusals not reported yet (some come after an arrival)
        self._opened = 0.0  # when this node heard that its open round started
        self._sending = self._waiting = 0.0
        self._report: NodeReport | None = None

    phase = property(lambda self: self.phases.phase)
    gone = property(lambda self: self.phases.gone, doc="the run is over for this node, or it tells the barrier so")
    takes_fragments = property(lambda self: self.phases.takes_fragments)
    restarting = property(lambda self: self.phases.restarting, doc="`NodePhases.restarting`")
    refusal = property(lambda self: self.phases.refusal(), doc="why it takes no fragment now: `NodePhases.refusal`")
    waits_for_model = property(lambda self: self.phases.waits_for_model, doc="`NodePhases.waits_for_model`")

    @property
    def starting(self) -> frozenset[int]:
        """Members of the open round that may still be starting: every one at registration (all were answered as
        this node was), then those a release names as joined."""
        return frozenset(self.members) if self._starting is None else self._starting

    # -- membership --------------------------------------------------------------------------------
    def registered(self, rank: int, addresses: Sequence[str], live: Iterable[int], round: int, run_id: str,
                   now: float) -> NodeOutcome:
        """The barrier's answer to a registration: this node's rank, the members' addresses, who is live, and the
        round it takes part from (> 0 for a node that rejoins or joins late). READMITTED: a dropped node that knows
        the model goes on at once; NEW_RUN: a checkpoint's node registered for a run at round 0 (this run's
        checkpoints are of round >= 1), which starts anew like the rest."""
        self.phases.expect(In.REGISTERED, self.rank)
        if self.fragmentation is not None:
            outcome = Out.READMITTED
        elif round == 0 and self.phases.restarting:
            outcome = Out.NEW_RUN
        else:
            outcome = Out.NOTED
        self.phases.fire(In.REGISTERED, outcome, rank)
        self.rank, self.addresses, self.round, self.run_id = rank, list(addresses), round, run_id
        self.members, self._starting = _ascending(live), None
        self._opened = now
        if outcome is Out.READMITTED and self.own_rounds:
            self._open_round(())
        return outcome

    def start(self, fragmentation: Fragmentation, sampler: PeerSampler, vector: np.ndarray | None = None, *,
              aggregator: Aggregator | None = None, attack: Attack | None = None,
              compressor: Compressor | None = None, evaluated: Callable[[int], bool] | None = None) -> None:
        """The model's fragmentation is known (and its starting vector, where known): from now on fragments are
        taken. `aggregator`: the run's rule (None: mean); `attack`: how this node lies, if it is an attacker;
        `compressor`: the run's codec with this node's error feedback (None: --compress none); `evaluated`: the
        rounds the barrier evaluates, the only ones whose models it keeps once a newer one exists (None: every
        round's, for `SNAPSHOTS_KEPT` rounds)."""
        if self.rank < 0:
            raise NodeStateError("start() before registered()")
        self.phases.fire(In.STARTED, Out.NOTED, self.rank)
        self.fragmentation, self.sampler, self.aggregator, self.attack = fragmentation, sampler, aggregator, attack
        self.compressor = compressor
        if evaluated is not None:
            self.snapshots.evaluating(evaluated)
        if self.own_rounds:
            self._open_round(())
        if vector is not None:
            self.begin(vector)

    def begin(self, vector: np.ndarray, kept_as: int | None = None, before: np.ndarray | None = None) -> None:
        """The model this node starts the run (or its rejoin) from; `kept_as`: the round it is the model after (a
        resumed run's checkpoint), kept as that round's snapshot for the barrier's evaluation, `before` too."""
        self.vector = vector
        if kept_as is not None:
            self.snapshots.resumed(kept_as, vector, before)

    def sitting_out(self) -> None:
        """The barrier answered this node's registration that it is a member's new incarnation (it restarted, with
        its state or none), which sits out the open round: until it is registered again it refuses that round's
        fragments for good (`rejoining`, 409), so that no sender waits for it, then it asks again for its place."""
        self.phases.fire(In.SIT_OUT, Out.NOTED, self.rank)

    def rejoining(self) -> None:
        """A dropped node registers again (--rejoin-dropped)."""
        self.phases.fire(In.REJOIN, Out.NOTED, self.rank)
        self.rank, self._round = -1, None

    def leaving(self) -> NodeOutcome:
        """This node stops (a signal, or its loop failed): NOTED, it tells the barrier, then is LEFT; IGNORED where
        there is nobody to tell (never registered) or nothing to say (it is `gone`)."""
        self.phases.expect(In.LEAVE, self.rank)
        outcome = Out.IGNORED if self.rank < 0 or self.phases.gone else Out.NOTED
        self.phases.fire(In.LEAVE, outcome, self.rank)
        return outcome

    def left(self) -> None:
        self.phases.fire(In.LEFT, Out.NOTED, self.rank)
        self._round = None

    # -- one round: outgoing -> sent -> released ---------------------------------------------------------
    def outgoing(self, local: np.ndarray, now: float) -> Sending:
        """Record the locally trained vector: this round's messages, one per receiving peer; REFUSED (nothing
        changes) where this node has no round to send in."""
        outcome = Out.NOTED if self.phases.sends else Out.REFUSED
        self.phases.fire(In.OUTGOING, outcome, self.rank)
        if outcome is Out.REFUSED:
            return Sending(outcome, (), f"a node sends once it is registered and has its model, not while "
                           f"{self.phase.value}")
        self._sending = now
        if self._round is None:  # its caller computes the round (`own_rounds=False`)
            return _SENDS_NOTHING
        return Sending(outcome, self._round.outgoing(np.asarray(local, dtype=np.float32)))

    def send_budget(self, round_deadline: float, now: float) -> float:
        """Seconds the sends may take now: what is left of the round's deadline (counted from its release) less
        a margin for the arrival (a tenth of it, 1 s to half of it), at least 0.5 s."""
        return max(round_deadline - send_margin(round_deadline) - (now - self._opened), MIN_SEND_BUDGET_S)

    def sent(self, delivered: Mapping[int, tuple[int, int]], unsent: Iterable[OutgoingMessage], now: float,
             loss: float = math.nan, train_s: float = 0.0, aggregate_s: float = 0.0) -> NodeReport | None:
        """The sends are over: `delivered` peer -> (fragments, bytes) it took; the report the arrival carries (None
        where its caller computes the rounds: it counts them too). `train_s`, `aggregate_s`: what the caller timed
        (this round's training, the last release's aggregation)."""
        self.phases.fire(In.SENT, Out.NOTED, self.rank)
        self.loss = loss
        if self._round is None:
            return None
        for message in unsent:
            self._round.mark_unsent(message)
        self._report = NodeReport.of_traffic(
            self._round.report, loss=loss, refused=dict(self._refused), train_s=round(train_s, 6),
            send_s=round(now - self._sending, 6), aggregate_s=round(aggregate_s, 6),
            delivered=dict(delivered))
        self._refused.clear()
        self._waiting = now
        return self._report

    def released(self, members: Iterable[int], joined: Mapping[int, str], stragglers: Iterable[int], now: float,
                 failure: str | None = None, computed: RoundOutcome | None = None) -> Advance:
        """The barrier released the round: aggregate and keep the snapshot; then, as the release decides, open the
        next round (AGGREGATED), or not: LEFT_OUT (this node is not among the next round's `members`: DROPPED) or
        FAILED (`failure`: the run ended so; FINISHED). `members`: ascending (a tuple is taken as it is, as a
        `Release`'s); `joined`: rank -> address of members new to the run; `computed`: the round's outcome where its
        caller computes the rounds (`own_rounds=False`)."""
        assert (computed is None) == self.own_rounds, "computed: the round's outcome where the caller computes it"
        members = members if type(members) is tuple else _ascending(members)
        at = bisect_left(members, self.rank)
        named = at < len(members) and members[at] == self.rank
        decided = Out.LEFT_OUT if not named else Out.FAILED if failure else Out.AGGREGATED
        self.phases.fire(In.RELEASED, decided, self.rank)  # out of order: NodeStateError, and nothing changed
        outcome = computed if self._round is None else self._round.finish()
        assert outcome is not None
        vector = self.settled(outcome)
        t, self.members, self.vector, self._opened = self.round, members, vector, now
        if self.snapshots.kept:
            self.snapshots.keep(t, vector)
        self._starting = _NOBODY
        if joined:
            for rank, address in sorted(joined.items()):
                if rank == len(self.addresses):  # a node that joined: the next free rank
                    self.addresses.append(address)
            self._starting = frozenset(int(r) for r in joined)  # they heard of their place with it, as we did
        report = None
        if self._report is not None:
            report = self.last_report = self._report.with_release(
                round(now - self._waiting, 6), tuple(stragglers), messages_in=outcome.report.messages_in,
                fragments_in=outcome.report.fragments_in, bytes_in=outcome.report.bytes_in)
        self._report, self.round = None, t + 1
        if decided is Out.AGGREGATED and self.own_rounds:
            return Advance(decided, vector, report, self._open_round(outcome.early), outcome.report)
        self._round = None
        return Advance(decided, vector, report, RoundReport(t + 1) if self.own_rounds else None,
                       outcome.report, failure)

    def settled(self, outcome: RoundOutcome) -> np.ndarray:
        """The model this node goes on with after a release: its round's aggregate. One rule for every driver (the
        daemon's `Peer`, `InMemoryNetwork`): what it returns is the node's model, snapshot and next round's start."""
        return outcome.vector

    def dropped(self) -> NodeOutcome:
        """The barrier said this node was dropped (or fell further behind than it keeps): NOTED, it is DROPPED;
        IGNORED where the run is over for it already (it left meanwhile)."""
        self.phases.expect(In.DROPPED, self.rank)
        outcome = Out.IGNORED if self.phases.gone else Out.NOTED
        self.phases.fire(In.DROPPED, outcome, self.rank)
        if outcome is Out.NOTED:
            self._round = None
        return outcome

    def finishing(self) -> None:
        """The final arrival (round == rounds): no more fragments are taken."""
        self.phases.fire(In.FINISHING, Out.NOTED, self.rank)
        self._round = None

    def finished(self) -> None:
        """The barrier answered the final arrival: the run is over for this node."""
        self.phases.fire(In.FINISHED, Out.NOTED, self.rank)

    def round_state(self, early: tuple = ()) -> RoundState:
        """The `RoundState` of this node's open round, as it opens it itself: its members, the run's rule, its attack
        (from the model the round starts from) and codec. A caller that computes the rounds (`own_rounds=False`)
        runs this one, so a node's round is built in one place."""
        assert self.fragmentation is not None and self.sampler is not None
        return RoundState(node=self.rank, round=self.round, members=self.members, fragmentation=self.fragmentation,
                          sampler=self.sampler, run_id=self.run_id, max_bytes=self.max_bytes, early=early,
                          planned_only=True, max_norm=self.max_norm, aggregator=self.aggregator, attack=self.attack,
                          on_refused=self._counted,
                          start=self.vector if self.attack is not None and self.round > 0 else None,
                          compressor=self.compressor)

    def _open_round(self, early: tuple) -> RoundReport:
        self._round = self.round_state(early)
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
        if not self.phases.takes_fragments:
            raise self.phases.refusal()
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

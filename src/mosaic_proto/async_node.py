"""`AsyncNodeState`: one node of asynchronous Mosaic (docs/spec.md, "Asynchronous mode"), with no I/O and no rounds.

The same shape as `NodeState`: the phase lives in `AsyncPhases` and moves only along `ASYNC_TRANSITIONS`, one
`fire` per call, inputs (`AsyncInput`) apart from what the state decides of them (`AsyncOutcome`), the clock (`now`)
handed in, and every decision returned as a value. It is a class of its own, not a mode of `NodeState`, because
none of `NodeState`'s inputs exist here (no registration round, release, drop or final arrival: nothing waits
for a barrier) and its one input with a model in it, `trained`, both aggregates and sends, which a barrier node does
in two calls a release apart. What it shares with the barrier node is reused as is: `Fragmentation`, `PeerSampler`
(keyed by (seed, step, node, fragment): a node's step takes the round's place), `Aggregator`, `Compressor`, `Attack`.

A driver (`AsyncNetwork` on a virtual clock; the daemon, later) feeds the trained vector, the fragments that
arrive and the link's turn, and gets the model to train next and the messages to send:

    state = AsyncNodeState(rank, members, fragmentation, sampler, iterations, vector, budget_s=..., ...)
    state.started(now)                           # the run's start on the driver's clock (default 0): the budget's
    start = state.start                          # the vector iteration `state.step` trains from
    done = state.trained(local, now)             # queue the trained model's fragments, aggregate: an `Iteration`
    message = state.next_send(now)               # the link is free: the next queued message (None: none queued)
    state.receive(batch, now)                    # any time: into the inbox (newest per sender and fragment)
    average = state.paired(other, now)           # --exchange pairwise: a peer's model came; both keep the average
    state.averaged(average, now)                 # ... and the node that asked keeps it too
    view = state.status(now)                     # a read-only `AsyncNodeStatus`: steps, inbox, queue, staleness
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .attacks import Attack
from .compression import Compressor
from .fragmentation import Fragmentation
from .robust import Aggregator
from .round import RoundReport, fragment_norms, over_norm
from .sampling import PeerSampler
from .wire import FragmentBatch

__all__ = ["ASYNC_TRANSITIONS", "AsyncInput", "AsyncMessage", "AsyncNodeState", "AsyncNodeStatus", "AsyncOutcome",
           "AsyncPhase", "AsyncPhases", "AsyncSend", "AsyncStateError", "Exchange", "Iteration", "SendQueue",
           "Staleness", "StopReason", "SyncMode", "pairwise_average"]


class SyncMode(StrEnum):
    """--sync: `barrier` (rounds released by the barrier: the paper's) or `async` (no rounds: this module)."""

    BARRIER = "barrier"
    ASYNC = "async"


class Exchange(StrEnum):
    """--exchange (asynchronous runs): `push` (each fragment to s sampled peers: Mosaic; EL with --fragments 1) or
    `pairwise` (AD-PSGD: the whole model averaged with one random peer, atomically)."""

    PUSH = "push"
    PAIRWISE = "pairwise"


class AsyncSend(StrEnum):
    """--async-send (push): which model's fragments a node sends. `trained` (its model after the iteration's H local
    steps, before it aggregates: each step reaches the receivers whole, as a barrier round sends x_trained) or
    `aggregated` (after it averaged its inbox: the step reaches them damped by about 1 / (1 + s))."""

    TRAINED = "trained"
    AGGREGATED = "aggregated"


class StopReason(StrEnum):
    """What ended a node's iterations: its --rounds `iterations`, or its --time-budget (`budget`), whichever came
    first."""

    ITERATIONS = "iterations"
    BUDGET = "budget"


class AsyncPhase(StrEnum):
    TRAINING = "training"
    FINISHED = "finished"  # its iterations are done; its queue still drains


class AsyncInput(StrEnum):
    """What comes in: the training loop's vector, a message, the link's turn, a pairwise average."""

    TRAINED = "trained"  # H local steps are done
    RECEIVED = "received"  # a fragment message arrived
    SEND = "send"  # the link is free: the next queued message, if any
    PAIRED = "paired"  # a peer's whole model arrived for pairwise averaging
    AVERAGED = "averaged"  # the peer asked kept the pair's average: so does this node


class AsyncOutcome(StrEnum):
    ITERATED = "iterated"  # aggregated and sent; the next iteration trains
    DONE = "done"  # that was the last iteration
    TAKEN = "taken"  # a message's fragments are in the inbox
    STALE = "stale"  # every fragment in it is older than the copy the inbox holds from its sender
    REFUSED = "refused"  # not this run's, not a member's, or not planned for this node
    OUT_OF_RANGE = "out_of_range"  # a fragment's norm is over --max-norm times the node's own fragment's
    IGNORED = "ignored"  # the node is finished: what comes is of no use to it
    NOTED = "noted"
    IDLE = "idle"  # nothing to send


S, In, Out = AsyncPhase, AsyncInput, AsyncOutcome
_ANY_MESSAGE = {In.SEND: {Out.NOTED: None, Out.IDLE: None}, In.AVERAGED: {Out.NOTED: None}}
# phase -> {input: {outcome: next phase}} (None: the phase stays); a finished node still sends what it queued, and
# keeps the average of the pair it asked for in its last iteration
ASYNC_TRANSITIONS: dict[AsyncPhase, dict[AsyncInput, dict[AsyncOutcome, AsyncPhase | None]]] = {
    S.TRAINING: {In.TRAINED: {Out.ITERATED: None, Out.DONE: S.FINISHED},
                 In.RECEIVED: {Out.TAKEN: None, Out.STALE: None, Out.REFUSED: None,
                               Out.OUT_OF_RANGE: None},
                 In.PAIRED: {Out.NOTED: None}, **_ANY_MESSAGE},
    S.FINISHED: {In.RECEIVED: {Out.IGNORED: None}, In.PAIRED: {Out.IGNORED: None}, **_ANY_MESSAGE},
}


class AsyncStateError(RuntimeError):
    """A call the node's phase does not allow (a bug in the driver)."""


class AsyncPhases:
    """An asynchronous node's phase and the one table it moves along."""

    def __init__(self) -> None:
        self._phase = AsyncPhase.TRAINING

    @property
    def phase(self) -> AsyncPhase:
        return self._phase

    @property
    def finished(self) -> bool:
        return self._phase is AsyncPhase.FINISHED

    def expect(self, input: AsyncInput, rank: int) -> None:
        """AsyncStateError unless `input` may come in this phase (nothing changes either way)."""
        if input not in ASYNC_TRANSITIONS[self._phase]:
            raise AsyncStateError(f"node {rank}: {input.value} is not possible while {self._phase.value}")

    def fire(self, input: AsyncInput, outcome: AsyncOutcome, rank: int) -> None:
        """The one place the phase changes: along `ASYNC_TRANSITIONS`, or AsyncStateError (nothing changes)."""
        try:
            to = ASYNC_TRANSITIONS[self._phase][input][outcome]
        except KeyError:
            raise AsyncStateError(f"node {rank}: {input.value} cannot end {outcome.value} while "
                                  f"{self._phase.value}") from None
        self._phase = to or self._phase


@dataclass(frozen=True)
class AsyncMessage:
    """One queued send: fragments of step `step` for `peer` (`pair`: the whole model, for pairwise averaging)."""

    peer: int
    step: int
    batch: FragmentBatch
    nbytes: int  # what the link carries (the values' bytes, as the barrier's virtual clock counts them)
    pair: bool = False


class SendQueue:
    """A node's outgoing queue: training never waits for it. At most one unsent copy of a fragment per receiver: a
    newer step's copy supersedes the unsent older one (the older message loses that fragment, and is dropped once it
    has none left); a message the link has taken is not recalled. Messages leave in the order they were queued."""

    def __init__(self) -> None:
        self._queued: dict[int, list] = {}  # seq -> [peer, step, {fragment: values}, {fragment: nbytes}, pair]
        self._by_peer: dict[int, list[int]] = {}
        self._seq = 0
        self.superseded = 0  # fragments dropped unsent because a newer copy for the same receiver came

    def __len__(self) -> int:
        return len(self._queued)

    def fragments(self) -> int:
        """Fragments waiting in the queued messages (a pair's whole model counts as one)."""
        return sum(len(message[2]) for message in self._queued.values())

    def put(self, peer: int, step: int, values: dict[int, object], nbytes: dict[int, int], pair: bool = False) -> None:
        mine = self._by_peer.setdefault(peer, [])
        for seq in list(mine):
            older = self._queued[seq]
            for f in [f for f in older[2] if f in values]:
                del older[2][f], older[3][f]
                self.superseded += 1
            if not older[2]:
                del self._queued[seq]
                mine.remove(seq)
        self._queued[self._seq] = [peer, step, values, nbytes, pair]
        mine.append(self._seq)
        self._seq += 1

    def pop(self) -> tuple[int, int, dict[int, object], int, bool] | None:
        """The oldest queued message: (peer, step, fragment -> values, bytes, pair), or None."""
        if not self._queued:
            return None
        seq = next(iter(self._queued))
        peer, step, values, nbytes, pair = self._queued.pop(seq)
        self._by_peer[peer].remove(seq)
        return peer, step, dict(sorted(values.items())), sum(nbytes.values()), pair


@dataclass(frozen=True)
class Iteration:
    """What `trained` decided: ITERATED (train `vector` next) or DONE (`vector` is the node's final model), the
    iteration's counts (`report.round` is its step), and the peer a pairwise node asked (else -1)."""

    outcome: AsyncOutcome
    vector: np.ndarray
    report: RoundReport
    partner: int = -1


@dataclass(frozen=True)
class Staleness:
    """How old the copies were that one aggregation averaged (docs/spec.md, "Asynchronous mode"): `lag_steps`, the
    receiver's step less the copy's (how far its sender was behind; negative: ahead), and `wait_s`, the time the
    copy waited in the inbox (the receiver's clock, from its arrival to the aggregation). The means and maxima are
    None when no copy came."""

    step: int  # the receiver's step whose aggregation this was
    at: float  # when (the driver's clock)
    copies: int  # fragment copies averaged with the node's own values
    senders: int
    lag_steps_mean: float | None
    lag_steps_max: int | None
    wait_s_mean: float | None
    wait_s_max: float | None


@dataclass(frozen=True)
class AsyncNodeStatus:
    """A read-only view of an asynchronous node for status pages: its steps, its inbox and outgoing queue, what it
    counted, and the staleness of its last aggregation (None before the first, and with --exchange pairwise)."""

    rank: int
    phase: str
    steps: int  # iterations done
    iterations: int  # of --rounds
    budget_s: float | None  # --time-budget (None: none)
    stopped_by: str | None  # what ended its iterations (`StopReason`; None while it trains)
    inbox: int  # fragments waiting in the inbox
    inbox_per_fragment: tuple[int, ...]  # ... of each fragment index
    inbox_oldest_s: float | None  # how long the oldest of them has waited (None: the inbox is empty)
    queue: int  # messages in the outgoing queue
    queue_fragments: int  # fragments in them
    superseded: int  # fragments dropped unsent for a newer copy (since the start)
    stale: int  # fragments received older than the copy held (since the start)
    refused: int  # messages refused (out_of_range among them)
    out_of_range: int  # ... by --max-norm
    ignored: int
    averaged: int  # pairwise averages kept
    last_aggregation: Staleness | None


def pairwise_average(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a + b) / 2 in float64, rounded to float32 once: the same bits whichever node computes it."""
    return ((np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2).astype(np.float32)


class AsyncNodeState:
    """One asynchronous node over its whole run: `iterations` times train -> send -> aggregate (`send` trained, the
    default) or train -> aggregate -> send (`send` aggregated); with `budget_s`, no iteration starts once the
    driver's clock is `budget_s` past the run's start (`started`), whichever comes first.

    `sampler`: whose plan for (step, node) names each fragment's receivers (pairwise: a sampler of fanout 1, whose
    one receiver of fragment 0 is the peer asked); `planned_only`: refuse fragments the sender's plan does not send
    here (a driver whose messages are all honest may skip the check); `max_norm` (--max-norm, push only): refuse a
    message with a fragment whose L2 norm is over max_norm times that fragment's of the node's model when it comes
    (the barrier round's check, `round.over_norm`)."""

    def __init__(self, rank: int, members: Sequence[int], fragmentation: Fragmentation, sampler: PeerSampler,
                 iterations: int, vector: np.ndarray, *, run_id: str = "mosaic", budget_s: float | None = None,
                 exchange: Exchange = Exchange.PUSH,
                 send: AsyncSend = AsyncSend.TRAINED, aggregator: Aggregator | None = None,
                 compressor: Compressor | None = None, attack: Attack | None = None, planned_only: bool = True,
                 max_norm: float | None = None) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        if max_norm is not None and Exchange(exchange) is Exchange.PAIRWISE:
            raise ValueError("max_norm needs exchange push: a pairwise exchange averages whole models atomically")
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.rank, self.members = rank, tuple(sorted(members))
        self._member_set = frozenset(self.members)
        if rank not in self._member_set:
            raise ValueError(f"node {rank} is not among the members")
        self.fragmentation, self.sampler, self.iterations, self.run_id = fragmentation, sampler, iterations, run_id
        self.exchange, self.send, self.aggregator = Exchange(exchange), AsyncSend(send), aggregator or Aggregator()
        self.compressor, self.attack, self.planned_only, self.max_norm = compressor, attack, planned_only, max_norm
        self.codec = compressor.compression.codec if compressor is not None else "none"
        self.phases = AsyncPhases()
        self.budget_s = budget_s
        self.started_at = 0.0  # the run's start on the driver's clock: the budget counts from it
        self.stopped_by: StopReason | None = None  # what ended the iterations, once they ended
        self.step = 0  # iterations done
        self.vector = np.ascontiguousarray(vector, dtype=np.float32)  # the node's model now
        self.start = self.vector  # what the iteration in training started from
        self._own_norms = self._norms(self.vector)  # --max-norm's measure: the model's fragments' norms
        self._moved = False  # a pairwise average replaced the model during the iteration's training
        # sender -> fragment -> (step, values, arrived at)
        self._inbox: dict[int, dict[int, tuple[int, object, float]]] = {}
        self.queue = SendQueue()
        self.counts: Counter[str] = Counter()  # stale, refused, out_of_range, ignored, averaged: since the start
        self._arrived = [0, 0, 0]  # messages, fragments, bytes taken since the last aggregation
        self._refused: Counter[str] = Counter()  # messages refused by --max-norm since then, by reason
        self._staleness: Staleness | None = None  # of the last aggregation

    phase = property(lambda self: self.phases.phase)
    finished = property(lambda self: self.phases.finished)

    def inbox_depth(self) -> int:
        """Fragments waiting in the inbox."""
        return sum(len(frags) for frags in self._inbox.values())

    def status(self, now: float) -> AsyncNodeStatus:
        """What the node is doing, as of `now` (the driver's clock): a read-only view."""
        per_fragment = [0] * self.fragmentation.k
        arrivals = []
        for frags in self._inbox.values():
            for f, (_, _, arrived) in frags.items():
                per_fragment[f] += 1
                arrivals.append(arrived)
        return AsyncNodeStatus(
            rank=self.rank, phase=self.phase.value, steps=self.step, iterations=self.iterations,
            budget_s=self.budget_s, stopped_by=None if self.stopped_by is None else self.stopped_by.value,
            inbox=len(arrivals), inbox_per_fragment=tuple(per_fragment),
            inbox_oldest_s=now - min(arrivals) if arrivals else None, queue=len(self.queue),
            queue_fragments=self.queue.fragments(), superseded=self.queue.superseded, stale=self.counts["stale"],
            refused=self.counts["refused"], out_of_range=self.counts["out_of_range"], ignored=self.counts["ignored"],
            averaged=self.counts["averaged"],
            last_aggregation=self._staleness)

    def started(self, now: float) -> None:
        """The run started at `now` on the driver's clock (the daemons: their start's barrier; the simulator's
        virtual clock starts at 0, the default): the time budget counts from it (a daemon started again: the run's
        start, which may lie before its own)."""
        if self.phases.finished:
            raise AsyncStateError(f"node {self.rank}: its iterations are over: the run's start came before")
        self.started_at = now

    def over_budget(self, now: float) -> bool:
        """Whether the time budget is spent at `now` (never without one): no iteration starts then."""
        return self.budget_s is not None and now - self.started_at >= self.budget_s

    def resumed(self, step: int, vector: np.ndarray) -> None:
        """A node started again from its checkpoint: it goes on with iteration `step` from `vector`, its inbox and
        queue empty (what they held died with its process). Only before its first iteration, and `step` must be
        one still to do (a node checkpoints no finished run)."""
        if self.step != 0 or not 0 <= step < self.iterations:
            raise AsyncStateError(f"node {self.rank}: cannot resume at step {step} after {self.step} of "
                                  f"{self.iterations} iterations")
        self.step, self.vector = step, np.ascontiguousarray(vector, dtype=np.float32)
        self.start, self._own_norms = self.vector, self._norms(self.vector)

    # -- the node's own loop -----------------------------------------------------------------------------------
    def trained(self, local: np.ndarray, now: float) -> Iteration:
        """H local steps from `start` gave `local`: apply them to the model (as they are, unless a pairwise average
        replaced the model meanwhile: then their change is added to it), queue the fragments of the trained model
        for the step's receivers and aggregate the inbox with it (`send` trained; `aggregated`: aggregate first
        and queue the aggregate's fragments); the aggregate is the node's model from then on."""
        self.phases.expect(In.TRAINED, self.rank)
        local = np.ascontiguousarray(local, dtype=np.float32)
        if self._moved:
            local = (self.vector + (local - self.start)).astype(np.float32)
        step, partner, cut = self.step, -1, Counter()
        if self.exchange is Exchange.PAIRWISE:
            vector = local
            partner = self.sampler.receivers(step, self.rank, 0, self.members)[0]
            self.queue.put(partner, step, {0: vector}, {0: vector.nbytes}, pair=True)
            out = (1, 1, vector.nbytes)
        elif self.send is AsyncSend.TRAINED:  # as a barrier round: send x_trained, then aggregate
            out = self._queue_fragments(local, step)
            vector, cut = self._aggregated(local, step, now)
        else:
            vector, cut = self._aggregated(local, step, now)
            out = self._queue_fragments(vector, step)
        (messages_in, fragments_in, bytes_in), self._arrived = self._arrived, [0, 0, 0]
        refused, self._refused = self._refused, Counter()
        report = RoundReport(round=step, messages_out=out[0], fragments_out=out[1], bytes_out=out[2],
                             messages_in=messages_in, fragments_in=fragments_in, bytes_in=bytes_in, refused=refused,
                             cut=cut)
        stop = StopReason.ITERATIONS if step + 1 >= self.iterations else \
            StopReason.BUDGET if self.over_budget(now) else None
        outcome = Out.ITERATED if stop is None else Out.DONE
        self.phases.fire(In.TRAINED, outcome, self.rank)
        self.stopped_by = stop
        self.step, self.vector, self.start, self._moved = step + 1, vector, vector, False
        self._own_norms = self._norms(vector)
        return Iteration(outcome, vector, report, partner)

    def _norms(self, vector: np.ndarray) -> list[float] | None:
        """What --max-norm measures received fragments against: the norms of `vector`'s fragments (None without)."""
        return None if self.max_norm is None else fragment_norms(self.fragmentation.views(vector))

    def _aggregated(self, local: np.ndarray, step: int, now: float) -> tuple[np.ndarray, Counter]:
        """The inbox's newest copies (one per sender and fragment) averaged with `local` by the run's rule, in
        ascending sender order; the inbox is empty afterwards (and `_staleness` says how old its copies were)."""
        received = {sender: {f: values for f, (_, values, _) in sorted(frags.items())}
                    for sender, frags in sorted(self._inbox.items())}
        copies = [(step - copy_step, now - arrived) for frags in self._inbox.values()
                  for copy_step, _, arrived in frags.values()]
        lags, waits = [lag for lag, _ in copies], [wait for _, wait in copies]
        self._staleness = Staleness(step, now, len(copies), len(self._inbox),
                                    sum(lags) / len(lags) if lags else None, max(lags) if lags else None,
                                    sum(waits) / len(waits) if waits else None, max(waits) if waits else None)
        self._inbox = {}
        stand_in = None if self.compressor is None else self.compressor.stand_in(local)
        vector, cut = self.aggregator.aggregate(local, self.fragmentation, received, stand_in=stand_in)
        if stand_in is not None and self.compressor is not None:
            self.compressor.heard(self.fragmentation.indices, received)
        return np.ascontiguousarray(vector, dtype=np.float32), cut

    def _queue_fragments(self, vector: np.ndarray, step: int) -> tuple[int, int, int]:
        """Queue the step's fragments for their receivers: (messages, fragments, bytes) queued."""
        fragments: list = self.fragmentation.views(vector)
        if self.attack is not None:
            start = self.fragmentation.views(self.start) if step > 0 else [None] * len(fragments)
            fragments = [self.attack.craft(step, f, values, start[f]) for f, values in enumerate(fragments)]
        if self.compressor is not None and self.codec != "none":
            fragments = [self.compressor.compress(values, round=step, fragment=f) for f, values in enumerate(fragments)]
        sizes = [int(v.nbytes) for v in fragments]
        plan = self.sampler.planned(step, self.rank, self.fragmentation.k, self.members)
        for peer, frags in plan.items():
            self.queue.put(peer, step, {f: fragments[f] for f in frags}, {f: sizes[f] for f in frags})
        return (len(plan), sum(len(frags) for frags in plan.values()),
                sum(sizes[f] for frags in plan.values() for f in frags))

    def next_send(self, now: float) -> AsyncMessage | None:
        """The link is free: the oldest queued message (NOTED), or None (IDLE)."""
        popped = self.queue.pop()
        self.phases.fire(In.SEND, Out.IDLE if popped is None else Out.NOTED, self.rank)
        if popped is None:
            return None
        peer, step, values, nbytes, pair = popped
        k = 1 if pair else self.fragmentation.k
        batch = FragmentBatch(self.run_id, step, self.rank, k, b"" if pair else self.fragmentation.fingerprint,
                              values, "none" if pair else self.codec)  # type: ignore[arg-type]
        return AsyncMessage(peer, step, batch, nbytes, pair)

    # -- what comes in --------------------------------------------------------------------------------------
    def receive(self, batch: FragmentBatch, now: float, sender: int | None = None) -> AsyncOutcome:
        """A fragment message: each fragment kept in the inbox if it is newer than the copy held from its sender
        (TAKEN), else dropped (STALE); REFUSED if it is not this run's, not from another member (or not from
        `sender`, the member its transport proved), or (with `planned_only`) not what the sender's plan of its step
        sends here; OUT_OF_RANGE (--max-norm) if a fragment's norm is over max_norm times that fragment's of the
        node's model now (the message is refused whole, as in a barrier round); IGNORED once the node is
        finished."""
        if self.phases.finished:
            outcome = Out.IGNORED
        elif (batch.run_id != self.run_id or batch.sender == self.rank or batch.sender not in self._member_set
              or (sender is not None and batch.sender != sender)
              or batch.k != self.fragmentation.k or batch.fingerprint != self.fragmentation.fingerprint
              or batch.codec != self.codec or not self._planned(batch)):
            outcome = Out.REFUSED
        elif self._own_norms is not None and self.max_norm is not None \
                and over_norm(batch.sender, batch.fragments, self._own_norms, self.max_norm) is not None:
            outcome = Out.OUT_OF_RANGE
            self._refused[outcome.value] += 1
        else:
            held = self._inbox.setdefault(batch.sender, {})
            fresh = {f: v for f, v in batch.fragments.items() if f not in held or held[f][0] < batch.round}
            for f, values in fresh.items():
                held[f] = (batch.round, values, now)
            self.counts["stale"] += len(batch.fragments) - len(fresh)
            outcome = Out.TAKEN if fresh else Out.STALE
            if fresh:
                arrived = self._arrived
                arrived[0], arrived[1] = arrived[0] + 1, arrived[1] + len(fresh)
                arrived[2] += sum(int(getattr(v, "nbytes", 0)) for v in fresh.values())
        self.phases.fire(In.RECEIVED, outcome, self.rank)
        if outcome in (Out.REFUSED, Out.IGNORED, Out.OUT_OF_RANGE):
            self.counts[outcome.value] += 1
        if outcome is Out.OUT_OF_RANGE:
            self.counts["refused"] += 1
        return outcome

    def _planned(self, batch: FragmentBatch) -> bool:
        if not self.planned_only:
            return True
        planned = self.sampler.share(batch.round, batch.sender, self.fragmentation.k, self.members, self.rank)
        return all(f in planned for f in batch.fragments)

    def paired(self, other: np.ndarray, now: float) -> np.ndarray | None:
        """--exchange pairwise: a peer's whole model came: this node keeps the pair's average and returns it (for
        the peer to keep too); None once it is finished (the pair does not happen)."""
        outcome = Out.IGNORED if self.phases.finished else Out.NOTED
        self.phases.fire(In.PAIRED, outcome, self.rank)
        if outcome is Out.IGNORED:
            self.counts["ignored"] += 1
            return None
        average = pairwise_average(self.vector, other)
        self.vector, self._moved = average, True
        self.counts["averaged"] += 1
        return average

    def averaged(self, average: np.ndarray, now: float) -> None:
        """The peer this node asked kept the pair's average: so does this node (the training under way applies its
        change to it, `trained`)."""
        self.phases.fire(In.AVERAGED, Out.NOTED, self.rank)
        self.vector = average
        self._moved = not self.phases.finished
        self.counts["averaged"] += 1

"""n nodes' rounds in one process: the reference every deployment must match bit for bit.

Each node is a `NodeState`, fed the inputs a daemon feeds its own (registered, started, outgoing, sent, released,
finishing, finished), so that every node rule (its phase, whether a release leaves it out, its end) is the one the
daemon runs. The rounds themselves are computed here for all nodes at once: `RoundState`s exchanging bytes, or for
honest rounds `exchange.exchange_round`, which gives the same models and reports; each node's state is handed its
round's outcome (`NodeState(own_rounds=False)`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .attacks import Attack
from .barrier import BarrierState, Release
from .compression import Compressor
from .exchange import exchange_round
from .fragmentation import Fragmentation
from .node import NodeOutcome, NodeState
from .robust import Aggregator
from .round import RoundOutcome, RoundReport
from .sampling import PeerSampler
from .wire import WireError

_NONE_DELIVERED: Mapping[int, tuple[int, int]] = {}  # what a state that computes no round of its own hears
_NONE_JOINED: Mapping[int, str] = {}  # in memory, nobody joins a run
TrainFn = Callable[[int, int, np.ndarray], tuple[np.ndarray, float]]


def consensus_distance(vectors: np.ndarray | Sequence[np.ndarray]) -> float:
    """Mean over nodes of ||x_i - mean_j x_j|| (the spec's metric).

    Row by row, with the float64 operations of `norm(v - v.mean(axis=0), axis=1).mean()` over the stack in float64
    (the rows added in order, each row's squares summed pairwise: the same value to the bit), holding two float64
    rows instead of n (the barrier's final collection of a large model; bench/README.md, Speed 5)."""
    rows = list(vectors)
    if not rows:
        raise ValueError("consensus_distance of no vectors")
    mean = np.array(rows[0], dtype=np.float64)
    for row in rows[1:]:
        np.add(mean, row, out=mean, dtype=np.float64)
    np.divide(mean, len(rows), out=mean)
    gap = np.empty_like(mean)
    norms = np.empty(len(rows), dtype=np.float64)
    for i, row in enumerate(rows):
        np.subtract(row, mean, out=gap, dtype=np.float64)
        np.multiply(gap, gap, out=gap)
        norms[i] = np.sqrt(np.add.reduce(gap))
    return float(norms.mean())


def consensus_error(vectors: np.ndarray) -> float:
    """sum_i ||x_i - mean_j x_j||^2 (the quadratic analysis' quantity)."""
    v = np.asarray(vectors, dtype=np.float64)
    return float(((v - v.mean(axis=0)) ** 2).sum())


@dataclass
class RoundRecord:
    """One round: `losses` and `reports` of the members that took part (`nodes`), and the barrier's release."""

    round: int
    losses: list[float]
    reports: list[RoundReport]
    nodes: list[int]
    release: Release | None = None


def in_memory_address(node: int) -> str:
    """A node's address in memory, sorting as its rank does (`membership.address_key`: hosts by name, then ports):
    inmemory:1..65535, then inmemory-0001:1.. and on for runs of more nodes than a host has ports."""
    host, port = divmod(node, 65535)
    return f"inmemory:{port + 1}" if host == 0 else f"inmemory-{host:04d}:{port + 1}"


class InMemoryNetwork:
    """Runs rounds of train -> send -> barrier -> aggregate for nodes 0..n-1, all in this process.

    With a `BarrierState` the rounds go through the same barrier decisions as a deployed run, on a virtual
    clock: `step(absent={3})` makes node 3 miss the round (it neither trains, sends, receives nor arrives;
    messages to it are lost), so it straggles after `round_deadline` and is dropped as the barrier decides.

    `aggregator`: every node's rule (None: mean); `attacks`: node -> how that node lies (its round states get
    the model each round started from, as a daemon's do: none in round 0); `max_norm`: every node's --max-norm;
    `compressors`: node -> its codec and error feedback (--compress), kept across rounds as a daemon keeps its own.
    `nodes`: node -> its `NodeState`, which decides its phase each round as a daemon's does (a member the release
    leaves out is DROPPED by its own state, and is no member from then on).

    A round where every node keeps to the protocol and averages (no attack, no --max-norm, the mean rule) is
    exchanged as arrays (`exchange.exchange_round`): the same models and reports as messages, at a fraction of the
    cost at high K. `messages=True` passes every message through its bytes and a `RoundState`, as a daemon does.
    """

    def __init__(self, vectors: Sequence[np.ndarray], fragmentation: Fragmentation, sampler: PeerSampler,
                 train: TrainFn | None, run_id: str = "inmemory", barrier: BarrierState | None = None, *,
                 aggregator: Aggregator | None = None, attacks: Mapping[int, Attack] | None = None,
                 max_norm: float | None = None, messages: bool = False,
                 compressors: Mapping[int, Compressor] | None = None) -> None:
        self.aggregator, self.attacks, self.max_norm = aggregator, dict(attacks or {}), max_norm
        self.compressors = dict(compressors or {})
        compressed = any(c.compression.codec != "none" for c in self.compressors.values())
        self.batched = not (messages or self.attacks or max_norm is not None or compressed
                            or (aggregator is not None and not aggregator.rule.batchable))
        self.vectors = [np.ascontiguousarray(v, dtype=np.float32) for v in vectors]
        self.fragmentation, self.sampler, self.train, self.run_id = fragmentation, sampler, train, run_id
        self.round = 0
        self.clock = 0.0
        self.members = list(range(len(self.vectors)))
        self.barrier = barrier
        if barrier is not None:
            for i in self.members:
                barrier.register(in_memory_address(i), self.clock)
            barrier.close(self.clock)
        self.nodes = self._registered(self.members, 0)

    def _registered(self, members: Sequence[int], round: int) -> dict[int, NodeState]:
        """Every member's `NodeState`, registered at `round` and started: what a daemon's is once it knows the
        model. The network computes their rounds (`own_rounds=False`) and keeps their models: no snapshots."""
        live, nodes = tuple(members), {}
        for i in live:
            node = nodes[i] = NodeState(max_norm=self.max_norm, own_rounds=False, snapshots=0)
            node.registered(i, (), live, round, self.run_id, self.clock)
            node.start(self.fragmentation, self.sampler, self.vectors[i], aggregator=self.aggregator,
                       attack=self.attacks.get(i), compressor=self.compressors.get(i))
        return nodes

    def restore(self, vectors: Sequence[np.ndarray], round: int, clock: float, members: Sequence[int],
                barrier: BarrierState | None) -> None:
        """Go on from a saved point (`mosaicd simulate --resume`): the models, round, virtual clock and members
        after round `round - 1`, and the barrier's state then; the next `step` is round `round`, as it would have
        been without the stop, so the rest of the run is the same bit for bit."""
        if len(vectors) != len(self.vectors):
            raise ValueError(f"restore: {len(vectors)} models for a network of {len(self.vectors)} nodes")
        self.vectors = [np.ascontiguousarray(v, dtype=np.float32) for v in vectors]
        self.round, self.clock, self.members, self.barrier = round, clock, list(members), barrier
        self.nodes = self._registered(self.members, round)

    def step(self, absent: Collection[int] = (), arrivals: Mapping[int, float] | None = None) -> RoundRecord:
        """One round; `absent` members miss it. `arrivals`: when each present member arrives at the barrier on the
        virtual clock (a node profile's `VirtualClock`), else all arrive at once; the release is then at the last
        arrival, or at the round's deadline if someone is absent."""
        t, members = self.round, self.members
        absent = absent if isinstance(absent, set | frozenset) else set(absent)
        present = [i for i in members if i not in absent]
        if self.batched:
            return self._exchanged(t, present, arrivals)
        for i in members:  # each state hears it; what the node sends is its `RoundState`'s below
            node = self.nodes[i]
            node.outgoing(self.vectors[i], self.clock)
            node.sent(_NONE_DELIVERED, (), self.clock)
        states = {i: self.nodes[i].round_state() for i in present}  # each as its daemon would open it
        losses = []
        for i, state in states.items():
            local, loss = self.train(i, t, self.vectors[i]) if self.train else (self.vectors[i], float("nan"))
            losses.append(loss)
            for message in state.outgoing(local):
                if message.peer in states:
                    try:
                        states[message.peer].receive(message.payload)
                    except WireError:  # refused (--max-norm): counted by the receiver, unsent for the sender (a 4xx)
                        state.mark_unsent(message)
                else:
                    state.mark_unsent(message)
        release = self._barrier(t, present, arrivals)
        outcomes = {i: s.finish() for i, s in states.items()}
        self._released(release, {i: o.vector for i, o in outcomes.items()}, {i: o.report for i, o in outcomes.items()})
        return RoundRecord(t, losses, [o.report for o in outcomes.values()], present, release)

    def _exchanged(self, t: int, present: list[int], arrivals: Mapping[int, float] | None) -> RoundRecord:
        """`step` for a round of nodes that all keep to the protocol: trained one by one, exchanged as arrays."""
        losses, trained, nodes, now = [], {}, self.nodes, self.clock
        for i in self.members:  # the state sends nothing itself: the network computes every node's round below
            node = nodes[i]
            node.outgoing(self.vectors[i], now)
            node.sent(_NONE_DELIVERED, (), now)
        for i in present:
            trained[i], loss = self.train(i, t, self.vectors[i]) if self.train else (self.vectors[i], float("nan"))
            losses.append(loss)
        vectors, reports = exchange_round(t, self.members, trained, self.fragmentation, self.sampler, self.run_id)
        release = self._barrier(t, present, arrivals)
        self._released(release, vectors, reports)
        return RoundRecord(t, losses, [reports[i] for i in present], present, release)

    def _released(self, release: Release | None, vectors: Mapping[int, np.ndarray],
                  reports: Mapping[int, RoundReport]) -> None:
        """Every member's state hears the release with its round's outcome (`vectors`, `reports`: of the members
        that took part; one that missed the round aggregates nothing: it keeps its model) and decides: the next
        round's members are those it did not leave out (as a daemon's drop them)."""
        members = tuple(release.members) if release is not None else tuple(self.members)
        nodes, now, kept, missed = self.nodes, self.clock, [], RoundReport(self.round)
        aggregated = NodeOutcome.AGGREGATED
        stragglers = release.stragglers if release is not None else ()
        for i in self.members:
            vector = vectors.get(i)
            outcome = RoundOutcome(self.vectors[i], missed, ()) if vector is None else RoundOutcome(
                vector, reports[i], ())
            advance = nodes[i].released(members, _NONE_JOINED, stragglers, now, computed=outcome)
            self.vectors[i] = advance.vector
            if advance.outcome is aggregated:
                kept.append(i)
        self.members = kept
        self.round += 1

    def _barrier(self, round: int, present: list[int], arrivals: Mapping[int, float] | None = None) -> Release | None:
        """Every present member arrives (now, or at its time in `arrivals`, in time order); if some are missing, the
        clock runs to the round's deadline."""
        if self.barrier is None:
            return None
        release = None
        at = arrivals or {}
        for i in sorted(present, key=lambda i: (at.get(i, self.clock), i)):
            self.clock = max(self.clock, at.get(i, self.clock))
            release = self.barrier.arrive(i, round, self.clock) or release
        if release is None:
            self.clock = self.barrier.deadline if self.barrier.deadline is not None else self.clock
            release = self.barrier.tick(self.clock)
        assert release is not None, "a round with no arrival cannot be released"
        return release

    def finish(self) -> Release | None:
        """The members arrive at round `rounds` (done with the run): the barrier's final release."""
        for i in self.members:
            self.nodes[i].finishing()
        release = self._barrier(self.round, self.members) if self.barrier is not None else None
        for i in self.members:
            self.nodes[i].finished()
        return release

    def run(self, rounds: int, on_round: Callable[[RoundRecord], None] | None = None) -> list[RoundRecord]:
        records = []
        for _ in range(rounds):
            record = self.step()
            records.append(record)
            if on_round:
                on_round(record)
        return records

    def matrix(self) -> np.ndarray:
        return np.stack(self.vectors)

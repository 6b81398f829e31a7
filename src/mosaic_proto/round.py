"""`RoundState`: one node's view of one gossip round, with no I/O.

The daemon (or the in-memory network) feeds it bytes and gets bytes and decisions back:

    state = RoundState(node=3, round=t, members=[...], fragmentation=C, sampler=S, run_id="r")
    state.receive(data)                 # any time during the round: accept, buffer (later round) or WireError
    for msg in state.outgoing(x_half):  # after local training: one message per receiving peer
        send(msg.peer, msg.payload)     # or msg.body.parts, written one after the other (no copy)
    outcome = state.finish()            # after the barrier: new vector, report, and the buffered messages
    next_state = RoundState(..., round=t + 1, early=outcome.early)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from .attacks import Attack
from .compression import Compressed, Compression, Compressor
from .fragmentation import Fragmentation
from .robust import Aggregator
from .sampling import PeerSampler
from .wire import DEFAULT_MAX_BYTES, FragmentBatch, Reason, WireError, decode, encode_parts

DEFAULT_WINDOW = 2


class Receipt(StrEnum):
    ACCEPTED = "accepted"
    BUFFERED = "buffered"


class Payload:
    """One encoded message as `wire.encode_parts` gives it: its framing and views of the fragments' values, which a
    transport writes one after the other (no copy of the values); `joined` is its bytes in one buffer, made once
    and only when asked for. Peers sent the same fragments share one."""

    __slots__ = ("parts", "nbytes", "_joined")

    def __init__(self, parts: Iterable[bytes | memoryview]) -> None:
        self.parts = tuple(parts)
        self.nbytes = sum(memoryview(part).nbytes for part in self.parts)
        self._joined: bytes | None = None

    def __len__(self) -> int:
        return self.nbytes

    def joined(self) -> bytes:
        if self._joined is None:
            self._joined = b"".join(self.parts)
        return self._joined


@dataclass(frozen=True)
class OutgoingMessage:
    peer: int
    fragments: tuple[int, ...]
    body: Payload
    raw_bytes: int = 0  # the fragments' float32 bytes before compression (4 per coordinate)

    @property
    def payload(self) -> bytes:
        """The message's bytes, as `wire.encode` writes them (joined once per `Payload`)."""
        return self.body.joined()

    @property
    def nbytes(self) -> int:
        return self.body.nbytes


@dataclass(frozen=True)
class EarlyMessage:
    """A message for a later round, kept until that round's state exists."""

    batch: FragmentBatch
    nbytes: int


@dataclass(kw_only=True)
class Traffic:
    """One round's fragment messages as one node counts them: sent (those its peers took), given up on, and accepted.
    A `RoundReport` counts them as the round goes; a `NodeReport` carries them to the barrier."""

    messages_out: int = 0
    fragments_out: int = 0
    bytes_out: int = 0
    messages_in: int = 0
    fragments_in: int = 0
    bytes_in: int = 0
    fragments_unsent: int = 0
    raw_bytes_out: int = 0  # the float32 bytes of the fragments sent, before compression (4 per coordinate)

    def counts(self) -> Traffic:
        """These counts alone, as a `Traffic` of their own (of a `RoundReport`: without its round and refusals)."""
        return Traffic(**{name: getattr(self, name) for name in TRAFFIC})

    def traffic_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TRAFFIC}

    def accepted(self, fragments: int, nbytes: int) -> None:
        self.messages_in += 1
        self.fragments_in += fragments
        self.bytes_in += nbytes

    def sending(self, messages: Sequence[OutgoingMessage]) -> None:
        self.messages_out = len(messages)
        self.fragments_out = sum(len(m.fragments) for m in messages)
        self.bytes_out = sum(m.nbytes for m in messages)
        self.raw_bytes_out = sum(m.raw_bytes for m in messages)

    def unsent(self, message: OutgoingMessage) -> None:
        """The transport gave up on `message`: it counts as unsent, not sent."""
        self.messages_out -= 1
        self.fragments_out -= len(message.fragments)
        self.bytes_out -= message.nbytes
        self.raw_bytes_out -= message.raw_bytes
        self.fragments_unsent += len(message.fragments)


TRAFFIC = tuple(f.name for f in fields(Traffic))  # the counts' names, in the order reports write them


@dataclass
class RoundReport(Traffic):
    round: int
    refused: Counter = field(default_factory=Counter)
    cut: Counter = field(default_factory=Counter)  # received fragments the aggregator's rule clipped or trimmed

    def to_json(self) -> dict:
        """The report as JSON; `refused` holds both kinds of refusal by reason: messages refused (wire reasons,
        out_of_range for --max-norm) and received fragments cut by the aggregator's rule (clipped, trimmed)."""
        return {"round": self.round, **self.traffic_json(), "refused": dict(self.refused + self.cut)}


class RoundOutcome(NamedTuple):
    """A finished round: the aggregated model, the round's counts, the next round's messages that came early."""

    vector: np.ndarray
    report: RoundReport
    early: tuple[EarlyMessage, ...]


def decoded(state: RoundState, data: bytes | bytearray | memoryview) -> FragmentBatch | WireError:
    """The message in `data` for `state`'s run, or why it is refused: the part of `RoundState.receive` that changes
    nothing and reads only the run's constants (fragmentation, id, byte limit), so a daemon may run it in a worker
    thread and give the result to `take` on its event loop."""
    try:
        return decode(data, state.fragmentation, run_id=state.run_id, max_bytes=state.max_bytes,
                      compression=state.compression)
    except WireError as exc:
        return exc


def fragment_norms(fragments: Sequence[np.ndarray]) -> list[float]:
    """Each fragment's L2 norm (in float64): what --max-norm measures a received fragment against."""
    return [float(np.linalg.norm(f.astype(np.float64))) for f in fragments]


def over_norm(sender: int, fragments: Mapping[int, np.ndarray | Compressed], own_norms: Sequence[float],
              max_norm: float) -> WireError | None:
    """--max-norm, the one check a barrier round and an asynchronous node make: why a message is refused where one
    of its fragments has an L2 norm over max_norm times the receiver's own fragment's (`own_norms`), else None. A
    sparse fragment's norm is that of the values it carries."""
    for f, part in fragments.items():
        values = part.values if isinstance(part, Compressed) else part
        limit = max_norm * max(own_norms[f], 1e-6)
        norm = float(np.linalg.norm(values.astype(np.float64)))
        if norm > limit:
            return WireError(Reason.OUT_OF_RANGE, f"sender {sender}'s fragment {f} has norm {norm:.3g}, more than "
                             f"max_norm {max_norm:g} x this node's own ({own_norms[f]:.3g})")
    return None


class RoundState:
    def __init__(self, *, node: int, round: int, members: Sequence[int], fragmentation: Fragmentation,
                 sampler: PeerSampler, run_id: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 window: int = DEFAULT_WINDOW, early: Iterable[EarlyMessage] = (), planned_only: bool = False,
                 max_norm: float | None = None, aggregator: Aggregator | None = None, attack: Attack | None = None,
                 start: np.ndarray | None = None, on_refused: Callable[[str, int], None] | None = None,
                 compressor: Compressor | None = None) -> None:
        """`planned_only`: accept only the fragments the sampler's plan has the sender send to this node (every
        node can recompute the plan), so nobody can slip in fragments that were not its to send.
        `max_norm`: refuse a fragment whose L2 norm exceeds max_norm times this node's own fragment's (a guard
        against faults such as diverged or corrupted models, not a Byzantine-robust aggregator).
        `aggregator`: the rule `finish` aggregates with (None: mean, `aggregation.aggregate`).
        `attack`: this node lies: `outgoing` sends crafted fragments (`attacks.py`); `start` is the model the
        round started from, which ALIE crafts from.
        `on_refused(reason, count)`: told of what this state refuses on its own, not through an exception to the
        caller: a message refused by --max-norm once this node's own norms are known (`outgoing`), and the
        received fragments the aggregator's rule cut (`finish`), so that a daemon can count them.
        `compressor`: the node's codec and error feedback (None: --compress none), kept by the node across rounds;
        received messages must be of its codec."""
        self.node, self.round, self.run_id = node, round, run_id
        self.members = tuple(sorted(set(members)))
        if node not in self.members:
            raise ValueError(f"node {node} is not among the members {self.members}")
        self.fragmentation, self.sampler = fragmentation, sampler
        self.max_bytes, self.window, self.planned_only, self.max_norm = max_bytes, window, planned_only, max_norm
        self._own_norms: list[float] | None = None
        self.aggregator, self.attack, self._start, self._on_refused = aggregator, attack, start, on_refused
        self.compressor = compressor
        self.compression = compressor.compression if compressor is not None else Compression()
        self.report = RoundReport(round)
        self._received: dict[int, dict[int, np.ndarray]] = {}
        self._early: dict[tuple[int, int], EarlyMessage] = {}
        self._local: np.ndarray | None = None
        self._own_fragments: list[np.ndarray] | None = None
        self._finished = False
        for message in early:
            try:
                self._accept(message.batch, message.nbytes)
            except WireError as exc:
                self.report.refused[exc.reason.value] += 1

    @property
    def finished(self) -> bool:
        return self._finished

    def receive(self, data: bytes | bytearray | memoryview, sender: int | None = None) -> Receipt:
        """Take one message. Raises WireError, leaving the state as it was, when the message is refused.

        `sender`: the member the transport authenticated (a signed request, a client certificate); the
        message must name the same one."""
        return self.take(decoded(self, data), len(data), sender)

    def take(self, batch: FragmentBatch | WireError, nbytes: int, sender: int | None = None) -> Receipt:
        """The rest of `receive`, after `decoded`: a message of `nbytes` bytes checked against this round and kept,
        or the WireError `decoded` gave (counted, raised)."""
        try:
            if isinstance(batch, WireError):
                raise batch
            if sender is not None and batch.sender != sender:
                raise WireError(Reason.SENDER_MISMATCH, f"the message says sender {batch.sender}, its transport "
                                f"proved sender {sender}")
            return self._accept(batch, nbytes)
        except WireError as exc:
            self.report.refused[exc.reason.value] += 1
            raise

    def _accept(self, batch: FragmentBatch, nbytes: int) -> Receipt:
        if batch.sender not in self.members or batch.sender == self.node:
            raise WireError(Reason.UNKNOWN_SENDER, f"sender {batch.sender} is not a member of round {self.round}")
        if batch.round < self.round or (batch.round == self.round and self._finished):
            raise WireError(Reason.STALE_ROUND, f"round {batch.round} is already aggregated (now {self.round})")
        if batch.round > self.round + self.window:
            raise WireError(Reason.FUTURE_ROUND,
                            f"round {batch.round} is more than {self.window} ahead of {self.round}")
        if batch.round > self.round and self._finished:
            # finish() has already handed the buffered messages on: keeping this one would silently lose it.
            raise WireError(Reason.ROUND_CLOSED, f"round {self.round} is finished: give round {batch.round}'s "
                            "message to the next round's state")
        if batch.round > self.round:
            key = (batch.round, batch.sender)
            if key in self._early:
                raise WireError(Reason.DUPLICATE_FRAGMENT, f"sender {batch.sender} already sent round {batch.round}")
            self._early[key] = EarlyMessage(batch, nbytes)
            return Receipt.BUFFERED
        planned = self.sampler.share(self.round, batch.sender, self.fragmentation.k, self.members, self.node) \
            if self.planned_only else batch.fragments
        if unplanned := sorted(f for f in batch.fragments if f not in planned):
            raise WireError(Reason.UNPLANNED_FRAGMENT, f"sender {batch.sender} does not send fragments {unplanned} "
                            f"to node {self.node} in round {self.round} (planned: {list(planned)})")
        if self._own_norms is not None:
            self._check_norms(batch.sender, batch.fragments)
        have = self._received.get(batch.sender)
        if have is None:
            self._received[batch.sender] = dict(batch.fragments)
        elif dup := sorted(f for f in batch.fragments if f in have):
            raise WireError(Reason.DUPLICATE_FRAGMENT, f"sender {batch.sender} already sent fragments {dup}")
        else:
            have.update(batch.fragments)
        self.report.accepted(len(batch.fragments), nbytes)
        return Receipt.ACCEPTED

    def plan(self) -> dict[int, list[int]]:
        """peer -> the fragments this node sends it this round."""
        return self.sampler.plan(self.round, self.node, self.fragmentation.k, self.members)

    def outgoing(self, local: np.ndarray) -> list[OutgoingMessage]:
        """Record the locally trained vector and encode this round's messages, one per receiving peer."""
        local = np.ascontiguousarray(local, dtype=np.float32)
        fragments = self.fragmentation.views(local)  # a contiguous fragment is encoded from `local` directly
        self._local, self._own_fragments = local, fragments  # finish() sums from these: no second gather
        if self.max_norm is not None:
            self._own_norms = fragment_norms(fragments)
            for sender in sorted(self._received):  # what came in while this node was still training
                try:
                    self._check_norms(sender, self._received[sender])
                except WireError as exc:
                    del self._received[sender]
                    self._refuse(exc.reason.value, 1)
        sent: list = fragments if self.attack is None else self._crafted(fragments)
        codec = self.compression.codec
        if self.compressor is not None and codec != "none":  # once per fragment: every receiver gets the same bytes
            sent = [self.compressor.compress(values, round=self.round, fragment=f) for f, values in enumerate(sent)]
        sizes = self.fragmentation.sizes
        messages, payloads = [], {}  # a message names no receiver: peers sent the same fragments share its bytes
        for peer, frags in self.sampler.planned(self.round, self.node, self.fragmentation.k, self.members).items():
            payload = payloads.get(frags)
            if payload is None:
                payload = payloads[frags] = Payload(encode_parts(FragmentBatch(
                    self.run_id, self.round, self.node, self.fragmentation.k, self.fragmentation.fingerprint,
                    {f: sent[f] for f in frags}, codec)))
            messages.append(OutgoingMessage(peer, tuple(frags), payload, 4 * sum(sizes[f] for f in frags)))
        self.report.sending(messages)
        return messages

    def _crafted(self, fragments: list[np.ndarray]) -> list[np.ndarray]:
        """What an attacker sends instead of its fragments (the same crafted values to every receiver)."""
        assert self.attack is not None
        start = None if self._start is None else self.fragmentation.views(
            np.ascontiguousarray(self._start, dtype=np.float32))
        return [self.attack.craft(self.round, f, values, None if start is None else start[f])
                for f, values in enumerate(fragments)]

    def _refuse(self, reason: str, count: int) -> None:
        self.report.refused[reason] += count
        if self._on_refused is not None:
            self._on_refused(reason, count)

    def _check_norms(self, sender: int, fragments: dict[int, np.ndarray | Compressed]) -> None:
        assert self._own_norms is not None and self.max_norm is not None
        if (refused := over_norm(sender, fragments, self._own_norms, self.max_norm)) is not None:
            raise refused

    def mark_unsent(self, message: OutgoingMessage) -> None:
        """The transport gave up on a message: keep the report honest."""
        self.report.unsent(message)

    def finish(self) -> RoundOutcome:
        """Aggregate what arrived (call after the barrier) and hand on messages for later rounds."""
        if self._local is None:
            raise RuntimeError("finish() before outgoing(): the round has no local vector")
        if self._finished:
            raise RuntimeError(f"round {self.round} is already finished")
        self._finished = True
        rule = self.aggregator or Aggregator()
        stand_in = None if self.compressor is None else self.compressor.stand_in(self._local)
        vector, cut = rule.aggregate(self._local, self.fragmentation, self._received, own_fragments=self._own_fragments,
                                     stand_in=stand_in)
        if stand_in is not None:
            self.compressor.heard(self.fragmentation.indices, self._received)
        for reason, count in sorted(cut.items()):
            self.report.cut[reason] += count
            if self._on_refused is not None:
                self._on_refused(reason, count)
        self._own_fragments = None
        early = tuple(m for _, m in sorted(self._early.items()))
        return RoundOutcome(vector, self.report, early)

"""Who receives each fragment: EL-Local, EL-Oracle and the static D-PSGD graph."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from .keyed_choice import keyed_table
from .rng import NONE, Purpose, key_parts, keyed_picks, keyed_rng


class SamplerKind(StrEnum):
    LOCAL = "local"
    ORACLE = "oracle"
    STATIC = "static"


class SamplingError(ValueError):
    """The requested fan-out cannot be met by the membership."""


def regular_digraph(members: Sequence[int], s: int, rng: np.random.Generator) -> dict[int, tuple[int, ...]]:
    """A random s-regular digraph (in- and out-degree s, no self loops, no repeated edges).

    A circulant graph over a random ordering of the members: position p sends to p+1..p+s. Equal in- and
    out-degree make uniform averaging doubly stochastic, so gossip over it preserves the network mean.
    """
    n = len(members)
    order = [members[i] for i in rng.permutation(n)]
    return {order[p]: tuple(sorted(order[(p + j) % n] for j in range(1, s + 1))) for p in range(n)}


PLAN_ROUNDS = 4
"""Rounds of plans a sampler keeps: the round in flight and the messages buffered for the next ones."""

PlanKey = tuple[int, int, tuple[int, ...]]  # (node, k, sorted members)
Plan = Mapping[int, tuple[int, ...]]


@dataclass(frozen=True)
class PeerSampler:
    """Every plan is a function of (seed, round, node, k, members) only, so a sampler keeps the plans it drew
    for the last `PLAN_ROUNDS` rounds: a receiver checks each message against its sender's plan, and drawing
    one keyed generator per fragment again per message made high K cost K times low K."""

    kind: SamplerKind
    fanout: int
    seed: int
    _plans: dict[int, dict[PlanKey, Plan]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _static: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SamplerKind(self.kind))
        if self.fanout < 1:
            raise SamplingError(f"fanout s must be >= 1, got {self.fanout}")

    def receivers(self, round: int, node: int, fragment: int, members: Sequence[int]) -> tuple[int, ...]:
        """The sorted receivers of `fragment` from `node` in `round`; `members` is sorted and holds `node`."""
        others = self._others(node, members)
        if self.kind is SamplerKind.LOCAL:
            picks = keyed_picks(self.seed, Purpose.SAMPLING, round, node, [fragment], len(others), self.fanout)[0]
            return tuple(sorted(others[i] for i in picks))
        graph_round, graph_fragment = (round, fragment) if self.kind is SamplerKind.ORACLE else (NONE, NONE)
        return self._graph(graph_round, graph_fragment, tuple(members))[node]

    def _others(self, node: int, members: Sequence[int]) -> list[int]:
        others = [m for m in members if m != node]
        if len(others) == len(members):
            raise SamplingError(f"node {node} is not among the members")
        if self.fanout > len(others):
            raise SamplingError(
                f"fanout s={self.fanout} needs more than the {len(others)} other members of a {len(members)}-node run"
            )
        return others

    def _graph(self, round: int, fragment: int, members: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        """The graph of (round, fragment), drawn once per round for all senders' plans (see `_kept`)."""
        def draw() -> dict[int, tuple[int, ...]]:
            return regular_digraph(members, self.fanout, keyed_rng(self.seed, Purpose.GRAPH, round, NONE, fragment))

        if round == NONE:  # the static graph: one for the whole run (per membership)
            if len(self._static) > 8:
                self._static.clear()
            return self._static.get(members) or self._static.setdefault(members, draw())
        key = (-2 - fragment, -1, members)  # apart from the plans' keys, whose node is >= 0
        return self._kept(round, key, draw)  # type: ignore[return-value]

    def plan(self, round: int, node: int, k: int, members: Sequence[int]) -> dict[int, list[int]]:
        """peer -> ascending fragment indices that `node` sends it in `round` (one message per peer)."""
        return {peer: list(frags) for peer, frags in self.planned(round, node, k, members).items()}

    def share(self, round: int, node: int, k: int, members: Sequence[int], receiver: int) -> tuple[int, ...]:
        """The ascending fragments `node` sends `receiver` in `round` (empty if none): what a receiver checks a
        message against, from the sender's plan drawn once per (round, sender)."""
        return self.planned(round, node, k, members).get(receiver, ())

    def planned(self, round: int, node: int, k: int, members: Sequence[int]) -> Plan:
        """`plan` as a shared, read-only mapping, drawn once and kept for `PLAN_ROUNDS` rounds."""
        key = (node, k, members if isinstance(members, tuple) else tuple(members))
        return self._kept(round, key, lambda: self._draw_plan(round, node, k, sorted(key[2])))

    def table(self, round: int, nodes: Sequence[int], k: int, members: Sequence[int]) -> np.ndarray:
        """receivers[i, f] = the `fanout` receivers of fragment f from nodes[i] in `round` (an int64 array of shape
        (len(nodes), k, fanout), each row in no particular order): every plan of a round at once, for
        `exchange.exchange_round`; the same receivers as `receivers`."""
        members = sorted(members)
        nodes = list(nodes)
        if self.kind is SamplerKind.LOCAL:
            ranks = np.asarray(members, dtype=np.int64)
            position = np.searchsorted(ranks, nodes)
            absent = [n for n, p in zip(nodes, position, strict=True) if p >= len(ranks) or ranks[p] != n]
            for node in absent[:1] + ([nodes[0]] if nodes and self.fanout > len(members) - 1 else []):
                self._others(node, members)  # raises the error it words (checked for all nodes at once: O(n))
            picks = keyed_table([key_parts(self.seed, Purpose.SAMPLING, round, node)[:-1] for node in nodes], k,
                                len(members) - 1, self.fanout)
            return ranks[picks + (picks >= position[:, None, None])]
        out = np.empty((len(nodes), k, self.fanout), dtype=np.int64)
        for f in range(k):
            for i, node in enumerate(nodes):
                out[i, f] = self.receivers(round, node, f, members)
        return out

    def _kept(self, round: int, key: PlanKey, draw: Callable[[], Plan]) -> Plan:
        """What `draw` returns for (round, key), drawn once while `round` is among the last PLAN_ROUNDS rounds.

        Safe without a lock: at worst two threads draw the same (deterministic) value and one is kept."""
        per_round = self._plans.get(round)
        if per_round is not None and (hit := per_round.get(key)) is not None:
            return hit
        value = draw()
        newest = max(list(self._plans), default=round)
        if round > newest - PLAN_ROUNDS:  # an old round (a late caller) is drawn again rather than kept
            self._plans.setdefault(round, {})[key] = value
            for old in [r for r in list(self._plans) if r <= max(newest, round) - PLAN_ROUNDS]:
                self._plans.pop(old, None)
        return value

    def _draw_plan(self, round: int, node: int, k: int, members: list[int]) -> Plan:
        if self.kind is SamplerKind.STATIC:
            frags = tuple(range(k))
            return {peer: frags for peer in self.receivers(round, node, 0, members)}
        out: dict[int, list[int]] = {}
        if self.kind is SamplerKind.LOCAL:  # `receivers` inlined: `others` once, not once per fragment
            others = self._others(node, members)
            for f, picks in enumerate(keyed_picks(self.seed, Purpose.SAMPLING, round, node, range(k), len(others),
                                                  self.fanout)):
                for i in picks:
                    out.setdefault(others[i], []).append(f)
        else:
            for f in range(k):
                for peer in self.receivers(round, node, f, members):
                    out.setdefault(peer, []).append(f)
        return {peer: tuple(out[peer]) for peer in sorted(out)}

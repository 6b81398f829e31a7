"""Who receives each fragment: EL-Local, EL-Oracle and the static D-PSGD graph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .rng import NONE, Purpose, keyed_rng


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


@dataclass(frozen=True)
class PeerSampler:
    kind: SamplerKind
    fanout: int
    seed: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SamplerKind(self.kind))
        if self.fanout < 1:
            raise SamplingError(f"fanout s must be >= 1, got {self.fanout}")

    def receivers(self, round: int, node: int, fragment: int, members: Sequence[int]) -> tuple[int, ...]:
        """The sorted receivers of `fragment` from `node` in `round`; `members` is sorted and holds `node`."""
        others = [m for m in members if m != node]
        if len(others) == len(members):
            raise SamplingError(f"node {node} is not among the members")
        if self.fanout > len(others):
            raise SamplingError(
                f"fanout s={self.fanout} needs more than the {len(others)} other members of a {len(members)}-node run"
            )
        if self.kind is SamplerKind.LOCAL:
            picks = keyed_rng(self.seed, Purpose.SAMPLING, round, node, fragment).choice(
                len(others), size=self.fanout, replace=False
            )
            return tuple(sorted(others[i] for i in picks))
        graph_round, graph_fragment = (round, fragment) if self.kind is SamplerKind.ORACLE else (NONE, NONE)
        return self._graph(graph_round, graph_fragment, tuple(members))[node]

    def _graph(self, round: int, fragment: int, members: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        rng = keyed_rng(self.seed, Purpose.GRAPH, round, NONE, fragment)
        return regular_digraph(members, self.fanout, rng)

    def plan(self, round: int, node: int, k: int, members: Sequence[int]) -> dict[int, list[int]]:
        """peer -> ascending fragment indices that `node` sends it in `round` (one message per peer)."""
        members = sorted(members)
        out: dict[int, list[int]] = {}
        if self.kind is SamplerKind.STATIC:
            return {peer: list(range(k)) for peer in self.receivers(round, node, 0, members)}
        for f in range(k):
            for peer in self.receivers(round, node, f, members):
                out.setdefault(peer, []).append(f)
        return dict(sorted(out.items()))

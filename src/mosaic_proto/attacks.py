"""Members that lie, as an experiment setting: which ranks attack, and the fragments they craft.

An attacker trains and aggregates like any node (its own model stays honest); only the fragments it sends are
crafted, from what it has: its trained fragment x = x_{t+1/2}[C==k] and, for ALIE, the model it started the
round from, s = x_t[C==k]. The crafted values are then encoded, planned and signed like any other fragment, so
they pass every check but the aggregator's. Attacks (`scale` is `attack_scale`, default per attack):

- `sign-flip`: -scale * x (default 1).
- `scale`: scale * x (default 10).
- `noise`: x + scale * rms(x) * N(0, 1) per coordinate (default 1), from the generator keyed by
  (seed, ATTACK, round, node, fragment).
- `alie` ("A little is enough", Baruch, Baruch and Goldberg 2019): the paper sends mu - z * sigma, the honest
  mean minus z standard deviations per coordinate, with z from the count of nodes and attackers. A node that
  knows only its own model takes mu = x and sigma = |x - s| (its own update this round, a stand-in for the spread of
  honest updates), moving against its update: x - z * (x - s). z defaults to the paper's z_max:
  Phi^-1((n - h) / n) with h = floor(n / 2 + 1) - f (0.157 for n = 16, f = 2: "a little"). Without s (the
  first round, where no node has aggregated yet) it sends x unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist

import numpy as np

from .rng import Purpose, keyed_rng


class AttackKind(StrEnum):
    SIGN_FLIP = "sign-flip"
    SCALE = "scale"
    NOISE = "noise"
    ALIE = "alie"


DEFAULT_SCALE = {AttackKind.SIGN_FLIP: 1.0, AttackKind.SCALE: 10.0, AttackKind.NOISE: 1.0}


def byzantine_ranks(seed: int, nodes: int, count: int) -> tuple[int, ...]:
    """The `count` attacking ranks of a run, drawn from its seed (sorted); every node computes the same."""
    if not 0 <= count <= nodes:
        raise ValueError(f"byzantine must be between 0 and nodes ({nodes}), got {count}")
    if count == 0:
        return ()
    chosen = keyed_rng(seed, Purpose.BYZANTINE).choice(nodes, size=count, replace=False)
    return tuple(sorted(int(r) for r in chosen))


def alie_z(nodes: int, byzantine: int) -> float:
    """Baruch et al.'s z_max for n nodes of which f attack: Phi^-1((n - h) / n), h = floor(n/2 + 1) - f."""
    h = nodes // 2 + 1 - byzantine
    share = (nodes - h) / nodes
    return NormalDist().inv_cdf(min(max(share, 1e-9), 1 - 1e-9)) if 0 < share < 1 else 0.0


@dataclass(frozen=True)
class Attack:
    """How one attacking node crafts the fragments it sends."""

    kind: AttackKind
    seed: int
    node: int
    scale: float

    @classmethod
    def of(cls, kind: AttackKind | str, seed: int, node: int, nodes: int, byzantine: int,
           scale: float | None = None) -> Attack:
        """The attack with the run's scale, or the kind's default (for ALIE, z_max of n and f)."""
        kind = AttackKind(kind)
        if scale is None:
            scale = alie_z(nodes, byzantine) if kind is AttackKind.ALIE else DEFAULT_SCALE[kind]
        return cls(kind, seed, node, float(scale))

    def craft(self, round: int, fragment: int, values: np.ndarray, start: np.ndarray | None) -> np.ndarray:
        """The float32 values sent instead of `values` (fragment `fragment` of this node's trained model);
        `start`: the same fragment of the model the round started from (ALIE), None if there is none."""
        x = np.asarray(values, dtype=np.float64)
        if self.kind is AttackKind.SIGN_FLIP:
            out = -self.scale * x
        elif self.kind is AttackKind.SCALE:
            out = self.scale * x
        elif self.kind is AttackKind.NOISE:
            rms = float(np.sqrt(np.mean(x * x))) if x.size else 0.0
            noise = keyed_rng(self.seed, Purpose.ATTACK, round, self.node, fragment).standard_normal(x.size)
            out = x + self.scale * rms * noise
        elif start is None:
            out = x
        else:
            out = x - self.scale * (x - np.asarray(start, dtype=np.float64))
        # stay finite in float32, so that the message is validly formed (the wire refuses non-finite values)
        limit = float(np.finfo(np.float32).max)
        return np.clip(out, -limit, limit).astype(np.float32)

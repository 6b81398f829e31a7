"""Every random choice of a run comes from a generator keyed by (seed, purpose, round, node, fragment).

Keying (instead of drawing from one shared stream) is what makes a run reproducible whether the nodes
live in one process or on many hosts: nobody has to replay anybody else's draws.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

import numpy as np

from .keyed_choice import keyed_choices, keyed_raw

NONE = -1


class Purpose(IntEnum):
    """Separates the streams of different uses of the same (round, node, fragment) key."""

    FRAGMENTATION = 1
    SAMPLING = 2
    GRAPH = 3
    INIT = 4
    TRAIN = 5
    DATA = 6
    BYZANTINE = 7
    ATTACK = 8
    COMPRESSION = 9
    PROFILE = 10


def key_parts(seed: int, purpose: Purpose, round: int = NONE, node: int = NONE, fragment: int = NONE) -> list[int]:
    """The SeedSequence entropy of a key: [seed, purpose, round + 1, node + 1, fragment + 1], all >= 0."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    key = [int(seed), int(purpose), int(round) + 1, int(node) + 1, int(fragment) + 1]
    if min(key) < 0:
        raise ValueError(f"key parts must be >= -1, got round={round} node={node} fragment={fragment}")
    return key


def keyed_rng(seed: int, purpose: Purpose, round: int = NONE, node: int = NONE,
              fragment: int = NONE) -> np.random.Generator:
    """A fresh PCG64 generator for one key; NONE (-1) marks a key part that does not apply."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(key_parts(seed, purpose, round, node, fragment))))


def keyed_picks(seed: int, purpose: Purpose, round: int, node: int, fragments: Iterable[int], population: int,
                size: int) -> list[frozenset[int]]:
    """For each f in `fragments`, the set `keyed_rng(seed, purpose, round, node, f).choice(population, size,
    replace=False)` draws, at a fraction of the cost (`keyed_choice`)."""
    fragments = list(fragments)
    if min(fragments, default=0) < 0:
        raise ValueError(f"fragments must be >= 0, got {min(fragments)}")
    return keyed_choices(key_parts(seed, purpose, round, node)[:-1], fragments, population, size)


def keyed_raws(seed: int, purpose: Purpose, round: int, nodes: Iterable[int]) -> np.ndarray:
    """raws[i] = `keyed_rng(seed, purpose, round, nodes[i]).bit_generator.random_raw()` (uint64), every node's at
    once: what a round's per-node generators draw first, without building one generator per node."""
    nodes = np.fromiter(nodes, dtype=np.int64)
    if len(nodes) and nodes.min() < NONE:
        raise ValueError(f"key parts must be >= -1, got node={nodes.min()}")
    return keyed_raw(key_parts(seed, purpose, round)[:-2], nodes + 1, NONE + 1)

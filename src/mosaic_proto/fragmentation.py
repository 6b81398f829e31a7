"""The coordinate-to-fragment map C: [0, d) -> [0, K), identical on every node of a run."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

import numpy as np

from .rng import Purpose, keyed_rng


class Strategy(StrEnum):
    RANDOM = "random"
    CONTIGUOUS = "contiguous"


@dataclass(frozen=True)
class Layout:
    """The model's flat vector: ordered tensor names and shapes (float tensors only)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError("layout needs one shape per name")
        if len(set(self.names)) != len(self.names):
            raise ValueError("layout tensor names must be unique")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if any(int(s) < 0 for s in shape):
                raise ValueError(f"tensor {name!r} has a negative dimension: {shape}")

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, Sequence[int]]]) -> Layout:
        return cls(tuple(n for n, _ in pairs), tuple(tuple(int(s) for s in shape) for _, shape in pairs))

    @classmethod
    def flat(cls, d: int, name: str = "x") -> Layout:
        return cls((name,), ((int(d),),))

    @cached_property  # asked for with every message received (its size limit): not np.prod per tensor each time
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.concatenate([[0], np.cumsum(self.sizes)]))

    @cached_property
    def dim(self) -> int:
        return sum(self.sizes)

    def to_json(self) -> list[list]:
        return [[n, list(s)] for n, s in zip(self.names, self.shapes, strict=True)]

    @classmethod
    def from_json(cls, data: list) -> Layout:
        return cls.from_pairs([(str(n), tuple(int(x) for x in s)) for n, s in data])

    def digest(self) -> bytes:
        return hashlib.sha256(repr(self.to_json()).encode()).digest()


# Coordinates `unpack` gathers at a time: their positions, widened to intp by np.take (512 KiB), stay in the cache.
UNPACK_BLOCK = 1 << 16
# A model of at least this many coordinates gathers its random fragments in one pass (`views`, `aggregate`); below,
# K small gathers cost less than building `order` and `positions` once.
PACK_FROM = 1 << 16


def _deal(n: int, k: int) -> np.ndarray:
    """Part index of each of n positions dealt into k near-equal contiguous parts (sizes differ by <= 1)."""
    return (np.arange(n, dtype=np.int64) * k // max(n, 1)).astype(np.int32) if n else np.zeros(0, np.int32)


def _assignment(layout: Layout, k: int, seed: int, strategy: Strategy) -> np.ndarray:
    """C as one int32 per coordinate (read-only). At K=1 every coordinate is fragment 0 whatever the permutations,
    so none is drawn."""
    d = layout.dim
    if strategy is Strategy.CONTIGUOUS or k == 1:
        assignment = _deal(d, k)
    else:
        assignment = np.empty(d, dtype=np.int32)
        for t, (lo, size) in enumerate(zip(layout.offsets[:-1], layout.sizes, strict=True)):
            perm = keyed_rng(seed, Purpose.FRAGMENTATION, node=t).permutation(size)
            assignment[lo + perm] = _deal(size, k)
    assignment.flags.writeable = False
    return assignment


def _indices(assignment: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Each fragment's coordinates, ascending (read-only int64 slices of one array laid out fragment after
    fragment)."""
    order = np.argsort(assignment, kind="stable")
    counts = np.bincount(assignment, minlength=k)
    indices = tuple(np.split(order.astype(np.int64), np.cumsum(counts)[:-1]))
    for ix in indices:
        ix.flags.writeable = False
    return indices


def _spans(indices: Sequence[np.ndarray]) -> tuple[tuple[int, int] | None, ...]:
    out: list[tuple[int, int] | None] = []
    for ix in indices:
        if len(ix) == 0:
            out.append((0, 0))
        elif int(ix[-1]) - int(ix[0]) == len(ix) - 1:  # indices are strictly increasing: no gaps
            out.append((int(ix[0]), int(ix[-1]) + 1))
        else:
            out.append(None)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Fragmentation:
    """C for one run. Derived from (layout, K, seed, strategy); only its fingerprint is ever sent.

    `sizes` and `spans` are all a round reads where every fragment is one contiguous range (K=1, the contiguous
    strategy): there `assignment` and `indices` (12 bytes a coordinate, three times a float32 model) are dropped
    once the fingerprint is made, and made again only where something asks for them (an analysis, --compress
    topk, a robust rule). Random fragments keep `indices`, through which every round gathers, and drop
    `assignment` (an analysis' only)."""

    layout: Layout
    k: int
    seed: int
    strategy: Strategy
    fingerprint: bytes
    sizes: tuple[int, ...]
    spans: tuple[tuple[int, int] | None, ...] = field(repr=False)
    """Per fragment, (start, stop) where its coordinates are one contiguous range (always for K=1 and the
    contiguous strategy), else None: such a fragment is a slice of the vector, read and written in place instead
    of gathered and scattered through its index array."""

    @classmethod
    def build(cls, layout: Layout, k: int, seed: int, strategy: Strategy | str = Strategy.RANDOM) -> Fragmentation:
        strategy = Strategy(strategy)
        d = layout.dim
        if k < 1:
            raise ValueError(f"K (fragments) must be >= 1, got {k}")
        if d > 0 and k > d:
            raise ValueError(f"K={k} fragments is more than the model's {d} coordinates")
        assignment = _assignment(layout, k, seed, strategy)
        indices = _indices(assignment, k)
        h = hashlib.sha256()
        h.update(f"mosaic-fragmentation/v1 k={k} d={d} strategy={strategy.value}".encode())
        h.update(layout.digest())
        h.update(assignment.astype("<i4").tobytes())
        spans = _spans(indices)
        fragmentation = cls(layout, k, seed, strategy, h.digest()[:8], tuple(len(ix) for ix in indices), spans)
        if any(span is None for span in spans):  # kept: `cached_property` reads it from here
            fragmentation.__dict__["indices"] = indices
        return fragmentation

    @cached_property
    def assignment(self) -> np.ndarray:
        """C: each coordinate's fragment (int32, read-only)."""
        return _assignment(self.layout, self.k, self.seed, self.strategy)

    @cached_property
    def indices(self) -> tuple[np.ndarray, ...]:
        """Each fragment's coordinates, ascending (int64, read-only)."""
        return _indices(self.assignment, self.k)

    @property
    def dim(self) -> int:
        return self.layout.dim

    @cached_property
    def order(self) -> np.ndarray:
        """Every coordinate, fragment after fragment: the K index arrays laid end to end (fragment f is
        `order[starts[f]:starts[f + 1]]`), the array `build` split them from, not a copy."""
        base = self.indices[0].base if self.indices else None
        if isinstance(base, np.ndarray) and base.shape == (self.dim,) and base.dtype == np.int64 \
                and base.flags.c_contiguous:
            at = base.ctypes.data
            if all(ix.base is base and ix.ctypes.data == at + 8 * lo
                   for ix, lo in zip(self.indices, self.starts, strict=False)):
                return base
        return np.concatenate(self.indices) if self.indices else np.zeros(0, np.int64)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Where each fragment begins in `order` (K + 1 values: the last is d)."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]))

    @cached_property
    def positions(self) -> np.ndarray:
        """Where each coordinate sits in `order` (its inverse; int32 below 2**31 coordinates): a vector laid out
        fragment after fragment is put back in coordinate order by one gather (`unpack`), streaming from K places at
        once, several times faster at d=11M, K=16 than K scatters through the index arrays. Made when first asked
        for (4 bytes a coordinate)."""
        dtype = np.int32 if self.dim < 2**31 else np.int64
        positions = np.empty(self.dim, dtype=dtype)
        positions[self.order] = np.arange(self.dim, dtype=dtype)
        positions.flags.writeable = False
        return positions

    def packed(self, vector: np.ndarray) -> np.ndarray:
        """`vector`'s values fragment after fragment (`order`'s order), one new array: fragment f is the slice
        `[starts[f]:starts[f + 1]]`."""
        self._check(vector)
        return np.take(vector, self.order)

    def unpack(self, packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The inverse of `packed`: `packed`'s values back in coordinate order (into `out`, else a new array),
        gathered through `positions` a block at a time (the block's indices widened to intp stay in the cache)."""
        positions = self.positions
        if out is None:
            out = np.empty(self.dim, dtype=packed.dtype)
        for lo in range(0, self.dim, UNPACK_BLOCK):
            np.take(packed, positions[lo:lo + UNPACK_BLOCK], out=out[lo:lo + UNPACK_BLOCK])
        return out

    def split(self, vector: np.ndarray) -> list[np.ndarray]:
        """The K fragments of a flat vector, each a new contiguous array."""
        self._check(vector)
        return [vector[ix] for ix in self.indices]

    def views(self, vector: np.ndarray) -> list[np.ndarray]:
        """The K fragments of a flat vector without copying where a fragment is a contiguous range (a read-only
        view of `vector` then), gathered into a new array elsewhere: for reading, e.g. encoding. Where no fragment
        is a range (random fragments), all K are gathered at once into one array (`packed`), of which they are
        slices."""
        self._check(vector)
        if self.k > 1 and self.dim >= PACK_FROM and all(span is None for span in self.spans):
            packed, starts = self.packed(vector), self.starts
            self.positions  # noqa: B018 (made now, at a node's first send, not in its first aggregation)
            return [packed[starts[f]:starts[f + 1]] for f in range(self.k)]
        out = []
        for f, span in enumerate(self.spans):
            if span is None:
                out.append(vector[self.indices[f]])
            else:
                view = vector[span[0]:span[1]]
                view.flags.writeable = False
                out.append(view)
        return out

    def take(self, vector: np.ndarray, fragment: int) -> np.ndarray:
        self._check(vector)
        return vector[self.indices[fragment]]

    def put(self, vector: np.ndarray, fragment: int, values: np.ndarray) -> None:
        """Write one fragment's values back into a flat vector, in place."""
        self._check(vector)
        ix = self.indices[fragment]
        if values.shape != ix.shape:
            raise ValueError(f"fragment {fragment} has {len(ix)} values, got {values.shape}")
        vector[ix] = values

    def merge(self, fragments: Sequence[np.ndarray], dtype: np.dtype | type = np.float32) -> np.ndarray:
        """The flat vector whose fragments are the given ones (inverse of split)."""
        if len(fragments) != self.k:
            raise ValueError(f"expected {self.k} fragments, got {len(fragments)}")
        out = np.empty(self.dim, dtype=dtype)
        for f, values in enumerate(fragments):
            self.put(out, f, values)
        return out

    def _check(self, vector: np.ndarray) -> None:
        if vector.ndim != 1 or vector.shape[0] != self.dim:
            raise ValueError(f"expected a flat vector of {self.dim} values, got shape {vector.shape}")

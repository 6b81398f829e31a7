"""Compressed fragments: what a sender puts on the wire instead of a fragment's float32 values, and back.

A `Compression` is a run setting every member agrees on (`none`, `fp16`, `bf16`, `int8`, `topk:FRACTION`). Every
codec is deterministic: `int8`'s stochastic rounding draws from the run's keyed generator (seed, round, sender,
fragment), so a fragment compresses to the same bytes in one process or on many hosts. `topk` sends the largest
coordinates with their indices; a receiver averages each coordinate over the contributions that carry it
(`sparse_average`), as fragment-wise averaging does over the senders of a fragment. Lossy codecs keep what they
dropped (`ErrorFeedback`) and add it to the next round's values, so nothing is lost for good, only delayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .rng import Purpose, keyed_rng

CODECS = ("none", "fp16", "bf16", "int8", "topk")
INT8_LEVELS = 127
FP16_MAX = 65504.0  # fp16's largest finite value: larger values are sent as it (saturated), never as infinity


@dataclass(frozen=True)
class Compressed:
    """One fragment as it travels: `values` in the codec's dtype, `indices` (ascending uint32) where the codec sends
    some coordinates only, `scale` where values are quantized to integers. `size`: the fragment's full length."""

    codec: str
    size: int
    values: np.ndarray
    indices: np.ndarray | None = None
    scale: float = 1.0

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (values, indices, the scale), framing excluded."""
        return self.values.nbytes + (0 if self.indices is None else self.indices.nbytes) + \
            (4 if self.codec == "int8" else 0)


@dataclass(frozen=True)
class Compression:
    """The run's codec; `fraction`: topk's share of coordinates sent (at least one per fragment)."""

    codec: str = "none"
    fraction: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Compression:
        """`none|fp16|bf16|int8|topk:FRACTION`; ValueError saying what is allowed."""
        name, _, arg = text.strip().partition(":")
        if name not in CODECS:
            raise ValueError(f"unknown compression {text!r}: one of none, fp16, bf16, int8, topk:FRACTION")
        if name != "topk":
            if arg:
                raise ValueError(f"compression {name} takes no argument, got {text!r}")
            return cls(name)
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"topk needs a fraction of coordinates in (0, 1], e.g. topk:0.1, got {text!r}") from None
        if not 0 < fraction <= 1 or not math.isfinite(fraction):
            raise ValueError(f"topk's fraction must be in (0, 1], got {fraction:g}")
        return cls("topk", fraction)

    def __str__(self) -> str:
        return f"topk:{self.fraction:g}" if self.codec == "topk" else self.codec

    def kept(self, size: int) -> int:
        """How many coordinates of a `size`-long fragment topk sends."""
        return size if self.codec != "topk" else min(size, max(1, math.ceil(self.fraction * size)))

    def compress(self, values: np.ndarray, *, seed: int, round: int, node: int, fragment: int) -> Compressed:
        """`values` (float32) as they go on the wire; the key makes int8's rounding the same on every host."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        size = values.size
        if self.codec == "none":
            return Compressed("none", size, values.copy())
        if self.codec == "fp16":
            return Compressed("fp16", size, np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16))
        if self.codec == "bf16":
            return Compressed("bf16", size, to_bfloat16(values))
        if self.codec == "int8":
            peak = float(np.max(np.abs(values))) if size else 0.0
            scale = peak / INT8_LEVELS if peak > 0 else 1.0
            noise = keyed_rng(seed, Purpose.COMPRESSION, round, node, fragment).random(size, dtype=np.float32)
            levels = np.floor(values / np.float32(scale) + noise)
            return Compressed("int8", size, np.clip(levels, -INT8_LEVELS, INT8_LEVELS).astype(np.int8), scale=scale)
        kept = self.kept(size)
        largest = np.argpartition(-np.abs(values), kept - 1, kind="introselect")[:kept]
        indices = np.sort(largest).astype(np.uint32)
        return Compressed("topk", size, values[indices], indices)


def decompress(message: Compressed) -> tuple[np.ndarray | None, np.ndarray]:
    """(indices or None for every coordinate, float32 values)."""
    if message.codec in ("none", "fp16"):
        return None, message.values.astype(np.float32)
    if message.codec == "bf16":
        return None, from_bfloat16(message.values)
    if message.codec == "int8":
        return None, message.values.astype(np.float32) * np.float32(message.scale)
    if message.codec == "topk":
        return message.indices, message.values.astype(np.float32)
    raise ValueError(f"unknown codec {message.codec!r}")


def dense(message: Compressed) -> np.ndarray:
    """The fragment a message stands for, zeros where topk sent nothing."""
    indices, values = decompress(message)
    if indices is None:
        return values
    out = np.zeros(message.size, np.float32)
    out[indices] = values
    return out


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest, ties to even (as torch rounds)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class ErrorFeedback:
    """One node's residuals, per fragment: what its lossy messages left out, added to the next values it sends."""

    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self._residuals: dict[int, np.ndarray] = {}

    def compress(self, values: np.ndarray, *, seed: int, round: int, node: int, fragment: int) -> Compressed:
        values = np.asarray(values, dtype=np.float32)
        carried = self._residuals.get(fragment)
        target = values if carried is None else values + carried
        message = self.compression.compress(target, seed=seed, round=round, node=node, fragment=fragment)
        self._residuals[fragment] = target - dense(message)
        return message

    def residual(self, fragment: int) -> np.ndarray | None:
        """What fragment `fragment`'s messages have left out so far (a copy)."""
        kept = self._residuals.get(fragment)
        return None if kept is None else kept.copy()


def sparse_average(own: np.ndarray, received: Sequence[Compressed]) -> np.ndarray:
    """Each coordinate of a fragment averaged over the node's own value and the messages that carry it, in the
    order given (ascending sender, as `aggregate` sums): a coordinate nobody sent keeps the node's own value."""
    total = np.asarray(own, dtype=np.float64).copy()
    count = np.ones(total.size, dtype=np.int64)
    for message in received:
        if message.size != total.size:
            raise ValueError(f"a message of {message.size} coordinates for a fragment of {total.size}")
        indices, values = decompress(message)
        if indices is None:
            total += values
            count += 1
        else:
            total[indices] += values
            count[indices] += 1
    return (total / count).astype(np.float32)

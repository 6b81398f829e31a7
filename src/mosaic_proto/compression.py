"""Compressed fragments: what a sender puts on the wire instead of a fragment's float32 values, and back.

A `Compression` is a run setting every member agrees on (`none`, `fp16`, `bf16`, `int8`, `topk:FRACTION`). Every
codec is deterministic: `int8`'s stochastic rounding draws from the run's keyed generator (seed, round, sender,
fragment), so a fragment compresses to the same bytes in one process or on many hosts. `topk` sends some
coordinates with their indices. With error feedback (`Compressor`) what a lossy message left out is sent in later
rounds, and a receiver reads the newest value it heard where a topk message is silent (`stand_in_average`);
without it, each coordinate is averaged over the messages that carry it (`sparse_average`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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

    def compress(self, values: np.ndarray, *, seed: int, round: int, node: int, fragment: int,
                 by: np.ndarray | None = None) -> Compressed:
        """`values` (float32) as they go on the wire; the key makes int8's rounding the same on every host. `by`:
        what topk ranks coordinates by (their magnitude; default the values')."""
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
            scale = float(np.float32(peak / INT8_LEVELS)) or 1.0  # float32, as it travels; 1 for a zero fragment
            noise = keyed_rng(seed, Purpose.COMPRESSION, round, node, fragment).random(size, dtype=np.float32)
            levels = np.floor(values / np.float32(scale) + noise)
            return Compressed("int8", size, np.clip(levels, -INT8_LEVELS, INT8_LEVELS).astype(np.int8), scale=scale)
        kept = self.kept(size)
        rank = np.abs(values if by is None else np.asarray(by, dtype=np.float32))
        largest = np.argpartition(-rank, kept - 1, kind="introselect")[:kept]
        indices = np.sort(largest).astype(np.uint32)
        return Compressed("topk", size, values[indices], indices)


def decompress(message: Compressed) -> tuple[np.ndarray | None, np.ndarray]:
    """(indices or None for every coordinate, float32 values)."""
    if message.codec in ("none", "fp16"):
        return None, message.values.astype(np.float32)
    if message.codec == "bf16":
        return None, from_bfloat16(message.values)
    if message.codec == "int8":
        with np.errstate(over="ignore"):  # a forged scale overflows to infinity, which the receiver refuses
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


class Compressor:
    """One node's side of the run's codec: what it sends, keyed by (seed, node), and with error feedback what its
    lossy messages leave out, carried into later rounds. It lives as long as the node's run (a checkpoint keeps its
    `state`).

    Messages carry model values, not updates, so the two kinds of codec carry different things. A quantizer's
    rounding error is added to the fragment's next values (sigma-delta: what is sent averages out to the model).
    topk keeps the values it last sent of each coordinate and sends the coordinates that moved most since (the
    model's largest coordinates without it), so every coordinate is sent sooner or later; and as a receiver it keeps
    the newest value it has heard of each coordinate (`stand_in`), which stands in for the coordinates a message
    leaves out. Measured on digits (16 nodes, K=4, Dirichlet 0.1, 30 rounds, topk:0.1): averaging each coordinate
    over the messages that carry it only, 54.3% node-average accuracy; with the stand-in, 73.3% (none: 74.0%).
    Adding topk's left-out values to the next round's, as one does for updates, would count the model again each
    round (it diverged)."""

    def __init__(self, compression: Compression, *, seed: int, node: int, error_feedback: bool = True) -> None:
        self.compression, self.seed, self.node = compression, seed, node
        self.error_feedback = error_feedback and compression.codec != "none"
        self._kept: dict[int, np.ndarray] = {}  # fragment -> rounding error (quantizers) or last values sent (topk)
        self._heard: np.ndarray | None = None  # topk: the newest value heard of each coordinate of the model

    def compress(self, values: np.ndarray, *, round: int, fragment: int) -> Compressed:
        """Fragment `fragment`'s values of `round` as they go on the wire (to every receiver alike)."""
        values = np.asarray(values, dtype=np.float32)
        key = {"seed": self.seed, "round": round, "node": self.node, "fragment": fragment}
        if not self.error_feedback:
            return self.compression.compress(values, **key)
        kept = self._kept.get(fragment)
        if self.compression.codec == "topk":
            sent = np.zeros_like(values) if kept is None else kept.copy()
            message = self.compression.compress(values, by=values - sent, **key)
            sent[message.indices] = message.values
            self._kept[fragment] = sent
            return message
        target = values if kept is None else values + kept
        message = self.compression.compress(target, **key)
        self._kept[fragment] = target - dense(message)
        return message

    def stand_in(self, own: np.ndarray) -> np.ndarray | None:
        """topk with error feedback: the newest value this node has heard of each coordinate (its own `own` where it
        has heard none yet), which a receiver reads where a message is silent; None for every other codec."""
        if not (self.error_feedback and self.compression.codec == "topk"):
            return None
        if self._heard is None:
            self._heard = np.array(own, dtype=np.float32, copy=True)
        return self._heard

    def heard(self, indices: Sequence[np.ndarray], received: Mapping[int, Mapping[int, object]]) -> None:
        """A round's messages were aggregated: what they carried becomes the newest value heard of those
        coordinates (in ascending sender order: the last sender's value stays). `indices`: each fragment's
        coordinates in the model."""
        if self._heard is None:
            return
        for sender in sorted(received):
            for f, part in received[sender].items():
                if isinstance(part, Compressed) and part.indices is not None:
                    self._heard[indices[f][part.indices]] = part.values

    def state(self) -> dict[str, np.ndarray]:
        """What it carries (copies), for a checkpoint: a resumed node must carry it on. Keys: "kept_F" per
        fragment F, "heard"."""
        state = {f"kept_{f}": kept.copy() for f, kept in sorted(self._kept.items())}
        if self._heard is not None:
            state["heard"] = self._heard.copy()
        return state

    def restore(self, state: Mapping[str, np.ndarray]) -> None:
        """Go on from a checkpoint's `state`."""
        self._kept = {int(key.removeprefix("kept_")): np.array(v, dtype=np.float32)
                      for key, v in state.items() if key.startswith("kept_")}
        heard = state.get("heard")
        self._heard = None if heard is None else np.array(heard, dtype=np.float32)


def stand_in_average(own: np.ndarray, received: Sequence[Compressed | np.ndarray], stand_in: np.ndarray) -> np.ndarray:
    """A fragment averaged over the node's own values and every message (count-based, as dense messages are), where
    a sparse message's missing coordinates read `stand_in` (the newest values heard), summed in the order given."""
    total = np.asarray(own, dtype=np.float64).copy()
    for message in received:
        total += densify(message, stand_in)
    return (total / (1 + len(received))).astype(np.float32)


def densify(part: np.ndarray | Compressed, own: np.ndarray) -> np.ndarray:
    """A received fragment as dense values, the receiver's own where a sparse message carries nothing: what the
    robust rules (trimmed-mean, clipped) and --max-norm see, so a coordinate nobody sent pulls nowhere."""
    if not isinstance(part, Compressed):
        return np.asarray(part)
    indices, values = decompress(part)
    if indices is None:
        return values
    out = np.array(own, dtype=np.float32, copy=True)
    out[indices] = values
    return out


def sparse_average(own: np.ndarray, received: Sequence[Compressed | np.ndarray]) -> np.ndarray:
    """Each coordinate of a fragment averaged over the node's own value and the messages that carry it, in the
    order given (ascending sender, as `aggregate` sums): a coordinate nobody sent keeps the node's own value.
    A dense array carries every coordinate."""
    total = np.asarray(own, dtype=np.float64).copy()
    count = np.ones(total.size, dtype=np.int64)
    for message in received:
        if not isinstance(message, Compressed):
            message = Compressed("none", len(message), np.asarray(message))
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

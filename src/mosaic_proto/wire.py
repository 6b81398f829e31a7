"""The wire format: one CBOR message per (sender, receiver, round), carrying every fragment for that peer.

    {"v": 1, "run": text, "round": uint, "sender": uint, "k": uint, "fp": bytes(8), "dtype": "<f4",
     "frags": [[index, 85(bytes)], ...]}      85 = RFC 8746 typed array, float32 little-endian

Encoding writes the CBOR framing by hand around the fragments' own buffers (one copy into the
message); decoding trusts nothing and raises only `WireError`.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from enum import StrEnum

import cbor2
import numpy as np

from .fragmentation import Fragmentation

VERSION = 1
DTYPE = "<f4"
TAG_FLOAT32_LE = 85
CONTENT_TYPE = "application/cbor"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_KEYS = ("v", "run", "round", "sender", "k", "fp", "dtype", "frags")
_MAX_ID = 2**31 - 1
_MAX_RUN_ID = 128


class Reason(StrEnum):
    """Machine-readable causes of a refused message (also the `reason` of an HTTP 4xx answer)."""

    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    BAD_HEADER = "bad_header"
    UNSUPPORTED_VERSION = "unsupported_version"
    WRONG_RUN = "wrong_run"
    WRONG_K = "wrong_k"
    FOREIGN_FINGERPRINT = "foreign_fingerprint"
    BAD_DTYPE = "bad_dtype"
    BAD_FRAGMENT = "bad_fragment"
    DUPLICATE_FRAGMENT = "duplicate_fragment"
    NON_FINITE = "non_finite"
    UNKNOWN_SENDER = "unknown_sender"
    STALE_ROUND = "stale_round"
    FUTURE_ROUND = "future_round"
    ROUND_CLOSED = "round_closed"


class WireError(ValueError):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail

    def to_json(self) -> dict[str, str]:
        return {"reason": self.reason.value, "detail": self.detail}


@dataclass(frozen=True)
class FragmentBatch:
    """What one sender sends one receiver in one round; `fragments` maps index -> float32 values."""

    run_id: str
    round: int
    sender: int
    k: int
    fingerprint: bytes
    fragments: dict[int, np.ndarray] = field(repr=False)

    @property
    def floats(self) -> int:
        return sum(len(v) for v in self.fragments.values())


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def encode(batch: FragmentBatch) -> bytes:
    parts: list[bytes | memoryview] = [_head(5, len(_KEYS))]
    header = {"v": VERSION, "run": batch.run_id, "round": batch.round, "sender": batch.sender,
              "k": batch.k, "fp": batch.fingerprint, "dtype": DTYPE}
    for key, value in header.items():
        parts += [cbor2.dumps(key), cbor2.dumps(value)]
    parts += [cbor2.dumps("frags"), _head(4, len(batch.fragments))]
    for index in sorted(batch.fragments):
        values = np.ascontiguousarray(batch.fragments[index], dtype=DTYPE)
        parts += [b"\x82", _head(0, index), b"\xd8\x55", _head(2, values.nbytes), memoryview(values).cast("B")]
    return b"".join(parts)


def _int(value: object, name: str, hi: int = _MAX_ID) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise WireError(Reason.BAD_HEADER, f"{name} must be an integer in [0, {hi}], got {value!r:.40}")
    return value


def decode(data: bytes | bytearray | memoryview, fragmentation: Fragmentation, *, run_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES) -> FragmentBatch:
    """Parse and validate one message against this run's fragmentation."""
    if len(data) > max_bytes:
        raise WireError(Reason.TOO_LARGE, f"{len(data)} bytes is over the {max_bytes}-byte limit")
    stream = io.BytesIO(data)
    try:
        obj = cbor2.CBORDecoder(stream).decode()
    except Exception as exc:  # cbor2 raises several types (and RecursionError on deep nesting)
        raise WireError(Reason.MALFORMED, f"not a CBOR item: {type(exc).__name__}") from None
    if stream.tell() != len(data):
        raise WireError(Reason.MALFORMED, f"{len(data) - stream.tell()} trailing bytes after the message")
    if not isinstance(obj, dict) or set(obj) != set(_KEYS):
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise WireError(Reason.BAD_HEADER, f"expected a map with keys {list(_KEYS)}, got {keys}")
    if obj["v"] != VERSION or type(obj["v"]) is not int:
        raise WireError(Reason.UNSUPPORTED_VERSION, f"format version {obj['v']!r:.20} (this node speaks {VERSION})")
    run = obj["run"]
    if not isinstance(run, str) or not 0 < len(run) <= _MAX_RUN_ID:
        raise WireError(Reason.BAD_HEADER, "run must be a non-empty text of at most 128 characters")
    if run_id is not None and run != run_id:
        raise WireError(Reason.WRONG_RUN, f"message of run {run!r}, this node is in run {run_id!r}")
    round_, sender, k = _int(obj["round"], "round"), _int(obj["sender"], "sender"), _int(obj["k"], "k")
    if k != fragmentation.k:
        raise WireError(Reason.WRONG_K, f"message has K={k}, this run has K={fragmentation.k}")
    if obj["fp"] != fragmentation.fingerprint:
        raise WireError(Reason.FOREIGN_FINGERPRINT, "the sender fragments the model differently (fingerprint mismatch)")
    if obj["dtype"] != DTYPE:
        raise WireError(Reason.BAD_DTYPE, f"dtype must be {DTYPE!r}, got {obj['dtype']!r:.20}")
    frags = obj["frags"]
    if not isinstance(frags, list) or not 0 < len(frags) <= k:
        raise WireError(Reason.BAD_FRAGMENT, f"frags must be a list of 1 to {k} fragments")
    fragments: dict[int, np.ndarray] = {}
    for item in frags:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], cbor2.CBORTag)):
            raise WireError(Reason.BAD_FRAGMENT, "each fragment must be [index, typed array]")
        index, tag = item
        if type(index) is not int or not 0 <= index < k:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment index must be in [0, {k}), got {index!r:.20}")
        if index in fragments:
            raise WireError(Reason.DUPLICATE_FRAGMENT, f"fragment {index} appears twice")
        if tag.tag != TAG_FLOAT32_LE or not isinstance(tag.value, bytes):
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} is not a tag-85 float32 typed array")
        expected = fragmentation.sizes[index] * 4
        if len(tag.value) != expected:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} has {len(tag.value)} bytes, expected {expected}")
        values = np.frombuffer(tag.value, dtype=DTYPE)
        if not np.isfinite(values).all():
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
        fragments[index] = values
    return FragmentBatch(run, round_, sender, k, obj["fp"], fragments)

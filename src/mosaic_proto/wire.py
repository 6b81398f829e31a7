"""The wire format: one CBOR message per (sender, receiver, round), carrying every fragment for that peer.

    {"v": 1, "run": text, "round": uint, "sender": uint, "k": uint, "fp": bytes(8), "dtype": "<f4",
     "frags": [[index, 85(bytes)], ...]}      85 = RFC 8746 typed array, float32 little-endian

A run with `--compress` names its codec in "dtype" and sends each fragment as that codec's item (RFC 8746 tags):
"fp16" [index, 84(float16 LE)], "bf16" [index, 69(uint16 LE: bfloat16 bits)], "int8" [index, 72(sint8), scale
(float32)], "topk" [index, 85(float32 LE values), 70(uint32 LE indices, ascending)]. A receiver takes only its
run's codec; dense codecs decode to float32 fragments, topk to a `Compressed` (the coordinates it carries).

Encoding writes the CBOR framing by hand around the fragments' own buffers (`encode_parts`: the pieces, the
values not copied; `encode`: them joined, one copy into the message): canonical
CBOR (shortest heads, definite lengths), the keys in the order above. Decoding trusts nothing, raises only
`WireError`, and reads exactly what `encode` writes (`_Reader`), no other CBOR: it stops at the first byte that
departs from the message's shape. A value of another type or out of range gets its field's reason; what CBOR
allows but `encode` never writes (an indefinite length, a head longer than it needs) is MALFORMED, keys in
another order BAD_HEADER; every item's form is read before any values are checked. The shape bounds the work:
`frags` holds at most K items, each typed array exactly its fragment's bytes, the run's id at most 512 bytes,
and no body over `max_message_bytes` is read, so whatever a body claims, reading it builds no more than a
message of the run; the fragments are read-only views into the message, never copied.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import cbor2
import numpy as np

from .compression import Compressed, Compression, decompress
from .fragmentation import Fragmentation

VERSION = 1
DTYPE = "<f4"
TAG_FLOAT32_LE = 85
CONTENT_TYPE = "application/cbor"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_KEYS = ("v", "run", "round", "sender", "k", "fp", "dtype", "frags")
_MAX_ID = 2**31 - 1
_MAX_RUN_ID = 128
_KEY_BYTES = tuple(key.encode() for key in _KEYS)
# max_message_bytes: a message's bytes beyond its fragments' payload are at most this much framing per fragment
# (its item's heads, 8 items of 8 bytes) and for the header
_ITEMS_PER_FRAGMENT = 8
_FRAMING_SLACK = 1024
# "dtype" of each codec's messages, and the RFC 8746 tag of its values (topk's indices: TAG_UINT32_LE)
CODEC_DTYPE = {"none": DTYPE, "fp16": "fp16", "bf16": "bf16", "int8": "int8", "topk": "topk"}
_CODEC_TAG = {"none": TAG_FLOAT32_LE, "fp16": 84, "bf16": 69, "int8": 72, "topk": TAG_FLOAT32_LE}
_CODEC_NUMPY = {codec: np.dtype(dtype) for codec, dtype in
                {"none": "<f4", "fp16": "<f2", "bf16": "<u2", "int8": "i1", "topk": "<f4"}.items()}
_CODEC_ITEMS = {"none": 2, "fp16": 2, "bf16": 2, "int8": 3, "topk": 3}  # [index, values] (+ scale or indices)
TAG_UINT32_LE = 70
_NONE = Compression()


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
    OUT_OF_RANGE = "out_of_range"  # a fragment's norm is far beyond the receiver's own (--max-norm)
    UNKNOWN_SENDER = "unknown_sender"
    SENDER_MISMATCH = "sender_mismatch"  # the message names another sender than the one its transport proved
    UNPLANNED_FRAGMENT = "unplanned_fragment"  # the sampler's plan does not send this fragment here
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
    """What one sender sends one receiver in one round; `fragments` maps index -> float32 values, or for a
    compressed run (`codec`) what travels: to `encode` a `Compressed` each; from `decode` float32 values for the
    dense codecs and topk's `Compressed`."""

    run_id: str
    round: int
    sender: int
    k: int
    fingerprint: bytes
    fragments: dict[int, np.ndarray | Compressed] = field(repr=False)
    codec: str = "none"

    @property
    def floats(self) -> int:
        """The coordinates of the fragments it stands for (a sparse one's whole fragment)."""
        return sum(v.size for v in self.fragments.values())


@functools.lru_cache(maxsize=4096)  # the same few heads (indices, lengths, rounds) over and over
def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


_KEY_CBOR = tuple((key, cbor2.dumps(key)) for key in _KEYS)


def _item(value: object) -> bytes:
    """Canonical CBOR of one header value (the same bytes as cbor2.dumps, without its per-call overhead)."""
    if type(value) is int and 0 <= value < 2**64:
        return _head(0, value)
    if type(value) is str:
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if type(value) is bytes:
        return _head(2, len(value)) + value
    return cbor2.dumps(value)


@functools.lru_cache(maxsize=256)
def _framing(run_id: str, k: int, fingerprint: bytes, dtype: str = DTYPE) -> tuple[bytes, bytes, bytes]:
    """The framing before round, between round and sender, and after sender: the same for every message of a run."""
    key = dict(_KEY_CBOR)
    before_round = b"".join([_head(5, len(_KEYS)), key["v"], _item(VERSION), key["run"], _item(run_id), key["round"]])
    after_sender = b"".join([key["k"], _item(k), key["fp"], _item(fingerprint), key["dtype"], _item(dtype),
                             key["frags"]])
    return before_round, key["sender"], after_sender


def encode(batch: FragmentBatch) -> bytes:
    return b"".join(encode_parts(batch))


def encode_parts(batch: FragmentBatch) -> list[bytes | memoryview]:
    """`encode`'s bytes as the pieces they are written from, in order: the framing (`bytes`) and each fragment's
    values (a view of its array, not copied), for a transport that writes them one after the other."""
    dtype = CODEC_DTYPE[batch.codec]
    if type(batch.run_id) is str and type(batch.k) is int and type(batch.fingerprint) is bytes:
        before_round, sender_key, after_sender = _framing(batch.run_id, batch.k, batch.fingerprint, dtype)
        parts: list[bytes | memoryview] = [before_round, _item(batch.round), sender_key, _item(batch.sender),
                                           after_sender]
    else:
        header = (VERSION, batch.run_id, batch.round, batch.sender, batch.k, batch.fingerprint, dtype)
        parts = [_head(5, len(_KEYS))]
        for (_, key), value in zip(_KEY_CBOR, header, strict=False):
            parts += [key, _item(value)]
        parts.append(_KEY_CBOR[-1][1])
    parts.append(_head(4, len(batch.fragments)))
    if batch.codec == "none":
        for index in sorted(batch.fragments):
            values = np.ascontiguousarray(batch.fragments[index], dtype=DTYPE)
            parts += [b"\x82", _head(0, index), b"\xd8\x55", _head(2, values.nbytes), memoryview(values).cast("B")]
        return parts
    tag = _head(6, _CODEC_TAG[batch.codec])
    for index in sorted(batch.fragments):
        message = batch.fragments[index]
        if not isinstance(message, Compressed) or message.codec != batch.codec:
            raise TypeError(f"fragment {index} of a {batch.codec} message must be a Compressed of that codec")
        values = np.ascontiguousarray(message.values, dtype=_CODEC_NUMPY[batch.codec])
        parts += [_head(4, _CODEC_ITEMS[batch.codec]), _head(0, index), tag,
                  _head(2, values.nbytes), memoryview(values).cast("B")]
        if batch.codec == "int8":
            parts.append(b"\xfa" + struct.pack(">f", message.scale))
        elif batch.codec == "topk":
            assert message.indices is not None
            indices = np.ascontiguousarray(message.indices, dtype="<u4")
            parts += [_head(6, TAG_UINT32_LE), _head(2, indices.nbytes), memoryview(indices).cast("B")]
    return parts


def encoded_sizes(run_id: str, round: int, k: int, fingerprint: bytes, senders: Sequence[int],
                  floats: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `encode` writes, in bytes, without writing it (for `exchange.exchange_round`): the framing of a message
    from each of `senders` in `round` (the fragment array's head excluded), the item of each fragment f of
    `floats[f]` values, and the fragment array's head for 0..k fragments. A message is the sum of its parts."""
    before_round, sender_key, after_sender = _framing(run_id, k, fingerprint)
    common = len(before_round) + len(_item(round)) + len(sender_key) + len(after_sender)
    framing = np.array([common + len(_item(sender)) for sender in senders], dtype=np.int64)
    items = np.array([3 + len(_head(0, f)) + len(_head(2, 4 * n)) + 4 * n for f, n in enumerate(floats)],
                     dtype=np.int64)
    return framing, items, np.array([len(_head(4, count)) for count in range(k + 1)], dtype=np.int64)


def _show(value: bytes | str, limit: int = 40) -> str:
    """A short, safe description of an untrusted string for error details."""
    text = repr(value[:limit])
    return text if len(value) <= limit else text + "..."


def _found(major: int, arg: int, size: int) -> str:
    """What a head that does not fit its field announces, in words (never what follows it)."""
    if major == 7:
        return "a float" if size > 2 else _SIMPLE.get(arg, f"simple value {arg}")
    if major == 1:
        return f"the integer {-1 - arg}"
    return ("the integer {}", "", "a byte string of {} bytes", "a text of {} bytes", "an array of {} items",
            "a map of {} entries", "tag {}")[major].format(arg)


def _finite(values: np.ndarray) -> bool:
    """No NaN or infinity; a short fragment (high K on a small model) is checked without numpy's per-call cost."""
    return all(map(math.isfinite, values.tolist())) if values.size <= 32 else bool(np.isfinite(values).all())


def _truncated() -> WireError:
    return WireError(Reason.MALFORMED, "the message ends before its declared contents")


_SIMPLE = {20: "false", 21: "true", 22: "null", 23: "undefined"}
_SHORTEST = {2: 24, 3: 1 << 8, 5: 1 << 16, 9: 1 << 32}  # the least argument a head of so many bytes may carry
_ANY_SIZE = 1 << 64
_UINT32 = np.dtype("<u4")
_FLOAT32_HEAD = b"\xfa"
_MAP = f"expected a map with keys {list(_KEYS)}"
_SHAPE = {codec: f"each fragment of a {codec} message must be a list of {items} items: [index, typed array"
          + {"int8": ", scale]", "topk": ", indices]"}.get(codec, "]") for codec, items in _CODEC_ITEMS.items()}


@functools.lru_cache(maxsize=4)  # every message of a run is read against the same
def _run(fragmentation: Fragmentation, compression: Compression) -> tuple[int, tuple[tuple[bytes, int], ...]]:
    """The most bytes of a message of the run (`max_message_bytes`) and, per fragment, the heads `encode` writes
    before its values' bytes (the values' tag and byte string's head) and how many values it carries (topk: those
    it keeps)."""
    tag, itemsize = _CODEC_TAG[compression.codec], _CODEC_NUMPY[compression.codec].itemsize
    counts = [compression.kept(size) for size in fragmentation.sizes]
    heads = tuple((_head(6, tag) + _head(2, itemsize * count), count) for count in counts)
    return max_message_bytes(fragmentation, compression), heads


class _Reader:
    """Reads one message as `encode` writes it, and nothing else: a map of the eight keys in `_KEYS`' order, each
    value of its type, every head of definite length and in its shortest form, `frags` an array of 1 to K items
    [index, typed array (, scale or indices)], each typed array of exactly its fragment's bytes. It reads in the
    message's order and stops at the first byte that departs from it: a head of another kind or out of its
    field's range gives that field's reason; a message cut short, an indefinite length, a head longer than its
    argument needs, a repeated or non-text key, invalid UTF-8 or trailing bytes are MALFORMED. The shape it
    reads is its only count: nothing is built but the header's values and at most K fragments, views of the
    message (never copies), whatever the heads claim. Where it knows the bytes to expect (the run's framing, a
    fragment's heads) it compares them in one go, and reads field by field to name a fault. Raises only
    `WireError`."""

    __slots__ = ("data", "view", "end", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.view, self.end, self.pos = data, memoryview(data), len(data), 0

    def comes(self, expected: bytes) -> bool:
        """Whether `expected` comes next (`bytes.startswith`, for a read-only view too)."""
        if type(self.data) is bytes:
            return self.data.startswith(expected, self.pos)
        return self.view[self.pos:self.pos + len(expected)] == expected

    def skip(self, expected: bytes) -> bool:
        """Whether `expected` comes next (then read past it)."""
        if self.comes(expected):
            self.pos += len(expected)
            return True
        return False

    def head(self, major: int, reason: Reason, what: str, lo: int = 0, hi: int = _ANY_SIZE) -> int:
        """The argument of the next head, of `major` type and in [lo, hi], else `reason`: `what` (a template of lo
        and hi, formatted only then) and what came."""
        data, pos = self.data, self.pos
        if pos >= self.end:
            raise _truncated()
        info = data[pos] & 31
        if info < 24:
            arg, after = info, pos + 1
        elif info < 28:
            after = pos + 1 + (1 << (info - 24))
            if after > self.end:
                raise _truncated()
            arg = int.from_bytes(data[pos + 1:after], "big")
        else:
            raise WireError(Reason.MALFORMED, ("an indefinite length or break" if info == 31 else "a reserved head")
                            + f" at byte {pos}")
        if data[pos] >> 5 != major or not lo <= arg <= hi:
            raise WireError(reason, f"{what.format(lo=lo, hi=hi)}, got {_found(data[pos] >> 5, arg, after - pos)}")
        if after - pos > 1 and arg < _SHORTEST[after - pos]:
            raise WireError(Reason.MALFORMED, f"the head at byte {pos} is longer than its argument needs")
        self.pos = after
        return arg

    def string(self, major: int, reason: Reason, what: str, hi: int = _ANY_SIZE) -> memoryview:
        """The bytes of the next byte (major 2) or text (3) string of at most `hi` bytes, a view of the message."""
        size = self.head(major, reason, what)
        start = self.pos
        if size > self.end - start:
            raise _truncated()
        if size > hi:
            raise WireError(reason, f"{what}, got {_found(major, size, 1)}")
        self.pos = start + size
        return self.view[start:self.pos]

    def key(self, index: int) -> None:
        """The message's `index`th key: another name is BAD_HEADER, a repeated or non-text key MALFORMED."""
        if self.skip(_KEY_CBOR[index][1]):
            return
        kind = self.data[self.pos] >> 5 if self.pos < self.end else 3
        name = self.string(2 if kind == 2 else 3, Reason.MALFORMED, "a map's keys must be text")
        if kind == 3 and name in _KEY_BYTES[:index]:
            raise WireError(Reason.MALFORMED, f"the key {str(name, 'utf-8')!r} appears twice")
        raise WireError(Reason.BAD_HEADER, f"the message's entry {index + 1} must be {_KEYS[index]!r}, got "
                        f"{_show(bytes(name[:41]))}")

    def header(self, fragmentation: Fragmentation, run_id: str | None,
               compression: Compression) -> tuple[str, int, int]:
        """(run, round, sender) of the message, its header checked up to its fragments' array."""
        dtype = CODEC_DTYPE[compression.codec]
        before_round, sender_key, after_sender = _framing(run_id or "", fragmentation.k, fragmentation.fingerprint,
                                                          dtype)
        run = run_id
        if run_id is None or not self.skip(before_round):
            self.head(5, Reason.BAD_HEADER, _MAP, len(_KEYS), len(_KEYS))
            self.key(0)
            self.head(0, Reason.UNSUPPORTED_VERSION, "format version must be {lo} (this node speaks {lo})",
                      VERSION, VERSION)
            self.key(1)
            run = self.run(run_id)
            self.key(2)
        round_ = self.head(0, Reason.BAD_HEADER, "round must be an integer in [0, {hi}]", 0, _MAX_ID)
        if not self.skip(sender_key):
            self.key(3)
        sender = self.head(0, Reason.BAD_HEADER, "sender must be an integer in [0, {hi}]", 0, _MAX_ID)
        if not self.skip(after_sender):
            self.key(4)
            k = self.head(0, Reason.BAD_HEADER, "k must be an integer in [0, {hi}]", 0, _MAX_ID)
            if k != fragmentation.k:
                raise WireError(Reason.WRONG_K, f"message has K={k}, this run has K={fragmentation.k}")
            self.key(5)
            if self.string(2, Reason.FOREIGN_FINGERPRINT, "fp must be a byte string") != fragmentation.fingerprint:
                raise WireError(Reason.FOREIGN_FINGERPRINT,
                                "the sender fragments the model differently (fingerprint mismatch)")
            self.key(6)
            what = f"dtype must be {dtype!r} (this run's --compress {compression})"
            got = self.string(3, Reason.BAD_DTYPE, what)
            if got != dtype.encode():
                raise WireError(Reason.BAD_DTYPE, f"{what}, got {_show(bytes(got[:41]))}")
            self.key(7)
        return run, round_, sender

    def run(self, run_id: str | None) -> str:
        """The run's id: a text of 1 to `_MAX_RUN_ID` characters, `run_id` where the receiver knows it."""
        what = f"run must be a non-empty text of at most {_MAX_RUN_ID} characters"
        try:
            run = str(self.string(3, Reason.BAD_HEADER, what, 4 * _MAX_RUN_ID), "utf-8")
        except UnicodeDecodeError:
            raise WireError(Reason.MALFORMED, "invalid UTF-8 in the run's id") from None
        if not 0 < len(run) <= _MAX_RUN_ID:
            raise WireError(Reason.BAD_HEADER, what)
        if run_id is not None and run != run_id:
            raise WireError(Reason.WRONG_RUN, f"message of run {_show(run)}, this node is in run {run_id!r}")
        return run

    def fragments(self, fragmentation: Fragmentation, compression: Compression,
                  heads: tuple[tuple[bytes, int], ...]) -> dict:
        """The message's fragments: every item's form read to the message's end (BAD_FRAGMENT), then each item's
        index (BAD_FRAGMENT) and values (`_fragment`). `heads`: each fragment's heads as `encode` writes
        them (`_run`)."""
        codec, k, sizes = compression.codec, fragmentation.k, fragmentation.sizes
        count = self.head(4, Reason.BAD_FRAGMENT, "frags must be a list of {lo} to {hi} fragments", 1, k)
        items, tag, dtype, shape = _CODEC_ITEMS[codec], _CODEC_TAG[codec], _CODEC_NUMPY[codec], _SHAPE[codec]
        read = []
        for _ in range(count):
            self.head(4, Reason.BAD_FRAGMENT, shape, items, items)
            index = self.head(0, Reason.BAD_FRAGMENT, "fragment index must be in [0, {hi}]", 0, k - 1)
            values = self.typed(heads[index], tag, dtype, index, "values")
            extra = None
            if codec == "int8":
                extra = self.scale(index)
            elif codec == "topk":
                extra = self.typed((_head(6, TAG_UINT32_LE) + _head(2, 4 * len(values)), len(values)),
                                   TAG_UINT32_LE, _UINT32, index, "indices")
            read.append((index, values, extra))
        if self.pos != self.end:
            raise WireError(Reason.MALFORMED, f"{self.end - self.pos} trailing bytes after the message")
        fragments: dict[int, np.ndarray | Compressed] = {}
        last = -1
        for index, values, extra in read:
            # the message itself is wrong (400), not a conflict with what the receiver holds (duplicate_fragment)
            if index <= last:  # encode writes them in ascending order
                twice = "appears twice in the message" if index in fragments else "comes after a higher index"
                raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} {twice}")
            fragments[index], last = _fragment(codec, sizes[index], values, extra, index), index
        return fragments

    def typed(self, heads: tuple[bytes, int], number: int, dtype: np.dtype, index: int, what: str) -> np.ndarray:
        """The values of an RFC 8746 typed array of tag `number` whose heads `encode` writes as `heads` (its
        values' count beside): a view of the message."""
        expected, count = heads
        size = count * dtype.itemsize
        start = self.pos + len(expected)
        if not self.comes(expected) or start + size > self.end:
            what = f"fragment {index}'s {what}"
            self.head(6, Reason.BAD_FRAGMENT, f"{what} must be a tag-{number} typed array", number, number)
            raw = self.string(2, Reason.BAD_FRAGMENT, f"{what} must be a tag-{number} typed array")
            raise WireError(Reason.BAD_FRAGMENT, f"{what} take {len(raw)} bytes, expected {size}")
        self.pos = start + size
        return np.frombuffer(self.view[start:self.pos], dtype)

    def scale(self, index: int) -> float:
        """int8's scale, a float32 as `encode` writes it."""
        if not self.skip(_FLOAT32_HEAD):
            if self.pos >= self.end:
                raise _truncated()
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s scale must be a float32")
        if self.pos + 4 > self.end:
            raise _truncated()
        self.pos += 4
        return struct.unpack_from(">f", self.data, self.pos - 4)[0]


def _fragment(codec: str, size: int, values: np.ndarray, extra: object, index: int) -> np.ndarray | Compressed:
    """A fragment of a well-formed item: float32 values (a view of the message for `none`) or topk's `Compressed`,
    its values finite, topk's indices ascending in range, int8's scale a positive finite float."""
    if codec == "topk":
        assert isinstance(extra, np.ndarray)
        if not _finite(values):
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
        if len(extra) and (int(extra[-1]) >= size or not bool(np.all(extra[1:] > extra[:-1]))):
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s indices must ascend within [0, {size})")
        return Compressed("topk", size, values, extra)
    if codec == "int8" and not (math.isfinite(extra) and extra > 0):  # type: ignore[arg-type]
        raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s scale must be a positive finite float")
    dense = values if codec == "none" else decompress(Compressed(codec, size, values, scale=extra or 1.0))[1]
    if not _finite(dense):
        raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
    return dense


def max_message_bytes(fragmentation: Fragmentation, compression: Compression = _NONE) -> int:
    """The most bytes a message of this run can take: all K fragments' floats (topk: and their indices) plus
    generous framing."""
    payload = 8 * sum(map(compression.kept, fragmentation.sizes)) if compression.codec == "topk" else \
        4 * fragmentation.dim
    return payload + _ITEMS_PER_FRAGMENT * 8 * fragmentation.k + _FRAMING_SLACK


def check_structure(data: bytes | memoryview, fragmentation: Fragmentation, compression: Compression = _NONE) -> None:
    """Refuse a body that cannot be a message of this run, as `decode` does (which builds nothing beyond the
    message's own O(K) values, whatever its heads claim). None if it is one."""
    decode(data, fragmentation, compression=compression)


def decode(data: bytes | bytearray | memoryview, fragmentation: Fragmentation, *, run_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES, compression: Compression = _NONE) -> FragmentBatch:
    """Parse and validate one message against this run's fragmentation and codec (`compression`).

    The returned fragments are read-only float32 arrays (topk: `Compressed`); for `bytes` input of an uncompressed
    run, or a read-only buffer (its owner changes it no more while anything views it: a daemon's body buffer, reused
    only once nothing refers to it), they are views into `data` (no copy); a writable buffer is copied once first
    so that they never alias memory the caller may reuse. A body over `max_bytes`, or over any message of the run
    (`max_message_bytes`), is TOO_LARGE before it is read.
    """
    if not isinstance(data, bytes):
        try:
            view = memoryview(data)
        except TypeError:
            raise WireError(Reason.MALFORMED, f"expected a bytes-like object, got {type(data).__name__}") from None
        if view.nbytes > max_bytes:
            raise WireError(Reason.TOO_LARGE, f"{view.nbytes} bytes is over the {max_bytes}-byte limit")
        data = view.cast("B") if view.readonly and view.c_contiguous else view.tobytes()
    size = len(data)
    if size > max_bytes:
        raise WireError(Reason.TOO_LARGE, f"{size} bytes is over the {max_bytes}-byte limit")
    limit, heads = _run(fragmentation, compression)
    if size > limit:
        raise WireError(Reason.TOO_LARGE, f"{size} bytes: no message of this run is over {limit} bytes")
    reader = _Reader(data)
    run, round_, sender = reader.header(fragmentation, run_id, compression)
    return FragmentBatch(run, round_, sender, fragmentation.k, fragmentation.fingerprint,
                         reader.fragments(fragmentation, compression, heads), compression.codec)

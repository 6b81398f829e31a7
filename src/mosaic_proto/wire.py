"""The wire format: one CBOR message per (sender, receiver, round), carrying every fragment for that peer.

    {"v": 1, "run": text, "round": uint, "sender": uint, "k": uint, "fp": bytes(8), "dtype": "<f4",
     "frags": [[index, 85(bytes)], ...]}      85 = RFC 8746 typed array, float32 little-endian

A run with `--compress` names its codec in "dtype" and sends each fragment as that codec's item (RFC 8746 tags):
"fp16" [index, 84(float16 LE)], "bf16" [index, 69(uint16 LE: bfloat16 bits)], "int8" [index, 72(sint8), scale
(float32)], "topk" [index, 85(float32 LE values), 70(uint32 LE indices, ascending)]. A receiver takes only its
run's codec; dense codecs decode to float32 fragments, topk to a `Compressed` (the coordinates it carries).

Encoding writes the CBOR framing by hand around the fragments' own buffers (one copy into the
message); decoding trusts nothing and raises only `WireError`. One reader (`_Reader`) reads a message's CBOR:
it checks each head before it builds anything and yields the values (the fragments as read-only views into the
message, never copied), which one validation checks. Where it knows what to expect it compares bytes instead of
reading heads: the run's own framing as `encode` writes it (`_framing`, `_Reader.framed`) and a fragment's item
(`_Reader.fragment`). No body holds more CBOR items than a message of the run (`_items`), and a body of
`_CHECK_MIN_BYTES` or more is held to what a message of the run holds (`_run_limits`: an array of 200 million
items or a string of a gigabyte is refused from its head), so whatever a body claims, reading it builds no more
than a message of the run; `check_structure` applies the run's limits to any body.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

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
_KEYSET = frozenset(_KEYS)
# What a message of a run holds (`_run_limits`), checked for bodies of `_CHECK_MIN_BYTES` and more (a smaller one
# cannot claim much): header strings (the run id in UTF-8 at most) and bytes of framing beyond the fragments' floats
# (non-canonical heads). Any body holds at most as many CBOR items (heads, chunks too) as a message of the run
# (`_items`), and nests at most `_MAX_DEPTH` containers and tags (a message needs four: the map, frags, a fragment,
# its tag), so that reading no body costs more steps than a message of the run.
_CHECK_MIN_BYTES = 1 << 16
_MAX_HEADER_STRING = 4 * _MAX_RUN_ID
_MAX_DEPTH = 6
_HEADER_ITEMS = 64
_ITEMS_PER_FRAGMENT = 8
_FRAMING_SLACK = 1024
_FRAGMENT_ITEMS = 3  # the most items of one fragment's array: [index, values, scale or indices]
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
        return b"".join(parts)
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
    return b"".join(parts)


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


def _show(value: object, limit: int = 40) -> str:
    """A short, safe description of an untrusted decoded value for error details.

    Never calls repr/str on containers or big integers: those can be huge, deeply nested or over Python's
    int-to-str digit limit (which raises ValueError).
    """
    if type(value) is int:
        return repr(value) if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
    if type(value) is memoryview:
        value = bytes(value[:limit + 1])
    if type(value) in (str, bytes):
        text = repr(value[:limit])
        return text if len(value) <= limit else text + "..."
    if value is None or type(value) in (bool, float):
        return repr(value)
    return f"<{type(value).__name__}>"


def _finite(values: np.ndarray) -> bool:
    """No NaN or infinity; a short fragment (high K on a small model) is checked without numpy's per-call cost."""
    return all(map(math.isfinite, values.tolist())) if values.size <= 32 else bool(np.isfinite(values).all())


def _int(value: object, name: str, hi: int = _MAX_ID) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise WireError(Reason.BAD_HEADER, f"{name} must be an integer in [0, {hi}], got {_show(value)}")
    return value


def _malformed(detail: str) -> WireError:
    return WireError(Reason.MALFORMED, detail)


class _Limits(NamedTuple):
    """What one body may hold, checked at each head before anything of it is built. A small body is held only to
    CBOR's own bounds (what its bytes can hold); a large one also to what a message of the run holds
    (`_run_limits`), so that whatever its heads claim, reading it builds no more than a message of the run."""

    size: int = 1 << 64  # bytes of the body; by default more than any head can claim
    header_string: int = 1 << 64  # bytes of a string directly in the top map
    string: int = 1 << 64  # bytes of any other string (or chunk)
    frags: int = 1 << 64  # items of an array directly in the top map (the fragments)
    array: int = 1 << 64  # items of an array below that (a fragment's)
    one_map: bool = False  # a map of the message's entries at the top, and no map below it


_ANY = _Limits()
_TOO_MANY_ITEMS = WireError(Reason.MALFORMED, "more CBOR items than a message of the run holds")
# How `encode` opens a fragment's item, per codec, as `_Reader.fragment` expects it: the initial byte of the item's
# array, the head of the values' tag, the tag's number and the item's length
_FRAGMENT_HEADS = {codec: (0x80 | _CODEC_ITEMS[codec], _head(6, number), number, _CODEC_ITEMS[codec])
                   for codec, number in _CODEC_TAG.items()}
_Tag = cbor2.CBORTag  # a tag and its item (the RFC 8746 typed arrays), as cbor2 gives them
_SIMPLE = {20: False, 21: True, 22: None, 23: cbor2.undefined}
_FLOAT = {3: ">e", 5: ">f", 9: ">d"}  # a float's struct format by the size of its head


class _Reader:
    """The one reader of a message's CBOR: it checks each head against `limits` and yields the values as cbor2
    would decode them (`cbor2.loads(..., allow_duplicate_keys=False, strict_hashable_types=True,
    max_depth=_MAX_DEPTH)`), with two differences: byte strings are read-only views into the body (the fragments
    are never copied), and a tag is kept as a `cbor2.CBORTag` (bignums excepted, which are ints), since no value
    of a message is a date, a set or a shared reference. Only text and byte strings are map keys (integers
    would collide in a dict) and a key appears once; nesting stops at `_MAX_DEPTH` containers and tags, so
    no body makes it recurse further. Raises only `WireError`.

    Where it knows what to expect, it compares bytes instead of reading heads one by one, which is cheaper per
    message (bench/codec.py): a run's own framing (`framed`) and a fragment's item as `encode` writes it
    (`fragment`). Anything else, it reads head by head, to the same values and faults.
    """

    __slots__ = ("data", "view", "end", "limits", "left", "expect")

    def __init__(self, data: bytes | memoryview, limits: _Limits, codec: str = "none", items: int = 1 << 64) -> None:
        """`items`: the most CBOR items (a string's chunks count) the body may hold, as a message of the run."""
        self.data, self.view, self.end, self.limits, self.left = data, memoryview(data), len(data), limits, items
        if self.end > limits.size:
            raise WireError(Reason.TOO_LARGE, f"{self.end} bytes: no message of this run is over {limits.size} bytes")
        self.expect = _FRAGMENT_HEADS[codec]

    def message(self) -> object:
        """The body's one item; a large body's must open as a map of the message's entries."""
        if self.limits.one_map:
            major, arg, _ = self.head(0)
            if major != 5 or arg not in (-1, len(_KEYS)):
                raise WireError(Reason.BAD_HEADER, f"expected a map of {len(_KEYS)} entries at the top")
        value, pos = self.item(0, 0)
        if pos != self.end:
            raise _malformed(f"{self.end - pos} trailing bytes after the message")
        return value

    def framed(self, framing: tuple[bytes, bytes, bytes]) -> tuple[int, int, object] | None:
        """(round, sender, frags) of a body that opens with its run's own framing (`_framing`: the header as
        `encode` writes it, compared in one go instead of head by head); None for any other, read by `message`.
        What it returns or raises is what `message` and the header's checks would give (for a valid run id)."""
        data, (before_round, sender_key, after_sender) = self.data, framing
        if not data.startswith(before_round):
            return None
        major, round_, pos = self.head(len(before_round))
        if major != 0 or not data.startswith(sender_key, pos):
            return None
        major, sender, pos = self.head(pos + len(sender_key))
        if major != 0 or not data.startswith(after_sender, pos):
            return None
        pos += len(after_sender)
        major, count, after = self.head(pos)
        if major == 4 and count >= 0:  # read as `item` reads it, with one step less
            self.left -= 2 * len(_KEYS) + 1  # the map, its keys, the values before frags and frags' array
            frags, pos = self.array(count, after, 1)
        else:
            self.left -= 2 * len(_KEYS)
            frags, pos = self.item(pos, 1)
        if pos != self.end:
            raise _malformed(f"{self.end - pos} trailing bytes after the message")
        return round_, sender, frags

    def head(self, pos: int) -> tuple[int, int, int]:
        """(major type, argument or -1 for an indefinite length, position after the head)."""
        if pos >= self.end:
            raise _malformed("the CBOR item ends before its declared contents")
        initial = self.data[pos]
        info = initial & 31
        if info < 24:
            return initial >> 5, info, pos + 1
        if info < 28:
            after = pos + 1 + (1 << (info - 24))
            if after > self.end:
                raise _malformed("the CBOR item ends before its declared contents")
            return initial >> 5, int.from_bytes(self.data[pos + 1:after], "big"), after
        if info == 31 and 2 <= initial >> 5 <= 5:
            return initial >> 5, -1, pos + 1
        raise _malformed(f"not a CBOR head at byte {pos}" if info < 31 else
                         "unexpected break" if initial == 0xFF else f"indefinite length at byte {pos}")

    def item(self, pos: int, depth: int) -> tuple[object, int]:
        """The value of the item at `pos`, `depth` containers and tags down, and the position after it."""
        self.left -= 1
        if self.left < 0:
            raise _TOO_MANY_ITEMS
        if depth > _MAX_DEPTH:
            raise _malformed(f"nested more than {_MAX_DEPTH} deep")
        start = pos
        major, arg, pos = self.head(pos)
        if major == 0:
            return arg, pos
        if major == 2 or major == 3:
            return self.string(major, arg, pos, depth) if arg >= 0 else self.chunked(major, pos, depth)
        if major == 1:
            return -1 - arg, pos
        if major == 7:
            return self.simple(arg, start, pos)
        if major == 4:
            return self.array(arg, pos, depth)
        if major == 5:
            return self.map(arg, pos, depth)
        value, pos = self.item(pos, depth + 1)
        if arg == 2 or arg == 3:  # a bignum
            if type(value) is not memoryview:
                raise _malformed("a bignum must be a byte string")
            number = int.from_bytes(value, "big")
            return (number if arg == 2 else -1 - number), pos
        return _Tag(arg, value), pos

    def fragment(self, pos: int, depth: int) -> tuple[object, int]:
        """An item of an array directly in the top map. One that opens as `encode` writes a fragment of the run's
        codec (the item's array head, an index, the values' tag and a byte string within the limits) is read from
        those expected heads, anything else by `item`, which also names any fault: the same value either way."""
        data, (opening, tag, number, items) = self.data, self.expect
        if pos + 4 < self.end and data[pos] == opening and self.left >= 4:
            index, after = data[pos + 1], pos + 2
            if index >= 24:
                major, index, after = self.head(pos + 1)
                if major != 0:
                    return self.item(pos, depth)
            if data.startswith(tag, after):
                major, size, after = self.head(after + len(tag))
                if major == 2 and 0 <= size <= self.limits.string and after + size <= self.end:
                    self.left -= 4  # the item's array, its index, the tag and its byte string
                    values = _Tag(number, self.view[after:after + size])
                    if items == 2:
                        return [index, values], after + size
                    last, after = self.item(after + size, depth + 1)  # int8's scale, topk's indices
                    return [index, values, last], after
        return self.item(pos, depth)

    def string(self, major: int, size: int, pos: int, depth: int) -> tuple[object, int]:
        if size > self.end - pos:
            raise _malformed(f"a string of {size} bytes with {self.end - pos} bytes left")
        cap = self.limits.header_string if depth == 1 else self.limits.string
        if size > cap:
            raise WireError(Reason.BAD_HEADER if depth == 1 else Reason.BAD_FRAGMENT,
                            f"a string of {size} bytes where this run has at most {cap}")
        end = pos + size
        if major == 2:
            return self.view[pos:end], end
        try:
            return str(self.data[pos:end], "utf-8"), end
        except UnicodeDecodeError:
            raise _malformed(f"invalid UTF-8 in the text at byte {pos}") from None

    def chunked(self, major: int, pos: int, depth: int) -> tuple[object, int]:
        """An indefinite-length string: definite chunks of its own major type up to a break, joined."""
        chunks = []
        while pos < self.end and self.data[pos] != 0xFF:
            self.left -= 1
            if self.left < 0:
                raise _TOO_MANY_ITEMS
            kind, size, pos = self.head(pos)
            if kind != major or size < 0:
                raise _malformed(f"a chunk of major type {kind} in an indefinite string of major type {major}")
            chunk, pos = self.string(major, size, pos, depth)
            chunks.append(chunk)
        if pos >= self.end:
            raise _malformed("the CBOR item ends before its declared contents")
        return (memoryview(b"".join(chunks)) if major == 2 else "".join(chunks)), pos + 1

    def simple(self, arg: int, start: int, pos: int) -> tuple[object, int]:
        """A simple value or a float (major type 7), by the size of its head."""
        size = pos - start
        if size == 1:
            return (_SIMPLE[arg] if arg in _SIMPLE else cbor2.CBORSimpleValue(arg)), pos
        if size == 2:
            if arg < 32:
                raise _malformed(f"simple value {arg} in two bytes at byte {start}")
            return cbor2.CBORSimpleValue(arg), pos
        return struct.unpack(_FLOAT[size], self.data[start + 1:pos])[0], pos

    def array(self, count: int, pos: int, depth: int) -> tuple[list, int]:
        cap = self.limits.frags if depth == 1 else self.limits.array
        if count > cap:
            raise WireError(Reason.BAD_FRAGMENT, f"an array of {count} items where this run has at most {cap}")
        if count > self.end - pos:
            raise _malformed(f"an array of {count} items with {self.end - pos} bytes left")
        items = []
        read = self.fragment if depth == 1 else self.item
        if count >= 0:
            for _ in range(count):
                value, pos = read(pos, depth + 1)
                items.append(value)
            return items, pos
        while not self.at_break(pos):
            if len(items) == cap:
                raise WireError(Reason.BAD_FRAGMENT, f"an indefinite array of more than {cap} items")
            value, pos = read(pos, depth + 1)
            items.append(value)
        return items, pos + 1

    def map(self, count: int, pos: int, depth: int) -> tuple[dict, int]:
        if depth and self.limits.one_map:
            raise WireError(Reason.BAD_HEADER, "a map inside the message")
        if count > (self.end - pos) // 2:
            raise _malformed(f"a map of {count} entries with {self.end - pos} bytes left")
        out: dict = {}
        entries = 0
        while entries < count if count >= 0 else not self.at_break(pos):
            if count < 0 and self.limits.one_map and entries == len(_KEYS):
                raise WireError(Reason.BAD_HEADER, f"a map of more than {len(_KEYS)} entries at the top")
            entries += 1
            key, pos = self.item(pos, depth + 1)
            if type(key) is not str and type(key) is not memoryview:
                raise _malformed(f"a map key must be a text or byte string, not {_show(key)}")
            value, pos = self.item(pos, depth + 1)
            if key in out:
                raise _malformed(f"the key {_show(key)} appears twice")
            out[key] = value
        return out, pos + (count < 0)

    def at_break(self, pos: int) -> bool:
        """Whether an indefinite-length item ends at `pos` (which must be within the body)."""
        if pos >= self.end:
            raise _malformed("the CBOR item ends before its declared contents")
        return self.data[pos] == 0xFF


def max_message_bytes(fragmentation: Fragmentation, compression: Compression = _NONE) -> int:
    """The most bytes a message of this run can take: all K fragments' floats (topk: and their indices) plus
    generous framing."""
    payload = 8 * sum(map(compression.kept, fragmentation.sizes)) if compression.codec == "topk" else \
        4 * fragmentation.dim
    return payload + _ITEMS_PER_FRAGMENT * 8 * fragmentation.k + _FRAMING_SLACK


@functools.lru_cache(maxsize=4)  # every large message of a run is read against the same limits
def _run_limits(fragmentation: Fragmentation, compression: Compression) -> _Limits:
    """What a message of this run holds: no more bytes than `max_message_bytes`, a map of 8 entries at the top and
    no map below it, `frags` of at most K items and arrays of at most `_FRAGMENT_ITEMS` below that, header strings
    of at most `_MAX_HEADER_STRING` bytes and others no longer than the longest fragment."""
    longest = max(_MAX_HEADER_STRING, 4 * max(map(len, fragmentation.indices)))
    return _Limits(max_message_bytes(fragmentation, compression), _MAX_HEADER_STRING, longest, fragmentation.k,
                   _FRAGMENT_ITEMS, True)


def _items(fragmentation: Fragmentation) -> int:
    """The most CBOR items a message of this run holds (a message encoded in a way no sender here writes, such as
    byte strings in thousands of chunks, is refused too)."""
    return _HEADER_ITEMS + _ITEMS_PER_FRAGMENT * fragmentation.k


def check_structure(data: bytes | memoryview, fragmentation: Fragmentation, compression: Compression = _NONE) -> None:
    """Refuse a body that cannot be a message of this run, as `decode` refuses a large one: before anything of it
    is built beyond what a message of the run holds, whatever its heads claim. None if it may be one."""
    _Reader(data, _run_limits(fragmentation, compression), compression.codec, _items(fragmentation)).message()


def _header(obj: object, fragmentation: Fragmentation, run_id: str | None,
            compression: Compression) -> tuple[str, int, int, object]:
    """(run, round, sender, frags) of a message read head by head, its header checked, each fault named."""
    if not isinstance(obj, dict) or obj.keys() != _KEYSET:
        keys = sorted(_show(key) for key in obj)[:20] if isinstance(obj, dict) else _show(obj)
        raise WireError(Reason.BAD_HEADER, f"expected a map with keys {list(_KEYS)}, got {keys}")
    version = obj["v"]
    if type(version) is not int or version != VERSION:
        raise WireError(Reason.UNSUPPORTED_VERSION, f"format version {_show(version)} (this node speaks {VERSION})")
    run = obj["run"]
    if not isinstance(run, str) or not 0 < len(run) <= _MAX_RUN_ID:
        raise WireError(Reason.BAD_HEADER, "run must be a non-empty text of at most 128 characters")
    if run_id is not None and run != run_id:
        raise WireError(Reason.WRONG_RUN, f"message of run {_show(run)}, this node is in run {run_id!r}")
    round_, sender, k = _int(obj["round"], "round"), _int(obj["sender"], "sender"), _int(obj["k"], "k")
    if k != fragmentation.k:
        raise WireError(Reason.WRONG_K, f"message has K={k}, this run has K={fragmentation.k}")
    fp = obj["fp"]
    if type(fp) is not memoryview or fp != fragmentation.fingerprint:
        raise WireError(Reason.FOREIGN_FINGERPRINT, "the sender fragments the model differently (fingerprint mismatch)")
    dtype = CODEC_DTYPE[compression.codec]
    if type(obj["dtype"]) is not str or obj["dtype"] != dtype:
        raise WireError(Reason.BAD_DTYPE, f"dtype must be {dtype!r} (this run's --compress {compression}), got "
                        f"{_show(obj['dtype'])}")
    return run, round_, sender, obj["frags"]


def decode(data: bytes | bytearray | memoryview, fragmentation: Fragmentation, *, run_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES, compression: Compression = _NONE) -> FragmentBatch:
    """Parse and validate one message against this run's fragmentation and codec (`compression`).

    The returned fragments are read-only float32 arrays (topk: `Compressed`); for `bytes` input of an uncompressed
    run they are views into `data` (no copy), any other buffer is copied once first so that they never alias memory
    the caller may reuse. A body of `_CHECK_MIN_BYTES` or more is read against what a message of the run holds
    (`_run_limits`); a smaller one cannot claim much, and is held to CBOR's own bounds and a message's count of
    items (`_items`).
    """
    if not isinstance(data, bytes):
        try:
            view = memoryview(data)
        except TypeError:
            raise WireError(Reason.MALFORMED, f"expected a bytes-like object, got {type(data).__name__}") from None
        if view.nbytes > max_bytes:
            raise WireError(Reason.TOO_LARGE, f"{view.nbytes} bytes is over the {max_bytes}-byte limit")
        data = view.tobytes()
    size = len(data)
    if size > max_bytes:
        raise WireError(Reason.TOO_LARGE, f"{size} bytes is over the {max_bytes}-byte limit")
    limits = _run_limits(fragmentation, compression) if size >= _CHECK_MIN_BYTES else _ANY
    reader = _Reader(data, limits, compression.codec, _items(fragmentation))
    framed = None if run_id is None else reader.framed(_framing(run_id, fragmentation.k, fragmentation.fingerprint,
                                                                CODEC_DTYPE[compression.codec]))
    if framed is not None:
        run, (round_, sender, frags) = run_id, framed
        if round_ > _MAX_ID or sender > _MAX_ID:  # unsigned: only the upper bound is left to check
            round_, sender = _int(round_, "round"), _int(sender, "sender")
    else:
        run, round_, sender, frags = _header(reader.message(), fragmentation, run_id, compression)
    return FragmentBatch(run, round_, sender, fragmentation.k, fragmentation.fingerprint,
                         _fragments(frags, fragmentation, compression), compression.codec)


def _fragments(frags: object, fragmentation: Fragmentation, compression: Compression) -> dict:
    """The fragments of a message, each item checked against the run's codec and the fragment's size, as float32
    values (views of the message's bytes for `none`) or, for topk, a `Compressed`."""
    codec, k, coordinates = compression.codec, fragmentation.k, fragmentation.indices
    if type(frags) is not list or not 0 < len(frags) <= k:
        raise WireError(Reason.BAD_FRAGMENT, f"frags must be a list of 1 to {k} fragments")
    items, tag_of_values, dtype = _CODEC_ITEMS[codec], _CODEC_TAG[codec], _CODEC_NUMPY[codec]
    fragments: dict[int, np.ndarray | Compressed] = {}
    for item in frags:
        if type(item) is not list or len(item) != items or type(item[1]) is not _Tag:
            raise WireError(Reason.BAD_FRAGMENT, f"each fragment of a {codec} message must be a list of {items} "
                            "items: [index, typed array" + (", scale]" if codec == "int8" else
                                                            ", indices]" if codec == "topk" else "]"))
        index = item[0]
        if type(index) is not int or not 0 <= index < k:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment index must be in [0, {k}), got {_show(index)}")
        if index in fragments:
            # the message itself is wrong (400), not a conflict with what the receiver holds (duplicate_fragment)
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} appears twice in the message")
        size = len(coordinates[index])
        values = _typed(item[1], tag_of_values, dtype, size if codec != "topk" else compression.kept(size), index,
                        "values")
        if codec != "none":
            fragments[index] = _compressed(item, index, size, values, codec)
        elif _finite(values):
            fragments[index] = values
        else:
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
    return fragments


def _compressed(item: list, index: int, size: int, values: np.ndarray, codec: str) -> np.ndarray | Compressed:
    """A compressed fragment (its item's values already checked): topk's indices exactly the coordinates it keeps,
    ascending and in range, int8's scale a positive float; the dense codecs' values as float32."""
    if codec == "topk":
        if not _finite(values):
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
        indices = _typed(item[2], TAG_UINT32_LE, _UINT32, len(values), index, "indices")
        if len(indices) and (int(indices[-1]) >= size or not bool(np.all(indices[1:] > indices[:-1]))):
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s indices must ascend within [0, {size})")
        return Compressed("topk", size, values, indices)
    scale = 1.0
    if codec == "int8":
        scale = item[2]
        if type(scale) is not float or not (math.isfinite(scale) and scale > 0):
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s scale must be a positive finite float")
    dense = decompress(Compressed(codec, size, values, scale=scale))[1]
    if not _finite(dense):
        raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
    return dense


_UINT32 = np.dtype("<u4")


def _typed(tag: object, number: int, dtype: np.dtype, count: int, index: int, what: str) -> np.ndarray:
    """The `count` values of an RFC 8746 typed array of tag `number` (a view of the message's bytes)."""
    if type(tag) is not _Tag or tag.tag != number or type(tag.value) is not memoryview:
        raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s {what} must be a tag-{number} typed array")
    if len(tag.value) != count * dtype.itemsize:
        raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s {what} take {len(tag.value)} bytes, expected "
                        f"{count * dtype.itemsize}")
    return np.frombuffer(tag.value, dtype)

"""The wire format: one CBOR message per (sender, receiver, round), carrying every fragment for that peer.

    {"v": 1, "run": text, "round": uint, "sender": uint, "k": uint, "fp": bytes(8), "dtype": "<f4",
     "frags": [[index, 85(bytes)], ...]}      85 = RFC 8746 typed array, float32 little-endian

A run with `--compress` names its codec in "dtype" and sends each fragment as that codec's item (RFC 8746 tags):
"fp16" [index, 84(float16 LE)], "bf16" [index, 69(uint16 LE: bfloat16 bits)], "int8" [index, 72(sint8), scale
(float32)], "topk" [index, 85(float32 LE values), 70(uint32 LE indices, ascending)]. A receiver takes only its
run's codec; dense codecs decode to float32 fragments, topk to a `Compressed` (the coordinates it carries).

Encoding writes the CBOR framing by hand around the fragments' own buffers (one copy into the
message); decoding trusts nothing and raises only `WireError`. Messages of `_ZERO_COPY_MIN_BYTES` and more
that are laid out exactly as `encode` writes them are parsed without copying the fragments (the arrays are
read-only views into the message); anything else goes through cbor2. Both feed the same validation.
Before a message of `_CHECK_MIN_BYTES` or more goes to cbor2, `check_structure` reads its CBOR heads only and
refuses what cannot be a message of this run (an array of 200 million items, a string of a gigabyte), so cbor2
never allocates in proportion to what a body claims.
"""

from __future__ import annotations

import functools
import io
import math
import re
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
# Messages at least this big are parsed by `_fast_parse` (no copy of the fragments); cbor2 is quicker below.
_ZERO_COPY_MIN_BYTES = 1 << 16
# What `check_structure` lets a message hold: header strings (the run id in UTF-8 at most), nesting (a tag counts),
# CBOR items (heads) per fragment, and bytes of framing beyond the fragments' floats (non-canonical heads).
_CHECK_MIN_BYTES = 1 << 16  # smaller bodies go to cbor2 as they are: they cannot claim much
_MAX_HEADER_STRING = 4 * _MAX_RUN_ID
_MAX_DEPTH = 6
_ITEMS_PER_FRAGMENT = 8
_FRAMING_SLACK = 1024
_FRAGMENT_ITEMS = 3  # the most items of one fragment's array: [index, values, scale or indices]
# "dtype" of each codec's messages, and the RFC 8746 tag of its values (topk's indices: TAG_UINT32_LE)
CODEC_DTYPE = {"none": DTYPE, "fp16": "fp16", "bf16": "bf16", "int8": "int8", "topk": "topk"}
_CODEC_TAG = {"none": TAG_FLOAT32_LE, "fp16": 84, "bf16": 69, "int8": 72, "topk": TAG_FLOAT32_LE}
_CODEC_NUMPY = {"none": "<f4", "fp16": "<f2", "bf16": "<u2", "int8": "i1", "topk": "<f4"}
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


class _Span(NamedTuple):
    """Where the fast path found a tag-85 byte string inside the message (so its bytes are not copied)."""

    offset: int
    length: int


# Definite-length CBOR heads (an initial byte, then 0, 1, 2, 4 or 8 bytes of argument), as `_head_at` reads them:
# unsigned integers, byte strings, arrays. A run's messages and their fragment items are matched by one regular
# expression each instead of head by head, which is cheaper per message (bench/codec.py).
_UINT = rb"([\x00-\x17]|\x18.|\x19..|\x1a.{4}|\x1b.{8})"
_BYTES_HEAD = rb"([\x40-\x57]|\x58.|\x59..|\x5a.{4}|\x5b.{8})"
_ARRAY_HEAD = rb"([\x80-\x97]|\x98.|\x99..|\x9a.{4}|\x9b.{8})"
_FRAGMENT_ITEM = re.compile(rb"\x82" + _UINT + rb"\xd8\x55" + _BYTES_HEAD, re.S)  # [index, tag 85 (bytes)]


def _arg(head: bytes) -> int:
    """The argument of a head matched by `_UINT`, `_BYTES_HEAD` or `_ARRAY_HEAD`."""
    return head[0] & 31 if len(head) == 1 else int.from_bytes(head[1:], "big")


def _head_at(data: bytes, pos: int) -> tuple[int, int, int] | None:
    """(major type, argument, position after the head) of a definite-length CBOR head, or None."""
    if pos >= len(data):
        return None
    initial = data[pos]
    info = initial & 31
    if info < 24:
        return initial >> 5, info, pos + 1
    if info > 27:
        return None
    end = pos + 1 + (1 << (info - 24))
    if end > len(data):
        return None
    return initial >> 5, int.from_bytes(data[pos + 1:end], "big"), end


def _fast_parse(data: bytes, max_frags: int = _MAX_ID) -> dict | None:
    """The message as decoded objects, for exactly the canonical layout `encode` writes; None for anything else.

    It only recognises well-formed CBOR (it gives up on anything it does not expect), so every message it
    parses is one cbor2 would decode to the same objects; the validation that follows is shared. The
    fragments' byte strings are not copied: they are returned as `_Span`s into `data`.
    """
    if not data or data[0] != 0xA0 | len(_KEYS):
        return None
    pos, obj = 1, {}
    for key, raw_key in _KEY_CBOR:
        if not data.startswith(raw_key, pos):
            return None
        head = _head_at(data, pos + len(raw_key))
        if head is None:
            return None
        major, arg, pos = head
        if key == "frags":
            break
        if major == 0:
            obj[key] = arg
        elif major in (2, 3):
            if arg > _MAX_HEADER_STRING or pos + arg > len(data):
                return None
            raw = data[pos:pos + arg]
            pos += arg
            if major == 2:
                obj[key] = raw
            else:
                try:
                    obj[key] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    return None
        else:
            return None
    frags = _fragment_spans(data, major, arg, pos, max_frags)
    if frags is None:
        return None
    obj["frags"] = frags
    return obj


def _fragment_spans(data: bytes, major: int, count: int, pos: int, max_frags: int) -> list | None:
    """The `frags` array whose head (`major`, `count`) ends at `pos`, as [index, _Span] pairs, if it is laid out as
    `encode` writes it and ends the message; None otherwise."""
    if major != 4 or count > max_frags or count * 4 > len(data) - pos:  # every fragment item takes >= 4 bytes
        return None
    frags = []
    item = _FRAGMENT_ITEM.match
    for _ in range(count):
        found = item(data, pos)
        if found is None:
            return None
        index, head = found.groups()
        start, length = found.end(), _arg(head)
        pos = start + length
        if pos > len(data):
            return None
        frags.append([_arg(index), _Span(start, length)])
    return frags if pos == len(data) else None


def _run_parse(data: bytes, run_id: str, fragmentation: Fragmentation) -> tuple[int, int, list] | None:
    """(round, sender, fragment spans) of a message laid out exactly as `encode` writes this run's messages: the
    framing around round and sender is the run's own bytes (version, run id, K, fingerprint and dtype compared
    in one go), so most messages skip cbor2 and the header's checks. None for anything else."""
    found = _run_layout(run_id, fragmentation.k, fragmentation.fingerprint).match(data)
    if found is None:
        return None
    round_, sender, count = found.groups()
    spans = _fragment_spans(data, 4, _arg(count), found.end(), fragmentation.k)
    return None if spans is None else (_arg(round_), _arg(sender), spans)


@functools.lru_cache(maxsize=256)
def _run_layout(run_id: str, k: int, fingerprint: bytes) -> re.Pattern[bytes]:
    """A run's message up to its fragments: the run's framing, round, sender and the head of `frags`."""
    before_round, sender_key, after_sender = _framing(run_id, k, fingerprint)
    return re.compile(re.escape(before_round) + _UINT + re.escape(sender_key) + _UINT + re.escape(after_sender)
                      + _ARRAY_HEAD, re.S)


_FRAGMENT_VALUE = (cbor2.CBORTag, _Span)  # what a fragment's values decode to: cbor2's tag, or the fast path's span


def max_message_bytes(fragmentation: Fragmentation, compression: Compression = _NONE) -> int:
    """The most bytes a message of this run can take: all K fragments' floats (topk: and their indices) plus
    generous framing."""
    payload = 8 * sum(map(compression.kept, fragmentation.sizes)) if compression.codec == "topk" else \
        4 * fragmentation.dim
    return payload + _ITEMS_PER_FRAGMENT * 8 * fragmentation.k + _FRAMING_SLACK


def check_structure(data: bytes | memoryview, fragmentation: Fragmentation, compression: Compression = _NONE) -> None:
    """Refuse, from its CBOR heads alone, a body that cannot be a message of this run; None if it may be one.

    Only heads are read and strings skipped, and it stops at the first head beyond what a message of this run
    holds: a map of 8 entries at the top and no map below it, `frags` of at most K items, pairs below that,
    nesting of at most `_MAX_DEPTH`, `_ITEMS_PER_FRAGMENT` items per fragment, header strings of at most
    `_MAX_HEADER_STRING` bytes and others no longer than the longest fragment. So a body's claims cost nothing
    before it is refused, and what passes decodes (cbor2) into O(K) objects whatever its size. (A message of the
    run encoded in a way no sender here writes, such as byte strings in thousands of chunks, is refused too.)
    """
    limit = max_message_bytes(fragmentation, compression)
    if len(data) > limit:
        raise WireError(Reason.TOO_LARGE, f"{len(data)} bytes: no message of this run is over {limit} bytes")
    k = fragmentation.k
    budget = 64 + _ITEMS_PER_FRAGMENT * k
    longest = max(_MAX_HEADER_STRING, 4 * max(len(ix) for ix in fragmentation.indices))
    stack: list[list[int]] = []  # open containers, tags and chunked strings: [items left or -1, major, items so far]
    pos, items, end = 0, 0, len(data)
    while True:
        if pos >= end:
            raise WireError(Reason.MALFORMED, "the CBOR item ends before its declared contents")
        if data[pos] == 0xFF:  # the end of an indefinite-length item
            if not stack or stack[-1][0] != -1:
                raise WireError(Reason.MALFORMED, f"unexpected break at byte {pos}")
            stack.pop()
            pos += 1
        else:
            items += 1
            if items > budget:
                raise WireError(Reason.MALFORMED, f"more than {budget} CBOR items: no message of K={k} has as many")
            major, arg, pos = _structure_head(data, pos)
            if _opens(stack, major, arg, pos, end, k, longest):
                continue
            if major in (2, 3) and arg >= 0:
                pos += arg
        if _close(stack, k):
            break
    if pos != end:
        raise WireError(Reason.MALFORMED, f"{end - pos} trailing bytes after the message")


def _structure_head(data: bytes | memoryview, pos: int) -> tuple[int, int, int]:
    """(major, argument or -1 for an indefinite length, position after the head) for `check_structure`."""
    initial = data[pos]
    if initial & 31 == 31:
        if initial >> 5 not in (2, 3, 4, 5):
            raise WireError(Reason.MALFORMED, f"indefinite length on major type {initial >> 5} at byte {pos}")
        return initial >> 5, -1, pos + 1
    head = _head_at(bytes(data[pos:pos + 9]), 0)
    if head is None:
        raise WireError(Reason.MALFORMED, f"not a CBOR head at byte {pos}")
    return head[0], head[1], pos + head[2]


def _opens(stack: list[list[int]], major: int, arg: int, pos: int, end: int, k: int, longest: int) -> bool:
    """Check one head against where it stands; True if it opened something whose items follow."""
    depth = len(stack)
    if depth >= _MAX_DEPTH:
        raise WireError(Reason.MALFORMED, f"nested more than {_MAX_DEPTH} deep")
    if depth == 0 and (major != 5 or arg not in (-1, len(_KEYS))):
        raise WireError(Reason.BAD_HEADER, f"expected a map of {len(_KEYS)} entries at the top")
    if major in (2, 3):
        cap = _MAX_HEADER_STRING if depth == 1 else longest
        if arg > end - pos:
            raise WireError(Reason.MALFORMED, f"a string of {arg} bytes with {end - pos} bytes left")
        if arg > cap:
            raise WireError(Reason.BAD_FRAGMENT if depth > 1 else Reason.BAD_HEADER,
                            f"a string of {arg} bytes where this run has at most {cap}")
        if arg < 0:
            stack.append([-1, major, 0])
        return arg < 0
    if major == 5 and depth > 0:
        raise WireError(Reason.BAD_HEADER, "a map inside the message")
    if major == 4:
        cap = k if depth == 1 else _FRAGMENT_ITEMS
        if arg > cap:
            raise WireError(Reason.BAD_FRAGMENT, f"an array of {arg} items where this run has at most {cap}")
    if major == 6 or (major in (4, 5) and arg != 0):  # a tag wraps one item
        stack.append([-1 if arg < 0 else (1 if major == 6 else arg * (2 if major == 5 else 1)), major, 0])
        return True
    return False


def _close(stack: list[list[int]], k: int) -> bool:
    """One item is complete: count it in the containers it ends; True when the top-level item is complete."""
    while stack:
        top = stack[-1]
        if top[0] == -1:  # indefinite: bounded by count
            top[2] += 1
            cap = (2 * len(_KEYS) if len(stack) == 1 else k if len(stack) == 2 else _FRAGMENT_ITEMS) \
                if top[1] in (4, 5) else None
            if cap is not None and top[2] > cap:
                raise WireError(Reason.BAD_FRAGMENT, f"an indefinite container of more than {cap} items")
            return False
        top[0] -= 1
        if top[0] > 0:
            return False
        stack.pop()
    return True


def _slow_parse(data: bytes) -> dict:
    """Any CBOR through cbor2 (which copies byte strings); WireError unless it is one item with no trailing bytes."""
    stream = io.BytesIO(data)
    try:
        # strict_hashable_types: only text/byte-string map keys, so no hash-collision flood (ints collide freely);
        # allow_duplicate_keys=False: a message has exactly one value per key.
        obj = cbor2.CBORDecoder(stream, allow_duplicate_keys=False, strict_hashable_types=True).decode()
    except Exception as exc:  # cbor2 raises several types (and RecursionError on deep nesting)
        raise WireError(Reason.MALFORMED, f"not a CBOR item: {type(exc).__name__}") from None
    if stream.tell() != len(data):
        raise WireError(Reason.MALFORMED, f"{len(data) - stream.tell()} trailing bytes after the message")
    return obj


def _header(data: bytes, fragmentation: Fragmentation, run_id: str | None,
            compression: Compression) -> tuple[str, int, int, int, bytes, list]:
    """Any message that is not laid out as this run's `encode` writes it: parsed (zero-copy when large and
    canonical, else cbor2 after `check_structure`) and its header checked, each fault named."""
    obj = _fast_parse(data, fragmentation.k) if len(data) >= _ZERO_COPY_MIN_BYTES else None
    if obj is None:
        if len(data) >= _CHECK_MIN_BYTES:
            check_structure(data, fragmentation, compression)
        obj = _slow_parse(data)
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
    if type(fp) is not bytes or fp != fragmentation.fingerprint:
        raise WireError(Reason.FOREIGN_FINGERPRINT, "the sender fragments the model differently (fingerprint mismatch)")
    dtype = CODEC_DTYPE[compression.codec]
    if type(obj["dtype"]) is not str or obj["dtype"] != dtype:
        raise WireError(Reason.BAD_DTYPE, f"dtype must be {dtype!r} (this run's --compress {compression}), got "
                        f"{_show(obj['dtype'])}")
    frags = obj["frags"]
    if not isinstance(frags, list):
        raise WireError(Reason.BAD_FRAGMENT, f"frags must be a list of 1 to {k} fragments")
    return run, round_, sender, k, fp, frags


def decode(data: bytes | bytearray | memoryview, fragmentation: Fragmentation, *, run_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES, compression: Compression = _NONE) -> FragmentBatch:
    """Parse and validate one message against this run's fragmentation and codec (`compression`).

    The returned fragments are read-only float32 arrays (topk: `Compressed`); for `bytes` input of an uncompressed
    run they are views into `data` (no copy), any other buffer is copied once first so that they never alias memory
    the caller may reuse.
    """
    if not isinstance(data, bytes):
        try:
            view = memoryview(data)
        except TypeError:
            raise WireError(Reason.MALFORMED, f"expected a bytes-like object, got {type(data).__name__}") from None
        if view.nbytes > max_bytes:
            raise WireError(Reason.TOO_LARGE, f"{view.nbytes} bytes is over the {max_bytes}-byte limit")
        data = view.tobytes()
    if len(data) > max_bytes:
        raise WireError(Reason.TOO_LARGE, f"{len(data)} bytes is over the {max_bytes}-byte limit")
    parsed = _run_parse(data, run_id, fragmentation) if run_id is not None and compression.codec == "none" else None
    if parsed is not None:
        run, (round_, sender, frags), k, fp = run_id, parsed, fragmentation.k, fragmentation.fingerprint
        round_, sender = _int(round_, "round"), _int(sender, "sender")
    else:
        run, round_, sender, k, fp, frags = _header(data, fragmentation, run_id, compression)
    if not 0 < len(frags) <= k:
        raise WireError(Reason.BAD_FRAGMENT, f"frags must be a list of 1 to {k} fragments")
    if compression.codec != "none":
        return FragmentBatch(run, round_, sender, k, fp, _compressed(frags, fragmentation, compression),
                             compression.codec)
    fragments: dict[int, np.ndarray] = {}
    for item in frags:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], _FRAGMENT_VALUE)):
            raise WireError(Reason.BAD_FRAGMENT, "each fragment must be [index, typed array]")
        index, tag = item
        if type(index) is not int or not 0 <= index < k:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment index must be in [0, {k}), got {_show(index)}")
        if index in fragments:
            raise WireError(Reason.DUPLICATE_FRAGMENT, f"fragment {index} appears twice")
        if isinstance(tag, _Span):
            buffer, offset, nbytes = data, tag.offset, tag.length
        elif tag.tag == TAG_FLOAT32_LE and isinstance(tag.value, bytes):
            buffer, offset, nbytes = tag.value, 0, len(tag.value)
        else:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} is not a tag-85 float32 typed array")
        expected = len(fragmentation.indices[index]) * 4
        if nbytes != expected:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment {index} has {nbytes} bytes, expected {expected}")
        values = np.frombuffer(buffer, dtype=DTYPE, count=nbytes // 4, offset=offset)
        if not _finite(values):
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
        fragments[index] = values
    return FragmentBatch(run, round_, sender, k, fp, fragments)


def _compressed(frags: list, fragmentation: Fragmentation, compression: Compression) -> dict:
    """A compressed message's fragments (cbor2 decoded them): each item checked against the run's codec and the
    fragment's size (topk: exactly the coordinates it keeps, ascending and in range), as float32 values or, for
    topk, a `Compressed`."""
    codec, k = compression.codec, fragmentation.k
    items, tag_of_values, dtype = _CODEC_ITEMS[codec], _CODEC_TAG[codec], _CODEC_NUMPY[codec]
    fragments: dict[int, np.ndarray | Compressed] = {}
    for item in frags:
        if not (isinstance(item, list) and len(item) == items and isinstance(item[1], cbor2.CBORTag)):
            raise WireError(Reason.BAD_FRAGMENT, f"each fragment of a {codec} message must be a list of {items} "
                            "items: [index, typed array" + (", scale]" if codec == "int8" else
                                                            ", indices]" if codec == "topk" else "]"))
        index, tag = item[0], item[1]
        if type(index) is not int or not 0 <= index < k:
            raise WireError(Reason.BAD_FRAGMENT, f"fragment index must be in [0, {k}), got {_show(index)}")
        if index in fragments:
            raise WireError(Reason.DUPLICATE_FRAGMENT, f"fragment {index} appears twice")
        size = len(fragmentation.indices[index])
        count = compression.kept(size)
        values = _typed(tag, tag_of_values, dtype, count, f"fragment {index}'s values")
        if codec == "topk":
            indices = _typed(item[2], TAG_UINT32_LE, "<u4", count, f"fragment {index}'s indices")
            if count and (int(indices[-1]) >= size or (count > 1 and not bool(np.all(indices[1:] > indices[:-1])))):
                raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s indices must ascend within [0, {size})")
            if not _finite(values):
                raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
            fragments[index] = Compressed("topk", size, values, indices)
            continue
        scale = 1.0
        if codec == "int8":
            scale = item[2]
            if type(scale) is not float or not (math.isfinite(scale) and scale > 0):
                raise WireError(Reason.BAD_FRAGMENT, f"fragment {index}'s scale must be a positive finite float")
        dense = decompress(Compressed(codec, size, values, scale=scale))[1]
        if not _finite(dense):
            raise WireError(Reason.NON_FINITE, f"fragment {index} holds NaN or infinite values")
        fragments[index] = dense
    return fragments


def _typed(tag: object, number: int, dtype: str, count: int, what: str) -> np.ndarray:
    """The `count` values of an RFC 8746 typed array of tag `number`."""
    width = np.dtype(dtype).itemsize
    if not (isinstance(tag, cbor2.CBORTag) and tag.tag == number and type(tag.value) is bytes):
        raise WireError(Reason.BAD_FRAGMENT, f"{what} must be a tag-{number} typed array")
    if len(tag.value) != count * width:
        raise WireError(Reason.BAD_FRAGMENT, f"{what} take {len(tag.value)} bytes, expected {count * width}")
    return np.frombuffer(tag.value, dtype=dtype)

"""The wire codec: exact round trips, one refusal reason per class of bad input, and fuzz tests against cbor2.

`decode` reads a message with one CBOR reader (`wire._Reader`), which compares the heads it expects (the run's
framing, `_Reader.framed`; a fragment's heads as `encode` writes them, `_Reader.fragment`) before it reads head
by head. Every test that decodes runs both ways (the `path` parameter: "framing", or "heads" with both
expectations off), and the fuzz tests check both against cbor2, the reference, with the same settings.
"""

from __future__ import annotations

import io
import math
import struct
import time
import tracemalloc
from collections.abc import Callable
from typing import Any
from unittest import mock

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import Fragmentation, FragmentBatch, Layout, Reason, WireError, decode, encode, wire
from mosaic_proto.compression import Compression

PATHS = ("framing", "heads")
NONE = Compression()
RUN = "run-1"
FR = Fragmentation.build(Layout.flat(40), 4, seed=7)  # four fragments of 10 floats
OTHER_FP = Fragmentation.build(Layout.flat(40), 4, seed=8).fingerprint


def decode_via(path: str, data: Any, fragmentation: Fragmentation = FR, **kwargs: Any) -> FragmentBatch:
    """decode() as it is ("framing"), or reading every head one by one ("heads")."""
    if path == "framing":
        return decode(data, fragmentation, **kwargs)
    with mock.patch.object(wire._Reader, "framed", lambda self, framing: None), \
            mock.patch.object(wire._Reader, "fragment", wire._Reader.item):
        return decode(data, fragmentation, **kwargs)


def values(f: int, n: int | None = None) -> np.ndarray:
    n = FR.sizes[f] if n is None else n
    return (np.arange(n, dtype=np.float32) + 100 * f) / 7


def tag(array: Any) -> cbor2.CBORTag:
    return cbor2.CBORTag(85, np.asarray(array, dtype="<f4").tobytes())


def fields(**overrides: Any) -> dict:
    base = {"v": 1, "run": RUN, "round": 5, "sender": 2, "k": 4, "fp": FR.fingerprint, "dtype": "<f4",
            "frags": [[0, tag(values(0))], [2, tag(values(2))]]}
    base.update(overrides)
    return base


def message(**overrides: Any) -> bytes:
    return cbor2.dumps(fields(**overrides))


GOOD = message()


def same_batch(a: FragmentBatch, b: FragmentBatch) -> bool:
    return ((a.run_id, a.round, a.sender, a.k, a.fingerprint) == (b.run_id, b.round, b.sender, b.k, b.fingerprint)
            and a.fragments.keys() == b.fragments.keys()
            and all(np.array_equal(a.fragments[f].view(np.uint32), b.fragments[f].view(np.uint32))
                    for f in a.fragments))


# -- round trips ------------------------------------------------------------------------------------------

@st.composite
def batches(draw: st.DrawFn) -> tuple[FragmentBatch, Fragmentation]:
    d = draw(st.integers(1, 300))
    k = draw(st.integers(1, min(d, 16)))
    fr = Fragmentation.build(Layout.flat(d), k, draw(st.integers(0, 2**32)))
    chosen = draw(st.sets(st.integers(0, k - 1), min_size=1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.1754944e-38], np.float32)
    frags = {}
    for f in chosen:
        v = (rng.standard_normal(fr.sizes[f]) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        v[rng.random(len(v)) < 0.2] = rng.choice(special)
        frags[f] = v
    run = draw(st.text(min_size=1, max_size=128))
    batch = FragmentBatch(run, draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1)), k,
                          fr.fingerprint, frags)
    return batch, fr


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=60, deadline=None)
@given(case=batches())
def test_round_trip_is_exact(path: str, case: tuple[FragmentBatch, Fragmentation]) -> None:
    batch, fr = case
    data = encode(batch)
    back = decode_via(path, data, fr, run_id=batch.run_id)
    assert same_batch(back, batch)
    assert back.floats == batch.floats == sum(fr.sizes[f] for f in batch.fragments)
    assert all(v.dtype == np.float32 and not v.flags.writeable for v in back.fragments.values())
    assert encode(back) == data


@settings(max_examples=40, deadline=None)
@given(case=batches())
def test_encoding_is_canonical_cbor(case: tuple[FragmentBatch, Fragmentation]) -> None:
    """The hand-written framing is byte for byte what cbor2 writes for the documented structure."""
    batch, _ = case
    expected = cbor2.dumps({"v": 1, "run": batch.run_id, "round": batch.round, "sender": batch.sender,
                            "k": batch.k, "fp": batch.fingerprint, "dtype": "<f4",
                            "frags": [[f, tag(batch.fragments[f])] for f in sorted(batch.fragments)]})
    assert encode(batch) == expected


def test_encode_converts_and_sorts_fragments() -> None:
    batch = FragmentBatch(RUN, 5, 2, 4, FR.fingerprint, {2: values(2).astype(np.float64), 0: values(0)[::-1][::-1]})
    assert encode(batch) == GOOD
    assert message() == GOOD


@pytest.mark.parametrize("path", PATHS)
def test_decode_accepts_any_bytes_like_input(path: str) -> None:
    expected = decode_via(path, GOOD)
    for data in (bytearray(GOOD), memoryview(GOOD), memoryview(bytearray(GOOD))):
        assert same_batch(decode_via(path, data), expected)
    assert decode_via(path, GOOD, run_id=None).run_id == RUN


@pytest.mark.parametrize("path", PATHS)
def test_fragments_never_alias_a_mutable_input(path: str) -> None:
    buffer = bytearray(GOOD)
    batch = decode_via(path, buffer)
    before = {f: v.copy() for f, v in batch.fragments.items()}
    buffer[-8:] = b"\xff" * 8
    assert all(np.array_equal(before[f], batch.fragments[f]) for f in before)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [10, wire._CHECK_MIN_BYTES])  # floats: a small message, one over the threshold
def test_messages_are_decoded_without_copying_the_fragments(path: str, n: int) -> None:
    fr = Fragmentation.build(Layout.flat(n), 1, 0)
    data = encode(FragmentBatch(RUN, 0, 1, 1, fr.fingerprint, {0: np.ones(n, np.float32)}))
    batch = decode_via(path, data, fr)
    assert np.shares_memory(batch.fragments[0], np.frombuffer(data, np.uint8))
    assert not batch.fragments[0].flags.writeable


def indefinite(obj: Any) -> bytes:
    """`obj` in CBOR with every map and array of indefinite length and every byte string in two chunks."""
    if isinstance(obj, dict):
        return b"\xbf" + b"".join(indefinite(k) + indefinite(v) for k, v in obj.items()) + b"\xff"
    if isinstance(obj, list):
        return b"\x9f" + b"".join(indefinite(v) for v in obj) + b"\xff"
    if isinstance(obj, cbor2.CBORTag):
        return cbor2.dumps(cbor2.CBORTag(obj.tag, None))[:-1] + indefinite(obj.value)
    if isinstance(obj, bytes):
        return b"\x5f" + cbor2.dumps(obj[:3]) + cbor2.dumps(obj[3:]) + b"\xff"
    return cbor2.dumps(obj)


def long_heads(obj: Any) -> bytes:
    """`obj` in CBOR with every head's argument in eight bytes and every integer a bignum (valid, not canonical)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return b"\xc2\x5b" + (8).to_bytes(8, "big") + obj.to_bytes(8, "big")
    def head(major: int, n: int) -> bytes:
        return bytes([major << 5 | 27]) + n.to_bytes(8, "big")
    if isinstance(obj, dict):
        return head(5, len(obj)) + b"".join(long_heads(k) + long_heads(v) for k, v in obj.items())
    if isinstance(obj, list):
        return head(4, len(obj)) + b"".join(long_heads(v) for v in obj)
    if isinstance(obj, cbor2.CBORTag):
        return head(6, obj.tag) + long_heads(obj.value)
    if isinstance(obj, str):
        return head(3, len(obj.encode())) + obj.encode()
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    return cbor2.dumps(obj)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fr", [FR, Fragmentation.build(Layout.flat(1 << 16), 4, seed=7)], ids=["small", "large"])
def test_any_valid_encoding_decodes_to_the_same_batch(path: str, fr: Fragmentation) -> None:
    """Indefinite lengths, chunked strings, long heads, bignums, keys in another order: what encode never writes is
    read all the same."""
    sent = FragmentBatch(RUN, 5, 2, 4, fr.fingerprint, {f: values(f, len(fr.indices[f])) for f in (0, 3)})
    obj = cbor2.loads(encode(sent))
    for data in (indefinite(obj), long_heads(obj), cbor2.dumps(dict(reversed(obj.items())))):
        assert same_batch(decode_via(path, data, fr, run_id=RUN), sent)
        assert (len(data) >= wire._CHECK_MIN_BYTES) == (fr is not FR)


# -- one test per class of malformed input -------------------------------------------------------------------

def raw_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A CBOR map written pair by pair (so it may repeat keys)."""
    assert len(pairs) < 24
    return bytes([0xA0 | len(pairs)]) + b"".join(cbor2.dumps(k) + cbor2.dumps(v) for k, v in pairs)


def without(key: str) -> bytes:
    return cbor2.dumps({k: v for k, v in fields().items() if k != key})


CASES: list[tuple[str, Callable[[], bytes], Reason]] = [
    # not CBOR / truncated
    ("empty", lambda: b"", Reason.MALFORMED),
    ("break_byte", lambda: b"\xff", Reason.MALFORMED),
    ("reserved_info", lambda: b"\x1c", Reason.MALFORMED),
    ("bad_utf8_text", lambda: b"\x62\xff\xfe", Reason.MALFORMED),
    ("truncated_by_one", lambda: GOOD[:-1], Reason.MALFORMED),
    ("truncated_in_header", lambda: GOOD[:12], Reason.MALFORMED),
    ("truncated_to_one_byte", lambda: GOOD[:1], Reason.MALFORMED),
    ("too_deep", lambda: b"\x81" * 1000 + b"\x00", Reason.MALFORMED),
    ("claims_huge_array", lambda: b"\x9b" + (2**40).to_bytes(8, "big"), Reason.MALFORMED),
    # trailing bytes
    ("trailing_zero", lambda: GOOD + b"\x00", Reason.MALFORMED),
    ("two_messages", lambda: GOOD + GOOD, Reason.MALFORMED),
    # not a map / missing key / extra key / repeated key / non-text key
    ("array", lambda: cbor2.dumps([1, 2, 3]), Reason.BAD_HEADER),
    ("integer", lambda: cbor2.dumps(5), Reason.BAD_HEADER),
    ("text", lambda: cbor2.dumps("v"), Reason.BAD_HEADER),
    ("null", lambda: cbor2.dumps(None), Reason.BAD_HEADER),
    ("typed_array_alone", lambda: cbor2.dumps(tag(values(0))), Reason.BAD_HEADER),
    ("empty_map", lambda: cbor2.dumps({}), Reason.BAD_HEADER),
    *[(f"missing_{key}", lambda key=key: without(key), Reason.BAD_HEADER) for key in fields()],
    ("extra_key", lambda: message(extra=1), Reason.BAD_HEADER),
    ("renamed_key", lambda: cbor2.dumps({("V" if k == "v" else k): v for k, v in fields().items()}),
     Reason.BAD_HEADER),
    ("repeated_key", lambda: raw_map([*fields().items(), ("round", 5)]), Reason.MALFORMED),
    ("integer_key", lambda: cbor2.dumps({**fields(), 1: 2}), Reason.MALFORMED),
    # unknown version
    ("version_2", lambda: message(v=2), Reason.UNSUPPORTED_VERSION),
    ("version_0", lambda: message(v=0), Reason.UNSUPPORTED_VERSION),
    ("version_text", lambda: message(v="1"), Reason.UNSUPPORTED_VERSION),
    ("version_float", lambda: message(v=1.0), Reason.UNSUPPORTED_VERSION),
    ("version_bool", lambda: message(v=True), Reason.UNSUPPORTED_VERSION),
    ("version_bignum", lambda: message(v=10**6000), Reason.UNSUPPORTED_VERSION),
    # run id
    ("wrong_run", lambda: message(run="run-2"), Reason.WRONG_RUN),
    ("empty_run", lambda: message(run=""), Reason.BAD_HEADER),
    ("long_run", lambda: message(run="r" * 129), Reason.BAD_HEADER),
    ("run_as_bytes", lambda: message(run=RUN.encode()), Reason.BAD_HEADER),
    # K
    ("k_3", lambda: message(k=3), Reason.WRONG_K),
    ("k_5", lambda: message(k=5), Reason.WRONG_K),
    ("k_negative", lambda: message(k=-4), Reason.BAD_HEADER),
    ("k_text", lambda: message(k="4"), Reason.BAD_HEADER),
    # fingerprint
    ("foreign_fp", lambda: message(fp=OTHER_FP), Reason.FOREIGN_FINGERPRINT),
    ("short_fp", lambda: message(fp=FR.fingerprint[:4]), Reason.FOREIGN_FINGERPRINT),
    ("fp_as_hex_text", lambda: message(fp=FR.fingerprint.hex()), Reason.FOREIGN_FINGERPRINT),
    ("fp_as_array", lambda: message(fp=list(FR.fingerprint)), Reason.FOREIGN_FINGERPRINT),
    # dtype
    ("dtype_f8", lambda: message(dtype="<f8"), Reason.BAD_DTYPE),
    ("dtype_big_endian", lambda: message(dtype=">f4"), Reason.BAD_DTYPE),
    ("dtype_name", lambda: message(dtype="float32"), Reason.BAD_DTYPE),
    ("dtype_bytes", lambda: message(dtype=b"<f4"), Reason.BAD_DTYPE),
    ("dtype_bignum", lambda: message(dtype=10**6000), Reason.BAD_DTYPE),
    # the fragment list
    ("no_fragments", lambda: message(frags=[]), Reason.BAD_FRAGMENT),
    ("more_than_k_fragments", lambda: message(frags=[[f % 4, tag(values(f % 4))] for f in range(5)]),
     Reason.BAD_FRAGMENT),
    ("frags_as_map", lambda: message(frags={"0": tag(values(0))}), Reason.BAD_FRAGMENT),
    ("item_not_a_pair", lambda: message(frags=[[0]]), Reason.BAD_FRAGMENT),
    ("item_a_triple", lambda: message(frags=[[0, tag(values(0)), 1]]), Reason.BAD_FRAGMENT),
    ("untagged_bytes", lambda: message(frags=[[0, values(0).tobytes()]]), Reason.BAD_FRAGMENT),
    ("plain_float_list", lambda: message(frags=[[0, values(0).tolist()]]), Reason.BAD_FRAGMENT),
    # fragment index out of range
    ("index_k", lambda: message(frags=[[4, tag(values(0))]]), Reason.BAD_FRAGMENT),
    ("index_negative", lambda: message(frags=[[-1, tag(values(0))]]), Reason.BAD_FRAGMENT),
    ("index_huge", lambda: message(frags=[[2**64, tag(values(0))]]), Reason.BAD_FRAGMENT),
    ("index_bignum", lambda: message(frags=[[10**6000, tag(values(0))]]), Reason.BAD_FRAGMENT),
    ("index_bool", lambda: message(frags=[[False, tag(values(0))]]), Reason.BAD_FRAGMENT),
    ("index_text", lambda: message(frags=[["0", tag(values(0))]]), Reason.BAD_FRAGMENT),
    # duplicate fragment index inside one message: the message is wrong (bad_fragment, 400), not a state conflict
    ("duplicate_index", lambda: message(frags=[[1, tag(values(1))], [1, tag(values(1))]]),
     Reason.BAD_FRAGMENT),
    ("duplicate_index_apart", lambda: message(frags=[[3, tag(values(3))], [0, tag(values(0))],
                                                     [3, tag(values(3))]]), Reason.BAD_FRAGMENT),
    # wrong length
    ("one_float_short", lambda: message(frags=[[0, tag(values(0, 9))]]), Reason.BAD_FRAGMENT),
    ("one_float_long", lambda: message(frags=[[0, tag(values(0, 11))]]), Reason.BAD_FRAGMENT),
    ("no_floats", lambda: message(frags=[[0, tag(values(0, 0))]]), Reason.BAD_FRAGMENT),
    ("one_byte_long", lambda: message(frags=[[0, cbor2.CBORTag(85, values(0).tobytes() + b"\0")]]),
     Reason.BAD_FRAGMENT),
    ("whole_vector_as_fragment", lambda: message(frags=[[0, tag(np.zeros(40))]]), Reason.BAD_FRAGMENT),
    # wrong tag
    ("tag_86_float64", lambda: message(frags=[[0, cbor2.CBORTag(86, values(0).astype("<f8").tobytes())]]),
     Reason.BAD_FRAGMENT),
    ("tag_81_big_endian", lambda: message(frags=[[0, cbor2.CBORTag(81, values(0).astype(">f4").tobytes())]]),
     Reason.BAD_FRAGMENT),
    ("tag_64_uint8", lambda: message(frags=[[0, cbor2.CBORTag(64, values(0).tobytes())]]), Reason.BAD_FRAGMENT),
    ("tag_85_of_text", lambda: message(frags=[[0, cbor2.CBORTag(85, "x" * 40)]]), Reason.BAD_FRAGMENT),
    ("tag_85_of_array", lambda: message(frags=[[0, cbor2.CBORTag(85, values(0).tolist())]]), Reason.BAD_FRAGMENT),
    # non-finite values
    ("nan", lambda: message(frags=[[0, tag(np.r_[values(0, 9), np.nan])]]), Reason.NON_FINITE),
    ("plus_inf", lambda: message(frags=[[2, tag(np.r_[np.inf, values(2, 9)])]]), Reason.NON_FINITE),
    ("minus_inf", lambda: message(frags=[[0, tag(values(0))], [1, tag(np.full(10, -np.inf))]]), Reason.NON_FINITE),
    ("signalling_nan", lambda: message(frags=[[0, cbor2.CBORTag(85, struct.pack("<I", 0x7F800001) * 10)]]),
     Reason.NON_FINITE),
    ("negative_nan", lambda: message(frags=[[0, cbor2.CBORTag(85, struct.pack("<I", 0xFFC00000) * 10)]]),
     Reason.NON_FINITE),
    # round and sender: negative, bool, huge, not an integer
    *[(f"{key}_{name}", lambda key=key, bad=bad: message(**{key: bad}), Reason.BAD_HEADER)
      for key in ("round", "sender")
      for name, bad in [("negative", -1), ("true", True), ("false", False), ("2_31", 2**31), ("2_63", 2**63),
                        ("bignum", 2**64), ("huge_bignum", 10**6000), ("negative_bignum", -(2**70)),
                        ("float", 1.0), ("nan", math.nan), ("text", "3"), ("null", None), ("array", [3])]],
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_input_is_refused_with_its_reason(path: str, make: Callable[[], bytes], reason: Reason) -> None:
    data = make()
    with pytest.raises(WireError) as info:
        decode_via(path, data, run_id=RUN)
    assert info.value.reason is reason, info.value
    assert info.value.to_json()["reason"] == reason.value
    assert len(str(info.value)) < 400  # details stay short whatever the input


@pytest.mark.parametrize("path", PATHS)
def test_too_large(path: str) -> None:
    assert decode_via(path, GOOD, max_bytes=len(GOOD)).round == 5
    for data in (GOOD, bytearray(GOOD), memoryview(GOOD)):
        with pytest.raises(WireError) as info:
            decode_via(path, data, max_bytes=len(GOOD) - 1)
        assert info.value.reason is Reason.TOO_LARGE
    # the limit is on bytes, also for a buffer of wider items
    wide = memoryview(np.frombuffer(GOOD[: len(GOOD) // 4 * 4], np.float32))
    with pytest.raises(WireError) as info:
        decode_via(path, wide, max_bytes=len(wide) + 1)
    assert info.value.reason is Reason.TOO_LARGE


def test_wrong_run_only_when_a_run_is_expected() -> None:
    data = message(run="run-2")
    assert decode(data, FR).run_id == "run-2"
    with pytest.raises(WireError) as info:
        decode(data, FR, run_id=RUN)
    assert info.value.reason is Reason.WRONG_RUN


def test_colliding_integer_keys_are_refused_quickly() -> None:
    """Regression: ints hash to themselves mod 2**61-1, so a map of colliding int keys took quadratic time."""
    m, p = 20_000, (1 << 61) - 1
    data = b"\xba" + m.to_bytes(4, "big") + b"".join(cbor2.dumps(i * p) + b"\x00" for i in range(m))
    started = time.perf_counter()
    with pytest.raises(WireError) as info:
        decode(data, FR)
    assert info.value.reason in (Reason.MALFORMED, Reason.TOO_LARGE)  # TOO_LARGE: over any message of FR's run
    assert time.perf_counter() - started < 0.5


SMALL = wire._CHECK_MIN_BYTES - 16  # bytes: a body under the run's structural limits
MANY_ITEMS = [
    b"\x9a" + SMALL.to_bytes(4, "big") + bytes(SMALL),  # an array of zeros
    b"\x9a" + (SMALL // 2).to_bytes(4, "big") + b"\x81\x00" * (SMALL // 2),  # of arrays
    b"\x5f" + b"\x40" * SMALL + b"\xff",  # a byte string in empty chunks
    message(frags=[])[:-1] + b"\x9a" + (SMALL - 128).to_bytes(4, "big") + b"\x80" * (SMALL - 128),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("data", MANY_ITEMS, ids=["zeros", "arrays", "chunks", "fragments"])
def test_a_small_body_of_more_items_than_a_message_is_refused_quickly(path: str, data: bytes) -> None:
    """However small a body, reading it takes no more steps than a message of the run (`wire._items`)."""
    assert len(data) < wire._CHECK_MIN_BYTES
    started = time.perf_counter()
    with pytest.raises(WireError) as info:
        decode_via(path, data, run_id=RUN)
    assert info.value.reason in (Reason.MALFORMED, Reason.BAD_FRAGMENT)
    assert time.perf_counter() - started < 0.01


def test_not_bytes_like() -> None:
    with pytest.raises(WireError) as info:
        decode("a text", FR)  # type: ignore[arg-type]
    assert info.value.reason is Reason.MALFORMED


# -- fuzz ----------------------------------------------------------------------------------------------------

INTERESTING = [0x00, 0x01, 0x17, 0x18, 0x19, 0x1A, 0x1B, 0x1C, 0x1F, 0x20, 0x3B, 0x40, 0x5B, 0x5F, 0x60, 0x7B,
               0x7F, 0x80, 0x9B, 0x9F, 0xA0, 0xBB, 0xBF, 0xC2, 0xC3, 0xD8, 0xF4, 0xF5, 0xF6, 0xF7, 0xF9, 0xFA,
               0xFB, 0xFF]
RAW_SNIPPETS = [b"\xd8\x1c\x81\xd8\x1d\x00",  # a shared array holding itself
                b"\x9f\x9f\xff\xff", b"\x5f\x41\x00\xff", b"\xd9\x01\x02\x82\x01\x02", b"\xc4\x82\x21\x19\x01\x00",
                b"\xd8\x1e\x82\x01\x00", b"\xd8\x23\x61\x28", b"\xc1\xfb\x7f\xf0\x00\x00\x00\x00\x00\x00"]


def random_object(rng: np.random.Generator, depth: int = 0) -> Any:
    kind = int(rng.integers(14 if depth < 3 else 9))
    if kind == 0:
        return int(rng.integers(-(2**63), 2**63 - 1))
    if kind == 1:
        return [0, 1, 2, 4, 5, 2**31 - 1, 2**31, 2**64, -1, 10**30, -(10**30), 10**5000][int(rng.integers(12))]
    if kind == 2:
        return float(rng.choice([0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e300]))
    if kind == 3:
        return "".join(chr(int(c)) for c in rng.integers(32, 0x2FF, size=int(rng.integers(0, 12))))
    if kind == 4:
        return rng.bytes(int(rng.integers(0, 48)))
    if kind == 5:
        return [None, True, False, cbor2.undefined][int(rng.integers(4))]
    if kind == 6:
        return str(rng.choice(list(fields()) + ["x", ""]))
    if kind == 7:
        return FR.fingerprint if rng.random() < 0.5 else OTHER_FP
    if kind == 8:
        return tag(values(int(rng.integers(4)), int(rng.choice([0, 9, 10, 11]))))
    if kind == 9:
        return [random_object(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    if kind == 10:
        return {random_object(rng, 9): random_object(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}
    if kind == 11:
        return [int(rng.integers(-1, 6)), random_object(rng, depth + 1)]
    if kind == 12:
        return cbor2.CBORTag(int(rng.choice([0, 1, 2, 3, 4, 5, 30, 32, 37, 64, 81, 85, 86, 258, 1000])),
                             random_object(rng, depth + 1))
    # a valid message with one field (or one fragment item) replaced
    out = fields()
    key = str(rng.choice(list(out)))
    out[key] = random_object(rng, depth + 1)
    return out


def valid_messages(rng: np.random.Generator) -> list[bytes]:
    out = [GOOD]
    for _ in range(8):
        chosen = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False))
        batch = FragmentBatch(RUN, int(rng.integers(0, 2**31)), int(rng.integers(0, 2**31)), 4, FR.fingerprint,
                              {int(f): rng.standard_normal(10).astype(np.float32) for f in chosen})
        out.append(encode(batch))
    return out


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    buf = bytearray(data)
    if not buf:
        return rng.bytes(int(rng.integers(1, 9)))
    op = int(rng.integers(6))
    if op == 0:  # bit flips
        for _ in range(int(rng.integers(1, 9))):
            i = int(rng.integers(len(buf)))
            buf[i] ^= 1 << int(rng.integers(8))
    elif op == 1:  # truncation
        del buf[int(rng.integers(len(buf))):]
    elif op == 2:  # insertion
        i = int(rng.integers(len(buf) + 1))
        buf[i:i] = rng.bytes(int(rng.integers(1, 9)))
    elif op == 3:  # deletion
        i = int(rng.integers(len(buf)))
        del buf[i:i + int(rng.integers(1, 9))]
    elif op == 4:  # interesting bytes, mostly in the header and the fragment framing
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(min(len(buf), 80)))
            buf[i] = int(rng.choice(INTERESTING))
    else:  # splice in a raw CBOR snippet
        i = int(rng.integers(len(buf) + 1))
        buf[i:i + int(rng.integers(0, 4))] = RAW_SNIPPETS[int(rng.integers(len(RAW_SNIPPETS)))]
    return bytes(buf)


def fuzz_inputs(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    valid = valid_messages(rng)
    out: list[bytes] = []
    while len(out) < count:
        kind = len(out) % 4
        if kind == 0:
            data = rng.bytes(int(rng.integers(0, 160)))
            if rng.random() < 0.5 and data:  # start like a map, so that cbor2 gets further in
                data = bytes([int(rng.choice([0xA8, 0xBF, 0xA9, 0xA7]))]) + data[1:]
        elif kind in (1, 2):
            data = mutate(rng, valid[int(rng.integers(len(valid)))])
            if rng.random() < 0.3:
                data = mutate(rng, data)
        else:
            try:
                data = cbor2.dumps(random_object(rng))
            except Exception:  # cbor2 cannot encode every random structure (e.g. unhashable keys)
                continue
        out.append(data)
    return out


# cbor2 turns these tags into Python objects (dates, sets, shared references, ...); the reader keeps every tag but
# the bignums (2, 3) as a tag, and so does the reference
CBOR2_SEMANTIC_TAGS = (0, 1, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 43000, 55799)


def cbor2_read(data: bytes) -> Any:
    """The reference reading: cbor2 with the reader's settings (`wire._Reader`); raises what cbor2 raises."""
    stream = io.BytesIO(data)
    keep = {tag: lambda value, immutable, tag=tag: cbor2.CBORTag(tag, value) for tag in CBOR2_SEMANTIC_TAGS}
    obj = cbor2.CBORDecoder(stream, allow_duplicate_keys=False, strict_hashable_types=True,
                            max_depth=wire._MAX_DEPTH, semantic_decoders=keep).decode()
    if stream.tell() != len(data):
        raise ValueError(f"{len(data) - stream.tell()} trailing bytes")
    return obj


def as_read(obj: Any) -> Any:
    """A cbor2 value as the reader gives it: byte strings as memoryviews."""
    if type(obj) is bytes:
        return memoryview(obj)
    if type(obj) is list:
        return [as_read(v) for v in obj]
    if type(obj) is dict:
        return {as_read(k): as_read(v) for k, v in obj.items()}
    if type(obj) is cbor2.CBORTag:
        return cbor2.CBORTag(obj.tag, as_read(obj.value))
    return obj


def same_value(ours: Any, ref: Any) -> bool:
    """The reader's value is cbor2's: equal, of the same types (True is not 1), a NaN for a NaN, -0.0 for -0.0.
    (Inside a tag cbor2 gives arrays as tuples and maps as frozendicts.)"""
    ours = bytes(ours) if type(ours) is memoryview else ours
    ref = list(ref) if type(ref) is tuple else dict(ref) if type(ref) is cbor2.frozendict else ref
    if type(ours) is not type(ref):
        return False
    if type(ref) is float:
        return (math.isnan(ours) and math.isnan(ref)) or struct.pack(">d", ours) == struct.pack(">d", ref)
    if type(ref) is list:
        return len(ours) == len(ref) and all(map(same_value, ours, ref))
    if type(ref) is dict:
        mine = {bytes(k) if type(k) is memoryview else k: v for k, v in ours.items()}
        return mine.keys() == ref.keys() and all(same_value(mine[k], ref[k]) for k in ref)
    if type(ref) is cbor2.CBORTag:
        return ours.tag == ref.tag and same_value(ours.value, ref.value)
    return ours == ref


def read(data: bytes, limits: Any = wire._ANY, path: str = "framing") -> tuple[str, Any]:
    """The reader's value of `data`, or the reason it refuses it."""
    try:
        if path == "framing":
            return "ok", wire._Reader(data, limits).message()
        with mock.patch.object(wire._Reader, "fragment", wire._Reader.item):
            return "ok", wire._Reader(data, limits).message()
    except WireError as exc:
        return "refused", exc.reason


def outcome(path: str, data: bytes, compression: Compression = NONE) -> tuple[str, Any]:
    try:
        return "ok", decode_via(path, data, run_id=RUN, compression=compression)
    except WireError as exc:
        assert isinstance(exc.reason, Reason) and exc.detail
        return "refused", exc.reason


def reference(data: bytes, compression: Compression = NONE) -> tuple[str, Any]:
    """What `decode` gives when cbor2 reads the body in place of the reader: the same checks follow."""
    try:
        obj = as_read(cbor2_read(data))
    except Exception:  # cbor2 raises several types
        return "refused", Reason.MALFORMED
    try:
        run, round_, sender, frags = wire._header(obj, FR, RUN, compression)
        return "ok", FragmentBatch(run, round_, sender, FR.k, FR.fingerprint,
                                   wire._fragments(frags, FR, compression), compression.codec)
    except WireError as exc:
        return "refused", exc.reason


def agrees_with_reference(data: bytes, compression: Compression = NONE) -> tuple[str, Any]:
    """decode's outcome both ways, checked against the reference's; anything but WireError fails the test."""
    expected = reference(data, compression)
    for path in PATHS:
        got = outcome(path, data, compression)
        assert got[0] == expected[0], (path, data, got, expected)
        if got[0] == "ok":
            assert got[1].codec == compression.codec and got[1].fragments.keys() == expected[1].fragments.keys()
            if compression.codec == "none":
                assert same_batch(got[1], expected[1])
        else:
            assert got[1] is expected[1], (path, data, got[1], expected[1])
    return expected


def nested(depth: int, opening: bytes, leaf: bytes = b"\x00") -> bytes:
    return opening * depth + leaf


EDGES = [
    # chunked strings: chunks of their own major type only, no nesting, no break missing
    b"\x5f\x41a\x41b\xff", b"\x7f\x61a\x61b\xff", b"\x5f\x61a\xff", b"\x7f\x41a\xff", b"\x5f\x5f\xff\xff",
    b"\x5f\x41a", b"\x5f\xff", b"\x7f\xff", b"\x7f\x61\xc3\x61\xa9\xff", b"\x7f\x62\xc3\xa9\xff", b"\x5f\x00\xff",
    # simple values and floats
    b"\xf0", b"\xf3", b"\xf4", b"\xf5", b"\xf6", b"\xf7", b"\xf8\x10", b"\xf8\x1f", b"\xf8\x20", b"\xf8\xff",
    b"\xf9\x7e\x00", b"\xf9\x80\x00", b"\xf9\x7c\x00", b"\xfa\x7f\xc0\x00\x01", b"\xfb" + struct.pack(">d", -0.0),
    b"\xf9\x3c", b"\xfc", b"\xfd", b"\xfe", b"\xff",
    # heads: reserved, indefinite where none may be, truncated, long forms
    b"\x1c", b"\x3d", b"\x5e", b"\x9c", b"\xbd", b"\xde\x00", b"\x1f", b"\x3f", b"\xdf\x00", b"\x19\x01",
    b"\x1b" + bytes(8), b"\x3b" + b"\xff" * 8, b"\x1b" + b"\xff" * 8, b"\x9f\x01", b"\xbf\x61a\xff", b"\xbf\xff",
    # maps: keys of text or bytes only, once each (a text and a byte string of the same bytes are two keys)
    b"\xa2\x61a\x00\x41a\x00", b"\xa2\x41a\x00\x41a\x01", b"\xa2\x61a\x00\x61a\x01", b"\xa1\x00\x00",
    b"\xa1\xf6\x00", b"\xa1\x80\x00", b"\xa1\xc2\x41\x01\x00", b"\xa1\x5f\x41a\xff\x00", b"\xa1\x61a",
    b"\xbf\x61a\x00\x61a\x00\xff",
    # tags: bignums become integers, any other stays a tag (the content of tags cbor2 reads as dates, sets, ...)
    b"\xc2\x40", b"\xc2\x41\x01", b"\xc3\x41\x01", b"\xc2\x00", b"\xc2\x5f\x41\x01\x41\x02\xff", b"\xc3\x60",
    b"\xc2\xc2\x41\x01", b"\xd8\x55\x41\x00", b"\xc0\x00", b"\xc1\x61a", b"\xd8\x1c\x81\xd8\x1d\x00",
    b"\xd9\xd9\xf7\x82\x01\x02", b"\xd9\x01\x02\x82\x01\x01", b"\xdb" + b"\xff" * 8 + b"\x00",
    # nesting: at most _MAX_DEPTH containers and tags, whatever they are
    *[nested(d, opening) for d in range(wire._MAX_DEPTH - 1, wire._MAX_DEPTH + 3)
      for opening in (b"\x81", b"\xc6", b"\x9f", b"\xa1\x61a")],
    nested(wire._MAX_DEPTH, b"\x81", b"\x80"), nested(wire._MAX_DEPTH, b"\x81", b"\x5f\x41a\xff"),
    nested(wire._MAX_DEPTH - 1, b"\x81", b"\xc2\x41\x01"), nested(wire._MAX_DEPTH, b"\x81", b"\xc2\x41\x01"),
    # arrays claiming more than the body holds
    b"\x9b" + (2**63).to_bytes(8, "big"), b"\xbb" + (2**63).to_bytes(8, "big"), b"\x5b" + (2**63).to_bytes(8, "big"),
    b"\x82\x00",
]


def reads_as_cbor2(data: bytes) -> tuple[str, Any]:
    """cbor2's value of `data` (or its refusal), which the reader gives both ways; it refuses only as malformed."""
    try:
        expected: tuple[str, Any] = ("ok", cbor2_read(data))
    except Exception:  # cbor2 raises several types
        expected = ("refused", Reason.MALFORMED)
    for path in PATHS:
        got = read(data, path=path)
        assert got[0] == expected[0] and (got[0] == "refused" or same_value(got[1], expected[1])), (data, got)
        assert got[0] == "ok" or got[1] is Reason.MALFORMED
    return expected


@pytest.mark.parametrize("data", EDGES, ids=[d.hex()[:24] for d in EDGES])
def test_the_reader_agrees_with_cbor2_on_the_edges_of_cbor(data: bytes) -> None:
    reads_as_cbor2(data)


def test_fuzz_decode_agrees_with_cbor2() -> None:
    accepted, reasons = 0, set()
    for data in fuzz_inputs(seed=20260501, count=12_000):
        result, value = agrees_with_reference(data)
        if result == "ok":
            accepted += 1
            assert same_batch(decode(encode(value), FR, run_id=RUN), value)
        else:
            reasons.add(value)
    # the fuzzer reaches deep into the validation, not only the CBOR reader
    assert accepted > 0
    assert {Reason.MALFORMED, Reason.BAD_HEADER, Reason.BAD_FRAGMENT, Reason.NON_FINITE,
            Reason.FOREIGN_FINGERPRINT} <= reasons


def test_fuzz_reader_agrees_with_cbor2() -> None:
    """The reader reads what cbor2 reads, to the same values, and refuses what cbor2 refuses; the run's limits
    only ever refuse (they change no value)."""
    read_ok, limited = 0, 0
    for data in fuzz_inputs(seed=7, count=4_000):
        expected = reads_as_cbor2(data)
        read_ok += expected[0] == "ok"
        within = read(data, wire._run_limits(FR, NONE))
        if within[0] == "ok":
            limited += 1
            assert same_value(within[1], expected[1])
    assert read_ok > 1_000 and limited > 200


def test_fuzz_framed_header_agrees_with_cbor2() -> None:
    """Whatever is read against a run's own framing (`_Reader.framed`, every message of a run with a known id),
    cbor2 reads to that run's header and the same round, sender and fragments; what it refuses, cbor2 refuses."""
    parsed = 0
    framing = wire._framing(RUN, FR.k, FR.fingerprint)
    for data in fuzz_inputs(seed=11, count=8_000):  # most mutations break the framing: ~130 of these match it
        try:
            framed = wire._Reader(data, wire._ANY).framed(framing)
        except WireError:
            with pytest.raises(Exception):  # noqa: B017, PT011 (cbor2 raises several types)
                cbor2_read(data)
            continue
        if framed is None:
            continue
        parsed += 1
        ref = cbor2_read(data)
        round_, sender, frags = framed
        assert {k: ref[k] for k in ("v", "run", "k", "fp", "dtype")} == {
            "v": wire.VERSION, "run": RUN, "k": FR.k, "fp": FR.fingerprint, "dtype": wire.DTYPE}
        assert same_value(round_, ref["round"]) and same_value(sender, ref["sender"])
        assert same_value(frags, ref["frags"])
    assert parsed > 100


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk:0.25"])
def test_fuzz_compressed_decode_agrees_with_cbor2(codec: str) -> None:
    """A compressed run's items ([index, values, scale or indices]) are read as cbor2 reads them."""
    compression, rng = Compression.parse(codec), np.random.default_rng(5)
    valid = []
    for seed in range(4):
        chosen = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False))
        sent = {int(f): compression.compress(rng.standard_normal(FR.sizes[f]).astype(np.float32), seed=seed,
                                             round=2, node=1, fragment=int(f)) for f in chosen}
        valid.append(encode(FragmentBatch(RUN, seed, 1, 4, FR.fingerprint, sent, compression.codec)))
    outcomes = []
    for i in range(1_500):
        data = mutate(rng, valid[i % len(valid)]) if i >= len(valid) else valid[i]
        outcomes.append(agrees_with_reference(data, compression)[0])
    assert outcomes[:len(valid)] == ["ok"] * len(valid) and outcomes.count("ok") > 10


# -- large bodies: refused from their CBOR heads (check_structure) ---------------------------------------------

BIG = Fragmentation.build(Layout.flat(1 << 20), 4, seed=7)  # four fragments of 1 MiB: messages over 64 KiB


def big_fields(**overrides: Any) -> dict:
    frags = [[f, tag(np.ones(len(BIG.indices[f]), np.float32))] for f in range(4)]
    return {"v": 1, "run": RUN, "round": 0, "sender": 1, "k": 4, "fp": BIG.fingerprint, "dtype": "<f4",
            "frags": frags, **overrides}


def claims(size: int) -> bytes:
    """An array of `size` zeros: one byte each, and cbor2 would build a list of `size` items."""
    return b"\x9b" + size.to_bytes(8, "big") + bytes(size)


def test_large_messages_pass_the_structure_check_in_any_valid_encoding() -> None:
    ones = {f: np.ones(len(BIG.indices[f]), np.float32) for f in range(4)}
    canonical = encode(FragmentBatch(RUN, 0, 1, 4, BIG.fingerprint, ones))
    indefinite = b"\xbf" + cbor2.dumps(big_fields())[1:] + b"\xff"  # the same map, of indefinite length
    for data in (canonical, cbor2.dumps(big_fields()), indefinite):
        wire.check_structure(data, BIG)
        assert sorted(decode(data, BIG, run_id=RUN).fragments) == [0, 1, 2, 3]


def header_then(frags: bytes) -> bytes:
    return cbor2.dumps(big_fields(frags=[]))[:-1] + frags


LARGE_CASES: list[tuple[str, bytes, Reason]] = [
    ("array_at_the_top", claims(2 << 20), Reason.BAD_HEADER),
    ("frags_of_millions", header_then(claims(2 << 20)), Reason.BAD_FRAGMENT),
    ("frags_of_k_plus_one", header_then(b"\x85" + bytes(5) + bytes(1 << 17)), Reason.BAD_FRAGMENT),
    ("indefinite_frags", header_then(b"\x9f" + bytes(1 << 17) + b"\xff"), Reason.BAD_FRAGMENT),
    ("map_in_a_field", cbor2.dumps(big_fields(sender={i: 0 for i in range(1 << 15)}, frags=[])), Reason.BAD_HEADER),
    ("long_run_id", cbor2.dumps(big_fields(run="r" * (1 << 17), frags=[])), Reason.BAD_HEADER),
    ("long_fragment", cbor2.dumps(big_fields(frags=[[0, tag(np.ones(1 << 19, np.float32))]])),
     Reason.BAD_FRAGMENT),
    ("deep_tags", header_then(b"\x81\x82\x00" + b"\xc6" * (1 << 16) + b"\x00"), Reason.MALFORMED),
    ("chunked_bytes", header_then(b"\x81\x82\x00\xd8\x55\x5f" + b"\x40" * (1 << 17) + b"\xff"), Reason.MALFORMED),
    ("truncated", cbor2.dumps(big_fields())[:-1], Reason.MALFORMED),
    ("over_any_message_of_the_run", claims(5 << 20), Reason.TOO_LARGE),
]


@pytest.mark.parametrize(("data", "reason"), [(d, r) for _, d, r in LARGE_CASES], ids=[n for n, _, _ in LARGE_CASES])
def test_a_large_body_that_cannot_be_a_message_is_refused_before_it_is_parsed(data: bytes, reason: Reason) -> None:
    assert len(data) >= wire._CHECK_MIN_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as info:
            decode(data, BIG, run_id=RUN)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.reason is reason, info.value
    assert peak < 64 << 10, f"{peak} bytes allocated to refuse a {len(data)}-byte body"

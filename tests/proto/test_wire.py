"""The wire codec: exact round trips, one refusal reason per class of bad input, and fuzz tests against a reference.

`decode` reads exactly what `encode` writes (`wire._Reader`) and refuses anything else, at the first byte that
departs from it, with that part's reason. The reference reads a body with cbor2 and checks its value in the same
order, here in the tests: what it accepts and `encode` would write byte for byte is what `decode` accepts, and on
a body cbor2 reads that is written as `encode` writes it, both refuse for the same reason.
"""

from __future__ import annotations

import io
import math
import struct
import time
import tracemalloc
from collections.abc import Callable, Mapping
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_proto import Fragmentation, FragmentBatch, Layout, Reason, WireError, decode, encode, wire
from mosaic_proto.compression import Compressed, Compression, decompress

NONE = Compression()
RUN = "run-1"
FR = Fragmentation.build(Layout.flat(40), 4, seed=7)  # four fragments of 10 floats
OTHER_FP = Fragmentation.build(Layout.flat(40), 4, seed=8).fingerprint


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


@settings(max_examples=60, deadline=None)
@given(case=batches())
def test_round_trip_is_exact(case: tuple[FragmentBatch, Fragmentation]) -> None:
    batch, fr = case
    data = encode(batch)
    back = decode(data, fr, run_id=batch.run_id)
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


def test_decode_accepts_any_bytes_like_input() -> None:
    expected = decode(GOOD, FR, run_id=RUN)
    for data in (bytearray(GOOD), memoryview(GOOD), memoryview(bytearray(GOOD))):
        assert same_batch(decode(data, FR, run_id=RUN), expected)
    assert decode(GOOD, FR, run_id=None).run_id == RUN


def test_fragments_never_alias_a_mutable_input() -> None:
    buffer = bytearray(GOOD)
    batch = decode(buffer, FR)
    before = {f: v.copy() for f, v in batch.fragments.items()}
    buffer[-8:] = b"\xff" * 8
    assert all(np.array_equal(before[f], batch.fragments[f]) for f in before)


def test_a_read_only_view_is_decoded_without_a_copy_and_a_writable_one_is_copied() -> None:
    """A daemon reads a large body into a buffer it writes over only once nothing views it, and hands on a read-only
    view: its fragments are views of that buffer; a writable view may change under them, so it is copied first."""
    array = np.frombuffer(GOOD, np.uint8).copy()
    array.flags.writeable = False
    batch = decode(memoryview(array), FR, run_id=RUN)
    assert same_batch(batch, decode(GOOD, FR, run_id=RUN))
    assert all(np.shares_memory(v, array) and not v.flags.writeable for v in batch.fragments.values())
    writable = np.frombuffer(GOOD, np.uint8).copy()
    assert not any(np.shares_memory(v, writable) for v in decode(memoryview(writable), FR).fragments.values())
    with pytest.raises(WireError) as info:  # a read-only view is read as strictly as bytes: cut short
        decode(memoryview(array[:-1]), FR)
    assert info.value.reason is Reason.MALFORMED


@pytest.mark.parametrize("n", [10, 1 << 16])  # floats: a small message, a large one
def test_messages_are_decoded_without_copying_the_fragments(n: int) -> None:
    fr = Fragmentation.build(Layout.flat(n), 1, 0)
    data = encode(FragmentBatch(RUN, 0, 1, 1, fr.fingerprint, {0: np.ones(n, np.float32)}))
    batch = decode(data, fr)
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


def in_fragment_long_heads(obj: dict) -> bytes:
    """`obj` as cbor2 writes it but for its first fragment's item, whose heads are all long (the header canonical)."""
    header = cbor2.dumps({**obj, "frags": []})[:-1]
    items = [long_heads(obj["frags"][0]), *map(cbor2.dumps, obj["frags"][1:])]
    return header + bytes([0x80 | len(items)]) + b"".join(items)


@pytest.mark.parametrize("fr", [FR, Fragmentation.build(Layout.flat(1 << 16), 4, seed=7)], ids=["small", "large"])
def test_only_what_encode_writes_is_read(fr: Fragmentation) -> None:
    """Valid CBOR that `encode` never writes (indefinite lengths, chunked strings, long heads, bignums, keys in
    another order) is refused: MALFORMED for the encoding, BAD_HEADER for keys out of the message's order."""
    sent = FragmentBatch(RUN, 5, 2, 4, fr.fingerprint, {f: values(f, len(fr.indices[f])) for f in (0, 3)})
    obj = cbor2.loads(encode(sent))
    assert same_batch(decode(cbor2.dumps(obj), fr, run_id=RUN), sent)
    refusals = [(indefinite(obj), Reason.MALFORMED), (long_heads(obj), Reason.MALFORMED),
                (in_fragment_long_heads(obj), Reason.MALFORMED),
                (cbor2.dumps(dict(reversed(obj.items()))), Reason.BAD_HEADER)]
    for data, reason in refusals:
        assert cbor2.loads(data) == obj
        with pytest.raises(WireError) as info:
            decode(data, fr, run_id=RUN)
        assert info.value.reason is reason, info.value


# -- one test per class of malformed input -------------------------------------------------------------------

def raw_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A CBOR map written pair by pair (so it may repeat keys)."""
    assert len(pairs) < 24
    return bytes([0xA0 | len(pairs)]) + b"".join(cbor2.dumps(k) + cbor2.dumps(v) for k, v in pairs)


def without(key: str) -> bytes:
    return cbor2.dumps({k: v for k, v in fields().items() if k != key})


def replaced(key: str, new_key: Any) -> bytes:
    """The message with `key`'s entry under `new_key`, in its place."""
    return raw_map([(new_key if k == key else k, v) for k, v in fields().items()])


def round_as(raw: bytes) -> bytes:
    """The message with the round's value written as `raw`."""
    before, after = GOOD.split(b"\x65round\x05", 1)
    return before + b"\x65round" + raw + after


CASES: list[tuple[str, Callable[[], bytes], Reason]] = [
    # not CBOR / truncated
    ("empty", lambda: b"", Reason.MALFORMED),
    ("break_byte", lambda: b"\xff", Reason.MALFORMED),
    ("reserved_info", lambda: b"\x1c", Reason.MALFORMED),
    ("bad_utf8_run", lambda: GOOD.replace(b"\x65run-1", b"\x65run\xff\xfe"), Reason.MALFORMED),
    ("truncated_by_one", lambda: GOOD[:-1], Reason.MALFORMED),
    ("truncated_in_header", lambda: GOOD[:12], Reason.MALFORMED),
    ("truncated_to_one_byte", lambda: GOOD[:1], Reason.MALFORMED),
    ("truncated_in_a_head", lambda: GOOD[:GOOD.index(b"\x65round") + 6] + b"\x1a\x00", Reason.MALFORMED),
    ("deep_array", lambda: b"\x81" * 1000 + b"\x00", Reason.BAD_HEADER),  # an array where the message's map opens
    ("claims_huge_array", lambda: b"\x9b" + (2**40).to_bytes(8, "big"), Reason.BAD_HEADER),
    # CBOR that encode never writes
    ("indefinite_map", lambda: b"\xbf" + GOOD[1:] + b"\xff", Reason.MALFORMED),
    ("long_head_round", lambda: round_as(b"\x1a\x00\x00\x00\x05"), Reason.MALFORMED),
    ("long_head_map", lambda: b"\xb8\x08" + GOOD[1:], Reason.MALFORMED),
    ("indefinite_frags", lambda: message(frags=[])[:-1] + b"\x9f" + cbor2.dumps([0, tag(values(0))]) + b"\xff",
     Reason.MALFORMED),
    ("chunked_values", lambda: message(frags=[])[:-1] + b"\x81\x82\x00\xd8\x55\x5f" + cbor2.dumps(values(0).tobytes())
     + b"\xff", Reason.MALFORMED),
    ("keys_in_another_order", lambda: cbor2.dumps(dict(reversed(fields().items()))), Reason.BAD_HEADER),
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
    ("renamed_key", lambda: replaced("v", "V"), Reason.BAD_HEADER),
    ("key_as_bytes", lambda: replaced("k", b"k"), Reason.BAD_HEADER),
    ("repeated_key", lambda: replaced("dtype", "round"), Reason.MALFORMED),
    ("repeated_key_in_nine", lambda: raw_map([*fields().items(), ("round", 5)]), Reason.BAD_HEADER),
    ("integer_key", lambda: replaced("k", 1), Reason.MALFORMED),
    # unknown version
    ("version_2", lambda: message(v=2), Reason.UNSUPPORTED_VERSION),
    ("version_0", lambda: message(v=0), Reason.UNSUPPORTED_VERSION),
    ("version_text", lambda: message(v="1"), Reason.UNSUPPORTED_VERSION),
    ("version_float", lambda: message(v=1.0), Reason.UNSUPPORTED_VERSION),
    ("version_bool", lambda: message(v=True), Reason.UNSUPPORTED_VERSION),
    ("version_bignum", lambda: message(v=10**600), Reason.UNSUPPORTED_VERSION),
    ("over_any_message_of_the_run", lambda: message(v=10**6000), Reason.TOO_LARGE),  # 2.6 KB, FR's run: 1.4
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
    ("dtype_bignum", lambda: message(dtype=10**600), Reason.BAD_DTYPE),
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
    ("index_bignum", lambda: message(frags=[[10**600, tag(values(0))]]), Reason.BAD_FRAGMENT),
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
                        ("bignum", 2**64), ("huge_bignum", 10**600), ("negative_bignum", -(2**70)),
                        ("float", 1.0), ("nan", math.nan), ("text", "3"), ("null", None), ("array", [3])]],
]


@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_input_is_refused_with_its_reason(make: Callable[[], bytes], reason: Reason) -> None:
    data = make()
    with pytest.raises(WireError) as info:
        decode(data, FR, run_id=RUN)
    assert info.value.reason is reason, info.value
    assert info.value.to_json()["reason"] == reason.value
    assert len(str(info.value)) < 400  # details stay short whatever the input
    agrees_with_reference(data)


def test_too_large() -> None:
    assert decode(GOOD, FR, max_bytes=len(GOOD)).round == 5
    assert len(GOOD) <= wire.max_message_bytes(FR)
    for data in (GOOD, bytearray(GOOD), memoryview(GOOD)):
        with pytest.raises(WireError) as info:
            decode(data, FR, max_bytes=len(GOOD) - 1)
        assert info.value.reason is Reason.TOO_LARGE
    # the limit is on bytes, also for a buffer of wider items
    wide = memoryview(np.frombuffer(GOOD[: len(GOOD) // 4 * 4], np.float32))
    with pytest.raises(WireError) as info:
        decode(wide, FR, max_bytes=len(wide) + 1)
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


# cbor2 turns these tags into Python objects (dates, sets, shared references, ...); the reference keeps them as tags
CBOR2_SEMANTIC_TAGS = (0, 1, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 43000, 55799)
KEYS = ("v", "run", "round", "sender", "k", "fp", "dtype", "frags")
MAX_ID = 2**31 - 1
# per codec: the tag, numpy dtype and items of a fragment's item ([index, values] + scale or indices)
ITEMS = {"none": (85, "<f4", 2), "fp16": (84, "<f2", 2), "bf16": (69, "<u2", 2), "int8": (72, "i1", 3),
         "topk": (85, "<f4", 3)}


def cbor2_read(data: bytes) -> Any:
    """cbor2's value of `data` (byte strings as bytes, tags but bignums as tags); raises what cbor2 raises."""
    stream = io.BytesIO(data)
    keep = {tag: lambda value, immutable, tag=tag: cbor2.CBORTag(tag, value) for tag in CBOR2_SEMANTIC_TAGS}
    obj = cbor2.CBORDecoder(stream, allow_duplicate_keys=False, strict_hashable_types=True,
                            semantic_decoders=keep).decode()
    if stream.tell() != len(data):
        raise ValueError(f"{len(data) - stream.tell()} trailing bytes")
    return obj


def is_float32(value: Any) -> bool:
    try:
        return type(value) is float and (math.isnan(value) or struct.unpack(">f", struct.pack(">f", value))[0] == value)
    except OverflowError:
        return False


def cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    size = next(size for size in (1, 2, 4, 8) if n < 1 << (8 * size))
    return bytes([major << 5 | (24 + size.bit_length() - 1)]) + n.to_bytes(size, "big")


def written(obj: Any) -> bytes:
    """`obj` in CBOR as `encode` writes its parts: definite lengths, shortest heads, a map's entries in their order,
    a float as a float32 where that is exact."""
    if isinstance(obj, Mapping):
        return cbor_head(5, len(obj)) + b"".join(written(k) + written(v) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return cbor_head(4, len(obj)) + b"".join(map(written, obj))
    if type(obj) is cbor2.CBORTag:
        return cbor_head(6, obj.tag) + written(obj.value)
    if is_float32(obj):
        return b"\xfa" + struct.pack(">f", obj)
    return cbor2.dumps(obj)


class Refused(Exception):
    def __init__(self, reason: Reason) -> None:
        self.reason = reason


def refuse_unless(ok: bool, reason: Reason) -> None:
    if not ok:
        raise Refused(reason)


def is_int(value: Any, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def is_typed(value: Any, number: int, nbytes: int) -> bool:
    return type(value) is cbor2.CBORTag and value.tag == number and type(value.value) is bytes and \
        len(value.value) == nbytes


def check(obj: Any, compression: Compression) -> FragmentBatch:
    """The reference's checks of a message's value, in the order of its bytes (as the spec and docs say)."""
    refuse_unless(type(obj) is dict and len(obj) == len(KEYS), Reason.BAD_HEADER)
    dtype = "<f4" if compression.codec == "none" else compression.codec
    for expected, (key, value) in zip(KEYS, obj.items(), strict=True):
        refuse_unless(type(key) in (str, bytes), Reason.MALFORMED)
        refuse_unless(key == expected, Reason.BAD_HEADER)
        if key == "v":
            refuse_unless(is_int(value, 1, 1), Reason.UNSUPPORTED_VERSION)
        elif key == "run":
            refuse_unless(type(value) is str and 0 < len(value) <= 128, Reason.BAD_HEADER)
            refuse_unless(value == RUN, Reason.WRONG_RUN)
        elif key in ("round", "sender", "k"):
            refuse_unless(is_int(value, 0, MAX_ID), Reason.BAD_HEADER)
            refuse_unless(key != "k" or value == FR.k, Reason.WRONG_K)
        elif key == "fp":
            refuse_unless(type(value) is bytes and value == FR.fingerprint, Reason.FOREIGN_FINGERPRINT)
        elif key == "dtype":
            refuse_unless(type(value) is str and value == dtype, Reason.BAD_DTYPE)
    fragments = check_fragments(obj["frags"], compression)
    return FragmentBatch(RUN, obj["round"], obj["sender"], FR.k, FR.fingerprint, fragments, compression.codec)


def check_fragments(frags: Any, compression: Compression) -> dict:
    """Every item's form (BAD_FRAGMENT), then each item's index not seen before and its values."""
    codec = compression.codec
    number, dtype, items = ITEMS[codec]
    refuse_unless(type(frags) is list and 1 <= len(frags) <= FR.k, Reason.BAD_FRAGMENT)
    for item in frags:
        refuse_unless(type(item) is list and len(item) == items and is_int(item[0], 0, FR.k - 1), Reason.BAD_FRAGMENT)
        count = compression.kept(len(FR.indices[item[0]]))
        refuse_unless(is_typed(item[1], number, count * np.dtype(dtype).itemsize), Reason.BAD_FRAGMENT)
        refuse_unless(codec != "int8" or is_float32(item[2]), Reason.BAD_FRAGMENT)
        refuse_unless(codec != "topk" or is_typed(item[2], 70, 4 * count), Reason.BAD_FRAGMENT)
    out: dict = {}
    for item in frags:
        index, size = item[0], len(FR.indices[item[0]])
        refuse_unless(index not in out, Reason.BAD_FRAGMENT)
        refuse_unless(not out or index > max(out), Reason.BAD_FRAGMENT)  # encode writes them in ascending order
        values = np.frombuffer(item[1].value, dtype)
        if codec == "topk":
            indices = np.frombuffer(item[2].value, "<u4").astype(np.int64)
            refuse_unless(bool(np.isfinite(values).all()), Reason.NON_FINITE)
            refuse_unless(bool(np.all(np.diff(indices) > 0)) and (not len(indices) or indices[-1] < size),
                          Reason.BAD_FRAGMENT)
            out[index] = values
            continue
        refuse_unless(codec != "int8" or (math.isfinite(item[2]) and item[2] > 0), Reason.BAD_FRAGMENT)
        if codec != "none":
            values = decompress(Compressed(codec, size, values, scale=item[2] if codec == "int8" else 1.0))[1]
        refuse_unless(bool(np.isfinite(values).all()), Reason.NON_FINITE)
        out[index] = values
    return out


def reference(data: bytes, compression: Compression = NONE) -> tuple[str, Any, bool]:
    """("ok", batch) or ("refused", reason) as the reference reads `data`, and whether `data` is written as
    `encode` writes (`written`) the value cbor2 reads (False where cbor2 reads none; True for a body over any
    message of the run, refused before it is read)."""
    if len(data) > wire.max_message_bytes(FR, compression):
        return "refused", Reason.TOO_LARGE, True
    try:
        obj = cbor2_read(data)
    except Exception:  # cbor2 raises several types
        return "refused", Reason.MALFORMED, False
    try:
        shaped = written(obj) == data
    except Exception:  # a value `written` cannot write (it is not a message's)
        shaped = False
    try:
        return "ok", check(obj, compression), shaped
    except Refused as refused:
        return "refused", refused.reason, shaped


def outcome(data: bytes, compression: Compression = NONE) -> tuple[str, Any]:
    try:
        return "ok", decode(data, FR, run_id=RUN, compression=compression)
    except WireError as exc:
        assert isinstance(exc.reason, Reason) and exc.detail and len(str(exc)) < 400
        return "refused", exc.reason


def agrees_with_reference(data: bytes, compression: Compression = NONE) -> tuple[str, Any, bool]:
    """decode accepts what the reference accepts and `encode` writes byte for byte, to the same fragments (for
    none, a batch that encodes to `data`); where the reference's value is written as encode writes, both refuse
    for the same reason. Anything but WireError fails the test."""
    status, value, shaped = reference(data, compression)
    got = outcome(data, compression)
    if got[0] == "ok":
        assert status == "ok" and shaped, (data, value)
        assert got[1].codec == compression.codec and got[1].fragments.keys() == value.fragments.keys()
        if compression.codec == "none":
            assert same_batch(got[1], value) and encode(got[1]) == data
    else:
        assert not (status == "ok" and shaped), (data, got)
        if shaped:
            assert got[1] is value, (data, got[1], value)
    return got[0], got[1], shaped


EDGES = [
    # chunked strings
    b"\x5f\x41a\x41b\xff", b"\x7f\x61a\x61b\xff", b"\x5f\x61a\xff", b"\x5f\x41a", b"\x5f\xff", b"\x7f\xff",
    # simple values and floats
    b"\xf0", b"\xf3", b"\xf4", b"\xf5", b"\xf6", b"\xf7", b"\xf8\x10", b"\xf8\x1f", b"\xf8\x20", b"\xf8\xff",
    b"\xf9\x7e\x00", b"\xf9\x80\x00", b"\xf9\x7c\x00", b"\xfa\x7f\xc0\x00\x01", b"\xfb" + struct.pack(">d", -0.0),
    b"\xf9\x3c", b"\xfc", b"\xfd", b"\xfe", b"\xff",
    # heads: reserved, indefinite where none may be, truncated, long forms
    b"\x1c", b"\x3d", b"\x5e", b"\x9c", b"\xbd", b"\xde\x00", b"\x1f", b"\x3f", b"\xdf\x00", b"\x19\x01",
    b"\x1b" + bytes(8), b"\x3b" + b"\xff" * 8, b"\x1b" + b"\xff" * 8, b"\x9f\x01", b"\xbf\x61a\xff", b"\xbf\xff",
    b"\x18\x05", b"\x19\x00\x05", b"\x1a\x00\x00\x00\x05", b"\x1b" + (5).to_bytes(8, "big"), b"\x18\x18",
    # maps and arrays
    b"\xa2\x61a\x00\x41a\x00", b"\xa2\x61a\x00\x61a\x01", b"\xa1\x00\x00", b"\xa1\x80\x00", b"\xa1\x61a", b"\x80",
    b"\x82\x00", b"\x81\x81\x81\x81\x81\x81\x81\x00", b"\x9b" + (2**63).to_bytes(8, "big"),
    b"\xbb" + (2**63).to_bytes(8, "big"), b"\x5b" + (2**63).to_bytes(8, "big"),
    # tags: bignums, typed arrays, any other
    b"\xc2\x40", b"\xc2\x41\x01", b"\xc3\x41\x01", b"\xc2\x00", b"\xc2\x5f\x41\x01\x41\x02\xff", b"\xc2\xc2\x41\x01",
    b"\xd8\x55\x41\x00", b"\xc0\x00", b"\xc1\x61a", b"\xd8\x1c\x81\xd8\x1d\x00", b"\xd9\xd9\xf7\x82\x01\x02",
    b"\xdb" + b"\xff" * 8 + b"\x00", b"\xc6" * 10 + b"\x00",
]
FRAGMENT_AFTER = message(frags=[])[:-1] + b"\x81\x82\x00"  # a message up to its one fragment's values


@pytest.mark.parametrize("edge", EDGES, ids=[e.hex()[:24] for e in EDGES])
def test_odd_cbor_in_a_message_agrees_with_the_reference(edge: bytes) -> None:
    """An odd head, alone or as a message's round, a fragment's values or the rest of a fragment's item: refused
    (with the reference's reason where the reference reads it) or, if it is what encode writes there, read."""
    for data in (edge, round_as(edge), FRAGMENT_AFTER + edge, FRAGMENT_AFTER + b"\xd8\x55" + edge,
                 round_as(edge) + b"\x00"):
        agrees_with_reference(data)


def test_fuzz_decode_agrees_with_the_reference() -> None:
    accepted, compared, reasons = 0, 0, set()
    for data in fuzz_inputs(seed=20260501, count=12_000):
        result, value, shaped = agrees_with_reference(data)
        if result == "ok":
            accepted += 1
            assert same_batch(decode(encode(value), FR, run_id=RUN), value)
        else:
            reasons.add(value)
            compared += shaped
    # the fuzzer reaches deep into the validation, not only the CBOR heads, and most refusals are compared
    assert accepted > 100 and compared > 2_000
    assert {Reason.MALFORMED, Reason.BAD_HEADER, Reason.BAD_FRAGMENT, Reason.NON_FINITE,
            Reason.FOREIGN_FINGERPRINT} <= reasons


@settings(max_examples=150, deadline=None)
@given(case=batches(), where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_a_changed_byte_is_refused_or_read_as_written(case: tuple[FragmentBatch, Fragmentation], where: float,
                                                      flip: int) -> None:
    """decode accepts only what encode writes: a message with one byte changed is refused, or it is another
    message, which encodes back to exactly those bytes."""
    batch, fr = case
    data = bytearray(encode(batch))
    data[int(where * len(data))] ^= flip
    try:
        got = decode(bytes(data), fr, run_id=batch.run_id)
    except WireError:
        return
    assert encode(got) == data


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk:0.25"])
def test_fuzz_compressed_decode_agrees_with_the_reference(codec: str) -> None:
    """A compressed run's items ([index, values, scale or indices]) are read and checked as the reference does."""
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


# -- large bodies: refused from their CBOR heads --------------------------------------------------------------

BIG = Fragmentation.build(Layout.flat(1 << 20), 4, seed=7)  # four fragments of 1 MiB: messages over 64 KiB


def big_fields(**overrides: Any) -> dict:
    frags = [[f, tag(np.ones(len(BIG.indices[f]), np.float32))] for f in range(4)]
    return {"v": 1, "run": RUN, "round": 0, "sender": 1, "k": 4, "fp": BIG.fingerprint, "dtype": "<f4",
            "frags": frags, **overrides}


def claims(size: int) -> bytes:
    """An array of `size` zeros: one byte each, and cbor2 would build a list of `size` items."""
    return b"\x9b" + size.to_bytes(8, "big") + bytes(size)


def test_large_messages_pass_the_structure_check_as_encode_writes_them() -> None:
    ones = {f: np.ones(len(BIG.indices[f]), np.float32) for f in range(4)}
    canonical = encode(FragmentBatch(RUN, 0, 1, 4, BIG.fingerprint, ones))
    assert canonical == cbor2.dumps(big_fields())
    wire.check_structure(canonical, BIG)
    assert sorted(decode(canonical, BIG, run_id=RUN).fragments) == [0, 1, 2, 3]
    indefinite = b"\xbf" + canonical[1:] + b"\xff"  # the same map, of indefinite length: not what encode writes
    with pytest.raises(WireError) as info:
        wire.check_structure(indefinite, BIG)
    assert info.value.reason is Reason.MALFORMED


def header_then(frags: bytes) -> bytes:
    return cbor2.dumps(big_fields(frags=[]))[:-1] + frags


MANY = 1 << 17  # items of a body that claims many small ones
LARGE_CASES: list[tuple[str, bytes, Reason]] = [
    ("array_at_the_top", claims(2 << 20), Reason.BAD_HEADER),
    ("frags_of_millions", header_then(claims(2 << 20)), Reason.BAD_FRAGMENT),
    ("frags_of_k_plus_one", header_then(b"\x85" + bytes(5) + bytes(1 << 17)), Reason.BAD_FRAGMENT),
    ("indefinite_frags", header_then(b"\x9f" + bytes(1 << 17) + b"\xff"), Reason.MALFORMED),
    ("map_in_a_field", cbor2.dumps(big_fields(sender={i: 0 for i in range(1 << 15)}, frags=[])), Reason.BAD_HEADER),
    ("long_run_id", cbor2.dumps(big_fields(run="r" * (1 << 17), frags=[])), Reason.BAD_HEADER),
    ("long_fragment", cbor2.dumps(big_fields(frags=[[0, tag(np.ones(1 << 19, np.float32))]])),
     Reason.BAD_FRAGMENT),
    ("deep_tags", header_then(b"\x81\x82\x00" + b"\xc6" * (1 << 16) + b"\x00"), Reason.BAD_FRAGMENT),
    ("chunked_bytes", header_then(b"\x81\x82\x00\xd8\x55\x5f" + b"\x40" * (1 << 17) + b"\xff"), Reason.MALFORMED),
    ("truncated", cbor2.dumps(big_fields())[:-1], Reason.MALFORMED),
    ("over_any_message_of_the_run", claims(5 << 20), Reason.TOO_LARGE),
    ("many_zeros", b"\x9a" + MANY.to_bytes(4, "big") + bytes(MANY), Reason.BAD_HEADER),
    ("many_arrays", b"\x9a" + MANY.to_bytes(4, "big") + b"\x81\x00" * MANY, Reason.BAD_HEADER),
    ("many_chunks", b"\x5f" + b"\x40" * MANY + b"\xff", Reason.MALFORMED),
    ("many_fragments", header_then(b"\x9a" + MANY.to_bytes(4, "big") + b"\x80" * MANY), Reason.BAD_FRAGMENT),
]


@pytest.mark.parametrize(("data", "reason"), [(d, r) for _, d, r in LARGE_CASES], ids=[n for n, _, _ in LARGE_CASES])
def test_a_large_body_that_cannot_be_a_message_is_refused_before_it_is_parsed(data: bytes, reason: Reason) -> None:
    assert len(data) >= 1 << 16
    wire._run(BIG, NONE)  # the run's own figures, computed once per run, are not the body's
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as info:
            decode(data, BIG, run_id=RUN)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.reason is reason, info.value
    assert peak < 64 << 10, f"{peak} bytes allocated to refuse a {len(data)}-byte body"

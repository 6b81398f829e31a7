"""The wire format of compressed runs (--compress): each codec's messages decode to what `dense` gives, a receiver
takes only its run's codec, and every malformed item is refused with its reason."""

from __future__ import annotations

import struct

import cbor2
import numpy as np
import pytest

from mosaic_proto import Fragmentation, FragmentBatch, Layout, Reason, WireError, decode, encode
from mosaic_proto.compression import Compressed, Compression, dense
from mosaic_proto.wire import check_structure, max_message_bytes

FR = Fragmentation.build(Layout(("w", "b"), ((40, 5), (12,))), 3, seed=1)
CODECS = ["fp16", "bf16", "int8", "topk:0.1", "topk:1"]


def batch(codec: str, fragments: tuple[int, ...] = (0, 2)) -> tuple[FragmentBatch, dict[int, np.ndarray]]:
    compression = Compression.parse(codec)
    rng = np.random.default_rng(7)
    values = {f: rng.standard_normal(len(FR.indices[f])).astype(np.float32) for f in fragments}
    sent = {f: compression.compress(v, seed=3, round=2, node=1, fragment=f) for f, v in values.items()}
    return FragmentBatch("run", 2, 1, FR.k, FR.fingerprint, sent, compression.codec), values


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_decodes_to_what_was_sent(codec: str) -> None:
    message, _ = batch(codec)
    data = encode(message)
    got = decode(data, FR, run_id="run", compression=Compression.parse(codec))
    assert (got.round, got.sender, got.codec, sorted(got.fragments)) == (2, 1, message.codec, [0, 2])
    for f, sent in message.fragments.items():
        assert isinstance(sent, Compressed)
        received = got.fragments[f]
        assert np.array_equal(dense(received) if isinstance(received, Compressed) else received, dense(sent))
    assert cbor2.loads(data)["dtype"] == message.codec  # the wire names the codec
    assert len(data) <= max_message_bytes(FR, Compression.parse(codec))
    check_structure(data, FR, Compression.parse(codec))


def test_compressed_messages_are_smaller_by_their_codec() -> None:
    sizes = {codec: len(encode(batch(codec, (0, 1, 2))[0])) for codec in ["fp16", "int8", "topk:0.1"]}
    plain = len(encode(FragmentBatch("run", 2, 1, FR.k, FR.fingerprint,
                                     {f: np.zeros(len(FR.indices[f]), np.float32) for f in range(3)})))
    assert sizes["fp16"] < 0.6 * plain and sizes["int8"] < 0.35 * plain and sizes["topk:0.1"] < 0.35 * plain


@pytest.mark.parametrize(("sent", "run"), [("none", "int8"), ("int8", "none"), ("fp16", "bf16"),
                                           ("topk:0.1", "topk:0.2")])
def test_a_receiver_takes_only_its_runs_codec(sent: str, run: str) -> None:
    if sent == "none":
        data = encode(FragmentBatch("run", 2, 1, FR.k, FR.fingerprint, {0: np.zeros(len(FR.indices[0]), np.float32)}))
    else:
        data = encode(batch(sent)[0])
    with pytest.raises(WireError) as refused:
        decode(data, FR, run_id="run", compression=Compression.parse(run))
    expected = Reason.BAD_FRAGMENT if sent.startswith("topk") and run.startswith("topk") else Reason.BAD_DTYPE
    assert refused.value.reason is expected
    if expected is Reason.BAD_DTYPE:
        assert f"--compress {Compression.parse(run)}" in refused.value.detail


class Float32:
    """A float that `forged` writes as `encode` writes int8's scale (a float32; cbor2 writes a float64)."""

    def __init__(self, value: float) -> None:
        self.value = value


def _float32(encoder: cbor2.CBOREncoder, value: Float32) -> None:
    encoder.write(b"\xfa" + struct.pack(">f", value.value))


def forged(codec: str, change) -> bytes:
    obj = cbor2.loads(encode(batch(codec)[0]))
    for item in obj["frags"]:  # int8's scales as encode wrote them
        item[2:] = [Float32(v) if type(v) is float else v for v in item[2:]]
    change(obj["frags"][0])
    return cbor2.dumps(obj, default=_float32)


def _set(index: int, value: object):
    def change(item: list) -> None:
        item[index] = value
    return change


TOPK_SIZE = len(FR.indices[0])
KEPT = Compression.parse("topk:0.1").kept(TOPK_SIZE)


@pytest.mark.parametrize(("codec", "change", "reason", "says"), [
    ("int8", _set(2, Float32(0.0)), Reason.BAD_FRAGMENT, "scale"),
    ("int8", _set(2, Float32(-1.0)), Reason.BAD_FRAGMENT, "scale"),
    ("int8", _set(2, Float32(float("inf"))), Reason.BAD_FRAGMENT, "scale"),
    ("int8", _set(2, 3), Reason.BAD_FRAGMENT, "scale"),
    ("int8", _set(2, 0.5), Reason.BAD_FRAGMENT, "float32"),  # a float64: encode writes a float32
    ("int8", _set(2, Float32(1e38)), Reason.NON_FINITE, "NaN or infinite"),
    ("int8", lambda item: item.pop(), Reason.BAD_FRAGMENT, "3 items"),
    ("fp16", _set(1, cbor2.CBORTag(84, np.full(TOPK_SIZE, np.inf, "<f2").tobytes())), Reason.NON_FINITE, "NaN"),
    ("fp16", _set(1, cbor2.CBORTag(85, b"\0" * 4 * TOPK_SIZE)), Reason.BAD_FRAGMENT, "tag-84"),
    ("bf16", _set(1, cbor2.CBORTag(69, b"\0" * 2)), Reason.BAD_FRAGMENT, "bytes, expected"),
    ("topk:0.1", _set(2, cbor2.CBORTag(70, np.arange(KEPT, dtype="<u4")[::-1].tobytes())), Reason.BAD_FRAGMENT,
     "ascend"),
    ("topk:0.1", _set(2, cbor2.CBORTag(70, np.arange(TOPK_SIZE - KEPT + 1, TOPK_SIZE + 1, dtype="<u4").tobytes())),
     Reason.BAD_FRAGMENT, "ascend"),
    ("topk:0.1", _set(1, cbor2.CBORTag(85, np.zeros(KEPT + 1, "<f4").tobytes())), Reason.BAD_FRAGMENT, "expected"),
    ("topk:0.1", _set(1, cbor2.CBORTag(85, np.full(KEPT, np.nan, "<f4").tobytes())), Reason.NON_FINITE, "NaN"),
    ("topk:0.1", _set(0, 7), Reason.BAD_FRAGMENT, "index"),
])
def test_malformed_compressed_fragments_are_refused(codec: str, change, reason: Reason, says: str) -> None:
    with pytest.raises(WireError) as refused:
        decode(forged(codec, change), FR, run_id="run", compression=Compression.parse(codec))
    assert refused.value.reason is reason and says in refused.value.detail


def test_topk_may_send_more_bytes_than_the_floats_and_the_limit_says_so() -> None:
    """topk:1 sends every value and its index: 8 bytes a coordinate, within its run's limit, not within none's."""
    big = Fragmentation.build(Layout(("w",), ((4000,),)), 2, seed=1)
    topk = Compression.parse("topk:1")
    sent = {f: topk.compress(np.ones(len(big.indices[f]), np.float32), seed=0, round=0, node=0, fragment=f)
            for f in range(2)}
    data = encode(FragmentBatch("run", 0, 0, 2, big.fingerprint, sent, "topk"))
    assert max_message_bytes(big) < len(data) <= max_message_bytes(big, topk)
    assert len(decode(data, big, run_id="run", compression=topk).fragments) == 2
    with pytest.raises(WireError) as refused:
        check_structure(data, big)
    assert refused.value.reason is Reason.TOO_LARGE

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mosaic_proto.compression import (
    Compressed,
    Compression,
    Compressor,
    decompress,
    dense,
    from_bfloat16,
    sparse_average,
    stand_in_average,
    to_bfloat16,
)

KEY = dict(seed=7, round=3, node=2, fragment=1)
finite = arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e4, 1e4, width=32))


@pytest.mark.parametrize("text, codec, fraction", [("none", "none", 1.0), ("fp16", "fp16", 1.0),
                                                   ("bf16", "bf16", 1.0), ("int8", "int8", 1.0),
                                                   ("topk:0.1", "topk", 0.1), (" topk:1 ", "topk", 1.0)])
def test_parse(text: str, codec: str, fraction: float) -> None:
    parsed = Compression.parse(text)
    assert (parsed.codec, parsed.fraction) == (codec, fraction)
    assert Compression.parse(str(parsed)) == parsed


@pytest.mark.parametrize("text, says", [("gzip", "one of none, fp16"), ("topk", "topk:0.1"), ("topk:0", "(0, 1]"),
                                        ("topk:1.5", "(0, 1]"), ("topk:nan", "(0, 1]"), ("int8:4", "no argument")])
def test_parse_refuses_naming_what_is_allowed(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="compression|topk") as err:
        Compression.parse(text)
    assert says in str(err.value)


@settings(max_examples=60, deadline=None)
@given(finite)
def test_each_codec_stays_within_its_error(values: np.ndarray) -> None:
    peak = float(np.max(np.abs(values)))
    assert np.array_equal(dense(Compression("none").compress(values, **KEY)), values)
    fp16 = dense(Compression("fp16").compress(values, **KEY))
    assert np.allclose(fp16, values, rtol=2.0 ** -11, atol=2.0 ** -24)
    bf16 = dense(Compression("bf16").compress(values, **KEY))
    assert np.allclose(bf16, values, rtol=2.0 ** -8, atol=2.0 ** -133)  # bf16's subnormals: 7 bits
    int8 = Compression("int8").compress(values, **KEY)
    assert np.all(np.abs(dense(int8) - values) <= int8.scale * 1.0001 + 1e-30)
    assert int8.scale == (float(np.float32(peak / 127)) or 1.0)  # float32, as the wire carries it


def test_fp16_saturates_instead_of_sending_infinity() -> None:
    sent = dense(Compression("fp16").compress(np.array([1e6, -1e9, 3.0], np.float32), **KEY))
    assert sent.tolist() == [65504.0, -65504.0, 3.0]


def test_bfloat16_rounds_to_nearest_even_as_torch_does() -> None:
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1000
    values[:4] = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -0.0, 65504.0]  # ties (to even: down, up), a sign, a big one
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bfloat16(values), theirs)
    assert np.array_equal(from_bfloat16(theirs), torch.from_numpy(values).to(torch.bfloat16).float().numpy())


def test_int8_is_the_same_for_the_same_key_and_unbiased_over_keys() -> None:
    values = np.linspace(-1, 1, 1001, dtype=np.float32)
    int8 = Compression("int8")
    once, again = int8.compress(values, **KEY), int8.compress(values, **KEY)
    assert np.array_equal(once.values, again.values) and once.scale == again.scale
    assert not np.array_equal(once.values, int8.compress(values, **{**KEY, "round": 4}).values)
    mean = np.mean([dense(int8.compress(values, **{**KEY, "round": r})) for r in range(400)], axis=0)
    assert np.max(np.abs(mean - values)) < 0.15 * once.scale  # stochastic rounding: right on average (nearest: 0.5)


def test_topk_sends_the_largest_coordinates_in_index_order() -> None:
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    message = Compression.parse("topk:0.1").compress(values, **KEY)
    indices, sent = decompress(message)
    assert indices is not None and len(indices) == 100 and np.all(np.diff(indices.astype(np.int64)) > 0)
    assert np.array_equal(sent, values[indices])
    assert np.min(np.abs(sent)) >= np.sort(np.abs(values))[-100]
    assert Compression.parse("topk:0.0001").kept(10) == 1
    every = Compression.parse("topk:1").compress(values, **KEY)
    assert np.array_equal(every.indices, np.arange(1000)) and np.array_equal(every.values, values)


def test_bytes_on_the_wire() -> None:
    values = np.ones(10_000, np.float32)
    sizes = {text: Compression.parse(text).compress(values, **KEY).nbytes
             for text in ("none", "fp16", "bf16", "int8", "topk:0.1")}
    assert sizes == {"none": 40_000, "fp16": 20_000, "bf16": 20_000, "int8": 10_004, "topk:0.1": 8_000}


def test_topk_with_error_feedback_sends_every_coordinate_in_turn() -> None:
    """A fragment that stays the same: with error feedback its receivers know all of it after 1 / fraction rounds,
    and then nothing is left unsent; without it, topk sends the same largest coordinates forever."""
    values = np.random.default_rng(2).standard_normal(200).astype(np.float32)
    topk = Compression.parse("topk:0.05")
    feedback, plain = Compressor(topk, seed=1, node=0), Compressor(topk, seed=1, node=0, error_feedback=False)
    known, seen = np.zeros_like(values), set()
    for r in range(20):
        message = feedback.compress(values, round=r, fragment=3)
        known[message.indices] = message.values
        seen.update(plain.compress(values, round=r, fragment=3).indices.tolist())
    assert np.array_equal(known, values)
    assert np.array_equal(feedback.state()["kept_3"], values)  # the values last sent: all of them, nothing unsent
    assert len(seen) == 10 and "kept_0" not in feedback.state()


def test_quantizer_error_feedback_sends_the_model_on_average() -> None:
    """int8 of a constant fragment: the rounding error carried, the messages' mean tends to the values."""
    values = np.random.default_rng(5).standard_normal(100).astype(np.float32)
    compressor = Compressor(Compression.parse("int8"), seed=0, node=1)
    sent = np.mean([dense(compressor.compress(values, round=r, fragment=0)) for r in range(50)], axis=0)
    step = np.abs(values).max() / 127
    assert np.max(np.abs(sent - values)) < 2 * step / 50 + 1e-6


def test_sparse_average_counts_only_the_messages_that_carry_a_coordinate() -> None:
    own = np.array([1, 1, 1, 1], np.float32)
    topk = Compression.parse("topk:0.5")
    a = topk.compress(np.array([9, 0, 5, 0], np.float32), **KEY)  # carries coordinates 0 and 2
    b = Compression("none").compress(np.array([3, 3, 3, 3], np.float32), **KEY)
    assert np.array_equal(sparse_average(own, [a, b]), np.array([13 / 3, 2, 3, 2], np.float32))
    with pytest.raises(ValueError, match="coordinates"):
        sparse_average(np.ones(3, np.float32), [b])


@pytest.mark.parametrize("codec", ["int8", "topk:0.2"])
def test_the_state_survives_a_checkpoint_and_the_messages_go_on_the_same(codec: str) -> None:
    """A node that resumes from its compressor's state sends what it would have sent had it never stopped."""
    values = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    whole, first = (Compressor(Compression.parse(codec), seed=4, node=2) for _ in range(2))
    for r in range(3):
        whole.compress(values * r, round=r, fragment=0)
        first.compress(values * r, round=r, fragment=0)
    again = Compressor(Compression.parse(codec), seed=4, node=2)
    again.restore(first.state())
    assert again.compress(values, round=3, fragment=0).values.tobytes() == \
        whole.compress(values, round=3, fragment=0).values.tobytes()


def test_without_error_feedback_nothing_is_kept() -> None:
    compressor = Compressor(Compression.parse("topk:0.1"), seed=0, node=0, error_feedback=False)
    compressor.compress(np.arange(30, dtype=np.float32), round=0, fragment=0)
    assert compressor.state() == {}


def test_a_topk_receiver_reads_the_newest_value_it_heard_where_a_message_is_silent() -> None:
    """Fragment [0..4) of a model of 6: the first round's stand-in is the node's own model; what the messages
    carried (the higher sender's value last) is heard, and read by the next round where a message is silent."""
    topk = Compression.parse("topk:0.5")
    receiver = Compressor(topk, seed=0, node=0)
    own = np.array([1, 1, 1, 1, 5, 5], np.float32)
    indices = [np.array([0, 2, 4, 5]), np.array([1, 3])]
    a = Compressed("topk", 4, np.array([9, 3], np.float32), np.array([0, 1], np.uint32))
    b = Compressed("topk", 4, np.array([7, 2], np.float32), np.array([1, 2], np.uint32))
    stand_in = receiver.stand_in(own)
    assert stand_in is not None and np.array_equal(stand_in, own)
    mine = own[indices[0]]
    assert np.allclose(stand_in_average(mine, [a, b], stand_in[indices[0]]),
                       [(1 + 9 + 1) / 3, (1 + 5 + 5) / 3, (5 + 5 + 2) / 3, (5 + 5 + 5) / 3])
    receiver.heard(indices, {2: {0: b}, 1: {0: a}})
    assert np.array_equal(receiver.stand_in(own), [9, 1, 7, 1, 2, 5])  # coordinate 2 (index 1): sender 2's 7
    again = Compressor(topk, seed=0, node=0)
    again.restore(receiver.state())
    assert np.array_equal(again.stand_in(np.zeros(6, np.float32)), [9, 1, 7, 1, 2, 5])


def test_only_topk_with_error_feedback_has_a_stand_in() -> None:
    own = np.ones(4, np.float32)
    assert Compressor(Compression.parse("int8"), seed=0, node=0).stand_in(own) is None
    assert Compressor(Compression.parse("topk:0.1"), seed=0, node=0, error_feedback=False).stand_in(own) is None

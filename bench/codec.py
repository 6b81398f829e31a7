"""Wire codec throughput: encode + decode round trip of one float32 fragment vs a plain numpy copy; and the
compression codecs' cost per message (--compress: compress + encode at the sender, decode at a receiver, the
message's bytes against `none`'s).

For each size n (floats), one message carries one fragment of n float32 values (K=1 fragmentation of a
flat layout of n coordinates). The round trip is `decode(encode(batch))` with full validation; the
reference is `np.copyto` of the same n floats into a preallocated array. Throughputs are in MB/s of float
payload (n * 4 bytes / time per operation; 1 MB = 1e6 bytes), best of several timed repeats.

Usage: .venv/bin/python bench/codec.py [--budget SECONDS]
The last line of stdout is a JSON object: per-size figures, `ratio` (round trip / copy at 1e6 floats) and
`compression` (per codec and fragment size: microseconds to compress + encode and to decode one message of one
fragment, both against a copy of the same floats, and the message's bytes against `none`'s).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np

from mosaic_proto import Fragmentation, FragmentBatch, Layout, decode, encode
from mosaic_proto.compression import Compression, Compressor

SIZES = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk:0.1", "topk:0.01")
COMPRESSION_SIZES = (14_826, 1_000_000)  # the digits CNN's whole model; a 1M-float fragment
RUN_ID = "bench-codec"


def per_op(fn: Callable[[], object], budget: float, repeats: int = 5) -> float:
    """Seconds per call: the best of `repeats` timed loops, each lasting about budget / repeats."""
    fn()  # warm up (page faults, allocator)
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    loops = max(1, int(budget / repeats / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best


def bench_size(n: int, budget: float) -> dict[str, float]:
    fragmentation = Fragmentation.build(Layout.flat(n), 1, seed=0)
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    batch = FragmentBatch(RUN_ID, 7, 3, 1, fragmentation.fingerprint, {0: values})
    payload = encode(batch)
    back = decode(payload, fragmentation, run_id=RUN_ID)
    assert np.array_equal(back.fragments[0].view(np.uint32), values.view(np.uint32))
    dst = np.empty_like(values)
    mb = n * 4 / 1e6
    t_enc = per_op(lambda: encode(batch), budget / 4)
    t_dec = per_op(lambda: decode(payload, fragmentation, run_id=RUN_ID), budget / 4)
    t_rt = per_op(lambda: decode(encode(batch), fragmentation, run_id=RUN_ID), budget / 4)
    t_copy = per_op(lambda: np.copyto(dst, values), budget / 4)
    return {
        "floats": n,
        "message_bytes": len(payload),
        "header_bytes": len(payload) - n * 4,
        "encode_MBps": mb / t_enc,
        "decode_MBps": mb / t_dec,
        "roundtrip_MBps": mb / t_rt,
        "copy_MBps": mb / t_copy,
        "roundtrip_us": t_rt * 1e6,
        "copy_us": t_copy * 1e6,
        "ratio": t_copy / t_rt,
    }


def bench_compression(n: int, budget: float) -> dict[str, dict[str, float]]:
    """Per codec: a message of one fragment of n floats, compressed (with error feedback, as a node sends it) and
    encoded by the sender, decoded (and checked) by a receiver."""
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    fragmentation = Fragmentation.build(Layout(("x",), ((n,),)), 1, seed=0)
    dst = np.empty_like(values)
    share = budget / (2 * len(COMPRESSIONS) + 1)
    t_copy = per_op(lambda: np.copyto(dst, values), share)
    rows, plain = {}, None
    for text in COMPRESSIONS:
        codec = Compression.parse(text)
        compressor = Compressor(codec, seed=1, node=3)

        def send(codec: Compression = codec, compressor: Compressor = compressor) -> bytes:
            sent = values if codec.codec == "none" else compressor.compress(values, round=2, fragment=0)
            return encode(FragmentBatch(RUN_ID, 2, 3, 1, fragmentation.fingerprint, {0: sent}, codec.codec))
        data = send()
        t_send = per_op(send, share)
        t_receive = per_op(lambda data=data, codec=codec: decode(data, fragmentation, run_id=RUN_ID,
                                                                 compression=codec), share)
        plain = plain or len(data)
        rows[text] = {"encode_us": t_send * 1e6, "decode_us": t_receive * 1e6, "us": (t_send + t_receive) * 1e6,
                      "vs_copy": (t_send + t_receive) / t_copy, "bytes": len(data), "bytes_vs_none": len(data) / plain}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.8, help="seconds of timing per size (default 0.8)")
    args = parser.parse_args()
    rows = {str(n): bench_size(n, args.budget) for n in SIZES}
    print(f"mosaic_proto wire codec, python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}")
    print(f"{'floats':>10} {'msg bytes':>10} {'hdr':>4} {'encode MB/s':>12} {'decode MB/s':>12} "
          f"{'round trip MB/s':>16} {'copy MB/s':>10} {'rt/copy':>8}")
    for r in rows.values():
        print(f"{r['floats']:>10.0e} {r['message_bytes']:>10} {r['header_bytes']:>4} {r['encode_MBps']:>12.0f} "
              f"{r['decode_MBps']:>12.0f} {r['roundtrip_MBps']:>16.0f} {r['copy_MBps']:>10.0f} {r['ratio']:>8.3f}")
    compression = {str(n): bench_compression(n, args.budget) for n in COMPRESSION_SIZES}
    print("\n--compress: a message of one fragment, compress + encode (sender) and decode (receiver), its bytes")
    print(f"{'floats':>10} {'codec':>10} {'encode us':>10} {'decode us':>10} {'x copy':>8} {'bytes':>10} {'x none':>7}")
    for n, codecs in compression.items():
        for text, r in codecs.items():
            print(f"{int(n):>10} {text:>10} {r['encode_us']:>10.1f} {r['decode_us']:>10.1f} {r['vs_copy']:>8.1f} "
                  f"{r['bytes']:>10} {r['bytes_vs_none']:>7.3f}")
    summary = {"sizes": {n: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                         for n, r in rows.items()},
               "ratio": round(rows[str(1_000_000)]["ratio"], 4),
               "compression": {n: {c: {k: round(v, 3) for k, v in r.items()} for c, r in codecs.items()}
                               for n, codecs in compression.items()}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

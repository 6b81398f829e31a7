"""Wire codec throughput: encode + decode round trip of one float32 fragment vs a plain numpy copy; and the
compression codecs' cost per message (`mosaic_proto.compression`: compress + decompress, bytes against `none`).

For each size n (floats), one message carries one fragment of n float32 values (K=1 fragmentation of a
flat layout of n coordinates). The round trip is `decode(encode(batch))` with full validation; the
reference is `np.copyto` of the same n floats into a preallocated array. Throughputs are in MB/s of float
payload (n * 4 bytes / time per operation; 1 MB = 1e6 bytes), best of several timed repeats.

Usage: .venv/bin/python bench/codec.py [--budget SECONDS]
The last line of stdout is a JSON object: per-size figures, `ratio` (round trip / copy at 1e6 floats) and
`compression` (per codec and fragment size: microseconds per compress + decompress, that time against a copy of
the same floats, payload bytes against `none`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np

from mosaic_proto import Fragmentation, FragmentBatch, Layout, decode, encode
from mosaic_proto.compression import Compression, decompress

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
    """Per codec: one fragment of n floats compressed and decompressed (the sender's and a receiver's work)."""
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    dst = np.empty_like(values)
    t_copy = per_op(lambda: np.copyto(dst, values), budget / (len(COMPRESSIONS) + 1))
    plain = n * 4
    rows = {}
    for text in COMPRESSIONS:
        codec = Compression.parse(text)

        def both(codec: Compression = codec) -> object:
            return decompress(codec.compress(values, seed=1, round=2, node=3, fragment=0))
        t = per_op(both, budget / (len(COMPRESSIONS) + 1))
        nbytes = codec.compress(values, seed=1, round=2, node=3, fragment=0).nbytes
        rows[text] = {"us": t * 1e6, "vs_copy": t / t_copy, "bytes": nbytes, "bytes_vs_none": nbytes / plain}
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
    print("\ncompression (mosaic_proto.compression): compress + decompress of one fragment, payload bytes")
    print(f"{'floats':>10} {'codec':>10} {'us':>10} {'x copy':>8} {'bytes':>10} {'x none':>7}")
    for n, codecs in compression.items():
        for text, r in codecs.items():
            print(f"{int(n):>10} {text:>10} {r['us']:>10.1f} {r['vs_copy']:>8.1f} {r['bytes']:>10} "
                  f"{r['bytes_vs_none']:>7.3f}")
    summary = {"sizes": {n: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                         for n, r in rows.items()},
               "ratio": round(rows[str(1_000_000)]["ratio"], 4),
               "compression": {n: {c: {k: round(v, 3) for k, v in r.items()} for c, r in codecs.items()}
                               for n, codecs in compression.items()}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

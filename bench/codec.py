"""Wire codec throughput: encode + decode round trip of one float32 fragment vs a plain numpy copy.

For each size n (floats), one message carries one fragment of n float32 values (K=1 fragmentation of a
flat layout of n coordinates). The round trip is `decode(encode(batch))` with full validation; the
reference is `np.copyto` of the same n floats into a preallocated array. Throughputs are in MB/s of float
payload (n * 4 bytes / time per operation; 1 MB = 1e6 bytes), best of several timed repeats.

Usage: .venv/bin/python bench/codec.py [--budget SECONDS]
The last line of stdout is a JSON object: per-size figures and `ratio` (round trip / copy at 1e6 floats).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np

from mosaic_proto import Fragmentation, FragmentBatch, Layout, decode, encode

SIZES = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
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
    summary = {"sizes": {n: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                         for n, r in rows.items()},
               "ratio": round(rows[str(1_000_000)]["ratio"], 4)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

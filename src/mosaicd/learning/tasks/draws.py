"""`torch.randperm(n, generator=g)` on the CPU for many seeded generators at once, in numpy: `--batched` draws every
node's batches of a round together, where a torch call per pass over each shard cost as much as a fifth of the
round's training (1,000 nodes of the teacher task).

torch's CPU randperm (below 2**32 / 20 values) is a Fisher-Yates shuffle on its mt19937: for i in 0 .. n-2,
z = next32() % (n - i) and r[i] swaps with r[i + z]. Its mt19937 seeded with s is the reference generator seeded with
s mod 2**32, which numpy's MT19937 gives by its legacy seeding. `matches()` checks both against torch once per
process; `stacked.batch_rows` draws through torch itself where they do not match.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["matches", "shuffled_prefixes"]

LARGEST = 2**32 // 20  # torch shuffles larger n another way


def shuffled_prefixes(seeds: Sequence[int], sizes: np.ndarray, passes: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Generator j seeded with seeds[j] draws passes[j] permutations of range(sizes[j]) one after another, as
    torch.randperm does: the first keep[j] entries of each, (lanes, max keep), a lane per (generator, pass) in that
    order (the entries past a lane's keep are unspecified)."""
    sizes, passes, keep = (np.asarray(a, dtype=np.int64) for a in (sizes, passes, keep))
    if len(sizes) and (int(sizes.max()) >= LARGEST or int(sizes.min()) < 1 or np.any(keep > sizes)):
        raise ValueError("sizes must be in 1 .. 2**32 / 20 and keep at most the size")
    draws = sizes - 1  # a permutation of n values takes n - 1 values of the generator
    generator = np.random.MT19937(0)
    raws = [_raw(generator, seed, int(p * d)) for seed, p, d in zip(seeds, passes.tolist(), draws.tolist(),
                                                                         strict=True)]
    stream = np.concatenate(raws) if raws else np.zeros(0, dtype=np.uint64)
    starts = np.cumsum(passes * draws) - passes * draws
    lane_of = np.repeat(np.arange(len(sizes)), passes)
    within = np.arange(len(lane_of)) - np.repeat(np.cumsum(passes) - passes, passes)  # each lane's pass
    n, k = sizes[lane_of], keep[lane_of]
    swaps = np.minimum(k, n - 1)  # the last value of a whole permutation needs no swap
    by_swaps = np.argsort(-swaps, kind="stable")  # the lanes still swapping at step i are the first ones
    swaps, n = swaps[by_swaps], n[by_swaps]
    first = (starts[lane_of] + within * draws[lane_of])[by_swaps]  # each lane's first value in the stream
    lanes, widest = len(lane_of), int(n.max(initial=1))
    # every swap's two places in `perm` flattened, step-major: step i's lanes are the first active[i] of row i
    lane = np.repeat(np.arange(lanes), swaps)
    step = np.arange(len(lane)) - np.repeat(np.cumsum(swaps) - swaps, swaps)
    z = (stream[first[lane] + step] % (n[lane] - step).astype(np.uint64)).astype(np.int64)
    other = np.zeros((int(swaps.max(initial=0)), lanes), dtype=np.int64)
    other[step, lane] = lane * widest + step + z
    active = np.bincount(step, minlength=len(other)).tolist()
    perm = np.tile(np.arange(widest, dtype=np.int64), lanes)
    here = np.arange(lanes) * widest
    for i, count in enumerate(active):
        a, b = here[:count] + i, other[i, :count]
        held = perm[a]
        perm[a] = perm[b]
        perm[b] = held
    out = np.empty((lanes, int(k.max(initial=0))), dtype=np.int64)
    out[by_swaps] = perm.reshape(lanes, widest)[:, :out.shape[1]]
    return out


def _raw(generator: np.random.MT19937, seed: int, count: int) -> np.ndarray:
    generator._legacy_seeding(seed & 0xFFFFFFFF)
    return generator.random_raw(count)


@functools.cache
def matches() -> bool:
    """This torch's randperm and this numpy's generator are the ones `shuffled_prefixes` copies (checked on a few
    seeds and sizes, a generator drawing twice)."""
    cases = [(0, 1), (7, 2), (12345, 57), (2**40 + 3, 229), (2**62 - 1, 1000)]
    try:
        for seed, n in cases:
            gen = torch.Generator().manual_seed(seed)
            want = np.stack([torch.randperm(n, generator=gen).numpy() for _ in range(2)])
            got = shuffled_prefixes([seed], np.array([n]), np.array([2]), np.array([n]))
            if not np.array_equal(got, want):
                return False
    except AttributeError:  # numpy without MT19937's legacy seeding
        return False
    return True

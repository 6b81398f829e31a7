"""What `keyed_rng(seed, purpose, round, node, f).choice(population, size, replace=False)` picks, for many f at once
(`keyed_choices`), and for every (node, f) of a round at once (`keyed_table`).

A plan draws one generator per fragment, and numpy's cost of building one (SeedSequence, PCG64, Generator) to
draw two numbers was, at K=16, most of a node's round. Here the same algorithms (SeedSequence's hash mixing,
PCG64's 128-bit LCG with XSL-RR output, Lemire's bounded integers, Floyd's sampling) run on plain integers, and the
mixing of the key's common prefix is shared by all fragments: several times cheaper per fragment, the same picks
(bench/high_k.py; bench/README.md, "Figures behind design choices"). `matches_numpy` checks that against numpy
once per process; were numpy ever to draw differently, the callers use numpy's own generators, so the picks never
depend on which path ran.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_M128 = (1 << 128) - 1
_POOL = 4  # SeedSequence's default pool size, in 32-bit words
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_FLOYD_UP_TO = 10000  # numpy samples larger populations by a partial shuffle when size > population // 50


def _words(n: int) -> list[int]:
    """An int as SeedSequence reads it: 32-bit words, least significant first ([0] for 0)."""
    out = [n & _M32]
    n >>= 32
    while n:
        out.append(n & _M32)
        n >>= 32
    return out


def _mix_entropy(words: list[int]) -> tuple[list[int], int]:
    """SeedSequence's pool after its first `_POOL` words and their cross-mixing (then the tail), and the hash
    constant at that point (hashmix and mix are written out inline: this is the hot path of a plan)."""
    pool, h = [], _INIT_A
    for i in range(_POOL):
        value = ((words[i] if i < len(words) else 0) ^ h) * (h := h * _MULT_A & _M32) & _M32
        pool.append(value ^ (value >> 16))
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                value = (pool[src] ^ h) * (h := h * _MULT_A & _M32) & _M32
                r = (_MIX_L * pool[dst] - _MIX_R * (value ^ (value >> 16))) & _M32
                pool[dst] = r ^ (r >> 16)
    return _mix_tail(pool, h, words[_POOL:])


def _mix_tail(pool: list[int], h: int, words: list[int]) -> tuple[list[int], int]:
    """The words past the pool's size, each hash-mixed into every pool word."""
    pool = list(pool)
    for word in words:
        for dst in range(_POOL):
            value = (word ^ h) * (h := h * _MULT_A & _M32) & _M32
            r = (_MIX_L * pool[dst] - _MIX_R * (value ^ (value >> 16))) & _M32
            pool[dst] = r ^ (r >> 16)
    return pool, h


def _hash_constants(init: int, mult: int, count: int) -> tuple[int, ...]:
    out = [init]
    for _ in range(count - 1):
        out.append(out[-1] * mult & _M32)
    return tuple(out)


_STATE_HASH = _hash_constants(_INIT_B, _MULT_B, 9)  # generate_state's hash constants: the same for every key


def _pcg64(pool: list[int]) -> tuple[int, int]:
    """(state, increment) of `PCG64(seed_sequence)`: generate_state(4, uint64), then PCG's seeding."""
    w = []
    for i in range(8):
        value = (pool[i & 3] ^ _STATE_HASH[i]) * _STATE_HASH[i + 1] & _M32
        w.append(value ^ (value >> 16))
    initstate = (w[1] << 96) | (w[0] << 64) | (w[3] << 32) | w[2]
    inc = (((w[5] << 96) | (w[4] << 64) | (w[7] << 32) | w[6]) << 1 | 1) & _M128
    return ((inc + initstate) * _PCG_MULT + inc) & _M128, inc


def _floyd(state: int, inc: int, population: int, size: int) -> frozenset[int]:
    """The set `Generator.choice(population, size, replace=False)` returns (it shuffles it after: order aside)."""
    chosen: set[int] = set()
    spare = -1  # PCG64 hands out a 64-bit output as two 32-bit draws, low half first
    for j in range(population - size, population):
        value = 0
        if j:
            bound, threshold = j + 1, -1
            while True:
                if spare >= 0:
                    draw, spare = spare, -1
                else:
                    state = (state * _PCG_MULT + inc) & _M128
                    x, rot = ((state >> 64) ^ state) & _M64, state >> 122
                    x = ((x >> rot) | (x << (64 - rot))) & _M64
                    draw, spare = x & _M32, x >> 32
                m = draw * bound  # Lemire: the high word, unless the low word falls in the biased sliver
                if (m & _M32) >= bound:
                    break
                if threshold < 0:
                    threshold = (_M32 - j) % bound
                if (m & _M32) >= threshold:
                    break
            value = m >> 32
        chosen.add(j if value in chosen else value)
    return frozenset(chosen)


def _numpy_choices(key: list[int], fragments: Iterable[int], population: int, size: int) -> list[frozenset[int]]:
    return [frozenset(int(i) for i in np.random.Generator(np.random.PCG64(np.random.SeedSequence(key + [f + 1])))
                      .choice(population, size=size, replace=False)) for f in fragments]


def _one_word_seeder(pool: list[int], h: int) -> Callable[[int], tuple[int, int]]:
    """`word -> _pcg64(_mix_tail(pool, h, [word])[0])`, unrolled: the hash constants and the pool's share of the
    mixing do not depend on the word, so a plan's K fragments compute them once. Unrolled on purpose: a loop over
    the four pool words gives the gain back (bench/README.md, "Figures behind design choices")."""
    a0, a1, a2, a3 = _hash_constants(h, _MULT_A, 4)
    b0, b1, b2, b3 = a1, a2, a3, a3 * _MULT_A & _M32
    c0, c1, c2, c3 = (_MIX_L * p for p in pool)
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = _STATE_HASH
    m, r_, m128, mult = _M32, _MIX_R, _M128, _PCG_MULT

    def seed(word: int) -> tuple[int, int]:
        v = (word ^ a0) * b0 & m
        r = (c0 - r_ * (v ^ (v >> 16))) & m
        p0 = r ^ (r >> 16)
        v = (word ^ a1) * b1 & m
        r = (c1 - r_ * (v ^ (v >> 16))) & m
        p1 = r ^ (r >> 16)
        v = (word ^ a2) * b2 & m
        r = (c2 - r_ * (v ^ (v >> 16))) & m
        p2 = r ^ (r >> 16)
        v = (word ^ a3) * b3 & m
        r = (c3 - r_ * (v ^ (v >> 16))) & m
        p3 = r ^ (r >> 16)
        w0 = (p0 ^ s0) * s1 & m
        w1 = (p1 ^ s1) * s2 & m
        w2 = (p2 ^ s2) * s3 & m
        w3 = (p3 ^ s3) * s4 & m
        w4 = (p0 ^ s4) * s5 & m
        w5 = (p1 ^ s5) * s6 & m
        w6 = (p2 ^ s6) * s7 & m
        w7 = (p3 ^ s7) * s8 & m
        initstate = ((w1 ^ (w1 >> 16)) << 96) | ((w0 ^ (w0 >> 16)) << 64) | ((w3 ^ (w3 >> 16)) << 32) \
            | (w2 ^ (w2 >> 16))
        inc = (((w5 ^ (w5 >> 16)) << 97) | ((w4 ^ (w4 >> 16)) << 65) | ((w7 ^ (w7 >> 16)) << 33)
               | ((w6 ^ (w6 >> 16)) << 1) | 1) & m128
        return ((inc + initstate) * mult + inc) & m128, inc

    return seed


def _choices(key: list[int], fragments: Iterable[int], population: int, size: int) -> list[frozenset[int]]:
    prefix = [w for part in key for w in _words(part)]
    if len(prefix) >= _POOL:  # the fragment's words only come in the tail: the prefix is mixed once
        shared = _mix_entropy(prefix)
        seed = _one_word_seeder(*shared)
        return [_floyd(*(seed(f + 1) if f + 1 <= _M32 else _pcg64(_mix_tail(*shared, _words(f + 1))[0])),
                       population, size) for f in fragments]
    return [_floyd(*_pcg64(_mix_entropy(prefix + _words(f + 1))[0]), population, size) for f in fragments]


def keyed_choices(key: list[int], fragments: Iterable[int], population: int, size: int) -> list[frozenset[int]]:
    """For each f in `fragments`, the indices `Generator(PCG64(SeedSequence(key + [f + 1]))).choice(population,
    size, replace=False)` picks. `key`: the non-negative key parts before the fragment's (see `rng.keyed_rng`)."""
    if not 0 <= size <= population:
        raise ValueError(f"cannot take {size} of {population} without replacement")
    if (population > _FLOYD_UP_TO and size > population // 50) or not matches_numpy():
        return _numpy_choices(key, fragments, population, size)
    return _choices(key, fragments, population, size)


@functools.cache
def matches_numpy() -> bool:
    """Whether this module picks what the installed numpy's generators pick, on keys that take every branch
    (short and long keys, rejected draws, j = 0, whole populations)."""
    cases = [([0, 2, 1, 1], 49, 2), ([7, 2, 3, 9], 1, 1), ([2**40 + 3, 2, 0], 5, 5), ([1, 2], 3, 2),
             ([123456789, 2, 1000, 4999], 9999, 40), ([5, 2, 77, 3], 3, 3)]
    return all(_choices(key, range(5), population, size) == _numpy_choices(key, range(5), population, size)
               for key, population, size in cases)


# The picks for every (node, fragment) of a round at once (`keyed_table`), in numpy: the same numbers, in arrays.
# A round of `InMemoryNetwork` needs n x K picks, which one by one above cost more at K=16 than a K=1 round. Here
# SeedSequence's mixing, PCG64's 128-bit LCG (two uint64 halves) with its XSL-RR output, Lemire's bounded integers
# and Floyd's sampling run on one lane per (node, fragment): a few hundred numpy calls per round whatever n and K.
# `matches_scalar` checks the lanes against the functions above once per process; were they ever to differ,
# `keyed_table` uses those.

_U = np.uint64
_MASK32 = _U(_M32)
_MULT_HI, _MULT_LO = _U(_PCG_MULT >> 64), _U(_PCG_MULT & ((1 << 64) - 1))


def _mul_lo_hi(a: np.ndarray, b: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """The low and high 64 bits of a * b (both 64-bit), from four 32 x 32-bit products."""
    a0, a1, b0, b1 = a & _MASK32, a >> _U(32), b & _MASK32, b >> _U(32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U(32)) + (p01 & _MASK32) + (p10 & _MASK32)
    return (p00 & _MASK32) | (mid << _U(32)), p11 + (p01 >> _U(32)) + (p10 >> _U(32)) + (mid >> _U(32))


def _step(hi: np.ndarray, lo: np.ndarray, inc_hi: np.ndarray, inc_lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """state * PCG_MULT + inc, mod 2^128, on (high, low) halves."""
    low, carry_hi = _mul_lo_hi(lo, _MULT_LO)
    high = carry_hi + hi * _MULT_LO + lo * _MULT_HI
    new_lo = low + inc_lo
    return high + inc_hi + (new_lo < low).astype(np.uint64), new_lo


def _output(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """PCG64's XSL-RR output of a state."""
    x, rot = hi ^ lo, hi >> _U(58)
    return (x >> rot) | (x << ((_U(64) - rot) & _U(63)))


def _seeded(pools: np.ndarray, h: int, words: np.ndarray) -> tuple[np.ndarray, ...]:
    """(state_hi, state_lo, inc_hi, inc_lo) of `PCG64(SeedSequence(prefix + [word]))` per lane: the pool after the
    prefix (pools[lane, 4]) and the hash constant after it (`h`), the word mixed into it, then PCG's seeding."""
    p = []
    for i in range(_POOL):
        p.append(_mixed_into(pools[:, i], words, h))
        h = h * _MULT_A & _M32
    w = []
    for i in range(8):
        v = ((p[i & 3] ^ _U(_STATE_HASH[i])) * _U(_STATE_HASH[i + 1])) & _MASK32
        w.append(v ^ (v >> _U(16)))
    init_hi, init_lo = (w[1] << _U(32)) | w[0], (w[3] << _U(32)) | w[2]
    inc_hi = (((w[5] << _U(32)) | w[4]) << _U(1)) | (w[7] >> _U(31))
    inc_lo = (((w[7] << _U(32)) | w[6]) << _U(1)) | _U(1)
    lo = inc_lo + init_lo
    hi = inc_hi + init_hi + (lo < inc_lo).astype(np.uint64)
    hi, lo = _step(hi, lo, inc_hi, inc_lo)
    return hi, lo, inc_hi, inc_lo


def _floyd_lanes(hi: np.ndarray, lo: np.ndarray, inc_hi: np.ndarray, inc_lo: np.ndarray, population: int,
           size: int) -> np.ndarray:
    """Per lane, the `size` indices `Generator.choice(population, size, replace=False)` picks (Floyd's order)."""
    lanes = len(hi)
    chosen = np.empty((lanes, size), dtype=np.int64)
    spare = np.zeros(lanes, dtype=np.uint64)
    has_spare = np.zeros(lanes, dtype=bool)
    for col, j in enumerate(range(population - size, population)):
        value = np.zeros(lanes, dtype=np.uint64)
        if j:
            bound = _U(j + 1)
            threshold = _U((_M32 - j) % (j + 1))
            todo = np.arange(lanes)
            while len(todo):
                fresh = todo[~has_spare[todo]]
                if len(fresh):
                    hi[fresh], lo[fresh] = _step(hi[fresh], lo[fresh], inc_hi[fresh], inc_lo[fresh])
                    out = _output(hi[fresh], lo[fresh])
                    draw_fresh = out & _MASK32
                    spare[fresh] = out >> _U(32)
                draw = spare[todo].copy()
                kept = has_spare[todo]
                if len(fresh):
                    draw[~kept] = draw_fresh
                has_spare[todo] = ~kept
                m = draw * bound
                low = m & _MASK32
                ok = (low >= bound) | (low >= threshold)
                value[todo[ok]] = m[ok] >> _U(32)
                todo = todo[~ok]
        picked = value.astype(np.int64)
        taken = (chosen[:, :col] == picked[:, None]).any(axis=1)
        chosen[:, col] = np.where(taken, j, picked)
    return chosen


def keyed_table(prefixes: Sequence[list[int]], k: int, population: int, size: int) -> np.ndarray:
    """picks[i, f] = the `size` indices `keyed_choice.keyed_choices(prefixes[i], [f], population, size)` picks, for
    every f < k, as an (len(prefixes), k, size) int64 array (each row in Floyd's order, not sorted)."""
    if not 0 <= size <= population:
        raise ValueError(f"cannot take {size} of {population} without replacement")
    if not (_fits(prefixes, k, population, size) and matches_numpy() and matches_scalar()):
        return np.array([[sorted(p) for p in keyed_choices(key, range(k), population, size)] for key in prefixes],
                        dtype=np.int64).reshape(len(prefixes), k, size)
    return _lanes(prefixes, k, population, size)


def _lanes(prefixes: Sequence[list[int]], k: int, population: int, size: int) -> np.ndarray:
    words = np.array([[w for part in key for w in _words(part)] for key in prefixes], dtype=np.uint64)
    pools, h = _mixed(words)
    seeded = _seeded(np.repeat(pools, k, axis=0), h, np.tile(np.arange(1, k + 1, dtype=np.uint64), len(prefixes)))
    return _floyd_lanes(*seeded, population, size).reshape(len(prefixes), k, size)


def keyed_raw(prefix: list[int], lanes: Sequence[int], word: int) -> np.ndarray:
    """raw[i] = the first 64-bit output (`random_raw()`) of `PCG64(SeedSequence(prefix + [lanes[i], word]))`, as
    uint64, for every lane at once: a round's per-node generators seeded in a few hundred numpy calls. numpy's own
    generators where the lanes do not apply (a short prefix, a lane or word past 32 bits) or do not match
    (`matches_raw`)."""
    lanes = np.asarray(lanes, dtype=np.int64).reshape(-1)
    prefix_words = [w for part in prefix for w in _words(part)]
    if (len(lanes) and len(prefix_words) >= _POOL - 1 and 0 <= word <= _M32 and 0 <= lanes.min()
            and lanes.max() <= _M32 and matches_raw()):
        return _raw_lanes(prefix_words, lanes, word)
    return np.array([np.random.PCG64(np.random.SeedSequence(list(prefix) + [int(lane), word])).random_raw()
                     for lane in lanes], dtype=np.uint64)


def _raw_lanes(prefix_words: list[int], lanes: np.ndarray, word: int) -> np.ndarray:
    words = np.empty((len(lanes), len(prefix_words) + 1), dtype=np.uint64)
    words[:, :-1] = np.array(prefix_words, dtype=np.uint64)
    words[:, -1] = lanes
    pools, h = _mixed(words)
    hi, lo, inc_hi, inc_lo = _seeded(pools, h, np.full(len(lanes), word, dtype=np.uint64))
    return _output(*_step(hi, lo, inc_hi, inc_lo))


@functools.cache
def matches_raw() -> bool:
    """Whether the lanes' first outputs are the installed numpy's (short and long keys, words 0 and past 16 bits)."""
    cases = [([0, 5, 1], [1, 1000], 0), ([2**40 + 3, 5, 0], [7, 2**31], 0), ([123456789, 2, 1000], [4999], 70000)]
    return all([int(x) for x in _raw_lanes([w for part in prefix for w in _words(part)], np.array(lanes), word)] ==
               [int(np.random.PCG64(np.random.SeedSequence(prefix + [lane, word])).random_raw()) for lane in lanes]
               for prefix, lanes, word in cases)


def _mixed(words: np.ndarray) -> tuple[np.ndarray, int]:
    """`keyed_choice._mix_entropy` of each row of `words` (rows of one length, at least the pool's): the pools, and
    the hash constant after them (it depends on the number of words only)."""
    h = _INIT_A
    pool = []
    for i in range(_POOL):
        v = ((words[:, i] ^ _U(h)) * _U(h := h * _MULT_A & _M32)) & _MASK32
        pool.append(v ^ (v >> _U(16)))
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mixed_into(pool[dst], pool[src], h)
                h = h * _MULT_A & _M32
    for i in range(_POOL, words.shape[1]):
        for dst in range(_POOL):
            pool[dst] = _mixed_into(pool[dst], words[:, i], h)
            h = h * _MULT_A & _M32
    return np.stack(pool, axis=1), h


def _mixed_into(target: np.ndarray, value: np.ndarray, h: int) -> np.ndarray:
    """SeedSequence's mix(target, hashmix(value)) with the hash constant `h` (hashmix's next one multiplies it)."""
    v = ((value ^ _U(h)) * _U(h * _MULT_A & _M32)) & _MASK32
    r = (target * _U(_MIX_L) - _U(_MIX_R) * (v ^ (v >> _U(16)))) & _MASK32
    return r ^ (r >> _U(16))


def _fits(prefixes: Sequence[list[int]], k: int, population: int, size: int) -> bool:
    """Whether the lanes compute these picks: the prefixes are as many words long, enough to fill the pool (the
    fragment's word is its tail), the fragment's word is one 32-bit word, and numpy would sample by Floyd's method
    (as `keyed_choices` decides) with 32-bit bounds."""
    lengths = {sum(len(_words(part)) for part in key) for key in prefixes}
    return (k < _M32 and population <= _M32 and not (population > _FLOYD_UP_TO and size > population // 50)
            and len(lengths) == 1 and min(lengths) >= _POOL)


@functools.cache
def matches_scalar() -> bool:
    """Whether the lanes pick what `keyed_choice` picks, on keys that take every branch (rejected draws, spare
    halves, j = 0, whole populations, long keys)."""
    cases = [([[0, 2, 1, 1], [0, 2, 1, 50]], 49, 2), ([[7, 2, 3, 9]], 1, 1), ([[2**40 + 3, 2, 0, 1]], 5, 5),
             ([[123456789, 2, 1000, 426], [123456789, 2, 1000, 499]], 9999, 40),  # fragments 8 and 7 reject a draw
             ([[5, 2, 77, 3]], 3, 3), ([[9, 2, 1, 2]], 9000, 1)]
    return all([frozenset(int(i) for i in row) for row in rows] == _choices(key, range(10), population, size)
               for prefixes, population, size in cases
               for key, rows in zip(prefixes, _lanes(prefixes, 10, population, size), strict=True))

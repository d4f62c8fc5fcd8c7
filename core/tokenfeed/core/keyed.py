"""Counter-based keys and keyed bijections: where every sample order gets its randomness.

One definition for every order the feeder computes (a dataset's block shuffle, a
mixture's step order, a source's passes), written so other languages can reproduce it
(docs/sampling.md, "Keys and the keyed bijection"):

* `mix(x)` is the splitmix64 finaliser on 64-bit words;
* `key(p_0, p_1, ...)` is the key chain h = mix(h ^ p) from h = 0x9E3779B97F4A7C15 over
  the parts (each taken modulo 2**64): a counter-based RNG, one stream per purpose,
  kept apart by the tags of `Tag`;
* the keyed bijection of [0, n) with key K is a Feistel network over the smallest
  number of bits b covering n (left half ceil(b/2) bits, right half floor(b/2); the
  widths swap every stage; 6 stages, what ciphers call rounds, restore them), stage r
  keyed by key(K, r), whose stage function is mix(half ^ stage key) masked to the
  other half's width; cycle walking (applying it again until the value lands below n)
  restricts it to [0, n). The domain is under 2n, so a point walks twice on average.

Everything here is vectorized over per-element keys, widths and sizes, so one call
evaluates many different bijections at once (a mixture maps items of many sources'
passes in one go); numpy's cost is per call, not per element, at these sizes.
`permute` runs in C (_keyed.c) when built; `permute_py` is its reference (native.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum, unique
from typing import Any

import numpy as np

from tokenfeed.core import native

MASK64 = (1 << 64) - 1
STAGES = 6
_H0 = 0x9E3779B97F4A7C15
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
_STAGE_IDS = np.arange(STAGES, dtype=np.uint64)
_ONE = np.uint64(1)


@unique
class Tag(IntEnum):
    """The key-domain tags: the part of a key chain that names its purpose, so no two
    purposes ever draw the same key. The values are part of every stream: never
    change one (docs/sampling.md, docs/mixtures.md)."""

    BLOCKS = 1  # a dataset epoch's block order: key(seed, epoch, BLOCKS)
    GROUP = 2  # a shuffle group's window order: key(seed, epoch, GROUP, group)
    SHIFT = 3  # `auto` shift of a global step: key(seed, epoch, SHIFT, offset)
    STEP = 16  # a mixture step's slot order: key(seed, STEP, offset)
    SOURCE = 17  # a mixture source's seed: key(seed, SOURCE, len(name), name's words...)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic); a new array.

    In place on two temporaries: cheaper than a new array per operation, which matters
    at the few hundred values a round maps."""
    y = x >> _S30
    y ^= x
    y *= _M1
    t = y >> _S27
    y ^= t
    y *= _M2
    np.right_shift(y, _S31, out=t)
    y ^= t
    return y


def mix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (scalars: faster than numpy here)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def key(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, tag, index...): the key chain."""
    h = _H0
    for p in parts:
        h = mix_int(h ^ (p & MASK64))
    return h


def keys(*parts: int | np.ndarray) -> np.ndarray:
    """`key` over arrays (broadcast): uint64 keys, one per element. The leading scalar
    parts are chained in Python, the rest on arrays."""
    first = next((i for i, p in enumerate(parts) if isinstance(p, np.ndarray)), len(parts))
    h0 = key(*(int(p) for p in parts[:first]))
    if first == len(parts):
        return np.array(h0, dtype=np.uint64)
    h: np.ndarray = np.uint64(h0) ^ np.asarray(parts[first]).astype(np.uint64)
    h = mix(h)
    for p in parts[first + 1 :]:
        if isinstance(p, np.ndarray):
            h = mix(h ^ p.astype(np.uint64))
        else:
            h = mix(h ^ np.uint64(int(p) & MASK64))
    return h


def stage_keys(k: int | np.ndarray) -> np.ndarray:
    """The stage keys key(K, r), r = 0..5, of the bijections keyed by `k`:
    shape k.shape + (6,) (an int key gives shape (6,)). For a 1-d `k` the array is
    column-major (`stage_keys_by_stage(k).T`), so each stage's keys are contiguous."""
    if not isinstance(k, np.ndarray):
        return np.array([key(int(k), r) for r in range(STAGES)], dtype=np.uint64)
    if k.ndim == 1:
        return stage_keys_by_stage(k).T
    base = mix(np.uint64(_H0) ^ k.astype(np.uint64))
    return mix(base[..., None] ^ _STAGE_IDS)


def stage_keys_by_stage(k: np.ndarray) -> np.ndarray:
    """The stage keys of 1-d keys `k`, stage-major: [6, len(k)], row r = key(k, r).
    Gather columns of it (`table[:, rows].T`) to hand `permute` per-element keys whose
    stages are contiguous: the Feistel reads one stage's keys at a time."""
    base = mix(np.uint64(_H0) ^ k.astype(np.uint64))
    return mix(base[None, :] ^ _STAGE_IDS[:, None])


def domain_bits(n: int | np.ndarray) -> Any:
    """The bits b of a bijection of [0, n): the smallest b with 2**b >= n, at least 1."""
    if isinstance(n, np.ndarray):
        m = np.maximum(n.astype(np.int64) - 1, 1)
        # bit_length via float log2 is exact for the sizes here (n <= 2**62): 2**k - 1
        # and 2**k are never confused because we take frexp of an integer-valued float.
        _, e = np.frexp(m.astype(np.float64))
        # frexp rounds m to a double; correct the rare case where that rounding crossed
        # a power of two (m >= 2**53)
        e = e.astype(np.int64)
        big = m >= (1 << 53)
        if big.any():
            e[big] = [int(x).bit_length() for x in m[big].tolist()]
        return e
    return max(1, (int(n) - 1).bit_length())


def _mask(width: Any) -> Any:
    if isinstance(width, np.ndarray):
        return np.left_shift(_ONE, width) - _ONE
    return np.uint64((1 << int(width)) - 1)


def _widths(bits: Any) -> tuple[Any, Any]:
    if isinstance(bits, np.ndarray):
        b = bits.astype(np.uint64)
        wr = b >> _ONE
        return b - wr, wr
    n = int(bits)
    return np.uint64(n - n // 2), np.uint64(n // 2)


def encrypt(x: np.ndarray, sk: np.ndarray, bits: Any) -> np.ndarray:
    """One pass of the Feistel network over [0, 2**bits) (no walking).

    x: uint64 [m]; sk: stage keys [6] (one bijection) or [m, 6] (one per element);
    bits: an int or an int array [m]."""
    wl, wr = _widths(bits)
    ml, mr = _mask(wl), _mask(wr)
    left, right = x >> wr, x & mr
    for r in range(STAGES):
        f = mix(right ^ sk[..., r])
        f &= ml
        f ^= left
        left, right = right, f
        wl, wr, ml, mr = wr, wl, mr, ml
    return (left << wr) | right


def decrypt(x: np.ndarray, sk: np.ndarray, bits: Any) -> np.ndarray:
    """The inverse of `encrypt` (same arguments)."""
    wl, wr = _widths(bits)  # an even number of stages: the widths at the end too
    ml, mr = _mask(wl), _mask(wr)
    left, right = x >> wr, x & mr
    for r in reversed(range(STAGES)):
        f = mix(left ^ sk[..., r])
        f &= mr
        f ^= right
        left, right = f, left
        wl, wr, ml, mr = wr, wl, mr, ml
    return (left << wr) | right


def permute(
    x: np.ndarray, n: Any, sk: np.ndarray, bits: Any = None, inverse: bool = False
) -> np.ndarray:
    """The keyed bijections of [0, n) at x (cycle walking): int64 [m].

    x: int array [m], each below its n; n: an int or an int array [m]; sk: stage keys
    [6] or [m, 6]; bits: domain_bits(n) if not given. Elements whose n is 1 map to 0.
    """
    if bits is None:
        bits = domain_bits(n)
    if _permute_c is None or not native.enabled():
        return permute_py(x, n, sk, bits, inverse)
    xs = np.ascontiguousarray(x, dtype=np.int64).reshape(-1)
    out = np.empty_like(xs)
    _permute_c(xs, _ints(n), sk.astype(np.uint64, copy=False), _ints(bits), inverse, out)
    return out.reshape(np.shape(x))


def _ints(v: Any) -> Any:
    """An int, or a contiguous int64 array: what _keyed.permute takes for n and bits."""
    if isinstance(v, np.ndarray) and v.ndim:
        return np.ascontiguousarray(v, dtype=np.int64).reshape(-1)
    return int(v)


def permute_py(
    x: np.ndarray, n: Any, sk: np.ndarray, bits: Any = None, inverse: bool = False
) -> np.ndarray:
    """`permute`'s reference, in numpy (element by element in C: _keyed.c)."""
    if bits is None:
        bits = domain_bits(n)
    if isinstance(bits, np.ndarray) and bits.size and int(bits.min()) == int(bits.max()):
        bits = int(bits.flat[0])  # one width for all: scalar shifts and masks are cheaper
    step = decrypt if inverse else encrypt
    out = step(np.asarray(x).astype(np.uint64), sk, bits)
    n_u = np.asarray(n).astype(np.uint64)
    outside = out >= n_u
    if not outside.any():
        return out.astype(np.int64)
    per_sk, per_n, per_bits = sk.ndim > 1, n_u.ndim > 0, isinstance(bits, np.ndarray)
    idx = np.flatnonzero(outside)
    while len(idx):
        sub = step(
            out[idx],
            sk[idx] if per_sk else sk,
            bits[idx] if per_bits else bits,
        )
        out[idx] = sub
        keep = sub >= (n_u[idx] if per_n else n_u)
        idx = idx[keep]
    return out.astype(np.int64)


_permute_c: Callable[..., None] | None
try:
    from tokenfeed.core._keyed import permute as _permute_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _permute_c = None


class Permutation:
    """The keyed bijection of range(n) with key `key`, evaluated pointwise."""

    def __init__(self, n: int, key_: int) -> None:
        self.n = n
        self._bits = domain_bits(n)
        self._sk = stage_keys(key_)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.n <= 1:
            return np.zeros(np.shape(x), dtype=np.int64)
        return permute(x, self.n, self._sk, self._bits)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        if self.n <= 1:
            return np.zeros(np.shape(y), dtype=np.int64)
        return permute(y, self.n, self._sk, self._bits, inverse=True)

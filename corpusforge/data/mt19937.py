"""numpy's legacy `RandomState.shuffle`, compiled: the same permutation, and the generator left in the same state.

Megatron-Core shuffles its document and shuffle indices with `numpy.random.RandomState(seed).shuffle`, so to give
the same samples we must draw the same permutation. numpy's own call costs ~20 ns per element (a function-pointer
call per 32-bit draw and three variable-size memcpy per swap) and holds the GIL; the document index of a 1e9-token
corpus is two shuffles of ~1M entries. Here the same algorithm runs in numba at ~8 ns per element, without the GIL:

- MT19937 (Matsumoto & Nishimura 1998) exactly as numpy/random/src/mt19937/mt19937.{h,c}: a block of 624 words is
  regenerated when used up, each word tempered on output;
- Fisher-Yates from the end (numpy mtrand.pyx `_shuffle_raw`): for i = n-1 .. 1, j = random_interval(i), swap
  x[i], x[j]; random_interval (numpy/random/src/distributions/distributions.c) draws 32-bit words masked to the
  smallest all-ones mask >= i until one is <= i.

The draws (branch-free: a rejected draw just does not move i) are taken in one pass and the swaps in a second, so
neither waits on the other's mispredicted branches. The generator's key and position are read from the
RandomState and written back after, so numpy calls on it later continue the same stream.

Example:
    >>> a, b = np.arange(10), np.arange(10)
    >>> np.random.RandomState(7).shuffle(a); shuffle(np.random.RandomState(7), b)
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import threading

import numpy as np

from corpusforge.jit import njit, ready, started

# MT19937 constants (mt19937.c): state words, the shift of the recurrence, the twist matrix, the tempering masks.
_N, _M = 624, 397
_MATRIX_A, _UPPER, _LOWER = 0x9908B0DF, 0x80000000, 0x7FFFFFFF
_TEMPER_B, _TEMPER_C = 0x9D2C5680, 0xEFC60000

# random_interval switches to 64-bit draws above this bound; those are left to numpy (4e9 entries: 8.8e12 tokens
# at seq_length 2048 for a shuffle index), which is then the reference by definition.
_MAX_32BIT_BOUND = 0xFFFFFFFF

# Arrays up to this length are shuffled by numpy itself: reading and writing the generator's state costs ~100 us,
# numpy ~10-20 ns per element (a blend of thousands of small datasets shuffles thousands of small arrays).
_NUMPY_BELOW = 1 << 13

# Longer arrays too, as long as numba has not started in this process (see corpusforge/jit.py: loading the first
# kernel costs ~1 s, what numpy takes for ~5e7 entries) and the array is shorter than this (numpy: ~0.3 s).
_COMPILED_FROM = 1 << 24

# Draws taken before their swaps are done: 64 KiB of uint32.
_CHUNK = 1 << 14


_THREAD = threading.local()  # seeded()'s generator, one per thread


def seeded(seed: int) -> np.random.RandomState:
    """A RandomState in the state of `np.random.RandomState(seed)`, valid until this thread calls seeded() again.

    Making a RandomState first seeds a new MT19937 from OS entropy (~120 us here) before the seed replaces that
    state; re-seeding this thread's one costs ~2 us. Megatron-Core makes one per dataset and split: for a blend of
    thousands of small datasets that was a third of each one's index build.

    Example:
        >>> a = seeded(1234).randint(0, 100, 3); b = np.random.RandomState(1234).randint(0, 100, 3)
        >>> bool((a == b).all())
        True
    """
    rng = getattr(_THREAD, "rng", None)
    if rng is None:
        rng = _THREAD.rng = np.random.RandomState(seed)
    else:
        rng.seed(seed)  # the legacy seeding RandomState(seed) does: the same key, position and no cached gaussian
    return rng


def shuffle(rng: np.random.RandomState, array: np.ndarray) -> None:
    """Shuffle a 1-D array in place exactly as `rng.shuffle(array)` would, and advance `rng` as it would.

    Any array numpy shuffles by its fast path gives the same result; others (another bit generator, an n-d or
    non-contiguous array, more than 2^32 entries) are handed to `rng.shuffle` itself.

    Example:
        >>> rng = np.random.RandomState(1234); x = np.arange(5, dtype=np.int32); shuffle(rng, x); x.tolist()
        [4, 0, 1, 2, 3]
    """
    if len(array) <= _NUMPY_BELOW or (len(array) < _COMPILED_FROM and not (ready(_shuffle) or started())):
        rng.shuffle(array)
        return
    state = rng.get_state(legacy=False)
    plain = isinstance(array, np.ndarray) and array.ndim == 1 and array.flags.c_contiguous and array.flags.writeable
    if state["bit_generator"] != "MT19937" or not plain or len(array) - 1 > _MAX_32BIT_BOUND or array.dtype.hasobject:
        rng.shuffle(array)
        return
    if len(array) < 2:  # numpy draws nothing for these
        return
    key = np.array(state["state"]["key"], dtype=np.uint32)  # a copy: numpy's state is only changed by set_state
    state["state"]["pos"] = _shuffle(array, key, int(state["state"]["pos"]))
    state["state"]["key"] = key
    rng.set_state(state)


@njit(nogil=True)
def _shuffle(x, key, pos):
    """Fisher-Yates over x with the MT19937 stream at (key, pos); returns the new pos (key is updated in place)."""
    words = np.empty(_N, np.uint32)  # the tempered outputs of the current block of key
    _temper(key, words)
    # swap_with[i - lo] = j for i = hi .. lo+1, a chunk at a time: a small buffer that stays in cache and costs no
    # fresh pages (a first touch of a page costs ~3 us in a VM: an n-sized buffer was a third of the time).
    swap_with = np.empty(_CHUNK, np.uint32)
    hi = len(x) - 1
    while hi > 0:
        lo = max(0, hi - _CHUNK)
        i = hi
        while i > lo:
            mask = np.int64(_mask(i))
            stop = max(lo, mask >> 1)  # the mask holds while i > mask // 2
            if pos == _N:
                _regenerate(key)
                _temper(key, words)
                pos = 0
            # Draws until the block ends, the mask shrinks or the chunk is done; a rejected draw (j > i) is written
            # and then overwritten, so the loop has no branch on the random value. All in int64: mixing uint32 and
            # int64 made numba convert through float and ran 5x slower.
            while pos < _N and i > stop:
                j = np.int64(words[pos]) & mask
                pos += 1
                swap_with[i - lo - 1] = j
                i -= np.int64(j <= i)
        for i in range(hi, lo, -1):
            j = np.int64(swap_with[i - lo - 1])
            x[i], x[j] = x[j], x[i]
        hi = lo
    return pos


@njit(nogil=True, inline="always")
def _mask(i):
    """The smallest all-ones mask >= i (< 2^32)."""
    m = np.uint32(i)
    m |= m >> np.uint32(1)
    m |= m >> np.uint32(2)
    m |= m >> np.uint32(4)
    m |= m >> np.uint32(8)
    m |= m >> np.uint32(16)
    return m


@njit(nogil=True)
def _regenerate(key):
    """The next 624 words of the MT19937 recurrence, in place (mt19937_gen)."""
    upper, lower, matrix_a, one, zero = np.uint32(_UPPER), np.uint32(_LOWER), np.uint32(_MATRIX_A), np.uint32(1), 0
    for i in range(_N - _M):
        y = (key[i] & upper) | (key[i + 1] & lower)
        key[i] = key[i + _M] ^ (y >> one) ^ ((np.uint32(zero) - (y & one)) & matrix_a)
    for i in range(_N - _M, _N - 1):
        y = (key[i] & upper) | (key[i + 1] & lower)
        key[i] = key[i + _M - _N] ^ (y >> one) ^ ((np.uint32(zero) - (y & one)) & matrix_a)
    y = (key[_N - 1] & upper) | (key[0] & lower)
    key[_N - 1] = key[_M - 1] ^ (y >> one) ^ ((np.uint32(zero) - (y & one)) & matrix_a)


@njit(nogil=True)
def _temper(key, out):
    """out[i] = the tempered output of state word i (mt19937_next)."""
    for i in range(_N):
        y = key[i]
        y ^= y >> np.uint32(11)
        y ^= (y << np.uint32(7)) & np.uint32(_TEMPER_B)
        y ^= (y << np.uint32(15)) & np.uint32(_TEMPER_C)
        y ^= y >> np.uint32(18)
        out[i] = y

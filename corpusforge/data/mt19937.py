"""numpy's legacy `RandomState.shuffle`, compiled: the same permutation, and the generator left in the same state.

Megatron-Core shuffles its document and shuffle indices with `numpy.random.RandomState(seed).shuffle`, so to give
the same samples we must draw the same permutation. numpy's own call costs ~20 ns per element (a function-pointer
call per 32-bit draw and three variable-size memcpy per swap) and holds the GIL; the document index of a 1e9-token
corpus is two shuffles of ~1M entries, and a one-dataset build at 1e8 tokens spends ~2 ms of its ~10 in them. Here
the same algorithm runs in plain C (corpusforge/_mt19937.c, built by pip install) at ~3 ns per element, without the
GIL and without numba (whose start-up, ~1 s in a fresh process, an index build must not wait for):

- MT19937 (Matsumoto & Nishimura 1998) exactly as numpy/random/src/mt19937/mt19937.{h,c}: a block of 624 words is
  regenerated when used up, each word tempered on output;
- Fisher-Yates from the end (numpy mtrand.pyx `_shuffle_raw`): for i = n-1 .. 1, j = random_interval(i), swap
  x[i], x[j]; random_interval (numpy/random/src/distributions/distributions.c) draws 32-bit words masked to the
  smallest all-ones mask >= i until one is <= i.

The generator's key and position are read from the RandomState and written back after, so numpy calls on it later
continue the same stream. Without the compiled module (a source tree not built), numpy shuffles: the same result.

Example:
    >>> a, b = np.arange(10), np.arange(10)
    >>> np.random.RandomState(7).shuffle(a); shuffle(np.random.RandomState(7), b)
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import threading

import numpy as np

try:
    from corpusforge import _mt19937
except ImportError:  # not built (a source checkout without pip install): numpy's own shuffle, the same permutation
    _mt19937 = None

# random_interval switches to 64-bit draws above this bound; those are left to numpy (4e9 entries: 8.8e12 tokens
# at seq_length 2048 for a shuffle index), which is then the reference by definition.
_MAX_32BIT_BOUND = 0xFFFFFFFF

# Arrays up to this length are shuffled by numpy itself: reading and writing the generator's state costs ~100 us,
# numpy ~10-20 ns per element (a blend of thousands of small datasets shuffles thousands of small arrays).
_NUMPY_BELOW = 1 << 13


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
    if len(array) <= _NUMPY_BELOW or _mt19937 is None:
        rng.shuffle(array)
        return
    state = rng.get_state(legacy=False)
    plain = isinstance(array, np.ndarray) and array.ndim == 1 and array.flags.c_contiguous and array.flags.writeable
    if state["bit_generator"] != "MT19937" or not plain or len(array) - 1 > _MAX_32BIT_BOUND or array.dtype.hasobject:
        rng.shuffle(array)
        return
    key = np.array(state["state"]["key"], dtype=np.uint32)  # a copy: numpy's state is only changed by set_state
    state["state"]["pos"] = _mt19937.shuffle(array, array.itemsize, key, int(state["state"]["pos"]))
    state["state"]["key"] = key
    rng.set_state(state)


def available() -> bool:
    """Whether the compiled shuffle is built (pip install builds it)."""
    return _mt19937 is not None

"""The compiled shuffle (corpusforge/_mt19937.c) against numpy's own RandomState.shuffle: the same permutation, the
same stream after it."""

from __future__ import annotations

import numpy as np
import pytest

from corpusforge.data import mt19937
from corpusforge.data.mt19937 import shuffle

# Sizes around the edges of the algorithm: nothing to draw (0, 1), the mask shrinking at powers of two, a
# generator block (624 words) used up mid-shuffle, and numpy's threshold for the compiled path.
SIZES = [0, 1, 2, 3, 4, 5, 8, 9, 623, 624, 625, 1000, 1 << 13, (1 << 13) + 1, (1 << 14) + 2, 3 * (1 << 14) + 7, 100_003]


def test_the_compiled_shuffle_is_built():
    """pip install builds it: without it every shuffle is numpy's (the same samples, ~4x slower)."""
    assert mt19937.available()


@pytest.fixture(autouse=True, params=["compiled", "as_shipped"])
def _path(request, monkeypatch):
    """Every test on the compiled shuffle for every size, and as shipped (numpy itself for small arrays)."""
    if request.param == "compiled":
        monkeypatch.setattr(mt19937, "_NUMPY_BELOW", 1)


@pytest.mark.parametrize("seed", [0, 1234, 2**32 - 1])
def test_same_permutation_and_stream_as_numpy(seed):
    for n in SIZES:
        for dtype in (np.int32, np.uint32, np.int64, np.float32, np.int8, np.uint16, np.complex128, "S3"):
            ours_rng, numpy_rng = np.random.RandomState(seed), np.random.RandomState(seed)
            skip = (seed + n) % 1000  # start mid-block, as the second shuffle of an index does
            ours_rng.randint(0, 7, size=skip)
            numpy_rng.randint(0, 7, size=skip)
            ours, expected = np.arange(n).astype(dtype), np.arange(n).astype(dtype)
            shuffle(ours_rng, ours)
            numpy_rng.shuffle(expected)
            np.testing.assert_array_equal(ours, expected, err_msg=f"n={n} seed={seed} {np.dtype(dtype)}")
            # and the generator goes on where numpy's does
            assert ours_rng.randint(0, 2**31, size=3).tolist() == numpy_rng.randint(0, 2**31, size=3).tolist()


def test_views_are_shuffled_in_place_like_numpy():
    """The index builders shuffle slices of one array: the same as numpy shuffling the same slices."""
    ours, expected = np.arange(50_000, dtype=np.int32), np.arange(50_000, dtype=np.int32)
    ours_rng, numpy_rng = np.random.RandomState(5), np.random.RandomState(5)
    for lo, hi in ((0, 30_000), (30_000, 50_000)):
        shuffle(ours_rng, ours[lo:hi])
        numpy_rng.shuffle(expected[lo:hi])
    np.testing.assert_array_equal(ours, expected)
    assert sorted(ours[:30_000].tolist()) == list(range(30_000))


def test_arrays_numpy_handles_otherwise_are_left_to_numpy():
    """A strided view, a 2-d array and another bit generator go through rng.shuffle itself: still identical."""
    for make in (
        lambda: np.arange(1000)[::3],
        lambda: np.arange(600).reshape(200, 3),
    ):
        ours, expected = make(), make()
        shuffle(np.random.RandomState(9), ours)
        np.random.RandomState(9).shuffle(expected)
        np.testing.assert_array_equal(ours, expected)
    pcg = np.random.RandomState(np.random.PCG64(3))
    ours, expected = np.arange(100), np.arange(100)
    shuffle(pcg, ours)
    np.random.RandomState(np.random.PCG64(3)).shuffle(expected)
    np.testing.assert_array_equal(ours, expected)


def test_seeded_is_a_fresh_random_state_of_that_seed():
    """seeded(seed) re-seeds one generator per thread: after any use, the same stream as RandomState(seed), the
    gaussian cache included; another thread gets its own generator."""
    import threading

    from corpusforge.data.mt19937 import seeded

    for seed in (1234, 0, 2**32 - 1):
        rng = seeded(7)
        rng.standard_normal()  # leaves a cached gaussian behind
        shuffle(rng, np.arange(50_000))
        ours, theirs = seeded(seed), np.random.RandomState(seed)
        assert ours.standard_normal() == theirs.standard_normal()
        np.testing.assert_array_equal(ours.randint(0, 1 << 30, 1000), theirs.randint(0, 1 << 30, 1000))
    other = []
    worker = threading.Thread(target=lambda: other.append(seeded(1)))
    worker.start()
    worker.join()
    assert other[0] is not seeded(1)

"""gigatoken's batch results as (flat ids, lengths) without importing awkward.

gigatoken's `encode_batch` assembles its result in Rust as one flat uint32 buffer plus a length per document,
then imports `awkward` only to wrap the two: `awkward.unflatten(flat, lengths)` (and `awkward.Array`, for an
isinstance check on the input). Importing awkward (with the pyarrow, fsspec and cloudpickle it pulls in) takes
0.15-0.25 s: on the critical path of every preprocess run, a sixth of the run for 200 MB on two cores, to build
an object whose buffers we take straight back out.

`flat_rows(call)` runs one gigatoken call with a stand-in module under the name `awkward` that hands the buffers
back as they are. It is used only where that is safe and useful:

- awkward is not imported yet in this process (once it is, there is nothing left to save, and the real module
  is never hidden from code that already uses it);
- on the calling thread, with gigatoken's own threads off (corpusforge's worker processes): the stand-in is
  visible to the whole process for the length of the call, and no other thread of corpusforge imports awkward.

gigatoken imports the module afresh on each call (checked in tests/test_tokenizers.py), so the stand-in is gone
after it. If a gigatoken release ever asks the stand-in for anything else, the call is made again with the real
awkward and the stand-in is not used again in this process: slower, never wrong.

Example:
    >>> flat, lengths = flat_rows(lambda: tok.encode_batch(["a b", "c"], parallel=False))  # doctest: +SKIP
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable

import numpy as np

__all__ = ["flat_rows", "usable"]


class _Unsupported(AttributeError):
    """gigatoken wanted more of awkward than the stand-in offers."""


class _StandIn(types.ModuleType):
    """The part of awkward's namespace gigatoken's result assembly touches; anything else is refused."""

    class Array:  # nothing is an instance: inputs here are lists of str, never awkward arrays
        def __new__(cls, *args, **kwargs):
            raise _Unsupported("corpusforge's awkward stand-in cannot build an awkward.Array")

    @staticmethod
    def unflatten(flat: np.ndarray, lengths: np.ndarray) -> _Rows:
        return _Rows(flat, lengths)

    def __getattr__(self, name: str):
        raise _Unsupported(f"corpusforge's awkward stand-in has no {name!r} (a newer gigatoken?)")


class _Rows(tuple):
    """(flat, lengths), marked as coming from the stand-in."""

    def __new__(cls, flat: np.ndarray, lengths: np.ndarray) -> _Rows:
        return super().__new__(cls, (flat, lengths))


_STAND_IN = _StandIn("awkward", "corpusforge's stand-in for awkward during one gigatoken call")
_lock = threading.Lock()
_broken = False  # set once a gigatoken call needed more than the stand-in offers


def usable() -> bool:
    """Whether a call can go through the stand-in now (awkward not imported, the stand-in never failed)."""
    return not _broken and "awkward" not in sys.modules


def flat_rows(call: Callable[[], object]) -> tuple[np.ndarray, np.ndarray] | None:
    """Run `call` (a gigatoken encode_batch) with the stand-in; its (flat, lengths), or None to redo it for real.

    None when the stand-in cannot be used now or did not satisfy gigatoken: the caller then calls gigatoken
    again with awkward imported.
    """
    global _broken
    with _lock:
        if not usable():
            return None
        sys.modules["awkward"] = _STAND_IN
        try:
            result = call()
        except _Unsupported:
            _broken = True
            return None
        finally:
            if sys.modules.get("awkward") is _STAND_IN:
                del sys.modules["awkward"]
    if not isinstance(result, _Rows):
        _broken = True
        return None
    flat, lengths = result
    return np.asarray(flat), np.asarray(lengths, dtype=np.int64)

"""`numba.njit` with an on-disk cache where one can be written, and without one where it cannot.

numba's `cache=True` raises when the module is imported ("cannot cache function ...: no locator available") if
neither the package's __pycache__ nor a user cache directory is writable, as for another user of a read-only
install. Importing corpusforge must not fail then: the functions compile in memory instead (a slower first call,
the same results).

Example:
    >>> @njit(nogil=True)
    ... def add(a, b):
    ...     return a + b
"""

from __future__ import annotations

from collections.abc import Callable

import numba


def njit(**options) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # no writable cache location
            return numba.njit(cache=False, **options)(fn)

    return decorate

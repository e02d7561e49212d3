"""`numba.njit` with an on-disk cache where one can be written, and without one where it cannot.

numba's `cache=True` raises when the module is imported ("cannot cache function ...: no locator available") if
neither the package's __pycache__ nor a user cache directory is writable, as for another user of a read-only
install. Importing corpusforge must not fail then: the functions compile in memory instead (a slower first call,
the same results).

`ready(kernel)` says whether this process already holds a kernel's machine code, `started()` whether it holds any.
The first kernel a process calls costs ~0.7-1.5 s here (numba initialises LLVM and loads its cache), each further
one ~5-10 ms: code that numpy runs in a few milliseconds at the sizes users usually have (the index build of one
dataset) calls a kernel only where the work repays that, or once numba has started (a process that has read
samples).

Example:
    >>> @njit(nogil=True)
    ... def add(a, b):
    ...     return a + b
    >>> ready(add)
    False
"""

from __future__ import annotations

from collections.abc import Callable

import numba


def njit(**options) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        try:
            kernel = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # no writable cache location
            kernel = numba.njit(cache=False, **options)(fn)
        _KERNELS.append(kernel)
        return kernel

    return decorate


_KERNELS: list[Callable] = []


def ready(kernel: Callable) -> bool:
    """Whether `kernel` (an njit function) has been compiled or loaded from numba's cache in this process.

    Example:
        >>> ready(add)
        False
    """
    return bool(kernel.overloads)  # .signatures would build a list: this is asked per dataset of a blend


def started() -> bool:
    """Whether any corpusforge kernel is loaded in this process: numba's start-up is paid, and loading one more
    kernel costs ~5-10 ms, not ~1 s.

    Example:
        >>> started()
        False
    """
    global _STARTED
    if not _STARTED:  # once started, always: no scan of the kernels per call then
        _STARTED = any(kernel.overloads for kernel in _KERNELS)
    return _STARTED


_STARTED = False

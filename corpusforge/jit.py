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

`load_in_background(load)` runs `load` (calls that load kernels) on one thread of the process, so that a job's first
batches come from numpy while numba starts beside them, and no batch waits for it. While such a load is in flight,
`ready` and `started` say False to every other thread: their callers keep to numpy until every kernel of the load is
there (a kernel called meanwhile would wait on numba's compiler lock, or start a compile of its own). `compiling()`
marks calls whose kernels must be loaded now (a loader's `load_kernels`, the background load itself): there `started`
says True. `finish_loading()` waits for the load; it is also done before every os.fork(), so that no child inherits
numba's compiler lock or an import lock held by a thread it does not have.

That thread only loads kernels from numba's on-disk cache; it never compiles. numba's compiler enters
`warnings.catch_warnings` thousands of times, and Python's warnings state is one per process: a compile beside the
main thread lost the main thread's warnings (a `pytest.warns` block saw none) and could leave a block's filters in place
for good. A compile the thread would start (a cold cache: a first run after an install or a change) ends the background
load; the reads then call their kernels, which compile where they are, as before there was a background load
(`must_compile`).

Example:
    >>> @njit(nogil=True)
    ... def add(a, b):
    ...     return a + b
    >>> ready(add)
    False
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import numba
import numba.core.event


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
    if _LOADER is not None and not compiling_here():  # a load is in flight on another thread: not yet
        return False
    return bool(kernel.overloads)  # .signatures would build a list: this is asked per dataset of a blend


def started() -> bool:
    """Whether any corpusforge kernel is loaded in this process: numba's start-up is paid, and loading one more
    kernel costs ~5-10 ms, not ~1 s.

    Example:
        >>> started()
        False
    """
    global _STARTED
    if compiling_here():
        return True
    if _LOADER is not None:  # a load is in flight on another thread: keep to numpy until it is done
        return False
    if not _STARTED:  # once started, always: no scan of the kernels per call then
        _STARTED = any(kernel.overloads for kernel in _KERNELS)
    return _STARTED


_STARTED = False


# The background load: its thread (None when no load is in flight), what it has still to run, what failed in it.
_LOADER: threading.Thread | None = None
_QUEUE: list[Callable[[], None]] = []
_ERRORS: list[BaseException] = []
_LOCK = threading.Lock()
_HERE = threading.local()  # .compiling: this thread calls the compiled kernels (compiling(), the loader thread)


def compiling_here() -> bool:
    """Whether this thread is under `compiling()` (or is the loading thread): its calls load kernels.

    Example:
        >>> compiling_here()
        False
    """
    return getattr(_HERE, "compiling", False)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """In this block `started()` says True on this thread: calls that choose between a kernel and its numpy twin
    take the kernel, and so load it (what a `load_kernels` is for).

    Example:
        >>> with compiling():
        ...     started()
        True
    """
    before = compiling_here()
    _HERE.compiling = True
    try:
        yield
    finally:
        _HERE.compiling = before


def load_in_background(load: Callable[[], None]) -> None:
    """Run `load` on this process's kernel-loading thread, under `compiling()`, after the loads asked before it;
    return at once. Until every load asked is done, `ready` and `started` say False on the other threads. Where a
    kernel had to be compiled (not in numba's cache), nothing is loaded here: see must_compile.

    Example:
        >>> load_in_background(dataset.load_kernels)
    """
    global _LOADER
    if _MUST_COMPILE[0]:  # the reads compile their kernels themselves now
        return
    with _LOCK:
        _QUEUE.append(load)
        if _LOADER is None:
            # Not a daemon: interpreter shutdown waits for it rather than stopping it inside LLVM, whose static
            # destructors would then run under a thread still in it.
            _LOADER = threading.Thread(target=_load_queued, name="corpusforge-kernels")
            _LOADER.start()


class _CompileNeeded(Exception):
    """Raised on the loading thread where numba would compile a kernel: that thread only loads from the cache."""


class _NoCompileHere(numba.core.event.Listener):
    """Stops a compile on the loading thread before it starts (numba's "numba:compile" event comes after its cache
    lookup missed, and before any type inference)."""

    def on_start(self, event: numba.core.event.Event) -> None:
        if threading.current_thread() is _LOADER:
            raise _CompileNeeded

    def on_end(self, event: numba.core.event.Event) -> None:
        pass


def _load_queued() -> None:
    global _LOADER
    _HERE.compiling = True
    while True:
        with _LOCK:
            if not _QUEUE or _MUST_COMPILE[0]:  # the load is over for the other threads at this very point
                _QUEUE.clear()  # after a compile was needed, the reads load their kernels themselves (must_compile)
                _LOADER = None
                return
            load = _QUEUE.pop(0)
        try:
            load()
        except _CompileNeeded:
            _MUST_COMPILE[0] = True
        except BaseException as error:  # kept for finish_loading's caller: a thread's error is printed, not raised
            _ERRORS.append(error)


def must_compile() -> bool:
    """Whether the background load met a kernel missing from numba's cache: the reads then call their kernels
    (compiling them where they are, as before there was a background load) instead of their numpy twins.

    Example:
        >>> must_compile()
        False
    """
    return _MUST_COMPILE[0]


# Whether the loading thread met a kernel missing from numba's cache: the reads then compile theirs (must_compile).
_MUST_COMPILE = [False]
numba.core.event.register("numba:compile", _NoCompileHere())


def loading() -> bool:
    """Whether a background load is in flight.

    Example:
        >>> loading()
        False
    """
    return _LOADER is not None


def finish_loading() -> None:
    """Wait until no background load is in flight (at once on the loader's own thread); raise what a load raised.

    Example:
        >>> finish_loading()
    """
    _join_loader()
    if _ERRORS and not compiling_here():
        raise _ERRORS.pop(0)


def _join_loader() -> None:
    """Wait for the loading thread, unless this is it (a load's own calls wait for nothing)."""
    while (loader := _LOADER) is not None and loader is not threading.current_thread():
        loader.join()


def _before_fork() -> None:
    # A child has only the forking thread: a loader thread's locks (numba's compiler lock, an import lock) would stay
    # held there for good. Errors stay for the next finish_loading (an exception here would only be printed).
    _join_loader()


def _after_fork_in_child() -> None:
    global _LOADER, _LOCK
    _LOADER, _LOCK = None, threading.Lock()
    _QUEUE.clear()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

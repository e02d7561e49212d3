"""Page-cache control for honest cold-read measurements (the loader benchmark, bench-io, the storage tests).

Standard library only: bench-io's worker processes use it. (Importing it runs corpusforge.storage's face, which
costs numpy and the format module, not numba: the span-copy kernel is compiled at its first use.)
"""

from __future__ import annotations

import ctypes
import mmap
import os


def drop_page_cache(path: str | os.PathLike) -> None:
    """Write back and evict a file from the page cache, so the next read comes from the storage (dirty pages
    cannot be dropped, hence the fdatasync first). Used for cold-read measurements.

    Example: drop_page_cache("out/corpus_text_document.bin")
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# resident_fraction asks mincore about a file of up to this many pages (16 MiB) in one call (a blend opens thousands
# of small ones), and about the sampled pages of a larger one one by one: the kernel looks up every page it is asked
# about (~5 ms for the 49k pages of a 200 MB file, against ~1 ms for 1024 single pages).
_ONE_CALL_PAGES = 1 << 12


def resident_fraction(path: str | os.PathLike, samples: int = 1024, window: int = 1) -> float | None:
    """The fraction of the file's pages in the page cache, estimated from `samples` evenly spaced windows of
    `window` pages each (mincore, one call per window: a call costs ~4 us, a page in it ~0.1 us; no I/O, nothing
    read ahead). None where that cannot be asked (no mincore, a mapping refused).

    Example: resident_fraction("out/corpus_text_document.bin") -> 1.0 right after preprocess wrote it
    """
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = _libc()
    if libc is None:
        return None
    page = mmap.PAGESIZE
    pages = -(-size // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)  # the mapping keeps the file
    if base in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        window = max(1, min(window, pages))
        last = pages - window  # the first page of the last window
        picks = sorted({i * last // max(samples - 1, 1) for i in range(min(samples, last + 1))})
        if pages <= _ONE_CALL_PAGES:  # one call for the whole file: a blend opens thousands of small ones
            flags = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(base), size, flags) != 0:
                return None
            return sum(flags[i + k] & 1 for i in picks for k in range(window)) / (len(picks) * window)
        flags, resident = (ctypes.c_ubyte * window)(), 0
        for i in picks:
            if libc.mincore(ctypes.c_void_p(base + i * page), window * page, flags) != 0:
                return None
            resident += sum(f & 1 for f in flags)
        return resident / (len(picks) * window)
    finally:
        libc.munmap(ctypes.c_void_p(base), size)


_LIBC: ctypes.CDLL | None | bool = False


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            int_ = ctypes.c_int
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC = libc
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC

"""Page-cache control for honest cold-read measurements (the loader benchmark, bench-io, the storage tests).

Kept apart from storage.py so that importing it costs nothing: bench-io's worker processes use it, and storage.py
compiles numba kernels.
"""

from __future__ import annotations

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

"""read_mode "auto": which local reader a .bin gets, from what the machine says when the dataset is opened.

"mmap-random" when the .bin fits comfortably in the page cache (at most AUTO_PAGE_CACHE_FRACTION of what this
process's memory can hold: min(MemAvailable, cgroup limit)) and is mostly cached already (mincore), since it is then
read from RAM at memcpy speed; "direct" when it does not fit or is cold, since every cold read goes to the disk and
whole 4 KiB pages per document piece cost ~4x the sample bytes (O_DIRECT: ~1.4x), while pretraining reads most
samples only once; where the file system refuses O_DIRECT (ramfs, some FUSE and NFS mounts), "mmap-random" for a
file that fits and "pread" for one that does not. The probes: /proc/meminfo, /proc/self/cgroup and the cgroup's
memory limit, mincore (pagecache.resident_fraction), one O_DIRECT read, the device's logical block size in sysfs.

Example:
    >>> choose_read_mode("out/a_text_document.bin", StorageConfig())
    ('mmap-random', 'auto: the .bin (0.00 GiB) fits the page-cache budget (11.2 GiB, half of ...): ...')
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from pathlib import Path
from typing import Any

from corpusforge.storage.config import GiB, StorageConfig
from corpusforge.storage.pagecache import resident_fraction

# read_mode "auto" asks the kernel about _RESIDENT_SAMPLES windows of _RESIDENT_WINDOW pages of a .bin to estimate
# how much of it is cached (a call costs ~4 us, a page in it ~0.1 us: 1024 single pages took ~5 ms of a 10 ms index
# build, 128 single pages 0.53 ms, 32 windows of 4 pages 0.15 ms; the decision compares it with AUTO_WARM_FRACTION).
_RESIDENT_SAMPLES = 32
_RESIDENT_WINDOW = 4

# read_mode "auto": a .bin up to this fraction of the memory the page cache can use is read through the memory map.
# Half, because the page cache also holds the other datasets of a blend, checkpoints being written and the
# training process's own files, and a file that only just fits is evicted piecemeal and read again (~4x each time).
AUTO_PAGE_CACHE_FRACTION = 0.5
# read_mode "auto": a .bin that fits but has less than this fraction of its pages cached when it is opened is read
# with O_DIRECT. A sample's documents lie apart in the file (the document order is shuffled), so whole-page reads
# of a cold file fetch about 4x the sample bytes, block-aligned O_DIRECT reads about 1.4x; and pretraining reads
# most samples once, so the pages the map would keep are seldom read again.
AUTO_WARM_FRACTION = 0.5


def choose_read_mode(bin_path: str | os.PathLike, config: StorageConfig) -> tuple[str, str]:
    """The read mode "auto" resolves to for this .bin, and why (one line, for reprs and run summaries).

    Example:
        >>> choose_read_mode("out/a_text_document.bin", StorageConfig())
        ('mmap-random', 'auto: the .bin (0.00 GiB) fits the page-cache budget (11.2 GiB, half of ...): ...')
    """
    size = os.path.getsize(bin_path)
    if config.auto_direct_above_bytes is not None:
        budget, source = config.auto_direct_above_bytes, "auto_direct_above_bytes"
    else:
        memory, source = page_cache_memory()
        budget = int(AUTO_PAGE_CACHE_FRACTION * memory)
        source = f"half of {source} {memory / GiB:.1f} GiB"
    sizes = f"the .bin ({size / GiB:.2f} GiB)"
    fits = f"auto: {sizes} fits the page-cache budget ({budget / GiB:.2f} GiB, {source})"
    if size <= budget:
        resident = resident_fraction(bin_path, _RESIDENT_SAMPLES, _RESIDENT_WINDOW)
        if resident is None or resident >= AUTO_WARM_FRACTION:
            cached = "" if resident is None else f" and {resident:.0%} of it is cached"
            return "mmap-random", f"{fits}{cached}: memory map, warm reads from RAM"
        over = f"{fits} but only {resident:.0%} of it is cached (a cold file)"
    else:
        over = f"auto: {sizes} exceeds the page-cache budget ({budget / GiB:.2f} GiB, {source})"
    refused = o_direct_refused(bin_path)
    if refused is None:
        return "direct", f"{over}: O_DIRECT reads of the sample bytes, no page-cache thrashing"
    if size <= budget:
        return "mmap-random", f"{over}, and O_DIRECT is refused here ({refused}): memory map, whole pages"
    return "pread", f"{over}, but O_DIRECT is refused here ({refused}): pread with read-ahead off (whole pages)"


def page_cache_memory() -> tuple[int, str]:
    """Bytes the page cache can hold for this process, and where the number comes from: MemAvailable, or the
    memory limit of its cgroup (v2 memory.max, v1 memory.limit_in_bytes) when that is smaller.

    Example:
        >>> page_cache_memory()
        (24006541312, 'MemAvailable')
    """
    now = time.monotonic()
    if _PAGE_CACHE_MEMORY and now - _PAGE_CACHE_MEMORY[0] < _PAGE_CACHE_MEMORY_TTL_S:
        return _PAGE_CACHE_MEMORY[1]
    available = _meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    found = (
        (limit, "the cgroup memory limit") if limit is not None and limit < available else (available, "MemAvailable")
    )
    _PAGE_CACHE_MEMORY[:] = [now, found]
    return found


# page_cache_memory's last answer is reused for this long: a blend of thousands of datasets opens them all within a
# second or two, and reading /proc/meminfo and the cgroup files for each cost more than opening it.
_PAGE_CACHE_MEMORY_TTL_S = 1.0
_PAGE_CACHE_MEMORY: list[Any] = []


def _meminfo(field_name: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup in bytes; None when there is none (or no cgroup file system)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: "0::/path"
                candidates = [f"/sys/fs/cgroup{path}/memory.max"]
            elif "memory" in controllers.split(","):
                candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
            else:
                continue
            for candidate in candidates:
                with contextlib.suppress(OSError, ValueError):
                    text = Path(candidate).read_text().strip()
                    if text != "max" and int(text) < 1 << 60:  # v1 writes "no limit" as ~2^63
                        return int(text)
    return None


def o_direct_refused(path: str | os.PathLike) -> str | None:
    """Why O_DIRECT reads of `path` fail (an errno name and message), or None when they work.

    Opens and reads one aligned block: some file systems refuse the open (ramfs, FUSE without direct I/O: EINVAL),
    others only the read.

    Example:
        >>> o_direct_refused("/data/corpus_text_document.bin") is None
        True
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
    try:
        align = logical_block_size(path)
        buffer = mmap.mmap(-1, max(align, mmap.PAGESIZE))
        try:
            os.preadv(fd, [memoryview(buffer)[:align]], 0)
        except OSError as e:
            return f"{errno.errorcode.get(e.errno, e.errno)} on read: {e.strerror}"
        finally:
            buffer.close()
    finally:
        os.close(fd)
    return None


def logical_block_size(path: str | os.PathLike) -> int:
    """The O_DIRECT alignment of the device holding `path`: its logical block size from sysfs, else 4096."""
    dev = os.stat(path).st_dev
    for sys_path in (
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/logical_block_size",
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue/logical_block_size",  # a partition
    ):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(sys_path).read_text())
    return 4096  # page size: what every file system that supports O_DIRECT accepts

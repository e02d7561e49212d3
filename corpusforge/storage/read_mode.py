"""read_mode "auto": which local reader a .bin gets, from what the machine says when the dataset is opened.

"mmap-random" when the .bin fits comfortably in the page cache (at most AUTO_PAGE_CACHE_FRACTION of what this
process's memory can hold: min(MemAvailable, cgroup limit)) and is mostly cached already (mincore), since it is then
read from RAM at memcpy speed; "direct" when it does not fit or is cold, since every cold read goes to the disk and
whole 4 KiB pages per document piece cost ~4x the sample bytes (O_DIRECT: ~1.4x), while pretraining reads most
samples only once; where the file system refuses O_DIRECT (ramfs, some FUSE and NFS mounts), "mmap-random" for a
file that fits and "pread" for one that does not. The probes: /proc/meminfo, /proc/self/cgroup and the cgroup's
memory limit, mincore (pagecache.resident_fraction), one O_DIRECT read, the device's logical block size in sysfs.
A blend of many datasets (storage.datasets.open_datasets) decides once for all its small .bin files together
(choose_read_modes): their total against the budget, mincore over a few of them, O_DIRECT probed once per device.

Example:
    >>> choose_read_mode("out/a_text_document.bin", StorageConfig())
    ('mmap-random', 'auto: the .bin (0.00 GiB) fits the page-cache budget (11.2 GiB, half of ...): ...')
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import time
from collections.abc import Callable, Sequence
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


def choose_read_mode(bin_path: str | os.PathLike, config: StorageConfig, size: int | None = None) -> tuple[str, str]:
    """The read mode "auto" resolves to for this .bin (of `size` bytes, when the caller has stat'ed it), and why
    (one line, for reprs and run summaries).

    Example:
        >>> choose_read_mode("out/a_text_document.bin", StorageConfig())
        ('mmap-random', 'auto: the .bin (0.00 GiB) fits the page-cache budget (11.2 GiB, half of ...): ...')
    """
    size = os.path.getsize(bin_path) if size is None else size
    budget, source = _budget(config)
    sizes = f"the .bin ({size / GiB:.2f} GiB)"
    resident = resident_fraction(bin_path, _RESIDENT_SAMPLES, _RESIDENT_WINDOW) if size <= budget else None
    return _decide(size, budget, source, sizes, resident, lambda: o_direct_refused(bin_path))


def _budget(config: StorageConfig) -> tuple[int, str]:
    """The bytes of .bin files "auto" reads through the memory map, and where that number comes from."""
    if config.auto_direct_above_bytes is not None:
        return config.auto_direct_above_bytes, "auto_direct_above_bytes"
    memory, source = page_cache_memory()
    return int(AUTO_PAGE_CACHE_FRACTION * memory), f"half of {source} {memory / GiB:.1f} GiB"


def _decide(
    size: int, budget: int, source: str, sizes: str, resident: float | None, refused: Callable[[], str | None]
) -> tuple[str, str]:
    """The rule of read_mode "auto" for `size` bytes (described as `sizes`) of which `resident` (a fraction, or
    None: unknown) is cached; `refused()` says why O_DIRECT fails there (None: it works), asked only if needed."""
    fits = f"auto: {sizes} fits the page-cache budget ({budget / GiB:.2f} GiB, {source})"
    if size <= budget:
        if resident is None or resident >= AUTO_WARM_FRACTION:
            cached = "" if resident is None else f" and {resident:.0%} of it is cached"
            return "mmap-random", f"{fits}{cached}: memory map, warm reads from RAM"
        over = f"{fits} but only {resident:.0%} of it is cached (a cold file)"
    else:
        over = f"auto: {sizes} exceeds the page-cache budget ({budget / GiB:.2f} GiB, {source})"
    why = refused()
    if why is None:
        return "direct", f"{over}: O_DIRECT reads of the sample bytes, no page-cache thrashing"
    if size <= budget:
        return "mmap-random", f"{over}, and O_DIRECT is refused here ({why}): memory map, whole pages"
    return "pread", f"{over}, but O_DIRECT is refused here ({why}): pread with read-ahead off (whole pages)"


# A blend of many datasets decides for its small .bin files together (choose_read_modes): those up to this size, when
# there are at least SMALL_GROUP_MIN of them. Per file, "auto" costs a mincore probe and, for a cold file, an
# O_DIRECT probe: ~0.4 ms, a second for 2,500 files, more than the rest of opening them.
SMALL_BIN_BYTES = 16 << 20
SMALL_GROUP_MIN = 8
# Files of the group whose pages mincore counts (each in one call, ~10 us), evenly spread over the blend's order.
_GROUP_RESIDENT_FILES = 32


def choose_read_modes(
    bin_paths: Sequence[str], config: StorageConfig, sizes: Sequence[int], devices: Sequence[int]
) -> list[tuple[str, str]]:
    """choose_read_mode for every .bin of a blend (`sizes` and `devices`: their st_size and st_dev), with one
    decision for all the small ones (at most SMALL_BIN_BYTES, when there are SMALL_GROUP_MIN or more): the blend
    reads them all, so it is their total that must fit the page-cache budget, and the cached fraction of their pages
    is estimated from _GROUP_RESIDENT_FILES of them. O_DIRECT is probed once per device (st_dev), not per file.
    Larger files are decided one by one, as choose_read_mode does.

    Example:
        >>> choose_read_modes(["a.bin", "b.bin"], StorageConfig(), [4096, 8192], [2049, 2049])[0][0]
        'mmap-random'
    """
    refused: dict[int, str | None] = {}

    def refused_on(i: int) -> str | None:
        if devices[i] not in refused:
            refused[devices[i]] = o_direct_refused(bin_paths[i])
        return refused[devices[i]]

    small = [i for i, size in enumerate(sizes) if size <= SMALL_BIN_BYTES]
    if len(small) < SMALL_GROUP_MIN:
        small = []
    out: list[tuple[str, str] | None] = [None] * len(bin_paths)
    if small:
        budget, source = _budget(config)
        total = sum(sizes[i] for i in small)
        sampled = [small[k * (len(small) - 1) // (_GROUP_RESIDENT_FILES - 1)] for k in range(_GROUP_RESIDENT_FILES)]
        sampled = sorted(set(sampled))
        resident = _resident_pages(bin_paths, sizes, sampled) if total <= budget else None
        what = f"the {len(small)} small .bin files of the blend together ({total / GiB:.2f} GiB)"
        if resident is not None:
            what += f", {len(sampled)} of them sampled"
        by_device: dict[int, tuple[str, str]] = {}
        for i in small:  # one decision; only the O_DIRECT fallback can differ between devices
            if devices[i] not in by_device:
                by_device[devices[i]] = _decide(total, budget, source, what, resident, lambda i=i: refused_on(i))
            out[i] = by_device[devices[i]]
    for i, path in enumerate(bin_paths):
        if out[i] is None:
            out[i] = choose_read_mode(path, config, sizes[i])
    return out  # type: ignore[return-value]


def _resident_pages(bin_paths: Sequence[str], sizes: Sequence[int], picks: Sequence[int]) -> float | None:
    """The fraction of the pages of files `picks` that are cached, weighting each file by its pages; None where
    mincore cannot be asked."""
    cached = pages = 0.0
    for i in picks:
        n = -(-sizes[i] // mmap.PAGESIZE)
        if not n:
            continue
        fraction = resident_fraction(bin_paths[i], n, 1)  # small files: one mincore call, every page counted
        if fraction is None:
            return None
        cached, pages = cached + fraction * n, pages + n
    return cached / pages if pages else 1.0


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
    """The O_DIRECT alignment of the device holding `path`: its logical block size from sysfs, else 4096.

    Example: logical_block_size("/data/corpus_text_document.bin") -> 512
    """
    return _device_block_size(os.stat(path).st_dev)


@functools.cache
def _device_block_size(dev: int) -> int:
    """logical_block_size of device `dev`, read once per process: a blend read with O_DIRECT asks it per dataset,
    and a device's logical block size does not change while it is mounted."""
    for sys_path in (
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/logical_block_size",
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue/logical_block_size",  # a partition
    ):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(sys_path).read_text())
    return 4096  # page size: what every file system that supports O_DIRECT accepts

"""Where token datasets are read from: local disk, shared file systems, object stores (fsspec), a local cache tier.

`open_dataset(prefix, config)` returns a reader of `{prefix}.bin/.idx` with the attributes of
`corpusforge.indexed.IndexedDataset` (sequence_lengths, sequence_pointers, document_indices, dtype, ...) and one
method the loaders call, `read_spans(starts, lengths)`: the tokens of many [start, start + length) ranges, back
to back, in one call. Three readers:

- `LocalDataset`, a path on a mounted file system (local disk, Lustre, CephFS). `read_mode="auto"` (default)
  picks one of the modes below when the dataset is opened, and says which and why (`read_mode_reason`, repr):
  "mmap-random" when the .bin fits comfortably in the page cache (at most half of what this process's memory can
  hold: min(MemAvailable, cgroup limit)) and is mostly cached already (mincore), since it is then read from RAM at
  memcpy speed; "direct" when it does not fit or is cold, since every cold read goes to the disk and whole 4 KiB
  pages per document piece cost ~4x the sample bytes (O_DIRECT: ~1.4x), while pretraining reads most samples only
  once; where the file system refuses O_DIRECT (ramfs, some FUSE and NFS mounts), "mmap-random" for a file that
  fits and "pread" for one that does not.
  `"mmap-random"` copies each span from the memory map, mapped with madvise(MADV_RANDOM) so that a cold read costs
  the pages it touches and no read-ahead. `"pread"` reads each span with os.preadv, with posix_fadvise(RANDOM): the
  same pages, a system call per span (slower from the page cache; no mapping). `"direct"` reads with O_DIRECT in
  units of the device's logical block (512 B here) and never fills the page cache: for corpora larger than RAM,
  where each short document piece of a sample would otherwise cost whole 4 KiB pages (about 4x the sample bytes
  at 1000-token documents, against 1.4x). `"mmap"` has the kernel's default read-ahead, which on random access
  pulls up to the read-ahead window (128 KiB to 8 MiB, more on Lustre) per page fault and thrashes a corpus
  larger than RAM (~200x the sample bytes measured here).
- `RemoteDataset`, an fsspec URL (`s3://bucket/key/prefix`, `gs://...`): the `.idx` is fetched whole into
  memory; the `.bin` is read in large ranged requests (`block_size`, 256 MiB by default as in Megatron-Core's
  S3 reader, megatron/core/datasets/object_storage_utils.py) kept in a small LRU of blocks.
- `LocalCache`, a directory with a size cap: `fetch(prefix)` copies a dataset (local or remote) to it on first
  use, verifies it, and returns the local prefix. Layout of the cache directory:

      {key}/{name}.bin, {key}/{name}.idx   a complete, verified copy (key = sha256 of the source location)[:16]
      {key}/meta.json                      source, sizes, sha256 of both files, written before the rename
      {key}.lock                           flock held while copying or evicting that entry
      {key}.readers                        shared flock of every process reading that entry (no eviction then)
      .{key}.partial-{pid}/                a copy in progress; never read; removed by the next lock holder
      {key}.used                           its mtime is the entry's last use (LRU eviction)

  One process per node copies while the others wait on the lock; the copy appears under its final name only
  complete (rename of the directory), so a killed copy is never used.

Example:
    >>> ds = open_dataset("s3://corpora/web_text_document",
    ...                   StorageConfig(storage_options={"endpoint_url": "http://127.0.0.1:7480"},
    ...                                 local_cache_dir="/nvme/cf-cache", local_cache_max_bytes=500 << 30))
    >>> ds.read_spans(np.array([0, 4096]), np.array([2049, 2049])).shape
    (4098,)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge import indexed
from corpusforge.jit import njit
from corpusforge.errors import MissingExtraError
from corpusforge.indexed import HEADER_SIZE, IndexedDataset, IndexedFormatError, fsync_dir
from corpusforge.pagecache import resident_fraction

READ_MODES = ("auto", "pread", "direct", "mmap", "mmap-random")
MiB = 1 << 20
GiB = 1 << 30

# read_mode "auto" asks the kernel about this many pages of a .bin to estimate how much of it is cached (each a
# syscall of a few us: 1024 took ~5 ms of a 10 ms index build; 128 give the fraction within a few percent, and the
# decision compares it with AUTO_WARM_FRACTION).
_RESIDENT_SAMPLES = 128

# read_mode "auto": a .bin up to this fraction of the memory the page cache can use is read through the memory map.
# Half, because the page cache also holds the other datasets of a blend, checkpoints being written and the
# training process's own files, and a file that only just fits is evicted piecemeal and read again (~4x each time).
AUTO_PAGE_CACHE_FRACTION = 0.5
# read_mode "auto": a .bin that fits but has less than this fraction of its pages cached when it is opened is read
# with O_DIRECT. A sample's documents lie apart in the file (the document order is shuffled), so whole-page reads
# of a cold file fetch about 4x the sample bytes, block-aligned O_DIRECT reads about 1.4x; and pretraining reads
# most samples once, so the pages the map would keep are seldom read again.
AUTO_WARM_FRACTION = 0.5


@dataclass(frozen=True)
class StorageConfig:
    """How token datasets are opened and read (the loaders take one; all fields have working defaults)."""

    read_mode: str = "auto"
    """Local reads: "auto" (chosen per dataset when it is opened: "mmap-random" when the .bin fits in half of the
    memory the page cache can use and at least half of it is cached, else "direct" (a cold or too large file), else,
    where O_DIRECT is refused, "mmap-random" for a file that fits and "pread" for one that does not), "mmap-random"
    (memory map with madvise(MADV_RANDOM): no read-ahead, so a cold read costs the pages a sample touches; from the
    page cache a compiled memcpy per span, no system call), "pread" (os.preadv per span, read-ahead off: the same
    pages, one system call each), "direct" (O_DIRECT reads aligned to the device's logical block, bypassing the page
    cache: the least disk traffic on a corpus larger than RAM), "mmap" (memory map with the kernel's read-ahead:
    megabytes per fault on random access; for comparison)."""

    block_size: int = 256 * MiB
    """Remote .bin reads: bytes per ranged request (Megatron-Core's S3 reader reads 256 MiB blocks)."""

    cache_blocks: int = 2
    """Remote .bin reads: blocks kept in memory per dataset (LRU), so block_size * cache_blocks bytes at most."""

    prefetch_blocks: int = 1
    """Remote .bin reads: blocks fetched ahead on background threads for the samples the loader asks for next, so
    that a step does not wait on a GET; per dataset and process, memory is block_size * (cache_blocks +
    prefetch_blocks) at most. 0: no prefetching."""

    auto_direct_above_bytes: int | None = None
    """read_mode "auto": a .bin larger than this is read with O_DIRECT (pread where refused), a smaller one through
    the memory map; None: AUTO_PAGE_CACHE_FRACTION (1/2) of min(MemAvailable, the cgroup's memory limit), read when
    the dataset is opened."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options of remote URLs, e.g. {"endpoint_url": "http://host:7480", "key": ..., "secret": ...}; for
    s3 they go to s3fs.S3FileSystem, with endpoint_url moved into client_kwargs."""

    local_cache_dir: str | None = None
    """A directory on fast local disk: datasets are copied there on first use and read from there."""

    local_cache_max_bytes: int | None = None
    """Size cap of local_cache_dir; least-recently-used datasets are evicted to stay under it (None: no cap)."""

    verify_sha256: bool = False
    """Re-hash a local-cache copy against the sha256 recorded at copy time each time it is opened (O(size))."""

    def __post_init__(self) -> None:
        if self.read_mode not in READ_MODES:
            raise ValueError(f"read_mode {self.read_mode!r}: choose one of {READ_MODES}")
        if self.local_cache_max_bytes is not None and self.local_cache_max_bytes < 1:
            raise ValueError(f"local_cache_max_bytes must be positive or None ({self.local_cache_max_bytes})")
        if self.auto_direct_above_bytes is not None and self.auto_direct_above_bytes < 0:
            raise ValueError(f"auto_direct_above_bytes must not be negative ({self.auto_direct_above_bytes})")
        if self.prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must not be negative ({self.prefetch_blocks})")
        if self.block_size < 1 or self.cache_blocks < 1:
            raise ValueError(f"block_size and cache_blocks must be positive ({self.block_size}, {self.cache_blocks})")


def is_url(prefix: str | os.PathLike) -> bool:
    """True for an fsspec URL with a protocol other than file (s3://, gs://, http://, ...).

    Example:
        >>> is_url("s3://bucket/a_text_document"), is_url("/data/a_text_document")
        (True, False)
    """
    text = os.fspath(prefix)
    return "://" in text and not text.startswith("file://")


def open_dataset(prefix: str | os.PathLike, config: StorageConfig | None = None) -> LocalDataset | RemoteDataset:
    """The token dataset at a local prefix or an fsspec URL, through the local cache tier when one is configured.

    Example:
        >>> open_dataset("out/a_text_document").read_spans(np.array([0]), np.array([3]))
        array([  464,  2068, 50256], dtype=uint16)
    """
    config = config or StorageConfig()
    text = os.fspath(prefix)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if config.local_cache_dir is not None:
        cache = LocalCache(config.local_cache_dir, config.local_cache_max_bytes, config.storage_options)
        path, pin = cache.fetch_pinned(text, verify_sha256=config.verify_sha256)
        return LocalDataset(path, config.read_mode, source=text, config=config, pin=pin)
    if is_url(text):
        return RemoteDataset(text, config)
    missing = [p for p in (f"{text}.idx", f"{text}.bin") if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"dataset prefix {text!r}: missing {' and '.join(missing)}; a prefix names the pair PREFIX.bin/.idx "
            f"(e.g. out/corpus_text_document, without the extension) as written by `corpusforge preprocess`"
        )
    return LocalDataset(text, config.read_mode, config=config)


# ---------------------------------------------------------------------------------------------------------------
# local reads


# (dtype, read mode) of the datasets whose span copy LocalDataset.load_kernels has compiled in this process.
_LOADED: set[tuple[str, str]] = set()


class LocalDataset(IndexedDataset):
    """A token dataset on a mounted file system, read through its memory map or with pread / O_DIRECT.

    `read_mode` is the mode in use ("auto" resolved when opened), `read_mode_reason` why ("configured" when given).

    Example:
        >>> ds = LocalDataset("out/a_text_document", read_mode="pread")
        >>> ds.read_spans(np.array([0, 10]), np.array([2, 2]))      # tokens 0, 1, 10, 11
        >>> LocalDataset("/lustre/big_text_document").read_mode_reason
        'auto: the .bin (812.00 GiB) exceeds the page-cache budget (245.10 GiB, ...): O_DIRECT reads of ...'
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        read_mode: str = "auto",
        source: str | None = None,
        config: StorageConfig | None = None,
        pin: ReaderPin | None = None,
    ) -> None:
        self.pin = pin  # a local cache entry's: no eviction while this dataset (or a fork of it) is open
        super().__init__(prefix, check=False)
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode {read_mode!r}: choose one of {READ_MODES}")
        self.source = source or self.prefix  # what the user named (a URL when read through the local cache)
        self._config = config or StorageConfig(read_mode=read_mode)
        if read_mode == "auto":
            self.read_mode, self.read_mode_reason = choose_read_mode(self.bin_path, self._config)
        else:
            self.read_mode, self.read_mode_reason = read_mode, "configured"
        self._fd: int | None = None  # close() reads it
        try:  # the full check after "auto" has measured how much of the .bin is cached: its sample caches some pages
            self.validate()
        except IndexedFormatError:
            self.close()  # let go of the cache entry's pin: a refused dataset is not being read
            raise
        self._fd_pid = -1
        if self.read_mode == "mmap-random" and isinstance(self._bin, np.memmap):
            self._bin._mmap.madvise(mmap.MADV_RANDOM)  # fault in one page at a time: no read-ahead

    def load_kernels(self) -> None:
        """Compile (or load) the span copy now, before DataLoader workers fork (they inherit it); once per process
        and dtype. Not at open: a blend opens thousands of datasets, and a job's start need not wait for numba.

        Example:
            >>> LocalDataset("out/a_text_document").load_kernels()
        """
        key = (self.dtype.str, self.read_mode)
        if self.read_mode in ("mmap", "mmap-random") and key not in _LOADED:
            self.read_spans(np.zeros(0, np.int64), np.zeros(0, np.int64))
            _LOADED.add(key)

    def _file(self) -> int:
        # One descriptor per process: a DataLoader worker forked from us opens its own rather than depend on one
        # the parent may close.
        if self._fd is None or self._fd_pid != os.getpid():
            direct = os.O_DIRECT if self.read_mode == "direct" else 0
            self._fd, self._fd_pid = os.open(self.bin_path, os.O_RDONLY | direct), os.getpid()
            # Random access: no read-ahead (the kernel would read up to read_ahead_kb around every miss).
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._align = _logical_block_size(self.bin_path) if direct else 1
        return self._fd

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [starts[k], starts[k] + lengths[k]) for every k, concatenated (token units, not bytes)."""
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        if self.read_mode in ("mmap", "mmap-random"):
            return _copy_spans(self.tokens, starts, lengths, out)
        fd, itemsize = self._file(), self.dtype.itemsize
        if self.read_mode == "direct":
            return self._read_direct(fd, starts * itemsize, lengths * itemsize, out)
        view = memoryview(out).cast("B")
        pos = 0
        for start, length in zip((starts * itemsize).tolist(), (lengths * itemsize).tolist()):
            got = os.preadv(fd, [view[pos : pos + length]], start)
            if got != length:  # a short read only at end of file: the .bin shrank under us
                raise OSError(f"{self.bin_path}: read {got} of {length} bytes at offset {start}")
            pos += length
        return out

    def _read_direct(self, fd: int, starts: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> np.ndarray:
        """O_DIRECT: each span widened to whole logical blocks, read into one aligned buffer, then cut out."""
        a = self._align
        lo = starts // a * a
        hi = -(-(starts + nbytes) // a) * a
        sizes = hi - lo
        buffer = mmap.mmap(-1, max(int(sizes.sum()), a))  # page-aligned, as O_DIRECT wants
        view, pos = memoryview(buffer), 0
        for offset, size in zip(lo.tolist(), sizes.tolist()):
            got = os.preadv(fd, [view[pos : pos + size]], offset)
            if got < size and offset + got < min(offset + size, self._bin_bytes()):
                raise OSError(f"{self.bin_path}: read {got} of {size} bytes at offset {offset}")
            pos += size
        raw = np.frombuffer(buffer, np.uint8)
        dest = memoryview(out).cast("B")
        pos = done = 0
        for skip, size, n in zip((starts - lo).tolist(), sizes.tolist(), nbytes.tolist()):
            dest[done : done + n] = raw[pos + skip : pos + skip + n].data
            pos += size
            done += n
        del view, raw
        buffer.close()
        return out

    def _bin_bytes(self) -> int:
        return len(self._bin) * self.dtype.itemsize

    def close(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None
        if self.pin is not None:
            self.pin.close()
        super().close()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled for spawn/forkserver DataLoader workers: reopen by name instead of copying the memory map, in the
        # mode chosen here (a worker re-running "auto" could see another MemAvailable and choose otherwise).
        return (open_dataset, (self.source, replace(self._config, read_mode=self.read_mode)))

    def __repr__(self) -> str:
        return (
            f"LocalDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype}, "
            f"read_mode={self.read_mode!r} ({self.read_mode_reason}))"
        )


# ---------------------------------------------------------------------------------------------------------------
# read_mode "auto"


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
        resident = resident_fraction(bin_path, _RESIDENT_SAMPLES)
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
        align = _logical_block_size(path)
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


def _logical_block_size(path: str | os.PathLike) -> int:
    """The O_DIRECT alignment of the device holding `path`: its logical block size from sysfs, else 4096."""
    dev = os.stat(path).st_dev
    for sys_path in (
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/logical_block_size",
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue/logical_block_size",  # a partition
    ):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(sys_path).read_text())
    return 4096  # page size: what every file system that supports O_DIRECT accepts


def _copy_spans(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Slice copies from an array (a memory map): one memcpy per span, compiled, no index arrays."""
    _copy_spans_kernel(np.asarray(tokens), np.asarray(starts, np.int64), np.asarray(lengths, np.int64), out)
    return out


@njit(nogil=True)
def _copy_spans_kernel(tokens, starts, lengths, out) -> None:
    pos = 0
    for k in range(len(starts)):
        out[pos : pos + lengths[k]] = tokens[starts[k] : starts[k] + lengths[k]]
        pos += lengths[k]


# ---------------------------------------------------------------------------------------------------------------
# remote reads


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec file system of `url`, a fresh instance (never shared with a parent process after fork).

    Example:
        >>> fs = filesystem("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:7480", "key": "k", "secret": "s"})
    """
    try:
        import fsspec
    except ImportError:
        raise MissingExtraError("remote datasets need fsspec: pip install 'corpusforge[s3]'") from None
    protocol = url.split("://", 1)[0]
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a") and "endpoint_url" in options:
        client = dict(options.pop("client_kwargs", {}) or {})
        client["endpoint_url"] = options.pop("endpoint_url")
        options["client_kwargs"] = client
        # botocore >= 1.36 sends CRC checksums (aws-chunked uploads) by default, which S3-compatible stores that
        # predate it (Ceph RGW before Squid, older MinIO) answer with 400 InvalidArgument: only when required.
        config = dict(options.pop("config_kwargs", {}) or {})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        options["config_kwargs"] = config
    try:
        return fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    except (ImportError, ValueError) as e:
        if protocol in ("s3", "s3a"):
            raise MissingExtraError(f"{url}: s3 URLs need s3fs: pip install 'corpusforge[s3]' ({e})") from None
        raise


def parse_index(data: bytes | memoryview, where: str) -> dict[str, Any]:
    """The arrays of an .idx held in memory, with the header and size checks of indexed.IndexedDataset.

    Example:
        >>> parse_index(open("out/a_text_document.idx", "rb").read(), "a")["dtype"]
        dtype('uint16')
    """
    header = indexed.parse_header(bytes(data[:HEADER_SIZE]), where)
    indexed.check_index_size(where, len(data), header)
    s, d = header.sequence_count, header.document_count
    return {
        "dtype": header.dtype,
        "sequence_lengths": np.frombuffer(data, np.int32, s, HEADER_SIZE),
        "sequence_pointers": np.frombuffer(data, np.int64, s, HEADER_SIZE + 4 * s),
        "document_indices": np.frombuffer(data, np.int64, d, HEADER_SIZE + 12 * s),
    }


class BlockCache:
    """An LRU of fixed-size blocks of one remote file, each fetched with one ranged GET, and blocks fetched ahead.

    `prefetch(blocks)` starts background GETs (threads of this process) for blocks that reads will want soon, at
    most `prefetch_blocks` fetched-ahead blocks held or in flight; a read takes its block from there (waiting for
    it if its GET is still running) instead of issuing a GET itself. Memory: at most
    (max_blocks + prefetch_blocks) * block_size.

    Counters (the tests assert on them): `requests` and `bytes_fetched`, what went over the network;
    `read_requests`, GETs that a read issued itself; `prefetch_requests`; `waits`, reads that waited on the network
    (their own GET or a prefetch still in flight); `peak_blocks`, the most blocks held or in flight at once.

    Example:
        >>> blocks = BlockCache(lambda lo, hi: fs.cat_file(path, lo, hi), size=10 << 30, block_size=256 << 20,
        ...                     max_blocks=2, prefetch_blocks=2)
        >>> blocks.prefetch([7, 3])    # GETs of blocks 7 and 3 start in the background
        >>> blocks.read_into(memoryview(bytearray(64)), 7 * (256 << 20))   # block 7, without a GET of its own
    """

    def __init__(self, fetch, size: int, block_size: int, max_blocks: int, prefetch_blocks: int = 0) -> None:
        self.fetch, self.size, self.block_size, self.max_blocks = fetch, size, block_size, max_blocks
        self.prefetch_blocks = prefetch_blocks
        self.blocks: OrderedDict[int, bytes] = OrderedDict()  # read recently (LRU)
        self.ahead: dict[int, bytes] = {}  # fetched ahead, not read yet
        self.in_flight: dict[int, Future] = {}
        self.requests = self.bytes_fetched = self.read_requests = self.prefetch_requests = 0
        self.waits = self.peak_blocks = 0
        self._lock = threading.Lock()  # torch DataLoader pin-memory threads may read concurrently
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a process forked from the one that made us (a DataLoader worker): the parent's prefetch threads are
        not here, and the lock may have been copied while one of them held it. Start over with the blocks."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._pool, self._pid = None, os.getpid()
            self.in_flight = {}

    def _get(self, b: int) -> bytes:
        lo = b * self.block_size
        hi = min(lo + self.block_size, self.size)
        data = bytes(self.fetch(lo, hi))
        if len(data) != hi - lo:
            raise OSError(f"ranged read [{lo}, {hi}) returned {len(data)} bytes")
        with self._lock:
            self.requests += 1
            self.bytes_fetched += len(data)
        return data

    def _keep(self, b: int, data: bytes) -> None:
        """Put a block that is being read into the LRU (lock held)."""
        self.blocks[b] = data
        self.blocks.move_to_end(b)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def _take(self, b: int) -> bytes | None:
        """Block b from the LRU or from the fetched-ahead blocks (lock held)."""
        data = self.blocks.get(b)
        if data is not None:
            self.blocks.move_to_end(b)
            return data
        data = self.ahead.pop(b, None)
        if data is not None:
            self._keep(b, data)
        return data

    def _block(self, b: int) -> bytes:
        self._forked()
        with self._lock:
            data = self._take(b)
            future = self.in_flight.get(b) if data is None else None
            if data is None:
                self.waits += 1
        if data is not None:
            return data
        if future is not None:
            with contextlib.suppress(Exception):  # a failed prefetch: the read below tries again itself
                future.result()
            with self._lock:
                data = self._take(b)
            if data is not None:
                return data
        data = self._get(b)
        with self._lock:
            self.read_requests += 1
            self._keep(b, data)
        return data

    def prefetch(self, blocks: list[int]) -> None:
        """Fetch `blocks` (soonest needed first) in the background, as far as prefetch_blocks allows; fetched-ahead
        blocks not among them are dropped (the reads that would have wanted them went elsewhere)."""
        if self.prefetch_blocks < 1:
            return
        self._forked()
        wanted = list(dict.fromkeys(int(b) for b in blocks))
        with self._lock:
            keep = set(wanted)
            for stale in [b for b in self.ahead if b not in keep]:
                del self.ahead[stale]
            for b in wanted:
                if len(self.ahead) + len(self.in_flight) >= self.prefetch_blocks:
                    break
                if b in self.ahead or b in self.in_flight:
                    continue
                if b in self.blocks:  # held where reads of other blocks could evict it first: keep it aside
                    self.ahead[b] = self.blocks.pop(b)
                    continue
                self.in_flight[b] = self._executor().submit(self._fetch_ahead, b)
            held = len(self.blocks) + len(self.ahead) + len(self.in_flight)
            self.peak_blocks = max(self.peak_blocks, held)

    def _fetch_ahead(self, b: int) -> None:
        try:
            data = self._get(b)
        except BaseException:
            with self._lock:
                self.in_flight.pop(b, None)
            raise
        with self._lock:
            self.in_flight.pop(b, None)
            self.prefetch_requests += 1
            if b not in self.blocks:
                self.ahead[b] = data

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # a few GETs in parallel: one ranged GET rarely fills the link
            self._pool = ThreadPoolExecutor(max(1, min(self.prefetch_blocks, 4)), thread_name_prefix="prefetch")
        return self._pool

    def blocks_of(self, starts: np.ndarray, nbytes: np.ndarray) -> list[int]:
        """The blocks that byte ranges [starts[k], starts[k] + nbytes[k]) touch, in order of first use."""
        out: dict[int, None] = {}
        for lo, n in zip(starts.tolist(), nbytes.tolist()):
            if n > 0:
                out.update(dict.fromkeys(range(lo // self.block_size, (lo + n - 1) // self.block_size + 1)))
        return list(out)

    def close(self) -> None:
        """Drop every block; prefetches in flight finish in the background and are dropped too."""
        with self._lock:
            self.blocks.clear()
            self.ahead.clear()
            self.prefetch_blocks = 0
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)

    def read_into(self, out: memoryview, offset: int) -> None:
        """Fill `out` with the bytes at [offset, offset + len(out))."""
        pos, n = 0, len(out)
        while pos < n:
            b, within = divmod(offset + pos, self.block_size)
            data = self._block(b)
            take = min(n - pos, len(data) - within)
            if take <= 0:
                raise OSError(f"read past the end of the file at byte {offset + pos} (size {self.size})")
            out[pos : pos + take] = data[within : within + take]
            pos += take


class RemoteDataset:
    """A token dataset at an fsspec URL: the .idx in memory, the .bin through a BlockCache of ranged reads.

    Example:
        >>> ds = RemoteDataset("s3://corpora/a_text_document", StorageConfig(storage_options={...}))
        >>> ds.read_spans(np.array([0]), np.array([2049])).dtype
        dtype('uint16')
    """

    def __init__(self, url: str, config: StorageConfig | None = None) -> None:
        self.prefix = self.source = url
        self.config = config or StorageConfig()
        self._fs_pid = -1
        fs = self._filesystem()
        idx_url, self.bin_url = f"{url}.idx", f"{url}.bin"
        try:
            data = fs.cat_file(idx_url)
            bin_size = int(fs.size(self.bin_url))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset prefix {url!r}: {idx_url} or {self.bin_url} does not exist; a prefix names the pair "
                "PREFIX.bin/.idx without the extension"
            ) from None
        arrays = parse_index(data, idx_url)
        self.dtype = arrays["dtype"]
        self.sequence_lengths = arrays["sequence_lengths"]
        self.sequence_pointers = arrays["sequence_pointers"]
        self.document_indices = arrays["document_indices"]
        # The same checks as a local open (the whole .idx is in memory anyway), before any block is fetched.
        indexed.check_index(
            idx_url, self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices, bin_size,
            self.bin_url,
        )  # fmt: skip
        self.bin_size = bin_size
        self._check_head_tokens(fs)
        self.blocks = BlockCache(
            self._fetch, bin_size, self.config.block_size, self.config.cache_blocks, self.config.prefetch_blocks
        )

    def _check_head_tokens(self, fs: Any) -> None:
        """The dtype against the first tokens (indexed.check_token_sample), in one small ranged GET rather than a
        first block of `block_size`; the middle and end samples of a local open would cost two more requests."""
        head = fs.cat_file(self.bin_url, start=0, end=min(self.bin_size, indexed.SAMPLE_TOKENS * self.dtype.itemsize))
        tokens = np.frombuffer(head, self.dtype, len(head) // self.dtype.itemsize)
        indexed.check_token_sample(f"{self.prefix}.idx", tokens, np.arange(len(tokens)))

    def _filesystem(self) -> Any:
        # fsspec's async clients (s3fs/aiohttp) must not cross a fork: each process makes its own.
        if self._fs_pid != os.getpid():
            self._fs, self._fs_pid = filesystem(self.prefix, self.config.storage_options), os.getpid()
        return self._fs

    def _fetch(self, lo: int, hi: int) -> bytes:
        return self._filesystem().cat_file(self.bin_url, start=lo, end=hi)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return self.bin_size // self.dtype.itemsize

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [starts[k], starts[k] + lengths[k]) for every k, concatenated, through the block cache."""
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        view, itemsize, pos = memoryview(out).cast("B"), self.dtype.itemsize, 0
        for start, length in zip((starts * itemsize).tolist(), (lengths * itemsize).tolist()):
            self.blocks.read_into(view[pos : pos + length], start)
            pos += length
        return out

    def prefetch_spans(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Start fetching the blocks that read_spans(starts, lengths) will need (token units), soonest first."""
        itemsize = self.dtype.itemsize
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        self.blocks.prefetch(self.blocks.blocks_of(starts * itemsize, lengths * itemsize))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of sequence i from token `offset` (as IndexedDataset.get)."""
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.read_spans(np.array([start]), np.array([n]))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def close(self) -> None:
        self.blocks.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteDataset, (self.prefix, self.config))

    def __repr__(self) -> str:
        return f"RemoteDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


# ---------------------------------------------------------------------------------------------------------------
# the local cache tier


class LocalCache:
    """Copies of datasets on fast local disk, shared by every process of a node, evicted LRU beyond a size cap.

    Example:
        >>> LocalCache("/nvme/cf-cache", max_bytes=200 << 30).fetch("s3://corpora/web_text_document")
        '/nvme/cf-cache/3f2a.../web_text_document'
    """

    def __init__(
        self, directory: str | os.PathLike, max_bytes: int | None = None, storage_options: Mapping | None = None
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.storage_options = dict(storage_options or {})

    def key(self, source: str) -> str:
        """The entry name of a source: the start of sha256 of its absolute location."""
        location = source if is_url(source) else os.path.abspath(source)
        return hashlib.sha256(location.encode()).hexdigest()[:16]

    def fetch(self, source: str, verify_sha256: bool = False) -> str:
        """The local prefix of a verified copy of `source`, copying it first if needed (one process per node).

        The copy may be evicted as soon as this returns; a reader that keeps using it takes `fetch_pinned`."""
        path, pin = self.fetch_pinned(source, verify_sha256)
        pin.close()
        return path

    def fetch_pinned(self, source: str, verify_sha256: bool = False) -> tuple[str, ReaderPin]:
        """`fetch`, plus a pin that keeps the copy from eviction until it is closed (or garbage-collected).

        The pin is a shared flock on `{key}.readers`, taken while the entry's lock is held, so no eviction can come
        between the check that the copy is complete and the pin; forked processes (DataLoader workers) share it.

        Example:
            >>> path, pin = LocalCache("/nvme/cf-cache", 200 << 30).fetch_pinned("s3://corpora/web_text_document")
            >>> ...                     # read path.bin / path.idx: no other process evicts them meanwhile
            >>> pin.close()
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        key, name = self.key(source), source.rstrip("/").rsplit("/", 1)[-1]
        final = self.directory / key
        sizes = self._source_sizes(source)
        with _flock(self.directory / f"{key}.lock"):
            if not self._complete(final, name, sizes):
                for stale in self.directory.glob(f".{key}.partial-*"):  # a killed copy: we hold the lock
                    shutil.rmtree(stale, ignore_errors=True)
                if final.exists():  # a copy of an older version of the source
                    if not self._remove_unread(key):
                        raise OSError(
                            f"{source} changed since it was copied to {final}, and running processes still read "
                            f"that copy; stop them first, or give this run another local_cache_dir"
                        )
                self._make_room(sum(sizes.values()), keep=key)
                self._copy(source, key, name, sizes)
            elif verify_sha256:
                self._verify_hashes(final, name)
            Path(self.directory / f"{key}.used").touch()
            pin = ReaderPin(self.directory / f"{key}.readers")
        return str(final / name), pin

    def _source_sizes(self, source: str) -> dict[str, int]:
        if is_url(source):
            fs = filesystem(source, self.storage_options)
            return {ext: int(fs.size(f"{source}.{ext}")) for ext in ("bin", "idx")}
        return {ext: os.path.getsize(f"{source}.{ext}") for ext in ("bin", "idx")}

    def _complete(self, final: Path, name: str, sizes: Mapping[str, int]) -> bool:
        meta = final / "meta.json"
        if not meta.is_file():
            return False
        recorded = json.loads(meta.read_text())
        on_disk = {ext: (final / f"{name}.{ext}").stat().st_size for ext in ("bin", "idx")}
        return recorded.get("sizes") == dict(sizes) == on_disk

    def _copy(self, source: str, key: str, name: str, sizes: Mapping[str, int]) -> None:
        """Copy to a partial directory, check it as a dataset, then rename it to its final name."""
        partial = self.directory / f".{key}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            hashes = {ext: self._copy_file(source, ext, partial / f"{name}.{ext}") for ext in ("idx", "bin")}
            copied = {ext: (partial / f"{name}.{ext}").stat().st_size for ext in ("bin", "idx")}
            if copied != dict(sizes):
                raise OSError(f"{source}: copied {copied} bytes, the source has {dict(sizes)}")
            IndexedDataset(partial / name).close()  # opening checks every length, pointer and document index
            meta = {"source": source, "sizes": dict(sizes), "sha256": hashes, "copied_at": time.time()}
            (partial / "meta.json").write_text(json.dumps(meta, indent=1))
            fsync_dir(partial)
            os.rename(partial, self.directory / key)
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _copy_file(self, source: str, ext: str, dest: Path, chunk: int = 64 * MiB) -> str:
        """Stream one file to `dest`, hashing on the way; fsync before it counts. Returns the sha256."""
        digest = hashlib.sha256()
        opener = filesystem(source, self.storage_options).open if is_url(source) else open
        with opener(f"{source}.{ext}", "rb") as src, open(dest, "wb") as out:
            while data := src.read(chunk):
                digest.update(data)
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
        return digest.hexdigest()

    def _verify_hashes(self, final: Path, name: str) -> None:
        recorded = json.loads((final / "meta.json").read_text())["sha256"]
        for ext, expected in recorded.items():
            digest = hashlib.sha256()
            with open(final / f"{name}.{ext}", "rb") as f:
                while data := f.read(64 * MiB):
                    digest.update(data)
            if digest.hexdigest() != expected:
                shutil.rmtree(final)
                raise OSError(f"{final}/{name}.{ext}: sha256 differs from the copy's record; removed, rerun to recopy")

    def entries(self) -> list[tuple[float, str, int]]:
        """(last use, key, bytes) of every complete entry, least recently used first."""
        out = []
        for meta in self.directory.glob("*/meta.json"):
            key = meta.parent.name
            used = self.directory / f"{key}.used"
            last = used.stat().st_mtime if used.exists() else meta.stat().st_mtime
            out.append((last, key, sum(json.loads(meta.read_text())["sizes"].values())))
        return sorted(out)

    def _make_room(self, needed: int, keep: str) -> None:
        """Evict least-recently-used entries that nobody reads until `needed` more bytes fit under the cap."""
        if self.max_bytes is None:
            return
        if needed > self.max_bytes:
            raise OSError(
                f"a dataset of {needed} bytes does not fit the local cache cap of {self.max_bytes} bytes "
                f"({self.directory}); raise local_cache_max_bytes or read it without the local cache"
            )
        entries = [e for e in self.entries() if e[1] != keep]
        used = sum(size for _, _, size in entries)
        busy = []
        for _, key, size in entries:
            if used + needed <= self.max_bytes:
                break
            if self._evict(key):
                used -= size
            else:
                busy.append(key)
        if used + needed > self.max_bytes:
            raise OSError(
                f"local cache {self.directory}: {needed} more bytes do not fit under its cap of {self.max_bytes}: "
                f"entries {busy} are being read or copied by running processes and are not evicted; raise "
                f"local_cache_max_bytes or wait for those processes to finish"
            )

    def _evict(self, key: str) -> bool:
        """Remove an entry unless another process copies it (holds its lock) or reads it (holds a pin)."""
        with _flock(self.directory / f"{key}.lock", blocking=False) as held:
            if not held:
                return False
            if not self._remove_unread(key):
                return False
            (self.directory / f"{key}.used").unlink(missing_ok=True)
            return True

    def _remove_unread(self, key: str) -> bool:
        """Remove entry `key` (its lock held by the caller) unless a reader pins it; whether it was removed."""
        with _flock(self.directory / f"{key}.readers", blocking=False) as unread:
            if not unread:
                return False
            doomed = self.directory / f".{key}.evicted-{os.getpid()}"
            os.rename(self.directory / key, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            return True


class ReaderPin:
    """A shared flock on a cache entry's `{key}.readers` file: while any process holds one, the entry stays.

    Closing it (or dropping it) closes the descriptor; the lock lasts while any copy of it is open, so a forked
    DataLoader worker keeps the entry pinned after its parent closed the dataset.

    Example:
        >>> pin = ReaderPin(Path("/nvme/cf-cache/3f2a9c.readers")); pin.close()
    """

    def __init__(self, path: Path) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # evictors only ever try LOCK_EX | LOCK_NB: never blocks long

    def close(self) -> None:
        # No LOCK_UN: that would release the lock for forked copies of this descriptor too.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path`; yields False (not held) when non-blocking and taken elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def with_read_mode(config: StorageConfig | None, read_mode: str) -> StorageConfig:
    """`config` with another read mode (benchmarks compare them).

    Example:
        >>> with_read_mode(None, "mmap").read_mode
        'mmap'
    """
    return replace(config or StorageConfig(), read_mode=read_mode)

"""The local variants of the reader seam (indexed.BinReader), and `open_reader`, the one place where a location
and a StorageConfig become a reader.

Read modes of a .bin on a mounted file system (local disk, Lustre, CephFS):

- "mmap-random" (indexed.MMapBinReader): the memory map, with madvise(MADV_RANDOM), so that a cold read costs the
  pages it touches and no read-ahead; from the page cache a compiled memcpy per span, no system call.
- "pread" (PreadBinReader): os.preadv per span, with posix_fadvise(RANDOM): the same pages, a system call per span
  (slower from the page cache; no mapping).
- "direct" (DirectBinReader): O_DIRECT reads in units of the device's logical block (512 B here) that never fill
  the page cache: for corpora larger than RAM, where each short document piece of a sample would otherwise cost
  whole 4 KiB pages (about 4x the sample bytes at 1000-token documents, against 1.4x).
- "mmap" (indexed.MMapBinReader): the kernel's default read-ahead, which on random access pulls up to the
  read-ahead window (128 KiB to 8 MiB, more on Lustre) per page fault and thrashes a corpus larger than RAM
  (~200x the sample bytes measured here); for comparison, and what a plain IndexedDataset uses.
- "auto" (default): one of the above, chosen when the dataset is opened (read_mode.py says how and why).

An fsspec URL gets remote.RemoteBinReader. Every read of these readers is recorded in readwatch (file, offset,
since when; its duration), so that a watchdog can name a read that hangs.

Example:
    >>> reader = open_reader("out/a_text_document.bin", np.dtype(np.uint16), StorageConfig(read_mode="pread"))
    >>> reader.read_spans(np.array([0, 10]), np.array([2, 2]))      # tokens 0, 1, 10, 11
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from corpusforge.fsutil import is_url
from corpusforge.indexed import BinReader, LocalBinReader, MMapBinReader, regular_file_size
from corpusforge.storage import readwatch
from corpusforge.storage.config import StorageConfig
from corpusforge.storage.read_mode import choose_read_mode, logical_block_size
from corpusforge.storage.remote import RemoteBinReader


class PreadBinReader(LocalBinReader):
    """The .bin read with os.preadv, a system call per span, read-ahead off.

    Example:
        >>> PreadBinReader(Path("out/a_text_document.bin"), np.dtype(np.uint16)).read(0, 3)
        array([  464,  2068, 50256], dtype=uint16)
    """

    flags = 0  # os.open flags beyond O_RDONLY
    default_read_mode = "pread"

    def _init_state(self) -> None:
        self._fd: int | None = None
        self._fd_pid = -1

    def _file(self) -> int:
        # One descriptor per process: a DataLoader worker forked from us opens its own rather than depend on one
        # the parent may close.
        if self._fd is None or self._fd_pid != os.getpid():
            self._fd, self._fd_pid = os.open(self.location, os.O_RDONLY | self.flags), os.getpid()
            # Random access: no read-ahead (the kernel would read up to read_ahead_kb around every miss).
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        return self._fd

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        itemsize = self.dtype.itemsize
        return self._read_into(self._file(), starts * itemsize, lengths * itemsize, out)

    def _read_into(self, fd: int, starts: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> np.ndarray:
        view, pos = memoryview(out).cast("B"), 0
        if not len(starts):
            return out
        t0 = readwatch.begin(self.location, int(starts[0]), len(out) * self.dtype.itemsize)  # a watchdog sees it
        try:
            for start, length in zip(starts.tolist(), nbytes.tolist()):
                readwatch.advance(start)
                got = os.preadv(fd, [view[pos : pos + length]], start)
                if got != length:  # a short read only at end of file: the .bin shrank under us
                    raise OSError(f"{self.location}: read {got} of {length} bytes at offset {start}")
                pos += length
        finally:
            readwatch.end(t0)
        return out

    def close(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None


class DirectBinReader(PreadBinReader):
    """The .bin read with O_DIRECT: each span widened to whole logical blocks of the device, read into one aligned
    buffer, then cut out; the page cache is neither read nor filled.

    Example:
        >>> DirectBinReader(Path("/lustre/big_text_document.bin"), np.dtype(np.uint16)).read(0, 3)
    """

    flags = os.O_DIRECT
    default_read_mode = "direct"

    def _init_state(self) -> None:
        super()._init_state()
        self._align = logical_block_size(self.location)

    def _read_into(self, fd: int, starts: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> np.ndarray:
        if not len(starts):  # no read to mark (load_kernels reads no sample, on a thread beside others' reads)
            return out
        a = self._align
        lo = starts // a * a
        hi = -(-(starts + nbytes) // a) * a
        sizes = hi - lo
        buffer = mmap.mmap(-1, max(int(sizes.sum()), a))  # page-aligned, as O_DIRECT wants
        view, pos = memoryview(buffer), 0
        t0 = readwatch.begin(self.location, int(lo[0]) if len(lo) else 0, int(sizes.sum()))
        try:
            for offset, size in zip(lo.tolist(), sizes.tolist()):
                readwatch.advance(offset)
                got = os.preadv(fd, [view[pos : pos + size]], offset)
                if got < size and offset + got < min(offset + size, self.nbytes):
                    raise OSError(f"{self.location}: read {got} of {size} bytes at offset {offset}")
                pos += size
        finally:
            readwatch.end(t0)
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


LOCAL_READERS: dict[str, type[BinReader]] = {
    "mmap": MMapBinReader,
    "mmap-random": MMapBinReader,
    "pread": PreadBinReader,
    "direct": DirectBinReader,
}


def open_reader(
    location: str | os.PathLike,
    dtype: np.dtype,
    config: StorageConfig,
    fs: Any = None,
    choice: tuple[str, str] | None = None,
    nbytes: int | None = None,
) -> BinReader:
    """The reader of the .bin at `location` (a path or an fsspec URL) under `config`; "auto" resolved here, from
    the file as it is now, so call this before anything reads the .bin (validation's token sample caches pages).
    `fs`: the fsspec file system that fetched the .idx, reused for a URL. `choice`: the (mode, reason) "auto" has
    already resolved to (read_mode.choose_read_modes, for a blend), and `nbytes` the size of the .bin, where the
    caller has them.

    Example:
        >>> open_reader("out/a_text_document.bin", np.dtype(np.uint16), StorageConfig()).read_mode
        'mmap-random'
    """
    if is_url(location):
        return RemoteBinReader(os.fspath(location), dtype, config, fs)
    location = os.fspath(location)
    if nbytes is None:
        nbytes = regular_file_size(location)
    if choice is not None:
        mode, reason = choice
    elif config.read_mode == "auto":
        mode, reason = choose_read_mode(location, config, nbytes)
    else:
        mode, reason = config.read_mode, "configured"
    return LOCAL_READERS[mode](location, dtype, mode, reason, nbytes)

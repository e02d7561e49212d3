"""The Megatron-Core MMap indexed dataset: tokens in `{prefix}.bin`, their index in `{prefix}.idx`.

Writer, reader, merge and validation live here together, so whoever changes one side sees the other.
The layout is byte for byte what `megatron.core.datasets.indexed_dataset` writes and reads.

`{prefix}.idx`, little-endian:

    offset      size      field
    0           9         magic b"MMIDIDX\\x00\\x00"
    9           8   <Q    version, always 1
    17          1   <B    dtype code of the tokens (see DTYPE_CODES)
    18          8   <Q    S, the number of sequences
    26          8   <Q    D, the number of document indices (documents + 1)
    34          4*S int32 sequence lengths, in tokens
    34+4S       8*S int64 sequence pointers: byte offset of each sequence in the .bin
    34+12S      8*D int64 document indices: the first sequence of each document; starts at 0, ends at S
   (34+12S+8D   1*S int8  sequence modes: only in Megatron's multimodal datasets)

`{prefix}.bin` holds the tokens of every sequence back to back, with no header.

A document is one or more sequences (Megatron splits documents into sentences when asked);
corpusforge's preprocess writes one sequence per document.

Opening a dataset validates it (Megatron-Core reads whatever it is given): the header, the file sizes, every length
non-negative, every pointer equal to the exclusive prefix sum of the lengths times the token size, the last sequence
ending exactly at the end of the .bin, document indices from 0 to S without going back; vectorised, about 1.2 s per
1e8 sequences from the page cache on a busy 2-core machine, and when the .idx is cold no more than reading it once
(benchmarks/index_validation.py). A dtype code changed to another of the same width moves no pointer: it is caught
by the dtype `corpusforge preprocess` recorded in P.preprocess.json, where there is one, and by a sample of tokens
that are no valid ids under the changed dtype (negative, or a float that is not an integer).

Example:
    >>> with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as w:
    ...     w.add_document(np.array([464, 2068, 50256]))
    >>> IndexedDataset("out/corpus_text_document")[0]
    array([  464,  2068, 50256], dtype=uint16)
"""

from __future__ import annotations

import errno
import functools
import glob
import json
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.errors import ArgumentError, CorpusforgeError
from corpusforge.fsutil import check_writable, fsync_dir, fsync_path, naming

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34

# Megatron-Core's DType enum; the codes are part of the file format.
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedFormatError(CorpusforgeError, ValueError):
    """An .idx/.bin pair that is not a valid Megatron MMap indexed dataset."""


class DatasetNotFoundError(CorpusforgeError, FileNotFoundError):
    """No dataset under a prefix: a file of the pair is missing (require_pair says which, and what to do)."""


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def exists(prefix: str | os.PathLike) -> bool:
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def best_dtype(vocab_size: int | None) -> type[np.number]:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500 ids, else int32.

    Example: best_dtype(50257) -> np.uint16; best_dtype(100277) -> np.int32
    """
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype: np.dtype | type) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(
            f"dtype {np.dtype(dtype)} has no Megatron code; use one of {sorted(map(str, _CODE_OF))}"
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# writing


def sync(prefix: str | os.PathLike) -> None:
    """fsync a finished dataset's .bin, .idx and directory: what `finalize(durable=False)` left to the caller."""
    for path in (bin_path(prefix), idx_path(prefix)):
        fsync_path(path)
    fsync_dir(bin_path(prefix).parent)


def _mergeable_source(prefix: str | os.PathLike | IndexedDataset, dtype: np.dtype) -> IndexedDataset:
    """Open a dataset to be appended to an output of `dtype` (or take one opened already), checked.

    The output's pointers are recomputed from the lengths: an input whose pointers disagree with its lengths would
    come out silently different from what it reads as; opening validates it (O(S), cheap next to the copy)."""
    src = prefix if isinstance(prefix, IndexedDataset) else IndexedDataset(prefix)
    if src.dtype != dtype:
        raise IndexedFormatError(
            f"{src.prefix}: tokens are {src.dtype} but the output is {dtype}; "
            "datasets made with different tokenizers cannot be merged"
        )
    return src


def write_index(
    path: str | os.PathLike,
    dtype: np.dtype | type,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
    durable: bool = True,
) -> None:
    """Write an .idx file at `path` (not atomically: callers write to a temporary name)."""
    lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int32)
    pointers = sequence_pointers(lengths, np.dtype(dtype).itemsize)
    doc_idx = np.ascontiguousarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(memoryview(lengths))
        f.write(memoryview(pointers))
        f.write(memoryview(doc_idx))
        if sequence_modes is not None:
            f.write(memoryview(np.ascontiguousarray(sequence_modes, dtype=np.int8)))
        f.flush()
        if durable:
            os.fsync(f.fileno())


def sequence_pointers(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence: the exclusive prefix sum of lengths, times the token size."""
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    return pointers


def _finish_pair(prefix: str, bin_fd: int, write_idx: Callable[[Path], None], durable: bool) -> None:
    """The end of every writer of a pair: fsync (when `durable`) and close the `.bin.tmp` open as `bin_fd`, write
    the `.idx.tmp` with `write_idx(path)`, and commit both under `prefix` (publish_pair). The caller discards its
    temporary files if this raises."""
    bin_tmp, idx_tmp = Path(f"{bin_path(prefix)}.tmp"), Path(f"{idx_path(prefix)}.tmp")
    with naming(bin_path(prefix), bin_tmp):
        try:
            if durable:
                os.fsync(bin_fd)
        finally:
            os.close(bin_fd)
    with naming(idx_path(prefix), idx_tmp):
        write_idx(idx_tmp)
    publish_pair(bin_tmp, idx_tmp, prefix, durable)


def publish_pair(
    bin_tmp: str | os.PathLike, idx_tmp: str | os.PathLike, prefix: str | os.PathLike, durable: bool = True
) -> None:
    """Commit a finished, fsynced pair under `prefix.bin/.idx`, replacing an older pair: the one commit of every
    writer of a pair (a writer, merge, preprocess, the Megatron drop-in). Two renames cannot be atomic together, so
    the .idx is the commit point:

        1. unlink the old .idx (and fsync the directory): no old .idx can ever pair with the new .bin
        2. rename the .bin
        3. rename the .idx, last
        4. fsync the directory (unless `durable=False`)

    A kill between 1 and 3 leaves a .bin without its .idx (or nothing, for a new dataset), which no reader opens as
    a dataset (require_pair: "an interrupted ..."), and which a rerun (preprocess: --resume) completes or replaces.
    So any .idx under the final name is the one written with the .bin beside it. Repeatable: a commit resumed after
    step 2 (`bin_tmp` gone, the final .bin there) goes on with step 3.

    Example: publish_pair("out/c.bin.tmp", "out/c.idx.tmp", "out/c")
    """
    final_bin, final_idx = bin_path(prefix), idx_path(prefix)
    with naming(final_idx, idx_tmp):
        if final_idx.exists() or final_idx.is_symlink():
            final_idx.unlink()
            if durable:  # the unlink reaches the disk before the new .bin does, even across a power cut
                fsync_dir(final_idx.parent)
    if os.path.lexists(bin_tmp) or not final_bin.exists():
        with naming(final_bin, bin_tmp):
            os.replace(bin_tmp, final_bin)
    with naming(final_idx, idx_tmp):
        os.replace(idx_tmp, final_idx)
        if durable:
            fsync_dir(final_idx.parent)


class IndexedDatasetWriter:
    """Writes `{prefix}.bin/.idx`; nothing exists under those names until `finalize()` succeeds.

    Tokens go to `{prefix}.bin.tmp` as they come; `finalize()` fsyncs it, writes `{prefix}.idx.tmp`, and
    renames both. Used as a context manager, an exception discards the temporary files.

    Example:
        >>> with IndexedDatasetWriter("out/x_text_document", np.int32) as w:
        ...     w.add_documents(np.array([1, 2, 3, 4, 5]), np.array([2, 3]))   # two documents
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # refuse a dtype Megatron cannot name before writing anything
        self._bin_final, self._idx_final = bin_path(prefix), idx_path(prefix)
        self._bin_tmp = Path(f"{self._bin_final}.tmp")
        self._idx_tmp = Path(f"{self._idx_final}.tmp")
        with naming(self._bin_final, self._bin_tmp):  # a read-only or forbidden place names the final .bin
            self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/discard
        self._lengths: list[np.ndarray] = []  # chunks of int32 sequence lengths
        self._doc_starts: list[np.ndarray] = []  # chunks of int64 document start indices
        self._pending_lengths: list[int] = []  # add_item() sequences of the open document
        self.num_sequences = 0
        self.num_tokens = 0
        self.finalized = False

    # -- adding data -------------------------------------------------------------------------------------------

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: `tokens` is their concatenation, `lengths` their sizes."""
        self._check_open()
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        self._write_tokens(tokens)
        self._doc_starts.append(self.num_sequences + np.arange(len(lengths), dtype=np.int64))
        self._lengths.append(lengths.astype(np.int32))
        self.num_sequences += len(lengths)

    def add_document(self, tokens: np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """Append one document; `lengths` splits it into several sequences (sentences), default one."""
        tokens = np.asarray(tokens)
        self.add_documents_with_sequences(tokens, [len(tokens)] if lengths is None else lengths)

    def add_documents_with_sequences(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        self._check_open()
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())} but the document has {len(tokens)} tokens")
        self._write_tokens(tokens)
        self._doc_starts.append(np.array([self.num_sequences], dtype=np.int64))
        self._lengths.append(lengths.astype(np.int32))
        self.num_sequences += len(lengths)

    def add_dataset(self, prefix: str | os.PathLike) -> None:
        """Append every document of an existing dataset, copying its .bin at disk speed (no re-tokenizing)."""
        self._check_open()
        src = _mergeable_source(prefix, self.dtype)
        with naming(self._bin_final, self._bin_tmp), open(src.bin_path, "rb") as f:
            self._bin.flush()
            copy_bytes(f.fileno(), self._bin.fileno(), src.num_tokens * self.dtype.itemsize, None, str(src.bin_path))
        self._lengths.append(src.sequence_lengths.copy())
        self._doc_starts.append(src.document_indices[:-1] + self.num_sequences)
        self.num_sequences += len(src)
        self.num_tokens += src.num_tokens
        src.close()

    def start_writeback(self) -> None:
        """Ask the kernel to start writing what is buffered to disk, without waiting, so that `finalize()`'s
        fsync finds little left to do. Linux only; elsewhere a no-op."""
        self._bin.flush()
        _start_writeback(self._bin.fileno())

    def _write_tokens(self, tokens: np.ndarray) -> None:
        if tokens.dtype != self.dtype:
            tokens = _cast_tokens(tokens, self.dtype)
        with naming(self._bin_final, self._bin_tmp):  # a full disk names the final .bin
            self._bin.write(memoryview(np.ascontiguousarray(tokens)))
        self.num_tokens += len(tokens)

    def _check_open(self) -> None:
        if self.finalized or self._bin.closed:
            raise RuntimeError(f"{self.prefix}: writer is already finalized or discarded")

    # -- finishing ---------------------------------------------------------------------------------------------

    def finalize(self, durable: bool = True) -> Path:
        """Make the dataset visible under its final names, and durable (fsync) unless `durable=False`, for a
        caller that syncs later itself (see `sync`); returns the prefix as a Path."""
        self._check_open()
        try:
            with naming(self._bin_final, self._bin_tmp):
                self._bin.flush()
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
            starts = np.concatenate(self._doc_starts) if self._doc_starts else np.zeros(0, np.int64)
            doc_idx = np.append(starts, np.int64(self.num_sequences))
            # The descriptor goes to _finish_pair, which closes it; the file object must not close it again.
            fd = os.dup(self._bin.fileno())
            self._bin.close()
            _finish_pair(self.prefix, fd, lambda tmp: write_index(tmp, self.dtype, lengths, doc_idx, durable=durable),
                         durable)  # fmt: skip
        except BaseException:
            self.discard()  # e.g. disk full while writing the .idx: leave no .tmp files behind
            raise
        self.finalized = True
        return Path(self.prefix)

    def discard(self) -> None:
        """Drop everything written so far; the final names are left untouched."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.finalized:
            self.finalize()
        elif exc_type is not None:
            self.discard()


def _start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing `nbytes` from `offset` (0, 0: the whole file) to disk, without waiting."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
            _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, don't wait


_sync_file_range = None


def _cast_tokens(tokens: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast token ids to the dataset's dtype, refusing ids that would wrap around.

    Between integer types of one size (a tokenizer's uint32 into int32) a view does it without a copy,
    since the bits of every id that fits are the same."""
    if not tokens.size or not np.issubdtype(dtype, np.integer):
        return tokens.astype(dtype, copy=False)
    info = np.iinfo(dtype)
    hi = int(tokens.max())
    lo = int(tokens.min()) if np.issubdtype(tokens.dtype, np.signedinteger) else 0
    if lo < info.min or hi > info.max:
        raise ValueError(f"token id {hi if hi > info.max else lo} does not fit the dataset dtype {dtype}")
    if np.issubdtype(tokens.dtype, np.integer) and tokens.dtype.itemsize == dtype.itemsize:
        return np.ascontiguousarray(tokens).view(dtype)
    return tokens.astype(dtype)


def copy_bytes(src: int, dst: int, nbytes: int, at: int | None, name: str) -> None:
    """Copy the first `nbytes` of the file open as `src` to `dst`: at byte `at` of it, or, with `at=None`, at its
    file position (appending). In the kernel (copy_file_range) where it can, else pread and pwrite/write; the
    source's file position never moves, so concurrent placements into one output do not collide. A source
    shorter than `nbytes` is an IndexedFormatError naming it (`name`).

    Example:
        >>> copy_bytes(src_fd, out_fd, 40960, 81920, "parts/part-00001_text_document.bin")
    """
    copied = 0
    try:
        while copied < nbytes:
            n = os.copy_file_range(src, dst, nbytes - copied, copied, None if at is None else at + copied)
            if n == 0:
                break
            copied += n
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        # EXDEV (another file system, old kernels), EINVAL/EOPNOTSUPP (FUSE, some network file systems): copy here
    while copied < nbytes:
        chunk = os.pread(src, min(16 << 20, nbytes - copied), copied)
        if not chunk:
            raise IndexedFormatError(f"{name}: {copied} bytes, shorter than the {nbytes} its index promises")
        view = memoryview(chunk)
        while view:
            n = os.write(dst, view) if at is None else os.pwrite(dst, view, at + copied)
            view, copied = view[n:], copied + n


# ---------------------------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequence_count: int
    document_count: int


REBUILD = "the index is corrupt: rebuild the dataset (re-run `corpusforge preprocess`, or `corpusforge merge`)"
"""The fix every message about an inconsistent index ends with: nothing in a corrupt .idx can be trusted to repair."""


def read_header(path: str | os.PathLike) -> IndexHeader:
    """Read and check the fixed 34-byte header of an .idx file."""
    path = Path(path)
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_SIZE), str(path))


def parse_header(head: bytes, where: str) -> IndexHeader:
    """Check the first 34 bytes of an .idx (`where` names it in the error) and return what they say."""
    if head[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        raise IndexedFormatError(
            f"{where}: this is the legacy (TNTIDX, lazy/cached) indexed format; "
            "convert it with `corpusforge convert PREFIX --output-prefix NEW`"
        )
    if len(head) < len(MAGIC) and MAGIC.startswith(head):  # cut inside the magic, or empty
        raise IndexedFormatError(f"{where}: truncated header ({len(head)} of {HEADER_SIZE} bytes); {REBUILD}")
    if head[: len(MAGIC)] != MAGIC:
        raise IndexedFormatError(f"{where}: not a Megatron MMap index (magic {head[:9]!r}, expected {MAGIC!r})")
    if len(head) < HEADER_SIZE:
        raise IndexedFormatError(f"{where}: truncated header ({len(head)} of {HEADER_SIZE} bytes); {REBUILD}")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise IndexedFormatError(f"{where}: index version {version}, only version {VERSION} exists; {REBUILD}")
    (code,) = struct.unpack_from("<B", head, 17)
    if code not in DTYPE_CODES:
        raise IndexedFormatError(f"{where}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); {REBUILD}")
    seq_count, doc_count = struct.unpack_from("<QQ", head, 18)
    return IndexHeader(np.dtype(DTYPE_CODES[code]), seq_count, doc_count)


def check_index_size(where: str, size: int, header: IndexHeader) -> bool:
    """Check an .idx of `size` bytes against the counts of its header; True when it holds sequence modes."""
    s, d = header.sequence_count, header.document_count
    expected = HEADER_SIZE + 12 * s + 8 * d
    if size not in (expected, expected + s):  # + s: the int8 sequence modes of multimodal datasets
        raise IndexedFormatError(
            f"{where}: {size} bytes, but its header promises {s} sequences and {d} document "
            f"indices ({expected} bytes); the file is truncated or corrupt: rebuild the dataset"
        )
    return size > expected


INDEX_READ_WHOLE_BYTES = 1 << 16
"""An .idx up to this size is read into memory with one pread (~6 us for 4 KiB) rather than memory-mapped (~14 us
with mmap.mmap, ~24 us with np.memmap): a blend opens thousands of small ones, and 2,500 of 64 KiB hold 160 MB at
most; a larger .idx is mapped, so its pages are shared with the page cache and memory stays bounded."""


@dataclass(frozen=True)
class OpenedIndex:
    """An .idx read or mapped, its header parsed and its size checked against the header.

    `buffer` holds the whole file (bytes, or a read-only mmap); `name` is how messages name the file.

    Example:
        >>> opened = open_index("out/a_text_document")
        >>> opened.header.sequence_count, len(opened.buffer)
        (1000, 20042)
    """

    header: IndexHeader
    buffer: Any
    has_modes: bool
    name: str

    @classmethod
    def from_bytes(cls, index: Any, name: str) -> OpenedIndex:
        """An .idx already in memory (read here, or fetched from a URL); `name` names it in messages."""
        header = parse_header(bytes(index[:HEADER_SIZE]), name)
        return cls(header, index, check_index_size(name, len(index), header), name)


def open_index(prefix: str | os.PathLike) -> OpenedIndex:
    """Open and check the header and size of the local `{prefix}.idx`: one open, one fstat, one pread (small files,
    INDEX_READ_WHOLE_BYTES) or one mmap; a missing .idx, or one that is no regular file, is require_pair's
    FileNotFoundError.

    Example:
        >>> open_index("out/a_text_document").header.dtype
        dtype('uint16')
    """
    path = f"{os.fspath(prefix)}.idx"
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        require_pair(os.fspath(prefix), "a dataset")
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            require_pair(os.fspath(prefix), "a dataset")
        name, size = str(Path(path)), info.st_size
        if size <= INDEX_READ_WHOLE_BYTES:
            buffer = _pread_all(fd, size)
        else:
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # the mapping keeps the file: fd closes below
    finally:
        os.close(fd)
    return OpenedIndex.from_bytes(buffer, name)


def _pread_all(fd: int, size: int) -> bytes:
    """The first `size` bytes of the file open as `fd`; fewer only where the file is shorter now."""
    data = os.pread(fd, size, 0)
    while len(data) < size:  # a short read of a regular file is rare (signals, some network file systems)
        more = os.pread(fd, size - len(data), len(data))
        if not more:
            break
        data += more
    return data


# ---------------------------------------------------------------------------------------------------------------
# validation: every consumer opens a dataset through IndexedDataset, whatever its reader (local files, fsspec URLs),
# which calls check_index(), so a loader, the trainer, build-knn and merge all refuse the same faults, at open.

CHECK_CHUNK = 1 << 14
"""Elements per step of check_index: its 128 KiB int64 buffers stay in cache (at 1e8 sequences: 0.6 s, against 5 s
for whole-array temporaries, an 800 MB cumsum among them), and it needs no memory that grows with S. Larger buffers
are fresh pages (malloc maps them) at each open: for 48k sequences 0.59 ms with 1 << 16 (384 KiB buffers, sized to
the data), 0.44 ms with 1 << 15, 0.10 ms with 1 << 14, 0.13 ms with 1 << 13; at 1e7 sequences 18.2, 17.0, 18.7 and
23.4 ms (2026-11-26, load ~2); 2 MiB buffers (1 << 18) were 0.48 ms at 48k and 17.6 ms at 1e7."""

SAMPLE_TOKENS = 4096
"""Tokens read from each of the start, middle and end of the .bin to catch a dtype code changed to another of the
same width (e.g. uint16 -> int16, int32 -> float32): 48 KiB of int32, a few pages."""


def check_index(
    where: str,
    dtype: np.dtype,
    lengths: np.ndarray,
    pointers: np.ndarray,
    document_indices: np.ndarray,
    bin_bytes: int,
    bin_name: str,
    full: bool = True,
) -> None:
    """Refuse an index that does not describe its .bin; `full=False` checks only the ends, in O(1).

    The full check is vectorised numpy over the three arrays in chunks of CHECK_CHUNK, O(S + D) with O(1) memory:
    every length non-negative, every pointer the byte offset the lengths before it give (Megatron's MMap pointers
    are byte offsets: the exclusive prefix sum of lengths times the token size), the last sequence ending exactly
    at the end of the .bin, document indices from 0 to S without going back. `where` (the .idx) and `bin_name`
    name the files in the one-line IndexedFormatError.

    Example:
        >>> check_index("a.idx", np.dtype(np.int32), np.array([3, 2], np.int32), np.array([0, 12]),
        ...             np.array([0, 1, 2]), 20, "a.bin")        # passes: 5 tokens of 4 bytes
    """
    s, itemsize, doc = len(lengths), np.dtype(dtype).itemsize, document_indices
    if len(doc) == 0 or doc[0] != 0 or doc[-1] != s:
        raise IndexedFormatError(
            f"{where}: document indices must run from 0 to the sequence count {s}, "
            f"found {doc[:1].tolist()}..{doc[-1:].tolist()}; {REBUILD}"
        )
    if s and pointers[0] != 0:
        raise IndexedFormatError(f"{where}: first sequence pointer is {int(pointers[0])}, not 0; {REBUILD}")
    end = int(pointers[-1]) + int(lengths[-1]) * itemsize if s else 0
    if end != bin_bytes:
        raise IndexedFormatError(
            f"{where}: the index covers {end} bytes of tokens but {bin_name} has {bin_bytes}; the .bin and .idx "
            "do not belong together, or one is truncated: rebuild the dataset (re-run preprocess or merge)"
        )
    if not full:
        return
    fault = _first_length_or_pointer_fault(lengths, pointers, itemsize)
    if fault is not None and fault[0] == "length":
        i = fault[1]
        raise IndexedFormatError(f"{where}: negative sequence length at {i} ({int(lengths[i])} tokens); {REBUILD}")
    if fault is not None:
        i = fault[1]
        expected = int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize
        raise IndexedFormatError(
            f"{where}: sequence {i} points at byte {int(pointers[i])}, but the lengths before it put it at "
            f"{expected}; {REBUILD}"
        )
    i = _first_decrease(doc)
    if i is not None:
        raise IndexedFormatError(
            f"{where}: document indices decrease at {i} ({int(doc[i])} then {int(doc[i + 1])}); {REBUILD}"
        )


def _first_length_or_pointer_fault(lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> tuple[str, int] | None:
    """("length", i) for a negative lengths[i], or ("pointer", i) for the first i >= 1 with
    pointers[i] - pointers[i-1] != lengths[i-1] * itemsize; None when there is neither. One pass, chunk by chunk.

    With pointers[0] == 0 (checked before) the pointer test is exactly "pointers == the exclusive prefix sum of
    lengths * itemsize", without an O(S) cumsum temporary; the sign test reads each chunk of lengths while it is
    in cache for the pointer test, rather than in a pass of its own."""
    s = len(lengths)
    n = max(1, min(CHECK_CHUNK, s - 1))  # no larger than the data: a small dataset touches few fresh pages
    gap, size, bad = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, bool)
    for lo in range(0, s - 1, CHECK_CHUNK):
        k = min(CHECK_CHUNK, s - 1 - lo)
        chunk = lengths[lo : lo + k]
        if chunk.min() < 0:
            return "length", lo + int(np.argmax(chunk < 0))
        np.subtract(pointers[lo + 1 : lo + 1 + k], pointers[lo : lo + k], out=gap[:k])
        np.multiply(chunk, itemsize, out=size[:k], dtype=np.int64)
        np.not_equal(gap[:k], size[:k], out=bad[:k])
        if bad[:k].any():
            return "pointer", lo + 1 + int(np.argmax(bad[:k]))
    if s and lengths[-1] < 0:  # the last length has no pointer after it: only its sign is left to check
        return "length", s - 1
    return None


def _first_decrease(doc: np.ndarray) -> int | None:
    """The first i with doc[i + 1] < doc[i], or None."""
    bad = np.empty(max(1, min(CHECK_CHUNK, len(doc) - 1)), bool)
    for lo in range(0, len(doc) - 1, CHECK_CHUNK):
        k = min(CHECK_CHUNK, len(doc) - 1 - lo)
        np.less(doc[lo + 1 : lo + 1 + k], doc[lo : lo + k], out=bad[:k])
        if bad[:k].any():
            return lo + int(np.argmax(bad[:k]))
    return None


def read_token_sample(path: str | os.PathLike, dtype: np.dtype, n: int = SAMPLE_TOKENS) -> tuple[np.ndarray, ...]:
    """Up to `n` tokens from each of the start, middle and end of the token file `path`, and their positions.

    Read with pread and POSIX_FADV_RANDOM, not through the memory map: a fault on a cold map pulls in the kernel's
    read-ahead window around it (megabytes), where this reads the few pages asked for."""
    dtype = np.dtype(dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size // dtype.itemsize
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        starts = sorted({0, max(0, total // 2 - n // 2), max(0, total - n)})
        ends = [min(a + n, total) for a in starts]
        reads = [os.pread(fd, (b - a) * dtype.itemsize, a * dtype.itemsize) for a, b in zip(starts, ends)]
    finally:
        os.close(fd)
    sample = np.frombuffer(b"".join(reads), dtype)
    positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
    return sample, positions[: len(sample)]  # shorter only if the file shrank while it was read


def check_token_sample(where: str, sample: np.ndarray, positions: np.ndarray) -> None:
    """Refuse tokens that are no token id under the index's dtype: negative, or for a float dtype not an integer.

    This is what catches a dtype code changed to another of the same width, which moves no pointer: uint16 ids of
    32768 and up read as negative int16, int32 ids read as float32 are denormals (1 -> 1.4e-45). It cannot catch a
    change the other way round (int16 -> uint16, float -> int) nor uint16 -> int16 when every id is below 32768:
    there the bytes read the same under both codes (see check_recorded_dtype for what P.preprocess.json adds)."""
    dtype = sample.dtype
    if not len(sample) or np.issubdtype(dtype, np.unsignedinteger):
        return
    if np.issubdtype(dtype, np.floating):
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(sample) | (sample < 0) | (sample != np.floor(sample))
    else:
        bad = sample < 0
    if bad.any():
        k = int(np.argmax(bad))
        raise IndexedFormatError(
            f"{where}: token {int(positions[k])} of the .bin reads as {sample[k].item()!r} under the index's dtype "
            f"{dtype}, which is no token id (ids are non-negative integers): the dtype code does not match the .bin; "
            f"{REBUILD}"
        )


def preprocess_summary(prefix: str | os.PathLike) -> tuple[Path, str] | None:
    """`P.preprocess.json` of a dataset `P_{key}_document` that `corpusforge preprocess` wrote, and the key; or None.

    Example: preprocess_summary("out/tiny_text_document") -> (PosixPath('out/tiny.preprocess.json'), 'text')
    """
    directory, name = os.path.split(os.fspath(prefix))
    stem = name.removesuffix("_document")
    if stem == name:
        return None
    # The key may itself hold underscores ("raw_text"): try every split; one stat per underscore of the name (on
    # strings: a blend asks this of thousands of datasets, and Path objects cost more than the stats).
    for i, ch in enumerate(stem):
        if ch != "_" or i == 0:
            continue
        path = os.path.join(directory, f"{stem[:i]}.preprocess.json")
        if os.path.isfile(path):
            return Path(path), stem[i + 1 :]
    return None


def check_recorded_dtype(prefix: str | os.PathLike, where: str, header_dtype: np.dtype) -> None:
    """Refuse a dataset whose dtype differs from the one `corpusforge preprocess` recorded writing it.

    The one exact signal against a dtype code changed to another of the same width; absent for datasets written
    by other tools or merged (no P.preprocess.json), and a summary that cannot be read is ignored: it is a hint
    about the data, not the data."""
    found = preprocess_summary(prefix)
    if found is None:
        return
    path, key = found
    try:
        summary = json.loads(path.read_text())
        if key not in summary["config"]["json_keys"]:
            return
        recorded = np.dtype(summary["stats"]["dtype"])
    except (OSError, ValueError, TypeError, KeyError):
        return
    if recorded != header_dtype:
        raise IndexedFormatError(
            f"{where}: dtype code {_CODE_OF.get(np.dtype(header_dtype))} ({header_dtype}), but {path.name} records "
            f"that preprocess wrote {recorded} tokens; {REBUILD}"
        )


# ---------------------------------------------------------------------------------------------------------------
# the reader seam: how the tokens of a .bin are read


def require_pair(prefix: str, what: str) -> None:
    """The one resolver of a dataset prefix that holds no dataset: raise DatasetNotFoundError (a FileNotFoundError)
    saying why, in one line (`what` the pair is: "a dataset", "a legacy dataset"):

    - a .bin without its .idx: a commit that was interrupted (publish_pair: the .idx comes last), never a dataset;
    - nothing there, but datasets that preprocess names `{prefix}_{key}_document` (or `_sentence`): those, as the
      prefix meant (`out/tiny` for `out/tiny_text_document`);
    - otherwise the first of `{prefix}.idx`, `{prefix}.bin` that is missing.

    Example:
        >>> require_pair("out/tiny", "a dataset")
        DatasetNotFoundError: no dataset at out/tiny; did you mean out/tiny_text_document?
    """
    idx, bin_ = idx_path(prefix), bin_path(prefix)
    if idx.is_file() and bin_.is_file():
        return
    if bin_.is_file() and what == "a dataset":  # (a legacy dataset was written by another tool)
        raise DatasetNotFoundError(
            f"{bin_} has no .idx: a preprocess or merge writing it was interrupted (the .idx is written last); "
            "rerun it (preprocess with --resume) to complete or replace it"
        )
    if not idx.exists():
        meant = dataset_names_under(prefix)
        if meant:
            listed = meant[0] if len(meant) == 1 else "one of " + ", ".join(meant)
            raise DatasetNotFoundError(f"no dataset at {prefix}; did you mean {listed}?")
    missing = idx if not idx.is_file() else bin_
    raise DatasetNotFoundError(f"{missing}: no such file ({what} is the pair {prefix}.bin/.idx)")


def dataset_names_under(prefix: str | os.PathLike) -> list[str]:
    """The datasets a prefix given to preprocess names: `{prefix}_{key}_document` and `{prefix}_{key}_sentence`
    pairs (Megatron's naming), and `{prefix}` itself when it was given with its .bin/.idx extension; sorted.

    Example: dataset_names_under("out/tiny") -> ['out/tiny_text_document']
    """
    text = os.fspath(prefix)
    found = {
        p.removesuffix(".idx")
        for kind in ("document", "sentence")
        for p in glob.glob(f"{glob.escape(text)}_*_{kind}.idx")
        if os.path.isfile(p[: -len(".idx")] + ".bin")
    }
    stem, ext = os.path.splitext(text)
    if ext in (".bin", ".idx") and exists(stem):
        found.add(stem)
    return sorted(found)


class BinReader:
    """How the tokens of one .bin are read (Megatron-Core's _BinReader): one interface, whose variants are this
    module's memory map and corpusforge.storage's pread, O_DIRECT and remote block reads, chosen in one place
    (`storage.open_dataset`). Offsets and lengths are in tokens.

    `memory` is the token array samples may be copied from directly (a memory map), or None where reads go
    through `read_spans`; `nbytes` the size of the .bin; `name` how messages name it.

    Example:
        >>> reader = MMapBinReader(Path("out/a_text_document.bin"), np.dtype(np.uint16))
        >>> reader.read_spans(np.array([0, 10]), np.array([2, 2]))        # tokens 0, 1, 10, 11
    """

    read_mode = "mmap"
    read_mode_reason = "configured"
    remote = False
    memory: np.ndarray | None = None

    def __init__(self, location: str | os.PathLike, dtype: np.dtype, nbytes: int) -> None:
        self.location, self.dtype, self.nbytes = location, np.dtype(dtype), nbytes
        self.name = os.path.basename(os.fspath(location))

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [starts[k], starts[k] + lengths[k]) for every k, concatenated."""
        raise NotImplementedError

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n)."""
        return self.read_spans(np.array([start], np.int64), np.array([n], np.int64))

    def prefetch_spans(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Start fetching what read_spans(starts, lengths) will need (readers that wait on a network)."""

    def token_sample(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens to check the dtype against (check_token_sample), and their positions."""
        return read_token_sample(self.location, self.dtype)

    @property
    def tokens(self) -> np.ndarray:
        if self.memory is None:
            raise AttributeError(f"{self.name} is read with {self.read_mode}: its tokens are read with read_spans")
        return self.memory

    @property
    def memory_location(self) -> str:
        """The file `memory` maps: what a watchdog names when a copy from it hangs."""
        return self.location

    def load_kernels(self) -> None:
        """Compile (or load) what reads need, before DataLoader workers fork (they inherit it)."""

    def describe(self) -> str:
        """How this .bin is read, and why, in one phrase (run summaries: data.read_modes)."""
        return f"{self.read_mode} ({self.read_mode_reason})"

    def close(self) -> None:
        """Let go of the file (or connection)."""


class LocalBinReader(BinReader):
    """A .bin on a local (or mounted) file system: its size stat'ed and its readability checked at open, so a
    missing, unreadable or non-regular .bin is refused when the dataset opens, not at the first read in a loader
    worker; `nbytes` is the size where the opener already has it. The variants (memory map, pread, O_DIRECT) open
    the file at their first read.

    Example:
        >>> MMapBinReader("out/a_text_document.bin", np.dtype(np.uint16)).nbytes   # a LocalBinReader
        40960
    """

    default_read_mode = ""  # each variant's own mode name, where the caller gives none

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: np.dtype,
        read_mode: str | None = None,
        read_mode_reason: str = "configured",
        nbytes: int | None = None,
    ) -> None:
        path = os.fspath(path)
        super().__init__(path, dtype, regular_file_size(path) if nbytes is None else nbytes)
        if not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, "no permission to read the dataset's .bin", path)
        self.read_mode, self.read_mode_reason = read_mode or self.default_read_mode, read_mode_reason
        self._init_state()

    def _init_state(self) -> None:
        """The variant's own state (nothing opened yet: that happens at the first read)."""


class MMapBinReader(LocalBinReader):
    """The .bin memory-mapped: `read` is a view (no copy), `read_spans` a compiled copy per span. "mmap" keeps the
    kernel's read-ahead; "mmap-random" maps with madvise(MADV_RANDOM), so that a cold read costs the pages it
    touches (see corpusforge.storage for when each pays).

    Opening stats the .bin (its size is checked against the index when the dataset opens); the map is made at the
    first read, so a blend of thousands of datasets maps only those it reads. The map checks the size again: a .bin
    that changed size since the dataset was opened is refused there, before any sample is served from it.

    Example:
        >>> MMapBinReader(Path("out/a_text_document.bin"), np.dtype(np.uint16)).read(0, 3)
        array([  464,  2068, 50256], dtype=uint16)
    """

    default_read_mode = "mmap"

    def _init_state(self) -> None:
        self._map: np.ndarray | None = None
        self._closed = False

    def _mapped(self) -> np.ndarray:
        """The token array, mapped at the first call (np.memmap costs ~24 us, mmap.mmap and a view ~14 us)."""
        if self._map is None:
            if self._closed:
                raise ValueError(f"{self.name}: the dataset is closed")
            self._map = self._map_file()
        return self._map

    def _map_file(self) -> np.ndarray:
        fd = os.open(self.location, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.nbytes:
                raise IndexedFormatError(
                    f"{self.location}: {size} bytes now, but {self.nbytes} when its dataset was opened and checked "
                    "against the index: the .bin was replaced or changed; reopen the dataset"
                )
            if not size:  # mmap cannot map an empty file; an empty dataset has nothing to read anyway
                return np.zeros(0, self.dtype)
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # the mapping keeps the file open
        finally:
            os.close(fd)
        if self.read_mode == "mmap-random":
            mapping.madvise(mmap.MADV_RANDOM)  # fault in one page at a time: no read-ahead
        # A plain ndarray (not np.memmap) also suits compiled code: numba types an np.memmap by a slower path.
        return np.frombuffer(mapping, self.dtype, size // self.dtype.itemsize)

    @property
    def memory(self) -> np.ndarray:  # type: ignore[override]
        return self._mapped()

    @property
    def tokens(self) -> np.ndarray:
        return self._mapped()

    def read(self, start: int, n: int) -> np.ndarray:
        return self._mapped()[start : start + n]

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        tokens, out = self._mapped(), np.empty(int(lengths.sum()), self.dtype)
        watch = _read_watch
        if watch is None or not len(starts):
            return copy_spans(tokens, starts, lengths, out)
        # A read a watchdog sees, as pread's: the slot names the file, and the kernel stores each span's byte offset
        # in its OFFSET word before copying it (a page fault a hung storage never answers waits there).
        slot = watch.slot_for(self.location)
        start = watch.mark_begin(slot, int(starts[0]) * self.dtype.itemsize, out.nbytes, time.monotonic_ns())
        try:
            return copy_spans(tokens, starts, lengths, out, slot[watch.OFFSET : watch.OFFSET + 1])
        finally:
            watch.mark_end(slot, start, time.monotonic_ns())

    def load_kernels(self) -> None:
        self.read_spans(np.zeros(0, np.int64), np.zeros(0, np.int64))  # compiles once per dtype, then a no-op call

    def close(self) -> None:
        self._map, self._closed = None, True


def regular_file_size(path: str) -> int:
    """The size of the regular file `path`; FileNotFoundError for a missing file or one that is no regular file
    (a directory named like a .bin), as a dataset pair needs.

    Example: regular_file_size("out/a_text_document.bin") -> 40960
    """
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise FileNotFoundError(f"{path}: not a regular file")
    return info.st_size


# corpusforge.storage.readwatch, which registers itself here when imported (this module cannot import the storage
# package, which imports it): MMapBinReader.read_spans marks its copies in it. None: no watchdog in this process.
_read_watch: Any = None


def watch_mapped_reads(readwatch: Any) -> None:
    """Have MMapBinReader.read_spans mark its copies in `readwatch` (corpusforge.storage.readwatch calls this).

    Example:
        >>> watch_mapped_reads(corpusforge.storage.readwatch)
    """
    global _read_watch
    _read_watch = readwatch


# Where copy_spans stores its span offsets when no read slot is given.
_NOWHERE = np.zeros(1, np.int64)


def copy_spans(
    tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, at: np.ndarray | None = None
) -> np.ndarray:
    """Fill `out` with tokens[starts[k] : starts[k] + lengths[k]] for every k, back to back: one memcpy per span,
    compiled, no index arrays. Returns `out`. `at` (one int64, a read slot's OFFSET word): the byte offset of the span
    being copied is stored there before it is copied.

    Example:
        >>> copy_spans(np.arange(10), np.array([2, 7]), np.array([2, 2]), np.empty(4, np.int64)).tolist()
        [2, 3, 7, 8]
    """
    at = _NOWHERE if at is None else at
    _span_kernel()(np.asarray(tokens), np.asarray(starts, np.int64), np.asarray(lengths, np.int64), out, at)
    return out


def _copy_spans_loop(tokens, starts, lengths, out, at) -> None:
    pos = 0
    for k in range(len(starts)):
        at[0] = starts[k] * tokens.itemsize
        out[pos : pos + lengths[k]] = tokens[starts[k] : starts[k] + lengths[k]]
        pos += lengths[k]


@functools.cache
def _span_kernel() -> Callable[..., None]:
    """_copy_spans_loop compiled, at its first use: numba costs ~1 s to import, which the format's other users
    (merge, inspect, preprocess) never need to pay."""
    from corpusforge.jit import njit

    return njit(nogil=True)(_copy_spans_loop)


class IndexedDataset:
    """A token dataset `{prefix}.bin/.idx`: its index in memory (read whole when small, else memory-mapped: see
    open_index), its tokens through a BinReader.

    The one dataset class of corpusforge, as Megatron-Core's IndexedDataset: the index is parsed here, the .bin is
    read by the reader it is given (`storage.open_dataset` chooses one: memory map, pread, O_DIRECT, ranged reads
    of an fsspec URL), by default a memory map, where `ds[i]` is sequence i as a view into the mapped .bin.

    Opening checks everything (`validate()`) and refuses a faulty pair with one IndexedFormatError line: the header
    and file sizes, every length, pointer and document index against each other and against the .bin (O(S),
    vectorised: ~1 s per 1e8 sequences, benchmarks/index_validation.py), and the dtype against a sample of tokens
    (signed and float dtypes) and against P.preprocess.json. The .bin is stat'ed then; the default reader maps it at
    its first read, and refuses it there if its size changed since. `check=False` does only the O(1) part (header,
    sizes, the ends against the .bin), for `corpusforge inspect`, which reports what `validate()` finds instead of
    refusing, and for openers that validate later themselves.

    `index` is the bytes of an .idx already in memory (a remote dataset: `prefix` is then its URL, and `reader`
    is required), or an OpenedIndex (open_index: storage opens the .idx before it chooses the reader); `pin` is
    closed with the dataset (a local cache entry's ReaderPin). Pickled, a dataset travels as how to reopen it
    (`reopen`), never as its tokens.

    Example:
        >>> ds = IndexedDataset("out/corpus_text_document")
        >>> len(ds), ds.num_documents, ds.dtype
        (1000, 1000, dtype('int32'))
        >>> ds.get(3, offset=10, length=5)      # five tokens of sequence 3, from its 10th
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        check: bool = True,
        reader: BinReader | None = None,
        index: bytes | OpenedIndex | None = None,
        pin: Any = None,
    ) -> None:
        self.prefix = self.source = os.fspath(prefix)
        self.pin = pin
        self.reopen: tuple[Callable[..., Any], tuple[Any, ...]] = (IndexedDataset, (self.prefix,))
        if index is None:
            index = open_index(self.prefix)
        elif not isinstance(index, OpenedIndex):
            index = OpenedIndex.from_bytes(index, f"{self.prefix}.idx")  # a URL: not a Path, which folds its "//"
        self.index_name, self._idx = index.name, index.buffer
        header = index.header
        self.dtype = header.dtype
        s, d = header.sequence_count, header.document_count
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, s, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, s, HEADER_SIZE + 4 * s)
        self.document_indices = np.frombuffer(self._idx, np.int64, d, HEADER_SIZE + 12 * s)
        modes_at = HEADER_SIZE + 12 * s + 8 * d
        self.sequence_modes = np.frombuffer(self._idx, np.int8, s, modes_at) if index.has_modes else None
        if reader is None:
            try:
                reader = MMapBinReader(f"{self.prefix}.bin", self.dtype)
            except FileNotFoundError:
                require_pair(self.prefix, "a dataset")  # the message that names the pair
                raise
        self.reader = reader
        self._check(full=False)
        if check:
            self.validate()

    # Paths on demand: a blend opens thousands of datasets, and two Path objects each cost more than reading a
    # small .idx; messages and merges ask for them.
    @functools.cached_property
    def idx_path(self) -> Path:
        return idx_path(self.prefix)

    @functools.cached_property
    def bin_path(self) -> Path:
        return bin_path(self.prefix)

    def _check(self, full: bool) -> None:
        check_index(
            self.index_name,
            self.dtype,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
            self.reader.nbytes,
            self.reader.name,
            full=full,
        )

    def validate(self) -> None:
        """Check every length, pointer and document index against each other and the .bin (O(S)), and the dtype
        against P.preprocess.json and, for a signed or float dtype, a sample of tokens (check_token_sample refuses
        no unsigned token, so for those none is read: on a cold blend of 2,500 datasets the three reads of each were
        ~0.15 s of a 0.34 s open); raise IndexedFormatError on the first fault."""
        self._check(full=True)
        if not self.reader.remote:  # an object store has no P.preprocess.json beside the dataset
            # The recorded dtype first: where it exists it is exact, and its message says what the dtype should be.
            check_recorded_dtype(self.prefix, self.index_name, self.dtype)
        if not np.issubdtype(self.dtype, np.unsignedinteger):  # every unsigned value is an id: nothing to refuse
            check_token_sample(self.index_name, *self.reader.token_sample())

    # -- access ------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return self.reader.nbytes // self.dtype.itemsize

    def _start(self, i: int) -> int:
        """Token offset of sequence i in the .bin, after a range check."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.prefix}")
        return int(self.sequence_pointers[i]) // self.dtype.itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        return self.reader.read(self._start(i), int(self.sequence_lengths[i]))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of sequence i from token `offset` (to its end when `length` is None), clamped to the
        sequence as a slice of it would be."""
        start = self._start(i)
        lo, hi, _ = slice(offset, None if length is None else offset + length).indices(int(self.sequence_lengths[i]))
        return self.reader.read(start + lo, max(hi - lo, 0))

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences are contiguous in the .bin)."""
        if not -self.num_documents <= d < self.num_documents:
            raise IndexError(f"document {d} out of range for {self.num_documents} documents in {self.prefix}")
        d %= self.num_documents
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self.reader.read(0, 0)
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        return self.reader.read(start, int(self.sequence_lengths[first:last].sum()))

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the dataset, as one memory-mapped array (local files only)."""
        return self.reader.tokens

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [starts[k], starts[k] + lengths[k]) for every k, concatenated (token units), in one call."""
        return self.reader.read_spans(starts, lengths)

    def prefetch_spans(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Start fetching what read_spans(starts, lengths) will need, where the reader fetches over a network."""
        self.reader.prefetch_spans(starts, lengths)

    @property
    def read_mode(self) -> str:
        return self.reader.read_mode

    @property
    def read_mode_reason(self) -> str:
        return self.reader.read_mode_reason

    def load_kernels(self) -> None:
        """Compile (or load) the reader's span copy now, before DataLoader workers fork (they inherit it)."""
        self.reader.load_kernels()

    def close(self) -> None:
        self.reader.close()
        self._idx = None  # type: ignore[assignment]
        if self.pin is not None:
            self.pin.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled for spawn/forkserver DataLoader workers and other processes: reopen by name instead of copying
        # the memory map (storage.open_dataset sets `reopen` to itself, with the read mode it chose).
        return self.reopen

    def __repr__(self) -> str:
        counts = f"sequences={len(self)}, documents={self.num_documents}"
        reads = f"read_mode={self.read_mode!r} ({self.read_mode_reason})"
        return f"IndexedDataset({self.prefix!r}, {counts}, dtype={self.dtype}, {reads})"


# ---------------------------------------------------------------------------------------------------------------
# merging


MERGE_STREAMS = 2
"""Inputs `merge` copies at once by default (benchmarks/bench_merge.py: GB/s for 1, 2, 4 streams)."""


@dataclass(frozen=True)
class MergeStats:
    datasets: int
    documents: int
    sequences: int
    tokens: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class Placement:
    """Where one input's tokens land in a concatenation: bytes [0, nbytes) of `source` at `offset` of the output."""

    source: str
    """The input's .bin file."""
    offset: int
    nbytes: int


def place(placement: Placement, dest: str | os.PathLike, durable: bool = False) -> None:
    """Copy one input's .bin into the existing file `dest` at its offset.

    Each placement writes only its own byte range, so many may run at once on one file: threads here, or
    processes on other machines that share the file system, which spreads the copy's bandwidth over them.
    `durable`: fsync before returning; a remote writer's pages are only durable after its own fsync.

    Example: place(Placement("parts/part-00001_text_document.bin", 81920, 40960), "out_text_document.bin.tmp")
    """
    fd = os.open(dest, os.O_WRONLY)
    try:
        with open(placement.source, "rb") as src:
            copy_bytes(src.fileno(), fd, placement.nbytes, placement.offset, placement.source)
        if durable:
            os.fsync(fd)
        elif placement.nbytes:
            _start_writeback(fd, placement.offset, placement.nbytes)
    finally:
        os.close(fd)


class _SpilledIndex:
    """An .idx built part by part: its lengths, pointers and document starts are appended to three anonymous
    temporary files beside it (page cache, not this process's memory) and written behind the header at the end,
    so building the index of a dataset of any size holds one part's arrays, not the whole dataset's (40 bytes a
    document: 0.9 GB for 22M documents). The bytes are `write_index`'s for the same lengths and starts.

    Example:
        >>> spill = _SpilledIndex(Path("out"), np.dtype(np.uint16))
        >>> spill.append(np.array([3, 2], np.int32), np.array([0, 1]))    # two documents of one sequence each
        >>> spill.write(Path("out/x.idx.tmp"), durable=False); spill.close()
    """

    def __init__(self, directory: Path, dtype: np.dtype) -> None:
        import tempfile

        self.dtype = dtype
        # lengths, pointers, starts; unbuffered: a full disk fails the append, never a later flush (in discard())
        self._files = [tempfile.TemporaryFile(dir=directory, buffering=0) for _ in range(3)]
        self.sequences = self.documents = 0
        self._offset = 0  # bytes of tokens before the next sequence

    def append(self, lengths: np.ndarray, doc_starts: np.ndarray) -> None:
        """One part: its sequences' lengths, and its documents' first sequences (already offset to the whole)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        pointers = sequence_pointers(lengths, self.dtype.itemsize) + self._offset
        self._offset += int(lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        for f, array in zip(self._files, (lengths, pointers, np.ascontiguousarray(doc_starts, dtype=np.int64))):
            view = memoryview(array).cast("B")
            while view:
                view = view[f.write(view) :]
        self.sequences += len(lengths)
        self.documents += len(doc_starts)

    def write(self, path: Path, durable: bool) -> None:
        with open(path, "wb", buffering=0) as out:  # unbuffered: the header lands before the in-kernel copies
            out.write(MAGIC + struct.pack("<QBQQ", VERSION, dtype_code(self.dtype), self.sequences, self.documents + 1))
            for f in self._files:  # in the kernel where it can: no pass through this process's memory
                copy_bytes(f.fileno(), out.fileno(), f.tell(), None, f"{path} (spilled index)")
            out.write(struct.pack("<q", self.sequences))  # the document index ends with the sequence count
            if durable:
                os.fsync(out.fileno())

    def close(self) -> None:
        for f in self._files:
            f.close()


class DatasetConcatenator:
    """Concatenates datasets, in order, into `{prefix}.bin/.idx`, copying up to `streams` of them at once.

    An input's place in the output is known as soon as the inputs before it are (its offset is the sum of
    their sizes), so `add()` reads its index, reserves its byte range and starts copying it there at once, on
    one of `streams` threads, while the next inputs are added. `streams=0` copies nothing: the caller runs
    `place()` for each returned placement (on other machines, say) before `finalize()`. `finalize()` waits for
    the copies, fsyncs once, writes the .idx from the inputs' lengths and renames both; until then everything
    is under temporary names, and `discard()` removes it. The result is byte for byte `IndexedDatasetWriter`'s
    `add_dataset()` of the same inputs, in the same order.

    Example:
        >>> cat = DatasetConcatenator("all_text_document", np.uint16, streams=4)
        >>> for p in ["a_text_document", "b_text_document"]:
        ...     cat.add(p)
        >>> cat.finalize()
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type, streams: int = 1) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_tmp = Path(f"{bin_path(prefix)}.tmp")
        self._idx_tmp = Path(f"{idx_path(prefix)}.tmp")
        # First the index's anonymous files: if the disk is full they fail before anything has a name to remove.
        with naming(idx_path(prefix)):
            self._index = _SpilledIndex(self.bin_tmp.parent, self.dtype)
        try:
            with naming(bin_path(prefix), self.bin_tmp):
                self._fd = os.open(self.bin_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except BaseException:
            self._index.close()
            raise
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix="corpusforge-place") if streams else None
        self._copies: list[Future] = []
        self.num_sequences = self.num_documents = self.nbytes = 0
        self.closed = False

    def add(self, prefix: str | os.PathLike | IndexedDataset) -> Placement:
        """Append dataset `prefix` (or an open one): check it, reserve its bytes, start copying them (unless
        streams=0). The dataset is closed once its index is taken."""
        if self.closed:
            raise RuntimeError(f"{self.prefix}: concatenator is already finalized or discarded")
        self._raise_failed_copy()  # a full disk stops the run at the next part, not at the end
        src = _mergeable_source(prefix, self.dtype)
        placement = Placement(os.fspath(src.bin_path), self.nbytes, src.num_tokens * self.dtype.itemsize)
        with naming(idx_path(self.prefix)):
            self._index.append(src.sequence_lengths, src.document_indices[:-1] + self.num_sequences)
        self.num_sequences += len(src)
        self.num_documents += src.num_documents
        self.nbytes += placement.nbytes
        src.close()
        if self._pool is not None:
            self._copies.append(self._pool.submit(place, placement, self.bin_tmp))
        return placement

    @property
    def num_tokens(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def _raise_failed_copy(self) -> None:
        for copy in self._copies:
            if copy.done() and copy.exception() is not None:
                with naming(bin_path(self.prefix), self.bin_tmp):  # a full disk names the output, not "output"
                    raise copy.exception()

    def finalize(self, durable: bool = True) -> Path:
        """Wait for the copies, then make the dataset visible under its final names (durable unless told not)."""
        try:
            with naming(bin_path(self.prefix), self.bin_tmp):
                for copy in self._copies:
                    copy.result()
                os.ftruncate(self._fd, self.nbytes)  # an input's bytes past its index would not be copied: no tail
            self.closed = True  # _finish_pair closes the descriptor
            _finish_pair(self.prefix, self._fd, lambda tmp: self._index.write(tmp, durable), durable)
        except BaseException:
            self.discard()
            raise
        self._shutdown()
        return Path(self.prefix)

    def discard(self) -> None:
        """Stop the copies and remove the temporary files; the final names are left untouched."""
        self._shutdown()
        if not self.closed:
            os.close(self._fd)
            self.closed = True
        for p in (self.bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # no copy may still write after discard()
        self._index.close()


def merge(
    prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike, streams: int = MERGE_STREAMS
) -> MergeStats:
    """Concatenate datasets, in order, into `output_prefix` without re-tokenizing; atomic like every writer.
    Up to `streams` inputs are copied at once, each straight to its offset in the output.

    Example:
        >>> merge(["shard0_text_document", "shard1_text_document"], "all_text_document").documents
    """
    import time

    if not prefixes:
        raise ArgumentError("merge needs at least one input dataset")
    t0 = time.perf_counter()
    out = os.fspath(output_prefix)
    if any(os.path.abspath(os.fspath(p)) == os.path.abspath(out) for p in prefixes):
        raise ArgumentError(f"{out}: the output prefix is also an input; choose another --output-prefix")
    check_writable(bin_path(out))  # a read-only place fails now, naming the output, not after the copy
    # Open (and so validate) every input before writing anything: a corrupt last input must not cost a copy of the
    # first ones. The memory maps stay open until each is added: two maps per input, no copy of any array.
    sources = [IndexedDataset(p) for p in prefixes]
    dtypes = {src.dtype for src in sources}
    if len(dtypes) > 1:
        listing = ", ".join(f"{src.prefix} ({src.dtype})" for src in sources)
        raise IndexedFormatError(f"cannot merge datasets of different token dtypes: {listing}")
    cat = DatasetConcatenator(out, dtypes.pop(), max(1, streams))
    try:
        for src in sources:
            cat.add(src)
    except BaseException:
        cat.discard()
        raise
    cat.finalize()
    return MergeStats(
        datasets=len(prefixes),
        documents=cat.num_documents,
        sequences=cat.num_sequences,
        tokens=cat.num_tokens,
        bytes=cat.nbytes,
        seconds=time.perf_counter() - t0,
    )

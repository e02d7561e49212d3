"""The chunk table: every document cut into fixed-length chunks that never cross a document boundary.

On disk, in `DB/chunks/` (plain .npy, memory-mapped when read):

    doc.npy     int64 (N,)  document index in the source dataset (`IndexedDataset.document_indices` order)
    start.npy   int64 (N,)  first token of the chunk, as an offset into the source .bin (in tokens)
    length.npy  int16 (N,)  tokens in the chunk: `chunk_length`, less only for a document's last chunk
    doc_end.npy int64 (D,)  one past the last token of each document (bounds a neighbour's continuation)

Building is O(N) numpy with no per-document Python loop: chunk k of document d starts at doc_start[d] + k*C.
The stage splits the documents into ranges of about `shard_size` chunks, one task each (`chunk_range`), for an
executor; every task writes its rows into the three preallocated `.npy.tmp` files at its own offset (known from
the .idx alone), so tasks on other machines need no merge, and the files are renamed when all are written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from corpusforge import indexed
from corpusforge.fsutil import fsync_dir, fsync_path, save_npy_atomic
from corpusforge.retro.common import load_npy
from corpusforge.stages import run_tasks


@dataclass(frozen=True)
class ChunkTable:
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    doc_end: np.ndarray

    def __len__(self) -> int:
        return len(self.doc)

    @classmethod
    def load(cls, directory: Path) -> ChunkTable:
        return cls(*(load_npy(directory / f"{name}.npy") for name in ("doc", "start", "length", "doc_end")))

    def tokens(
        self, source: np.ndarray, ids: np.ndarray, width: int, pad: int = -1, continuation: bool = False
    ) -> np.ndarray:
        """(len(ids), width) int64 tokens from each chunk's start, padded with `pad`: the chunk alone, or with
        `continuation` the chunk and the tokens after it up to its document's end (RETRO's neighbour + continuation)."""
        ids = np.asarray(ids, dtype=np.int64)
        starts = self.start[ids]
        ends = self.doc_end[self.doc[ids]] if continuation else starts + self.length[ids]
        pos = starts[:, None] + np.arange(width, dtype=np.int64)[None, :]
        valid = pos < ends[:, None]
        out = source[np.minimum(pos, max(len(source) - 1, 0))].astype(np.int64)
        out[~valid] = pad
        return out


def document_bounds(ds: indexed.IndexedDataset, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first token, one past the last token) of documents [lo, hi) (default all), in tokens of the .bin."""
    hi = ds.num_documents if hi is None else hi
    seqs = np.asarray(ds.document_indices[lo : hi + 1], dtype=np.int64)
    pointers = np.asarray(ds.sequence_pointers[seqs[0] : seqs[-1]], dtype=np.int64) // ds.dtype.itemsize
    seq_start = np.append(pointers, np.int64(ds.num_tokens) if seqs[-1] == len(ds.sequence_pointers) else -1)
    if seq_start[-1] < 0:  # [lo, hi) ends before the last sequence: its end is where the next sequence begins
        seq_start[-1] = int(ds.sequence_pointers[seqs[-1]]) // ds.dtype.itemsize
    return seq_start[seqs[:-1] - seqs[0]], seq_start[seqs[1:] - seqs[0]]


def chunk_documents(doc_start: np.ndarray, doc_end: np.ndarray, chunk_length: int) -> ChunkTable:
    """Cut documents [doc_start, doc_end) into chunks of `chunk_length` tokens; the last one of a document is shorter.

    Example: chunk_documents([0, 100], [100, 130], 64) -> doc [0, 0, 1], start [0, 64, 100], length [64, 36, 30]
    """
    doc_start, doc_end = np.asarray(doc_start, np.int64), np.asarray(doc_end, np.int64)
    sizes = doc_end - doc_start
    counts = -(-sizes // chunk_length)  # ceil; 0 for an empty document
    total = int(counts.sum())
    doc = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # index of each document's first chunk
    k = np.arange(total, dtype=np.int64) - np.repeat(first, counts)  # chunk number inside its document
    start = doc_start[doc] + k * chunk_length
    length = np.minimum(chunk_length, doc_end[doc] - start).astype(np.int16)
    return ChunkTable(doc, start, length, doc_end)


NAMES = ("doc", "start", "length")
DTYPES = {"doc": np.int64, "start": np.int64, "length": np.int16}


@dataclass(frozen=True)
class ChunkJob:
    """What every chunking task needs, as plain data (it pickles to a worker or a Ray node)."""

    prefix: str
    directory: str
    chunk_length: int


def chunk_range(job: ChunkJob, task: tuple[int, int, int, int], ctx=None) -> int:
    """Task i = (i, lo, hi, first): chunk documents [lo, hi) into rows [first, ...) of the preallocated .npy.tmp
    files. Returns the chunks written.

    Example (what an executor calls): chunk_range(job, (0, 0, 5000, 0), None) -> 81342"""
    from corpusforge.retro.common import open_dataset

    _i, lo, hi, first = task
    table = chunk_documents(*document_bounds(open_dataset(job.prefix), lo, hi), job.chunk_length)
    for name in NAMES:
        out = np.load(_tmp(Path(job.directory), name), mmap_mode="r+", allow_pickle=False)
        values = getattr(table, name) + (lo if name == "doc" else 0)
        out[first : first + len(values)] = values
        out.flush()
        del out
    if ctx is not None and ctx.report:
        ctx.report(len(table))
    return len(table)


def _tmp(directory: Path, name: str) -> Path:
    return directory / f"{name}.npy.tmp"


def count_chunks(ds: indexed.IndexedDataset, chunk_length: int) -> int:
    """Chunks of `chunk_length` the dataset cuts into, from its .idx alone."""
    if not ds.num_documents:
        return 0
    starts, ends = document_bounds(ds)
    return int((-(-(ends - starts) // chunk_length)).sum())


def plan_chunk_tasks(doc_start: np.ndarray, doc_end: np.ndarray, chunk_length: int, per_task: int) -> list:
    """Tasks (i, lo, hi, first chunk): document ranges of about `per_task` chunks each, cut at document boundaries.

    Example: plan_chunk_tasks([0, 100, 300], [100, 300, 310], 64, 3) -> [(0, 0, 2, 0), (1, 2, 3, 6)]"""
    counts = -(-(np.asarray(doc_end, np.int64) - np.asarray(doc_start, np.int64)) // chunk_length)
    ends = np.cumsum(counts)
    cuts = np.unique(np.searchsorted(ends, np.arange(per_task, int(ends[-1]) if len(ends) else 0, per_task)) + 1)
    bounds = [0, *[int(c) for c in cuts if c < len(counts)], len(counts)]
    first = np.concatenate([[0], ends])
    ranges = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    return [(i, lo, hi, int(first[lo])) for i, (lo, hi) in enumerate(ranges)]


def build_chunks(
    ds: indexed.IndexedDataset,
    directory: Path,
    chunk_length: int,
    per_task: int = 1 << 20,
    executor=None,
    progress=None,
) -> dict:
    """The chunks stage: tasks on `executor` (default: this process) fill `directory/*.npy.tmp`, then each file is
    fsynced and renamed; returns its statistics. A killed stage is redone whole (it runs at memory speed)."""
    if not 1 <= chunk_length <= np.iinfo(np.int16).max:
        raise ValueError(f"chunk length {chunk_length} must be between 1 and 32767 tokens")
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    doc_start, doc_end = document_bounds(ds) if ds.num_documents else (np.zeros(0, np.int64),) * 2
    tasks = plan_chunk_tasks(doc_start, doc_end, chunk_length, per_task)
    total = int((-(-(doc_end - doc_start) // chunk_length)).sum())
    for name in NAMES:
        np.lib.format.open_memmap(_tmp(directory, name), mode="w+", dtype=DTYPES[name], shape=(total,)).flush()
    job = ChunkJob(os.path.abspath(ds.prefix), os.path.abspath(directory), chunk_length)
    run_tasks(partial(chunk_range, job), tasks, executor, progress=progress, count=int)  # none kept: redone whole
    for name in NAMES:  # filled in place by the tasks, so not fsutil.atomic_write: fsync, then the final name
        fsync_path(_tmp(directory, name))
        os.replace(_tmp(directory, name), directory / f"{name}.npy")
    save_npy_atomic(directory / "doc_end.npy", doc_end)
    fsync_dir(directory)
    seconds = time.perf_counter() - t0
    length = load_npy(directory / "length.npy")
    return {
        "chunks": total,
        "documents": ds.num_documents,
        "tokens": int(ds.num_tokens),
        "full_chunks": int((length == chunk_length).sum()),
        "tasks": len(tasks),
        "seconds": round(seconds, 3),
        "chunks_per_s": round(total / seconds) if seconds > 0 else None,
    }

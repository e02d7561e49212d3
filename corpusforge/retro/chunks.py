"""The chunk table: every document cut into fixed-length chunks that never cross a document boundary.

On disk, in `DB/chunks/` (plain .npy, memory-mapped when read):

    doc.npy     int64 (N,)  document index in the source dataset (`IndexedDataset.document_indices` order)
    start.npy   int64 (N,)  first token of the chunk, as an offset into the source .bin (in tokens)
    length.npy  int16 (N,)  tokens in the chunk: `chunk_length`, less only for a document's last chunk
    doc_end.npy int64 (D,)  one past the last token of each document (bounds a neighbour's continuation)

Building is O(N) numpy with no per-document Python loop: chunk k of document d starts at doc_start[d] + k*C.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpusforge import indexed
from corpusforge.retro.common import kill_point, load_npy, save_npy_atomic


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


def document_bounds(ds: indexed.IndexedDataset) -> tuple[np.ndarray, np.ndarray]:
    """(first token, one past the last token) of every document, in tokens of the .bin."""
    seq_start = np.append(ds.sequence_pointers // ds.dtype.itemsize, np.int64(ds.num_tokens))
    return seq_start[ds.document_indices[:-1]], seq_start[ds.document_indices[1:]]


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


def build_chunks(ds: indexed.IndexedDataset, directory: Path, chunk_length: int) -> dict:
    """The chunks stage: writes `directory/*.npy` atomically, one file at a time; returns its statistics."""
    if not 1 <= chunk_length <= np.iinfo(np.int16).max:
        raise ValueError(f"chunk length {chunk_length} must be between 1 and 32767 tokens")
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    table = chunk_documents(*document_bounds(ds), chunk_length)
    for i, name in enumerate(("doc", "start", "length", "doc_end")):
        save_npy_atomic(directory / f"{name}.npy", getattr(table, name))
        kill_point("chunks", i)
    seconds = time.perf_counter() - t0
    return {
        "chunks": len(table),
        "documents": ds.num_documents,
        "tokens": int(ds.num_tokens),
        "full_chunks": int((table.length == chunk_length).sum()),
        "seconds": round(seconds, 3),
        "chunks_per_s": round(len(table) / seconds) if seconds > 0 else None,
    }

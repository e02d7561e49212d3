"""`RetroDataset`: training samples with their retrieved neighbours' tokens, gathered in batches from memmaps.

Sample i covers `chunks_per_sample` consecutive query chunks (seq_length / chunk_length). It returns

    tokens      int64 (m*C,)        the sample's chunk tokens, each chunk padded to C with `pad_id`
    chunk_ids   int64 (m,)          query chunk ids (rows of neighbours.bin)
    neighbours  int64 (m, K, 2C)    each neighbour chunk followed by its continuation (RETRO, Borgeaud et al.
                                    2022, sec. 2.3), cut at its document's end and padded; all pad where -1
    neighbour_ids int64 (m, K)      DB chunk ids, -1 for missing

Nothing is copied at open: the chunk tables, the neighbours file and both token datasets stay memory-mapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from corpusforge.retro.chunks import ChunkTable
from corpusforge.retro.common import RetroError, open_dataset
from corpusforge.retro.neighbours import read_neighbours


class RetroDataset:
    def __init__(
        self, db: str | Path, seq_length: int = 2048, pad_id: int = 0, neighbours_path: str | Path | None = None
    ) -> None:
        db = Path(db)
        manifest_path = db / "manifest.json"
        if not manifest_path.is_file():
            raise RetroError(f"{db}: not a retrieval database (no manifest.json)")
        manifest = json.loads(manifest_path.read_text())
        if neighbours_path is None and "neighbours" not in manifest["stages"]:
            raise RetroError(f"{db}: no neighbours yet; rerun build-knn with --resume (and without --no-neighbours)")
        cfg = manifest["config"]
        self.chunk_length = int(cfg["chunk_length"])
        if seq_length % self.chunk_length:
            raise RetroError(f"seq_length {seq_length} is not a multiple of the chunk length {self.chunk_length}")
        self.chunks_per_sample = seq_length // self.chunk_length
        self.pad_id = pad_id
        self.db_chunks = ChunkTable.load(db / "chunks")
        self.db_tokens = open_dataset(cfg["prefix"]).tokens
        if cfg.get("query_prefix"):
            self.query_chunks = ChunkTable.load(db / "query_chunks")
            self.query_tokens = open_dataset(cfg["query_prefix"]).tokens
        else:
            self.query_chunks, self.query_tokens = self.db_chunks, self.db_tokens
        self.neighbours = read_neighbours(Path(neighbours_path) if neighbours_path else db / "neighbours.bin")
        if len(self.neighbours) != len(self.query_chunks):
            raise RetroError(f"{db}/neighbours.bin: {len(self.neighbours)} rows for {len(self.query_chunks)} chunks")

    def __len__(self) -> int:
        return len(self.query_chunks) // self.chunks_per_sample

    def get_batch(self, indices) -> dict[str, np.ndarray]:
        """Samples `indices` stacked: every array gains a leading batch dimension (B, ...)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range for {len(self)} samples")
        idx %= max(len(self), 1)
        m, c = self.chunks_per_sample, self.chunk_length
        chunk_ids = idx[:, None] * m + np.arange(m)[None, :]  # (B, m)
        tokens = self.query_chunks.tokens(self.query_tokens, chunk_ids.ravel(), c, pad=self.pad_id)
        nb_ids = np.asarray(self.neighbours[chunk_ids.ravel()])  # (B*m, K)
        k = nb_ids.shape[1]
        nb_tokens = self.db_chunks.tokens(
            self.db_tokens, np.maximum(nb_ids.ravel(), 0), 2 * c, pad=self.pad_id, continuation=True
        )
        nb_tokens[nb_ids.ravel() < 0] = self.pad_id
        b = len(idx)
        return {
            "tokens": tokens.reshape(b, m * c),
            "chunk_ids": chunk_ids,
            "neighbours": nb_tokens.reshape(b, m, k, 2 * c),
            "neighbour_ids": nb_ids.reshape(b, m, k),
        }

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {name: a[0] for name, a in self.get_batch([i]).items()}

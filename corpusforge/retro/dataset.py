"""`RetroDataset`: training samples with their retrieved neighbours' tokens, gathered in batches from memmaps.

Sample i covers L = seq_length / chunk_length consecutive query chunks (m tokens each; a document's last chunk is
shorter and padded). `get_batch(ids)` returns, as numpy arrays,

    tokens        int64 (B, L*m)         the samples' chunk tokens, each chunk padded to m with `pad_id`
    chunk_ids     int64 (B, L)           query chunk ids (rows of neighbours.bin)
    neighbours    int64 (B, L, K, 2m)    each neighbour chunk followed by its continuation (RETRO, Borgeaud et al.
                                         2022, sec. 2.3), cut at its document's end and padded; all pad where -1
    neighbour_ids int64 (B, L, K)        DB chunk ids, -1 for missing

and, for training, the loader path (the GPT path's split, corpusforge/data/batch.py): `read_raw(ids)` gathers a
`RetroRawBatch` in the token file's dtype with one vectorised read per table (what DataLoader workers send: its
neighbours are 4x the sample's tokens, so the narrow dtype matters), and `assemble(raw)` makes the model's fields

    tokens          int32 (B, T)         pads as 0
    labels          int32 (B, T)         the next token; 0 where there is none
    loss_mask       float32 (B, T)       1 where the label is the next token of the same document, else 0 (after a
                                         document's last token, in a short chunk's padding)
    position_ids    int32 (B, T)         0..T-1
    neighbours      int32 (B, L, K, R)   R = retrieved_chunks * m; 0 where masked
    neighbour_mask  bool (B, L, K, R)    True for real tokens: False for a -1 neighbour and past a document's end

all views of one storage as torch tensors (`__getitems__`, what torch's DataLoader calls with a batch sampler). The
mask comes from lengths, never from token values: pad_id may be a real token.

Nothing is copied at open: the chunk tables, the neighbours file and both token datasets stay memory-mapped; a
worker started with spawn reopens them from their paths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.retro.chunks import ChunkTable
from corpusforge.retro.common import RetroError, open_dataset
from corpusforge.retro.neighbours import read_neighbours
from corpusforge.storage import readwatch

NEIGHBOUR_MODES = ("real", "random")


@dataclass(frozen=True)
class RetroRawBatch:
    """A batch as read, before its fields are made: what DataLoader workers send to the main process."""

    text: np.ndarray
    """(B, T + 1) tokens in the token file's dtype, 0 where a chunk is padded; the last column is the token after
    the sample where its last chunk continues into the next one (else 0)."""

    lengths: np.ndarray
    """(B, L) int16: real tokens in each query chunk."""

    joins: np.ndarray
    """(B, L) bool: chunk j is full and the chunk after it is the same document, so its last token has a label."""

    neighbours: np.ndarray
    """(B, L, K, R) neighbour + continuation tokens in the DB token file's dtype, 0 past `neighbour_lengths`."""

    neighbour_lengths: np.ndarray
    """(B, L, K) int16: real tokens of each neighbour (0 for a missing one)."""

    chunk_ids: np.ndarray
    """(B, L) int64 query chunk ids."""

    neighbour_ids: np.ndarray
    """(B, L, K) int64 DB chunk ids, -1 for missing."""


class RetroDataset:
    """Samples of a retrieval database's query chunks (the DB's own corpus unless built with --query-prefix) with
    the tokens of their neighbours.

    Example:
        >>> ds = RetroDataset("db/", seq_length=2048, num_neighbours=2, seed=1234, num_samples=10_000)
        >>> batch = ds.__getitems__([0, 1])     # torch: tokens (2, 2048) ... neighbours (2, 32, 2, 128)
    """

    def __init__(
        self,
        db: str | Path,
        seq_length: int = 2048,
        pad_id: int = 0,
        neighbours_path: str | Path | None = None,
        num_neighbours: int | None = None,
        chunk_length: int | None = None,
        retrieved_chunks: int = 2,
        seed: int | None = None,
        neighbours: str = "real",
        sample_range: tuple[int, int] | None = None,
        num_samples: int | None = None,
    ) -> None:
        self._args = dict(db=str(db), seq_length=seq_length, pad_id=pad_id, neighbours_path=neighbours_path,
                          num_neighbours=num_neighbours, chunk_length=chunk_length,
                          retrieved_chunks=retrieved_chunks, seed=seed, neighbours=neighbours,
                          sample_range=None if sample_range is None else tuple(sample_range),
                          num_samples=num_samples)  # fmt: skip
        db = Path(db)
        manifest_path = db / "manifest.json"
        if not manifest_path.is_file():
            raise RetroError(f"{db}: not a retrieval database (no manifest.json)")
        manifest = json.loads(manifest_path.read_text())
        if neighbours_path is None and "neighbours" not in manifest["stages"]:
            raise RetroError(f"{db}: no neighbours yet; rerun build-knn with --resume (and without --no-neighbours)")
        if neighbours not in NEIGHBOUR_MODES:
            raise RetroError(f"neighbours={neighbours!r}: choose one of {', '.join(NEIGHBOUR_MODES)}")
        cfg = manifest["config"]
        self.chunk_length = int(cfg["chunk_length"])
        if chunk_length is not None and chunk_length != self.chunk_length:
            raise RetroError(
                f"{db}: built with chunk length {self.chunk_length}, but {chunk_length} was asked for; set the model's "
                f"chunk_length to {self.chunk_length} or rebuild the database with --chunk-length {chunk_length}"
            )
        if seq_length % self.chunk_length:
            raise RetroError(f"seq_length {seq_length} is not a multiple of the chunk length {self.chunk_length}")
        self.seq_length, self.chunks_per_sample = seq_length, seq_length // self.chunk_length
        self.pad_id, self.retrieved_length = pad_id, retrieved_chunks * self.chunk_length
        self.mode, self.seed = neighbours, seed
        self.db_chunks = ChunkTable.load(db / "chunks")
        self.db_tokens, self.db_bin = _mapped_tokens(cfg["prefix"])
        if cfg.get("query_prefix"):
            self.query_chunks = ChunkTable.load(db / "query_chunks")
            self.query_tokens, self.query_bin = _mapped_tokens(cfg["query_prefix"])
        else:
            self.query_chunks, self.query_tokens, self.query_bin = self.db_chunks, self.db_tokens, self.db_bin
        path = Path(neighbours_path) if neighbours_path else db / "neighbours.bin"
        self.neighbours = read_neighbours(path, n_chunks=len(self.db_chunks))  # ids out of range refused here
        if len(self.neighbours) != len(self.query_chunks):
            raise RetroError(f"{path}: {len(self.neighbours)} rows for {len(self.query_chunks)} chunks")
        stored = self.neighbours.shape[1]
        self.num_neighbours = stored if num_neighbours is None else num_neighbours
        if not 1 <= self.num_neighbours <= stored:
            raise RetroError(
                f"{path}: holds {stored} neighbours per chunk, {num_neighbours} were asked for; rebuild the "
                f"neighbours with build-knn -k {num_neighbours} or ask for at most {stored}"
            )
        # The samples: all, or [lo, hi) of them in file order (a train/validation split by position in the corpus,
        # so the two share no chunk); in file order, or permuted by `seed` (the loader takes 0, 1, 2, ...).
        n = len(self.query_chunks) // self.chunks_per_sample
        lo, hi = (0, n) if sample_range is None else sample_range
        if not 0 <= lo < hi <= n:
            raise RetroError(
                f"{db}: sample_range ({lo}, {hi}) is not inside the {n} samples of seq_length {seq_length}"
            )
        self.order = np.arange(lo, hi, dtype=np.int64)
        if seed is not None:
            self.order = np.random.default_rng(seed).permutation(self.order)
        # A trainer asks for as many samples as its steps consume: past the range, the order repeats (each epoch
        # the same permutation), as a GPT dataset repeats a short split.
        if num_samples is not None and num_samples < 1:
            raise RetroError(f"num_samples {num_samples}: ask for at least 1 sample")
        self.num_samples = len(self.order) if num_samples is None else int(num_samples)
        self.fingerprint = {
            "db": str(db.resolve()),
            "identity": manifest.get("identity"),
            "neighbours_file": str(path.resolve()),
            "neighbours_shape": list(self.neighbours.shape),
            **{k: v for k, v in self._args.items() if k not in ("db", "neighbours_path")},
            "num_neighbours": self.num_neighbours,  # as resolved: a resume must see the same K and m
            "chunk_length": self.chunk_length,
        }

    def __len__(self) -> int:
        return self.num_samples

    @property
    def remote(self) -> bool:
        """Whether reads go over the network (the loader's prefetch asks): the tables and tokens are local maps."""
        return False

    def _chunk_ids(self, indices: Any) -> np.ndarray:
        """(B, L) query chunk ids of samples `indices` (negative indices count from the end)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range for {len(self)} samples")
        sample = self.order[(idx % max(len(self), 1)) % len(self.order)]
        return sample[:, None] * self.chunks_per_sample + np.arange(self.chunks_per_sample)[None, :]

    def _neighbour_ids(self, chunk_ids: np.ndarray) -> np.ndarray:
        """(B, L, K) DB chunk ids of the query chunks' neighbours; in "random" mode each real one replaced by a
        pseudo-random DB chunk that depends only on (seed, query chunk, slot), whatever the batch."""
        ids = np.asarray(self.neighbours[chunk_ids.ravel()])[:, : self.num_neighbours]
        ids = ids.reshape(*chunk_ids.shape, self.num_neighbours)
        if self.mode == "random":
            k = self.num_neighbours
            keys = chunk_ids[..., None].astype(np.uint64) * np.uint64(k) + np.arange(k, dtype=np.uint64)
            picks = (_splitmix64(keys ^ np.uint64(self.seed or 0)) % np.uint64(len(self.db_chunks))).astype(np.int64)
            ids = np.where(ids >= 0, picks, ids)  # missing stays missing: the same mask as the real neighbours
        return ids

    def read_raw(self, indices: Any) -> RetroRawBatch:
        """Samples `indices` as read: one gather per table for the whole batch, no per-sample Python loop."""
        cids = self._chunk_ids(indices)  # (B, L)
        m, q = self.chunk_length, self.query_chunks
        lengths = q.length[cids]  # (B, L) int16
        nxt = np.minimum(cids + 1, len(q) - 1)
        joins = (lengths == m) & (cids + 1 < len(q)) & (q.doc[nxt] == q.doc[cids])
        starts = np.append(q.start[cids], (q.start[cids[:, -1]] + m)[:, None], axis=1)  # (B, L+1)
        span = np.append(lengths, joins[:, -1:].astype(lengths.dtype), axis=1)  # the extra token: 1 or 0
        text = _gather(self.query_tokens, self.query_bin, starts, span, m).reshape(len(cids), -1)
        text = text[:, : m * self.chunks_per_sample + 1]
        nb_ids = self._neighbour_ids(cids)  # (B, L, K)
        db = self.db_chunks
        safe = np.maximum(nb_ids, 0)
        nb_starts = db.start[safe]
        nb_lengths = np.clip(db.doc_end[db.doc[safe]] - nb_starts, 0, self.retrieved_length)
        nb_lengths = np.where(nb_ids >= 0, nb_lengths, 0).astype(np.int16)
        nb_tokens = _gather(self.db_tokens, self.db_bin, nb_starts, nb_lengths, self.retrieved_length)
        return RetroRawBatch(text, lengths, joins, nb_tokens, nb_lengths, cids, nb_ids)

    def assemble(self, raw: RetroRawBatch, as_torch: bool = False, pin_memory: bool = False) -> dict[str, Any]:
        """The model's fields of a raw batch (see the module docstring); torch tensors in one storage if asked."""
        return assemble(raw, self.chunk_length, as_torch, pin_memory)

    def get_batch(self, indices: Any) -> dict[str, np.ndarray]:
        """Samples `indices` stacked: tokens, chunk_ids, neighbours, neighbour_ids, padded with `pad_id`."""
        raw = self.read_raw(indices)
        (b, length), m = raw.lengths.shape, self.chunk_length
        real = np.arange(m) < raw.lengths[..., None]  # (B, L, m)
        tokens = np.where(real, raw.text[:, :-1].reshape(b, length, m), self.pad_id).astype(np.int64)
        nb_real = np.arange(self.retrieved_length) < raw.neighbour_lengths[..., None]
        return {
            "tokens": tokens.reshape(b, length * m),
            "chunk_ids": raw.chunk_ids,
            "neighbours": np.where(nb_real, raw.neighbours, self.pad_id).astype(np.int64),
            "neighbour_ids": raw.neighbour_ids,
        }

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        """The model's batch as torch tensors (what a DataLoader with a batch sampler calls, without workers)."""
        return self.assemble(self.read_raw(indices), as_torch=True)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {name: a[0] for name, a in self.get_batch([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        # For DataLoader workers started with spawn/forkserver: pickling the memmaps would copy every file.
        return self._args

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def _mapped_tokens(prefix: str) -> tuple[np.ndarray, str]:
    """The token array of the dataset at `prefix` (its memory map) and the file it maps, which a read of it names."""
    indexed = open_dataset(prefix)
    return indexed.tokens, indexed.reader.memory_location


def _gather(source: np.ndarray, path: str, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """(..., width) tokens from `source` (the map of `path`) at `starts` (...), each zero past its length, in the
    source's dtype; one fancy-indexed read of the memmap for all of them, marked in readwatch as one read from the
    lowest start: its page faults wait on the storage, and a watchdog then names the file (as for GPT samples)."""
    pos = starts[..., None] + np.arange(width, dtype=np.int64)  # (..., width)
    real = np.arange(width) < lengths[..., None]
    itemsize = source.dtype.itemsize
    lowest = int(starts.min()) * itemsize if starts.size else 0
    began = readwatch.begin(path, lowest, int(lengths.sum()) * itemsize)
    try:
        out = source[np.clip(pos, 0, max(len(source) - 1, 0))]
    finally:
        readwatch.end(began)
    out[~real] = 0
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed bijective mix of uint64 values (Steele et al. 2014, SplitMix64's finaliser): random-looking ids that
    need no generator state, so any worker computes the same for the same chunk."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def assemble(raw: RetroRawBatch, chunk_length: int, as_torch: bool = False, pin_memory: bool = False) -> dict:
    """tokens, labels, loss_mask, position_ids, neighbours, neighbour_mask of a raw batch (numpy, or torch tensors
    that are views of one storage: corpusforge.data.batch.to_torch).

    Example:
        >>> batch = assemble(ds.read_raw([0, 1]), ds.chunk_length)
        >>> batch["neighbour_mask"].shape        # (B, L, K, R)
        (2, 32, 2, 128)
    """
    b, length = raw.lengths.shape
    m = chunk_length
    t = length * m
    i = np.arange(m)
    # A label is the next token of the same document: inside a chunk up to its last real token, and from a full
    # chunk's last token into the next chunk when that one continues the document (`joins`).
    has_label = (i + 1 < raw.lengths[..., None]) | ((i == m - 1) & raw.joins[..., None])  # (B, L, m)
    labels = np.where(has_label.reshape(b, t), raw.text[:, 1:], 0).astype(np.int32)
    batch = {
        "tokens": raw.text[:, :t].astype(np.int32),
        "labels": labels,
        "loss_mask": has_label.reshape(b, t).astype(np.float32),
        "position_ids": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
        "neighbours": raw.neighbours.astype(np.int32),
        "neighbour_mask": np.arange(raw.neighbours.shape[-1]) < raw.neighbour_lengths[..., None],
    }
    if not as_torch:
        return batch
    from corpusforge.data.batch import to_torch

    return to_torch(batch, pin_memory)

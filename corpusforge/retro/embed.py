"""Embedders (chunk tokens → L2-normalised vectors) and the embeddings stage (float16 shards).

Two embedders:

- `hashed` (default): every token unigram and bigram of a chunk is hashed with a seeded 64-bit mixer
  (splitmix64), and the hash's bits ARE the feature's row of a ±1 random projection (Achlioptas 2003,
  "database-friendly random projections"): no table, no collisions between features, no download. Lexical
  only; deterministic for a seed on any machine. numba, parallel over chunks.
- a sentence-transformers / Hugging Face model directory: chunks are detokenised with the dataset's
  tokenizer and encoded by the model (batched; bf16 on a GPU when there is one). Offline: nothing is fetched.

Stage output, `DB/embeddings/shard_NNNNN.npy`: float16 (rows, dim), rows = `shard_size` except the last
shard; each shard is written atomically, so a killed run resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numba
import numpy as np

from corpusforge._jit import njit
from corpusforge.retro.chunks import ChunkTable
from corpusforge.retro.common import RetroError, kill_point, load_npy, save_npy_atomic


class Embedder(Protocol):
    name: str
    dim: int
    fingerprint: str

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(n, C) int64 token ids, -1 as padding → (n, dim) float32, each row of norm 1 (or 0 when empty)."""
        ...


# -- the model-free default ------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(inline="always")
def _mix(z):
    # splitmix64's finaliser (Steele et al. 2014): a bijection of uint64 with full avalanche
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(inline="always")
def _add_feature(acc, h, dim):
    for block in range(dim // 64):
        bits = _mix(h + np.uint64(block + 1) * _GOLDEN)
        for b in range(64):
            acc[block * 64 + b] += 1.0 - 2.0 * np.float32((bits >> np.uint64(b)) & np.uint64(1))


@njit(parallel=True)
def _hashed_embed(tokens, seed, dim, bigram_weight):  # tokens (n, C) int64 → (n, dim) float32
    n, c = tokens.shape
    out = np.zeros((n, dim), dtype=np.float32)
    s = np.uint64(seed)
    for i in numba.prange(n):
        acc = np.zeros(dim, dtype=np.float32)
        bigram = np.zeros(dim, dtype=np.float32)
        for j in range(c):
            t = tokens[i, j]
            if t < 0:
                break
            _add_feature(acc, _mix(np.uint64(t) ^ s), dim)
            if j + 1 < c and tokens[i, j + 1] >= 0:
                u = np.uint64(tokens[i, j + 1])
                _add_feature(bigram, _mix(_mix(np.uint64(t) ^ s) + u * _GOLDEN + np.uint64(1)), dim)
        norm = 0.0
        for k in range(dim):
            acc[k] += bigram_weight * bigram[k]
            norm += acc[k] * acc[k]
        if norm > 0:
            inv = 1.0 / np.sqrt(norm)
            for k in range(dim):
                out[i, k] = acc[k] * inv
    return out


@dataclass(frozen=True)
class HashedNgramEmbedder:
    """Hashed token unigrams + bigrams through a seeded ±1 random projection; `dim` a multiple of 64."""

    dim: int = 128
    seed: int = 0
    bigram_weight: float = 1.0
    name: str = "hashed"

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 64:
            raise RetroError(f"--dim {self.dim}: the hashed embedder needs a positive multiple of 64 (64, 128, 256)")

    @property
    def fingerprint(self) -> str:
        return f"hashed-ngram-v1:dim={self.dim}:seed={self.seed}:bigram={self.bigram_weight}"

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return _hashed_embed(np.ascontiguousarray(tokens, dtype=np.int64), self.seed, self.dim, self.bigram_weight)


# -- models from a local directory -----------------------------------------------------------------------------


class SentenceTransformerEmbedder:
    """A sentence-transformers (or plain Hugging Face encoder, mean-pooled) model from a local directory."""

    def __init__(self, path: str | os.PathLike, tokenizer, batch_size: int = 128, device: str | None = None) -> None:
        path = Path(path)
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise RetroError(
                f"--embedder {path}: not a model directory (no config.json or modules.json); give a local "
                "sentence-transformers / Hugging Face model directory, or 'hashed' for the model-free default"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory only: never reach for the Hub
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise RetroError(
                "the model embedder needs sentence-transformers; `pip install -e '.[retro-models]'` fixes it"
            ) from None
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if self.device == "cuda" else {}
            self.model = SentenceTransformer(str(path), device=self.device, local_files_only=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - any load failure means: this directory is not a usable model
            raise RetroError(f"--embedder {path}: could not load a model from it ({type(e).__name__}: {e})") from None
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.path = path
        self.name = f"model:{path.name}"
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.fingerprint = _directory_fingerprint(path)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        texts = [self.tokenizer.decode(row[row >= 0].tolist()) for row in tokens]
        vectors = self.model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float32)


def _directory_fingerprint(path: Path) -> str:
    """sha256 over file names, sizes, and the bytes of every small file (configs, vocab): cheap and exact enough."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path)}:{size}".encode())
        if size < (4 << 20):
            h.update(f.read_bytes())
    return f"model:{h.hexdigest()[:16]}"


def load_embedder(spec: str, dim: int, seed: int, tokenizer=None) -> Embedder:
    """'hashed' → HashedNgramEmbedder(dim, seed); anything else is a model directory."""
    if spec == "hashed":
        return HashedNgramEmbedder(dim=dim, seed=seed)
    if not Path(spec).exists():
        raise RetroError(f"--embedder {spec}: no such directory; give 'hashed' or a local model directory")
    if tokenizer is None:
        raise RetroError("the model embedder needs the dataset's tokenizer to detokenise chunks (--tokenizer)")
    return SentenceTransformerEmbedder(spec, tokenizer)


# -- the stage -------------------------------------------------------------------------------------------------


def shard_path(directory: Path, i: int) -> Path:
    return directory / f"shard_{i:05d}.npy"


def embed_chunks(
    table: ChunkTable,
    source: np.ndarray,
    embedder: Embedder,
    directory: Path,
    shard_size: int,
    chunk_length: int,
    batch_size: int = 8192,
    progress=None,
) -> dict:
    """The embeddings stage: one float16 shard per `shard_size` chunks; finished shards are kept on resume."""
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob("*.tmp"):
        leftover.unlink()
    n = len(table)
    shards = -(-n // shard_size)
    t0, embedded = time.perf_counter(), 0
    for s in range(shards):
        path = shard_path(directory, s)
        if path.exists():
            continue
        lo, hi = s * shard_size, min(n, (s + 1) * shard_size)
        out = np.empty((hi - lo, embedder.dim), dtype=np.float16)
        for b in range(lo, hi, batch_size):
            ids = np.arange(b, min(hi, b + batch_size))
            out[b - lo : b - lo + len(ids)] = embedder.embed(table.tokens(source, ids, chunk_length))
            if progress:
                progress(len(ids))
        save_npy_atomic(path, out)
        embedded += hi - lo
        kill_point("embeddings", s)
    seconds = time.perf_counter() - t0
    return {
        "shards": shards,
        "dim": embedder.dim,
        "embedded_now": embedded,
        "seconds": round(seconds, 3),
        "chunks_per_s": round(embedded / seconds) if embedded and seconds > 0 else None,
    }


class EmbeddingStore:
    """The float16 shards as one (N, dim) array for gathering rows by chunk id; checks every shard's shape."""

    def __init__(self, directory: Path, n: int, dim: int, shard_size: int) -> None:
        self.n, self.dim, self.shard_size = n, dim, shard_size
        self.shards = []
        for s in range(-(-n // shard_size)):
            path = shard_path(directory, s)
            if not path.exists():
                raise RetroError(f"{path}: missing embedding shard; rerun build-knn with --resume")
            arr = load_npy(path)
            rows = min(shard_size, n - s * shard_size)
            if arr.ndim != 2 or arr.shape[1] != dim:
                raise RetroError(
                    f"{path}: embeddings of dimension {arr.shape[1:]} but the database's embedder gives {dim}; "
                    "shards from different embedders cannot be mixed: rebuild the embeddings stage in a new --output"
                )
            if arr.shape[0] != rows:
                raise RetroError(f"{path}: {arr.shape[0]} rows, expected {rows}; the shard is truncated or foreign")
            self.shards.append(arr)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (any shape, -1 allowed → zeros) as float32, shape ids.shape + (dim,)."""
        ids = np.asarray(ids, dtype=np.int64)
        flat = ids.ravel()
        out = np.zeros((len(flat), self.dim), dtype=np.float32)
        shard_of = np.where(flat >= 0, flat // self.shard_size, -1)
        for s in np.unique(shard_of[shard_of >= 0]):
            sel = np.flatnonzero(shard_of == s)
            out[sel] = self.shards[s][flat[sel] - s * self.shard_size]
        return out.reshape(ids.shape + (self.dim,))

    def blocks(self, rows: int = 1 << 18):
        """(first id, float32 block) over all embeddings, in order."""
        for s, arr in enumerate(self.shards):
            for lo in range(0, len(arr), rows):
                yield s * self.shard_size + lo, np.asarray(arr[lo : lo + rows], dtype=np.float32)

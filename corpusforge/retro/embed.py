"""Embedders (chunk tokens → L2-normalised vectors) and the embeddings stage (float16 shards, one task each).

Two embedders:

- `hashed` (default, `hashed.py`): hashed token unigrams and bigrams → a 1024-wide ±1 sketch → a PCA to `dim`
  fitted on a seeded sample of the corpus. Lexical only; no download; deterministic for a seed.
- a sentence-transformers / Hugging Face model directory: chunks are detokenised with the dataset's
  tokenizer and encoded by the model (batched; bf16 on a GPU when there is one). Offline: nothing is fetched.

Stage output, `DB/embeddings/`: the hashed embedder's fitted projection (`pca_mean.npy`, `pca_components.npy`,
written first), then `shard_NNNNN.npy`: float16 (rows, dim), rows = `shard_size` except the last shard. Each
shard is an independent task (`embed_shard`) for an executor (local processes, or Ray on a cluster sharing the
file system), written atomically, so a killed run resumes at the missing shards, and the bytes do not depend on
how many workers or machines made them.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np

from corpusforge.fsutil import remove_leftovers, save_npy_atomic
from corpusforge.retro.chunks import ChunkTable
from corpusforge.retro.common import RetroError, load_npy, open_dataset
from corpusforge.retro.hashed import HashedNgramEmbedder
from corpusforge.stages import run_tasks


class Embedder(Protocol):
    name: str
    dim: int
    fingerprint: str

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(n, C) int64 token ids, -1 as padding → (n, dim) float32, each row of norm 1 (or 0 when empty)."""
        ...


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
    """'hashed' → HashedNgramEmbedder(dim, seed), to be fitted (`fit_embedder`); anything else is a model directory.

    Example: load_embedder("hashed", 128, 0).fingerprint -> 'hashed-ngram-v2:dim=128:seed=0:...'"""
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


def fit_embedder(embedder: Embedder, table: ChunkTable, source: np.ndarray, directory: Path, chunk_length: int):
    """The embedder ready to embed: a hashed one gets its PCA, read from `directory` when a (killed) run saved it,
    else fitted on a seeded sample of the chunks and saved there first. Returns (embedder, statistics)."""
    if not isinstance(embedder, HashedNgramEmbedder):
        return embedder, {}
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fitted = embedder.load(directory)
        return fitted, {"projection_sha256": fitted.projection_sha256(), "fit_s": 0.0}
    except RetroError:
        pass
    t0 = time.perf_counter()
    n = len(table)
    ids = np.sort(np.random.default_rng(embedder.seed).choice(n, size=min(n, embedder.fit_sample), replace=False))
    fitted = embedder.fit(table.tokens(source, ids, chunk_length))
    info = fitted.save(directory)
    return fitted, {**info, "fit_sample": len(ids), "fit_s": round(time.perf_counter() - t0, 3)}


def load_fitted(embedder: Embedder, directory: Path) -> Embedder:
    """The embedder of a built database (its hashed projection read back), for embedding queries."""
    return embedder.load(directory) if isinstance(embedder, HashedNgramEmbedder) else embedder


@dataclass(frozen=True)
class EmbedJob:
    """What every shard task needs, as plain data: it pickles to a forked worker or a Ray node."""

    prefix: str
    """Token dataset the chunks point into."""
    chunks: str
    """The database's chunks/ directory."""
    directory: str
    """The database's embeddings/ directory (shards are written here)."""
    embedder: Embedder
    shard_size: int
    chunk_length: int
    batch_size: int = 8192

    def shards(self, n: int) -> int:
        return -(-n // self.shard_size)

    def rows(self, shard: int, n: int) -> int:
        """Chunks in `shard` of `n`: shard_size, less in the last shard."""
        return min(self.shard_size, n - shard * self.shard_size)


def embed_shard(job: EmbedJob, shard: int, ctx=None) -> int:
    """One task: embed chunks [shard·shard_size, ...) into shard_NNNNN.npy (atomically); returns its rows.

    Example (what an executor calls): embed_shard(job, 3, TaskContext(report=print)) -> 1048576"""
    table = ChunkTable.load(Path(job.chunks))
    source = open_dataset(job.prefix).tokens
    lo, hi = shard * job.shard_size, min(len(table), (shard + 1) * job.shard_size)
    embed = job.embedder.embed
    if isinstance(job.embedder, HashedNgramEmbedder):  # one core in a worker; this process's threads when alone
        embed = partial(embed, threads=ctx.threads if ctx is not None else 0)
    out = np.empty((hi - lo, job.embedder.dim), dtype=np.float16)
    for b in range(lo, hi, job.batch_size):
        ids = np.arange(b, min(hi, b + job.batch_size))
        out[b - lo : b - lo + len(ids)] = embed(table.tokens(source, ids, job.chunk_length))
        if ctx is not None and ctx.report:
            ctx.report(len(ids))
    save_npy_atomic(shard_path(Path(job.directory), shard), out)
    return hi - lo


def embed_chunks(job: EmbedJob, n: int, executor=None, progress=None) -> dict:
    """The embeddings stage: every missing shard as a task on `executor` (default: this process); finished shards
    are kept on resume. A model embedder (torch, maybe a GPU) always runs here, in this process."""
    from corpusforge.executors import LocalExecutor

    directory = Path(job.directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_leftovers(directory)  # a killed task's shard_NNNNN.npy.PID.HEX.tmp
    if executor is None or not isinstance(job.embedder, HashedNgramEmbedder):
        executor = LocalExecutor(1)

    def finished(shard: int) -> int | None:  # a shard is written whole or not at all: its file is its done marker
        return job.rows(shard, n) if shard_path(directory, shard).exists() else None

    run = run_tasks(
        partial(embed_shard, job), range(job.shards(n)), executor, finished=finished, progress=progress, count=int
    )
    embedded = sum(run.ran)
    return {
        "shards": run.tasks,
        "dim": job.embedder.dim,
        "embedded_now": embedded,
        "seconds": round(run.seconds, 3),
        "chunks_per_s": round(embedded / run.seconds) if embedded and run.seconds > 0 else None,
        "executor": run.executor,
        "workers": run.workers,
    }


class EmbeddingStore:
    """The float16 shards as one (N, dim) array for gathering rows by chunk id; checks every shard's shape."""

    def __init__(self, directory: Path, n: int, dim: int, shard_size: int) -> None:
        self.directory, self.n, self.dim, self.shard_size = Path(directory), n, dim, shard_size
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

"""The model-free default embedder: hashed token n-grams → a wide ±1 sketch → a PCA fitted on the corpus.

1. Features: every token unigram and bigram of a chunk, hashed with a seeded 64-bit mixer (splitmix64) and
   weighted 1 + ln(tf): sublinear term frequency, so that 40 indentation tokens do not make a chunk of code
   40 times "about spaces".
2. Sketch: the bits of a feature's hash ARE its row of a ±1 random projection to `sketch_dim` (1024)
   dimensions (Achlioptas 2003, "database-friendly random projections"): no table, no collisions between
   features, no download. The sum is L2-normalised.
3. Projection: a centred PCA to `dim` (128) dimensions, fitted once per database on the sketches of a
   seeded sample of its chunks (`fit`), then L2-normalised. It is stored in the database
   (`embeddings/pca_mean.npy`, `embeddings/pca_components.npy`) so that every later embedding (shards on
   other machines, --query-prefix, query-knn) uses the same one.

Why the PCA, not a direct 128-d random projection (v1 of this embedder): such a projection adds noise of about
1/sqrt(128) = 0.09 to every cosine, so among 1M chunks the best of ~1M noise terms (~0.4) is as large as a real
neighbour's similarity. The exact top-10 of a chunk without close relatives is then noise, and an ANN index
cannot navigate to noise: HNSW32 needed efSearch=2048 (49 queries/s) for recall@10 0.95 at 1M chunks. A wide
sketch has 1/sqrt(1024) = 0.03 of noise, and the corpus's own main directions carry its structure (code vs
prose, language, topic): neighbourhoods become navigable. Measured with benchmarks/bench_knn.py --anchor, HNSW32
on the same real-text chunks in the same run: at 1M chunks recall@10 0.818 → 0.962 at efSearch 512, and
efSearch 320 (1,165 queries/s) now reaches 0.95 where v1 needed 2048 (49 queries/s); the nearest neighbours
share as many tokens as before (token-set Jaccard 0.357 → 0.359).
IDF weighting was tried too and rejected: it up-weights rare tokens (identifiers, numbers) that mostly make
chunks unlike everything, and recall at the same efSearch fell (100k chunks, HNSW32 at efSearch 128: 0.874 →
0.68 without the PCA, 0.955 → 0.815 with it).

Deterministic: the features, the sketch and the projection are fixed by the seed and the sample; the fit runs
once, in one process, and is read back from the database by every worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numba
import numpy as np

from corpusforge.fsutil import save_npy_atomic
from corpusforge.jit import njit
from corpusforge.retro.common import RetroError, load_npy

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MEAN_FILE, COMPONENTS_FILE = "pca_mean.npy", "pca_components.npy"


@numba.njit(inline="always")
def _mix(z):
    # splitmix64's finaliser (Steele et al. 2014): a bijection of uint64 with full avalanche
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(inline="always")
def _add_feature(acc, h, weight):
    # dimension 64·block + bit gets the sign of that bit of mix(h + (block + 1)·golden); a table lookup per byte
    # measured 4x slower than these shifts, which LLVM vectorises
    for block in range(len(acc) // 64):
        bits = _mix(h + np.uint64(block + 1) * _GOLDEN)
        for b in range(64):
            acc[block * 64 + b] += weight - np.float32(2.0) * weight * np.float32((bits >> np.uint64(b)) & np.uint64(1))


@numba.njit(inline="always")
def _add_sorted_features(acc, keys, scale):
    """keys sorted: each run of equal keys is one feature of term frequency = run length."""
    j = 0
    while j < len(keys):
        k = j + 1
        while k < len(keys) and keys[k] == keys[j]:
            k += 1
        _add_feature(acc, keys[j], np.float32(scale * (1.0 + np.log(k - j))))
        j = k


@numba.njit(inline="always")
def _sketch_row(row, seed, bigram_weight, acc):
    """acc (sketch_dim,) ← the unit sketch of one chunk (-1 ends it); returns False for an empty chunk."""
    c = len(row)
    uni = np.empty(c, np.uint64)
    bi = np.empty(c, np.uint64)
    nu = nb = 0
    for j in range(c):
        if row[j] < 0:
            break
        h = _mix(np.uint64(row[j]) ^ seed)
        uni[nu] = h
        nu += 1
        if j + 1 < c and row[j + 1] >= 0:
            bi[nb] = _mix(h + np.uint64(row[j + 1]) * _GOLDEN + np.uint64(1))
            nb += 1
    acc[:] = 0
    _add_sorted_features(acc, np.sort(uni[:nu]), 1.0)
    _add_sorted_features(acc, np.sort(bi[:nb]), bigram_weight)
    norm = 0.0
    for k in range(len(acc)):
        norm += acc[k] * acc[k]
    if norm == 0:
        return False
    acc *= np.float32(1.0 / np.sqrt(norm))
    return True


@numba.njit(inline="always")
def _embed_row(row, seed, bigram_weight, mean, components, out):
    """out (dim,) ← the unit vector of ((sketch - mean) @ components); zeros for an empty chunk."""
    sketch_dim, dim = components.shape
    acc = np.empty(sketch_dim, dtype=np.float32)
    if not _sketch_row(row, np.uint64(seed), bigram_weight, acc):
        return
    y = np.zeros(dim, dtype=np.float32)
    for j in range(sketch_dim):  # a fixed summation order: the same bits on any machine and thread count
        a = acc[j] - mean[j]
        for k in range(dim):
            y[k] += a * components[j, k]
    norm = 0.0
    for k in range(dim):
        norm += y[k] * y[k]
    if norm > 0:
        out[:] = y * np.float32(1.0 / np.sqrt(norm))


# Each kernel twice: parallel for this process, serial for a forked worker. numba's default threading layer here
# is GNU OpenMP, which aborts a forked child whose parent already ran a parallel region ("fork() called from a
# process already using GNU OpenMP"), and the fit runs in the parent before the local executor forks.
@njit(parallel=True)
def _sketch_parallel(tokens, seed, sketch_dim, bigram_weight):  # (n, C) int64 → (n, sketch_dim) float32
    out = np.zeros((tokens.shape[0], sketch_dim), dtype=np.float32)
    for i in numba.prange(tokens.shape[0]):
        acc = np.empty(sketch_dim, dtype=np.float32)
        if _sketch_row(tokens[i], np.uint64(seed), bigram_weight, acc):
            out[i] = acc
    return out


@njit(parallel=True)
def _embed_parallel(tokens, seed, bigram_weight, mean, components):  # (n, C) int64 → (n, dim) float32
    out = np.zeros((tokens.shape[0], components.shape[1]), dtype=np.float32)
    for i in numba.prange(tokens.shape[0]):
        _embed_row(tokens[i], seed, bigram_weight, mean, components, out[i])
    return out


@njit()
def _embed_serial(tokens, seed, bigram_weight, mean, components):
    out = np.zeros((tokens.shape[0], components.shape[1]), dtype=np.float32)
    for i in range(tokens.shape[0]):
        _embed_row(tokens[i], seed, bigram_weight, mean, components, out[i])
    return out


@dataclass(frozen=True)
class HashedNgramEmbedder:
    """Hashed token unigrams + bigrams (sublinear tf) → ±1 sketch of `sketch_dim` → PCA to `dim`, fitted by `fit`.

    Example:
        >>> e = HashedNgramEmbedder(dim=64).fit(np.random.default_rng(0).integers(0, 1000, (500, 64)))
        >>> e.embed(np.array([[5, 6, 7, -1]])).shape
        (1, 64)
    """

    dim: int = 128
    seed: int = 0
    bigram_weight: float = 1.0
    sketch_dim: int = 1024
    """Width of the ±1 random projection before the PCA (a multiple of 64): noise on a cosine ~1/sqrt(width)."""
    fit_sample: int = 16384
    """Chunks whose sketches the PCA is fitted on (a seeded sample; all chunks when fewer)."""
    name: str = "hashed"
    mean: np.ndarray | None = field(default=None, repr=False, compare=False)
    components: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.sketch_dim <= 0 or self.sketch_dim % 64:
            raise RetroError(f"sketch width {self.sketch_dim}: needs a positive multiple of 64")
        if not 1 <= self.dim <= self.sketch_dim:
            raise RetroError(f"--dim {self.dim}: the hashed embedder needs 1..{self.sketch_dim} (the sketch width)")

    @property
    def fingerprint(self) -> str:
        """The parameters that decide the vectors; the fitted projection follows from them and the data."""
        return (
            f"hashed-ngram-v2:dim={self.dim}:seed={self.seed}:bigram={self.bigram_weight}:tf=sublinear"
            f":sketch={self.sketch_dim}:pca_sample={self.fit_sample}"
        )

    @property
    def fitted(self) -> bool:
        return self.components is not None

    def sketch(self, tokens: np.ndarray) -> np.ndarray:
        """(n, C) token ids (-1 padding) → (n, sketch_dim) float32 unit sketches (zero rows for empty chunks)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        return _sketch_parallel(tokens, self.seed, self.sketch_dim, self.bigram_weight)

    def fit(self, sample_tokens: np.ndarray) -> HashedNgramEmbedder:
        """The embedder with its PCA fitted on the sketches of `sample_tokens` (n, C)."""
        s = self.sketch(sample_tokens).astype(np.float64)
        mean = s.mean(0) if len(s) else np.zeros(self.sketch_dim)
        s -= mean
        _, vectors = np.linalg.eigh(s.T @ s)  # ascending eigenvalues; the covariance's scale does not matter
        top = vectors[:, ::-1][:, : self.dim]
        # an eigenvector's sign is arbitrary: fix it (largest |component| positive), so LAPACK builds cannot differ
        top *= np.sign(top[np.abs(top).argmax(0), np.arange(self.dim)])
        return replace(self, mean=mean.astype(np.float32), components=np.ascontiguousarray(top, dtype=np.float32))

    def embed(self, tokens: np.ndarray, threads: int = 0) -> np.ndarray:
        """(n, C) int64 token ids, -1 as padding → (n, dim) float32, each row of norm 1 (0 when empty).
        `threads=1`: one core and no OpenMP (what a forked worker must use); 0: numba's threads."""
        if not self.fitted:
            raise RetroError("the hashed embedder is not fitted: fit() it on a sample, or load() it from a database")
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        kernel = _embed_serial if threads == 1 else _embed_parallel
        return kernel(tokens, self.seed, self.bigram_weight, self.mean, self.components)

    def save(self, directory: Path) -> dict:
        """Write the fitted projection into `directory` (atomically); returns its sha256 for the manifest."""
        save_npy_atomic(directory / MEAN_FILE, self.mean)
        save_npy_atomic(directory / COMPONENTS_FILE, self.components)
        return {"projection_sha256": self.projection_sha256()}

    def load(self, directory: Path) -> HashedNgramEmbedder:
        """This embedder with the projection a build saved in `directory`, after checking its shapes."""
        mean_path, comp_path = directory / MEAN_FILE, directory / COMPONENTS_FILE
        if not (mean_path.is_file() and comp_path.is_file()):
            raise RetroError(f"{comp_path}: missing; the embeddings stage has not run: rerun build-knn with --resume")
        mean, comp = load_npy(mean_path, mmap=False), load_npy(comp_path, mmap=False)
        if mean.shape != (self.sketch_dim,) or comp.shape != (self.sketch_dim, self.dim) or comp.dtype != np.float32:
            raise RetroError(
                f"{comp_path}: a projection of shape {comp.shape}, expected ({self.sketch_dim}, {self.dim}); "
                "it belongs to another embedder: rebuild the embeddings stage in a new --output"
            )
        return replace(self, mean=mean, components=comp)

    def projection_sha256(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.mean).tobytes())
        h.update(np.ascontiguousarray(self.components).tobytes())
        return h.hexdigest()

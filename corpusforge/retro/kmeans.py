"""Two-level k-means for the coarse centroids of an IVF index with many lists.

faiss trains an IVF index's lists with one k-means of `nlist` centroids over the whole training sample (~64 vectors
a list): every iteration compares each sample vector with every centroid, so the cost grows as nlist². At 10M
chunks 16,384 lists took 261 s on 2 cores; 2^18 lists (autofaiss's choice from 300M) would take 256x that, ~19 h,
and 2^20, which faiss's guidelines ask for at 1e9 vectors and more, ~12 days.

Two levels (faiss.contrib.clustering.two_level_clustering, as faiss's billion-scale benchmarks train): k-means of
sqrt(nlist) centroids on the sample; each vector assigned to one of them; then, inside each of those clusters, a
k-means of as many centroids as its share of the sample asks for (rebalanced, so that they add up to nlist). Each
vector is compared with 2·sqrt(nlist) centroids an iteration instead of nlist.

Written here rather than called from faiss.contrib: its IVF helper asserts an L2 index (ours are inner product,
trained with spherical k-means as faiss's IVF does), prints to stdout, and does not seed the second level.
"""

from __future__ import annotations

import math

import numpy as np

from corpusforge.retro.common import through_pre_transform


def train_two_level(faiss, index, x: np.ndarray, seed: int, gpus: int = 0) -> None:
    """Train `index` (IVF, or IVF behind an OPQ/PCA pre-transform) on `x`, its coarse centroids from two-level
    k-means (on `gpus` GPUs, see gpu.py); the rest (PQ codebooks, OPQ rotation) as faiss's own train does it.

    Example: train_two_level(faiss, faiss.index_factory(128, "IVF16384_HNSW32,Flat"), sample, seed=0)"""
    inner, x = through_pre_transform(faiss, index, x, train=True)
    ivf = faiss.extract_index_ivf(inner)
    centroids = two_level_centroids(faiss, x, ivf.nlist, ivf.cp, seed, gpus)
    ivf.quantizer.train(centroids)
    ivf.quantizer.add(centroids)
    ivf.train(x)  # with a full quantizer faiss skips the coarse k-means and trains the rest (PQ, residuals)
    index.is_trained = True  # an IndexPreTransform around it: its chain and inner index are trained


def two_level_centroids(faiss, x: np.ndarray, nlist: int, cp, seed: int, gpus: int = 0) -> np.ndarray:
    """(nlist, d) float32 centroids: sqrt(nlist) first-level clusters of `x`, each split by its own k-means into
    centroids in proportion to its size. `cp`: the index's ClusteringParameters (iterations, spherical, points
    per centroid), so both levels cluster as faiss's IVF training would."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    first = max(1, min(nlist, math.isqrt(nlist)))
    coarse = _kmeans(faiss, x, first, cp, seed, gpus)
    _, assign = coarse.index.search(x, 1)
    assign = assign.ravel()
    sizes = np.bincount(assign, minlength=first)
    # second-level centroids per cluster, proportional to its size, adding up to nlist (faiss's "rebalance")
    per_cluster = np.diff(np.concatenate([[0], np.cumsum(sizes) * nlist // n]))
    order = np.argsort(assign, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for c in range(first):
        members = x[order[starts[c] : starts[c + 1]]]
        k = int(per_cluster[c])
        if k == 0:
            continue
        if k >= len(members):  # as many centroids as vectors: the vectors themselves
            out.append(np.resize(members, (k, d)))
            continue
        out.append(_kmeans(faiss, members, k, cp, seed + 1 + c, gpus).centroids)
    return np.ascontiguousarray(np.vstack(out), dtype=np.float32)


def _kmeans(faiss, x: np.ndarray, k: int, cp, seed: int, gpus: int = 0):
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=cp.niter,
        spherical=cp.spherical,
        max_points_per_centroid=cp.max_points_per_centroid,
        min_points_per_centroid=1,
        seed=seed,
        verbose=False,
        **({"gpu": gpus} if gpus else {}),  # faiss's Kmeans then assigns on a GPU flat index
    )
    km.train(x)
    return km

"""faiss-gpu in the index stage: the k-means of training and the list assignment of adding, on GPUs when faiss has
them (`pip install faiss-gpu-cu12` in place of faiss-cpu, on a machine with CUDA devices).

What runs on a GPU is the one operation both spend their time in: brute-force search of vectors against
centroids. Training keeps faiss's k-means (or kmeans.py's two levels) and gives it a GPU flat index to assign with,
as faiss's wiki recipe does (`clustering_index`); adding gives each vector the list of its exact nearest centroid,
searched on the GPU among all of them, in place of the HNSW coarse quantizer's approximate search, then encodes
and stores it on CPU (`add_preassigned`). OPQ, PQ codebooks, encoding, lists and the merge stay on CPU, so the
files have faiss's CPU layout and are searched on any machine.

The GPU and CPU paths run the same code: the tests run it with faiss's CPU flat index where a GPU clone would be
(byte for byte faiss's own train and add with a flat quantizer). It has not run on a GPU here: none was lent.
"""

from __future__ import annotations

import functools

import numpy as np

from corpusforge.retro.common import RetroError, import_faiss, through_pre_transform

GPU_CHOICES = ("auto", "on", "off")


def gpus_for(faiss, request: str) -> int:
    """The GPUs the index stage uses: every one faiss sees for 'auto', none for 'off'; 'on' with none is an error.

    Example: gpus_for(faiss, "auto") -> 0 with faiss-cpu"""
    if request not in GPU_CHOICES:
        raise RetroError(f"--gpu {request}: choose one of {', '.join(GPU_CHOICES)}")
    seen = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if request == "on" and not seen:
        raise RetroError(
            "--gpu on: faiss sees no GPU (faiss-cpu is installed, or no CUDA device is visible); install "
            "faiss-gpu-cu12 in place of faiss-cpu on a machine with a GPU, or use --gpu auto"
        )
    return 0 if request == "off" else seen


def flat_index(faiss, d: int, metric: int, gpus: int):
    """An empty brute-force index of `d` dimensions and `metric`, on `gpus` GPUs (0: here, on CPU)."""
    flat = faiss.IndexFlatIP(d) if metric == faiss.METRIC_INNER_PRODUCT else faiss.IndexFlatL2(d)
    return faiss.index_cpu_to_all_gpus(flat, ngpu=gpus) if gpus else flat


def train_with(faiss, index, gpus: int) -> None:
    """Make faiss's own k-means of `index`'s coarse centroids assign with a flat index on `gpus` GPUs, of the
    metric it would use: the quantizer's when the centroids are trained inside it, L2 when a quantizer that is
    filled afterwards (HNSW) takes them (faiss's Level1Quantizer::train_q1)."""
    ivf = faiss.extract_index_ivf(index)
    if ivf.quantizer_trains_alone == 1:  # the quantizer runs its own training: nothing to hand over
        return
    metric = ivf.quantizer.metric_type if ivf.quantizer_trains_alone == 0 else faiss.METRIC_L2
    ivf.clustering_index = flat_index(faiss, ivf.d, metric, gpus)


def centroid_index(faiss, index, gpus: int):
    """The trained `index`'s coarse centroids in a flat index of the quantizer's metric, on `gpus` GPUs."""
    quantizer = faiss.extract_index_ivf(index).quantizer
    flat = flat_index(faiss, quantizer.d, quantizer.metric_type, gpus)
    flat.add(quantizer.reconstruct_n(0, quantizer.ntotal))
    return flat


@functools.lru_cache(maxsize=1)
def cached_centroid_index(path: str, mtime_ns: int, gpus: int):
    """centroid_index of the trained index at `path`, once per process and file version: the add tasks of one
    build run one after another in the driver, and each would otherwise copy the centroids to the GPUs again."""
    faiss = import_faiss()
    return centroid_index(faiss, faiss.read_index(path), gpus)


def add_assigned(faiss, index, x: np.ndarray, ids: np.ndarray, centroids) -> None:
    """Add `x` with `ids` to the IVF `index` (or the IndexPreTransform around it), each vector into the list of its
    nearest centroid in `centroids` (centroid_index): faiss's add, with an exact assignment searched there.

    Example: add_assigned(faiss, index, x, np.arange(len(x)), centroid_index(faiss, index, gpus=1))"""
    inner, xt = through_pre_transform(faiss, index, x)
    ivf = faiss.extract_index_ivf(inner)
    _, lists = centroids.search(xt, 1)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    ivf.add_core(len(xt), faiss.swig_ptr(xt), faiss.swig_ptr(ids), faiss.swig_ptr(np.ascontiguousarray(lists[:, 0])))
    index.ntotal = inner.ntotal = ivf.ntotal

"""A batch search over on-disk inverted lists that reads every list once per batch, not once per query probing it.

faiss searches an IVF index query by query: each query reads its nprobe lists. With the lists in RAM that is the
right order; with them on disk, a batch of queries reads the same lists again and again, and at 10M chunks under a
3 GiB memory limit (IVF16384_HNSW32,Flat, 5.2 GB of lists) that made 1.1 queries/s against 152 in RAM
(knn-10m-ondisk-3g-2026-11-22.json): the neighbours stage could not run on an index larger than its RAM.

Here the batch is assigned to its lists first (the coarse quantizer, in RAM), then the lists are taken in groups
of consecutive list numbers, which `OnDiskInvertedLists.merge_from_multiple` lays out contiguously in
index.ivfdata: the next group is read ahead (POSIX_FADV_WILLNEED) while faiss's own `search_preassigned` scans
the current one for every query that probes it, and each query's hits are merged group by group. The distances
are faiss's, computed by the same code as `index.search`; only the order in which lists are visited differs, so
the k best are the same, in the same order, except where hits tie exactly at the k-th distance: faiss keeps the
first it meets, this search the one faiss's order of equal distances puts first (the larger id, for inner products).

Example: search_batch(index, queries, 40)[1].shape -> (len(queries), 40)
"""

from __future__ import annotations

import os

import numpy as np

from corpusforge.retro.common import import_faiss, through_pre_transform

# Bytes of lists per group: the group being scanned and the one read ahead stay in the page cache together
# (512 MB), small beside the 3 GiB the 10M benchmark ran in, and large enough that a group is read in long
# sequential requests (16384 lists of ~0.3 MB at 10M: 20 groups).
GROUP_BYTES = 256 << 20

# Rows merged at a time: the (rows, 2k) ids and distances of the best so far and a group's hits, ~31 MB at k=320.
MERGE_ROWS = 4096


def on_disk_lists(index):
    """The index's OnDiskInvertedLists, or None (not IVF, or lists in RAM)."""
    faiss = import_faiss()
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        return None
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    return lists if isinstance(lists, faiss.OnDiskInvertedLists) else None


def wants_list_major(index, n_queries: int) -> bool:
    """Whether a batch of `n_queries` reads less going list by list: its probes, in all, touch at least as many
    lists as the index has (one pass reads each list once; the per-query search would read each probed list)."""
    if on_disk_lists(index) is None:
        return False
    ivf = import_faiss().extract_index_ivf(index)
    return n_queries * min(ivf.nprobe, ivf.nlist) >= ivf.nlist


def search_batch(index, queries: np.ndarray, k: int):
    """(D, I) of `index.search(queries, k)`, list by list where that reads less (see wants_list_major).

    Example: search_batch(index, queries, 40)[1].shape -> (len(queries), 40)"""
    if wants_list_major(index, len(queries)):
        return search_list_major(index, queries, k)
    return index.search(np.ascontiguousarray(queries, dtype=np.float32), k)


def search_list_major(index, queries: np.ndarray, k: int, group_bytes: int = GROUP_BYTES):
    """(D, I) of `index.search(queries, k)` for an IVF index with on-disk lists, reading each list once.
    Hits tied at the k-th distance may differ: faiss keeps the first it meets, this the one its own order puts first."""
    faiss = import_faiss()
    ivf = faiss.extract_index_ivf(index)
    lists = on_disk_lists(index)
    _, x = through_pre_transform(faiss, index, queries)
    nprobe = min(ivf.nprobe, ivf.nlist)
    coarse_d, coarse_i = ivf.quantizer.search(x, nprobe)  # (n, nprobe): each query's lists, nearest first
    larger_first = ivf.metric_type == faiss.METRIC_INNER_PRODUCT
    best_d, best_i = _empty_hits(len(x), k, larger_first)
    groups = list_groups(lists, group_bytes)
    fd = os.open(lists.filename, os.O_RDONLY)
    try:
        _read_ahead(fd, groups[0])
        for g, (first, end, _lo, _hi) in enumerate(groups):
            if g + 1 < len(groups):
                _read_ahead(fd, groups[g + 1])
            rows, assign, dist = _assigned_to(coarse_i, coarse_d, first, end)
            if len(rows):
                d, i = _search_preassigned(faiss, ivf, x[rows], k, assign, dist)
                _merge_into(best_d, best_i, rows, d, i, larger_first)
    finally:
        os.close(fd)
    return best_d, best_i


def list_groups(lists, group_bytes: int) -> list[tuple[int, int, int, int]]:
    """(first list, end list, first byte, end byte) of consecutive lists of about `group_bytes` together, in
    index.ivfdata order; at least one list a group.

    Example: list_groups(lists, 256 << 20)[0] -> (0, 812, 0, 268304384)"""
    nlist = lists.nlist
    offset = np.fromiter((lists.lists.at(j).offset for j in range(nlist)), dtype=np.int64, count=nlist)
    span = np.fromiter((lists.lists.at(j).capacity for j in range(nlist)), dtype=np.int64, count=nlist)
    end_byte = offset + span * (lists.code_size + 8)  # a list: its codes, then its int64 ids
    groups, first = [], 0
    while first < nlist:
        end = max(first + 1, int(np.searchsorted(end_byte, offset[first] + group_bytes, side="right")))
        groups.append((first, end, int(offset[first]), int(end_byte[first:end].max())))
        first = end
    return groups


def _empty_hits(n: int, k: int, inner_product: bool) -> tuple[np.ndarray, np.ndarray]:
    return np.full((n, k), -np.inf if inner_product else np.inf, dtype=np.float32), np.full((n, k), -1, np.int64)


def _read_ahead(fd: int, group: tuple[int, int, int, int]) -> None:
    """Ask the kernel to read the group's bytes now, in the background: the lists are mapped MADV_RANDOM (see
    index._advise_random), so faiss's page faults alone would read them 4 KB at a time."""
    _, _, lo, hi = group
    if hi > lo and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)


def _assigned_to(coarse_i: np.ndarray, coarse_d: np.ndarray, first: int, end: int):
    """The queries probing a list in [first, end), and their probes there, packed left in probe order and padded
    with -1 (faiss skips those): (rows, (r, w) list numbers, (r, w) coarse distances), w the most any row has."""
    inside = (coarse_i >= first) & (coarse_i < end)
    count = inside.sum(1)
    rows = np.flatnonzero(count)
    width = int(count.max()) if len(rows) else 0
    assign = np.full((len(rows), width), -1, dtype=np.int64)
    dist = np.zeros((len(rows), width), dtype=np.float32)
    inside = inside[rows]
    col = np.cumsum(inside, 1) - 1  # each probe's place among its row's probes in the group
    r, c = np.nonzero(inside)
    assign[r, col[r, c]] = coarse_i[rows][r, c]
    dist[r, col[r, c]] = coarse_d[rows][r, c]
    return rows, assign, dist


def _search_preassigned(faiss, ivf, x: np.ndarray, k: int, assign: np.ndarray, dist: np.ndarray):
    """faiss's IVF scan over the given (query, list) probes; `assign` may be narrower than the index's nprobe, so
    the probe count goes in search parameters (the Python wrapper insists on the index's own). Parallel over
    queries: in faiss's default mode (0) search_preassigned runs on one thread, since `search` splits the queries
    over threads before calling it; mode 3 splits them inside, one query at a time (the same result)."""
    n, width = assign.shape
    d = np.empty((n, k), dtype=np.float32)
    i = np.empty((n, k), dtype=np.int64)
    params = faiss.SearchParametersIVF()
    params.nprobe = width
    params.max_codes = ivf.max_codes
    mode, ivf.parallel_mode = ivf.parallel_mode, 3
    try:
        ivf.search_preassigned_c(
            n,
            faiss.swig_ptr(x),
            k,
            faiss.swig_ptr(np.ascontiguousarray(assign)),
            faiss.swig_ptr(np.ascontiguousarray(dist)),
            faiss.swig_ptr(d),
            faiss.swig_ptr(i),
            False,
            params,
        )
    finally:
        ivf.parallel_mode = mode
    return d, i


def _merge_into(best_d, best_i, rows: np.ndarray, d: np.ndarray, i: np.ndarray, larger_first: bool) -> None:
    """best[rows] ← the k best of best[rows] and (d, i), in faiss's order: for inner products the largest first and,
    among equal distances, the larger id first; for L2 the smallest and the smaller id. Missing hits (id -1) last."""
    k = best_d.shape[1]
    sign = -1.0 if larger_first else 1.0
    for lo in range(0, len(rows), MERGE_ROWS):
        r = rows[lo : lo + MERGE_ROWS]
        all_d = np.concatenate([best_d[r], d[lo : lo + MERGE_ROWS]], 1)
        all_i = np.concatenate([best_i[r], i[lo : lo + MERGE_ROWS]], 1)
        missing = all_i < 0
        # lexsort: the last key is the primary one
        order = np.lexsort((sign * all_i, sign * all_d, missing), axis=1)[:, :k]
        best_d[r] = np.take_along_axis(all_d, order, 1)
        best_i[r] = np.take_along_axis(all_i, order, 1)

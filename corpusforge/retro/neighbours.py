"""Neighbour search (approximate candidates, exact re-rank, same-document exclusion) and the neighbours file.

`DB/neighbours.bin`, little-endian:

    offset  size      field
    0       8         magic b"CFRKNN\\x00\\x01"
    8       8   <Q    version, 1
    16      8   <Q    Q, the number of query chunks (rows)
    24      8   <Q    K, neighbours per query
    32      32        zero padding (the table starts 64-byte aligned)
    64      8*Q*K     int64 (Q, K): DB chunk ids, nearest first; -1 where fewer than K chunks qualify

Row q belongs to chunk q of the query chunk table (the DB's own table unless another dataset was given).
The stage runs as tasks on the build's executor (local processes or Ray): task b searches query chunks
[b·block, (b+1)·block) and writes `neighbours.bin.parts/part_b.npy`; the file is the parts in order. Every
block is searched alone, as in one process, so the bytes do not depend on the executor or the workers.
Exclusion is by document id: a DB chunk whose document is the query's document is never a neighbour, however
many near-duplicate chunks that document has (the search widens until K others are found or the index is
exhausted). It never assumes the first hit is the query itself.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.fsutil import atomic_write, remove_leftovers, save_npy_atomic
from corpusforge.retro.common import RetroError, faiss_threads, load_npy, open_dataset
from corpusforge.retro.embed import Embedder, EmbeddingStore
from corpusforge.retro.index import format_params, parse_params, set_search_params
from corpusforge.retro.listmajor import search_batch
from corpusforge.stages import DriverExecutor, run_tasks

MAGIC = b"CFRKNN\x00\x01"
HEADER = 64
MAX_CANDIDATES = 4096
# Candidate vectors gathered at a time for the exact re-rank, float32 (rows, candidates, d): ~64 MB, 128 queries at
# 1024 candidates and d=128. A neighbours task of 65,536 queries gathering all at once needed 10.7 GB at 320.
GATHER_BYTES = 64 << 20


@dataclass(frozen=True)
class Database:
    """What queries are searched against: the Faiss index, the stored embeddings its hits are re-ranked with, and
    the document of every DB chunk (for the same-document exclusion).

    Example: search(Database(index, store, table.doc), queries, query_doc, k=2, candidates=40)"""

    index: Any
    store: EmbeddingStore
    doc: np.ndarray


def search(
    db: Database, queries: np.ndarray, query_doc: np.ndarray | None, k: int, candidates: int, params: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """K nearest DB chunks of each query vector: `candidates` approximate hits re-ranked exactly on the stored
    embeddings, chunks of `query_doc` excluded (None: no exclusion). Returns (ids int64, scores float32), (Q, K).

    Queries whose candidate list was full of same-document chunks are searched again with 4x the candidates."""
    index, store, db_doc = db.index, db.store, db.doc
    q = len(queries)
    ids = np.full((q, k), -1, dtype=np.int64)
    scores = np.full((q, k), -np.inf, dtype=np.float32)
    todo = np.arange(q)
    width = max(candidates, k)
    while len(todo):
        _set_width(index, params, width)
        _, cand = search_batch(index, queries[todo], width)
        top_ids, top_scores, valid = _rerank(
            store, db_doc, queries[todo], cand, None if query_doc is None else query_doc[todo], k
        )
        ids[todo], scores[todo] = top_ids, top_scores
        # widen only where exclusion may have hidden real neighbours: fewer than k valid and a full list
        short = (valid < k) & (cand[:, -1] >= 0)
        if width >= min(MAX_CANDIDATES, store.n) or not short.any():
            break
        todo, width = todo[short], min(width * 4, MAX_CANDIDATES, store.n)
    return ids, scores


def _set_width(index, params: str, width: int) -> None:
    """HNSW returns at most efSearch hits: keep efSearch >= the candidates asked for."""
    if "efSearch" in params and not params.startswith("nprobe"):
        parts = parse_params(params)
        parts["efSearch"] = str(max(int(parts["efSearch"]), width))
        params = format_params(parts)
    set_search_params(index, params)


def search_prefixes(
    db: Database, queries: np.ndarray, query_doc: np.ndarray | None, k: int, params: str, widths: list[int]
) -> dict[int, np.ndarray]:
    """For each width w in `widths`, the K ids that re-ranking the first w candidates gives, from one search at the
    widest: an IVF search's first w hits at width W are its hits at width w (the recall tuning's shortcut; no
    widening for same-document hits, which `search` adds).

    Example: search_prefixes(Database(index, store, doc), q, qdoc, 10, "nprobe=64", [40, 60])[60].shape -> (len(q), 10)
    """
    index, store, db_doc = db.index, db.store, db.doc
    set_search_params(index, params)
    _, cand = search_batch(index, queries, max(widths))
    out = {w: np.empty((len(queries), k), dtype=np.int64) for w in widths}
    for rows in _row_blocks(cand.shape, store.dim):
        qd = None if query_doc is None else query_doc[rows]
        exact, _ = _exact_scores(store, db_doc, queries[rows], cand[rows], qd)
        for w in widths:
            out[w][rows] = _top_k(cand[rows, :w], exact[:, :w], k)[0]
    return out


def _row_blocks(shape: tuple[int, int], dim: int) -> list[slice]:
    """Slices of the rows of a (queries, candidates) array whose candidate vectors fill about GATHER_BYTES."""
    step = max(1, GATHER_BYTES // max(1, shape[1] * dim * 4))
    return [slice(lo, lo + step) for lo in range(0, shape[0], step)]


def _rerank(store, db_doc, queries, cand, query_doc, k):
    """The k best candidates of each query by exact score, and how many candidates were not excluded."""
    ids, scores = np.empty((len(cand), k), np.int64), np.empty((len(cand), k), np.float32)
    valid = np.empty(len(cand), np.int64)
    for rows in _row_blocks(cand.shape, store.dim):
        qd = None if query_doc is None else query_doc[rows]
        exact, bad = _exact_scores(store, db_doc, queries[rows], cand[rows], qd)
        ids[rows], scores[rows] = _top_k(cand[rows], exact, k)
        valid[rows] = (~bad).sum(1)
    return ids, scores, valid


def _exact_scores(store, db_doc, queries, cand, query_doc) -> tuple[np.ndarray, np.ndarray]:
    """Exact similarities of the (q, c) candidates to their queries, -inf where excluded; and the excluded mask."""
    vectors = store.get(cand)  # (q, c, d) float32
    exact = np.einsum("qcd,qd->qc", vectors, np.asarray(queries, dtype=np.float32))
    bad = cand < 0
    if query_doc is not None:
        bad |= db_doc[np.maximum(cand, 0)] == query_doc[:, None]
    exact[bad] = -np.inf
    return exact, bad


def _top_k(cand, exact, k):
    # stable sort on (-score, id): ties broken by chunk id, so results never depend on the index's order
    order = np.lexsort((cand, -exact), axis=1)[:, :k]
    top_ids = np.take_along_axis(cand, order, 1)
    top_scores = np.take_along_axis(exact, order, 1)
    top_ids[~np.isfinite(top_scores)] = -1
    if top_ids.shape[1] < k:
        pad = k - top_ids.shape[1]
        top_ids = np.pad(top_ids, ((0, 0), (0, pad)), constant_values=-1)
        top_scores = np.pad(top_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
    return top_ids, top_scores.astype(np.float32)


def exact_search(store: EmbeddingStore, db_doc, queries, query_doc, k: int) -> np.ndarray:
    """Brute-force K nearest with the same exclusion, block by block over all stored embeddings (the reference)."""
    q = len(queries)
    best_s = np.full((q, k), -np.inf, dtype=np.float32)
    best_i = np.full((q, k), -1, dtype=np.int64)
    queries = np.asarray(queries, dtype=np.float32)
    for first, block in store.blocks(rows=1 << 16):  # (q, 65536) scores: 256 MB at 1,000 queries, not 1 GB
        s = queries @ block.T  # (q, rows)
        if query_doc is not None:
            s[db_doc[first : first + len(block)][None, :] == query_doc[:, None]] = -np.inf
        if s.shape[1] > k:  # keep each row's k best of the block before the (k + k)-wide exact merge
            part = np.argpartition(-s, k - 1, axis=1)[:, :k]
            s, ids = np.take_along_axis(s, part, 1), part + first
        else:
            ids = np.broadcast_to(np.arange(first, first + len(block)), s.shape)
        all_s, all_i = np.concatenate([best_s, s], 1), np.concatenate([best_i, ids], 1)
        order = np.lexsort((all_i, -all_s), axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(all_s, order, 1), np.take_along_axis(all_i, order, 1)
    best_i[~np.isfinite(best_s)] = -1
    return best_i


def recall_at(approx: np.ndarray, exact: np.ndarray, scores=None, tol: float = 1e-5) -> float:
    """Recall of `approx` (Q, k) ids against the reference `exact` (Q, k), ignoring -1 in the reference.

    Without `scores`: |approx ∩ exact| / |exact|. With `scores(ids) -> (Q, k)` exact similarities to the queries:
    a found chunk counts when its score reaches the reference's k-th score (less `tol`), as ann-benchmarks counts
    ties. Real corpora repeat text (licences, boilerplate), so a chunk often has more than k identical chunks in
    other documents; any k of them are right, and which ids the reference lists is an accident of tie-breaking.

    Example: recall_at(np.array([[1, 2]]), np.array([[1, 3]])) -> 0.5"""
    if scores is None:
        hits = total = 0
        for a, e in zip(approx, exact):
            e = e[e >= 0]
            hits += len(np.intersect1d(a[a >= 0], e))
            total += len(e)
        return hits / total if total else 1.0
    if not (exact >= 0).any():
        return 1.0
    valid_e, valid_a = exact >= 0, approx >= 0
    s_e, s_a = scores(np.maximum(exact, 0)), scores(np.maximum(approx, 0))
    kth = np.where(valid_e, s_e, np.inf).min(1)  # the k-th (last valid) reference score of each row
    hits = ((s_a >= kth[:, None] - tol) & valid_a).sum(1)
    total = valid_e.sum(1)
    return float(np.minimum(hits, total).sum() / total.sum()) if total.sum() else 1.0


# -- the stage and the file ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryChunks:
    """Another dataset's chunks as the queries: embedded inside each task, never stored."""

    prefix: str
    """The training dataset (PREFIX.bin/.idx) the chunks point into."""
    chunks: str
    """Its chunk table (DB/query_chunks)."""
    embedder: Embedder
    """The database's fitted embedder."""
    chunk_length: int


@dataclass(frozen=True)
class NeighbourJob:
    """What every neighbours task needs, as plain data: it pickles to a forked worker or a Ray node. Paths are
    absolute (a Ray task may run on another node sharing the file system)."""

    index: str
    """DB/index/index.faiss."""
    params: str
    """Tuned search parameters (faiss ParameterSpace string)."""
    chunks: str
    """The database's chunks/ directory: the document of every DB chunk, for the exclusion."""
    embeddings: str
    dim: int
    shard_size: int
    parts: str
    """Where task b writes part_b.npy: int64 (rows, K)."""
    k: int
    candidates: int
    queries: QueryChunks | None = None
    """None: the database's own chunks, their stored embeddings, with same-document exclusion."""


def neighbours_range(job: NeighbourJob, task: tuple[int, int, int], ctx=None) -> int:
    """One task: the neighbours of query chunks [lo, hi) → parts/part_NNNNN.npy (atomically); returns its rows.

    Example (what an executor calls): neighbours_range(job, (2, 131072, 196608), TaskContext(report=print)) -> 65536
    """
    from corpusforge.retro.chunks import ChunkTable
    from corpusforge.retro.index import shared_index

    b, lo, hi = task
    threads = ctx.threads if ctx is not None else 0
    table = ChunkTable.load(Path(job.chunks))
    store = EmbeddingStore(Path(job.embeddings), len(table), job.dim, job.shard_size)
    if job.queries is None:
        vectors, query_doc = store.get(np.arange(lo, hi)), np.asarray(table.doc[lo:hi])
    else:  # another dataset's documents are not the DB's: nothing to exclude by document
        vectors, query_doc = _embed_queries(job.queries, lo, hi, threads), None
    # one OpenMP thread in a forked worker: see common.faiss_threads
    with faiss_threads(threads):
        index = shared_index(job.index, os.stat(job.index).st_mtime_ns)
        ids, _ = search(Database(index, store, table.doc), vectors, query_doc, job.k, job.candidates, job.params)
    save_npy_atomic(_part(job, b), ids)
    if ctx is not None and ctx.report:
        ctx.report(hi - lo)
    return hi - lo


def _part(job: NeighbourJob, b: int) -> Path:
    return Path(job.parts) / f"part_{b:05d}.npy"


def _embed_queries(queries: QueryChunks, lo: int, hi: int, threads: int) -> np.ndarray:
    from corpusforge.retro.chunks import ChunkTable
    from corpusforge.retro.hashed import HashedNgramEmbedder

    qtable = ChunkTable.load(Path(queries.chunks))
    tokens = qtable.tokens(open_dataset(queries.prefix).tokens, np.arange(lo, hi), queries.chunk_length)
    if isinstance(queries.embedder, HashedNgramEmbedder):  # serial numba in a forked worker (see hashed.py)
        return queries.embedder.embed(tokens, threads=threads)
    return queries.embedder.embed(tokens)


def build_neighbours(job: NeighbourJob, n: int, path: Path, block: int, executor=None, progress=None) -> dict:
    """The neighbours stage: blocks of `block` query chunks as tasks on `executor` (default: this process), each
    writing `path.parts/part_NNNNN.npy` (kept on resume) → `path` with its header, the parts in order. Without an
    executor the tasks run in this process.

    Example: build_neighbours(job, 10**6, Path("db/neighbours.bin"), 65536, executor)["queries"] -> 1000000"""
    parts = Path(job.parts)
    parts.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parts)  # a killed task's part_NNNNN.npy.PID.HEX.tmp
    tasks = [(b, lo, min(n, lo + block)) for b, lo in enumerate(range(0, n, block))]

    def finished(task: tuple[int, int, int]) -> int | None:  # a part is written whole: its file is its done marker
        return task[2] - task[1] if _part(job, task[0]).exists() else None

    # no executor: here, with all this process's threads (a model embedder, torch, maybe a GPU, stays here)
    t0 = time.perf_counter()
    run = run_tasks(
        partial(neighbours_range, job),
        tasks,
        executor or DriverExecutor(),
        finished=finished,
        progress=progress,
        count=int,
    )
    _write_file(path, [_part(job, b) for b, _, _ in tasks], n, job.k)
    for p in parts.iterdir():
        p.unlink()
    parts.rmdir()
    seconds = time.perf_counter() - t0
    served = sum(run.ran)
    return {
        "queries": n,
        "k": job.k,
        "seconds": round(seconds, 3),
        "queries_per_s": round(served / seconds) if served else None,
        "tasks": run.tasks,
        "executor": run.executor,
        "workers": run.workers,
    }


def _write_file(path: Path, parts: list[Path], n: int, k: int) -> None:
    """The header, then the parts' rows in order, as one file that appears whole (see the module docstring)."""
    with atomic_write(path) as f:
        f.write(MAGIC + struct.pack("<QQQ", 1, n, k) + bytes(HEADER - len(MAGIC) - 24))
        for p in parts:
            f.write(memoryview(np.ascontiguousarray(load_npy(p, mmap=False), dtype="<i8")))


# Neighbour ids checked at a time when a file is opened: 64 MiB of int64, a fraction of a second from the page cache.
CHECK_BLOCK = 8 << 20
_checked: set[tuple] = set()  # (path, size, mtime, chunks) of files whose ids were found in range, in this process


def read_neighbours(path: Path, n_chunks: int | None = None) -> np.ndarray:
    """The (Q, K) int64 memmap of a neighbours file, after checking its header against its size and, given the
    database's number of chunks `n_chunks`, every id against it (-1, no neighbour, or 0..n_chunks-1): a file damaged
    in place is refused at open, naming its first bad row, not met as an IndexError in the middle of a training run.

    Example: read_neighbours(Path("db/neighbours.bin"), n_chunks=len(ChunkTable.load("db/chunks"))).shape -> (Q, K)"""
    with open(path, "rb") as f:
        head = f.read(HEADER)
    if len(head) < HEADER or head[:8] != MAGIC:
        raise RetroError(f"{path}: not a corpusforge neighbours file (magic {head[:8]!r})")
    version, n, k = struct.unpack_from("<QQQ", head, 8)
    if version != 1:
        raise RetroError(f"{path}: neighbours file version {version}; this corpusforge reads version 1")
    size = path.stat().st_size
    if size != HEADER + 8 * n * k:
        raise RetroError(f"{path}: {size} bytes, but its header promises {n} x {k} neighbours; the file is truncated")
    if n * k == 0:
        return np.zeros((n, k), dtype=np.int64)
    table = np.memmap(path, dtype="<i8", mode="r", offset=HEADER, shape=(n, k))
    if n_chunks is not None:
        _check_ids(path, table, n_chunks)
    return table


def _check_ids(path: Path, table: np.ndarray, n_chunks: int) -> None:
    """Every id of `table` is -1 or a chunk of the database, or a RetroError naming the first row that is not;
    a file found good is not read again in this process while its size and time stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, n_chunks)
    if key in _checked:
        return
    flat = table.reshape(-1)
    for lo in range(0, len(flat), CHECK_BLOCK):
        block = np.asarray(flat[lo : lo + CHECK_BLOCK])
        if block.min() >= -1 and block.max() < n_chunks:
            continue
        at = lo + int(np.argmax((block < -1) | (block >= n_chunks)))
        row, k = divmod(at, table.shape[1])
        raise RetroError(
            f"{path}: row {row} holds neighbour id {int(flat[at])} (column {k}), but the database has {n_chunks} "
            f"chunks (ids 0 to {n_chunks - 1}, -1 for none): the file is damaged; restore it, or build the database "
            f"again with corpusforge build-knn into a new --output"
        )
    _checked.add(key)

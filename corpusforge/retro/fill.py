"""Filling a trained IVF index as independent add tasks, then merging their parts (in RAM, or on disk).

    index/trained.faiss         the trained, empty index (written by the driver before any task starts)
    index/part_NNNNN.faiss      task N's vectors: a copy of trained.faiss holding rows [lo, hi) with their ids
    index/index.faiss           the merged index; with on-disk inverted lists also index/index.ivfdata

A task (`add_range`) loads trained.faiss, adds one range of `ADD_ROWS` rows of one embedding shard with their
chunk ids, and writes its part atomically; a finished part is skipped when the stage is resumed. The ranges are
fixed by N and the shard size alone (never by the number of workers), and they are the blocks the one-process
fill added, so every vector meets the same quantizer arithmetic: the merged bytes do not depend on the executor
or on how many workers ran it. The merge adds the parts' inverted lists in task order, which is what one
`add_with_ids` over all rows in order gives (an IVF list holds its entries in insertion order).

HNSW and Flat indexes have no inverted lists to merge (faiss cannot merge two HNSW graphs), so they are filled by
`build_index` in one task in the driver; see index.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpusforge.fsutil import atomic_path
from corpusforge.retro.common import (
    c_stdout_to_stderr,
    faiss_threads,
    import_faiss,
    load_npy,
    through_pre_transform,
)
from corpusforge.retro.embed import shard_path
from corpusforge.retro.fastscan import pack_lists, plain_twin
from corpusforge.retro.gpu import add_assigned, cached_centroid_index

# Rows per add task: the block size of the one-process fill (so the bytes are those it wrote); at 100k vectors/s
# per core (IVF-Flat) a task takes ~3 s, long beside loading trained.faiss and short enough to spread.
ADD_ROWS = 1 << 18


@dataclass(frozen=True)
class AddJob:
    """What every add task needs, as plain data: it pickles to a forked worker or a Ray node."""

    embeddings: str
    """The database's embeddings/ directory (absolute: a Ray task may run on another node)."""
    directory: str
    """The database's index/ directory: trained.faiss is read from it, parts are written to it."""
    shard_size: int
    gpus: int = 0
    """GPUs that assign each vector its list (gpu.py); the tasks then run one after another in the driver, which
    holds the GPUs (a forked worker cannot use the CUDA context of its parent)."""


def add_tasks(n: int, shard_size: int, rows: int = ADD_ROWS) -> list[tuple[int, int, int]]:
    """Tasks (i, lo, hi): ranges of at most `rows` vectors that never cross an embedding shard.

    Example: add_tasks(700, 256, 200) -> [(0, 0, 200), (1, 200, 256), (2, 256, 456), (3, 456, 512), (4, 512, 700)]
    """
    tasks = []
    for first in range(0, n, shard_size):
        end = min(n, first + shard_size)
        for lo in range(first, end, rows):
            tasks.append((len(tasks), lo, min(end, lo + rows)))
    return tasks


def part_path(directory: Path, task: int) -> Path:
    return directory / f"part_{task:05d}.faiss"


def add_range(job: AddJob, task: tuple[int, int, int], ctx=None) -> int:
    """One task: rows [lo, hi) of the embeddings, with their ids, into a copy of trained.faiss → part_NNNNN.faiss.
    Returns the rows added.

    Example (what an executor calls): add_range(job, (3, 786432, 1048576), TaskContext(report=print)) -> 262144"""
    faiss = import_faiss()
    i, lo, hi = task
    directory = Path(job.directory)
    shard = lo // job.shard_size
    first = shard * job.shard_size
    block = np.asarray(load_npy(shard_path(Path(job.embeddings), shard))[lo - first : hi - first], dtype=np.float32)
    # One OpenMP thread in a forked worker: GNU OpenMP hangs a child whose parent already ran a parallel region
    # (the driver trained the index) as soon as the child starts one with more threads.
    with faiss_threads(ctx.threads if ctx is not None else 0):
        trained = directory / "trained.faiss"
        index = faiss.read_index(str(trained))
        ids = np.arange(lo, hi, dtype=np.int64)
        inner = faiss.downcast_index(faiss.extract_index_ivf(index))
        part = index
        if isinstance(inner, faiss.IndexIVFPQFastScan):  # its lists cannot be merged: encode into a plain twin
            part = plain_twin(faiss, inner)
            block = through_pre_transform(faiss, index, block)[1]
        if job.gpus:
            centroids = cached_centroid_index(str(trained), trained.stat().st_mtime_ns, job.gpus)
            add_assigned(faiss, part, block, ids, centroids)
        else:
            part.add_with_ids(block, ids)
    write_index_atomic(faiss, part, part_path(directory, i))
    if ctx is not None and ctx.report:
        ctx.report(hi - lo)
    return hi - lo


def merge_parts(directory: Path, tasks: int, on_disk: bool) -> None:
    """trained.faiss + the parts' inverted lists, in task order → index.faiss (and index.ivfdata when `on_disk`).

    In RAM, the merged lists live in the index file; on disk, they are written to index.ivfdata (faiss's
    OnDiskInvertedLists, as `faiss.contrib.ondisk.merge_ondisk` does) and the index file holds only their offsets,
    so merging and searching need the quantizer in RAM, not the lists: the parts are read memory-mapped. A fast-scan
    index's parts are plain IVFPQ lists: merged on disk into a scratch file, then packed into its blocks in RAM
    (fastscan.py), so the merge holds the packed lists and not a second copy."""
    faiss = import_faiss()
    merged = faiss.read_index(str(directory / "trained.faiss"))
    ivf = faiss.downcast_index(faiss.extract_index_ivf(merged))
    parts = [part_path(directory, t) for t in range(tasks)]
    if isinstance(ivf, faiss.IndexIVFPQFastScan):
        plain = plain_twin(faiss, ivf)
        scratch = directory / "plain.ivfdata.tmp"  # a leftover *.tmp is removed when the stage starts again
        _merge_on_disk(faiss, plain, parts, scratch)
        pack_lists(faiss, ivf, plain)
        del plain
        scratch.unlink()
    elif on_disk:
        data = directory / "index.ivfdata"
        with atomic_path(data) as tmp:  # the lists stay mapped through the rename (same inode)
            ondisk = _merge_on_disk(faiss, ivf, parts, tmp)
        ondisk.filename = str(data)  # what index.faiss records; load_index finds it beside index.faiss wherever it is
    else:
        for path in parts:
            part = faiss.read_index(str(path))  # held while its lists are merged: the IVF view does not own it
            ivf.merge_from(faiss.extract_index_ivf(part), 0)
    merged.ntotal = ivf.ntotal
    write_index_atomic(faiss, merged, directory / "index.faiss")


def _merge_on_disk(faiss, ivf, parts: list[Path], path: Path):
    """The parts' lists, in order, merged into OnDiskInvertedLists at `path`, which become `ivf`'s lists (owned by
    it); returns them."""
    keep, lists = [], faiss.InvertedListsPtrVector()
    for part_file in parts:
        part = faiss.read_index(str(part_file), faiss.IO_FLAG_MMAP)
        keep.append(part)  # the part owns its lists: it must outlive the merge
        lists.push_back(faiss.extract_index_ivf(part).invlists)
    with c_stdout_to_stderr():
        ondisk = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(path))
        ivf.ntotal = ondisk.merge_from_multiple(lists.data(), lists.size(), False)
    ivf.replace_invlists(ondisk, True)
    ondisk.this.disown()
    return ondisk


def write_index_atomic(faiss, index, path: Path) -> None:
    """faiss.write_index to `path`, whole or not at all (fsutil.atomic_path: a failed write leaves no temporary)."""
    with atomic_path(path) as tmp:
        faiss.write_index(index, str(tmp))

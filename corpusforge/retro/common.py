"""What every stage shares: the error type, the database's JSON, reading arrays and datasets, the data fingerprint,
and faiss's threads and stdout. Files are written through corpusforge.fsutil (atomic, removed on an exception)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np

from corpusforge import indexed, sizes
from corpusforge.errors import CorpusforgeError, PickleRefusedError, pickle_refused, refuses_pickle
from corpusforge.fsutil import write_json_atomic


class RetroError(CorpusforgeError, ValueError):
    """Bad input or configuration of a retrieval build; the message is the one line a person needs."""


def write_json(path: Path, data: dict) -> None:
    """A database's JSON (the manifest) whole or not at all, in the bytes every database has had: indent 1, sorted
    keys, a final newline.

    Example: write_json(Path("db/manifest.json"), {"version": 1, "stages": {}})"""
    write_json_atomic(path, data, sort_keys=True, newline=True)


def load_npy(path: Path, mmap: bool = True) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as e:
        if refuses_pickle(e):
            raise PickleRefusedError(pickle_refused(path, "delete the database and build it again")) from None
        raise


def open_dataset(prefix: str | os.PathLike) -> indexed.IndexedDataset:
    """Open a token dataset, with one line naming the missing file rather than a traceback."""
    prefix = os.fspath(prefix)
    indexed.require_pair(prefix, "a dataset")  # the one resolver: an interrupted write, `out/tiny` meant, ...
    return indexed.IndexedDataset(prefix)


def data_fingerprint(prefix: str | os.PathLike) -> dict:
    """What identifies the token data, in O(index size): sha256 of the .idx, and the .bin's size and edges.

    Reading the whole .bin (TBs) to resume a stage would cost more than most stages; the .idx holds every length
    and the edges of the .bin catch a re-tokenised file of the same size."""
    prefix = os.fspath(prefix)
    h = hashlib.sha256()
    with open(indexed.idx_path(prefix), "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    bin_path = indexed.bin_path(prefix)
    size = bin_path.stat().st_size
    with open(bin_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return {"prefix": os.path.abspath(prefix), "bin_bytes": size, "sha256": h.hexdigest()}


def parse_bytes(text: str | int) -> int:
    """'16G', '512M', '3.5GB', '1e9' → bytes (powers of 1024 for K/M/G/T)."""
    try:
        return sizes.parse_size(text, minimum=1)  # inf, nan, negatives and '1e400k' refused here too
    except ValueError as e:
        raise RetroError(str(e)) from None


def import_faiss():
    try:
        import faiss
    except ImportError:
        raise RetroError("faiss is not installed; `pip install -e '.[retro]'` (faiss-cpu) fixes it") from None
    return faiss


def through_pre_transform(faiss, index, x: np.ndarray, train: bool = False):
    """(the index inside an IndexPreTransform, `x` through its chain of OPQ/PCA transforms); the index itself and
    `x` unchanged when there is no chain. `train`: train each untrained transform on its input first, in order.

    Example: through_pre_transform(faiss, faiss.index_factory(128, "OPQ32_128,IVF64,PQ32"), x)[1].shape[1] -> 128"""
    index = faiss.downcast_index(index)
    if not isinstance(index, faiss.IndexPreTransform):
        return index, np.ascontiguousarray(x, dtype=np.float32)
    for t in range(index.chain.size()):
        transform = faiss.downcast_VectorTransform(index.chain.at(t))
        if train and not transform.is_trained:
            transform.train(x)
        x = transform.apply(x)
    return index.index, np.ascontiguousarray(x, dtype=np.float32)


@contextlib.contextmanager
def faiss_threads(threads: int):
    """faiss's OpenMP threads set to `threads` inside the block (0: leave them), restored after.

    A task in a forked local worker gets threads=1, and must: GNU OpenMP (libgomp, bundled with faiss-cpu) keeps
    the parent's thread pool in its state across fork, so a child whose parent already ran a parallel region (the
    driver trained the index, tuned recall) hangs at its first parallel region of more than one thread. With one
    thread libgomp runs the region in the calling thread and never touches the pool; tests/retro check it with real
    forked workers. The same holds for the OpenMP build of OpenBLAS that faiss-cpu bundles."""
    if threads <= 0:
        yield
        return
    faiss = import_faiss()
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


@contextlib.contextmanager
def c_stdout_to_stderr():
    """Inside the block, what C code prints on stdout goes to stderr. faiss's on-disk inverted lists printf
    ("resizing ... bytes", "IO_FLAG_ONDISK_SAME_DIR: updating ondisk filename ...") to file descriptor 1, which
    is where `--json` writes its summary."""
    import ctypes
    import sys

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)  # C's stdout buffer, before fd 1 points at stdout again
        os.dup2(saved, 1)
        os.close(saved)

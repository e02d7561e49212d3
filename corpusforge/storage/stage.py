"""Staging a blend to node-local disk while training reads it (StorageConfig.local_cache_staging = "background").

Each dataset is opened from its source (CephFS, Lustre, an object store) and read through a StagedBinReader; one
process per node (whoever holds `{local_cache_dir}/stage-{hash}.lock`, a non-blocking flock retried every few
seconds, so a dead stager is replaced) copies the blend's datasets into the local cache tier (LocalCache: its
per-entry locks, verification and LRU) in the order the blend first reads them, from the read position on. Each
reader switches to its dataset's local copy at its first read after the copy is complete and verified: the steps
before read the source, the steps after read local disk. Progress is written to `{local_cache_dir}/stage-{hash}.json`
(datasets and bytes done, of the total, MB/s) after every dataset, for anyone to read (`cat`, the trainer's log).

Example:
    >>> storage = StorageConfig(local_cache_dir="/nvme/cf-cache", local_cache_staging="background")
    >>> train, _, _ = build_gpt_datasets(blend, 2048, num_samples=(n, 0, 0), storage=storage)  # starts staging
    >>> wait_for_staging()          # optional: block until every dataset is local
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from corpusforge.fsutil import flock, write_json_atomic
from corpusforge.indexed import BinReader, IndexedDataset
from corpusforge.storage.config import StorageConfig
from corpusforge.storage.local_cache import LocalCache
from corpusforge.storage.readers import LOCAL_READERS

# How often a reader whose copy is not there yet looks again (a stat of a local file; the stager in this process
# tells its readers at once).
CHECK_EVERY_S = 0.5
# How often a process that is not the stager tries to become it (the stager may have died).
RETRY_STAGER_S = 3.0

_THREADS: list[threading.Thread] = []


class StagedBinReader(BinReader):
    """The .bin of a dataset being staged: read from `source_reader` until its local copy is complete and verified,
    then from the copy (pinned against eviction), memory-mapped: `memory` is then the copy's tokens, so samples are
    gathered straight from the map as from any local dataset. The switch happens in read_spans, in the thread that
    reads; `owners` (the GPTDatasets over this reader, registered by the builder) are told then (see _switched).

    Example:
        >>> reader = StagedBinReader(ds.reader, LocalCache("/nvme/cf-cache"), "/cephfs/a_text_document", idx_bytes)
    """

    def __init__(self, source_reader: BinReader, cache: LocalCache, source: str, idx_bytes: int) -> None:
        super().__init__(source_reader.location, source_reader.dtype, source_reader.nbytes)
        self.remote = source_reader.remote
        self.read_mode, self.read_mode_reason = source_reader.read_mode, source_reader.read_mode_reason
        self.source, self.cache, self.idx_bytes = source, cache, idx_bytes
        self._source, self._local, self._pin = source_reader, None, None
        self._next_check = 0.0
        self.staged = threading.Event()  # set by this process's stager when the copy is complete
        self.owners: list[weakref.ref] = []

    @property
    def memory(self) -> np.ndarray | None:  # type: ignore[override]
        return None if self._local is None else self._local.memory

    @property
    def memory_location(self) -> str:
        return self.location if self._local is None else self._local.location

    def _switched(self) -> None:
        """GPTDataset remembers whether its reader has a memory map (its _direct_args cache, made at its first
        batch, from the source): forget it, so that its next batch takes the memory-map path of the copy. Called
        in the reading thread, between two batches of that dataset."""
        for ref in self.owners:
            owner = ref()
            if owner is not None:
                owner.reader_changed()

    def _current(self, switch: bool = True) -> BinReader:
        if self._local is not None or not switch:
            return self._local or self._source
        now = time.monotonic()
        if self.staged.is_set() or now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            found = self.cache.pin_if_complete(self.source, {"bin": self.nbytes, "idx": self.idx_bytes})
            if found is not None:
                path, self._pin = found
                self._local = LOCAL_READERS["mmap-random"](f"{path}.bin", self.dtype, "mmap-random",
                                                           "staged to local disk", self.nbytes)  # fmt: skip
                self._source.close()
                self._switched()
                return self._local
        return self._source

    @property
    def local(self) -> bool:
        """Whether reads now go to the local copy."""
        return self._local is not None

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return self._current().read_spans(starts, lengths)

    def prefetch_spans(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        self._current(switch=False).prefetch_spans(starts, lengths)

    def token_sample(self) -> tuple[np.ndarray, np.ndarray]:
        return self._source.token_sample()

    def load_kernels(self) -> None:
        self._source.load_kernels()

    def describe(self) -> str:
        where = "local copy" if self._local is not None else "source until staged"
        return f"{self._current(switch=False).describe()} [{where}]"

    def close(self) -> None:
        self._source.close()
        if self._local is not None:
            self._local.close()
        if self._pin is not None:
            self._pin.close()


def wrap_for_staging(datasets: Sequence[IndexedDataset], config: StorageConfig) -> None:
    """Give each dataset not yet complete in the local cache a StagedBinReader (those already staged are reopened
    from their copy by the caller, see storage.datasets)."""
    assert config.local_cache_dir is not None
    cache = LocalCache(config.local_cache_dir, config.local_cache_max_bytes, config.storage_options)
    for ds in datasets:
        if not isinstance(ds.reader, StagedBinReader):
            ds.reader = StagedBinReader(ds.reader, cache, ds.source, len(ds._idx))
            ds.reopen = (_reopen_staged, (ds.reopen, config))  # a DataLoader worker's copy reads the same way


def _reopen_staged(reopen: tuple, config: StorageConfig) -> IndexedDataset:
    ds = reopen[0](*reopen[1])
    wrap_for_staging([ds], config)
    return ds


def first_use_order(dataset_index: np.ndarray, count: int, position: int = 0) -> list[int]:
    """The datasets of a blend in the order its samples from `position` on first read them; those it never reads
    from there come last, in their order.

    Example:
        >>> first_use_order(np.array([2, 2, 0, 1, 0]), 4)
        [2, 0, 1, 3]
    """
    ahead = np.asarray(dataset_index[position:])
    found, first = np.unique(ahead, return_index=True)
    order = [int(d) for d in found[np.argsort(first, kind="stable")]]
    return order + [d for d in range(count) if d not in set(order)]


def start_staging(datasets: Sequence[IndexedDataset], order: Sequence[int], config: StorageConfig) -> threading.Thread:
    """Start this process's stager thread for `datasets` (staged in `order`): it copies them if it becomes the
    node's stager, and tells this process's readers as each copy completes; it ends when every dataset is local.

    Example:
        >>> thread = start_staging(blend.indexed_datasets, first_use_order(blend.dataset_index, n), storage)
    """
    assert config.local_cache_dir is not None
    readers = [ds.reader for ds in datasets]
    sources = [ds.source for ds in datasets]
    key = hashlib.sha256(json.dumps(sources).encode()).hexdigest()[:16]
    directory = Path(config.local_cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(
        target=_stage, args=(readers, list(order), config, directory / f"stage-{key}"), name="stage", daemon=True
    )
    thread.start()
    _THREADS.append(thread)
    return thread


def wait_for_staging(timeout: float | None = None) -> bool:
    """Wait until this process's stager threads have seen every dataset staged; whether they all ended in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_THREADS):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in _THREADS)


def _stage(readers: list[BinReader], order: list[int], config: StorageConfig, base: Path) -> None:
    cache = LocalCache(config.local_cache_dir, config.local_cache_max_bytes, config.storage_options)
    staged = [r for r in readers if isinstance(r, StagedBinReader)]
    total = sum(r.nbytes + r.idx_bytes for r in staged)
    while True:
        left = [i for i in order if isinstance(readers[i], StagedBinReader) and not _mark_if_staged(readers[i])]
        if not left:
            return
        with flock(Path(f"{base}.lock"), blocking=False) as held:
            if held:
                _copy_in_order(cache, [readers[i] for i in left], config, Path(f"{base}.json"), total)
                continue
        time.sleep(RETRY_STAGER_S)  # another process of the node stages; take over if it dies


def _mark_if_staged(reader: StagedBinReader) -> bool:
    if reader.staged.is_set():
        return True
    found = reader.cache.pin_if_complete(reader.source, {"bin": reader.nbytes, "idx": reader.idx_bytes})
    if found is None:
        return False
    found[1].close()
    reader.staged.set()
    return True


def _copy_in_order(
    cache: LocalCache, readers: list[StagedBinReader], config: StorageConfig, status: Path, total: int
) -> None:
    """Copy each dataset (LocalCache.fetch: its lock, verification, LRU), telling its reader, writing progress."""
    t0, done_bytes = time.monotonic(), 0
    for k, reader in enumerate(readers):
        cache.fetch(reader.source, verify_sha256=config.verify_sha256)
        reader.staged.set()
        done_bytes += reader.nbytes + reader.idx_bytes
        seconds = time.monotonic() - t0
        with contextlib.suppress(OSError):
            write_json_atomic(status, {"datasets_done": k + 1, "datasets": len(readers), "bytes_done": done_bytes,
                                       "bytes": total, "seconds": round(seconds, 2),
                                       "mb_per_s": round(done_bytes / max(seconds, 1e-9) / 1e6, 1),
                                       "stager_pid": os.getpid()}, durable=False)  # fmt: skip

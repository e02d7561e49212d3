"""Sharded, resumable loading: Megatron's pretraining sampler over a torch DataLoader, with a small state.

The global order is sample 0, 1, 2, ... of the dataset (the dataset's own shuffle index already randomises it).
It is consumed in global batches of micro_batch_size * dp_world_size samples; rank r takes the r-th slice of each
(megatron/training/datasets/data_samplers.py: MegatronPretrainingSampler). The only state is the number of
samples consumed globally, so resuming costs nothing, and resuming with another world size continues the same
global order: a run of 4 ranks stopped after k steps has consumed 4 * k * micro_batch_size samples, and 2 ranks go
on from there.

Each DataLoader fetch is one micro-batch: the batch sampler hands the dataset a list of ids, and the dataset reads
them with one gather. Without workers, its `__getitems__` returns int32 tensors (widen them on the GPU); with
workers, they send the raw text (RawBatches) and this process assembles the same tensors.

Example:
    >>> loader = make_loader(train, micro_batch_size=8, dp_rank=0, dp_world_size=4, num_workers=2)
    >>> batch = next(iter(loader))          # {"tokens": (8, S) int32, "labels": ..., "loss_mask": ..., ...}
    >>> state = loader.state_dict()         # {"consumed_samples": 32, "seed": 1234, "fingerprint": "...", ...}
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from corpusforge import worker_stacks
from corpusforge.data.batch import assemble
from corpusforge.data.cache import describe_differences, description_hash
from corpusforge.data.gpt_dataset import prefetch_upcoming
from corpusforge.errors import CorpusforgeError
from corpusforge.executors import die_with_parent
from corpusforge.jit import load_in_background, started

STATE_VERSION = 1


class LoaderStateError(CorpusforgeError, ValueError):
    """A loader state that belongs to other data or another configuration."""


@dataclass(frozen=True)
class PretrainingBatchSampler:
    """Rank `dp_rank`'s micro-batches of the global order, from `consumed_samples` on.

    Example:
        >>> list(PretrainingBatchSampler(10, 0, micro_batch_size=2, dp_rank=1, dp_world_size=2))
        [[2, 3], [6, 7]]
    """

    total_samples: int
    """Samples in the dataset."""

    consumed_samples: int
    """Samples already consumed by all ranks together; iteration starts after them."""

    micro_batch_size: int
    """Samples per rank per step."""

    dp_rank: int
    """This rank's index among the data-parallel ranks."""

    dp_world_size: int
    """Number of data-parallel ranks."""

    drop_last: bool = True
    """Drop a last global batch that is not full (Megatron's default); else each rank gets its slice of it."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.dp_world_size < 1:
            raise ValueError(f"micro_batch_size {self.micro_batch_size} and dp_world_size must be >= 1")
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not in [0, {self.dp_world_size})")
        if self.consumed_samples < 0:
            raise ValueError(f"consumed_samples {self.consumed_samples} is negative")

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_world_size

    def __len__(self) -> int:
        left = max(0, self.total_samples - self.consumed_samples)
        return left // self.global_batch_size if self.drop_last else -(-left // self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.global_batch_size):
            end = min(start + self.global_batch_size, self.total_samples)
            if end - start < self.global_batch_size and self.drop_last:
                return
            ids = list(range(start + mine, min(start + mine + self.micro_batch_size, end)))
            if ids:
                yield ids


class BatchIds(list):
    """One micro-batch's sample ids (a list), with `upcoming`: the ids of the batches the same DataLoader worker
    reads after it, so that a dataset over remote storage can fetch their blocks while this one is trained on.

    Example:
        >>> ids = BatchIds([4, 5], upcoming=[12, 13, 20, 21])
        >>> ids, ids.upcoming
        ([4, 5], [12, 13, 20, 21])
    """

    def __init__(self, ids: list[int], upcoming: list[int]) -> None:
        super().__init__(ids)
        self.upcoming = upcoming

    def __reduce__(self) -> tuple[Any, ...]:  # sent to workers through their index queues
        return (BatchIds, (list(self), self.upcoming))


@dataclass(frozen=True)
class LookaheadBatches:
    """The batches of a batch sampler as BatchIds: each with the ids of the next `depth` batches that go to the
    same worker. torch's DataLoader hands map-style batches to its workers in turn (batch k to worker k % W), so
    those are the batches `workers` places further on; with another assignment prefetching only helps less.

    Example:
        >>> [b.upcoming for b in LookaheadBatches([[0], [1], [2], [3]], workers=2, depth=1)]
        [[2], [3], [], []]
    """

    batches: Any
    """The batch sampler (an iterable of lists of ids, with a length)."""

    workers: int = 1
    """DataLoader workers (1 for none: every batch is read by the same process)."""

    depth: int = 2
    """How many of its next batches each batch announces."""

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[BatchIds]:
        window: deque[list[int]] = deque()
        span = self.workers * self.depth
        for batch in self.batches:
            window.append(batch)
            if len(window) > span:
                yield self._next(window)
        while window:
            yield self._next(window)

    def _next(self, window: deque[list[int]]) -> BatchIds:
        current = window.popleft()
        later = [window[k] for k in range(self.workers - 1, len(window), self.workers)][: self.depth]
        return BatchIds(current, [i for batch in later for i in batch])


def _keep_batch(batch: Any) -> Any:
    """collate_fn: the dataset's `__getitems__` already returns the batched tensors."""
    return batch


class RawBatches:
    """What DataLoader workers read: a dataset's batches as RawBatch (the samples' text in the token file's dtype),
    which the main process assembles into tensors.

    A worker's result reaches the main process pickled through a pipe, except torch tensors, which go through a
    shared-memory segment and a file descriptor passed per storage: ~1 ms a batch here, which held 2 workers to
    5-8K samples/s of (8, 2048) batches. The raw text is 8x smaller than the assembled batch (uint16 against four
    int32 fields) and crosses the pipe in ~0.1-0.2 ms; assembling it takes ~10 us (corpusforge/data/batch.py).
    2 workers then gave 35K samples/s (benchmarks/results/loader-2026-11-22.json).

    Example:
        >>> RawBatches(train).__getitems__([0, 1]).text.shape
        (2, 2049)
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, ids: list[int]) -> Any:
        prefetch_upcoming(self.dataset, ids)
        return self.dataset.read_raw(ids)


@dataclass(frozen=True)
class WorkerInit:
    """A DataLoader's worker_init_fn: die with the process that made the loader (`parent`), then `then`'s own init.
    A dataclass, so that it pickles to spawn/forkserver workers."""

    parent: int
    then: Callable[[int], None] | None = None

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        worker_stacks.serve_in_worker()  # a hang's report holds this worker's stacks too (train/watchdog.py)
        if self.then is not None:
            self.then(worker_id)


def _accelerator() -> bool:
    """Whether page-locked memory can be had (torch's DataLoader also pins only where there is an accelerator)."""
    import torch

    return torch.cuda.is_available()


class Loader:
    """A resumable per-rank loader over a GPTDataset or BlendedDataset.

    Iterating yields dicts of tensors (tokens, labels, position_ids int32; loss_mask float32; ...). `state_dict()`
    is a few hundred bytes of JSON-able values; `load_state_dict()` checks the data and configuration first.

    Example:
        >>> loader = Loader(train, micro_batch_size=4, dp_rank=0, dp_world_size=1)
        >>> for step, batch in zip(range(10), loader): ...
        >>> loader.state_dict()["consumed_samples"]
        40
    """

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        drop_last: bool = True,
        consumed_samples: int = 0,
        multiprocessing_context: str | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        self.num_workers, self.pin_memory, self.drop_last = num_workers, pin_memory, drop_last
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        self.multiprocessing_context = multiprocessing_context
        self.worker_init_fn = worker_init_fn
        self.consumed_samples = consumed_samples
        self._sampler(consumed_samples)  # check the arguments now, not at the first batch
        self.fingerprint = dataset.fingerprint
        self.fingerprint_hash = description_hash(self.fingerprint)

    def _sampler(self, consumed: int) -> PretrainingBatchSampler:
        return PretrainingBatchSampler(
            len(self.dataset), consumed, self.micro_batch_size, self.dp_rank, self.dp_world_size, self.drop_last
        )

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_world_size

    def __len__(self) -> int:
        return len(self._sampler(self.consumed_samples))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import DataLoader

        workers = {}
        if self.num_workers > 0:
            load = getattr(self.dataset, "load_kernels", None)
            if load is not None:  # compiled (or loaded) once here, not once per forked worker
                load()
            workers = {
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers,
                "multiprocessing_context": self.multiprocessing_context,
                # workers end with this process, even SIGKILLed: torch's own watchdog looks only between batches
                "worker_init_fn": WorkerInit(os.getpid(), self.worker_init_fn),
            }
        batches = LookaheadBatches(self._sampler(self.consumed_samples), max(1, self.num_workers))
        # Workers send raw text, assembled here (see RawBatches), straight into page-locked memory when pinning.
        raw = self.num_workers > 0
        pin = self.pin_memory and raw and _accelerator()
        loader = DataLoader(
            RawBatches(self.dataset) if raw else self.dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=_keep_batch,
            pin_memory=self.pin_memory and not raw,
            **workers,
        )
        # A dataset with its own assemble (RetroDataset: neighbours too) makes its fields; GPT datasets use batch.py's.
        own = getattr(self.dataset, "assemble", None)
        config = getattr(self.dataset, "config", None)
        # Read in this process, the first batches come from numpy (GPTDataset._numpy_for_now): the kernels load on
        # jit's thread once the first batch is handed over, beside the step it feeds, not beside the job's start-up.
        kernels = getattr(self.dataset, "load_kernels", None) if not raw and not started() else None
        for batch in loader:
            # Counted when handed over, not when prefetched: a state saved now resumes at the next batch.
            self.consumed_samples += self.global_batch_size
            if kernels is not None:
                load_in_background(kernels)
                kernels = None
            if not raw:
                yield batch
            elif own is not None:
                yield own(batch, as_torch=True, pin_memory=pin)
            else:
                yield assemble(batch, config, as_torch=True, pin_memory=pin)

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: samples consumed by all ranks, the seed, and the data's fingerprint."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "seed": getattr(getattr(self.dataset, "config", self.dataset), "seed", None),  # RetroDataset has no config
            "fingerprint": self.fingerprint_hash,
            "description": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after `state`; refuse a state from other data or another configuration, saying what differs."""
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state.get('version')!r}, this loader reads {STATE_VERSION}")
        if state.get("fingerprint") != self.fingerprint_hash:
            theirs = state.get("description") or {}
            diff = describe_differences(self.fingerprint, theirs) or ["(fingerprints differ)"]
            raise LoaderStateError(
                "the loader state was saved for other data or another configuration; differences (now != saved): "
                + "; ".join(diff[:10])
                + (f"; and {len(diff) - 10} more" if len(diff) > 10 else "")
                + "; load it into a loader made with the data and options it was saved with"
            )
        self._sampler(int(state["consumed_samples"]))
        self.consumed_samples = int(state["consumed_samples"])


def make_loader(
    dataset: Any,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    num_workers: int = 0,
    **options: Any,
) -> Loader:
    """A Loader for rank `dp_rank` of `dp_world_size`; options: pin_memory, prefetch_factor, persistent_workers,
    drop_last, consumed_samples, multiprocessing_context ("spawn", "forkserver"; default: torch's), worker_init_fn.

    Example:
        >>> loader = make_loader(train, micro_batch_size=8, dp_rank=rank, dp_world_size=world, num_workers=2)
    """
    return Loader(dataset, micro_batch_size, dp_rank, dp_world_size, num_workers, **options)

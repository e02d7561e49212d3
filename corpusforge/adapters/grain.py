"""corpusforge's samples as a Grain random-access data source (torchtitan HEAD and MaxText load through Grain).

`GrainSource` is one data-parallel rank's view of a GPTDataset or BlendedDataset: record k of rank r is the sample
corpusforge's own loader hands rank r as the (k % micro_batch_size)-th row of its (k // micro_batch_size)-th
micro-batch (Megatron's pretraining sampler: global batches of micro_batch_size * dp_world_size consecutive
samples, rank r taking the r-th slice; corpusforge/data/loader.py). Batched in order, without Grain's own sharding
or shuffling (the dataset's shuffle index already randomises the order), rank r's batches are its corpusforge
batches, field for field: tokens, labels, position_ids int32, loss_mask float32, plus dataset_id for a blend and
cu_seqlens/max_seqlen with document_boundaries. Two ways in: `grain_loader` (Grain's DataLoader over micro-batch
records, each read with one gather, in order with any number of worker processes) and `grain_dataset` (a
MapDataset of the same micro-batches, or of the sample records batched by Grain's `.batch`).

Grain checkpoints its iterators itself (`DataLoader` iterators: `get_state()` bytes, `MapDataset` iterators: a
dict); `__repr__` names the data's fingerprint and the rank layout, so Grain refuses a state saved over other data
or another layout (it compares `repr(data_source)`) instead of continuing at a wrong sample.

Example:
    >>> from corpusforge.adapters.grain import GrainSource, grain_loader
    >>> source = GrainSource(train, micro_batch_size=8, dp_rank=rank, dp_world_size=world)
    >>> it = iter(grain_loader(source))              # batches of 8, as corpusforge's loader gives them
    >>> batch = next(it); state = it.get_state()      # bytes: save with the checkpoint; it.set_state(state) resumes
"""

from __future__ import annotations

from typing import Any

import numpy as np

from corpusforge.data.cache import description_hash
from corpusforge.data.loader import PretrainingBatchSampler
from corpusforge.errors import CorpusforgeError


def _grain() -> Any:
    try:
        import grain.python as grain
    except ImportError:
        raise CorpusforgeError('the Grain adapter needs grain: pip install "corpusforge[adapters]"') from None
    return grain


class GrainSource:
    """Rank `dp_rank`'s samples of a corpusforge dataset as a Grain `RandomAccessDataSource` (`__len__`,
    `__getitem__`, and `_getitems` for Grain's batched reads); each record is a dict of numpy arrays.

    Example:
        >>> source = GrainSource(train, micro_batch_size=2, dp_rank=1, dp_world_size=2)
        >>> [source.sample_id(k) for k in range(4)]        # rank 1's slices of global batches [0..3], [4..7]
        [2, 3, 6, 7]
    """

    def __init__(self, dataset: Any, micro_batch_size: int = 1, dp_rank: int = 0, dp_world_size: int = 1) -> None:
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        # the sampler checks the layout and says how many full micro-batches this rank gets (Megatron drops the rest)
        batches = len(PretrainingBatchSampler(len(dataset), 0, micro_batch_size, dp_rank, dp_world_size))
        self._length = batches * micro_batch_size
        self.fingerprint_hash = description_hash(dataset.fingerprint)

    def __len__(self) -> int:
        return self._length

    def sample_id(self, key: int) -> int:
        """The dataset's sample id of record `key` of this rank."""
        if not 0 <= key < self._length:
            raise IndexError(f"record {key} is not in [0, {self._length}) of {self!r}")
        step, row = divmod(int(key), self.micro_batch_size)
        return step * self.micro_batch_size * self.dp_world_size + self.dp_rank * self.micro_batch_size + row

    def sample_ids(self, keys: Any) -> np.ndarray:
        """The dataset's sample ids of records `keys` (sample_id for many, in one numpy pass: a Python call per
        record cost a tenth of a micro-batch's gather).

        Example:
            >>> GrainSource(train, micro_batch_size=2, dp_rank=1, dp_world_size=2).sample_ids(range(4)).tolist()
            [2, 3, 6, 7]
        """
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if len(keys) and (keys.min() < 0 or keys.max() >= self._length):
            bad = keys[(keys < 0) | (keys >= self._length)][0]
            raise IndexError(f"record {bad} is not in [0, {self._length}) of {self!r}")
        step, row = np.divmod(keys, self.micro_batch_size)
        return (step * self.dp_world_size + self.dp_rank) * self.micro_batch_size + row

    def _getitems(self, keys: Any) -> list[dict[str, np.ndarray]]:
        """Records `keys`, read with one gather (Grain calls this for a batch where it reads batches at once)."""
        ids = self.sample_ids(keys)
        batch = self.dataset.get_batch(ids)
        return [{name: value[i] for name, value in batch.items()} for i in range(len(ids))]

    def __getitem__(self, key: int) -> dict[str, np.ndarray]:
        batch = self.dataset.get_batch(np.array([self.sample_id(key)], np.int64))
        return {name: value[0] for name, value in batch.items()}

    def __repr__(self) -> str:
        # Grain validates a restored DataLoader state by this string: it must change with the data and the layout
        return (
            f"corpusforge.GrainSource(samples={self._length}, micro_batch_size={self.micro_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_world_size={self.dp_world_size}, data={self.fingerprint_hash[:16]})"
        )


class MicroBatchSource:
    """A GrainSource's micro-batches as records: record k is the rank's k-th micro-batch, read with one gather.
    What grain_loader reads: Grain's DataLoader gives worker w the records w, w + W, ... and batches each worker's
    records on their own, so a Batch operation over sample records would mix the micro-batches of workers; records
    that are micro-batches come back in their order whatever the worker count.

    Example:
        >>> MicroBatchSource(GrainSource(train, micro_batch_size=8))[0]["tokens"].shape
        (8, 2048)
    """

    def __init__(self, source: GrainSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source) // self.source.micro_batch_size

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        if not 0 <= k < len(self):
            raise IndexError(f"micro-batch {k} is not in [0, {len(self)}) of {self.source!r}")
        source, mbs = self.source, self.source.micro_batch_size
        start = (k * source.dp_world_size + source.dp_rank) * mbs  # a micro-batch is consecutive samples
        return source.dataset.get_batch(np.arange(start, start + mbs, dtype=np.int64))

    def __repr__(self) -> str:
        return f"corpusforge.MicroBatchSource({self.source!r})"


def grain_loader(
    source: GrainSource, worker_count: int = 0, num_epochs: int = 1, read_options: Any = None, **options: Any
) -> Any:
    """A `grain.python.DataLoader` giving `source`'s micro-batches in order (dicts of (B, ...) numpy arrays), with
    any number of worker processes; `options` go to the DataLoader (worker_buffer_size, ...).

    `read_options` defaults to reading in the calling thread (read ahead in worker processes, with worker_count, as
    corpusforge's own loader does): Grain's default (16 threads, 500 records ahead) polls its whole read-ahead
    buffer on every record: 5-7x corpusforge's loader's CPU time per sample here, and 2 threads about 2x, on a
    loaded 2-core machine (benchmarks/bench_adapters.py, 2026-11-28). Pass ReadOptions with threads for
    storage with latency.

    Example:
        >>> it = iter(grain_loader(GrainSource(train, micro_batch_size=8), worker_count=2))
    """
    grain = _grain()
    batches = MicroBatchSource(source)
    # A seed gives every record its own Philox generator (12.8 us a record here, against the sampler's 2.0 without
    # one): only random transforms among the operations use it, and nothing is shuffled.
    seed = 0 if options.get("operations") else None
    sampler = grain.IndexSampler(
        num_records=len(batches), shard_options=grain.NoSharding(), shuffle=False, num_epochs=num_epochs, seed=seed
    )
    read_options = read_options or grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return grain.DataLoader(
        data_source=batches, sampler=sampler, worker_count=worker_count, read_options=read_options, **options
    )


def grain_dataset(source: GrainSource, per_sample: bool = False) -> Any:
    """`source`'s micro-batches as a Grain `MapDataset` (iterate it with `.to_iter_dataset(read_options)`, whose
    iterator's get_state()/set_state() checkpoint it; pass read options as grain_loader does rather than Grain's
    default): records that are micro-batches, each read with one gather; with per_sample, Grain's `.batch` over the
    sample records (`grain.MapDataset.source(source).batch(...)`, for pipelines that transform samples first),
    which reads one sample per call: Grain 0.2.18 does not pass a batch's indices to the source at once (its batch
    pushdown is off): 3-4x corpusforge's loader's CPU time per sample here.

    Example:
        >>> options = grain.python.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        >>> it = iter(grain_dataset(GrainSource(train, micro_batch_size=8)).to_iter_dataset(options))
    """
    grain = _grain()
    if per_sample:
        return grain.MapDataset.source(source).batch(source.micro_batch_size, drop_remainder=True)
    return grain.MapDataset.source(MicroBatchSource(source))

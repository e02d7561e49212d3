"""train, valid, test datasets from a blend of token datasets, as Megatron-Core's BlendedMegatronDatasetBuilder
builds them from `--data-path`, `--split` and the sample counts of each split.

- one prefix without a weight: a GPTDataset per split, of the requested size;
- prefixes with weights: per dataset and split a GPTDataset of ceil(ceil(n * w) * 1.005) samples, blended into
  sum_d ceil(n * w_d) samples (weights normalised; _get_size_per_split_per_dataset);
- several prefixes without weights: one epoch of each, blended by their lengths into min(n, their sum) samples,
  or every sample exactly once when n is None.

Example:
    >>> train, valid, test = build_gpt_datasets(["out/a_text_document", 0.7, "out/b_text_document", 0.3],
    ...     seq_length=2048, split="969,30,1", seed=1234, num_samples=(8000, 80, 8), cache_dir="cache/")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from corpusforge.data.blended import (
    BlendedDataset,
    normalize,
    parse_blend,
    samples_per_dataset,
)
from corpusforge.data.cache import IndexCache, completing_after
from corpusforge.data.gpt_dataset import SPLIT_NAMES, GPTDataset, GPTDatasetConfig, build_together, split_ranges
from corpusforge.indexed import IndexedDataset
from corpusforge.storage import StorageConfig
from corpusforge.storage.datasets import open_datasets

Dataset = GPTDataset | BlendedDataset


def read_modes(dataset: Dataset) -> dict[str, str]:
    """How each token dataset under a GPTDataset or blend is read: {source: "mode (why)"}, for run summaries.

    Example:
        >>> read_modes(train)
        {'out/a_text_document': "mmap-random (auto: the .bin (0.00 GiB) fits the page-cache budget (...)...)"}
    """
    return {
        part.indexed.source: part.indexed.reader.describe() for part in getattr(dataset, "datasets", None) or [dataset]
    }


def _splits_of(
    indexed: IndexedDataset,
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    cache: IndexCache,
    deferred: bool = False,
) -> list[GPTDataset | None]:
    """The GPTDataset of each split of one token dataset (None where the split string gives it no weight); with
    deferred, without their indices yet (see _blend_parts)."""
    out: list[GPTDataset | None] = []
    for name, bounds, size in zip(SPLIT_NAMES, split_ranges(config.split, len(indexed)), sizes):
        if bounds is None:
            out.append(None)
            continue
        out.append(GPTDataset(indexed, name, bounds, size, config, cache, deferred=deferred))
    return out


def _blend_parts(
    indexed: list[IndexedDataset], sizes: list[list[int | None]], config: GPTDatasetConfig, cache: IndexCache
) -> list[list[GPTDataset | None]]:
    """[dataset][split] GPTDatasets of a blend (sizes[dataset][split]), the indices of each split's datasets
    built and cached together: one cache entry per split, not one per dataset and split."""
    per_prefix = [_splits_of(ds, sizes[d], config, cache, deferred=True) for d, ds in enumerate(indexed)]
    for s, name in enumerate(SPLIT_NAMES):
        parts = [p[s] for p in per_prefix if p[s] is not None]
        if parts:
            build_together(parts, cache, f"GPTDatasets-{name}")
    return per_prefix


def build_gpt_datasets(
    blend: str | Sequence[Any],
    seq_length: int,
    split: str = "969,30,1",
    seed: int = 1234,
    num_samples: Sequence[int | None] = (None, None, None),
    cache_dir: str | os.PathLike | None = None,
    storage: StorageConfig | None = None,
    **options: Any,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """(train, valid, test): a GPTDataset or BlendedDataset per split, None for a split of weight 0.

    `options` are the other GPTDatasetConfig fields (eod_token_id, reset_position_ids, eod_mask_loss, ...).
    `num_samples` None for a split means one epoch of it (not allowed with weights, as in Megatron).
    Prefixes may be fsspec URLs (s3://bucket/a_text_document); `storage` says how to read them (read mode,
    ranged block size, fsspec options, the local cache tier: StorageConfig(local_cache_dir=..., ...)).

    Example:
        >>> train, valid, test = build_gpt_datasets("out/a_text_document", seq_length=1024,
        ...     num_samples=(1000, 10, 10), cache_dir="cache/", eod_token_id=50256, eod_mask_loss=True)
    """
    known = {f.name for f in fields(GPTDatasetConfig)} - {"seq_length", "seed", "split"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; valid: {sorted(known)}")
    config = GPTDatasetConfig(seq_length=seq_length, seed=seed, split=split, **options)
    sizes = list(num_samples)
    if len(sizes) != 3:
        raise ValueError(f"num_samples must give train, valid, test counts, got {num_samples!r}")
    if any(s is not None and s < 0 for s in sizes):
        raise ValueError(f"num_samples must not be negative: {num_samples!r}")
    prefixes, weights = parse_blend(blend)
    indexed = open_datasets(prefixes, storage)  # every missing file is reported before any work
    cache = IndexCache(cache_dir)
    with completing_after():  # the cache entries' fsyncs start once every split is built, not between them
        if len(prefixes) == 1 and weights is None:
            out = tuple(_splits_of(indexed[0], sizes, config, cache))
        elif weights is not None:
            out = _weighted_blend(indexed, normalize(weights), sizes, config, cache)
        else:
            out = _length_blend(indexed, sizes, config, cache)
    if storage is not None and storage.local_cache_dir is not None and storage.local_cache_staging == "background":
        _start_staging(indexed, out, storage)
    return out  # type: ignore[return-value]


def _start_staging(indexed: list[IndexedDataset], splits: tuple, storage: StorageConfig) -> None:
    """Stage the blend to local disk in the order its train split first reads the datasets (storage/stage.py); each
    staged reader knows the GPTDatasets over it, which it tells when it switches to its copy."""
    import weakref

    from corpusforge.storage.stage import first_use_order, start_staging

    for split in splits:
        for part in getattr(split, "datasets", None) or ([split] if split is not None else []):
            owners = getattr(part.indexed.reader, "owners", None)
            if owners is not None:
                owners.append(weakref.ref(part))
    dataset_index = getattr(splits[0], "dataset_index", None)
    order = list(range(len(indexed))) if dataset_index is None else first_use_order(dataset_index, len(indexed))
    start_staging(indexed, order, storage)


def _weighted_blend(
    indexed: list[IndexedDataset],
    weights: list[float],
    sizes: list[int | None],
    config: GPTDatasetConfig,
    cache: IndexCache,
) -> tuple[Dataset | None, ...]:
    ranges = split_ranges(config.split, 1 << 30)  # which splits exist does not depend on the size
    missing = [n for n, s, r in zip(SPLIT_NAMES, sizes, ranges) if s is None and r is not None]
    if missing:
        raise ValueError(f"a weighted blend needs a sample count for every split; none given for {missing}")
    sized = [s or 0 for s in sizes]
    target = [samples_per_dataset(weights, n) for n in sized]  # [split][dataset]
    buffer = [samples_per_dataset(weights, n, config.mid_level_dataset_surplus) for n in sized]
    per_prefix = _blend_parts(indexed, [[b[d] for b in buffer] for d in range(len(indexed))], config, cache)
    out: list[Dataset | None] = []
    for s in range(3):
        if ranges[s] is None:
            out.append(None)
            continue
        parts = [per_prefix[d][s] for d in range(len(indexed))]
        out.append(BlendedDataset(parts, weights, sum(target[s]), cache))  # type: ignore[arg-type]
    return tuple(out)


def _length_blend(
    indexed: list[IndexedDataset], sizes: list[int | None], config: GPTDatasetConfig, cache: IndexCache
) -> tuple[Dataset | None, ...]:
    per_prefix = _blend_parts(indexed, [[None, None, None]] * len(indexed), config, cache)
    out: list[Dataset | None] = []
    for s in range(3):
        parts = [per_prefix[d][s] for d in range(len(indexed))]
        if parts[0] is None:
            out.append(None)
            continue
        lengths = [len(p) for p in parts]  # type: ignore[arg-type]
        size = None if sizes[s] is None else min(sizes[s], sum(lengths))
        out.append(BlendedDataset(parts, lengths, size, cache))  # type: ignore[arg-type]
    return tuple(out)

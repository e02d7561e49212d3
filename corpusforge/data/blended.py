"""Blending several GPT datasets by weight, with Megatron-Core `BlendedDataset` semantics.

Sample i of a blend is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`. Both are filled greedily:
at step i (taken as at least 1) the dataset whose count lags its weight the most, max(w_d * i - count_d), gets
the next sample, ties to the lowest d (helpers.cpp: build_blending_indices). Without weights but with a size, the
weights are the datasets' lengths; without either, every sample of every dataset is used once, in the same
greedy order over the datasets that still have samples (build_exhaustive_blending_indices).

Each step depends on the counts so far; helpers.cpp scans every dataset at every step, O(D). Here each block of
sqrt(D) steps first finds the few datasets that can win in it (below), and the steps scan those only: O(sqrt(D)) a
step, with the same result.

Each dataset is asked for ceil(ceil(n * w_d) * 1.005) samples of a blend of n (the 0.5% surplus of
blended_megatron_dataset_builder.py: _get_size_per_split_per_dataset) and the blend holds sum_d ceil(n * w_d).

Example:
    >>> prefixes, weights = parse_blend(["out/a_text_document", 0.7, "out/b_text_document", 0.3])
    >>> weights
    [0.7, 0.3]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from corpusforge.data.batch import RawBatch, assemble, batch_fields, to_torch
from corpusforge.data.cache import IndexCache, picklable, unpickled
from corpusforge.data.gpt_dataset import GPTDataset, prefetch_upcoming
from corpusforge.errors import ArgumentError
from corpusforge.jit import njit

try:
    from corpusforge import _blend
except ImportError:  # not built (a source checkout without pip install): _fill_blocks in numba, the same indices
    _blend = None

# ---------------------------------------------------------------------------------------------------------------
# the blend list


def _as_weight(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def parse_blend(blend: str | Sequence[Any]) -> tuple[list[str], list[float] | None]:
    """Prefixes and weights of a blend; weights None when none are given.

    Accepts a single prefix, a list of prefixes, `[prefix, weight, ...]`, or Megatron's `--data-path` order
    `[weight, prefix, ...]` (megatron/core/datasets/utils.py: get_blend_from_list). Weights are returned as
    given (not normalised); they must be positive.

    Example:
        >>> parse_blend(["0.3", "a", "0.7", "b"])
        (['a', 'b'], [0.3, 0.7])
    """
    items = [blend] if isinstance(blend, str) else list(blend)
    if not items:
        raise ArgumentError("blend is empty: give at least one dataset prefix")
    numeric = [_as_weight(x) is not None for x in items]
    if not any(numeric):
        return [str(x).strip() for x in items], None
    pairs = len(items) // 2
    if len(items) % 2 == 0 and all(numeric[1::2]) and not any(numeric[0::2]):
        prefixes, raw = items[0::2], items[1::2]
    elif len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        prefixes, raw = items[1::2], items[0::2]
    else:
        raise ArgumentError(
            f"blend {items!r}: expected prefixes only, [prefix, weight, ...] or [weight, prefix, ...] "
            f"({pairs} pairs); a prefix that looks like a number must be given as a path, e.g. './1'"
        )
    weights = [_as_weight(x) for x in raw]
    check_weights(prefixes, weights)
    return [str(p).strip() for p in prefixes], weights


def check_weights(prefixes: Sequence[str], weights: Sequence[float]) -> None:
    """Refuse weights that cannot be normalised: negative, zero, not finite, or not summing to a positive number."""
    bad = [f"{p}: {w}" for p, w in zip(prefixes, weights) if not (math.isfinite(w) and w > 0)]
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    if not total > 0 or not math.isfinite(total):
        raise ArgumentError(f"blend weights {list(weights)} must sum to a positive number (they sum to {total})")
    if bad:
        raise ArgumentError(f"blend weights must be positive and finite; drop a dataset rather than weigh it 0: {bad}")


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their float64 sum, as megatron/core/datasets/utils.py: normalize does it."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def samples_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples each dataset contributes to a blend of `size`: ceil(ceil(size * w) * (1 + surplus)), w normalised.

    Example:
        >>> samples_per_dataset([0.7, 0.3], 1000, surplus=0.005)
        [704, 302]
    """
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


# ---------------------------------------------------------------------------------------------------------------
# the blending indices


# helpers.cpp builds the blending indices with a scan over every dataset at every step: O(size * D), 5e9 error
# computations for 2M samples of 2,500 datasets. _fill_blocks makes the same scan over a few candidates: for a block
# of K steps, at most K datasets are picked, so some dataset among the K with the largest errors at the block's first
# step is still unpicked at every step of it, and its error has only grown (w * step rounds up monotonically in step):
# the largest error at every step of the block is at least the K-th largest at its start, `floor`. A dataset whose
# error at the block's last step, with its count unchanged, is below floor can never be the largest there, so it is
# never picked, and its count indeed stays unchanged. The scan over the others (~2K of them, in dataset order, errors
# computed exactly as helpers.cpp computes them, ties to the lowest index) picks what the full scan picks. A block
# costs one pass over the D datasets; with K = sqrt(D), each step costs ~3 sqrt(D) error computations, not D.
# (Before: a kinetic tournament, O(log D) comparisons a step but ~13 re-comparisons a step with random weights: 2.9x
# slower than this for 2M samples of 2,500 datasets.)


@njit(nogil=True)
def _fill_blocks(dataset_index, dataset_sample_index, weights, limits, size):  # pragma: no cover - compiled
    """The indices of helpers.cpp's build_blending_indices (limits past size) or build_exhaustive_blending_indices
    (limits = sizes): at each step the dataset with the largest error w_d * max(i, 1) - count_d, ties to the
    lowest, a dataset whose count reaches its limit leaving the race; scanned over each block's candidates only."""
    d = len(weights)
    block = max(8, int(math.sqrt(d)))
    taken = np.zeros(d, np.int64)
    count = np.full(d, np.inf)  # count_d as helpers.cpp's double; inf once out of the race (error -inf)
    for k in range(d):
        if limits[k] > 0:
            count[k] = 0.0
    pre, pre_error = np.empty(d, np.int64), np.empty(d)
    candidates = np.arange(d)
    weight, counted = weights.copy(), count.copy()  # the candidates' weights and counts, side by side
    low = -np.inf  # only datasets whose error may reach this by the block's end are looked at (adapted per block)
    i = 0
    while i < size:
        stop = min(size, i + block)
        first, last, picks = max(float(i), 1.0), max(float(stop - 1), 1.0), stop - i
        while True:  # one pass over the datasets; a second, over all, if `low` kept fewer than `picks` above it
            m = above = 0
            for k in range(d):
                if weights[k] * last - count[k] >= low:
                    pre[m], pre_error[m] = k, weights[k] * first - count[k]
                    above += pre_error[m] >= low
                    m += 1
            if above >= picks or low == -np.inf:
                break
            low = -np.inf
        n = 0
        if above >= picks:  # floor: the picks-th largest error at the first step (all of them >= low are in pre)
            floor = np.partition(pre_error[:m], m - picks)[m - picks]
            top = floor
            for c in range(m):
                top = max(top, pre_error[c])
                if weights[pre[c]] * last - count[pre[c]] >= floor:
                    candidates[n] = pre[c]
                    n += 1
            low = floor - (top - floor)  # the next block's floor is near this one
        else:  # fewer datasets in the race than picks: all of them
            for c in range(m):
                if count[pre[c]] < np.inf:
                    candidates[n] = pre[c]
                    n += 1
        for c in range(n):
            weight[c], counted[c] = weights[candidates[c]], count[candidates[c]]
        for j in range(i, stop):
            step = max(float(j), 1.0)
            best, best_error = 0, weight[0] * step - counted[0]  # helpers.cpp: weights[d] * double(i) - count
            for c in range(1, n):
                error = weight[c] * step - counted[c]
                if error > best_error:
                    best, best_error = c, error
            k = candidates[best]
            dataset_index[j] = k
            dataset_sample_index[j] = taken[k]
            taken[k] += 1
            count[k] = counted[best] = taken[k] if taken[k] < limits[k] else np.inf
        i = stop


def _fill(dataset_index, dataset_sample_index, weights, limits, size) -> None:
    """_fill_blocks in plain C (corpusforge/_blend.c: no numba start-up, ~0.5-1 s of CPU in a fresh process) where
    it is built, else in numba."""
    if _blend is not None:
        _blend.fill_blocks(dataset_index, dataset_sample_index, weights, limits)
    else:
        _fill_blocks(dataset_index, dataset_sample_index, weights, limits, size)


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of a blend of `size` samples with normalised weights.

    Example:
        >>> build_blending_indices([0.5, 0.5], 4)[0]
        array([0, 1, 0, 1], dtype=int16)
    """
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if size:
        w = np.asarray(weights, dtype=np.float64)
        _fill(dataset_index, dataset_sample_index, w, np.full(len(w), np.iinfo(np.int64).max), size)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blending indices that use every one of sizes[d] samples of each dataset exactly once.

    Example:
        >>> build_exhaustive_blending_indices([1, 2])[0]
        array([1, 0, 1], dtype=int16)
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    total = int(sizes_arr.sum())
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    if total:
        weights = sizes_arr / float(total)  # helpers.cpp: build_exhaustive_blending_indices
        _fill(dataset_index, dataset_sample_index, weights, sizes_arr, total)
    return dataset_index, dataset_sample_index


# ---------------------------------------------------------------------------------------------------------------
# the dataset


class BlendedDataset:
    """Samples drawn from several GPTDatasets of one split in proportion to their weights.

    `weights` as Megatron's BlendedDataset takes them: with a `size`, any positive weights (normalised here);
    with size None, integer sample counts per dataset, each used exactly.

    Example:
        >>> blend = BlendedDataset([ds_a, ds_b], [0.7, 0.3], size=1000, cache=IndexCache("cache/"))
        >>> blend.get_batch([0, 1])["dataset_id"]
        array([0, 1], dtype=int32)
    """

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: Sequence[float],
        size: int | None,
        cache: IndexCache | None = None,
        *,
        prebuilt: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """`prebuilt`: build_blending_indices(normalize(weights), size) built beforehand (prepare-cache builds them
        on a thread while it builds the datasets: they depend on the weights and the size only); checked against
        the datasets' lengths as a build here is."""
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:  # the dataset index is int16
            raise ValueError(f"a blend holds at most 32766 datasets, got {len(datasets)}")
        self.datasets = list(datasets)
        self.config = datasets[0].config
        self.split = datasets[0].split
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        self.description = {
            "class": "BlendedDataset",
            "datasets": [d.description for d in self.datasets],
            "split": self.split,
            "weights": self.weights,
            "size": size,
        }
        build = self._build if prebuilt is None else lambda: self._checked(*prebuilt)
        arrays, self.built = (cache or IndexCache(None)).get_or_build(
            f"BlendedDataset-{self.split}", self.description, build
        )
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]

    def _build(self) -> dict[str, np.ndarray]:
        if self.size is not None:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = build_exhaustive_blending_indices(self.weights)
        return self._checked(dataset_index, sample_index)

    def _checked(self, dataset_index: np.ndarray, sample_index: np.ndarray) -> dict[str, np.ndarray]:
        """The blending indices, refused where they take more samples from a dataset than it holds."""
        if len(dataset_index) != (self.size if self.size is not None else sum(self.weights)):
            raise ValueError(f"{len(dataset_index)} blending indices for a blend of {self.size} samples")
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for d, (count, ds) in enumerate(zip(counts, self.datasets)):
            if count > len(ds):  # BlendedDataset._build_indices raises the same
                raise ValueError(
                    f"the {self.split} blend takes {count} samples from dataset {d} ({ds.indexed.prefix}) which "
                    f"has {len(ds)}; raise mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus})"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return len(self.dataset_index)

    def load_kernels(self) -> None:
        """Compile (or load) the sample gather of every dataset of the blend (see GPTDataset.load_kernels)."""
        for part in self.datasets:
            part.load_kernels()

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {**self.description, "options": self.config.describe()}

    def get_batch(self, ids) -> dict[str, np.ndarray]:
        """Samples `ids` as numpy arrays, plus `dataset_id` (B,) int32: which dataset each came from."""
        batch = self._fields_by_dataset(ids)
        return batch if batch is not None else assemble(self.read_raw(ids), self.config)

    def _fields_by_dataset(self, ids) -> dict[str, np.ndarray] | None:
        """The batch's four fields and dataset_id, each dataset filling its own rows with its get_batch (a compiled
        copy from its memory map, or numpy for a process's first samples: a job's first batch does not wait for
        numba's start-up, ~0.6-1 s of CPU per rank, as read_raw's piece kernel made it); the same values as
        assemble(read_raw). None where the fields are not those four (attention mask, document boundaries)."""
        if self.config.create_attention_mask or self.config.document_boundaries:
            return None
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids out of range [0, {len(self)}): {ids.min()}..{ids.max()}")
        which = self.dataset_index[ids].astype(np.int32)
        inner = self.dataset_sample_index[ids]
        block = np.empty((4, len(ids), self.config.seq_length), np.int32)
        for d in np.unique(which):
            rows = which == d
            part = self.datasets[int(d)].get_batch(inner[rows])
            block[0, rows], block[1, rows], block[3, rows] = part["tokens"], part["labels"], part["position_ids"]
            block[2, rows] = part["loss_mask"].view(np.int32)
        return {**batch_fields(block), "dataset_id": which}

    def read_raw(self, ids) -> RawBatch:
        """The text of samples `ids` as read (see GPTDataset.read_raw), with the dataset of each."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids out of range [0, {len(self)}): {ids.min()}..{ids.max()}")
        which = self.dataset_index[ids].astype(np.int32)
        inner = self.dataset_sample_index[ids]
        parts = {int(d): (which == d, self.datasets[d].read_raw(inner[which == d])) for d in np.unique(which)}
        dtype = np.result_type(np.uint16, *(raw.text.dtype for _, raw in parts.values()))
        text = np.empty((len(ids), self.config.seq_length + self.config.extra), dtype=dtype)
        for rows, raw in parts.values():
            text[rows] = raw.text
        cu_seqlens = max_seqlen = None
        if self.config.document_boundaries:  # each dataset cut its own samples' documents: put them in row order
            cu_seqlens = np.empty((len(ids), self.config.seq_length + 1), np.int32)
            max_seqlen = np.empty(len(ids), np.int32)
            for rows, raw in parts.values():
                cu_seqlens[rows], max_seqlen[rows] = raw.cu_seqlens, raw.max_seqlen
        return RawBatch(text, any(raw.maybe_padded for _, raw in parts.values()), which, cu_seqlens, max_seqlen)

    @property
    def remote(self) -> bool:
        """Whether any dataset of the blend comes over the network."""
        return any(part.remote for part in self.datasets)

    def prefetch(self, ids) -> None:
        """Start fetching what samples `ids` need from the remote datasets of the blend (soonest first)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < len(self))]
        which, inner = self.dataset_index[ids], self.dataset_sample_index[ids]
        for d, part in enumerate(self.datasets):
            if part.remote:
                part.prefetch(inner[which == d])

    def __getitems__(self, ids: list[int]) -> dict[str, Any]:
        prefetch_upcoming(self, ids)
        batch = self._fields_by_dataset(ids)
        if batch is not None:
            return to_torch(batch)  # one storage, as assemble(as_torch=True) makes a blend's
        return assemble(self.read_raw(ids), self.config, as_torch=True)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # the GPTDatasets pickle themselves without their memmaps
        for name in ("dataset_index", "dataset_sample_index"):
            state[name] = picklable(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("dataset_index", "dataset_sample_index"):
            state[name] = unpickled(state[name])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"BlendedDataset({len(self.datasets)} datasets, {self.split}, samples={len(self)})"

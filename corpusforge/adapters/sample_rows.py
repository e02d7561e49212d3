"""A micro-batch read with one gather, handed to a trainer's per-sample DataLoader as per-sample rows that collate
back into that batch without a copy.

Megatron-LM's `build_pretraining_data_loader` and the HF Trainer read a dataset through a torch DataLoader with a
batch sampler, which calls `dataset.__getitems__(ids)` (torch/utils/data/_utils/fetch.py) and then the collate
function on the list it returns. A trainer's default collate stacks every field of every sample again (a copy of the
whole batch, ~10 us a sample of 2,048 int64 tokens here). `sample_rows` cuts a batch into `SampleRow`s (read-only
mappings whose fields are views of the batch's, made when read) that remember the batch; `whole_batch(rows)` gives
that batch back when the rows are all of it, in order. torch's documented extension of its `default_collate`
(`default_collate_fn_map`, in torch/utils/data/_utils/collate.py) is taught `SampleRow` here, so that Megatron-LM's
DataLoader collates them to the batch itself; rows of several reads, reordered or partial collate as torch collates
plain dicts (the same values).

`widened` and `widened_targets` make the int64 fields those trainers take (Megatron-LM's tensor-parallel broadcast
allocates int64 buffers; the cross-entropy of transformers and torchtitan refuses int32 targets) once per batch, from
the fields as read, into one storage. That widening is what these adapters cost over corpusforge's own int32 loader:
~2 us a sample of 2,048 tokens here, the bytes of the int64 fields (benchmarks/bench_adapters.py, "rows int32").

Example:
    >>> rows = sample_rows({"tokens": torch.zeros((2, 4), dtype=torch.int64)})
    >>> rows[1]["tokens"].shape, whole_batch(rows)["tokens"].shape
    (torch.Size([4]), torch.Size([2, 4]))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from corpusforge.jit import njit, ready, started


class SampleRow(Mapping):
    """Row `index` of `batch` (a dict of (B, ...) tensors or numpy arrays) as a read-only mapping of its fields:
    each field is made (a view of the batch's) when it is read, since making B x fields views per batch costs
    more than the gather itself (~0.7 us a torch view here, 40 a batch of 8 samples of 5 fields)."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: dict[str, Any], index: int) -> None:
        self.batch, self.index = batch, index

    def __getitem__(self, key: str) -> Any:
        return self.batch[key][self.index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.batch)

    def __len__(self) -> int:
        return len(self.batch)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (sent by a DataLoader worker, copied) as a plain dict
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return f"SampleRow({dict(self)!r})"


def sample_rows(batch: dict[str, Any]) -> list[SampleRow]:
    """`batch` ((B, ...) torch tensors, or numpy arrays whose rows are numpy scalars and which collate as torch's
    collate makes them: torch.as_tensor) as its B rows.

    Example:
        >>> [r["tokens"].tolist() for r in sample_rows({"tokens": torch.arange(4).view(2, 2)})]
        [[0, 1], [2, 3]]
    """
    return [SampleRow(batch, index) for index in range(len(next(iter(batch.values()))))]


def whole_batch(rows: list[Any]) -> dict[str, Any] | None:
    """The batch `rows` were cut from, as a new dict of torch tensors, when `rows` are all its rows in order; else
    None.

    Example:
        >>> rows = sample_rows({"tokens": torch.zeros((2, 4))})
        >>> whole_batch(rows) is not None, whole_batch(rows[::-1])
        (True, None)
    """
    first = rows[0] if rows else None
    if type(first) is not SampleRow:
        return None
    batch = first.batch
    if len(rows) != len(next(iter(batch.values()))):
        return None
    for index, row in enumerate(rows):
        if type(row) is not SampleRow or row.batch is not batch or row.index != index:
            return None
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def collate_sample_rows(rows: list[SampleRow], *, collate_fn_map: dict | None = None) -> dict[str, Any]:
    """torch's collate of SampleRows: their batch where whole_batch finds it, else each field collated as torch
    collates a list of plain dicts.

    Example:
        >>> torch.utils.data.default_collate(sample_rows({"x": torch.zeros((2, 3))}))["x"].shape
        torch.Size([2, 3])
    """
    batch = whole_batch(rows)
    if batch is not None:
        return batch
    return {key: collate([row[key] for row in rows], collate_fn_map=collate_fn_map) for key in rows[0]}


def widened(*fields: np.ndarray) -> list[Any]:
    """(B, S) integer arrays as int64 torch tensors, rows of one fresh (F, B, S) storage: one allocation, and one
    converting copy a field (megatron-core's GPTDataset types tokens, labels and position_ids as int64).

    Example:
        >>> [t.dtype for t in widened(np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32))]
        [torch.int64, torch.int64]
    """
    block = np.empty((len(fields), *fields[0].shape), np.int64)  # numpy's allocation: ~4 us a batch less than torch's
    for k, field in enumerate(fields):
        block[k] = field
    return list(torch.from_numpy(block).unbind(0))  # one storage: a DataLoader worker sends it as one segment


def widened_targets(
    tokens: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, *more: np.ndarray, ignore_index: int = -100
) -> list[Any]:
    """widened(tokens, labels, *more) with `ignore_index` in labels where loss_mask is 0 (the targets transformers'
    and torchtitan's cross-entropy skip), tokens and targets made in one compiled pass: a separate scan of the
    loss mask for zeros cost as much as a field's copy here.

    Example:
        >>> widened_targets(np.ones((1, 3), np.int32), np.ones((1, 3), np.int32), np.array([[1, 0, 1]], np.float32))[1]
        tensor([[   1, -100,    1]])
    """  # fmt: skip
    block = np.empty((2 + len(more), *tokens.shape), np.int64)
    if ready(_widen_targets) or started():  # numba is up in this process (the dataset's reads start it)
        _widen_targets(tokens, labels, loss_mask, ignore_index, block)
    else:
        block[0], block[1] = tokens, labels
        np.copyto(block[1], ignore_index, where=loss_mask == 0)
    for k, field in enumerate(more):
        block[2 + k] = field
    return list(torch.from_numpy(block).unbind(0))


@njit(nogil=True)
def _widen_targets(tokens, labels, loss_mask, ignore_index, out) -> None:
    """out[0] = tokens, out[1] = labels or ignore_index where loss_mask is 0 ((B, S) each)."""
    for b in range(tokens.shape[0]):
        # a row's 1-D views, a loop each: vectorised; one loop over both fields indexed in 3-D took twice as long
        t, label, mask, wide_t, wide_label = tokens[b], labels[b], loss_mask[b], out[0, b], out[1, b]
        for c in range(t.shape[0]):
            wide_t[c] = t[c]
        for c in range(t.shape[0]):
            wide_label[c] = label[c] if mask[c] != 0 else ignore_index


def torch_view(array: np.ndarray) -> Any:
    """`array` as a contiguous torch tensor (a view where it already is contiguous), as torch's collate makes it."""
    return torch.from_numpy(np.ascontiguousarray(array))


# torch's documented way to extend default_collate: an entry for this type only (the exact type is looked up first)
default_collate_fn_map[SampleRow] = collate_sample_rows

"""Batches for GPT pretraining: the text of B samples made into tokens, labels, loss mask and position ids.

A dataset reads a batch as a `RawBatch`: the (B, S + extra) text of its samples in the token file's own dtype
(uint16 for most vocabularies; int32 with the pad id where a short sample is padded), plus, for a blend, which
dataset each sample came from. `assemble` makes the model's fields from it, Megatron-Core's way
(GPTDataset.__getitem__, _get_ltor_masks_and_position_ids), into one (4, B, S) int32 block:

    block[0] tokens        text[:, :S]
    block[1] labels        text[:, 1:S+1] (without the extra token: text[:, 1:] and the pad id last)
    block[2] loss_mask     float32 bits: 1, 0 on pad labels (and on eod tokens with eod_mask_loss)
    block[3] position_ids  0..S-1 (restarting after each eod with reset_position_ids)

One allocation per batch and, as torch tensors, four views of one storage. Tokens stay int32: widen on the GPU.

Why the split: DataLoader workers send the raw batch to the main process, which assembles it. A (8, 2049) uint16
text is 32 KiB through the worker's pipe; the assembled torch batch is 256 KiB in a shared-memory segment whose
file descriptor is passed per batch, which cost ~1 ms a batch here and capped 2 workers at ~5000 samples/s
(benchmarks/bench_loader.py). Assembling takes ~10 us.

Example:
    >>> raw = RawBatch(np.array([[5, 0, 7, 8]], np.uint16))
    >>> assemble(raw, GPTDatasetConfig(3, eod_token_id=0, reset_position_ids=True))["position_ids"]
    array([[0, 1, 0]], dtype=int32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from corpusforge._jit import njit

if TYPE_CHECKING:
    from corpusforge.data.gpt_dataset import GPTDatasetConfig

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class RawBatch:
    """The text of a batch as read, before its fields are made (what DataLoader workers send)."""

    text: np.ndarray
    """(B, S + extra) tokens, in the token file's dtype, or int32 holding the pad id."""

    maybe_padded: bool = True
    """False when no token of `text` is a pad (no short sample): the pad scans are skipped."""

    dataset_id: np.ndarray | None = None
    """(B,) int32: for a blend, the dataset each sample came from."""


def assemble(
    raw: RawBatch, config: GPTDatasetConfig, as_torch: bool = False, pin_memory: bool = False
) -> dict[str, Any]:
    """tokens, labels, loss_mask, position_ids (attention_mask if asked; dataset_id for a blend) of a raw batch,
    as numpy arrays or torch tensors (views of one storage, in page-locked memory with pin_memory: written there
    directly, not copied there after).

    Example:
        >>> assemble(RawBatch(np.zeros((2, 5), np.uint16)), GPTDatasetConfig(4), as_torch=True)["tokens"].shape
        torch.Size([2, 4])
    """
    b, s = raw.text.shape[0], raw.text.shape[1] - config.extra
    if as_torch and not config.create_attention_mask and raw.dataset_id is None:
        import torch

        block = torch.empty((4, b, s), dtype=torch.int32, pin_memory=pin_memory)
        fields = batch_fields(block.numpy())
    else:  # numpy; or fields of other shapes too (attention_mask, dataset_id): to_torch copies them into one storage
        block = None
        fields = batch_fields(np.empty((4, b, s), np.int32))
    _split_text(raw.text, config.extra, config.pad, fields["tokens"], fields["labels"])
    batch = finish_batch(fields, config, raw.maybe_padded or not config.add_extra_token_to_sequence)
    if raw.dataset_id is not None:
        batch["dataset_id"] = raw.dataset_id
    if not as_torch:
        return batch
    if block is None:
        return to_torch(batch, pin_memory)
    import torch

    out = dict(zip(FIELDS, block.unbind(0)))  # four views: cheaper than slicing a byte storage four times
    out["loss_mask"] = out["loss_mask"].view(torch.float32)
    return out


def make_batch(text: np.ndarray, config: GPTDatasetConfig) -> dict[str, np.ndarray]:
    """tokens, labels, loss_mask, position_ids (and attention_mask if asked) from (B, S + extra) text, as numpy.

    Mirrors GPTDataset.__getitem__ and _get_ltor_masks_and_position_ids (gpt_dataset.py), batched:
    tokens/labels/position_ids (B, S) int32, loss_mask (B, S) float32, attention_mask (B, 1, S, S) bool with True
    where attention is masked.

    Example:
        >>> make_batch(np.array([[5, 0, 7, 8]], np.int32), GPTDatasetConfig(3, eod_token_id=0,
        ...            reset_position_ids=True))["position_ids"]
        array([[0, 1, 0]], dtype=int32)
    """
    return assemble(RawBatch(text), config)


def batch_fields(block: np.ndarray) -> dict[str, np.ndarray]:
    """tokens, labels, loss_mask, position_ids as views of one (4, B, S) int32 block (loss_mask reinterpreted as
    float32).

    Example:
        >>> batch_fields(np.zeros((4, 2, 8), np.int32))["loss_mask"].dtype
        dtype('float32')
    """
    return {"tokens": block[0], "labels": block[1], "loss_mask": block[2].view(np.float32), "position_ids": block[3]}


@njit(nogil=True)
def _split_text(text, extra, pad, tokens, labels) -> None:
    """tokens = text[:, :S], labels = text[:, 1:S+1] (the last label the pad id without the extra token), widened
    to int32 in one compiled pass."""
    b, s = tokens.shape
    for row in range(b):
        source, t, lab = text[row], tokens[row], labels[row]
        for c in range(s):
            t[c] = source[c]
        for c in range(s - 1 + extra):
            lab[c] = source[c + 1]
        if extra == 0:
            lab[s - 1] = pad


def finish_batch(fields: dict[str, np.ndarray], config: GPTDatasetConfig, maybe_padded: bool) -> dict[str, np.ndarray]:
    """Fill loss_mask and position_ids (and add attention_mask if asked) from tokens and labels, in place.

    `maybe_padded` False says no label or token holds the pad id (Megatron's -1 when there is no pad token, and no
    sample was short): then the pad scans are skipped.

    Example:
        >>> f = batch_fields(np.zeros((4, 1, 3), np.int32)); f["tokens"][:] = [[5, 0, 7]]
        >>> finish_batch(f, GPTDatasetConfig(3, eod_token_id=0, eod_mask_loss=True), False)["loss_mask"]
        array([[1., 0., 1.]], dtype=float32)
    """
    tokens, labels, loss_mask, position_ids = (fields[k] for k in FIELDS)
    b, s = tokens.shape
    loss_mask.fill(1.0)
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod_token_id] = 0.0
    segment_start = None
    if config.reset_position_ids or config.reset_attention_mask:
        # Start of each position's document: one past the last eod strictly before it (0 if none).
        marks = np.zeros((b, s), dtype=np.int32)
        marks[:, 1:] = np.where(tokens[:, :-1] == config.eod_token_id, np.arange(1, s, dtype=np.int32), 0)
        segment_start = np.maximum.accumulate(marks, axis=1)
    position_ids[:] = _positions(s)
    if config.reset_position_ids:
        position_ids -= segment_start
    # Padding (megatron: GPTDataset.__getitem__): no loss on pad labels, pad ids mapped to 0 for the embedding.
    # Tested before written: most batches have no pad at all, and a masked write costs more than a test.
    if maybe_padded or config.pad_token_id is not None:
        pad_labels = labels == config.pad
        if pad_labels.any():
            loss_mask[pad_labels] = 0.0
            labels[pad_labels] = 0
        pad_tokens = tokens == config.pad
        if pad_tokens.any():
            tokens[pad_tokens] = 0
    batch = dict(fields)
    if config.create_attention_mask:
        rows = np.arange(s)[:, None]
        masked = np.broadcast_to(np.arange(s)[None, :] > rows, (b, s, s))
        if config.reset_attention_mask:
            masked = masked | (np.arange(s)[None, None, :] < segment_start[:, :, None])
        batch["attention_mask"] = np.ascontiguousarray(masked)[:, None]
    return batch


_POSITIONS: dict[int, np.ndarray] = {}


def _positions(s: int) -> np.ndarray:
    """0 .. s-1 as int32, kept per length (read-only: only ever copied from)."""
    row = _POSITIONS.get(s)
    if row is None:
        row = _POSITIONS[s] = np.arange(s, dtype=np.int32)
        row.flags.writeable = False
    return row


def to_torch(batch: dict[str, np.ndarray], pin_memory: bool = False) -> dict[str, Any]:
    """The batch as torch tensors, dtypes kept (int32 stays int32: widen on the GPU), all views of one storage
    (page-locked with pin_memory).

    One storage because a DataLoader worker that returns tensors hands each storage to the main process through
    its own shared-memory segment and file descriptor.

    Example:
        >>> to_torch({"tokens": np.zeros((2, 4), np.int32)})["tokens"].dtype
        torch.int32
    """
    import torch

    if not _TORCH_DTYPES:
        _torch_dtypes()
    arrays = {k: np.ascontiguousarray(v) for k, v in batch.items()}
    offsets, total = {}, 0
    for k, a in arrays.items():
        offsets[k] = total
        total += -(-a.nbytes // 8) * 8  # 8-byte aligned, so that every dtype can view its slice
    storage = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    flat = storage.numpy()
    out = {}
    for k, a in arrays.items():
        lo, hi = offsets[k], offsets[k] + a.nbytes
        flat[lo:hi] = a.reshape(-1).view(np.uint8)
        out[k] = storage[lo:hi].view(_TORCH_DTYPES[a.dtype.str]).view(a.shape)
    return out


_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtypes() -> None:
    import torch

    for np_dtype, torch_dtype in (
        (np.int32, torch.int32),
        (np.int64, torch.int64),
        (np.float32, torch.float32),
        (np.bool_, torch.bool),
        (np.uint8, torch.uint8),
        (np.int16, torch.int16),
    ):
        _TORCH_DTYPES[np.dtype(np_dtype).str] = torch_dtype

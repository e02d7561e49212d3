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

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from corpusforge.jit import must_compile, njit, ready, started

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

    boundaries: np.ndarray | None = None
    """(B, K) int32, K <= S + 1: with document_boundaries, where each sample's documents start, then S, padded with S:
    Megatron's cu_seqlens cut to the K columns the batch's samples use (a dataset's read_raw sends ~3 of 2,049, not
    64 KiB of padding through the worker's pipe); assemble pads them to S + 1. K = S + 1 is Megatron's own layout."""

    max_seqlen: np.ndarray | None = None
    """(B,) int32: with document_boundaries, each sample's longest document."""

    @property
    def cu_seqlens(self) -> np.ndarray | None:
        """(B, S + 1) int32: the boundaries in Megatron's layout, padded with S (S: the last column of boundaries,
        which holds S for every sample)."""
        cut = self.boundaries
        if cut is None or len(cut) == 0:
            return cut
        s = int(cut[0, -1])
        if cut.shape[1] == s + 1:
            return cut
        padded = np.full((len(cut), s + 1), s, np.int32)
        padded[:, : cut.shape[1]] = cut
        return padded


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
    if raw.boundaries is not None:
        return _assemble_with_boundaries(raw, config, as_torch, pin_memory)
    if getattr(config, "document_boundaries", False):  # never a batch without the boundaries it was asked for
        raise ValueError(
            "document_boundaries: this raw batch carries no cu_seqlens (it was read by a dataset whose config does not "
            "ask for them); build the datasets with document_boundaries=True, or turn it off"
        )
    if not config.create_attention_mask:  # every field in one compiled pass, into one (4, B, S) block
        # numpy's twin until the kernels are loaded (a first batch read without a memory map: GPTDataset._pieces)
        fill = fill_fields if _compiled(fill_fields) else fill_fields_numpy
        if as_torch and raw.dataset_id is None:
            block = torch_block(b, s, pin_memory)
            fill(raw.text, kernel_options(config, raw.maybe_padded), block.numpy())
            return torch_fields(block)
        array = np.empty((4, b, s), np.int32)
        fill(raw.text, kernel_options(config, raw.maybe_padded), array)
        batch = batch_fields(array)
        if raw.dataset_id is not None:
            batch["dataset_id"] = raw.dataset_id
        return to_torch(batch, pin_memory) if as_torch else batch
    fields = batch_fields(np.empty((4, b, s), np.int32))
    split = _split_text if _compiled(_split_text) else _split_text_numpy
    split(raw.text, config.extra, config.pad, fields["tokens"], fields["labels"])
    batch = finish_batch(fields, config, raw.maybe_padded or not config.add_extra_token_to_sequence)
    if raw.dataset_id is not None:
        batch["dataset_id"] = raw.dataset_id
    return to_torch(batch, pin_memory) if as_torch else batch


def _assemble_with_boundaries(raw: RawBatch, config: GPTDatasetConfig, as_torch: bool, pin_memory: bool) -> dict:
    """assemble for a raw batch that carries document boundaries: the four fields, cu_seqlens and max_seqlen (in
    one storage as torch tensors), position ids restarting at each document."""
    b, s = raw.text.shape[0], raw.text.shape[1] - config.extra
    compiled = _compiled(_fill_bounded)  # else the numpy twins (see assemble)
    if as_torch and raw.dataset_id is None:
        block = bounded_block(b, s, pin_memory)
        fill = _fill_bounded if compiled else _fill_bounded_numpy
        fill(raw.text, kernel_options(config, raw.maybe_padded), raw.boundaries, raw.max_seqlen, block.numpy())
        return bounded_fields(block, b, s)
    array = np.empty((4, b, s), np.int32)
    (fill_fields if compiled else fill_fields_numpy)(raw.text, kernel_options(config, raw.maybe_padded), array)
    (reset_positions if compiled else reset_positions_numpy)(raw.boundaries, array[3])
    batch = {**batch_fields(array), "cu_seqlens": raw.cu_seqlens, "max_seqlen": raw.max_seqlen}
    if raw.dataset_id is not None:
        batch["dataset_id"] = raw.dataset_id
    return to_torch(batch, pin_memory) if as_torch else batch


def bounded_block(b: int, s: int, pin_memory: bool = False) -> Any:
    """An uninitialised (R, S) int32 torch tensor for a batch with document boundaries, one storage (a DataLoader
    worker passes one file descriptor per storage): rows 0..4B-1 tokens, labels, loss_mask bits, position_ids (B rows
    each, as torch_block), then, from row 4B on, cu_seqlens (B x (S + 1)) and max_seqlen (B) flat; R = 5B + ceil(2B /
    S): where 2B <= S one row more, with S - 2B entries unused. Rows of S, not one flat array: the four fields come
    out of one split, as torch_block's from one unbind (bounded_fields).

    Example:
        >>> bounded_block(2, 4).shape
        torch.Size([11, 4])
    """
    torch = _torch()
    return torch.empty((5 * b - (-2 * b // s), s), dtype=torch.int32, pin_memory=pin_memory)


def bounded_fields(block: Any, b: int, s: int) -> dict[str, Any]:
    """The six fields of a filled bounded_block as views of it: tokens, labels, loss_mask (float32), position_ids
    (B, S), cu_seqlens (B, S + 1), max_seqlen (B,).

    Every torch call here costs ~1 us (on these cores, as much as the boundaries themselves), so the fewest: one
    split for the four fields and the rest, and one as_strided for each of cu_seqlens and max_seqlen (a flat split
    then views of each took two calls more).

    Example:
        >>> bounded_fields(bounded_block(2, 4), 2, 4)["cu_seqlens"].shape
        torch.Size([2, 5])
    """
    tokens, labels, loss_mask, position_ids, _ = block.split_with_sizes(_bounded_rows(b, block.shape[0]))
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask.view(_torch().float32),
        "position_ids": position_ids,
        "cu_seqlens": block.as_strided((b, s + 1), (s + 1, 1), 4 * b * s),
        "max_seqlen": block.as_strided((b,), (1,), 4 * b * s + b * (s + 1)),
    }


@functools.cache
def _bounded_rows(b: int, rows: int) -> tuple[int, ...]:
    return (b, b, b, b, rows - 4 * b)


@njit(nogil=True)
def _fill_bounded(text, options, boundaries, max_in, out) -> None:
    """fill_fields, cu_seqlens padded from `boundaries` (RawBatch.boundaries) to S + 1 and max_seqlen beside the
    fields, position ids per document, into `out` laid out as bounded_block (or any C-contiguous array of at least
    B * (5S + 2) entries laid out so): one dispatch, and the views made here, not by numpy or torch calls."""
    b, s = text.shape[0], text.shape[1] - options[_EXTRA]
    flat = out.reshape(-1)
    block = flat[: 4 * b * s].reshape((4, b, s))
    fill_fields(text, options, block)
    cu_out = flat[4 * b * s : 4 * b * s + b * (s + 1)].reshape((b, s + 1))
    width = boundaries.shape[1]
    for r in range(b):
        row = cu_out[r]
        row[:width] = boundaries[r]
        # a slice fill: a loop over k in range(width, s + 1) checks each index for wraparound, and took 3x as long
        row[width:] = s
    flat[4 * b * s + b * (s + 1) : b * (5 * s + 2)] = max_in
    reset_positions(boundaries, block[3])  # fill_fields wrote none (_POSITIONS_BY_DOCUMENT)


def _compiled(kernel: Any) -> bool:
    """Whether to call `kernel` rather than its numpy twin: numba has started in this process and no load is in
    flight in the background (jit.py), or a kernel had to be compiled (a cold cache: jit.must_compile); until then a
    batch does not wait ~0.6-1 s for numba's start-up."""
    return ready(kernel) or started() or must_compile()


def _fill_bounded_numpy(text, options, boundaries, max_in, out) -> None:
    """_fill_bounded in numpy: the same values in `out`."""
    b, s = text.shape[0], text.shape[1] - int(options[_EXTRA])
    flat = out.reshape(-1)
    block = flat[: 4 * b * s].reshape((4, b, s))
    fill_fields_numpy(text, options, block)
    cu_out = flat[4 * b * s : 4 * b * s + b * (s + 1)].reshape((b, s + 1))
    cu_out[:, : boundaries.shape[1]] = boundaries
    cu_out[:, boundaries.shape[1] :] = s
    flat[4 * b * s + b * (s + 1) : b * (5 * s + 2)] = max_in
    reset_positions_numpy(boundaries, block[3])


def reset_positions_numpy(cu_seqlens: np.ndarray, positions: np.ndarray) -> None:
    """reset_positions in numpy: each position minus the start of its document, the last boundary at or before it.
    Every row of cu_seqlens starts at 0 and ends with S (RawBatch.boundaries), so every position is written.

    Example:
        >>> p = np.zeros((1, 4), np.int32); reset_positions_numpy(np.array([[0, 3, 4, 4, 4]], np.int32), p); p.tolist()
        [[0, 1, 2, 0]]
    """
    b, s = positions.shape
    starts = np.zeros((b, s + 1), np.int32)
    cu = np.minimum(cu_seqlens, s).astype(np.intp)
    np.put_along_axis(starts, cu, cu.astype(np.int32), axis=1)  # a repeated boundary (an empty piece): one value
    np.maximum.accumulate(starts, axis=1, out=starts)
    positions[:] = _positions(s) - starts[:, :s]


@njit(nogil=True)
def reset_positions(cu_seqlens, positions) -> None:
    """positions[b, t] = t - the start of t's document, for documents cu_seqlens[b] (S + 1 columns, or fewer: see
    RawBatch.boundaries): what Megatron-LM sets with inter-document masking (each document piece counts from 0,
    whatever reset_position_ids says).

    Example:
        >>> p = np.zeros((1, 4), np.int32); reset_positions(np.array([[0, 3, 4, 4, 4]], np.int32), p); p.tolist()
        [[0, 1, 2, 0]]
    """
    s = positions.shape[1]
    for b in range(positions.shape[0]):
        cu, row = cu_seqlens[b], positions[b]
        for k in range(len(cu) - 1):
            lo, hi = np.int64(cu[k]), np.int64(cu[k + 1])  # held, not reloaded: row and cu may alias
            if lo >= s:  # the padding of cu_seqlens: no document past here
                break
            # counted from 0 in a slice of its own: indices that cannot be negative, so the loop vectorises
            # (row[t] = t - lo, with a wraparound check per store, took 2.6x as long)
            piece = row[lo:hi]
            for t in range(hi - lo):
                piece[t] = t


def torch_block(b: int, s: int, pin_memory: bool = False) -> Any:
    """An uninitialised (4, B, S) int32 torch tensor for tokens, labels, loss_mask bits and position_ids."""
    torch = _torch()
    return torch.empty((4, b, s), dtype=torch.int32, pin_memory=pin_memory)


def torch_fields(block: Any) -> dict[str, Any]:
    """The four fields of a filled (4, ..., S) int32 tensor as views of it (loss_mask as float32).

    Example:
        >>> torch_fields(torch.zeros((4, 2, 8), dtype=torch.int32))["loss_mask"].dtype
        torch.float32
    """
    tokens, labels, loss_mask, position_ids = block.unbind(0)  # one call for four views: cheaper than 4 slices
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask.view(_torch().float32),
        "position_ids": position_ids,
    }


_TORCH: list[Any] = []


def _torch() -> Any:
    """torch, imported on first use (it takes ~1 s to import; the index builds do not need it)."""
    if not _TORCH:
        import torch

        _TORCH.append(torch)
    return _TORCH[0]


# kernel_options: the int64 vector that tells fill_fields what to do (one array argument instead of six: each
# argument of a numba call costs its dispatcher ~0.1 us to type).
_EXTRA, _PAD, _EOD, _EOD_MASK_LOSS, _RESET_POSITIONS, _CHECK_PAD = range(6)

# options[_RESET_POSITIONS] with document boundaries: the caller writes every position from them (reset_positions),
# so fill_fields writes none (each written once, not 0..S-1 first and then rewritten from the second document on).
_POSITIONS_BY_DOCUMENT = 2


def kernel_options(config: GPTDatasetConfig, maybe_padded: bool = False) -> np.ndarray:
    """(6,) int64: extra token, pad id, eod id, eod_mask_loss, reset_position_ids (_POSITIONS_BY_DOCUMENT with
    document boundaries), and whether pad ids may occur (a short sample was padded, a pad token is configured, or the
    last label is the pad without the extra token).

    Example:
        >>> kernel_options(GPTDatasetConfig(8)).tolist()
        [1, -1, -1, 0, 0, 0]
    """
    eod = -1 if config.eod_token_id is None else config.eod_token_id
    check_pad = maybe_padded or config.pad_token_id is not None or not config.add_extra_token_to_sequence
    # with document boundaries the positions restart at each document (reset_positions), whatever reset_position_ids
    reset = _POSITIONS_BY_DOCUMENT if getattr(config, "document_boundaries", False) else int(config.reset_position_ids)
    return np.array([config.extra, config.pad, eod, config.eod_mask_loss, reset, check_pad], np.int64)


# The bits of float32 1.0: the loss mask is written as int32 into the block it shares with the other fields.
_ONE_F32 = 0x3F800000


@njit(nogil=True)
def fill_fields(text, options, block) -> None:
    """block[:, b] = tokens, labels, loss_mask (float32 bits), position_ids of text row b, made as finish_batch
    and Megatron-Core's GPTDataset.__getitem__ make them (masks from the tokens as read; then no loss on pad
    labels, pad ids mapped to 0), in one compiled pass over each row instead of a dozen numpy calls.

    Example:
        >>> block = np.empty((4, 1, 3), np.int32)
        >>> fill_fields(np.array([[5, 0, 7, 8]], np.uint16), kernel_options(GPTDatasetConfig(3)), block)
        >>> block[1].tolist()
        [[0, 7, 8]]
    """
    extra, pad, eod = options[_EXTRA], options[_PAD], options[_EOD]
    n, s = block.shape[1], block.shape[2]
    for b in range(n):
        row = text[b]
        tokens, labels, loss, positions = block[0, b], block[1, b], block[2, b], block[3, b]
        if options[_RESET_POSITIONS] == _POSITIONS_BY_DOCUMENT:  # the caller writes them
            for c in range(s):
                tokens[c] = row[c]
                loss[c] = _ONE_F32
        else:
            for c in range(s):
                tokens[c] = row[c]
                loss[c] = _ONE_F32
                positions[c] = c
        for c in range(s - 1 + extra):
            labels[c] = row[c + 1]
        if extra == 0:
            labels[s - 1] = pad
        if options[_EOD_MASK_LOSS]:
            for c in range(s):
                if tokens[c] == eod:
                    loss[c] = 0
        if options[_RESET_POSITIONS] == 1:  # positions restart after each eod token (before pads become 0)
            start = 0
            for c in range(s):
                positions[c] = c - start
                if tokens[c] == eod:
                    start = c + 1
        if options[_CHECK_PAD]:
            for c in range(s):
                if labels[c] == pad:
                    loss[c] = 0
                    labels[c] = 0
                if tokens[c] == pad:
                    tokens[c] = 0


def fill_fields_numpy(text: np.ndarray, options: np.ndarray, block: np.ndarray) -> None:
    """fill_fields in numpy, the same block: for the samples a process reads before numba has started in it (its
    start-up, ~0.6-1.5 s, is paid once the process reads more; corpusforge.data.gpt_dataset._read_fields).

    Example:
        >>> block = np.empty((4, 1, 3), np.int32)
        >>> fill_fields_numpy(np.array([[5, 0, 7, 8]], np.uint16), kernel_options(GPTDatasetConfig(3)), block)
        >>> block[1].tolist()
        [[0, 7, 8]]
    """
    extra, pad, eod = (int(options[k]) for k in (_EXTRA, _PAD, _EOD))
    tokens, labels, loss, positions = block
    s = block.shape[2]
    tokens[:] = text[:, :s]
    labels[:, : s - 1 + extra] = text[:, 1 : s + extra]
    if extra == 0:
        labels[:, s - 1] = pad
    loss.fill(_ONE_F32)
    if options[_EOD_MASK_LOSS]:
        loss[tokens == eod] = 0
    positions[:] = _positions(s)
    if options[_RESET_POSITIONS] == 1:  # minus the start of each position's document: one past the last eod before it
        starts = np.zeros(tokens.shape, np.int32)
        starts[:, 1:] = np.where(tokens[:, :-1] == eod, _positions(s)[1:], 0)
        positions -= np.maximum.accumulate(starts, axis=1)
    if options[_CHECK_PAD]:
        pads = labels == pad
        loss[pads] = 0
        labels[pads] = 0
        tokens[tokens == pad] = 0


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


def _split_text_numpy(text, extra, pad, tokens, labels) -> None:
    """_split_text in numpy: the same tokens and labels."""
    s = tokens.shape[1]
    tokens[:] = text[:, :s]
    labels[:, : s - 1 + extra] = text[:, 1 : s + extra]
    if extra == 0:
        labels[:, s - 1] = pad


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

"""GPT pretraining samples over a token dataset, with Megatron-Core `GPTDataset` semantics.

For the same files, seed, sequence length, split and sample count, sample i here holds the same tokens as sample i
of `megatron.core.datasets.gpt_dataset.GPTDataset`. The algorithm, written from its description:

1. split: the split string ("969,30,1") is normalised and turned into cumulative book-ends; split s exposes the
   sequences [round(lo * S), round(hi * S)) (blended_megatron_dataset_config.py: parse_and_normalize_split,
   convert_split_vector_to_split_matrix; blended_megatron_dataset_builder.py: _build_megatron_dataset_splits).
2. epochs: as many passes E over the split's T tokens as it takes to cover num_samples * seq_length + 1 tokens
   (gpt_dataset.py: GPTDataset._get_num_epochs).
3. document index: the split's sequence ids repeated E times and shuffled with numpy.random.RandomState(seed);
   if the last epoch would supply under 80% of an epoch's samples, the first E-1 epochs and the last one are
   shuffled separately, so the short last epoch is not smeared over the whole run (_build_document_index).
4. sample index: the documents, in document-index order, form one token stream; sample j starts at token
   j * seq_length of it and reads seq_length + 1 tokens, so consecutive samples share one token (the label of
   the last position). Each start is stored as (position in the document index, offset in that document)
   (helpers.cpp: build_sample_idx). Here one merge of the document stream with the sample starts, in plain C
   (corpusforge/_sample_index.c, built by pip install); where that is not built, the same walk in numba, or, where
   numba has not started in the process and the input is small, the same rows from numpy.
5. shuffle index: a permutation of the samples with the same RandomState, continued; with a separate final
   epoch the samples of the first E-1 epochs and those of the last are permuted separately (_build_shuffle_index).

The shuffles are numpy's RandomState.shuffle in plain C (mt19937.py: the same permutations, ~4x faster, no numba
to start), and the sample index is built on a second thread while the shuffle index is drawn (neither holds the
GIL). The sample index's C walk costs a few microseconds for a small dataset (numpy's twin ~0.15 ms of fixed-overhead
calls, numba's ~1 s start-up in a fresh process: corpusforge/jit.py); a blend of thousands of small datasets builds
thousands of them. A blend's datasets are built and cached together (SharedIndices, build_together).

Sample i is then the sample-index entry shuffle[i], read across as many documents as it spans, a whole batch per
call (copied straight from the memory map where the file is read through it), and made into tokens, labels, loss
mask and position ids by corpusforge/data/batch.py. Tokens come out as int32 (widen to int64 on the GPU). A copy from
the map is a read a watchdog sees (storage/readwatch.py): the kernel marks its slot (file, bytes, since when) and
stores each piece's byte offset there before copying it, so that a page fault a hung storage never answers is named.

Example:
    >>> ds = GPTDataset(IndexedDataset("out/a_text_document"), "train", (0, 969), 1000,
    ...                 GPTDatasetConfig(seq_length=2048, seed=1234))
    >>> ds.get_batch([0, 1])["tokens"].shape
    (2, 2048)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from corpusforge.data.batch import (
    RawBatch,
    _torch,
    assemble,
    batch_fields,
    bounded_block,
    bounded_fields,
    fill_fields,
    fill_fields_numpy,
    kernel_options,
    reset_positions,
    reset_positions_numpy,
    torch_block,
    torch_fields,
)
from corpusforge.data.cache import IndexCache, describe_dataset, picklable, unpickled
from corpusforge.data.mt19937 import seeded, shuffle
from corpusforge.errors import ArgumentError
from corpusforge.indexed import IndexedDataset
from corpusforge.jit import (
    compiling,
    compiling_here,
    finish_loading,
    load_in_background,
    must_compile,
    njit,
    ready,
    started,
)
from corpusforge.storage import readwatch
from corpusforge.storage.readwatch_kernels import OFFSET, mark_begin, mark_end, monotonic_ns

try:
    from corpusforge import _sample_index
except ImportError:  # not built (a source checkout without pip install): numba's _sample_starts or numpy, same rows
    _sample_index = None
try:
    from corpusforge import _mt19937
except ImportError:  # not built: mt19937.shuffle (numpy's own shuffle), the same permutations
    _mt19937 = None

SPLIT_NAMES = ("train", "valid", "test")

# Megatron-Core's _PAD_TOKEN_ID (megatron_dataset.py): a pad id no real token has.
NO_PAD = -1

# gpt_dataset.py, _build_document_sample_shuffle_indices: the last epoch is shuffled on its own when it
# supplies fewer than this fraction of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


class ShortSplitWarning(UserWarning):
    """A split holds fewer tokens than one sample: its samples repeat it (Megatron-Core builds it the same way)."""


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How samples are cut from token datasets and what each sample carries (Megatron's GPTDatasetConfig)."""

    seq_length: int
    """Tokens per sample fed to the model; each sample reads seq_length + 1 tokens (megatron: sequence_length)."""

    seed: int = 1234
    """Seed of every shuffle: document order, sample order (megatron: random_seed)."""

    split: str = "969,30,1"
    """Relative sizes of train, valid, test, taken in order over each dataset's sequences (megatron: split)."""

    eod_token_id: int | None = None
    """The end-of-document token; needed by reset_position_ids, reset_attention_mask and eod_mask_loss."""

    pad_token_id: int | None = None
    """A pad token: labels equal to it get loss mask 0 and are set to 0, like Megatron's; None means none (-1)."""

    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""

    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens (only in the attention mask, so it needs create_attention_mask)."""

    eod_mask_loss: bool = False
    """Give end-of-document tokens loss mask 0."""

    create_attention_mask: bool = False
    """Return a (B, 1, S, S) boolean mask, True where attention is masked; off by default, since fused attention
    kernels build the causal mask themselves (megatron: create_attention_mask, default True there)."""

    add_extra_token_to_sequence: bool = True
    """Read seq_length + 1 tokens per sample so that tokens and labels are both seq_length long."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial sample of the validation split (else it is padded with the pad token)."""

    mid_level_dataset_surplus: float = 0.005
    """Blends build each dataset this fraction larger than its share, so the blend never runs short."""

    document_boundaries: bool = False
    """Give each sample its document boundaries as variable-length attention takes them, as Megatron-LM does with
    --dataloader-inter-document-masking (PR #5298; GPTDataset.__getitem__ at commit
    d98e8a64ddf34856e74b24714e3bedb2f5a39553): `cu_seqlens` (S + 1,) int32, the starts of the sample's document
    pieces then S, padded with S to a fixed length; `max_seqlen` int32, the longest piece; and position_ids restarting
    at every piece (see _document_boundaries). Off: batches are unchanged."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {self.seq_length}")
        needs_eod = [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, n)]
        if needs_eod and self.eod_token_id is None:
            raise ValueError(f"{', '.join(needs_eod)} need eod_token_id (the end-of-document token id)")
        if self.pad_token_id is not None and self.pad_token_id == self.eod_token_id:
            # Megatron warns and drops the pad id (megatron_dataset.py); a silent change of the loss is worse.
            raise ValueError(f"pad_token_id {self.pad_token_id} is also the eod token; give a distinct pad id or None")
        if self.document_boundaries and self.create_attention_mask:
            # Megatron omits the attention mask with inter-document masking: the boundaries replace it
            raise ValueError("document_boundaries replaces create_attention_mask: ask for one of them")
        parse_split(self.split)

    @property
    def extra(self) -> int:
        return int(self.add_extra_token_to_sequence)

    @property
    def pad(self) -> int:
        return NO_PAD if self.pad_token_id is None else self.pad_token_id

    def index_description(self) -> dict[str, Any]:
        """The fields that determine the indices (the masks options do not)."""
        return {
            "seq_length": self.seq_length,
            "seed": self.seed,
            "split": parse_split(self.split),
            "add_extra_token_to_sequence": self.add_extra_token_to_sequence,
        }

    def describe(self) -> dict[str, Any]:
        described = asdict(self)
        if not self.document_boundaries:  # a loader state saved before this option existed still matches
            del described["document_boundaries"]
        return described


# ---------------------------------------------------------------------------------------------------------------
# split


def parse_split(split: str) -> list[float]:
    """The split string as three weights summing to 1, exactly as Megatron computes them.

    Mirrors blended_megatron_dataset_config.py: parse_and_normalize_split (numbers found by regex, padded with
    zeros to three, divided by their float64 sum).

    Example:
        >>> parse_split("99,1")
        [0.99, 0.01, 0.0]
    """
    return list(_parse_split(split))


@functools.lru_cache(maxsize=64)
def _parse_split(split: str) -> tuple[float, ...]:
    """parse_split, once per split string: a blend asks it for each of its thousands of datasets (a regex each)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(parts) <= 3:
        raise ArgumentError(f"split {split!r}: give one to three comma-separated weights for train,valid,test")
    parts += [0.0] * (3 - len(parts))
    total = float(np.sum(np.array(parts, dtype=np.float64)))
    if total <= 0:
        raise ArgumentError(f"split {split!r}: the weights must sum to a positive number")
    return tuple((np.array(parts, dtype=np.float64) / total).tolist())


def split_ranges(split: str, num_sequences: int) -> list[tuple[int, int] | None]:
    """The [begin, end) sequence range of train, valid, test; None for a split with zero weight.

    Book-ends are cumulative sums in Python floats; an empty book-end is None; the range is
    int(round(x * S)) (convert_split_vector_to_split_matrix; _build_megatron_dataset_splits).

    Example:
        >>> split_ranges("969,30,1", 1000)
        [(0, 969), (969, 999), (999, 1000)]
    """
    weights = parse_split(split)
    ends = [0.0]
    for w in weights:
        ends.append(ends[-1] + w)
    out: list[tuple[int, int] | None] = []
    for lo, hi in zip(ends[:-1], ends[1:]):
        if hi <= lo:
            out.append(None)
        else:
            out.append((int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the three indices


def count_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Passes over the split needed for num_samples samples: the least E with E * T >= n * seq_length + extra.

    Example:
        >>> count_epochs(tokens_per_epoch=1000, num_samples=10, seq_length=128, extra=1)
        2
    """
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def count_samples(tokens: int, seq_length: int, extra: int, drop_last_partial: bool) -> int:
    """Samples in `tokens` tokens (helpers.cpp build_sample_idx: it divides in float32 when not dropping)."""
    if drop_last_partial:
        return (tokens - extra) // seq_length
    return math.ceil(float(np.float32(tokens - extra) / np.float32(seq_length)))


def build_document_index(
    documents: np.ndarray | range, num_epochs: int, rng: np.random.RandomState | KeyStream, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` repeated num_epochs times and shuffled in place by `rng` (int32, Megatron's dtype).

    With separate_final_epoch the first num_epochs-1 copies are shuffled together, then the last one alone
    (gpt_dataset.py: _build_document_index). Both are shuffled where they lie in one array: the same values as
    shuffling two arrays and concatenating them, without the copy.

    Example:
        >>> build_document_index(np.arange(3), 2, np.random.RandomState(0), False).shape
        (6,)
    """
    n = len(documents)
    index = np.empty(n * num_epochs, dtype=np.int32)
    if isinstance(documents, range) and documents.step == 1 and _compiled(_count_from, n):
        _count_from(index[:n], documents.start)
    elif isinstance(documents, range):
        index[:n] = np.arange(documents.start, documents.stop, documents.step, dtype=np.int32)
    else:
        index[:n] = np.asarray(documents, dtype=np.int32)
    for epoch in range(1, num_epochs):
        index[epoch * n : (epoch + 1) * n] = index[:n]
    if separate_final_epoch and num_epochs > 1:
        head = (num_epochs - 1) * n
        _shuffle(rng, index[:head])
        _shuffle(rng, index[head:])
    else:
        _shuffle(rng, index)
    return index


class KeyStream:
    """`np.random.RandomState(seed)`'s stream as its MT19937 key and position, for the compiled shuffle
    (corpusforge/_mt19937.c) to draw from directly: the same permutations, in the same order, as the RandomState's
    own shuffle. A RandomState's state costs ~100 us to read and write back around each compiled call, so arrays
    below 8,192 entries went to numpy's shuffle (~24 ns an entry: two thirds of a small dataset's index build, and a
    blend builds thousands); from a key, ~3 ns an entry whatever the size. Only where the compiled shuffle is built
    (`KeyStream.usable`).

    Example:
        >>> a, b = np.arange(10), np.arange(10)
        >>> np.random.RandomState(7).shuffle(a); KeyStream(7).shuffle(b)
        >>> bool((a == b).all())
        True
    """

    __slots__ = ("key", "pos")

    def __init__(self, seed: int) -> None:
        self.key = _seeded_key(seed).copy()  # 624 words: a copy costs ~1 us, seeding them ~10
        self.pos = len(self.key)  # as RandomState(seed) leaves it: the first draw regenerates the block

    @staticmethod
    def usable(*lengths: int) -> bool:
        """Whether the compiled shuffle is built and takes arrays of these lengths (numpy draws 64-bit words past
        2^32 entries: those stay with numpy)."""
        return _mt19937 is not None and all(n - 1 <= 0xFFFFFFFF for n in lengths)

    def shuffle(self, array: np.ndarray) -> None:
        """Shuffle a contiguous 1-D array in place as RandomState.shuffle would, advancing the stream."""
        self.pos = _mt19937.shuffle(array, array.itemsize, self.key, self.pos)


@functools.lru_cache(maxsize=16)
def _seeded_key(seed: int) -> np.ndarray:
    """The MT19937 key of np.random.RandomState(seed) (its legacy seeding; a seed outside [0, 2^32) is refused by
    it), read-only."""
    key = np.random.RandomState(seed).get_state(legacy=False)["state"]["key"].astype(np.uint32)
    key.setflags(write=False)
    return key


def _shuffle(rng: np.random.RandomState | KeyStream, array: np.ndarray) -> None:
    if isinstance(rng, KeyStream):
        rng.shuffle(array)
    else:
        shuffle(rng, array)


@njit(nogil=True)
def _count_from(out, start) -> None:
    """out[i] = start + i (np.arange written into an existing array)."""
    for i in range(len(out)):
        out[i] = start + i


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_samples: int,
    extra: int,
) -> np.ndarray:
    """(num_samples + 1, 2) array: the (document-index position, offset) where each sample starts, and a last row
    where the last sample ends; the same values as Megatron's helpers.cpp build_sample_idx, from one linear merge.

    In the token stream of the documents in document-index order, sample j starts at token j * seq_length. With
    the extra token, the start is in the document that holds that token; without it, in the document where the
    previous sample ended (so the offset may equal the document's length). Row 0 is always (0, 0). A last sample
    that runs past the end of the stream (not dropped: validation only) ends at (last, length - extra).

    Example:
        >>> build_sample_index(np.array([5, 5], np.int32), np.array([0, 1], np.int32), 4, 2, 1)
        array([[0, 0],
               [0, 4],
               [1, 3]], dtype=int32)
    """
    big = max(len(document_index), int(sequence_lengths.max()) if len(sequence_lengths) else 0)
    dtype = np.int32 if big <= np.iinfo(np.int32).max else np.int64  # helpers.py: build_sample_idx
    out = np.empty((num_samples + 1, 2), dtype=dtype)  # every row is written: no zeroing pass over fresh pages
    lengths, documents = np.ascontiguousarray(sequence_lengths), np.ascontiguousarray(document_index)
    if _sample_index is not None and lengths.dtype == np.int32 and documents.dtype == np.int32 and seq_length >= 1:
        _sample_index.fill(lengths, documents, seq_length, num_samples, extra, out)
    elif _compiled(_sample_starts, num_samples + len(documents)):
        _sample_starts(lengths, documents, seq_length, num_samples, extra, out)
    else:
        _sample_starts_numpy(lengths, documents, seq_length, num_samples, extra, out)
    return out


# The index builders call their compiled kernels for inputs of this many entries and more, or where numba has
# started in this process (any kernel loaded: one more costs ~5-10 ms); below, numpy (a few ms at 1e5 entries)
# rather than numba's start-up (~1 s for the first kernel of a process: corpusforge/jit.py).
_COMPILED_FROM = 1 << 22


def _compiled(kernel, entries: int) -> bool:
    """Whether to call `kernel` for an input of `entries` (see _COMPILED_FROM) rather than its numpy twin."""
    return entries >= _COMPILED_FROM or ready(kernel) or started()


def _sample_index_compiled(entries: int) -> bool:
    """Whether build_sample_index runs compiled code (which releases the GIL) for an input of `entries`: the C
    kernel wherever it is built, else numba's under _compiled's rule."""
    return _sample_index is not None or _compiled(_sample_starts, entries)


def _sample_starts_numpy(sequence_lengths, document_index, seq_length, num_samples, extra, out) -> None:
    """_sample_starts in numpy, the same rows, without loading a kernel: document k of the first n - 1 holds the
    starts j * seq_length (j >= 1) below its stream end (at or below without the extra token) that no earlier one
    holds, so the position of start j is the number of documents that hold fewer than j starts: one bincount and
    its running sum place every start (no binary search, and no np.repeat, which copies element by element and
    took twice as long), then one gather of the documents' beginnings gives the offsets. A block of documents at a
    time: the temporaries stay small and are reused from the heap; whole-array ones cost ~900 fresh pages at 1e8
    tokens (~4 us each to fault in here), a fifth of the build."""
    n = len(document_index)
    out[0] = 0
    if n == 0:
        out[:] = 0
        return
    rows = out[1:]
    positions, offsets = rows[:, 0], rows[:, 1]
    done = 0  # the rows filled: starts 1 .. done are placed
    # A power-of-two seq_length divides by a shift (an arithmetic shift floors negatives, as // does).
    seq = int(seq_length)
    shift = seq.bit_length() - 1 if seq > 0 and seq & (seq - 1) == 0 else -1
    ends = np.empty(min(_STARTS_BLOCK, n) + 1, np.int64)  # ends[k + 1]: stream end of the block's document k;
    ends[0] = 0  # ends[0]: where the block starts
    # The block's lengths, gathered by np.take into a reused buffer: lengths[index] makes a fresh array and checks
    # its indices by a slower path (0.044 against 0.019 ms per block of 8,192 here).
    gathered = np.empty(min(_STARTS_BLOCK, n), sequence_lengths.dtype)
    for a in range(0, n - 1, _STARTS_BLOCK):
        b = min(n - 1, a + _STARTS_BLOCK)
        k = b - a
        block_ends = ends[1 : k + 1]
        np.take(sequence_lengths, document_index[a:b], out=gathered[:k])
        np.cumsum(gathered[:k], dtype=np.int64, out=block_ends)
        block_ends += ends[0]
        covered = block_ends - extra  # starts j >= 1 below each document's end
        if shift >= 0:
            covered >>= shift
        else:
            covered //= seq_length
        # covered never decreases (lengths are not negative): clamp only where an end is out of [done, num_samples]
        if covered[0] < done:
            np.maximum(covered, done, out=covered)
        top = int(covered[-1])
        if top > num_samples:
            np.minimum(covered, num_samples, out=covered)
            top = num_samples
        if top > done:
            if done:
                covered -= done
            local = np.bincount(covered, minlength=top - done + 1)[: top - done]
            np.cumsum(local, out=local)
            np.add(local, a, out=positions[done:top], casting="unsafe")
            starts = np.arange((done + 1) * seq_length, (top + 1) * seq_length, seq_length, dtype=np.int64)
            starts -= ends[local]  # minus where its document begins
            offsets[done:top] = starts
            done = top
        ends[0] = ends[k]
    # The rest are clamped to the last document; a sample running past its end ends at (last, length - extra).
    end, last = int(ends[0]), int(sequence_lengths[document_index[n - 1]])
    tail = np.arange((done + 1) * seq_length, (num_samples + 1) * seq_length, seq_length, dtype=np.int64)
    positions[done:] = n - 1
    offsets[done:] = np.where(tail + extra > end + last, last - extra, tail - end)


# Documents _sample_starts_numpy takes at a time (64 KiB temporaries of int64).
_STARTS_BLOCK = 1 << 13


# Documents whose lengths _sample_starts gathers at a time (32 KiB of int64: stays in L1/L2).
_GATHER = 1 << 12


@njit(nogil=True)
def _sample_starts(sequence_lengths, document_index, seq_length, num_samples, extra, out) -> None:
    """Fill out[j] = (position, offset) of sample start j * seq_length: one pass over the document stream with
    starts that only grow, a merge of two sorted sequences, O(D + S) (a searchsorted over a cumsum took 3x longer).

    position is the first document whose stream end is past the start (at or past it without the extra token),
    clamped to the last document; a start whose sample would run past the stream's end (an undropped partial
    sample: only possible in the last document, whose end is the stream's total) ends at (last, length - extra).

    The walk goes document by document and, for each, writes the next sample's row as if it started there, moving
    on only when it does: no branch on the data for documents shorter than a sample (the common case), so no
    mispredictions, and the carried dependency is one compare and one add. A row written by a document that does
    not hold that start is rewritten by the one that does, which comes later. Document lengths are gathered a
    block at a time first, so that the walk does not wait on random loads."""
    n = len(document_index)
    out[0, 0] = out[0, 1] = 0
    if n == 0:
        out[:] = 0
        return
    inclusive = 1 - extra  # without the extra token a start may sit at a document's end
    lengths = np.empty(_GATHER, np.int64)
    j = 1  # the next row to fill
    start = np.int64(seq_length)  # its stream token
    end = np.int64(0)  # the stream end of the documents walked so far
    block = 0
    while block < n - 1 and j <= num_samples:  # the last document is clamped to, below
        count = min(_GATHER, n - 1 - block)
        for k in range(count):
            lengths[k] = sequence_lengths[document_index[block + k]]
        for k in range(count):
            begin = end
            end += lengths[k]
            out[j, 0] = block + k
            out[j, 1] = start - begin
            here = np.int64(start < end + inclusive)
            j += here
            start += seq_length & -here
            while start < end + inclusive and j <= num_samples:  # a document holding more than one start
                out[j, 0] = block + k
                out[j, 1] = start - begin
                j += 1
                start += seq_length
            if j > num_samples:
                break
        block += count
    last = n - 1
    length = np.int64(sequence_lengths[document_index[last]])
    while j <= num_samples:
        out[j, 0] = last
        out[j, 1] = length - extra if start + extra > end + length else start - end
        j += 1
        start += seq_length


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState | KeyStream) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size) (_build_shuffle_index),
    both shuffled where they lie in one array.

    Example:
        >>> sorted(build_shuffle_index(3, 5, np.random.RandomState(0))[:3])
        [0, 1, 2]
    """
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    index = np.arange(total_size, dtype=dtype)
    _shuffle(rng, index[:num_samples])
    if num_samples != total_size:
        _shuffle(rng, index[num_samples:])
    return index


def build_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray | range,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    extra: int = 1,
    drop_last_partial: bool = True,
    tokens_per_epoch: int | None = None,
) -> dict[str, np.ndarray]:
    """Document, sample and shuffle index of one split, as Megatron's
    GPTDataset._build_document_sample_shuffle_indices builds them (one RandomState, in that order).

    `tokens_per_epoch`, the tokens of `documents`, is summed here when not given (a caller that has it saves a
    gather over the split).

    Example:
        >>> idx = build_indices(np.full(100, 50, np.int32), np.arange(100), 40, 128, seed=1234)
        >>> idx["shuffle_index"].shape, idx["sample_index"].shape     # 2 epochs of 5000 tokens: 78 samples
        ((78,), (79, 2))
    """
    if tokens_per_epoch is None:
        tokens_per_epoch = int(np.sum(sequence_lengths[np.asarray(documents)], dtype=np.int64))
    num_epochs = count_epochs(tokens_per_epoch, num_samples, seq_length, extra)
    separate_final_epoch = False
    if num_epochs > 1:
        assert num_samples is not None
        before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        per_epoch = (tokens_per_epoch - extra) // seq_length
        separate_final_epoch = num_samples - before_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    total = count_samples(num_epochs * tokens_per_epoch, seq_length, extra, drop_last_partial)
    if KeyStream.usable(len(documents) * num_epochs, total):
        rng = KeyStream(seed)
    else:
        rng = seeded(seed)  # RandomState(seed) without its ~120 us of OS-entropy seeding first
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    # The sample index needs the document index but not the generator, and the shuffle index the generator but
    # not the sample index: both kernels release the GIL, so they run side by side on two cores.
    head = before_final if separate_final_epoch else total
    # Side by side only where both are compiled and large enough: numpy's shuffle holds the GIL, and a hand-off to
    # the helper thread costs more than a small build.
    compiled = _sample_index_compiled(total + len(document_index))
    if total < _PARALLEL_ABOVE or not compiled:
        sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total, extra)
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": build_shuffle_index(head, total, rng),
        }
    pending = _helper().submit(build_sample_index, sequence_lengths, document_index, seq_length, total, extra)
    shuffle_index = build_shuffle_index(head, total, rng)
    return {"document_index": document_index, "sample_index": pending.result(), "shuffle_index": shuffle_index}


# build_indices builds the sample index on a second thread for more samples than this (~100 us of work each side).
_PARALLEL_ABOVE = 1 << 16


_HELPER: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    """One thread of this process for index work beside the caller's (a forked child makes its own)."""
    global _HELPER
    if _HELPER is None or _HELPER[0] != os.getpid():
        _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="index-build"))
    return _HELPER[1]


# ---------------------------------------------------------------------------------------------------------------
# samples


@njit()
def _sample_pieces(rows, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, width, extra):
    """The document pieces of samples `rows` (sample-index rows): token start in the file, length, and offset in
    the flat (B * width) output, in sample order then document order."""
    count = 0
    for b in range(len(rows)):
        count += sample_index[rows[b] + 1, 0] - sample_index[rows[b], 0] + 1
    src = np.empty(count, np.int64)
    length = np.empty(count, np.int64)
    dest = np.empty(count, np.int64)
    k = 0
    for b in range(len(rows)):
        first, first_off = sample_index[rows[b], 0], sample_index[rows[b], 1]
        last, last_off = sample_index[rows[b] + 1, 0], sample_index[rows[b] + 1, 1]
        filled = 0
        for position in range(first, last + 1):
            doc = document_index[position]
            begin = first_off if position == first else 0
            end = last_off + extra if position == last else sequence_lengths[doc]
            src[k] = sequence_pointers[doc] // itemsize + begin
            length[k] = end - begin
            dest[k] = b * width + filled
            filled += end - begin
            k += 1
    return src, length, dest


# _gather first loads one token per this many bytes (a cache line) of every piece.
_TOUCH_BYTES = 64


@njit(nogil=True)
def _gather(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, options,
    text, block, slot
):  # fmt: skip
    """The (B, S + extra) text of samples `ids`, copied straight from the token array `source` (a memory map) into
    `text` (the same dtype; one of its own where `text` has no row per sample): no per-piece arrays, no second copy;
    then, where `block` has a row per sample, their fields into the (4, B, S) int32 block (batch.fill_fields) in
    the same call: the per-sample path pays one dispatch, not three. Returns 0, or 1 if a sample is short (text
    and block are then incomplete: the caller pads), or -1 if an id is out of range.

    Two passes: the first loads one token per cache line of every piece, loads that do not wait on each other, so
    the TLB misses and DRAM latency of the whole batch overlap (a page walk is costly in a VM); the second copies
    from cache. Measured here: a batch of 8 x 2049 tokens in ~36 us instead of ~47 us.

    `slot` (readwatch.slot_for the map's file) is marked in a read for the call, and holds the byte offset of the
    piece being read: a page fault that never returns (a hung storage) is seen where it waits."""
    for b in range(len(ids)):
        if ids[b] < 0 or ids[b] >= len(shuffle_index):
            return -1
    extra = options[0]
    if text.shape[0] != len(ids):  # the fields alone are wanted: the text is scratch
        text = np.empty((len(ids), block.shape[2] + extra), source.dtype)
    width = text.shape[1]
    short = 0
    touched = 0
    start = mark_begin(slot, 0, len(ids) * width * itemsize, monotonic_ns()) if len(ids) else 0
    for copy in range(2):
        for b in range(len(ids)):
            row = np.int64(shuffle_index[ids[b]])
            first, first_off = np.int64(sample_index[row, 0]), np.int64(sample_index[row, 1])
            last, last_off = np.int64(sample_index[row + 1, 0]), np.int64(sample_index[row + 1, 1])
            filled = 0
            for position in range(first, last + 1):
                doc = document_index[position]
                begin = first_off if position == first else 0
                end = last_off + extra if position == last else np.int64(sequence_lengths[doc])
                at = sequence_pointers[doc] // itemsize + begin
                slot[OFFSET] = at * itemsize  # one store per piece: the offset a hung read names
                if copy:
                    text[b, filled : filled + end - begin] = source[at : at + end - begin]
                else:
                    for c in range(0, end - begin, max(1, _TOUCH_BYTES // itemsize)):
                        touched ^= source[at + c]
                filled += end - begin
            short |= filled < width
    if len(ids):
        mark_end(slot, start, monotonic_ns())
    if short == 0 and block.shape[1] == len(ids):
        fill_fields(text, options, block)
    return np.int64(short) + 0 * np.int64(touched)  # touched is used, so the first pass is not optimised away


# What _gather is given as `block` when only the text is wanted.
_NO_FIELDS = np.empty((4, 0, 0), np.int32)


@njit(nogil=True)
def _gather_bounded(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, options,
    text, block, cu_seqlens, max_seqlen, slot
):  # fmt: skip
    """_gather, then _document_boundaries of the same samples (position ids per document where `block` has rows), in
    one call: a numba dispatch costs ~1 us, as much as the boundaries themselves. Returns _gather's status, or -2."""
    status = _gather(
        ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source,
        options, text, block, slot,
    )  # fmt: skip
    if status != 0:
        return status
    s = block.shape[2] if block.shape[1] == len(ids) else text.shape[1] - options[0]
    return _document_boundaries(
        ids, shuffle_index, sample_index, document_index, sequence_lengths, options[0], s, cu_seqlens, max_seqlen,
        block[3],
    )  # fmt: skip


@njit(nogil=True)
def _gather_raw_bounded(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, options,
    text, slot
):  # fmt: skip
    """_gather of the text alone (what a loader worker sends), and the samples' boundaries as RawBatch.boundaries
    takes them: cu_seqlens with only as many columns as the batch's samples use (a few, against S + 1: a sample of
    2,048 tokens holds ~2 documents here), made in the same call. Returns (status, boundaries, max_seqlen)."""
    b, s = len(ids), text.shape[1] - options[0]
    none = np.empty((b, 0), np.int32)
    status = _gather(
        ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source,
        options, text, np.empty((4, 0, 0), np.int32), slot,
    )  # fmt: skip
    if status != 0:
        return status, none, none[:, 0]
    most = 1  # the most document pieces a sample reads (one more than its boundaries but the first and the last)
    for k in range(b):
        row = np.int64(shuffle_index[ids[k]])
        most = max(most, np.int64(sample_index[row + 1, 0]) - np.int64(sample_index[row, 0]) + 1)
    boundaries, max_seqlen = np.empty((b, min(most, s) + 1), np.int32), np.empty(b, np.int32)
    status = _document_boundaries(
        ids, shuffle_index, sample_index, document_index, sequence_lengths, options[0], s, boundaries, max_seqlen,
        none,
    )  # fmt: skip
    return status, boundaries, max_seqlen


@njit(nogil=True)
def _gather_flat(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, options,
    text, out, s, slot
):  # fmt: skip
    """_gather_bounded into `out`, int32 laid out as batch.bounded_block (or one flat array of B * (5S + 2) laid out
    so): the (4, B, S) block, cu_seqlens (B, S + 1), then max_seqlen (B,): the views are made here, not by numpy
    calls around it (~0.5 us each), and the call types one output array, not three."""
    b = len(ids)
    flat = out.reshape(-1)
    block = flat[: 4 * b * s].reshape((4, b, s))
    cu_seqlens = flat[4 * b * s : 4 * b * s + b * (s + 1)].reshape((b, s + 1))
    max_seqlen = flat[4 * b * s + b * (s + 1) : b * (5 * s + 2)]
    return _gather_bounded(
        ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source,
        options, text, block, cu_seqlens, max_seqlen, slot,
    )  # fmt: skip


# What _document_boundaries is given as `positions` when only the boundaries are wanted.
_NO_POSITIONS = np.empty((0, 0), np.int32)

# Samples a process reads with the numpy twins (about: a read may count twice) before a dataset asks for its kernels
# on jit's loading thread, and how many it has read so. A process that reads a few samples never pays numba's
# start-up (~0.6-1 s of CPU); a Loader asks at once, as it hands over its first batch (the load overlaps the step).
_NUMPY_SAMPLES = 64
_NUMPY_SERVED = [0]


def _gather_numpy(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, options,
    text, block, slot
):  # fmt: skip
    """_gather in numpy, until the kernels are loaded (a slice copy per document piece, then
    batch.fill_fields_numpy): the same block, the same return codes and the same marks in `slot`, without numba.
    `text` is unused (the rows are made here)."""
    extra = int(options[0])
    text = np.empty((len(ids), block.shape[2] + extra), source.dtype)
    status = _text_numpy(ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers,
                         itemsize, source, extra, text, slot)  # fmt: skip
    if status == 0:
        fill_fields_numpy(text, options, block)
    return status


def _text_numpy(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, extra,
    text, slot
) -> int:  # fmt: skip
    """_gather of the text alone (`block` without rows) in numpy: the same text, return codes and marks in `slot`."""
    if len(ids) and (ids.min() < 0 or ids.max() >= len(shuffle_index)):
        return -1
    start = readwatch.mark_begin(slot, 0, text.size * itemsize, time.monotonic_ns())
    try:
        short = _copy_numpy(ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers,
                            itemsize, source, extra, text, slot)  # fmt: skip
    finally:
        readwatch.mark_end(slot, start, time.monotonic_ns())
    return int(short)


def _copy_numpy(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, sequence_pointers, itemsize, source, extra,
    text, slot
) -> bool:  # fmt: skip
    """_gather_numpy's copy of the samples' text; whether one is short."""
    for b, i in enumerate(ids.tolist()):
        row = int(shuffle_index[i])
        (first, first_off), (last, last_off) = sample_index[row].tolist(), sample_index[row + 1].tolist()
        filled = 0
        for position in range(first, last + 1):
            doc = int(document_index[position])
            begin = first_off if position == first else 0
            end = last_off + extra if position == last else int(sequence_lengths[doc])
            at = int(sequence_pointers[doc]) // itemsize + begin
            slot[OFFSET] = at * itemsize
            text[b, filled : filled + end - begin] = source[at : at + end - begin]
            filled += end - begin
        if filled < text.shape[1]:
            return True
    return False


@njit(nogil=True)
def _document_boundaries(
    ids, shuffle_index, sample_index, document_index, sequence_lengths, extra, s, cu_seqlens, max_seqlen, positions
):  # fmt: skip
    """cu_seqlens[b] and max_seqlen[b] of samples `ids` of seq_length s, and, where `positions` has a row per sample
    (fill_fields writes none with boundaries: batch._POSITIONS_BY_DOCUMENT), their position ids restarting at each
    document piece. cu_seqlens has S + 1 columns (Megatron's layout) or fewer, as long as each sample's boundaries
    fit (see RawBatch.boundaries): the columns past a sample's last boundary hold S either way. Returns 0, -1 if an id
    is out of range, -2 if a sample holds more than S pieces (empty documents; Megatron fails there too).

    Megatron-LM's convention (GPTDataset.__getitem__ with inter_document_masking, commit d98e8a64ddf3): the boundaries
    are those of the sample's document pieces as the indices cut them (not its eod tokens: a dataset without eod
    tokens has them too); the extra token comes off the last piece, which is dropped if that empties it; the padding
    of a short sample is folded into the last piece, so cu_seqlens[n] = S; the entries past the n + 1 used hold S
    (so that samples stack); max_seqlen is the longest piece, padding included. A piece may be empty (a sample
    starting at the end of a document without the extra token, an empty document): its boundary is repeated."""
    width = cu_seqlens.shape[1]
    for b in range(len(ids)):
        if ids[b] < 0 or ids[b] >= len(shuffle_index):
            return -1
        row = np.int64(shuffle_index[ids[b]])
        first, first_off = np.int64(sample_index[row, 0]), np.int64(sample_index[row, 1])
        last, last_off = np.int64(sample_index[row + 1, 0]), np.int64(sample_index[row + 1, 1])
        pieces = last - first + 1
        if pieces - 1 > s:
            return -2
        cu = cu_seqlens[b]
        cu[0] = 0
        total, length = np.int64(0), np.int64(0)
        for k in range(pieces):
            position = first + k
            begin = first_off if k == 0 else 0
            end = last_off + extra if position == last else np.int64(sequence_lengths[document_index[position]])
            length = end - begin
            total += length
            if k + 1 < width:
                cu[k + 1] = total
        if extra:  # the extra token is the label of the last position, not a token of the sample
            total -= 1
            if length == 1:
                pieces -= 1
            elif pieces < width:
                cu[pieces] = total
        if pieces >= width:
            return -2
        if total < s:  # a padded sample: the padding joins the last piece (or is the only one)
            if pieces == 0:
                pieces = 1
            cu[pieces] = s
        cu[pieces + 1 :] = s
        longest = 0
        for k in range(1, pieces + 1):
            longest = max(longest, cu[k] - cu[k - 1])
        max_seqlen[b] = longest
    if positions.shape[0] == len(ids):
        reset_positions(cu_seqlens, positions)
    return 0


def prefetch_upcoming(dataset: Any, ids: Any) -> None:
    """Where `ids` is a loader's BatchIds and the dataset is remote: start fetching what this batch and the next
    ones of the same worker need, soonest first.

    Example:
        >>> prefetch_upcoming(train, BatchIds([0, 1], upcoming=[8, 9]))
    """
    upcoming = getattr(ids, "upcoming", None)
    if upcoming is not None and dataset.remote:
        dataset.prefetch([*ids, *upcoming])


INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class SharedIndices:
    """The indices of many GPTDatasets as one set of arrays, each dataset's a slice: a blend's datasets are built
    and cached as one entry (four .npy files, not four per dataset: 10,000 files and their fsyncs for 2,500
    datasets), and sent to spawned workers once, not once per dataset.

    `arrays` holds the three indices concatenated and "bounds", (D + 1, 3) int64: where each dataset's slice of
    each starts.

    Example:
        >>> shared = SharedIndices.concatenate([build_indices(...), build_indices(...)])
        >>> shared.part(1)["shuffle_index"]
    """

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    @classmethod
    def concatenate(cls, parts: list[dict[str, np.ndarray]]) -> SharedIndices:
        bounds = np.zeros((len(parts) + 1, 3), np.int64)
        for k, name in enumerate(INDEX_NAMES):
            bounds[1:, k] = np.cumsum([len(p[name]) for p in parts])
        arrays = {name: np.concatenate([p[name] for p in parts]) for name in INDEX_NAMES}
        return cls({**arrays, "bounds": bounds})

    def part(self, d: int) -> dict[str, np.ndarray]:
        """Dataset d's indices: views (plain ndarrays, so that no one takes a slice for the whole mapped file)."""
        lo, hi = self.arrays["bounds"][d], self.arrays["bounds"][d + 1]
        return {name: np.asarray(self.arrays[name][lo[k] : hi[k]]) for k, name in enumerate(INDEX_NAMES)}

    def __getstate__(self) -> dict[str, Any]:
        return {name: picklable(a) for name, a in self.arrays.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.arrays = {name: unpickled(a) for name, a in state.items()}


def build_together(parts: list[GPTDataset], cache: IndexCache | None, kind: str) -> None:
    """Give every dataset of `parts` (made with deferred=True) its indices: built, or loaded from the cache, as one
    entry for all of them (see SharedIndices); without a cache directory, each is built on its own.

    Example:
        >>> parts = [GPTDataset(ds, "train", (0, len(ds)), 1000, config, deferred=True) for ds in opened]
        >>> build_together(parts, IndexCache("cache/"), "GPTDatasets-train")
    """
    if cache is None or cache.directory is None:
        for part in parts:
            part._set_indices(part._pending(), True)
        return
    description = {"class": "GPTDatasets", "parts": [p.description for p in parts]}

    def build() -> dict[str, np.ndarray]:
        return SharedIndices.concatenate([p._pending() for p in parts]).arrays

    arrays, built = cache.get_or_build(kind, description, build)
    shared = SharedIndices(arrays)
    for d, part in enumerate(parts):
        part._set_indices(shared.part(d), built, (shared, d))


# The kernel signatures GPTDataset.load_kernels has compiled (or loaded) in this process.
_COMPILED: set[tuple] = set()

# What load_kernels' calls mark instead of the process's readwatch slot (GPTDataset._slot).
_LOAD_SLOT = np.zeros(readwatch.WORDS, np.int64)


@functools.cache
def _splits(s: int) -> tuple[int, ...]:
    """The lengths of tokens, labels, loss_mask, position_ids, cu_seqlens, max_seqlen in one sample's storage."""
    return (s, s, s, s, s + 1, 1)


@functools.cache
def _float32() -> Any:
    from corpusforge.data.batch import _torch

    return _torch().float32


def _from_numpy(array: np.ndarray) -> Any:
    from corpusforge.data.batch import _torch

    return _torch().from_numpy(array)


class GPTDataset:
    """One split of one token dataset, sequences [begin, end) of it, cut into samples of seq_length + 1 tokens.

    `len(ds)` is the number of samples the indices hold (at least num_samples, like Megatron's). `get_batch(ids)`
    returns numpy arrays for many samples in one call; `ds[i]` and `ds.__getitems__(ids)` (what torch's DataLoader
    calls with a batch sampler) return torch tensors; `read_raw(ids)` returns the samples' text as read, which
    `batch.assemble` turns into either (what the loader's workers send). `built` says whether this process built
    the indices (True) or mapped them from the cache (False).

    Example:
        >>> ds = GPTDataset(IndexedDataset("out/a_text_document"), "train", (0, 969), 1000,
        ...                 GPTDatasetConfig(seq_length=2048), cache=IndexCache("cache/"))
        >>> ds.get_batch([0, 1, 2])["tokens"].dtype
        dtype('int32')
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        split: str,
        documents: tuple[int, int],
        num_samples: int | None,
        config: GPTDatasetConfig,
        cache: IndexCache | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        self.indexed, self.split, self.config, self.num_samples = indexed, split, config, num_samples
        self.documents = (int(documents[0]), int(documents[1]))
        if not 0 <= self.documents[0] <= self.documents[1] <= len(indexed):
            raise ValueError(f"{indexed.prefix}: sequence range {self.documents} is not within [0, {len(indexed)}]")
        split_tokens = self._split_tokens()
        drop_last = self._drop_last()
        self.description = {
            "class": "GPTDataset",
            "dataset": describe_dataset(indexed),
            "split": split,
            "documents": list(self.documents),
            "num_samples": num_samples,
            "drop_last_partial_sequence": drop_last,
            **config.index_description(),
        }

        def build() -> dict[str, np.ndarray]:
            if split_tokens == 0:  # an empty split asked for no samples (Megatron would loop forever)
                return {
                    "document_index": np.zeros(0, np.int32),
                    "sample_index": np.zeros((1, 2), np.int32),
                    "shuffle_index": np.zeros(0, np.uint32),
                }
            lengths = np.asarray(indexed.sequence_lengths)
            return build_indices(
                lengths,
                range(*self.documents),  # filled straight into the document index: no arange array
                num_samples,
                config.seq_length,
                config.seed,
                config.extra,
                drop_last,
                split_tokens,
            )

        if deferred:  # build_together gives this dataset its indices, with those of the others of its blend
            self._pending = build
            return
        arrays, built = (cache or IndexCache(None)).get_or_build(f"GPTDataset-{split}", self.description, build)
        self._set_indices(arrays, built)

    def _set_indices(self, arrays: dict[str, np.ndarray], built: bool, shared: tuple | None = None) -> None:
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.built = built
        self.__dict__.pop("_pending", None)  # a closure: neither needed nor picklable
        if shared is not None:
            self._shared = shared
        if self.sample_index.ndim != 2 or len(self.shuffle_index) != len(self.sample_index) - 1:
            raise ValueError(f"{self.indexed.prefix}: cached {self.split} indices are inconsistent; delete the cache")

    def load_kernels(self) -> None:
        """Compile (or load from numba's cache) the sample gather for these array types now, so that forked
        DataLoader workers inherit it instead of each paying for it on their first batch (the loader calls this
        before it starts workers; building the indices does not, so that a job's start does not wait for numba).
        A load already in flight in the background (_numpy_for_now) is waited for first. Once per process and
        kernel signature: a blend holds thousands of datasets of the same types.

        Example:
            >>> ds.load_kernels()
        """
        finish_loading()
        with compiling():  # the calls below take the kernels, not the numpy twins that a fresh process serves with
            self._load_kernels_now()

    def _numpy_for_now(self, kernel: Any, samples: int) -> bool:
        """Whether a read of `samples` samples takes `kernel`'s numpy twin (or its Python function): numba has not
        started in this process, or kernels are loading in the background. Past _NUMPY_SAMPLES such samples (or when
        a Loader has handed over its first batch) this dataset's kernels load on jit's loading thread: a job's first
        batch does not wait ~0.6-1 s for numba's start-up, later batches take the kernels once every one is loaded,
        and none waits for the load."""
        if ready(kernel) or started() or must_compile():  # (a cold numba cache: the kernels compile here)
            return False
        _NUMPY_SERVED[0] += samples
        if _NUMPY_SERVED[0] >= _NUMPY_SAMPLES and "_kernels_asked" not in self.__dict__:
            self._kernels_asked = True
            load_in_background(self._load_kernels_now)
        return True

    @staticmethod
    def _slot(location: str) -> np.ndarray:
        """readwatch.slot_for(location), the slot a read from the map marks; under jit.compiling() (load_kernels'
        calls, which read no sample) a scratch slot of the same type: a load on jit's thread does not rename the file
        of the process's slot while another thread is in a read of another file (a watchdog would name that one)."""
        return _LOAD_SLOT if compiling_here() else readwatch.slot_for(location)

    def _load_kernels_now(self) -> None:
        """load_kernels' calls, on a thread under jit.compiling()."""
        self.indexed.load_kernels()
        indexed, direct = self.indexed, self._direct_args() is not None
        arrays = (self.shuffle_index, self.sample_index, self.document_index, indexed.sequence_lengths)
        key = (type(indexed.reader), indexed.read_mode, direct, indexed.dtype.str, self.config)
        key += tuple((a.dtype.str, a.ndim, a.flags.writeable, a.flags.c_contiguous) for a in arrays)
        key += ((indexed.sequence_pointers.dtype.str, indexed.sequence_pointers.flags.writeable),)
        if key in _COMPILED:
            return
        assemble(self.read_raw(np.zeros(0, np.int64)), self.config)
        if direct:
            self._read_fields(np.zeros(0, np.int64), np.empty((4, 0, self.config.seq_length), np.int32))
        if self.config.document_boundaries:
            s = self.config.seq_length
            none, cu_seqlens, max_seqlen = np.zeros(0, np.int64), np.empty((0, s + 1), np.int32), np.empty(0, np.int32)
            assemble(self.read_raw(none), self.config, as_torch=True)  # what the loader's main process assembles
            if direct:
                self._read_bounded(none, np.empty((4, 0, s), np.int32), cu_seqlens, max_seqlen)
                for flat in (np.empty(0, np.int32), np.empty((0, s), np.int32)):  # ds[i]'s, then __getitems__'
                    self._read_flat(none, flat)
            for positions in (_NO_POSITIONS, np.empty((0, s), np.int32)):  # read_raw's call, then get_batch's
                self._boundaries(
                    np.zeros(0, np.int64), np.empty((0, s + 1), np.int32), np.empty(0, np.int32), positions
                )
        _COMPILED.add(key)

    def reader_changed(self) -> None:
        """The token reader now reads elsewhere (storage/stage.py: a staged local copy): the next batch looks again
        for its memory map, instead of the source's path it found at the first batch.

        Example:
            >>> ds.reader_changed()
        """
        self.__dict__.pop("_direct", None)
        self.__dict__.pop("_mapped_path", None)

    def _direct_args(self) -> tuple | None:
        """The arguments of _gather for this dataset but the block, kept after the first call; None where
        samples are not copied from a memory map (pread, O_DIRECT, remote reads: the reader has no `memory`) or
        carry an attention mask (another shape)."""
        args = self.__dict__.get("_direct")
        if args is None and "_direct" not in self.__dict__:
            memory = self.indexed.reader.memory
            if memory is not None and not self.config.create_attention_mask:
                indexed = self.indexed
                # Plain ndarray views: numba types an np.memmap (cached indices) by a slower path on every call.
                args = (
                    np.asarray(self.shuffle_index),
                    np.asarray(self.sample_index),
                    np.asarray(self.document_index),
                    np.asarray(indexed.sequence_lengths),
                    np.asarray(indexed.sequence_pointers),
                    indexed.dtype.itemsize,
                    memory,
                    self._options(),
                    np.empty((0, 0), memory.dtype),  # no text: _gather makes its own scratch
                )
                # the file a gather from `memory` marks its reads in (readwatch.slot_for, one call per gather)
                self._mapped_path = self.indexed.reader.memory_location
            self._direct = args
        return args

    def _read_fields(self, ids: np.ndarray, block: np.ndarray) -> bool:
        """Fill the (4, B, S) int32 `block` with the fields of samples `ids` in one compiled pass from the memory
        map; False where that path does not apply (see _direct_args) or a sample is short or out of range (the
        caller then takes the general path, which pads or raises). A process's samples come from numpy
        (_gather_numpy) until the kernels are loaded (_numpy_for_now): a job's first batch or a user's ds[0] does not
        wait ~1 s for numba's start-up."""
        args = self._direct_args()
        if args is not None and self._numpy_for_now(_gather, len(ids)):
            return _gather_numpy(ids, *args, block, self._slot(self._mapped_path)) == 0
        return args is not None and _gather(ids, *args, block, self._slot(self._mapped_path)) == 0

    def _read_flat(self, ids: np.ndarray, flat: np.ndarray) -> bool:
        """_read_bounded into `flat`, int32 laid out as batch.bounded_block (see _gather_flat)."""
        args = self._direct_args()
        if args is not None and (started() or ready(_gather_flat)):
            status = _gather_flat(ids, *args, flat, self.config.seq_length, self._slot(self._mapped_path))
            if status != -2:
                return status == 0
        b, s, flat = len(ids), self.config.seq_length, flat.reshape(-1)
        block, cu_seqlens = flat[: 4 * b * s].reshape(4, b, s), flat[4 * b * s : 4 * b * s + b * (s + 1)]
        return self._read_bounded(
            ids, block, cu_seqlens.reshape(b, s + 1), flat[4 * b * s + b * (s + 1) : b * (5 * s + 2)]
        )

    def _read_bounded(self, ids: np.ndarray, block: np.ndarray, cu_seqlens: np.ndarray, max_seqlen: np.ndarray) -> bool:
        """_read_fields, and the samples' document boundaries (position ids per document) in the same compiled call."""
        args = self._direct_args()
        if args is None:
            return False
        if self._numpy_for_now(_gather_bounded, len(ids)):  # the numpy twins, until the kernels load (_read_fields)
            if not self._read_fields(ids, block):
                return False
            self._boundaries(ids, cu_seqlens, max_seqlen, block[3])
            return True
        status = _gather_bounded(ids, *args, block, cu_seqlens, max_seqlen, self._slot(self._mapped_path))
        if status == -2:
            self._boundaries(ids, cu_seqlens, max_seqlen, block[3])  # raises, naming the dataset
        return status == 0

    def _split_tokens(self) -> int:
        """The split's token count. A split holding fewer tokens than one sample is repeated as Megatron-Core
        repeats it (as many epochs as the samples need), with a ShortSplitWarning saying how often; a split holding
        no tokens at all is an error when samples are asked of it: Megatron-Core loops forever there."""
        lo, hi = self.documents  # a contiguous range: a slice, not a gather
        tokens = int(np.sum(self.indexed.sequence_lengths[lo:hi], dtype=np.int64))
        needed = self.config.seq_length + self.config.extra
        if self.num_samples == 0 or tokens >= needed:
            return tokens
        where = (
            f"{self.indexed.prefix}: the {self.split} split (sequences [{lo}, {hi}) of {len(self.indexed)}, split "
            f"{self.config.split!r}) holds {tokens} tokens"
        )
        if tokens == 0:
            raise ValueError(
                f"{where}, and samples are asked of it; give the split documents (more data or another split) "
                "or ask for no samples of it (Megatron-Core would loop forever here)"
            )
        if self.num_samples is None:  # one pass, as Megatron-Core: samples only where a partial one is kept
            count = count_samples(tokens, self.config.seq_length, self.config.extra, self._drop_last())
            what = f"one pass over it gives {count} sample(s)"
        else:
            epochs = count_epochs(tokens, self.num_samples, self.config.seq_length, self.config.extra)
            what = f"it is repeated {epochs} times for its {self.num_samples} samples, as Megatron-Core repeats it"
        warnings.warn(
            f"{where}, fewer than one sample of {needed}: {what}; more data or a shorter seq_length avoids this",
            ShortSplitWarning,
            stacklevel=3,
        )
        return tokens

    def _drop_last(self) -> bool:
        return self.config.drop_last_partial_validation_sequence if self.split == "valid" else True

    def __len__(self) -> int:
        return len(self.shuffle_index)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What determines this dataset's samples; the loader's state carries it."""
        return {**self.description, "options": self.config.describe()}

    def get_text(self, ids: np.ndarray) -> np.ndarray:
        """(B, seq_length + extra) int32 tokens of samples `ids`; a partial last sample is padded with the pad id
        (GPTDataset._query_document_sample_shuffle_indices)."""
        return self.read_raw(ids).text.astype(np.int32, copy=False)

    def read_raw(self, ids) -> RawBatch:
        """The text of samples `ids` as read (the token file's dtype; int32 if a short sample is padded), whole
        batch in one gather: what DataLoader workers send, and what get_batch and __getitems__ assemble."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        indexed, extra = self.indexed, self.config.extra
        width = self.config.seq_length + extra
        memory = indexed.reader.memory
        status = 1  # as _gather says when a sample is short: the general path below
        bounded = self.config.document_boundaries and memory is not None and started()
        if bounded:  # the text and the boundaries, in as few columns as they take, in one compiled call
            text = np.empty((len(ids), width), memory.dtype)
            args, slot = self._direct_args()[:-1], self._slot(self._mapped_path)
            status, boundaries, max_seqlen = _gather_raw_bounded(ids, *args, text, slot)
            if status == 0:
                return RawBatch(text, False, None, boundaries, max_seqlen)
            if status == -2:
                self._raise_too_many_pieces()
        elif memory is not None:  # one compiled pass from the map into the batch
            text = np.empty((len(ids), width), memory.dtype)
            path = self.__dict__.get("_mapped_path")
            if path is None:  # (a mask's config has no _direct_args to set it)
                path = self._mapped_path = indexed.reader.memory_location
            arrays = (ids, self.shuffle_index, self.sample_index, self.document_index, indexed.sequence_lengths,
                      indexed.sequence_pointers, indexed.dtype.itemsize, memory)  # fmt: skip
            if self._numpy_for_now(_gather, len(ids)):  # until the kernels are loaded (_read_fields)
                status = _text_numpy(*arrays, extra, text, self._slot(path))
            else:
                status = _gather(*arrays, self._options(), text, _NO_FIELDS, self._slot(path))
            if status == 0:
                return self._with_boundaries(ids, RawBatch(text, maybe_padded=False))
        if status < 0 or len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids out of range [0, {len(self)}): {ids.min()}..{ids.max()}")
        # (P,) pieces: where each document piece of each sample starts in the token file, its length, and where
        # it goes in the flat (B * width) text; one compiled pass instead of a dozen (P,)-sized numpy ops.
        src, length, dest = self._pieces(ids)
        # One read per piece (pread, O_DIRECT, ranged GETs, or a slice copy from the map): no per-token index
        # arrays, and on a cold file the disk reads about the sample bytes (see corpusforge/storage/readers.py).
        values = indexed.read_spans(src, length)
        n = len(values)
        if n == len(ids) * width:  # every sample full: the pieces tile the text in order
            return self._with_boundaries(ids, RawBatch(values.reshape(len(ids), width), maybe_padded=False))
        out = np.full((len(ids), width), self.config.pad, dtype=np.int32)
        flat_before = np.cumsum(length) - length
        step = np.arange(n, dtype=np.int64) - np.repeat(flat_before, length)
        out.reshape(-1)[np.repeat(dest, length) + step] = values
        return self._with_boundaries(ids, RawBatch(out))

    def _with_boundaries(self, ids: np.ndarray, raw: RawBatch) -> RawBatch:
        """`raw` with the samples' document boundaries where the config asks for them."""
        if not self.config.document_boundaries:
            return raw
        cu_seqlens = np.empty((len(ids), self.config.seq_length + 1), np.int32)
        max_seqlen = np.empty(len(ids), np.int32)
        self._boundaries(ids, cu_seqlens, max_seqlen, _NO_POSITIONS)
        return dataclasses.replace(raw, boundaries=cu_seqlens, max_seqlen=max_seqlen)

    def _boundaries(self, ids: np.ndarray, cu_seqlens: np.ndarray, max_seqlen: np.ndarray, positions: np.ndarray):
        """Fill cu_seqlens (B, S + 1), max_seqlen (B,) and, given a row per sample, position ids (B, S) of samples
        `ids` (_document_boundaries). Until the kernels are loaded (_numpy_for_now), the kernel's Python function
        and reset_positions' numpy twin, so that the first samples do not wait for numba."""
        args = self.__dict__.get("_boundary_args")
        if args is None:
            indexed = self.indexed
            arrays = (self.shuffle_index, self.sample_index, self.document_index, indexed.sequence_lengths)
            args = self._boundary_args = (*(np.asarray(a) for a in arrays), self.config.extra)
        s = self.config.seq_length
        if self._numpy_for_now(_document_boundaries, len(ids)):  # (its Python function calls reset_positions)
            status = _document_boundaries.py_func(ids, *args, s, cu_seqlens, max_seqlen, _NO_POSITIONS)
            if status == 0 and positions.shape[0] == len(ids):
                reset_positions_numpy(cu_seqlens, positions)
        else:
            status = _document_boundaries(ids, *args, s, cu_seqlens, max_seqlen, positions)
        if status == -1:
            raise IndexError(f"sample ids out of range [0, {len(self)}): {ids.min()}..{ids.max()}")
        if status == -2:
            self._raise_too_many_pieces()

    def _raise_too_many_pieces(self) -> None:
        raise ValueError(
            f"{self.indexed.prefix}: a sample of {self.config.seq_length} tokens spans more document pieces than its "
            "cu_seqlens can hold (a run of empty documents); drop the empty documents or use a longer seq_length "
            "(Megatron-LM fails there too)"
        )

    def _pieces(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, length, dest) of every document piece of samples `ids` (see _sample_pieces). Until the kernels are
        loaded (_numpy_for_now), the kernel's Python function, a loop over a few pieces: a first batch read without a
        memory map (O_DIRECT, pread, remote) starts no numba, as _read_fields' numpy twin."""
        indexed, extra = self.indexed, self.config.extra
        kernel = _sample_pieces.py_func if self._numpy_for_now(_sample_pieces, len(ids)) else _sample_pieces
        return kernel(
            self.shuffle_index[ids].astype(np.int64),
            self.sample_index,
            self.document_index,
            indexed.sequence_lengths,
            indexed.sequence_pointers,
            indexed.dtype.itemsize,
            self.config.seq_length + extra,
            extra,
        )

    def get_batch(self, ids) -> dict[str, np.ndarray]:
        """Samples `ids` as numpy arrays: tokens, labels, loss_mask, position_ids[, attention_mask]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        block = np.empty((4, len(ids), self.config.seq_length), np.int32)
        if not self.config.document_boundaries:
            if self._read_fields(ids, block):
                return batch_fields(block)
            return assemble(self.read_raw(ids), self.config)
        cu_seqlens = np.empty((len(ids), self.config.seq_length + 1), np.int32)
        max_seqlen = np.empty(len(ids), np.int32)
        if self._read_bounded(ids, block, cu_seqlens, max_seqlen):
            return {**batch_fields(block), "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        return assemble(self.read_raw(ids), self.config)

    def _options(self) -> np.ndarray:
        """batch.kernel_options of this dataset's config, made once."""
        options = self.__dict__.get("_kernel_options")
        if options is None:
            options = self._kernel_options = kernel_options(self.config)
        return options

    @property
    def remote(self) -> bool:
        """Whether the tokens come over the network (then prefetch() fetches ahead)."""
        return self.indexed.reader.remote

    def prefetch(self, ids) -> None:
        """Start fetching the storage blocks that samples `ids` need (soonest first), where the token dataset is
        remote; a no-op for local files."""
        if not self.remote:
            return
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < len(self))]
        src, length, _ = self._pieces(ids)
        self.indexed.prefetch_spans(src, length)

    def __getitems__(self, ids: list[int]) -> dict[str, Any]:
        """Samples `ids` as (B, S) torch tensors, views of one int32 storage (what a DataLoader with a batch
        sampler calls)."""
        prefetch_upcoming(self, ids)
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.config.document_boundaries:
            b, s = len(array), self.config.seq_length
            block = bounded_block(b, s)
            if self._read_flat(array, block.numpy()):
                return bounded_fields(block, b, s)
            return assemble(self.read_raw(array), self.config, as_torch=True)
        block = torch_block(len(array), self.config.seq_length)
        if self._read_fields(array, block.numpy()):
            return torch_fields(block)
        return assemble(self.read_raw(array), self.config, as_torch=True)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample i as (S,) torch tensors (Megatron's GPTDataset.__getitem__; int32 tokens here, not int64).

        Where samples are copied from a memory map: one compiled call from the map into a fresh (4, 1, S) block,
        then four torch views of it; measured per call (benchmarks/bench_loader.py --per-sample), the Python and
        torch calls around the copy cost more than the copy, so they are kept to the fewest."""
        s = self.config.seq_length
        if self.config.document_boundaries:  # one storage: the block, then cu_seqlens (S + 1), then max_seqlen
            flat = np.empty(5 * s + 2, np.int32)
            if self._read_flat(np.array([i], np.int64), flat):
                # six views in one call: a torch call costs ~1-3 us here, as much as the boundaries themselves
                # (torch.split_with_sizes itself: Tensor.split's Python wrapper costs as much again)
                parts = _torch().split_with_sizes(_from_numpy(flat), _splits(s))
                tokens, labels, loss_mask, positions, cu_seqlens, max_seqlen = parts
                loss_mask, max_seqlen = loss_mask.view(_float32()), max_seqlen.view(())
                return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions,
                        "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}  # fmt: skip
            return {k: v[0] for k, v in self.__getitems__([i]).items()}
        block = np.empty((4, 1, s), np.int32)
        if self._read_fields(np.array([i], np.int64), block):
            return torch_fields(_from_numpy(block.reshape(4, -1)))
        return {k: v[0] for k, v in self.__getitems__([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers started with spawn/forkserver: the token dataset pickles as how to reopen it
        # (IndexedDataset.__reduce__), and cached indices are re-mapped by their paths.
        state = self.__dict__.copy()
        state.pop("_direct", None)  # holds the token memory map: rebuilt where it is unpickled
        state.pop("_mapped_path", None)  # rebuilt with it
        state.pop("_boundary_args", None)  # views of the indices: rebuilt where it is unpickled
        state.pop("_kernels_asked", None)  # a spawned worker starts without kernels: its first read asks for them
        for name in ("document_index", "sample_index", "shuffle_index"):
            # slices of a blend's shared indices travel as the shared arrays (once per pickle) and a position
            state[name] = None if "_shared" in state else picklable(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        shared = state.get("_shared")
        for name in ("document_index", "sample_index", "shuffle_index"):
            state[name] = unpickled(state[name]) if shared is None else shared[0].part(shared[1])[name]
        self.__dict__.update(state)

    def __repr__(self) -> str:
        prefix, seq, indexed = self.indexed.prefix, self.config.seq_length, self.indexed
        reads = f"read_mode={indexed.read_mode!r} ({indexed.read_mode_reason})"
        return f"GPTDataset({prefix!r}, {self.split}, samples={len(self)}, seq_length={seq}, {reads})"

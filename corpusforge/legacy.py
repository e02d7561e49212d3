"""The legacy indexed format (magic TNTIDX, `--dataset-impl lazy/cached`): read it, and convert it to the MMap format.

fairseq wrote it first (torchnet's IndexedDataset); older Megatron-LM copied fairseq's module and appended a document
index; DeepSpeed's copy kept Megatron's layout and renumbered the dtypes. Pipelines built on them (CPM-2, early
Megatron-DeepSpeed runs) still ship such files. Sources of the layout below:
fairseq `fairseq/data/indexed_dataset.py` (IndexedDataset.read_index, IndexedDatasetBuilder.finalize), NVIDIA
Megatron-LM `megatron/data/indexed_dataset.py` (before 2023), DeepSpeed
`deepspeed/runtime/data_pipeline/data_sampling/indexed_dataset.py`.

`{prefix}.idx`, little-endian; every array is int64:

    offset      size       field
    0           8          magic b"TNTIDX\\x00\\x00"
    8           8    <Q    version, always 1
    16          8    <Q    dtype code (see LEGACY_DTYPES: the codes differ between producers)
    24          8    <Q    element size in bytes
    32          8    <Q    N, the number of items
    40          8    <Q    S, the length of `sizes` (the sum of the items' ranks: N for 1-D token items)
   (48          8    <Q    D, the number of document indices: Megatron-LM and DeepSpeed only)
    H           8*(N+1)    dim_offsets: item i has shape sizes[dim_offsets[i]:dim_offsets[i+1]]
    H+8(N+1)    8*(N+1)    data_offsets: item i is elements data_offsets[i]:data_offsets[i+1] of the .bin
    H+16(N+1)   8*S        sizes
   (H+16(N+1)+8S  8*D      doc_idx: the first item of each document, then N: Megatron-LM and DeepSpeed only)

with H = 48 (fairseq) or 56 (Megatron-LM). The file size tells the two layouts apart: they differ by 8 + 8*D bytes.
`{prefix}.bin` holds the items' elements back to back. fairseq's builder stored every token id plus one
("+1 for Lua compatibility") and its loader subtracts it again (`load_indexed_dataset(..., fix_lua_indexing=True)`);
Megatron-LM and DeepSpeed store the ids as they are. `convert` undoes fairseq's +1 unless told otherwise.

Example:
    >>> src = read_legacy("old/corpus_text_sentence")
    >>> src.layout, len(src), src.num_documents
    ('megatron', 120000, 3000)
    >>> convert("old/corpus_text_sentence", "new/corpus_text_sentence").tokens
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpusforge.errors import ArgumentError
from corpusforge.indexed import (
    DTYPE_CODES,
    MAGIC,
    IndexedDatasetWriter,
    IndexedFormatError,
    MMapBinReader,
    bin_path,
    check_token_sample,
    idx_path,
    read_token_sample,
    require_pair,
)

LEGACY_MAGIC = b"TNTIDX\x00\x00"
FAIRSEQ_HEADER = 48
MEGATRON_HEADER = 56

# (dtype code, element size) -> dtype. The element size in the header settles the codes on which producers disagree:
# fairseq and Megatron-LM: 6 float64 ("np.float"), 7 double, 8 uint16, fairseq also 9 uint32, 10 uint64;
# DeepSpeed: 6 uint16, 7 uint32, 8 uint64. Float codes are refused: they are not token ids.
LEGACY_DTYPES: dict[tuple[int, int], type[np.integer]] = {
    (1, 1): np.uint8,
    (2, 1): np.int8,
    (3, 2): np.int16,
    (4, 4): np.int32,
    (5, 8): np.int64,
    (8, 2): np.uint16,  # fairseq, Megatron-LM
    (9, 4): np.uint32,  # fairseq
    (10, 8): np.uint64,  # fairseq
    (6, 2): np.uint16,  # DeepSpeed
    (7, 4): np.uint32,  # DeepSpeed
    (8, 8): np.uint64,  # DeepSpeed
}
_FLOAT_CODES = {6, 7}


@dataclass(frozen=True)
class LegacyHeader:
    dtype: np.dtype
    element_size: int
    items: int  # N
    sizes_count: int  # S
    document_count: int | None  # D; None in fairseq's layout
    layout: str  # "fairseq" or "megatron"

    @property
    def header_size(self) -> int:
        return FAIRSEQ_HEADER if self.layout == "fairseq" else MEGATRON_HEADER


def read_legacy_header(path: str | os.PathLike) -> LegacyHeader:
    """Read the header of a legacy .idx and tell its layout from the file size.

    Example: read_legacy_header("old/x.idx").layout -> 'fairseq'
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(MEGATRON_HEADER)
    if head[:9] == MAGIC:
        raise IndexedFormatError(f"{path}: already the MMap format (MMIDIDX); read it as it is, no conversion needed")
    if head[:8] != LEGACY_MAGIC:
        raise IndexedFormatError(
            f"{path}: not a legacy indexed dataset (magic {head[:8]!r}, expected {LEGACY_MAGIC!r})"
        )
    if len(head) < FAIRSEQ_HEADER:
        raise IndexedFormatError(f"{path}: truncated header ({len(head)} of {FAIRSEQ_HEADER} bytes)")
    version, code, element_size, n, s = struct.unpack_from("<5Q", head, 8)
    if version != 1:
        raise IndexedFormatError(f"{path}: legacy index version {version}, only version 1 exists")
    dtype = _legacy_dtype(path, code, element_size)
    arrays = 8 * (2 * (n + 1) + s)
    if size == FAIRSEQ_HEADER + arrays:
        return LegacyHeader(dtype, element_size, n, s, None, "fairseq")
    d = struct.unpack_from("<Q", head, FAIRSEQ_HEADER)[0] if len(head) == MEGATRON_HEADER else 0
    if size == MEGATRON_HEADER + arrays + 8 * d:
        if d == 0:  # Megatron-LM's builder starts the document index at [0]: it is never empty
            raise IndexedFormatError(f"{path}: the document index is empty; it must hold at least [0]")
        return LegacyHeader(dtype, element_size, n, s, d, "megatron")
    raise IndexedFormatError(
        f"{path}: {size} bytes, but a legacy index of {n} items and {s} sizes takes {FAIRSEQ_HEADER + arrays} bytes "
        f"(fairseq) or {MEGATRON_HEADER + arrays + 8 * d} (Megatron-LM, {d} document indices); "
        "the file is truncated or corrupt"
    )


def _legacy_dtype(path: Path, code: int, element_size: int) -> np.dtype:
    if (code, element_size) in LEGACY_DTYPES:
        return np.dtype(LEGACY_DTYPES[code, element_size])
    if code in _FLOAT_CODES:
        raise IndexedFormatError(f"{path}: dtype code {code} is floating point data, not token ids")
    raise IndexedFormatError(
        f"{path}: dtype code {code} with {element_size}-byte elements is not one that fairseq, Megatron-LM "
        "or DeepSpeed write"
    )


class LegacyIndexedDataset:
    """Memory-mapped reader of a legacy `{prefix}.bin/.idx` pair, checked in full (O(N)) when opened.

    `ds[i]` is item i as stored, a view into the .bin: for fairseq's layout that is every id + 1 (`lua_shifted`).
    Without a document index (fairseq), or with `one_document_per_item`, each item is its own document.

    Example:
        >>> ds = LegacyIndexedDataset("old/corpus_text_sentence")
        >>> ds[0], ds.document_indices[:3]
        (memmap([ 464, 2068, 50256], dtype=int32), array([0, 4, 9]))
    """

    def __init__(self, prefix: str | os.PathLike, *, one_document_per_item: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        require_pair(self.prefix, "a legacy dataset")
        h = read_legacy_header(self.idx_path)
        self.layout, self.dtype, self.element_size = h.layout, h.dtype, h.element_size
        self.lua_shifted = h.layout == "fairseq"
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        n, s, at = h.items, h.sizes_count, h.header_size
        self.dim_offsets = np.frombuffer(idx, np.int64, n + 1, at)
        self.data_offsets = np.frombuffer(idx, np.int64, n + 1, at + 8 * (n + 1))
        self.sizes = np.frombuffer(idx, np.int64, s, at + 16 * (n + 1))
        doc_at, d = at + 16 * (n + 1) + 8 * s, h.document_count
        self.doc_idx = None if d is None else np.frombuffer(idx, np.int64, d, doc_at)
        self._check_items()
        nbytes = self.bin_path.stat().st_size
        if nbytes != int(self.data_offsets[-1]) * self.element_size:
            raise IndexedFormatError(
                f"{self.prefix}: the index covers {int(self.data_offsets[-1]) * self.element_size} bytes of tokens "
                f"but {self.bin_path.name} has {nbytes}; the .bin and .idx do not belong together, or one is truncated"
            )
        if self.doc_idx is not None and not one_document_per_item:
            self._check_documents()
        else:
            self.doc_idx = None
        self._bin = MMapBinReader(self.bin_path, self.dtype).tokens
        # A signed dtype code put where the unsigned one of the same width belongs (int16 for uint16) moves no
        # offset; negative ids in a sample of the tokens show it, as for the MMap format (indexed.check_token_sample).
        check_token_sample(str(self.idx_path), *read_token_sample(self.bin_path, self.dtype))

    def _check_items(self) -> None:
        """Every item 1-D, with a non-negative size that matches its span of the .bin."""
        dim, data, sizes = self.dim_offsets, self.data_offsets, self.sizes
        if dim[0] != 0 or dim[-1] != len(sizes) or (len(dim) > 1 and int(np.diff(dim).min()) < 0):
            raise IndexedFormatError(
                f"{self.idx_path}: dim_offsets must rise from 0 to the {len(sizes)} sizes, "
                f"found {dim[:1].tolist()}..{dim[-1:].tolist()}"
            )
        ranks = np.diff(dim)
        bad = np.flatnonzero(ranks != 1)
        if len(bad):
            i = int(bad[0])
            shape = tuple(sizes[dim[i] : dim[i + 1]].tolist())
            raise IndexedFormatError(
                f"{self.idx_path}: item {i} has shape {shape}; token datasets hold 1-D items, this one cannot be read"
            )
        if len(sizes) and int(sizes.min()) < 0:
            raise IndexedFormatError(f"{self.idx_path}: negative item size at {int(np.argmin(sizes))}")
        if data[0] != 0:
            raise IndexedFormatError(f"{self.idx_path}: the first item starts at element {int(data[0])}, not 0")
        bad = np.flatnonzero(np.diff(data) != sizes)
        if len(bad):
            i = int(bad[0])
            raise IndexedFormatError(
                f"{self.idx_path}: item {i} spans elements {int(data[i])}..{int(data[i + 1])} of the .bin "
                f"but its size is {int(sizes[i])}"
            )

    def _check_documents(self) -> None:
        doc, n = self.doc_idx, len(self)
        if doc[0] != 0:
            raise IndexedFormatError(f"{self.idx_path}: the document index starts at item {int(doc[0])}, not 0")
        steps = np.diff(doc)
        if len(steps) and int(steps.min()) < 0:
            raise IndexedFormatError(f"{self.idx_path}: document indices decrease at {int(np.argmin(steps))}")
        if doc[-1] != n:
            # Megatron-LM's legacy merge_file_ concatenated the items but not the document index.
            raise IndexedFormatError(
                f"{self.idx_path}: the document index ends at item {int(doc[-1])} but there are {n} items "
                "(files merged by Megatron-LM's legacy builder lose their document index); "
                "convert with --one-document-per-item (Python: one_document_per_item=True) to make every item "
                "a document"
            )

    # -- access ------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} items in {self.prefix}")
        i %= len(self)
        return self._bin[int(self.data_offsets[i]) : int(self.data_offsets[i + 1])]

    @property
    def item_lengths(self) -> np.ndarray:
        """Tokens per item (int64)."""
        return self.sizes

    @property
    def document_indices(self) -> np.ndarray:
        """The first item of each document, then N: the stored doc_idx, or one document per item."""
        return np.arange(len(self) + 1, dtype=np.int64) if self.doc_idx is None else self.doc_idx

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    @property
    def tokens(self) -> np.ndarray:
        """Every stored element, as one memory-mapped array."""
        return self._bin

    def __repr__(self) -> str:
        return (
            f"LegacyIndexedDataset({self.prefix!r}, layout={self.layout}, items={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype})"
        )


def read_legacy(prefix: str | os.PathLike, *, one_document_per_item: bool = False) -> LegacyIndexedDataset:
    """Open and check a legacy dataset (either layout); raises IndexedFormatError on an inconsistent pair.

    Example: read_legacy("old/corpus_text_sentence").layout -> 'megatron'
    """
    return LegacyIndexedDataset(prefix, one_document_per_item=one_document_per_item)


# ---------------------------------------------------------------------------------------------------------------
# converting


@dataclass(frozen=True)
class ConvertStats:
    source: str
    output: str
    layout: str  # "fairseq" or "megatron": the legacy layout that was read
    dtype: str  # token dtype of the output
    lua_shift: bool  # whether fairseq's +1 was taken off every id
    sequences: int  # one per legacy item
    documents: int
    tokens: int
    bytes: int  # size of the output .bin
    seconds: float


def convert(
    prefix: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    dtype: np.dtype | type | None = None,
    lua_shift: bool | None = None,
    one_document_per_item: bool = False,
    chunk_tokens: int = 1 << 24,
) -> ConvertStats:
    """Rewrite a legacy dataset as `{output_prefix}.bin/.idx` in the MMap format, atomically.

    Each legacy item becomes one sequence; documents follow the stored doc_idx, or one per item. `dtype` defaults to
    the source's (uint32/uint64, which the MMap format cannot name, become int32 when the ids fit). `lua_shift`
    defaults to True for fairseq's layout (its builder stored id + 1) and False otherwise. Tokens are copied in
    chunks of about `chunk_tokens`, vectorised.

    Example:
        >>> convert("old/wiki_text_sentence", "new/wiki_text_sentence")
        ConvertStats(source='old/wiki_text_sentence', ..., layout='megatron', dtype='int32', ...)
    """
    t0 = time.perf_counter()
    src = read_legacy(prefix, one_document_per_item=one_document_per_item)
    out = os.fspath(output_prefix)
    if os.path.abspath(out) == os.path.abspath(src.prefix):
        raise ArgumentError(f"{out}: the output prefix is the input; choose another --output-prefix")
    shift = src.lua_shifted if lua_shift is None else lua_shift
    out_dtype = _output_dtype(src, dtype, shift)
    with IndexedDatasetWriter(out, out_dtype) as w:
        for d0, d1 in _document_chunks(src, chunk_tokens):
            _write_documents(w, src, d0, d1, shift)
    return ConvertStats(
        source=src.prefix,
        output=out,
        layout=src.layout,
        dtype=str(out_dtype),
        lua_shift=shift,
        sequences=w.num_sequences,
        documents=src.num_documents,
        tokens=w.num_tokens,
        bytes=w.num_tokens * out_dtype.itemsize,
        seconds=time.perf_counter() - t0,
    )


def _output_dtype(src: LegacyIndexedDataset, requested: np.dtype | type | None, shift: bool) -> np.dtype:
    if requested is not None:
        return np.dtype(requested)  # the writer refuses a dtype without a Megatron code, and ids that do not fit
    if src.dtype in {np.dtype(t) for t in DTYPE_CODES.values()}:
        return src.dtype
    top = int(src.tokens.max()) - int(shift) if src.num_tokens else 0
    return np.dtype(np.int32) if top <= np.iinfo(np.int32).max else np.dtype(np.int64)


def _document_chunks(src: LegacyIndexedDataset, chunk_tokens: int) -> list[tuple[int, int]]:
    """Split the documents into runs of about `chunk_tokens` tokens (a longer document is a run of its own)."""
    starts = src.data_offsets[src.document_indices]  # token offset of every document boundary, (D,)
    targets = np.arange(chunk_tokens, src.num_tokens, chunk_tokens)
    cuts = np.unique(np.concatenate([[0], np.searchsorted(starts, targets), [src.num_documents]]))
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _write_documents(w: IndexedDatasetWriter, src: LegacyIndexedDataset, d0: int, d1: int, shift: bool) -> None:
    """Write documents d0..d1-1: converted in one vectorised pass, written in one call when each is one item."""
    doc = src.document_indices[d0 : d1 + 1]
    bounds = src.data_offsets[doc]  # token offset of each document boundary in this run
    tokens = _stored_to_ids(src, src.tokens[int(bounds[0]) : int(bounds[-1])], shift)
    lengths = src.item_lengths[int(doc[0]) : int(doc[-1])]
    if bool((np.diff(doc) == 1).all()):
        w.add_documents(tokens, lengths)
        return
    # Documents of several items (Megatron's --split-sentences) or of none: the writer takes those one at a time.
    rel, first = bounds - bounds[0], doc - doc[0]
    for k in range(len(doc) - 1):
        w.add_documents_with_sequences(tokens[rel[k] : rel[k + 1]], lengths[first[k] : first[k + 1]])


def _stored_to_ids(src: LegacyIndexedDataset, stored: np.ndarray, shift: bool) -> np.ndarray:
    if not shift or not stored.size:
        return stored
    if int(stored.min()) < 1:
        at = int(np.argmin(stored))
        raise IndexedFormatError(
            f"{src.bin_path}: holds {int(stored[at])} among its tokens, but fairseq's builder stores every id + 1 "
            "(so never 0); this file was not written by fairseq: convert with --no-lua-shift (Python: lua_shift=False)"
        )
    return stored - stored.dtype.type(1)

"""corpusforge.legacy: reading the legacy TNTIDX format (fairseq and Megatron-LM layouts) and converting it to MMap.

The real producer here is DeepSpeed's copy of Megatron-LM's legacy IndexedDatasetBuilder, when installed: it is the
one copy that runs with numpy 2 without pulling a new torch (fairseq's package builds C++/Cython extensions and
requires torchaudio and hydra to import; Megatron-LM's and NeMo's copies use the removed `np.float`). fairseq's layout
comes from `write_legacy` below, transcribed from fairseq's source, and both layouts are pinned by byte fixtures
spelled out by hand, so these tests fail if the reader drifts from the format even where DeepSpeed is absent.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest

from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from corpusforge.legacy import ConvertStats, LegacyIndexedDataset, convert, read_legacy

# ---------------------------------------------------------------------------------------------------------------
# producers

# fairseq's codes (fairseq/data/indexed_dataset.py `_code_to_dtype`); Megatron-LM's are the same up to 8.
FAIRSEQ_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8, np.uint32: 9}


def write_legacy(prefix, items, *, dtype=np.int32, doc_idx=None, lua=False, code=None) -> None:
    """Write a legacy pair the way fairseq's (doc_idx=None, lua=True) or Megatron-LM's (doc_idx given) builder does.

    Transcribed from fairseq/fairseq `fairseq/data/indexed_dataset.py`, IndexedDatasetBuilder.add_item (stores
    `tensor + 1` "for Lua compatibility") and .finalize (magic, <Q version 1, <QQ code and element size, <QQ item
    count and len(sizes), then dim_offsets, data_offsets, sizes as int64), and NVIDIA/Megatron-LM
    `megatron/data/indexed_dataset.py`, whose finalize adds <Q len(doc_idx) after the counts and doc_idx at the end.
    """
    dtype = np.dtype(dtype)
    data = [np.asarray(x, dtype=np.int64) + (1 if lua else 0) for x in items]
    dim_offsets = np.arange(len(items) + 1)
    data_offsets = np.concatenate([[0], np.cumsum([len(x) for x in data])]).astype(np.int64)
    sizes = [len(x) for x in data]
    with open(f"{prefix}.bin", "wb") as f:
        for x in data:
            f.write(x.astype(dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<QQ", code or FAIRSEQ_CODES[dtype.type], dtype.itemsize))
        f.write(struct.pack("<QQ", len(items), len(sizes)))
        if doc_idx is not None:
            f.write(struct.pack("<Q", len(doc_idx)))
        for arr in (dim_offsets, data_offsets, sizes) + (() if doc_idx is None else (doc_idx,)):
            f.write(np.asarray(arr, dtype=np.int64).tobytes())


@pytest.fixture(scope="module")
def deepspeed_legacy():
    """DeepSpeed's legacy indexed_dataset module, loaded from its file: importing the `deepspeed` package itself
    would pull in far more than this one module (numpy, torch and the standard library) needs."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed is not installed: pip install --no-deps --no-build-isolation deepspeed")
    path = Path(spec.origin).parent / "runtime/data_pipeline/data_sampling/indexed_dataset.py"
    module_spec = importlib.util.spec_from_file_location("deepspeed_legacy_indexed_dataset", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def write_deepspeed(module, prefix, documents, dtype) -> None:
    """Each document is a list of items (sentences); one end_document() after each, as Megatron's preprocess did."""
    import torch

    b = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for items in documents:
        for item in items:
            b.add_item(torch.from_numpy(np.asarray(item, dtype=np.int64)))
        b.end_document()
    b.finalize(f"{prefix}.idx")


def make_documents(seed: int, n: int, vocab: int) -> list[list[np.ndarray]]:
    """n documents of 0..3 items of 0..30 tokens (empty items and item-less documents included)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        docs.append([rng.integers(0, vocab, int(rng.integers(0, 31))) for _ in range(int(rng.choice([0, 1, 1, 2, 3])))])
    docs[0] = []
    docs[-1] = [np.array([], dtype=np.int64), rng.integers(0, vocab, 5)]
    return docs


def assert_converted(out_prefix, documents) -> None:
    """The MMap output holds one sequence per item and the given documents, for us and for megatron-core."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

    items = [x for d in documents for x in d]
    doc_idx = np.cumsum([0] + [len(d) for d in documents]).tolist()
    ours = IndexedDataset(out_prefix)
    ours.validate()
    theirs = MegatronIndexedDataset(str(out_prefix))
    assert len(ours) == len(theirs) == len(items)
    assert ours.document_indices.tolist() == theirs.document_indices.tolist() == doc_idx
    for i, item in enumerate(items):
        np.testing.assert_array_equal(ours[i], item)
        np.testing.assert_array_equal(theirs[i], item)


# ---------------------------------------------------------------------------------------------------------------
# the format pinned by hand: items [5, 6, 7] and [8], int32

FAIRSEQ_IDX = bytes.fromhex(
    "544e544944580000"  # magic b"TNTIDX\0\0"
    "0100000000000000"  # version 1
    "0400000000000000"  # dtype code 4 (int32)
    "0400000000000000"  # element size 4
    "0200000000000000"  # N = 2 items
    "0200000000000000"  # S = 2 sizes
    "0000000000000000 0100000000000000 0200000000000000"  # dim_offsets 0, 1, 2
    "0000000000000000 0300000000000000 0400000000000000"  # data_offsets 0, 3, 4 (in elements)
    "0300000000000000 0100000000000000"  # sizes 3, 1
)
FAIRSEQ_BIN = bytes.fromhex("06000000 07000000 08000000 09000000")  # 5+1, 6+1, 7+1, 8+1: fairseq's +1

MEGATRON_IDX = bytes.fromhex(
    "544e544944580000 0100000000000000 0400000000000000 0400000000000000"  # magic, version, code, element size
    "0200000000000000 0200000000000000"  # N = 2, S = 2
    "0200000000000000"  # D = 2 document indices (Megatron-LM's layout only)
    "0000000000000000 0100000000000000 0200000000000000"  # dim_offsets
    "0000000000000000 0300000000000000 0400000000000000"  # data_offsets
    "0300000000000000 0100000000000000"  # sizes
    "0000000000000000 0200000000000000"  # doc_idx 0, 2: one document of both items
)
MEGATRON_BIN = bytes.fromhex("05000000 06000000 07000000 08000000")  # the ids as they are


def test_fairseq_fixture(tmp_path):
    write_legacy(tmp_path / "fs", [[5, 6, 7], [8]], lua=True)
    assert (tmp_path / "fs.idx").read_bytes() == FAIRSEQ_IDX  # the test-side writer matches the hand-made bytes
    assert (tmp_path / "fs.bin").read_bytes() == FAIRSEQ_BIN
    src = read_legacy(tmp_path / "fs")
    assert (src.layout, src.lua_shifted, src.dtype, len(src), src.num_documents) == ("fairseq", True, "int32", 2, 2)
    assert src[0].tolist() == [6, 7, 8] and src[-1].tolist() == [9]  # as stored
    stats = convert(tmp_path / "fs", tmp_path / "out")
    assert (stats.layout, stats.lua_shift, stats.sequences, stats.documents, stats.tokens) == ("fairseq", True, 2, 2, 4)
    assert_converted(tmp_path / "out", [[[5, 6, 7]], [[8]]])


def test_megatron_fixture(tmp_path):
    (tmp_path / "mg.idx").write_bytes(MEGATRON_IDX)
    (tmp_path / "mg.bin").write_bytes(MEGATRON_BIN)
    src = read_legacy(tmp_path / "mg")
    assert (src.layout, src.lua_shifted, len(src), src.num_documents) == ("megatron", False, 2, 1)
    assert src.doc_idx.tolist() == [0, 2]
    stats = convert(tmp_path / "mg", tmp_path / "out")
    assert (stats.layout, stats.lua_shift, stats.documents, stats.dtype, stats.bytes) == (
        "megatron",
        False,
        1,
        "int32",
        16,
    )
    assert_converted(tmp_path / "out", [[[5, 6, 7], [8]]])
    write_legacy(tmp_path / "again", [[5, 6, 7], [8]], doc_idx=[0, 2])
    assert (tmp_path / "again.idx").read_bytes() == MEGATRON_IDX


def test_deepspeed_builder_writes_the_megatron_fixture(tmp_path, deepspeed_legacy):
    write_deepspeed(deepspeed_legacy, tmp_path / "ds", [[[5, 6, 7], [8]]], np.int32)
    assert (tmp_path / "ds.idx").read_bytes() == MEGATRON_IDX
    assert (tmp_path / "ds.bin").read_bytes() == MEGATRON_BIN


def test_mmap_reader_points_legacy_files_to_convert(tmp_path):
    (tmp_path / "mg.idx").write_bytes(MEGATRON_IDX)
    (tmp_path / "mg.bin").write_bytes(MEGATRON_BIN)
    with pytest.raises(IndexedFormatError, match="corpusforge convert"):
        IndexedDataset(tmp_path / "mg")


# ---------------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_deepspeed(tmp_path, deepspeed_legacy, dtype):
    documents = make_documents(0, 400, 60000)
    write_deepspeed(deepspeed_legacy, tmp_path / "ds", documents, dtype)
    src = read_legacy(tmp_path / "ds")
    assert (src.layout, src.dtype, src.num_documents) == ("megatron", np.dtype(dtype), 400)
    theirs = deepspeed_legacy.IndexedDataset(str(tmp_path / "ds"))  # DeepSpeed's own legacy reader agrees
    for i in range(len(src)):
        np.testing.assert_array_equal(src[i], theirs[i])

    stats = convert(tmp_path / "ds", tmp_path / "out")
    assert stats.dtype == np.dtype(dtype).name and stats.lua_shift is False
    assert_converted(tmp_path / "out", documents)


def test_round_trip_deepspeed_merged_files(tmp_path, deepspeed_legacy):
    parts = [make_documents(k, 50, 1000) for k in (1, 2)]
    for k, documents in enumerate(parts):
        write_deepspeed(deepspeed_legacy, tmp_path / f"part{k}", documents, np.int32)
    b = deepspeed_legacy.IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.int32)
    for k in range(2):
        b.merge_file_(str(tmp_path / f"part{k}"))
    b.finalize(str(tmp_path / "merged.idx"))
    convert(tmp_path / "merged", tmp_path / "out")
    assert_converted(tmp_path / "out", parts[0] + parts[1])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip_fairseq_layout(tmp_path, dtype):
    rng = np.random.default_rng(3)
    items = [rng.integers(0, 60000, int(n)) for n in rng.integers(0, 40, 500)]
    write_legacy(tmp_path / "fs", items, dtype=dtype, lua=True)
    stats = convert(tmp_path / "fs", tmp_path / "out")
    assert (stats.sequences, stats.documents, stats.dtype) == (500, 500, np.dtype(dtype).name)
    assert_converted(tmp_path / "out", [[x] for x in items])


def test_round_trip_megatron_layout_without_deepspeed(tmp_path):
    documents = make_documents(4, 300, 60000)
    items = [x for d in documents for x in d]
    write_legacy(tmp_path / "mg", items, doc_idx=np.cumsum([0] + [len(d) for d in documents]))
    convert(tmp_path / "mg", tmp_path / "out")
    assert_converted(tmp_path / "out", documents)


def test_chunking_does_not_change_the_output(tmp_path):
    documents = make_documents(5, 300, 60000)
    items = [x for d in documents for x in d]
    write_legacy(tmp_path / "mg", items, dtype=np.uint16, doc_idx=np.cumsum([0] + [len(d) for d in documents]))
    convert(tmp_path / "mg", tmp_path / "whole")
    for chunk in (1, 7, 100):
        convert(tmp_path / "mg", tmp_path / f"chunk{chunk}", chunk_tokens=chunk)
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"chunk{chunk}{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()


def test_dtype_choice(tmp_path):
    write_legacy(tmp_path / "u32", [[1, 70000], [3]], dtype=np.uint32, lua=True)  # fairseq code 9: no MMap code
    assert convert(tmp_path / "u32", tmp_path / "a").dtype == "int32"
    assert IndexedDataset(tmp_path / "a")[0].tolist() == [1, 70000]
    assert convert(tmp_path / "u32", tmp_path / "b", dtype=np.int64).dtype == "int64"
    with pytest.raises(ValueError, match="token id 70000 does not fit the dataset dtype uint16"):
        convert(tmp_path / "u32", tmp_path / "c", dtype=np.uint16)
    assert not list(tmp_path.glob("c*"))  # nothing left behind, not even .tmp files


def test_lua_shift(tmp_path):
    write_legacy(tmp_path / "raw", [[0, 1, 2], [3]])  # fairseq's layout without the +1: it holds a 0
    with pytest.raises(IndexedFormatError, match="holds 0 among its tokens.*lua_shift=False"):
        convert(tmp_path / "raw", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))
    assert convert(tmp_path / "raw", tmp_path / "out", lua_shift=False).lua_shift is False
    assert_converted(tmp_path / "out", [[[0, 1, 2]], [[3]]])


def test_failure_in_a_later_chunk_leaves_nothing(tmp_path):
    write_legacy(tmp_path / "fs", [[5, 6, 7]] * 10 + [[0]], lua=False)  # the 0 sits in the last chunk
    with pytest.raises(IndexedFormatError, match="lua_shift=False"):
        convert(tmp_path / "fs", tmp_path / "out", lua_shift=True, chunk_tokens=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fs.bin", "fs.idx"]


def test_incomplete_document_index(tmp_path):
    write_legacy(tmp_path / "mg", [[1], [2], [3]], doc_idx=[0, 1])  # items 1 and 2 belong to no document
    with pytest.raises(IndexedFormatError, match="ends at item 1 but there are 3 items.*one_document_per_item=True"):
        read_legacy(tmp_path / "mg")
    stats = convert(tmp_path / "mg", tmp_path / "out", one_document_per_item=True)
    assert stats.documents == 3
    assert_converted(tmp_path / "out", [[[1]], [[2]], [[3]]])


def test_convert_refuses_output_equal_to_input(tmp_path):
    write_legacy(tmp_path / "fs", [[5, 6]], lua=True)
    with pytest.raises(ValueError, match="output prefix is the input"):
        convert(tmp_path / "fs", tmp_path / "fs")
    assert (tmp_path / "fs.idx").read_bytes()[:8] == b"TNTIDX\x00\x00"


def test_empty_legacy_dataset(tmp_path):
    write_legacy(tmp_path / "fs", [], lua=True)
    write_legacy(tmp_path / "mg", [], doc_idx=[0])
    for name in ("fs", "mg"):
        stats = convert(tmp_path / name, tmp_path / f"{name}_out")
        assert (stats.sequences, stats.documents, stats.tokens) == (0, 0, 0)
        ds = IndexedDataset(tmp_path / f"{name}_out")
        assert (len(ds), ds.num_documents) == (0, 0)


def test_stats_are_plain_data(tmp_path):
    import dataclasses
    import json

    write_legacy(tmp_path / "fs", [[5, 6]], lua=True)
    stats = convert(tmp_path / "fs", tmp_path / "out")
    assert isinstance(stats, ConvertStats)
    json.dumps(dataclasses.asdict(stats))  # the CLI prints it as JSON
    assert stats.source == str(tmp_path / "fs") and stats.output == str(tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------------
# refusing inconsistent files


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def q(v: int) -> bytes:
    return struct.pack("<q", v)


# offsets in MEGATRON_IDX (H = 56, N = 2, S = 2): dim_offsets at 56, data_offsets at 80, sizes at 104, doc_idx at 120
FAULTS = {
    "bad magic": (lambda i, b: patch(i, 0, b"XXXXXX\x00\x00"), r"not a legacy indexed dataset"),
    "mmap magic": (lambda i, b: patch(i, 0, b"MMIDIDX\x00\x00"), r"already the MMap format"),
    "version 2": (lambda i, b: patch(i, 8, q(2)), r"legacy index version 2"),
    "unknown dtype": (lambda i, b: patch(i, 16, q(11)), r"dtype code 11 with 4-byte elements is not one"),
    "element size": (lambda i, b: patch(i, 24, q(2)), r"dtype code 4 with 2-byte elements"),
    "float dtype": (lambda i, b: (patch(i, 16, q(7)), patch(i, 24, q(8))), r"floating point data, not token ids"),
    "truncated header": (lambda i, b: i.write_bytes(i.read_bytes()[:40]), r"truncated header \(40 of 48 bytes\)"),
    "truncated idx": (lambda i, b: i.write_bytes(i.read_bytes()[:-8]), r"128 bytes, but .* truncated or corrupt"),
    "extra bytes": (lambda i, b: i.write_bytes(i.read_bytes() + b"\0"), r"137 bytes, but .* truncated or corrupt"),
    "empty doc index": (lambda i, b: (patch(i, 48, q(0)), i.write_bytes(i.read_bytes()[:120])), r"index is empty"),
    "bin shorter": (lambda i, b: b.write_bytes(b.read_bytes()[:-4]), r"covers 16 bytes of tokens but mg\.bin has 12"),
    "bin longer": (lambda i, b: b.write_bytes(b.read_bytes() + b"\0" * 4), r"covers 16 bytes .* mg\.bin has 20"),
    "dim offsets": (lambda i, b: patch(i, 72, q(5)), r"dim_offsets must rise from 0 to the 2 sizes"),
    "2-d item": (lambda i, b: (patch(i, 64, q(2)), patch(i, 72, q(2))), r"item 0 has shape \(3, 1\)"),
    "first data offset": (lambda i, b: patch(i, 80, q(1)), r"first item starts at element 1"),
    "data offsets vs sizes": (lambda i, b: patch(i, 88, q(2)), r"item 0 spans elements 0\.\.2 .* its size is 3"),
    "negative size": (lambda i, b: patch(i, 104, q(-3)), r"negative item size at 0"),
    "doc index not from 0": (lambda i, b: patch(i, 120, q(1)), r"document index starts at item 1"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_corrupt_legacy_refused(tmp_path, name):
    idx, bin_ = tmp_path / "mg.idx", tmp_path / "mg.bin"
    idx.write_bytes(MEGATRON_IDX)
    bin_.write_bytes(MEGATRON_BIN)
    corrupt, message = FAULTS[name]
    corrupt(idx, bin_)
    with pytest.raises(IndexedFormatError, match=message) as e:
        convert(tmp_path / "mg", tmp_path / "out")
    assert str(tmp_path / "mg") in str(e.value)  # names the file
    assert not list(tmp_path.glob("out*"))


def test_decreasing_document_index(tmp_path):
    write_legacy(tmp_path / "mg", [[1], [2], [3]], doc_idx=[0, 2, 1, 3])
    with pytest.raises(IndexedFormatError, match="document indices decrease at 1"):
        read_legacy(tmp_path / "mg")


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file_is_named(tmp_path, missing):
    write_legacy(tmp_path / "fs", [[5, 6]], lua=True)
    (tmp_path / f"fs{missing}").unlink()
    with pytest.raises(FileNotFoundError, match=rf"fs\{missing}: no such file"):
        LegacyIndexedDataset(tmp_path / "fs")


def test_convert_equals_writing_directly(tmp_path):
    """convert goes through IndexedDatasetWriter: the output is a normal MMap dataset, byte-identical to writing
    the same documents directly."""
    documents = make_documents(6, 50, 60000)
    items = [x for d in documents for x in d]
    write_legacy(tmp_path / "mg", items, dtype=np.uint16, doc_idx=np.cumsum([0] + [len(d) for d in documents]))
    convert(tmp_path / "mg", tmp_path / "out")
    with IndexedDatasetWriter(tmp_path / "direct", np.uint16) as w:
        for d in documents:
            w.add_document(np.concatenate(d) if d else np.zeros(0, np.int64), [len(x) for x in d])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"direct{ext}").read_bytes()

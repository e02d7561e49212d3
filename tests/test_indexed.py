"""corpusforge.indexed against the real megatron-core: both directions, byte for byte, plus refusal of bad files.

megatron-core is imported only here, inside the tests: the package itself never imports it.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from corpusforge import indexed
from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter, IndexedFormatError, merge, read_header


@pytest.fixture(scope="module")
def mcore():
    """megatron.core's indexed_dataset module (a dev dependency: its absence is a failure, not a skip)."""
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def make_documents(seed: int, n: int, vocab: int) -> list[list[np.ndarray]]:
    """n documents, each a list of 0..3 sequences of 0..40 tokens: empty sequences and empty documents included."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        n_seq = int(rng.choice([0, 1, 1, 1, 2, 3]))
        docs.append([rng.integers(0, vocab, int(rng.integers(0, 41))) for _ in range(n_seq)])
    docs[0] = [np.array([], dtype=np.int64)]  # one empty sequence
    docs[1] = []  # no sequence at all
    return docs


def write_ours(prefix: Path, docs: list[list[np.ndarray]], dtype) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for seqs in docs:
            tokens = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
            w.add_document(tokens, [len(s) for s in seqs])


def write_megatron_builder(mcore, prefix: Path, docs: list[list[np.ndarray]], dtype) -> None:
    """The same documents through megatron's own builder, alternating its two ways of adding a document."""
    import torch

    b = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, seqs in enumerate(docs):
        if i % 2 and seqs:
            b.add_document(np.concatenate(seqs), [len(s) for s in seqs])
        else:
            for s in seqs:
                b.add_item(torch.from_numpy(s))
            b.end_document()
    b.finalize(f"{prefix}.idx")


def flat_sequences(docs):
    return [s for seqs in docs for s in seqs]


def assert_same_as_megatron(ours: IndexedDataset, theirs) -> None:
    assert len(ours) == len(theirs)
    assert ours.dtype == np.dtype(theirs.index.dtype)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# both directions with megatron-core


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_files_load_in_megatron(tmp_path, mcore, dtype):
    docs = make_documents(0, 300, 65000 if dtype is np.uint16 else 200_000)
    write_ours(tmp_path / "ours", docs, dtype)

    theirs = mcore.IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedDataset(tmp_path / "ours")
    assert_same_as_megatron(ours, theirs)
    expected = flat_sequences(docs)
    assert len(theirs) == len(expected)
    for i, seq in enumerate(expected):
        np.testing.assert_array_equal(theirs[i], seq)
    assert theirs.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    # partial reads agree too (megatron's get(i, offset, length))
    i = next(k for k, s in enumerate(expected) if len(s) > 10)
    np.testing.assert_array_equal(ours.get(i, 3, 5), theirs.get(i, offset=3, length=5))


def test_bulk_add_documents_loads_in_megatron(tmp_path, mcore):
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 50, 1000)
    tokens = rng.integers(0, 50257, int(lengths.sum()))
    with IndexedDatasetWriter(tmp_path / "bulk", np.uint16) as w:
        w.add_documents(tokens[: int(lengths[:400].sum())], lengths[:400])
        w.add_documents(tokens[int(lengths[:400].sum()) :], lengths[400:])
    theirs = mcore.IndexedDataset(str(tmp_path / "bulk"))
    assert theirs.document_indices.tolist() == list(range(1001))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(1000):
        np.testing.assert_array_equal(theirs[i], tokens[starts[i] : starts[i + 1]])


# megatron's __del__ methods then trip over the half-built objects; that noise is theirs.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_empty_dataset(tmp_path, mcore):
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16):
        pass
    ours = IndexedDataset(tmp_path / "empty")
    assert (len(ours), ours.num_documents, ours.num_tokens) == (0, 0, 0)
    ours.validate()
    assert ours.document_indices.tolist() == [0]
    # megatron-core 0.16 memory-maps the .bin unconditionally, and numpy cannot map an empty file:
    # it refuses its own empty datasets the same way, so there is nothing more to compare.
    try:
        theirs = mcore.IndexedDataset(str(tmp_path / "empty"))
    except ValueError as e:
        assert "empty" in str(e)
    else:
        assert len(theirs) == 0


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_builder_files_load_in_ours(tmp_path, mcore, dtype):
    docs = make_documents(2, 300, 65000 if dtype is np.uint16 else 200_000)
    write_megatron_builder(mcore, tmp_path / "theirs", docs, dtype)

    ours = IndexedDataset(tmp_path / "theirs")
    ours.validate()
    assert ours.dtype == np.dtype(dtype)
    expected = flat_sequences(docs)
    assert len(ours) == len(expected)
    for i, seq in enumerate(expected):
        np.testing.assert_array_equal(ours[i], seq)
    assert ours.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    for d, seqs in enumerate(docs):
        np.testing.assert_array_equal(ours.document(d), np.concatenate(seqs) if seqs else [])
    assert_same_as_megatron(ours, mcore.IndexedDataset(str(tmp_path / "theirs")))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_byte_identical_to_megatron_builder(tmp_path, mcore, dtype):
    docs = make_documents(3, 500, 60000)
    write_ours(tmp_path / "ours", docs, dtype)
    write_megatron_builder(mcore, tmp_path / "theirs", docs, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes(), ext


def test_multimodal_sequence_modes_are_read(tmp_path, mcore):
    import torch

    b = mcore.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.int32, multimodal=True)
    b.add_item(torch.tensor([1, 2, 3]), mode=0)
    b.add_item(torch.tensor([4, 5]), mode=1)
    b.end_document()
    b.finalize(str(tmp_path / "mm.idx"))
    ours = IndexedDataset(tmp_path / "mm")
    ours.validate()
    assert ours.sequence_modes.tolist() == [0, 1]
    np.testing.assert_array_equal(ours.document(0), [1, 2, 3, 4, 5])


# ---------------------------------------------------------------------------------------------------------------
# merge


def test_merge_equals_megatron_add_index(tmp_path, mcore):
    parts = []
    for k, n in enumerate([50, 0, 1, 120]):
        prefix = tmp_path / f"part{k}"
        write_ours(prefix, make_documents(10 + k, max(n, 2), 60000)[:n], np.uint16)
        parts.append(prefix)

    stats = merge(parts, tmp_path / "merged")

    b = mcore.IndexedDatasetBuilder(str(tmp_path / "reference.bin"), dtype=np.uint16)
    for p in parts:
        b.add_index(str(p))
    b.finalize(str(tmp_path / "reference.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"reference{ext}").read_bytes(), ext

    inputs = [IndexedDataset(p) for p in parts]
    assert stats.datasets == 4
    assert stats.documents == sum(d.num_documents for d in inputs)
    assert stats.sequences == sum(len(d) for d in inputs)
    assert stats.tokens == sum(d.num_tokens for d in inputs)
    assert stats.bytes == 2 * stats.tokens
    merged = IndexedDataset(tmp_path / "merged")
    merged.validate()
    np.testing.assert_array_equal(merged.tokens, np.concatenate([d.tokens for d in inputs]))


def megatron_concatenation(mcore, parts: list[Path], out: Path, dtype) -> tuple[bytes, bytes]:
    b = mcore.IndexedDatasetBuilder(str(out) + ".bin", dtype=dtype)
    for p in parts:
        b.add_index(str(p))
    b.finalize(str(out) + ".idx")
    return Path(f"{out}.bin").read_bytes(), Path(f"{out}.idx").read_bytes()


def many_parts(tmp_path: Path, dtype=np.int32, sizes=(300, 0, 1, 700, 5, 0, 1200, 40, 900, 2)) -> list[Path]:
    """Parts of very different sizes, empty ones included, so that parallel copies finish out of order."""
    parts = []
    for k, n in enumerate(sizes):
        prefix = tmp_path / f"part{k}"
        write_ours(prefix, make_documents(100 + k, max(n, 2), 100000)[:n], dtype)
        parts.append(prefix)
    return parts


@pytest.fixture(scope="module")
def parts_and_reference(tmp_path_factory, mcore) -> tuple[list[Path], tuple[bytes, bytes]]:
    """many_parts() and Megatron's concatenation of them (add_index), made once: Megatron takes seconds."""
    tmp = tmp_path_factory.mktemp("parts")
    parts = many_parts(tmp)
    return parts, megatron_concatenation(mcore, parts, tmp / "reference", np.int32)


@pytest.mark.parametrize("streams", [1, 2, 4, 16])
def test_parallel_merge_streams_equal_megatron_add_index(tmp_path, parts_and_reference, streams):
    parts, expected = parts_and_reference
    stats = merge(parts, tmp_path / "merged", streams=streams)
    assert ((tmp_path / "merged.bin").read_bytes(), (tmp_path / "merged.idx").read_bytes()) == expected
    assert stats.bytes == 4 * stats.tokens == len(expected[0]) and stats.datasets == len(parts)
    assert not list(tmp_path.glob("*.tmp"))


def _place_in_child(placement: indexed.Placement, dest: str) -> int:
    indexed.place(placement, dest, durable=True)
    return os.getpid()


def test_parts_placed_by_other_processes_give_the_same_bytes(tmp_path, parts_and_reference):
    # streams=0: this process only plans; other processes (on a cluster, other nodes) copy each part into place,
    # here in reverse order, before the index is written
    import multiprocessing

    parts, expected = parts_and_reference
    cat = indexed.DatasetConcatenator(tmp_path / "placed", np.int32, streams=0)
    placements = [cat.add(p) for p in parts]
    assert [p.offset for p in placements] == list(np.cumsum([0] + [p.nbytes for p in placements[:-1]]))
    assert not Path(f"{tmp_path}/placed.bin").exists()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pids = pool.starmap(_place_in_child, [(p, str(cat.bin_tmp)) for p in reversed(placements)])
    assert os.getpid() not in pids
    cat.finalize()
    assert ((tmp_path / "placed.bin").read_bytes(), (tmp_path / "placed.idx").read_bytes()) == expected


def test_concatenating_holds_one_part_of_the_index_not_the_whole(tmp_path):
    """The index of a concatenation is built in temporary files: the memory it takes does not grow with the number
    of documents (40 bytes a document before: 0.9 GB for a 22M-document dataset), and the bytes are the same."""
    import tracemalloc

    part = tmp_path / "part_text_document"
    with IndexedDatasetWriter(part, np.uint16) as w:  # 50,000 one-token documents
        w.add_documents(np.arange(50_000, dtype=np.uint16), np.ones(50_000, dtype=np.int64))
    copies = 40  # 2M documents: 80 MB of index arrays if held
    tracemalloc.start()
    cat = indexed.DatasetConcatenator(tmp_path / "all_text_document", np.uint16, streams=0)
    for _ in range(copies):
        indexed.place(cat.add(part), cat.bin_tmp)
    cat.finalize(durable=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 << 20, f"{peak / 2**20:.0f} MB traced while concatenating {copies} x 50,000 documents"
    reference = tmp_path / "reference_text_document"
    with IndexedDatasetWriter(reference, np.uint16) as w:
        for _ in range(copies):
            w.add_dataset(part)
    assert indexed.idx_path(tmp_path / "all_text_document").read_bytes() == indexed.idx_path(reference).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_placement_refuses_a_bin_shorter_than_its_index(tmp_path):
    parts = many_parts(tmp_path, sizes=(50, 60))
    cat = indexed.DatasetConcatenator(tmp_path / "out", np.int32, streams=0)
    placements = [cat.add(p) for p in parts]
    os.truncate(placements[1].source, placements[1].nbytes - 8)  # cut after it was checked, as a lost write would
    with pytest.raises(IndexedFormatError, match=r"part1.bin: .* shorter than the \d+ its index promises"):
        indexed.place(placements[1], cat.bin_tmp)
    cat.discard()
    assert not list(tmp_path.glob("out*"))


def test_merge_onto_a_full_disk_raises_enospc_and_leaves_nothing(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        parts = many_parts(tmp_path, sizes=(1500, 1500, 1500, 1500))  # ~480 KB of tokens in all
        with pytest.raises(OSError) as e:
            merge(parts, mount / "out", streams=4)
        assert e.value.errno == errno.ENOSPC
        assert not list(mount.iterdir())
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_merge_refuses_mixed_dtypes(tmp_path):
    write_ours(tmp_path / "a", [[np.array([1, 2])]], np.uint16)
    write_ours(tmp_path / "b", [[np.array([1, 2])]], np.int32)
    with pytest.raises(IndexedFormatError, match=r"different token dtypes.*a \(uint16\).*b \(int32\)"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


def test_merge_refuses_output_equal_to_input(tmp_path):
    write_ours(tmp_path / "a", [[np.array([1, 2])]], np.uint16)
    write_ours(tmp_path / "b", [[np.array([3])]], np.uint16)
    before = (tmp_path / "a.bin").read_bytes(), (tmp_path / "a.idx").read_bytes()
    with pytest.raises(ValueError, match="output prefix is also an input"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "a")
    assert ((tmp_path / "a.bin").read_bytes(), (tmp_path / "a.idx").read_bytes()) == before


def test_merge_refuses_input_with_inconsistent_pointers(tmp_path):
    write_ours(tmp_path / "a", [[np.arange(5)], [np.arange(6)], [np.arange(7)]], np.int32)
    patch_idx(tmp_path / "a.idx", pointer_offset(3, 1), struct.pack("<q", 4))  # sequence 1 should start at byte 20
    with pytest.raises(IndexedFormatError, match="points at byte 4"):
        merge([tmp_path / "a"], tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


def test_merge_refuses_a_bad_input_before_writing(tmp_path):
    write_ours(tmp_path / "a", [[np.array([1, 2])]], np.uint16)
    (tmp_path / "b.idx").write_bytes(b"garbage" * 10)
    (tmp_path / "b.bin").write_bytes(b"")
    with pytest.raises(IndexedFormatError, match="not a Megatron MMap index"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------------------------------------------------------
# refusing bad files


def pointer_offset(s: int, i: int) -> int:
    """Byte offset of sequence pointer i in an .idx with s sequences (see the layout in indexed.py)."""
    return indexed.HEADER_SIZE + 4 * s + 8 * i


def doc_index_offset(s: int, i: int) -> int:
    return indexed.HEADER_SIZE + 12 * s + 8 * i


def patch_idx(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.fixture
def good(tmp_path) -> Path:
    """Four one-sequence documents of 3, 4, 5, 6 int32 tokens: S = 4, D = 5, a .bin of 72 bytes."""
    prefix = tmp_path / "good"
    write_ours(prefix, [[np.arange(n)] for n in (3, 4, 5, 6)], np.int32)
    IndexedDataset(prefix).validate()
    return prefix


def _bad_magic(p):
    patch_idx(p.with_suffix(".idx"), 0, b"XXIDIDX\x00\x00")


def _legacy_magic(p):
    patch_idx(p.with_suffix(".idx"), 0, b"TNTIDX\x00\x00")


def _version_2(p):
    patch_idx(p.with_suffix(".idx"), 9, struct.pack("<Q", 2))


def _dtype_code_9(p):
    patch_idx(p.with_suffix(".idx"), 17, bytes([9]))


def _truncated_idx(p):
    idx = p.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])


def _truncated_header(p):
    idx = p.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:20])


def _empty_idx(p):
    p.with_suffix(".idx").write_bytes(b"")


def _idx_with_extra_bytes(p):
    idx = p.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes() + b"\x00" * 3)


def _bin_shorter(p):
    b = p.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-4])


def _bin_longer(p):
    b = p.with_suffix(".bin")
    b.write_bytes(b.read_bytes() + b"\x00" * 4)


def _first_pointer_not_0(p):
    patch_idx(p.with_suffix(".idx"), pointer_offset(4, 0), struct.pack("<q", 4))


def _doc_indices_not_from_0(p):
    patch_idx(p.with_suffix(".idx"), doc_index_offset(4, 0), struct.pack("<q", 1))


def _doc_indices_not_to_s(p):
    patch_idx(p.with_suffix(".idx"), doc_index_offset(4, 4), struct.pack("<q", 3))


def _header_counts_too_many_sequences(p):
    patch_idx(p.with_suffix(".idx"), 18, struct.pack("<Q", 5))


OPEN_FAULTS = [
    (_bad_magic, r"not a Megatron MMap index"),
    (_legacy_magic, r"legacy \(TNTIDX.*corpusforge convert"),
    (_version_2, r"index version 2, only version 1"),
    (_dtype_code_9, r"unknown dtype code 9"),
    (_truncated_idx, r"truncated or corrupt"),
    (_truncated_header, r"truncated header \(20 of 34 bytes\)"),
    (_empty_idx, r"truncated header \(0 of 34 bytes\)"),
    (_idx_with_extra_bytes, r"truncated or corrupt"),
    (_header_counts_too_many_sequences, r"promises 5 sequences"),
    (_bin_shorter, r"the index covers 72 bytes of tokens but good\.bin has 68"),
    (_bin_longer, r"the index covers 72 bytes of tokens but good\.bin has 76"),
    (_first_pointer_not_0, r"first sequence pointer is 4, not 0"),
    (_doc_indices_not_from_0, r"document indices must run from 0 to the sequence count 4, found \[1\]\.\.\[4\]"),
    (_doc_indices_not_to_s, r"document indices must run from 0 to the sequence count 4, found \[0\]\.\.\[3\]"),
]


@pytest.mark.parametrize("corrupt,message", OPEN_FAULTS, ids=[f.__name__.strip("_") for f, _ in OPEN_FAULTS])
def test_open_refuses(good, corrupt, message):
    corrupt(good)
    with pytest.raises(IndexedFormatError, match=message) as e:
        IndexedDataset(good)
    assert str(good) in str(e.value)  # the message names the file


def _pointer_inconsistent(p):
    patch_idx(p.with_suffix(".idx"), pointer_offset(4, 2), struct.pack("<q", 16))  # lengths put it at 28


def _negative_length(p):
    patch_idx(p.with_suffix(".idx"), indexed.HEADER_SIZE + 4 * 1, struct.pack("<i", -4))


def _decreasing_doc_indices(p):
    patch_idx(p.with_suffix(".idx"), doc_index_offset(4, 1), struct.pack("<q", 3))
    patch_idx(p.with_suffix(".idx"), doc_index_offset(4, 2), struct.pack("<q", 1))


VALIDATE_FAULTS = [
    (_pointer_inconsistent, r"sequence 2 points at byte 16, but the lengths before it put it at 28"),
    (_negative_length, r"negative sequence length at 1"),
    (_decreasing_doc_indices, r"document indices decrease at 1"),
]


@pytest.mark.parametrize("corrupt,message", VALIDATE_FAULTS, ids=[f.__name__.strip("_") for f, _ in VALIDATE_FAULTS])
def test_faults_in_the_middle_are_refused_on_open(good, corrupt, message):
    corrupt(good)
    with pytest.raises(IndexedFormatError, match=message) as e:
        IndexedDataset(good)
    assert str(good) in str(e.value)
    ds = IndexedDataset(good, check=False)  # the O(1) checks see only the ends; validate() finds the same fault
    with pytest.raises(IndexedFormatError, match=message):
        ds.validate()


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, indexed.CHECK_CHUNK])
def test_check_index_finds_the_first_fault_wherever_the_chunks_fall(monkeypatch, chunk):
    """check_index walks the arrays in chunks: a fault at any position, on either side of a chunk boundary, is
    found and named by its own index."""
    monkeypatch.setattr(indexed, "CHECK_CHUNK", chunk)
    lengths = np.random.default_rng(0).integers(0, 9, 11).astype(np.int32)
    pointers, doc = indexed.sequence_pointers(lengths, 2), np.arange(12, dtype=np.int64)
    check = lambda lengths, pointers, doc: indexed.check_index(  # noqa: E731
        "x.idx", np.dtype(np.uint16), lengths, pointers, doc, int(lengths.sum()) * 2, "x.bin"
    )
    check(lengths, pointers, doc)  # sound
    for i in range(1, 10):  # the last pointer is the O(1) check's
        bad = pointers.copy()
        bad[i] += 2
        with pytest.raises(
            IndexedFormatError, match=rf"sequence {i} points at byte {bad[i]}, .* put it at {pointers[i]}"
        ):
            check(lengths, bad, doc)
        bad = doc.copy()
        bad[i] = doc[i + 1] + 1
        with pytest.raises(IndexedFormatError, match=rf"document indices decrease at {i} "):
            check(lengths, pointers, bad)
    for i in range(11):
        bad = lengths.copy()
        bad[i] = -1
        with pytest.raises(IndexedFormatError, match=rf"negative sequence length at {i} "):
            check(bad, indexed.sequence_pointers(bad, 2), doc)


def test_empty_and_documentless_indexes(tmp_path):
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int64))
    indexed.check_index("x.idx", np.dtype(np.int32), *empty, np.array([0]), 0, "x.bin")  # S = 0, D = 1: sound
    with pytest.raises(IndexedFormatError, match=r"must run from 0 to the sequence count 0, found \[\]\.\.\[\]"):
        indexed.check_index("x.idx", np.dtype(np.int32), *empty, np.zeros(0, np.int64), 0, "x.bin")


@pytest.mark.parametrize(
    "name,found",
    [
        ("corpus_text_document", ("corpus", "text")),
        ("my_corpus_raw_text_document", ("my_corpus", "raw_text")),  # the key's own underscore: the one on disk wins
        ("corpus_text_sentence", None),
        ("part-00000_text_document", None),
    ],
)
def test_preprocess_summary_is_found_by_the_output_naming(tmp_path, name, found):
    for stem in ("corpus", "my_corpus"):
        (tmp_path / f"{stem}.preprocess.json").write_text("{}")
    got = indexed.preprocess_summary(tmp_path / name)
    assert got == (None if found is None else (tmp_path / f"{found[0]}.preprocess.json", found[1]))


def test_recorded_dtype_that_cannot_be_read_is_ignored(good):
    (good.parent / "x.preprocess.json").write_text("not json")
    good_named = good.parent / "x_text_document"
    for ext in (".bin", ".idx"):
        good.with_suffix(ext).rename(f"{good_named}{ext}")
    IndexedDataset(good_named)  # a hint about the data, not the data: no refusal
    (good.parent / "x.preprocess.json").write_text('{"config": {"json_keys": ["text"]}, "stats": {"dtype": "int64"}}')
    with pytest.raises(IndexedFormatError, match=r"dtype code 4 \(int32\), but x\.preprocess\.json records .* int64"):
        IndexedDataset(good_named)


def test_token_sample_reads_the_start_middle_and_end(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(100, dtype=np.int32).tofile(path)
    sample, positions = indexed.read_token_sample(path, np.int32, n=10)
    np.testing.assert_array_equal(positions, [*range(10), *range(45, 55), *range(90, 100)])
    np.testing.assert_array_equal(sample, positions)
    sample, positions = indexed.read_token_sample(path, np.int32, n=1000)  # windows longer than the file
    assert set(positions.tolist()) == set(range(100)) and (sample == positions).all()


@pytest.mark.parametrize(
    "missing, message",
    [
        ((".bin",), r"good\.bin: no such file \(a dataset is the pair .*good\.bin/\.idx\)$"),
        ((".bin", ".idx"), r"good\.idx: no such file \(a dataset is the pair .*good\.bin/\.idx\)$"),
        # the .idx is a pair's commit point (publish_pair): a .bin without it is an interrupted write, not a dataset
        ((".idx",), r"good\.bin has no \.idx: a preprocess or merge writing it was interrupted .*; rerun it \("),
    ],
)
def test_a_missing_file_is_named_and_a_bin_without_its_idx_is_an_interrupted_write(good, missing, message):
    for ext in missing:
        good.with_suffix(ext).unlink()
    with pytest.raises(indexed.DatasetNotFoundError, match=message) as err:
        IndexedDataset(good)
    assert isinstance(err.value, FileNotFoundError) and "\n" not in str(err.value)


def test_read_header(good):
    h = read_header(good.with_suffix(".idx"))
    assert (h.dtype, h.sequence_count, h.document_count) == (np.dtype(np.int32), 4, 5)


def test_megatron_accepts_what_validate_accepts(good, mcore):
    """The fixture itself is sound for megatron too, so the faults above are the only difference."""
    assert_same_as_megatron(IndexedDataset(good), mcore.IndexedDataset(str(good)))


# ---------------------------------------------------------------------------------------------------------------
# writer: atomicity and bad input


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document(np.arange(100))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_exception_inside_with_keeps_the_old_dataset(tmp_path):
    write_ours(tmp_path / "x", [[np.array([7, 8, 9])]], np.uint16)
    before = (tmp_path / "x.bin").read_bytes(), (tmp_path / "x.idx").read_bytes()
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document(np.arange(100))
            raise RuntimeError("boom")
    assert ((tmp_path / "x.bin").read_bytes(), (tmp_path / "x.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.idx"]


def test_failure_during_finalize_leaves_nothing(tmp_path, monkeypatch):
    def failing_write_index(path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(indexed, "write_index", failing_write_index)
    with pytest.raises(OSError, match="No space"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document(np.arange(100))
    assert list(tmp_path.iterdir()) == []


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from corpusforge.indexed import IndexedDatasetWriter

    how, prefix = sys.argv[1], sys.argv[2]
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(50):
        w.add_document(np.arange(1000) % 60000)
    w._bin.flush()
    print("wrote", flush=True)
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how,code", [("exit", 3), ("kill", -signal.SIGKILL)])
def test_killed_writer_leaves_no_final_names(tmp_path, how, code):
    write_ours(tmp_path / "old", [[np.array([1, 2, 3])]], np.uint16)
    before = (tmp_path / "old.bin").read_bytes(), (tmp_path / "old.idx").read_bytes()
    for prefix in (tmp_path / "new", tmp_path / "old"):
        proc = subprocess.run([sys.executable, "-c", CHILD, how, str(prefix)], capture_output=True, text=True)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout.strip() == "wrote"
        assert os.path.getsize(f"{prefix}.bin.tmp") == 50 * 1000 * 2  # the tokens were really written
    assert not (tmp_path / "new.bin").exists() and not (tmp_path / "new.idx").exists()
    assert ((tmp_path / "old.bin").read_bytes(), (tmp_path / "old.idx").read_bytes()) == before
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "old")[0], [1, 2, 3])


def test_writer_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no Megatron code"):
        IndexedDatasetWriter(tmp_path / "u32", np.uint32)
    assert list(tmp_path.iterdir()) == []
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError, match="token id 70000 does not fit"):
        w.add_document(np.array([1, 70000]))
    with pytest.raises(ValueError, match="token id -1 does not fit"):
        w.add_document(np.array([-1, 5]))
    with pytest.raises(ValueError, match="sum to 3 but the document has 2 tokens"):
        w.add_document(np.array([1, 2]), [1, 2])
    with pytest.raises(ValueError, match="lengths sum to 4 but 3 tokens"):
        w.add_documents(np.array([1, 2, 3]), [2, 2])
    w.add_documents([1, 2, 3], [1, 2])  # plain lists are fine
    w.finalize()
    with pytest.raises(RuntimeError, match="already finalized"):
        w.add_document(np.array([1]))
    assert [IndexedDataset(tmp_path / "x")[i].tolist() for i in range(2)] == [[1], [2, 3]]


# ---------------------------------------------------------------------------------------------------------------
# random access on a larger dataset


def test_random_access_matches_reference(tmp_path):
    rng = np.random.default_rng(7)
    n_docs = 100_000
    seqs_per_doc = rng.choice([1, 1, 1, 2, 3], n_docs)
    lengths = rng.integers(0, 30, int(seqs_per_doc.sum()))
    tokens = rng.integers(0, 60000, int(lengths.sum())).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    doc_idx = np.concatenate([[0], np.cumsum(seqs_per_doc)])
    with IndexedDatasetWriter(tmp_path / "big", np.uint16) as w:
        for d in range(n_docs):
            s0, s1 = doc_idx[d], doc_idx[d + 1]
            w.add_document(tokens[starts[s0] : starts[s1]], lengths[s0:s1])

    ds = IndexedDataset(tmp_path / "big")
    ds.validate()
    assert (len(ds), ds.num_documents, ds.num_tokens) == (len(lengths), n_docs, len(tokens))
    np.testing.assert_array_equal(ds.tokens, tokens)
    for i in rng.integers(0, len(lengths), 2000):
        ref = tokens[starts[i] : starts[i + 1]]
        np.testing.assert_array_equal(ds[int(i)], ref)
        np.testing.assert_array_equal(ds[int(i) - len(ds)], ref)  # negative index
        np.testing.assert_array_equal(ds.get(int(i), 2, 5), ref[2:7])
        np.testing.assert_array_equal(ds.get(int(i), 4), ref[4:])
    for d in rng.integers(0, n_docs, 2000):
        np.testing.assert_array_equal(ds.document(int(d)), tokens[starts[doc_idx[d]] : starts[doc_idx[d + 1]]])
    np.testing.assert_array_equal(ds.document(-1), ds.document(n_docs - 1))
    # zero-copy: a sequence is a view into the memory-mapped .bin, not a copy
    assert np.shares_memory(ds[5], ds.tokens)
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    with pytest.raises(IndexError, match="document 100000 out of range"):
        ds.document(n_docs)


# -- replacing a pair: a crash between the renames never pairs a new .bin with an old .idx --------------------------


def _write_pair(prefix, docs, dtype=np.int32):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.array(d, dtype), [len(d)])


def _finalize_with_merge(prefix, docs):
    _write_pair(f"{prefix}-src", docs)
    merge([f"{prefix}-src"], prefix)


@pytest.mark.parametrize("finalize", [_write_pair, _finalize_with_merge], ids=["writer", "merge"])
@pytest.mark.parametrize("crash_at", [0, 1], ids=["at the .bin", "at the .idx"])
def test_a_crash_while_replacing_a_pair_leaves_old_or_none(tmp_path, monkeypatch, finalize, crash_at):
    """Old pair of 3 documents, new pair of 2 documents of other lengths: at each rename a reader sees the old pair
    or no dataset (the .idx missing), never the new .bin under the old .idx."""
    prefix = tmp_path / "ds"
    _write_pair(prefix, [[1, 2, 3], [4, 5], [6]])
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        if Path(dst).parent == tmp_path and Path(dst).name.startswith("ds."):  # the final names only
            calls.append(dst)
            if len(calls) > crash_at:
                raise OSError(errno.EIO, "injected crash", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", crashing_replace)
    with pytest.raises(OSError, match="injected crash"):
        finalize(prefix, [[7, 8, 9, 10], [11]])
    monkeypatch.setattr(indexed.os, "replace", real_replace)
    if (tmp_path / "ds.idx").exists():
        ds = IndexedDataset(prefix)
        assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4, 5], [6]]
    else:
        with pytest.raises(indexed.DatasetNotFoundError, match=r"ds\.bin has no \.idx: a preprocess or merge writing"):
            IndexedDataset(prefix)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to another user: needs root (CI runs as root)")
def test_open_refuses_an_unreadable_bin_at_open():
    """The .bin is mapped only at the first read; a .bin its reader may not read is still refused when the
    dataset opens, not later in a loader worker."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="cf-unreadable-"))  # pytest's tmp_path sits under a 0700 folder
    top.chmod(0o755)
    prefix = top / "a"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.arange(10), np.array([4, 6]))
    Path(f"{prefix}.idx").chmod(0o644)
    # The child opens the dataset once as root (every module it needs imported: the checkout may sit where the
    # other user cannot read), then, as that user, after the .bin lost its permissions.
    code = (
        "import os\nfrom corpusforge.indexed import IndexedDataset\n"
        f"IndexedDataset({str(prefix)!r})\nos.chmod({str(prefix)!r} + '.bin', 0)\n"
        f"os.setgid(65534)\nos.setuid(65534)\nIndexedDataset({str(prefix)!r})"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(top)
    assert out.returncode == 1
    assert (
        f"PermissionError: [Errno {errno.EACCES}] no permission to read the dataset's .bin: '{prefix}.bin'"
        in out.stderr
    )


# -- a full disk names the output, whichever writer fills it (a real tmpfs; the suite runs as root) ------------------

from iobench import iobench_helpers  # noqa: E402 - tests/iobench's helpers: a tmpfs mounted for a test

mount_tmpfs = iobench_helpers.tmpfs  # the fixture: mount(size, options) -> a fresh tmpfs, unmounted after the test


def _big(prefix: Path) -> Path:
    with IndexedDatasetWriter(prefix, np.uint16) as w:  # 1.6 MB of tokens, 40 KB of index
        w.add_documents(np.arange(800_000) % 50_000, np.full(4000, 200))
    return prefix


@pytest.mark.parametrize(
    "size, write, named",
    [
        ("1m", lambda src, out: merge([src], out), "out.bin"),  # the tokens do not fit
        ("1m", lambda src, out: IndexedDatasetWriter(out, np.uint16).add_dataset(src), "out.bin"),
        ("1m", lambda src, out: _big(out), "out.bin"),
        ("1680k", lambda src, out: merge([src], out), "out.idx"),  # the tokens fit, their index does not
        ("1600k", lambda src, out: _big(out), "out.idx"),
    ],
    ids=["merge-bin", "writer-copy", "writer-add", "merge-idx", "writer-idx"],
)
def test_a_full_disk_names_the_final_file_not_a_temporary_or_nothing(mount_tmpfs, tmp_path, size, write, named):
    src, where = _big(tmp_path / "src"), mount_tmpfs(size)
    with pytest.raises(OSError) as err:
        write(src, where / "out")
    assert err.value.errno == errno.ENOSPC and err.value.filename == f"{where}/{named}"
    assert not list(where.glob("out.idx"))  # no index of a dataset that is not there


def test_a_read_only_place_is_refused_before_the_merge_copies_anything(mount_tmpfs, tmp_path):
    ro = mount_tmpfs("1m", ",ro")
    with pytest.raises(OSError) as err:
        merge([_big(tmp_path / "src")], ro / "out")
    assert err.value.errno == errno.EROFS and err.value.filename == f"{ro}/out.bin"


# -- one resolver of dataset prefixes: a prefix that names no dataset says what it may have meant -------------------


def test_a_prefix_of_preprocess_is_pointed_to_its_datasets(tmp_path):
    """`preprocess --output-prefix out/tiny` writes out/tiny_text_document.bin/.idx; the README then says
    `inspect out/tiny`..."""
    for name in ("tiny_text_document", "tiny_title_document", "tiny_text_sentence", "tinyx_text_document"):
        _write_pair(tmp_path / name, [[1, 2]])
    (tmp_path / "tiny_orphan_document.bin").write_bytes(b"")  # no .idx: not a dataset
    with pytest.raises(indexed.DatasetNotFoundError) as err:
        IndexedDataset(tmp_path / "tiny")
    t = tmp_path / "tiny"
    assert str(err.value) == (
        f"no dataset at {t}; did you mean one of {t}_text_document, {t}_text_sentence, {t}_title_document?"
    )
    for name in ("tiny_title_document", "tiny_text_sentence"):
        for ext in (".bin", ".idx"):
            (tmp_path / f"{name}{ext}").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^no dataset at {t}; did you mean {t}_text_document\?$"):
        merge([t], tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=rf"^no dataset at {t}_text_document\.bin; did you mean {t}_text_d"):
        IndexedDataset(f"{t}_text_document.bin")  # given with its extension
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path}/nothing\.idx: no such file \(a dataset is the pair"):
        IndexedDataset(tmp_path / "nothing")

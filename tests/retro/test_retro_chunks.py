"""Chunk table: fixed chunks that never cross a document, equal to a per-document loop, on real .bin/.idx files."""

import numpy as np
from retrokit import topical_documents, write_dataset

from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter
from corpusforge.retro.chunks import ChunkTable, build_chunks, chunk_documents, document_bounds


def test_docstring_example():
    t = chunk_documents([0, 100], [100, 130], 64)
    assert t.doc.tolist() == [0, 0, 1] and t.start.tolist() == [0, 64, 100] and t.length.tolist() == [64, 36, 30]


def test_equals_per_document_loop_and_skips_empty_documents():
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 300, 500)
    sizes[::7] = 0
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    t = chunk_documents(starts, starts + sizes, 64)
    ref = [(d, s, min(64, s0 + n - s)) for d, (s0, n) in enumerate(zip(starts, sizes)) for s in range(s0, s0 + n, 64)]
    assert list(zip(t.doc.tolist(), t.start.tolist(), t.length.tolist())) == ref


def test_multi_sequence_documents_and_files(tmp_path):
    prefix = tmp_path / "multi"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_document(np.arange(150), lengths=[50, 100])  # one document of two sequences
        w.add_document(np.arange(1000, 1070))
    ds = IndexedDataset(prefix)
    starts, ends = document_bounds(ds)
    assert starts.tolist() == [0, 150] and ends.tolist() == [150, 220]
    stats = build_chunks(ds, tmp_path / "chunks", 64)
    t = ChunkTable.load(tmp_path / "chunks")
    assert stats["chunks"] == len(t) == 5
    assert t.doc.tolist() == [0, 0, 0, 1, 1]
    toks = t.tokens(ds.tokens, np.arange(5), 64)
    assert toks[2, :22].tolist() == list(range(128, 150)) and (toks[2, 22:] == -1).all()
    cont = t.tokens(ds.tokens, [1, 3], 128, pad=0, continuation=True)
    assert cont[0, :86].tolist() == list(range(64, 150)) and (cont[0, 86:] == 0).all()  # stops at its document's end
    assert cont[1, :70].tolist() == list(range(1000, 1070))


def test_no_chunk_crosses_a_document(tmp_path):
    ds = IndexedDataset(write_dataset(tmp_path / "d", topical_documents(200)))
    build_chunks(ds, tmp_path / "c", 64)
    t = ChunkTable.load(tmp_path / "c")
    starts, ends = document_bounds(ds)
    assert (t.start >= starts[t.doc]).all() and (t.start + t.length <= ends[t.doc]).all()
    assert int(t.length.sum()) == ds.num_tokens


def test_document_ranges_give_the_same_bounds(tmp_path):
    prefix = tmp_path / "multi"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in range(30):
            w.add_document(np.arange(40 * d + 5), lengths=[5, 40 * d] if d % 3 else [40 * d + 5])
    ds = IndexedDataset(prefix)
    starts, ends = document_bounds(ds)
    for lo, hi in ((0, 30), (0, 1), (7, 8), (4, 29), (29, 30)):
        s, e = document_bounds(ds, lo, hi)
        assert s.tolist() == starts[lo:hi].tolist() and e.tolist() == ends[lo:hi].tolist(), (lo, hi)


def test_chunk_tasks_on_workers_write_the_same_bytes(tmp_path):
    """Document ranges of ~50 chunks as tasks on 2 local worker processes: the files of the one-task pass."""
    from corpusforge.executors import LocalExecutor

    ds = IndexedDataset(write_dataset(tmp_path / "d", topical_documents(300)))
    one = build_chunks(ds, tmp_path / "one", 64)
    with LocalExecutor(2) as ex:
        many = build_chunks(ds, tmp_path / "many", 64, per_task=50, executor=ex)
    assert one["tasks"] == 1 and many["tasks"] > 10 and many["chunks"] == one["chunks"]
    for name in ("doc", "start", "length", "doc_end"):
        assert (tmp_path / "many" / f"{name}.npy").read_bytes() == (tmp_path / "one" / f"{name}.npy").read_bytes()
    assert not list((tmp_path / "many").glob("*.tmp"))

"""corpusforge.describe: the numbers `corpusforge inspect` prints, checked against plain-Python references."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from corpusforge.describe import DatasetSummary, decode_documents, describe, document_lengths, length_histogram
from corpusforge.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter, IndexedFormatError


def write(prefix, documents, dtype=np.uint16) -> None:
    """documents: lists of sequences (lists of ids)."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for seqs in documents:
            tokens = np.array([t for s in seqs for t in s], dtype=np.int64)
            w.add_document(tokens, [len(s) for s in seqs])


def reference_stats(doc_lengths: list[int]) -> dict:
    """Order statistics by hand: the p-th percentile is the ceil(p/100 * n)-th smallest length (inverted CDF)."""
    xs = sorted(doc_lengths)
    n = len(xs)

    def pct(p: float) -> int:
        return xs[max(math.ceil(p / 100 * n), 1) - 1]

    return {
        "doc_tokens_min": xs[0],
        "doc_tokens_mean": sum(xs) / n,
        "doc_tokens_p50": pct(50),
        "doc_tokens_p90": pct(90),
        "doc_tokens_p99": pct(99),
        "doc_tokens_max": xs[-1],
    }


def reference_histogram(doc_lengths: list[int]) -> dict[int, int]:
    """bucket -> documents, bucket = int.bit_length(): 0 for 0, k for 2**(k-1) <= x < 2**k."""
    counts: dict[int, int] = {}
    for x in doc_lengths:
        counts[x.bit_length()] = counts.get(x.bit_length(), 0) + 1
    return counts


def random_documents(seed: int, n: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        n_seq = int(rng.choice([0, 1, 1, 2, 3]))
        # lengths spread over several powers of two, with some empty sequences
        docs.append([rng.integers(0, 60000, int(rng.choice([0, 1, 3, 17, 200, 1500]))).tolist() for _ in range(n_seq)])
    docs[-1] = []  # a trailing document with no sequences: the case np.add.reduceat gets wrong
    return docs


def test_summary_matches_reference(tmp_path):
    docs = random_documents(0, 3000)
    write(tmp_path / "ds", docs)
    s = describe(tmp_path / "ds")

    doc_lengths = [sum(len(x) for x in seqs) for seqs in docs]
    n_seq = sum(len(seqs) for seqs in docs)
    assert (s.prefix, s.dtype, s.sequences, s.documents, s.tokens) == (
        str(tmp_path / "ds"),
        "uint16",
        n_seq,
        3000,
        sum(doc_lengths),
    )
    assert s.bin_bytes == 2 * sum(doc_lengths)
    assert s.idx_bytes == HEADER_SIZE + 12 * n_seq + 8 * 3001
    ref = reference_stats(doc_lengths)
    assert {k: getattr(s, k) for k in ref} == pytest.approx(ref)
    hist = reference_histogram(doc_lengths)
    assert {lo.bit_length(): n for lo, _, n in s.histogram if n} == hist
    assert sum(n for _, _, n in s.histogram) == 3000
    assert (s.valid, s.problem) == (True, None)


def test_document_lengths_with_empty_documents_everywhere(tmp_path):
    docs = [[], [[1, 2]], [], [], [[3], [], [4, 5, 6]], [[]], []]
    write(tmp_path / "ds", docs)
    assert document_lengths(IndexedDataset(tmp_path / "ds")).tolist() == [0, 2, 0, 0, 4, 0, 0]


def test_histogram_buckets():
    lengths = np.array([0, 1, 5, 6, 7, 1024, 1023])
    assert length_histogram(lengths) == (
        (0, 0, 1),
        (1, 1, 1),
        (2, 3, 0),
        (4, 7, 3),
        (8, 15, 0),
        (16, 31, 0),
        (32, 63, 0),
        (64, 127, 0),
        (128, 255, 0),
        (256, 511, 0),
        (512, 1023, 1),
        (1024, 2047, 1),
    )
    assert length_histogram(np.array([9, 12])) == ((8, 15, 2),)  # starts at the first non-empty bucket
    assert length_histogram(np.zeros(0, np.int64)) == ()
    # exact at every power of two, where floating-point log2 would be one off
    for k in range(1, 40):
        (lo, hi, _), *_ = length_histogram(np.array([2**k]))
        assert (lo, hi) == (2**k, 2 ** (k + 1) - 1)
        (lo, hi, _), *_ = length_histogram(np.array([2**k - 1]))
        assert (lo, hi) == (2 ** (k - 1), 2**k - 1)


def test_to_dict_is_flat_json(tmp_path):
    write(tmp_path / "ds", [[[1, 2, 3]], [[4]], [], [[5, 6], [7, 8, 9, 10, 11]]])
    d = describe(tmp_path / "ds").to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["histogram"] == {"0": 1, "1": 1, "2-3": 1, "4-7": 1}
    assert (d["documents"], d["sequences"], d["tokens"]) == (4, 4, 11)
    assert (d["doc_tokens_min"], d["doc_tokens_p50"], d["doc_tokens_max"], d["doc_tokens_mean"]) == (0, 1, 7, 2.75)
    assert all(not isinstance(v, dict) for k, v in d.items() if k != "histogram")  # one row per key in the CLI


def test_summary_is_frozen(tmp_path):
    write(tmp_path / "ds", [[[1]]])
    s = describe(tmp_path / "ds")
    assert isinstance(s, DatasetSummary)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tokens = 5


def test_empty_dataset(tmp_path):
    write(tmp_path / "ds", [])
    s = describe(tmp_path / "ds")
    assert (s.sequences, s.documents, s.tokens, s.bin_bytes, s.valid) == (0, 0, 0, 0, True)
    assert s.doc_tokens_min is None and s.doc_tokens_mean is None and s.histogram == ()
    assert s.to_dict()["histogram"] == {}


def test_invalid_index_is_reported_not_raised(tmp_path):
    write(tmp_path / "ds", [[[1, 2, 3]], [[4, 5]], [[6]]], dtype=np.int32)
    raw = bytearray((tmp_path / "ds.idx").read_bytes())
    raw[HEADER_SIZE + 12 + 8 : HEADER_SIZE + 12 + 16] = struct.pack("<q", 4)  # sequence 1 should start at byte 12
    (tmp_path / "ds.idx").write_bytes(bytes(raw))
    s = describe(tmp_path / "ds")
    assert s.valid is False
    assert "sequence 1 points at byte 4" in s.problem
    assert (s.sequences, s.documents, s.tokens) == (3, 3, 6)  # counts still come from the header and sizes
    assert s.doc_tokens_max is None and s.histogram == ()


def test_broken_pair_is_refused(tmp_path):
    write(tmp_path / "ds", [[[1, 2, 3]]])
    (tmp_path / "ds.bin").write_bytes(b"\x01\x00")
    with pytest.raises(IndexedFormatError, match="covers 6 bytes of tokens but ds.bin has 2"):
        describe(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        describe(tmp_path / "nothing")


class CharTokenizer:
    """Stand-in tokenizer for the test: id i decodes to chr(ord('a') + i % 26)."""

    def __init__(self) -> None:
        self.calls: list = []

    def decode(self, ids: list[int]) -> str:
        self.calls.append(ids)
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_decode_documents(tmp_path):
    write(tmp_path / "ds", [[[7, 4], [11, 11, 14]], [], [[22, 14, 17, 11, 3]], [[0]]])
    tok = CharTokenizer()
    assert decode_documents(tmp_path / "ds", 3, tok) == ["hello", "", "world"]
    assert all(type(x) is int for ids in tok.calls for x in ids)  # plain ints, not numpy scalars
    assert decode_documents(tmp_path / "ds", 100, tok) == ["hello", "", "world", "a"]
    assert decode_documents(tmp_path / "ds", 0, tok) == []
    with pytest.raises(ValueError, match="cannot decode -1 documents"):
        decode_documents(tmp_path / "ds", -1, tok)


def test_large_dataset_is_vectorised(tmp_path):
    rng = np.random.default_rng(1)
    lengths = (2 ** rng.uniform(0, 10, 100_000)).astype(np.int64) - 1  # spread over 11 buckets, ~15 M tokens
    tokens = np.zeros(int(lengths.sum()), np.uint16)  # only the index matters here
    with IndexedDatasetWriter(tmp_path / "big", np.uint16) as w:
        w.add_documents(tokens, lengths)
    s = describe(tmp_path / "big")
    ref = reference_stats(lengths.tolist())
    assert {k: getattr(s, k) for k in ref} == pytest.approx(ref)
    assert {lo.bit_length(): n for lo, _, n in s.histogram if n} == reference_histogram(lengths.tolist())


# -- inspect --decode: the tokenizer the dataset was written with ------------------------------------------------

TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs", "naïve café"]


def _own_tokenizer_dataset(root):
    """A dataset preprocessed with a tokenizer.json trained here (run from its own directory, with a relative path),
    so that decoding with the default cl100k_base would print other text."""
    from corpusforge.tokenizers.training import train_tokenizer

    train_tokenizer(TEXTS * 50, 300, root / "tok.json", kind="bpe")
    (root / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run = subprocess.run(
        [sys.executable, "-m", "corpusforge.cli", "preprocess", "in.jsonl", "--output-prefix", "out/c",
         "--tokenizer", "tok.json", "--workers", "1"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return root


@pytest.fixture(scope="module")
def own_tokenizer_dataset(tmp_path_factory):
    return _own_tokenizer_dataset(tmp_path_factory.mktemp("own"))


def _inspect(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "corpusforge.cli", "inspect", *args, "--json"],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["same directory", "other directory"])
def test_decode_uses_the_recorded_tokenizer(own_tokenizer_dataset, tmp_path, where):
    root = own_tokenizer_dataset
    cwd, prefix = (
        (root, "out/c_text_document") if where == "same directory" else (tmp_path, root / "out/c_text_document")
    )
    run = _inspect(str(prefix), "--decode", "3", cwd=cwd)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["decoded"] == [t + "<|endoftext|>" for t in TEXTS]  # the EOD preprocess appended


def test_decode_refuses_a_changed_or_missing_tokenizer(tmp_path):
    copy = _own_tokenizer_dataset(tmp_path)
    from corpusforge.tokenizers.training import train_tokenizer

    train_tokenizer(TEXTS * 50, 280, copy / "tok.json", kind="bpe")  # another tokenizer under the recorded path
    run = _inspect("out/c_text_document", "--decode", "1", cwd=copy)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "no longer the one" in lines[0], run.stderr
    (copy / "tok.json").unlink()
    run = _inspect("out/c_text_document", "--decode", "1", cwd=copy)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "pass --tokenizer" in lines[0], run.stderr
    (copy / "out" / "c.preprocess.json").unlink()  # a dataset another tool wrote: no record at all
    run = _inspect("out/c_text_document", "--decode", "1", cwd=copy)
    assert run.returncode == 1 and "no P.preprocess.json" in run.stderr, run.stderr
    run = _inspect("out/c_text_document", cwd=copy)  # without --decode no tokenizer is needed
    assert run.returncode == 0, run.stderr


@pytest.mark.slow  # CLI processes: ~3 s of imports each
def test_inspect_of_the_readmes_prefix_points_to_the_dataset_it_wrote(tmp_path):
    """The README runs `preprocess ... --output-prefix out/tiny`, which writes out/tiny_text_document.bin/.idx; a
    user then types `inspect out/tiny`. And a .bin left without its .idx by a killed commit is no dataset."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-corpus.jsonl.zst"
    cli = [sys.executable, "-m", "corpusforge.cli"]
    run = lambda *args: subprocess.run([*cli, *args], capture_output=True, text=True, cwd=tmp_path)  # noqa: E731
    assert run("preprocess", str(example), "--output-prefix", "out/tiny").returncode == 0
    for command in (["inspect", "out/tiny"], ["merge", "out/tiny", "--output-prefix", "out/all"]):
        proc = run(*command)
        assert proc.returncode == 1 and proc.stderr == (
            "corpusforge: error: no dataset at out/tiny; did you mean out/tiny_text_document?\n"
        ), proc.stderr
    (tmp_path / "out" / "tiny_text_document.idx").unlink()  # as a kill between the commit's two renames leaves it
    proc = run("inspect", "out/tiny_text_document")
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "corpusforge: error: out/tiny_text_document.bin has no .idx: a preprocess or merge writing it was "
        "interrupted (the .idx is written last); rerun it (preprocess with --resume) to complete or replace it"
    ]

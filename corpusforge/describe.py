"""What `corpusforge inspect` shows: counts, sizes, document-length statistics and validity of a token dataset.

Everything comes from the index (lengths and document indices), vectorised, so a summary of a billion-token dataset
costs one pass over its .idx; `--decode N` is the only part that reads tokens.

Example:
    >>> s = describe("out/corpus_text_document")
    >>> s.documents, s.doc_tokens_p50, s.valid
    (1000, 412, True)
    >>> s.to_dict()["histogram"]
    {'0': 2, '1': 0, '2-3': 5, ..., '512-1023': 210}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from corpusforge.indexed import IndexedDataset, IndexedFormatError, preprocess_summary


@dataclass(frozen=True)
class DatasetSummary:
    prefix: str
    dtype: str
    sequences: int
    documents: int
    tokens: int
    bin_bytes: int
    idx_bytes: int
    # Tokens per document; None when there are no documents, or when the index failed validation
    # (its lengths and document indices would not describe anything real).
    doc_tokens_min: int | None
    doc_tokens_mean: float | None
    doc_tokens_p50: int | None
    doc_tokens_p90: int | None
    doc_tokens_p99: int | None
    doc_tokens_max: int | None
    # (lo, hi, documents) per power-of-two bucket of tokens per document, lo..hi inclusive: 0, 1, 2-3, 4-7, ...,
    # from the first non-empty bucket to the last (empty ones between them included, so the shape reads right).
    histogram: tuple[tuple[int, int, int], ...]
    valid: bool  # IndexedDataset.validate() passed
    problem: str | None  # its message when it did not

    def to_dict(self) -> dict:
        """Flat and JSON-ready; the histogram becomes {"lo-hi": documents}."""
        data = asdict(self)
        data["histogram"] = {_bucket_label(lo, hi): n for lo, hi, n in self.histogram}
        return data


def describe(prefix: str | os.PathLike) -> DatasetSummary:
    """Summarise `{prefix}.bin/.idx`; opening refuses a broken pair, and validate()'s verdict is reported, not raised.

    Example: describe("out/corpus_text_document").tokens -> 1843200
    """
    ds = IndexedDataset(prefix, check=False)  # the O(1) checks; what validate() finds is reported below
    try:
        ds.validate()
        problem = None
    except IndexedFormatError as e:
        problem = str(e)
    lengths = document_lengths(ds) if problem is None else np.zeros(0, np.int64)
    stats = _length_stats(lengths)
    return DatasetSummary(
        prefix=ds.prefix,
        dtype=str(ds.dtype),
        sequences=len(ds),
        documents=ds.num_documents,
        tokens=ds.num_tokens,
        bin_bytes=ds.bin_path.stat().st_size,
        idx_bytes=ds.idx_path.stat().st_size,
        **stats,
        histogram=length_histogram(lengths),
        valid=problem is None,
        problem=problem,
    )


def document_lengths(ds: IndexedDataset) -> np.ndarray:
    """Tokens per document, (D-1,) int64: sums of sequence lengths between consecutive document indices.

    Differences of one cumulative sum rather than np.add.reduceat: reduceat returns the element itself for an empty
    segment (a document with no sequences) and rejects an index equal to S (empty documents at the end).
    """
    cum = np.zeros(len(ds) + 1, dtype=np.int64)
    np.cumsum(ds.sequence_lengths, dtype=np.int64, out=cum[1:])
    doc = ds.document_indices
    return cum[doc[1:]] - cum[doc[:-1]]


def _length_stats(lengths: np.ndarray) -> dict:
    names = (
        "doc_tokens_min",
        "doc_tokens_mean",
        "doc_tokens_p50",
        "doc_tokens_p90",
        "doc_tokens_p99",
        "doc_tokens_max",
    )
    if not len(lengths):
        return dict.fromkeys(names)
    # inverted_cdf: each percentile is a length some document really has (no interpolation between two).
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99], method="inverted_cdf")
    values = (int(lengths.min()), float(lengths.mean()), int(p50), int(p90), int(p99), int(lengths.max()))
    return dict(zip(names, values))


def length_histogram(lengths: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Documents per power-of-two length bucket: bucket 0 holds length 0, bucket k >= 1 holds 2**(k-1)..2**k - 1.

    Example: length_histogram(np.array([0, 1, 5, 6, 7])) -> ((0, 0, 1), (1, 1, 1), (2, 3, 0), (4, 7, 3))
    """
    if not len(lengths):
        return ()
    # frexp's exponent e satisfies 2**(e-1) <= x < 2**e for x >= 1, and is 0 for x = 0: exactly the bucket number
    # (exact for integers below 2**53).
    buckets = np.frexp(lengths.astype(np.float64))[1]
    counts = np.bincount(buckets)
    first = int(np.flatnonzero(counts)[0])
    return tuple((_bucket_lo(k), _bucket_lo(k + 1) - 1 if k else 0, int(counts[k])) for k in range(first, len(counts)))


def _bucket_lo(k: int) -> int:
    return 0 if k == 0 else 1 << (k - 1)


def _bucket_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


# ---------------------------------------------------------------------------------------------------------------
# --decode N


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def decode_documents(prefix: str | os.PathLike, n: int, tokenizer: Decoder) -> list[str]:
    """The text of the first `n` documents (fewer if the dataset has fewer), decoded with `tokenizer`.

    Example: decode_documents("out/corpus_text_document", 2, tokenizer) -> ['The first text.', 'The second.']
    """
    if n < 0:
        raise ValueError(f"cannot decode {n} documents; give a count of 0 or more")
    ds = IndexedDataset(prefix)
    # Plain ints: tokenizers differ in what array types they take, all take a list.
    return [tokenizer.decode(ds.document(d).tolist()) for d in range(min(n, ds.num_documents))]


@dataclass(frozen=True)
class RecordedTokenizer:
    """The tokenizer `corpusforge preprocess` wrote a dataset with, as its `P.preprocess.json` recorded it."""

    spec: str | None  # an encoding name or the tokenizer file's absolute path (None: the default, cl100k_base)
    fingerprint: str  # the tokenizer's sha256 identity, to check that `spec` still names the same tokenizer
    record: Path


def recorded_tokenizer(prefix: str | os.PathLike) -> RecordedTokenizer | None:
    """The tokenizer recorded beside a dataset that `corpusforge preprocess` wrote; None for other datasets.

    Older records may hold a path relative to the run's working directory: it is tried as given and then beside the
    record, and `load_recorded_tokenizer` checks the fingerprint either way.

    Example: recorded_tokenizer("out/tiny_text_document").spec -> None (cl100k_base, the default)
    """
    found = preprocess_summary(prefix)
    if found is None:
        return None
    path, _ = found
    try:
        summary = json.loads(path.read_text())
        # stats.tokenizer is the loaded tokenizer's name: an encoding name, or the file's absolute path
        spec = summary["stats"].get("tokenizer") or summary["config"]["tokenizer"]
        fingerprint = summary["fingerprint"]["tokenizer"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return RecordedTokenizer(spec, fingerprint, path)


def load_recorded_tokenizer(prefix: str | os.PathLike):
    """The tokenizer a dataset was written with, loaded and checked against its recorded fingerprint.

    Raises TokenizerError with the fix (pass --tokenizer) when there is no record or the recorded one cannot be
    found or has changed; decoding with another tokenizer would print plausible nonsense.

    Example: load_recorded_tokenizer("out/tiny_text_document").name -> 'cl100k_base'
    """
    from corpusforge.tokenizers import TokenizerError, load_tokenizer

    recorded = recorded_tokenizer(prefix)
    if recorded is None:
        raise TokenizerError(
            f"{prefix}: no P.preprocess.json records its tokenizer (written by another tool, or merged); "
            "pass --tokenizer NAME|PATH to decode"
        )
    candidates = [recorded.spec]
    if recorded.spec and not os.path.isabs(recorded.spec):
        candidates.append(str(recorded.record.parent / recorded.spec))
    for spec in candidates:
        try:
            tokenizer = load_tokenizer(spec)
        except (TokenizerError, OSError):
            continue
        if tokenizer.fingerprint == recorded.fingerprint:
            return tokenizer
    raise TokenizerError(
        f"{recorded.record}: the recorded tokenizer {recorded.spec or 'cl100k_base'!r} cannot be found or is no "
        "longer the one the dataset was written with; pass --tokenizer NAME|PATH to decode"
    )

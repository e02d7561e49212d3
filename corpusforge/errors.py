"""The one base class of the errors corpusforge raises on purpose.

A `CorpusforgeError` is a user's problem, not a bug: its message is already the one line a person needs (the file,
the record, the fix). The CLI and `python -m corpusforge.train` print it as one line and exit non-zero; any other
exception is a bug and keeps its traceback.

    >>> raise CorpusforgeError("corpus.jsonl.zst: truncated zstd stream; re-download or re-compress the file")
"""

from __future__ import annotations


class CorpusforgeError(Exception):
    """An expected failure with a one-line message naming the file, the record and the fix."""

    exit_code: int = 1

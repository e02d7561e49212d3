"""The one base class of the errors corpusforge raises on purpose, and the few kinds that are not one module's.

A `CorpusforgeError` is a user's problem, not a bug: its message is already the one line a person needs (the file,
the record, the fix). The CLI and `python -m corpusforge.train` print it as one line and exit non-zero; any other
exception is a bug and keeps its traceback. Each module's own errors (InputError, IndexedFormatError, ConfigError...)
subclass it and keep their older base (ValueError, RuntimeError), so `except ValueError` still catches them.

    >>> raise CorpusforgeError("corpus.jsonl.zst: truncated zstd stream; re-download or re-compress the file")
"""

from __future__ import annotations


class CorpusforgeError(Exception):
    """An expected failure with a one-line message naming the file, the record and the fix."""

    exit_code: int = 1


class ArgumentError(CorpusforgeError, ValueError):
    """Arguments that cannot work together (an output that is also an input); the message says which to change."""


class MissingExtraError(CorpusforgeError, ImportError):
    """An optional dependency is not installed; the message names the `pip install` that fixes it."""


class PickleRefusedError(CorpusforgeError, ValueError):
    """A file that should hold plain arrays or tensors holds a pickle, which could run code: it is never loaded.

    Example:
        >>> raise PickleRefusedError(pickle_refused("cache/abc-document_index.npy", "delete it; it is rebuilt"))
    """


def pickle_refused(path: object, fix: str) -> str:
    """The one wording of a refused pickle, so every loader says the same thing."""
    return f"{path}: holds a pickle; corpusforge never unpickles files (a pickle can run code): {fix}"


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name: for one-line errors that quote a
    library's (often multi-line) message.

    Example:
        >>> first_line(ValueError("bad thing\\n  details"))
        'bad thing'
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def refuses_pickle(error: BaseException) -> bool:
    """Whether np.load(..., allow_pickle=False) raised `error` because the file holds a pickle: an object array
    ("Object arrays cannot be loaded", "Python objects in dtype"), or no .npy header at all, which numpy then
    takes for a pickle ("pickled (object) data"). Anything else it raises means a damaged file."""
    text = str(error)
    return isinstance(error, ValueError) and ("pickle" in text or "object" in text.lower())

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


def first_line(error: BaseException | tuple) -> str:
    """The first non-empty line of an exception's message, or its type's name: for one-line errors that quote a
    library's (often multi-line) message.

    A failure is quoted as its own message, never with the traceback some libraries carry beside it: an
    `(exception, traceback)` pair (what DCP's CheckpointException.failures hold per rank), an exception that
    gathers others (CheckpointException, an ExceptionGroup: its first), or one whose arguments hold a traceback
    (a StackSummary, a list of FrameSummary: its first text argument). str() of those would print
    `[<FrameSummary file ...>]` into a one-line error.

    Example:
        >>> first_line(ValueError("bad thing\\n  details"))
        'bad thing'
        >>> first_line((OSError("short read"), traceback.extract_stack()))
        'short read'
    """
    error = _the_failure(error)
    if isinstance(error, BaseException) and any(map(_is_traceback, error.args)):
        text = next((a for a in error.args if isinstance(a, str)), "").strip()
    else:
        text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _the_failure(error: object) -> object:
    """The exception a carrier holds (see first_line); the error itself when it is plain."""
    for _ in range(8):  # carriers nest (a group of checkpoint failures); a cycle must not loop
        if isinstance(error, tuple) and error:
            error = next((e for e in error if isinstance(e, BaseException)), error[0])
        elif isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        elif isinstance(error, BaseException) and isinstance(getattr(error, "failures", None), dict) and error.failures:
            error = next(iter(error.failures.values()))
        else:
            return error
    return error


def _is_traceback(value: object) -> bool:
    """A traceback object, a StackSummary, or a list of FrameSummary (traceback.extract_tb's forms)."""
    import traceback
    import types

    if isinstance(value, types.TracebackType | traceback.StackSummary | traceback.FrameSummary):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(v, traceback.FrameSummary) for v in value)


def refuses_pickle(error: BaseException) -> bool:
    """Whether np.load(..., allow_pickle=False) raised `error` because the file holds a pickle: an object array
    ("Object arrays cannot be loaded", "Python objects in dtype"), or no .npy header at all, which numpy then
    takes for a pickle ("pickled (object) data"). Anything else it raises means a damaged file."""
    text = str(error)
    return isinstance(error, ValueError) and ("pickle" in text or "object" in text.lower())

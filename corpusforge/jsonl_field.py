"""One string field of every JSON line, extracted in C, for the blocks where nothing is wrong.

Parsing with orjson builds a dict and a str per record, only for the tokenizer to turn the str back into
UTF-8: on two cores that cost 40-60% of the tokenizer's own time. `extract_field` (corpusforge/_jsonl_field.c)
validates each line as strict JSON and copies the decoded UTF-8 of one top-level string field into one bytes
object, each document followed by 0xFF, a byte that never occurs in UTF-8; gigatoken splits it itself
(BytesSource). No Python object is made per record, and the scan runs without the GIL.

It accepts only what orjson accepts, and gives the same text; everything else it declines rather than judges:
a line that is not a JSON object, invalid JSON or UTF-8, a missing or repeated key, a value that is not a
string, an empty or whitespace-only document, a top-level key written with escapes, a lone surrogate, a number
orjson would reject (an infinite one), nesting deeper than 64. A declined block goes to the exact orjson path
(corpusforge.sources), which reports or skips each bad record with its file:line: the fast path changes the
speed only, never a result or a message. Without the compiled module (a source tree that was not built),
every block takes the exact path.

Example:
    >>> extract_field(b'{"text": "caf\\\\u00e9"}\\n\\n{"id": 1, "text": "b"}\\n', "text")
    (2, 3, JoinedTexts(2 documents, 8 bytes))
"""

from __future__ import annotations

try:
    from corpusforge import _jsonl_field
except ImportError:  # not built: the exact path serves every block
    _jsonl_field = None

SEPARATOR = b"\xff"  # after every document: never part of UTF-8 text


def available() -> bool:
    """Whether the compiled extractor is built (pip install builds it)."""
    return _jsonl_field is not None


class JoinedTexts:
    """A text column as one bytes object: each document's UTF-8 followed by SEPARATOR."""

    __slots__ = ("data", "count")

    def __init__(self, data: bytes, count: int) -> None:
        self.data, self.count = data, count

    def __len__(self) -> int:
        return self.count

    def to_pylist(self) -> list[str]:
        return [piece.decode() for piece in self.data.split(SEPARATOR)[:-1]]

    def __repr__(self) -> str:
        return f"JoinedTexts({self.count} documents, {len(self.data)} bytes)"


def extract_blocks(
    buffer: bytes | memoryview | object, key: str, ranges: list[tuple[int, int]], stop: bytearray
) -> list[tuple[int, int, JoinedTexts] | None] | None:
    """`extract_field(buffer[a:b], key)` for each (a, b) of `ranges`, in order, in one call that holds no GIL: so
    it can run on a thread beside one that holds the GIL for long (gigatoken loading a tokenizer). It stops before
    the next block once `stop[0]` is set, returning the results so far; None where the compiled module is not
    built or the key cannot take the fast path.

    Example:
        >>> extract_blocks(b'{"text": "a"}\\n{"x": 1}\\n', "text", [(0, 14), (14, 23)], bytearray(1))
        [(1, 1, JoinedTexts(1 documents, 2 bytes)), None]
    """
    name = key.encode()
    if _jsonl_field is None or not hasattr(_jsonl_field, "extract_blocks") or b"\\" in name or b'"' in name:
        return None
    found = _jsonl_field.extract_blocks(buffer, name, ranges, stop)
    return [None if f is None else (f[0], f[1], JoinedTexts(f[2], f[0])) for f in found]


def extract_field(block: bytes | memoryview, key: str) -> tuple[int, int, JoinedTexts] | None:
    """(documents, lines, their texts) for the string field `key` of every line of `block` (whole lines; blank
    lines hold no record), or None when some line needs the exact path."""
    name = key.encode()
    if _jsonl_field is None or b"\\" in name or b'"' in name:
        return None
    found = _jsonl_field.extract(block, name)
    if found is None:
        return None
    docs, lines, data = found
    return docs, lines, JoinedTexts(data, docs)

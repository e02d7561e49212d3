"""What every tokenizer here shares, whatever its format and engine: the protocol, the error, the file it came from.

- `Tokenizer`: the protocol callers type against (preprocess, inspect, retro).
- `Source`: a tokenizer file resolved from a spec (format, name, bytes); `Identity`: what the file says about
  itself (vocab_size, eod_id, fingerprint), the same on every engine.
- `BaseTokenizer`: the base class of every engine's tokenizer: batch checks, lone-surrogate retry, decode's
  id validation. Subclasses write `_encode` and `_decode` only.
- `Format`: one per file format (tiktoken_format, hf_format, sentencepiece_format): its identity, the reference
  library's tokenizer, and gigatoken's.

Example:
    >>> ids, lengths = tokenizer.encode_batch(["a b", "c"])  # doctest: +SKIP
    >>> tokenizer.decode(ids[: lengths[0]])  # doctest: +SKIP
    'a b'
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from corpusforge.errors import CorpusforgeError
from corpusforge.jsonl_field import JoinedTexts

__all__ = ["BaseTokenizer", "Format", "Identity", "Source", "Tokenizer", "TokenizerError", "flatten_lists", "read_file"]

_FINGERPRINT_VERSION = 1


class TokenizerError(CorpusforgeError, ValueError):
    """A tokenizer could not be loaded or used; the message is one line saying what failed and the fix."""


@runtime_checkable
class Tokenizer(Protocol):
    name: str  # "cl100k_base", "/abs/path/tokenizer.json"
    backend: str  # "gigatoken" | "tiktoken" | "tokenizers" | "sentencepiece"
    vocab_size: int  # 1 + the largest id, special tokens included: picks the .bin dtype
    eod_id: int | None  # appended after each document by --append-eod
    fingerprint: str  # sha256 hex of the file + settings that change tokens, not of the engine

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids, lengths int64 per text); ids of text i are flat[cumsum(lengths)[i-1]:cumsum(lengths)[i]]."""
        ...

    def decode(self, ids) -> str: ...


# ---------------------------------------------------------------------------------------------------------------
# the file, and what it says about itself


@dataclass(frozen=True)
class Source:
    """A tokenizer file, read once: its bytes are what every engine loads and what the fingerprint hashes."""

    format: str  # "tiktoken" | "tokenizers" | "sentencepiece"
    name: str
    path: Path
    data: bytes = field(repr=False)
    scheme: str | None = None  # tiktoken only: whose ranks these are (r50k_base, cl100k_base, o200k_base)


def read_file(path: Path) -> bytes:
    """The bytes of a tokenizer file, or a one-line TokenizerError.

    Example:
        >>> read_file(Path("/data/tok/tokenizer.json"))[:1]  # doctest: +SKIP
        b'{'
    """
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Identity:
    """What a tokenizer file says about itself, the same on every engine (the Tokenizer protocol's attributes)."""

    name: str
    vocab_size: int
    eod_id: int | None
    fingerprint: str

    @classmethod
    def of(cls, source: Source, vocab_size: int, eod_id: int | None) -> Identity:
        """The identity of `source`; the fingerprint leaves out the engine (shards of either engine resume each other).

        Example:
            >>> Identity.of(source, 100277, 100257).fingerprint  # doctest: +SKIP
            '5c1f...'
        """
        return cls(source.name, vocab_size, eod_id, _fingerprint(source, eod_id))


def _fingerprint(source: Source, eod_id: int | None) -> str:
    header = {
        "v": _FINGERPRINT_VERSION,
        "format": source.format,
        "scheme": source.scheme,
        "specials": "ordinary",  # special tokens inside documents are encoded as text (the package docstring)
        "eod_id": eod_id,
    }
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(b"\0")
    h.update(source.data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# the tokenizers


def _is_arrow_strings(texts) -> bool:
    module = type(texts).__module__
    if not module.startswith("pyarrow"):
        return False
    import pyarrow as pa

    return isinstance(texts, pa.Array) and (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type))


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.empty(0, np.uint32), np.empty(0, np.int64)


def _scrub(texts: Sequence[str]) -> tuple[list[str], bool]:
    """Texts with lone surrogates replaced by U+FFFD, as tiktoken does; and whether anything changed."""
    out, changed = [], False
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TokenizerError(f"document {i} of the batch is {type(text).__name__}, not str: pass text only")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Pairs of surrogates become their character, lone ones U+FFFD (tiktoken.core.Encoding.encode).
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            changed = True
        out.append(text)
    return out, changed


def flatten_lists(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint32 ids, int64 lengths) of one list of ids per document, as the reference libraries return them.

    Example:
        >>> flatten_lists([[1, 2], [3]])
        (array([1, 2, 3], dtype=uint32), array([2, 1]))
    """
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.uint32, count=int(lengths.sum()))
    return flat, lengths


class BaseTokenizer:
    """Shared by every engine: the identity attributes, batch checks, id validation for decode.

    A tokenizer pickles as "load it again" (Rust and C++ tokenizers do not pickle): corpusforge.tokenizers.load
    registers that with copyreg, beside load_tokenizer, so that this module need not import its own loader.
    """

    backend = "?"

    def __init__(self, identity: Identity, threads: bool) -> None:
        self.name = identity.name
        self.vocab_size = identity.vocab_size
        self.eod_id = identity.eod_id
        self.fingerprint = identity.fingerprint
        self.threads = threads
        self.fallback_reason: str | None = None  # why engine="auto" did not take gigatoken

    def encode_batch(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids, one length per text) for a list of str, an Arrow string array (UTF-8 buffers, no nulls), or
        JoinedTexts: what corpusforge.sources reads from parquet and JSON lines without a Python str per document."""
        if isinstance(texts, JoinedTexts):
            return self._encode_joined(texts) if len(texts) else _empty()
        if _is_arrow_strings(texts):
            return self._encode_arrow(texts) if len(texts) else _empty()
        if not isinstance(texts, list):
            texts = list(texts)
        if not texts:
            return _empty()
        try:
            return self._encode(texts)
        except (TypeError, UnicodeEncodeError) as e:  # a lone surrogate, or a document that is not a str
            fixed, changed = _scrub(texts)
            if not changed:
                raise TokenizerError(f"{self.backend} could not encode a batch with {self.name}: {e}") from None
            return self._encode(fixed)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _encode_arrow(self, texts) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_batch(texts.to_pylist())  # the reference libraries take str

    def _encode_joined(self, texts: JoinedTexts) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_batch(texts.to_pylist())

    def decode(self, ids) -> str:
        arr = np.asarray(ids).ravel()
        if arr.size == 0:
            return ""
        if arr.dtype.kind not in "iu":
            raise TokenizerError(f"decode takes integer token ids, got an array of {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise TokenizerError(f"token id {bad} is outside the vocabulary of {self.name} (0..{self.vocab_size - 1})")
        return self._decode(arr.astype(np.int64, copy=False))

    def _decode(self, ids: np.ndarray) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, backend={self.backend!r}, vocab_size={self.vocab_size}, "
            f"eod_id={self.eod_id})"
        )


class Format:
    """One tokenizer file format: what the file says about itself, and its tokenizer on each engine.

    `reference` builds the format's own library's tokenizer; `gigatoken` gigatoken's, or raises
    gigatoken_engine.Unsupported; `probes` are the texts both must tokenize alike before engine="auto" trusts
    gigatoken (empty: trusted without a check).

    Example:
        >>> fmt = HFFormat(source)  # doctest: +SKIP
        >>> fmt.identity.eod_id, fmt.reference(threads=False).backend  # doctest: +SKIP
        (0, 'tokenizers')
    """

    identity: Identity
    probes: list[str]

    def reference(self, threads: bool) -> BaseTokenizer:
        raise NotImplementedError

    def gigatoken(self, threads: bool) -> BaseTokenizer:
        raise NotImplementedError

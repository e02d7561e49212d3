"""load_tokenizer: a spec (a name or a path) to a file, the file to its format, the format to a tokenizer on an engine.

The choice of engine is made here and nowhere else: "reference" is the format's own library; "gigatoken" is
gigatoken or an error; "auto" is gigatoken when it loads the file and passes the probe check
(gigatoken_engine.load_checked), else the reference with the reason in `.fallback_reason`.

Example:
    >>> tok = load_tokenizer("cl100k_base", engine="auto")
    >>> tok.backend, tok.vocab_size, tok.eod_id
    ('gigatoken', 100277, 100257)
"""

from __future__ import annotations

import copyreg
import os
from pathlib import Path

from corpusforge.tokenizers.base import BaseTokenizer, Format, Source, Tokenizer, TokenizerError, read_file
from corpusforge.tokenizers.gigatoken_engine import GigatokenTokenizer, Unsupported, load_checked
from corpusforge.tokenizers.hf_format import HFFormat, HFReference
from corpusforge.tokenizers.sentencepiece_format import SentencePieceFormat, SentencePieceReference
from corpusforge.tokenizers.tiktoken_format import (
    DEFAULT_TOKENIZER,
    NAMED_ENCODINGS,
    TiktokenFormat,
    TiktokenReference,
    named_encoding,
    tiktoken_file,
)

__all__ = ["ENGINES", "load_tokenizer"]

ENGINES = ("auto", "gigatoken", "reference")  # what --engine accepts: the CLI takes its choices from here

# Source.format -> the class that knows that format's identity and engines.
FORMATS: dict[str, type[Format]] = {
    "tiktoken": TiktokenFormat,
    "tokenizers": HFFormat,
    "sentencepiece": SentencePieceFormat,
}

_FORMS = (
    "one of the names gpt2, r50k_base, cl100k_base, o200k_base, or a path to a .tiktoken rank file, "
    "a tokenizer.json (or a directory holding one) or a sentencepiece .model"
)


def resolve(spec: str | os.PathLike | None) -> Source:
    """The tokenizer file `spec` names (see the package docstring for the accepted forms), read and checked.

    Example:
        >>> resolve("cl100k_base").format
        'tiktoken'
    """
    spec = DEFAULT_TOKENIZER if spec is None else os.fspath(spec)
    if spec in NAMED_ENCODINGS:
        return named_encoding(spec)
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
        return tiktoken_file(path)
    if path.suffix == ".json":
        return Source("tokenizers", str(path), path, read_file(path))
    if path.suffix == ".model":
        return Source("sentencepiece", str(path), path, read_file(path))
    raise TokenizerError(f"cannot tell the format of tokenizer file {path} from its name; expected {_FORMS}")


def load_tokenizer(spec: str | os.PathLike | None = None, *, engine: str = "auto", threads: bool = False) -> Tokenizer:
    """The tokenizer named by `spec` (see the package docstring for the accepted forms), on `engine`.

    threads=True lets the engine use its own thread pool (gigatoken's rayon pool, tokenizers' and
    sentencepiece's threads); False encodes on the calling thread, for worker processes (one per core).

    Example:
        >>> ids, lengths = load_tokenizer("/data/tok/tokenizer.json", engine="reference").encode_batch(["hi"])
    """
    if engine not in ENGINES:
        raise TokenizerError(f"unknown tokenizer engine {engine!r}: use one of {', '.join(ENGINES)}")
    source = resolve(spec)
    fmt = FORMATS[source.format](source)
    if engine == "reference":
        return fmt.reference(threads)
    try:
        return load_checked(fmt, threads)
    except Unsupported as e:
        if engine == "gigatoken":
            raise TokenizerError(
                f"gigatoken cannot be used for {source.name}: {e}; use engine='reference' (or 'auto')"
            ) from None
        fallback = fmt.reference(threads)
        fallback.fallback_reason = str(e)
        return fallback


# ---------------------------------------------------------------------------------------------------------------
# pickling: a worker process gets the same tokenizer by loading it again


def _reload(name: str, engine: str, threads: bool, fingerprint: str) -> Tokenizer:
    tokenizer = load_tokenizer(name, engine=engine, threads=threads)
    if tokenizer.fingerprint != fingerprint:
        raise TokenizerError(f"tokenizer {name} changed on disk while in use (its fingerprint differs): rerun")
    return tokenizer


def _reduce(tokenizer: BaseTokenizer) -> tuple:
    # Rust and C++ tokenizers do not pickle. Registered with copyreg here rather than written as
    # BaseTokenizer.__reduce__, so that base.py does not import the loader that imports it.
    engine = "gigatoken" if tokenizer.backend == "gigatoken" else "reference"
    return _reload, (tokenizer.name, engine, tokenizer.threads, tokenizer.fingerprint)


for _cls in (GigatokenTokenizer, TiktokenReference, HFReference, SentencePieceReference):
    copyreg.pickle(_cls, _reduce)

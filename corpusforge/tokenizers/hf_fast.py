"""Any tokenizer corpusforge loads, as the files of a Hugging Face fast tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json) that `transformers.AutoTokenizer` loads offline and that encodes
text to the ids corpusforge's own tokenizer gives (what `corpusforge export-hf` ships beside a model).

- tiktoken (cl100k_base, o200k_base, r50k_base/gpt2): the BPE ranks become a `tokenizers` byte-level BPE, as
  transformers' `TikTokenConverter` builds it (merges: every split of a token into two tokens, ordered by the
  token's rank; `ignore_merges`, so that a piece found whole takes its rank, as tiktoken does), with two fixes:
  the special tokens keep their ids (the converter appends them after the ranks, which puts cl100k_base's
  <|endoftext|> at 100256 instead of 100257), and a possessive interval `\\p{N}{1,3}+` is written `\\p{N}{1,3}`
  (Oniguruma, which `tokenizers` uses, reads `{n,m}+` as "one or more of the interval": 25 digits would be one
  piece). "<|endoftext|>" is bos and eos (GPT-2's convention).
- tokenizer.json: copied byte for byte; tokenizer_config.json is written anew (a source's own is not copied).
- sentencepiece: transformers' `SpmConverter.build_tokenizer_from_spm_proto` (the model's own normalizer).

Every form encodes special-token text inside a text as text (`split_special_tokens: true`), as corpusforge's
datasets hold it: the end-of-document id comes from generation, never from a prompt. Decoding does no clean-up.
Each conversion is checked before it is returned: the texts corpusforge's probe set holds (awkward whitespace,
non-ASCII, special-token text) must encode to corpusforge's ids and decode back to its text, else TokenizerError.

Example:
    >>> files = hf_fast_tokenizer("cl100k_base")
    >>> files.eos_id, sorted(files.files)
    (100257, ['special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json'])
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from corpusforge.errors import first_line
from corpusforge.tokenizers.base import Format, Source, TokenizerError
from corpusforge.tokenizers.tiktoken_format import ENCODINGS, EOT, _parse_ranks

__all__ = ["HFTokenizerFiles", "hf_fast_tokenizer"]

# More than the probe set: what a user of the exported tokenizer will try first.
CHECK_TEXTS = [
    "Hello world",
    "héllo wörld, naïve café — 你好，世界 🙂",
    "a   b\t\t c\n\n\n  d  ",
    "x<|endoftext|>y <|endoftext|>",
    "123456789 1,234.5678",
]


@dataclass(frozen=True)
class HFTokenizerFiles:
    """A tokenizer as transformers' files, and the ids a model config needs from it."""

    name: str  # corpusforge's name for it: an encoding name or the file's absolute path
    fingerprint: str  # corpusforge's identity of it (Tokenizer.fingerprint)
    vocab_size: int  # 1 + its largest id
    eos_id: int | None  # its end-of-document id (Tokenizer.eod_id)
    bos_id: int | None
    files: dict[str, bytes] = field(repr=False)  # file name -> bytes


def hf_fast_tokenizer(spec: str | os.PathLike | None, *, model_max_length: int | None = None) -> HFTokenizerFiles:
    """The fast-tokenizer files of the tokenizer `spec` names (as `load_tokenizer` takes it), checked against
    corpusforge's own tokenizer; TokenizerError (one line) if it cannot be converted or converts to other ids.

    Example:
        >>> hf_fast_tokenizer("/data/tok/tokenizer.json").files["tokenizer.json"][:1]  # doctest: +SKIP
        b'{'
    """
    from corpusforge.tokenizers.load import FORMATS, resolve

    source = resolve(spec)
    fmt = FORMATS[source.format](source)
    if source.format == "tiktoken":
        tokenizer_json, bos, eos = _from_tiktoken(source)
    elif source.format == "tokenizers":
        tokenizer_json, bos, eos = _from_tokenizer_json(source, fmt)
    else:
        tokenizer_json, bos, eos = _from_sentencepiece(source, fmt)
    _check(tokenizer_json, fmt)
    identity = fmt.identity
    specials = {"bos_token": bos, "eos_token": eos}
    specials = {k: v for k, v in specials.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "split_special_tokens": True,  # special-token text in a prompt is text, as in the training data
        "clean_up_tokenization_spaces": False,  # decode gives the text back, as corpusforge's decode does
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if model_max_length:
        config["model_max_length"] = model_max_length
    files = {
        "tokenizer.json": tokenizer_json.encode("utf-8"),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(specials),
    }
    bos_id = _token_id(tokenizer_json, bos)
    return HFTokenizerFiles(identity.name, identity.fingerprint, identity.vocab_size, identity.eod_id, bos_id, files)


def _json(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _token_id(tokenizer_json: str, token: str | None) -> int | None:
    if token is None:
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_str(tokenizer_json).token_to_id(token)


def _from_tiktoken(source: Source) -> tuple[str, str, str]:
    """(tokenizer.json, bos, eos) of a tiktoken encoding; see the module docstring for the two fixes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    encoding = ENCODINGS[source.scheme]
    ranks = _parse_ranks(source.data)
    byte_char = bytes_to_unicode()  # GPT-2's printable stand-in for each byte

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges += [(rank, left, right) for left, right in splits]
    merges.sort(key=lambda m: m[0])
    vocab = {text(token): rank for token, rank in ranks.items()} | dict(encoding.special_tokens)
    tok = Tokenizer(BPE(vocab, [(text(a), text(b)) for _, a, b in merges], fuse_unk=False, ignore_merges=True))
    pattern = re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", encoding.pat_str)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                              use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in encoding.special_tokens])
    return tok.to_str(), EOT, EOT


def _from_tokenizer_json(source: Source, fmt: Format) -> tuple[str, str | None, str | None]:
    """(tokenizer.json, bos, eos) of a tokenizer.json: the file itself; eos is corpusforge's eod token."""
    import tokenizers

    text = source.data.decode("utf-8")
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise TokenizerError(f"tokenizers cannot load {source.path}: {first_line(e)}") from None
    eod = fmt.identity.eod_id
    eos = tok.id_to_token(eod) if eod is not None else None
    return text, eos, eos


def _from_sentencepiece(source: Source, fmt: Format) -> tuple[str, str | None, str | None]:
    """(tokenizer.json, bos, eos) of a sentencepiece model, through transformers' converter."""
    import sentencepiece
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    try:
        proto = import_protobuf().ModelProto()
        proto.ParseFromString(source.data)
        pieces = [(p.piece, p.score) for p in proto.pieces]
        vocab: Any = {piece: i for i, (piece, _) in enumerate(pieces)} if proto.trainer_spec.model_type == 2 else pieces
        tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    except Exception as e:  # protobuf's and the converter's own errors
        raise TokenizerError(
            f"{source.path}: transformers cannot convert this sentencepiece model to a fast tokenizer "
            f"({first_line(e)}); convert it to a tokenizer.json and pass that"
        ) from None
    if tok is None:
        raise TokenizerError(
            f"{source.path}: transformers converts sentencepiece BPE and unigram models only; convert it to a "
            "tokenizer.json and pass that"
        )
    sp = sentencepiece.SentencePieceProcessor(model_proto=source.data)
    eos = sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None
    bos = sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else eos
    return tok.to_str(), bos, eos


def _check(tokenizer_json: str, fmt: Format) -> None:
    """Refuse a conversion whose ids or text differ from corpusforge's reference tokenizer on the probe texts."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True  # what split_special_tokens: true sets in transformers
    reference = fmt.reference(threads=False)
    for text in [*fmt.probes, *CHECK_TEXTS]:
        ids, _ = reference.encode_batch([text])
        theirs = tok.encode(text, add_special_tokens=False).ids
        if theirs != ids.tolist() or tok.decode(theirs, skip_special_tokens=False) != reference.decode(ids):
            raise TokenizerError(
                f"{fmt.source.path}: as a Hugging Face fast tokenizer it would not give the ids and text "
                f"corpusforge's tokenizer gives (first on {text[:40]!r}); convert it to a tokenizer.json that "
                "does and pass that"
            )

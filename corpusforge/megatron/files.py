"""Megatron's tokenizer files, checked before a tokenizer library reads them: each is what its flag says, or one line.

Handed a damaged file, the libraries fail with a traceback that names no file (a merges file of binary junk:
`tokenizers`' "Error while initializing BPE"; a vocab.json that is not JSON: "Expecting value: line 1 column 1").
Each check here reads its file once and builds no tokenizer. A file that fails it raises MegatronTokenizerError
`FLAG PATH: what is wrong; the fix`:

    flag                 type                     a good file
    --vocab-file         GPT2BPETokenizer         UTF-8 JSON object, token -> distinct id >= 0 (GPT-2's vocab.json)
    --merge-file         GPT2BPETokenizer         UTF-8 lines "a b" after an optional "#version" line; a, b and ab
                                                  in the vocab (what `tokenizers` needs to build the BPE); not empty
                                                  (a file cut between two lines is a smaller BPE: no check sees it)
    --vocab-file         BertWordPiece*           UTF-8 text, one token per line, not JSON, holding [UNK] [CLS] [SEP]
                                                  (one cut short is a smaller vocab: no check sees it)
    --tokenizer-model    TikTokenizer             .json list of {rank, token_bytes (base64), token_str}, ranks 0..n-1,
                                                  the first 256 the single bytes (megatron.core's own asserts)
    --tokenizer-model    HuggingFaceTokenizer     a directory (or a Hub id in the local cache); its JSON files parse,
                                                  a vocab.json + merges.txt pair as above
    --tokenizer-model    sentencepiece types      a ModelProto (corpusforge's sentencepiece loader checks it)
    --tokenizer-metadata any                      JSON object with a "library" (megatron.core's metadata file)

Example:
    >>> vocab = gpt2_vocab("gpt2/vocab.json")        # doctest: +SKIP
    >>> bpe_merges("gpt2/merges.txt", vocab, "gpt2/vocab.json")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from corpusforge.errors import CorpusforgeError, first_line


class MegatronTokenizerError(CorpusforgeError, ValueError):
    """A Megatron tokenizer that cannot be built from the given flags and files; one line naming the flag, the file
    and the fix."""


GPT2_VOCAB_FIX = "pass GPT-2's vocab.json (a JSON object of token to id), the one saved with the merges file"
MERGES_FIX = "pass the merges.txt saved with the vocab file (one merge 'a b' per line)"
WORDPIECE_FIX = "pass the BERT model's vocab.txt (one WordPiece token per line, with [UNK], [CLS] and [SEP])"
TIKTOKEN_FIX = "pass Megatron's tiktoken vocabulary: a .json list of {rank, token_bytes (base64), token_str}"
BERT_SPECIALS = ("[UNK]", "[CLS]", "[SEP]")


def read(flag: str, path: str | None, what: str) -> bytes:
    """The bytes of the file `flag` names, or one line saying why there are none."""
    if not path:
        raise MegatronTokenizerError(f"{flag} is required: give the path of the {what}")
    p = Path(path)
    if not p.exists():
        raise MegatronTokenizerError(f"{flag} {path}: no such file; give the path of the {what}")
    if p.is_dir():
        raise MegatronTokenizerError(f"{flag} {path}: a directory, not a file; give the path of the {what}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise MegatronTokenizerError(
            f"{flag} {path}: cannot be read ({(e.strerror or first_line(e)).lower()}); make it readable"
        ) from None
    if not data:
        raise MegatronTokenizerError(f"{flag} {path}: an empty file (0 bytes); give the path of the {what}")
    return data


def utf8(flag: str, path: str, data: bytes, what: str, fix: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MegatronTokenizerError(
            f"{flag} {path}: not a {what} (binary data: not UTF-8 at byte {e.start}); {fix}"
        ) from None


def _json(flag: str, path: str, text: str, what: str, fix: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise MegatronTokenizerError(f"{flag} {path}: not a {what} (not JSON: {first_line(e)}); {fix}") from None


def gpt2_vocab(path: str | None, flag: str = "--vocab-file") -> dict[str, int]:
    """GPT-2's vocab.json: a JSON object of token to distinct non-negative id."""
    what = "GPT-2 vocab.json"
    text = utf8(flag, path, read(flag, path, what), what, GPT2_VOCAB_FIX)
    vocab = _json(flag, path, text, what, GPT2_VOCAB_FIX)
    if not isinstance(vocab, dict):
        raise MegatronTokenizerError(
            f"{flag} {path}: not a {what} (a JSON {type(vocab).__name__}, not an object of token to id); "
            f"{GPT2_VOCAB_FIX}"
        )
    bad = next((k for k, v in vocab.items() if type(v) is not int or v < 0), None)
    if bad is not None:
        raise MegatronTokenizerError(
            f"{flag} {path}: not a {what} (token {bad!r} has id {vocab[bad]!r}, not an integer >= 0); {GPT2_VOCAB_FIX}"
        )
    if len(set(vocab.values())) != len(vocab):
        raise MegatronTokenizerError(f"{flag} {path}: not a {what} (two tokens share an id); {GPT2_VOCAB_FIX}")
    return vocab


def bpe_merges(path: str | None, vocab: dict[str, int], vocab_path: str, flag: str = "--merge-file") -> None:
    """merges.txt: lines "a b" (an optional "#version" first line, blank lines ignored), a, b and ab in `vocab`."""
    what = "BPE merges file"
    text = utf8(flag, path, read(flag, path, what), what, MERGES_FIX)
    merges = 0
    for n, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise MegatronTokenizerError(
                f"{flag} {path}: line {n} is not a merge 'a b' ({line[:40]!r}): not a {what}; {MERGES_FIX}"
            )
        a, b = parts
        missing = next((t for t in (a, b, a + b) if t not in vocab), None)
        if missing is not None:
            raise MegatronTokenizerError(
                f"{flag} {path}: line {n} merges {a!r} and {b!r}, but {missing!r} is not in the vocab file "
                f"{vocab_path}; pass the merges file saved with that vocab"
            )
        merges += 1
    if not merges:
        raise MegatronTokenizerError(f"{flag} {path}: holds no merge (empty): not a {what}; {MERGES_FIX}")


def wordpiece_vocab(path: str | None, flag: str = "--vocab-file") -> None:
    """BERT's vocab.txt: UTF-8 text, one token per line, not JSON, with [UNK], [CLS] and [SEP]."""
    what = "BERT WordPiece vocab.txt"
    text = utf8(flag, path, read(flag, path, what), what, WORDPIECE_FIX)
    if text.lstrip()[:1] in ("{", "["):
        try:
            json.loads(text)
        except ValueError:
            pass
        else:
            raise MegatronTokenizerError(
                f"{flag} {path}: a JSON file (a GPT-2 vocab.json?), not a {what}; {WORDPIECE_FIX}"
            )
    tokens = {line.strip() for line in text.splitlines()}
    missing = [t for t in BERT_SPECIALS if t not in tokens]
    if missing:
        raise MegatronTokenizerError(
            f"{flag} {path}: not a {what} (no {' '.join(missing)} line among its {len(text.splitlines())} lines); "
            f"{WORDPIECE_FIX}"
        )


def tiktoken_ranks(path: str | None, max_vocab: int, shift: int, flag: str = "--tokenizer-model") -> dict[bytes, int]:
    """megatron.core's reload_mergeable_ranks: [{"rank", "token_bytes", "token_str"}, ...] cut to `max_vocab`, each
    rank + `shift`, with its asserts as one-line errors."""
    what = "tiktoken vocabulary"
    if not path or not str(path).endswith(".json"):
        raise MegatronTokenizerError(
            f"{flag} {path}: TikTokenizer reads a .json rank list (as Megatron); {TIKTOKEN_FIX}"
        )
    text = utf8(flag, path, read(flag, path, what), what, TIKTOKEN_FIX)
    rows = _json(flag, path, text, what, TIKTOKEN_FIX)
    if not isinstance(rows, list):
        raise MegatronTokenizerError(
            f"{flag} {path}: a JSON {type(rows).__name__}, not a list of ranks; {TIKTOKEN_FIX}"
        )
    rows = rows[:max_vocab]
    ranks: dict[bytes, int] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or row.keys() != {"rank", "token_bytes", "token_str"}:
            raise MegatronTokenizerError(
                f"{flag} {path}: entry {i} is not {{rank, token_bytes, token_str}}: not a {what}; {TIKTOKEN_FIX}"
            )
        if row["rank"] != i:
            raise MegatronTokenizerError(
                f"{flag} {path}: entry {i} has rank {row['rank']!r}; the ranks must be 0, 1, 2, ... in order; "
                f"{TIKTOKEN_FIX}"
            )
        try:
            token = base64.b64decode(row["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise MegatronTokenizerError(
                f"{flag} {path}: entry {i}'s token_bytes {str(row['token_bytes'])[:24]!r} is not base64: not a "
                f"{what}; {TIKTOKEN_FIX}"
            ) from None
        if i < 256 and token != bytes([i]):
            raise MegatronTokenizerError(
                f"{flag} {path}: entry {i} is {token[:8]!r}, not the byte {bytes([i])!r}: the first 256 ranks must be "
                f"the single bytes in order; {TIKTOKEN_FIX}"
            )
        ranks[token] = i + shift
    if len(ranks) != len(rows):
        raise MegatronTokenizerError(f"{flag} {path}: two ranks hold the same bytes: not a {what}; {TIKTOKEN_FIX}")
    if len(rows) != max_vocab:
        raise MegatronTokenizerError(
            f"{flag} {path}: {len(rows)} ranks, but --vocab-size minus --tiktoken-num-special-tokens is {max_vocab}; "
            "set --vocab-size to the file's ranks plus the special tokens"
        )
    return ranks


_HF_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json")


def hf_directory(path: str) -> None:
    """A tokenizer directory (save_pretrained's): its JSON files parse, its vocab.json/merges.txt are a BPE pair.
    A path that does not exist is left to transformers (a Hub id, read from the local cache only)."""
    flag, p = "--tokenizer-model", Path(path)
    if not p.exists():
        return
    fix = "pass the directory the tokenizer was saved to (save_pretrained), with undamaged files"
    if not p.is_dir():
        raise MegatronTokenizerError(
            f"{flag} {path}: a file, not a tokenizer directory; HuggingFaceTokenizer reads a directory: {fix}"
        )
    for name in _HF_JSON:
        f = p / name
        if f.is_file():
            _json(flag, str(f), utf8(flag, str(f), read(flag, str(f), name), name, fix), name, fix)
    if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
        vocab = gpt2_vocab(str(p / "vocab.json"), flag)
        bpe_merges(str(p / "merges.txt"), vocab, str(p / "vocab.json"), flag)


def metadata(path: str) -> dict:
    """megatron.core's tokenizer metadata file (MegatronTokenizer.write_metadata): a JSON object with a "library"."""
    flag, what = "--tokenizer-metadata", "tokenizer metadata file"
    fix = "pass the tokenizer_metadata.json MegatronTokenizer.write_metadata wrote, or drop the flag"
    meta = _json(flag, path, utf8(flag, path, read(flag, path, what), what, fix), what, fix)
    if not isinstance(meta, dict) or not isinstance(meta.get("library"), str):
        raise MegatronTokenizerError(f'{flag} {path}: no "library" in it: not a {what}; {fix}')
    return meta

"""Megatron-LM's `--tokenizer-type`s, with Megatron's semantics, behind corpusforge's Tokenizer protocol.

What `tools/preprocess_data.py` writes for a document is decided by `build_tokenizer(args).tokenize(text)` and
`.eod`, `.vocab_size` (megatron.core.tokenizers, identical in HEAD, core_v0.19.0 and core_v0.18.2). Per type:

    type                          tokenize(text)                                    eod             vocab_size
    GPT2BPETokenizer              GPT2TokenizerFast(vocab, merges)(text).input_ids  "<|endoftext|>"  len(tokenizer)
    HuggingFaceTokenizer          AutoTokenizer(model)(text).input_ids: BOS/EOS of  eos_token        len(tokenizer)
                                  its post-processor, special tokens in text match
    SentencePieceTokenizer,       sp.encode_as_ids(text): no BOS/EOS                sp.eos_id()      pieces
    GPTSentencePieceTokenizer,
    Llama2Tokenizer (one class)
    TikTokenizer                  tiktoken, ranks shifted by --tiktoken-num-special-  "</s>" (id 2)    --vocab-size
                                  tokens, allowed_special="all"                                     (131072)
    NullTokenizer                 [int(x) for x in text.split(" ")]                 vocab_size - 1   --vocab-size

The HF types load through `transformers` exactly as Megatron does (and add the same special tokens), and encode
through it; a Hub id is read from the local Hugging Face cache only, never downloaded. SentencePiece uses
corpusforge's own sentencepiece tokenizer, whose plain encode is Megatron's (so it gets gigatoken's speed).

Megatron's Encoder (tools/preprocess_data.py) then makes a document: each sentence tokenized (the whole text is
one sentence without --split-sentences), sentences with no tokens dropped, the EOD appended to the last one if the
document has any token; a document with no token is written as a document of no sequence. `encode_documents`
does exactly that for a batch.

Example:
    >>> tok = MegatronTokenizerSpec("SentencePieceTokenizer", tokenizer_model="sp.model")(False)
    >>> flat, lengths, counts = tok.encode_documents(["Hello there."], eod=tok.eod_id)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from corpusforge.errors import CorpusforgeError, first_line
from corpusforge.sources import text_list

# Megatron-LM's tokenizer types (--tokenizer-type choices, HEAD): the ones this mode writes, and why not the rest.
SUPPORTED_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
_BERT = "BERT WordPiece vocabularies are not implemented here (they are for BERT, not GPT pretraining)"
UNSUPPORTED_TYPES = {
    "BertWordPieceLowerCase": _BERT,
    "BertWordPieceCase": _BERT,
    "MultimodalTokenizer": "multimodal prompt formats are not implemented here",
    "NullMultimodalTokenizer": "multimodal prompt formats are not implemented here",
    "SFTTokenizer": "SFT conversation formats are not implemented here",
}
_SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")

# megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py
_TIKTOKEN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_TIKTOKEN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TIKTOKEN_SPECIALS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
_TIKTOKEN_MAX_VOCAB = 2**17


class MegatronTokenizerError(CorpusforgeError, ValueError):
    """A Megatron tokenizer that cannot be built from the given flags; one line naming the flag and the fix."""


@dataclass(frozen=True)
class MegatronTokenizerSpec:
    """Megatron's tokenizer flags; calling it (in each worker) builds the tokenizer. Frozen, hashable, picklable."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    special_tokens: tuple[str, ...] | None = None
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    hf_use_fast: bool = True
    hf_include_special_tokens: bool = True
    trust_remote_code: bool = False
    null_eod_id: int | None = None
    sp_ignore_extra_whitespaces: bool = True
    engine: str = "auto"
    """corpusforge's engine for the types it tokenizes natively (sentencepiece)."""
    split_language: str | None = None
    """--lang when --split-sentences is on; None: one sequence per document."""
    keep_newlines: bool = False

    def __call__(self, threads: bool = False) -> MegatronTokenizer:
        if self.tokenizer_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
            inner: _Texts = _HFTexts(self)
        elif self.tokenizer_type in _SP_TYPES:
            inner = _SentencePieceTexts(self, threads)
        elif self.tokenizer_type == "TikTokenizer":
            inner = _TikTokenTexts(self)
        elif self.tokenizer_type == "NullTokenizer":
            inner = _NullTexts(self)
        else:
            raise MegatronTokenizerError(
                f"--tokenizer-type {self.tokenizer_type}: {UNSUPPORTED_TYPES.get(self.tokenizer_type, 'unknown')}"
            )
        splitter = None
        if self.split_language is not None:
            from corpusforge.megatron.sentences import load_splitter

            splitter = load_splitter(self.split_language, self.keep_newlines)
        return MegatronTokenizer(self, inner, splitter)


def _file_digest(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    h = hashlib.sha256()
    for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
        if f.is_file() and f.stat().st_size < (1 << 30):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class MegatronTokenizer:
    """corpusforge's Tokenizer protocol over one of Megatron's types, plus `encode_documents` (Megatron's Encoder)."""

    def __init__(self, spec: MegatronTokenizerSpec, inner: _Texts, splitter) -> None:
        self.spec, self._inner, self._splitter = spec, inner, splitter
        self.name = f"{spec.tokenizer_type}:{spec.tokenizer_model or spec.vocab_file or ''}"
        self.backend = inner.backend
        self.vocab_size = inner.vocab_size
        self.eod_id = inner.eod_id
        self.punkt_source = splitter.source if splitter is not None else None
        # What changes the tokens: the flags (not the engine) and the bytes of every file they name.
        settings = {k: v for k, v in asdict(spec).items() if k != "engine"}
        files = {k: _file_digest(getattr(spec, k)) for k in ("vocab_file", "merge_file", "tokenizer_model")}
        header = json.dumps({"megatron": settings, "files": files, "punkt": self.punkt_source}, sort_keys=True)
        self.fingerprint = hashlib.sha256(header.encode()).hexdigest()

    def encode_batch(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's tokenize() of each text: (flat ids, lengths)."""
        return self._inner.encode(text_list(texts))

    def decode(self, ids) -> str:
        return self._inner.decode([int(i) for i in np.asarray(ids).ravel()])

    def encode_documents(self, texts, eod: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Megatron's Encoder.encode for a batch: (flat ids, sequence lengths, sequences per document), the last
        None when every document is one sequence. `eod` (or None) ends each document that has a token."""
        if self._splitter is None:
            # A column as it came (JoinedTexts, Arrow) where the engine reads it in place: no str per document.
            flat, lengths = self._inner.encode(texts if self._inner.reads_columns else text_list(texts))
            counts = np.ones(len(texts), np.int64)
        else:
            texts = text_list(texts)
            sentences = [self._splitter.sentences(t) for t in texts]
            counts = np.fromiter(map(len, sentences), np.int64, count=len(sentences))
            flat, lengths = self.encode_batch([s for doc in sentences for s in doc])
        kept = lengths > 0
        if not kept.all():  # Megatron drops sentences without tokens (and so may write documents of none)
            doc_of = np.repeat(np.arange(len(texts)), counts)
            counts = np.bincount(doc_of[kept], minlength=len(texts)).astype(np.int64)
            lengths = lengths[kept]
        lengths = lengths.astype(np.int64)
        if eod is not None:
            last = (np.cumsum(counts) - 1)[counts > 0]  # the last sequence of each document that has one
            flat = np.insert(flat.astype(np.int64, copy=False), np.cumsum(lengths)[last], eod)
            lengths[last] += 1
        return flat, lengths, (None if (counts == 1).all() else counts)


class _Texts:
    """One tokenizer type: Megatron's tokenize() over a list of str."""

    backend: str
    vocab_size: int
    eod_id: int | None
    reads_columns = False
    """`encode` takes any RecordBatch column (str list, JoinedTexts, Arrow array), not only a list of str."""

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


def _flatten(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    flat = np.fromiter((i for ids in lists for i in ids), np.int64, count=int(lengths.sum()))
    return flat, lengths


def _existing(flag: str, path: str | None, what: str) -> str:
    if not path:
        raise MegatronTokenizerError(f"{flag} is required: the {what}")
    if not os.path.exists(path):
        raise MegatronTokenizerError(f"{flag} {path}: no such file or directory")
    return path


class _HFTexts(_Texts):
    """GPT2BPETokenizer and HuggingFaceTokenizer: megatron.core's HuggingFaceTokenizer, through transformers."""

    backend = "transformers"

    def __init__(self, spec: MegatronTokenizerSpec) -> None:
        try:
            import transformers
        except ImportError:
            raise MegatronTokenizerError(
                f"--tokenizer-type {spec.tokenizer_type} needs transformers, as in Megatron: pip install transformers"
            ) from None
        self._tok = self._load(transformers, spec)
        self._tok.model_max_length = 1 << 62  # no "sequence too long" warning per long document; never truncates
        self._add_megatron_special_tokens(list(spec.special_tokens or ()))
        self.include_special = spec.hf_include_special_tokens
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token
        self.eod_id = None if eos is None else int(self._tok.convert_tokens_to_ids(eos))

    @staticmethod
    def _load(transformers, spec: MegatronTokenizerSpec):
        if spec.tokenizer_type == "GPT2BPETokenizer":
            # Megatron: AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...), a GPT-2 tokenizer
            # made from the two files (the Hub's "gpt2" repository only names the class).
            # Here a directory laid out as that repository (its class, the two files) is loaded the same way.
            vocab = _existing("--vocab-file", spec.vocab_file, "GPT-2 vocab.json")
            merges = _existing("--merge-file", spec.merge_file, "GPT-2 merges.txt")
            with tempfile.TemporaryDirectory(prefix="corpusforge-gpt2-") as repo:
                (Path(repo) / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
                (Path(repo) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
                shutil.copyfile(vocab, Path(repo) / "vocab.json")
                shutil.copyfile(merges, Path(repo) / "merges.txt")
                return transformers.AutoTokenizer.from_pretrained(
                    repo, use_fast=spec.hf_use_fast, local_files_only=True
                )
        model = spec.tokenizer_model
        if not model:
            raise MegatronTokenizerError(
                "--tokenizer-model is required with HuggingFaceTokenizer: a tokenizer directory"
            )
        kwargs = {"use_fast": spec.hf_use_fast, "trust_remote_code": spec.trust_remote_code}
        if spec.vocab_file is not None:
            kwargs["vocab_file"] = spec.vocab_file
            if spec.merge_file is not None:
                kwargs["merges_file"] = spec.merge_file
        try:  # local_files_only: a directory, or a Hub id already in the local cache; never a download
            return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True, **kwargs)
        except (OSError, ValueError) as e:
            raise MegatronTokenizerError(
                f"--tokenizer-model {model}: transformers cannot load it offline ({first_line(e)[:200]}); pass a local "
                "directory with the tokenizer files (save_pretrained), corpusforge never downloads from the Hub"
            ) from None

    def _add_megatron_special_tokens(self, additional: list[str]) -> None:
        # megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py, __init__, with no token overrides given
        tok, special = self._tok, {}
        if tok.sep_token is None and tok.eos_token:
            special["sep_token"] = tok.eos_token
        elif tok.eos_token is None and tok.sep_token:
            special["eos_token"] = tok.sep_token
        if tok.bos_token is None and tok.cls_token:
            special["bos_token"] = tok.cls_token
        if tok.cls_token is None and tok.bos_token:
            special["cls_token"] = tok.bos_token
        special["additional_special_tokens"] = additional
        tok.add_special_tokens(special)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        if self.include_special:
            return _flatten(self._tok(texts).input_ids)
        tok = self._tok
        return _flatten([tok.convert_tokens_to_ids(tok.tokenize(t)) for t in texts])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class _SentencePieceTexts(_Texts):
    """The three sentencepiece types are one class in megatron.core: plain encode, eod = eos."""

    reads_columns = True  # corpusforge's own tokenizer, as native preprocess calls it

    def __init__(self, spec: MegatronTokenizerSpec, threads: bool) -> None:
        from corpusforge.tokenizers import load_tokenizer

        model = _existing("--tokenizer-model", spec.tokenizer_model, "sentencepiece .model file")
        if spec.special_tokens:  # as megatron.core's SentencePieceTokenizer refuses them without legacy mode
            raise MegatronTokenizerError(
                "--tokenizer-special-tokens with a sentencepiece model needs --tokenizer-sentencepiece-legacy, "
                "which corpusforge does not implement; train the model with those tokens instead"
            )
        self._tok = load_tokenizer(model, engine=spec.engine, threads=threads)
        if self._tok.backend not in ("sentencepiece", "gigatoken"):
            raise MegatronTokenizerError(f"--tokenizer-model {model} is not a sentencepiece model")
        if not spec.sp_ignore_extra_whitespaces and self._drops_extra_spaces():
            raise MegatronTokenizerError(
                f"--no-tokenizer-sentencepiece-ignore-extra-whitespaces is not supported: {model} drops repeated "
                "spaces, and Megatron's placeholder rewrite that keeps them is not implemented"
            )
        self.backend = self._tok.backend
        self.vocab_size = self._tok.vocab_size
        self.eod_id = self._tok.eod_id

    def _drops_extra_spaces(self) -> bool:  # megatron.core: removed_extra_spaces (on the pieces; ids are the same)
        a, b = self._tok.encode_batch(["x  y"])[0], self._tok.encode_batch(["x y"])[0]
        return np.array_equal(a, b)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self._tok.encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class _TikTokenTexts(_Texts):
    """megatron.core's TikTokenTokenizer: a JSON rank list, ids shifted past its special tokens."""

    backend = "tiktoken"

    def __init__(self, spec: MegatronTokenizerSpec) -> None:
        import tiktoken

        path = _existing("--tokenizer-model", spec.tokenizer_model, "tiktoken vocabulary (.json rank list)")
        specials = list(spec.special_tokens) if spec.special_tokens else list(_TIKTOKEN_SPECIALS)
        pattern = {"v1": _TIKTOKEN_V1, "v2": _TIKTOKEN_V2, None: _TIKTOKEN_V2}.get(spec.tiktoken_pattern)
        n_special, vocab_size = spec.tiktoken_num_special_tokens, spec.vocab_size or _TIKTOKEN_MAX_VOCAB
        if pattern is None:
            raise MegatronTokenizerError(f"--tiktoken-pattern {spec.tiktoken_pattern}: use v1 or v2")
        if len(set(specials)) != len(specials) or not len(specials) <= n_special < vocab_size:
            raise MegatronTokenizerError(
                f"--tokenizer-special-tokens ({len(specials)}, unique), --tiktoken-num-special-tokens ({n_special}) "
                f"and --vocab-size ({vocab_size}) must satisfy len(special tokens) <= num special < vocab size"
            )
        if not set(_TIKTOKEN_SPECIALS) <= set(specials):
            raise MegatronTokenizerError(f"--tokenizer-special-tokens must include {' '.join(_TIKTOKEN_SPECIALS)}")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), n_special)]
        ranks = _tiktoken_ranks(path, vocab_size - n_special, n_special)
        self._enc = tiktoken.Encoding(
            name=Path(path).parent.name,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(specials)},
        )
        self.vocab_size, self.eod_id = vocab_size, specials.index("</s>")

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten([self._enc.encode(t, allowed_special="all") for t in texts])

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def _tiktoken_ranks(path: str, max_vocab: int, shift: int) -> dict[bytes, int]:
    """megatron.core's reload_mergeable_ranks: [{"rank", "token_bytes", "token_str"}, ...], ranks + shift."""
    import base64

    if not path.endswith(".json"):
        raise MegatronTokenizerError(f"--tokenizer-model {path}: TikTokenizer reads a .json rank list")
    try:
        vocab = json.loads(Path(path).read_bytes())[:max_vocab]
        ranks = {base64.b64decode(x["token_bytes"]): x["rank"] + shift for x in vocab}
        ok = all(x["rank"] == i for i, x in enumerate(vocab)) and len(ranks) == len(vocab) == max_vocab
    except (ValueError, KeyError, TypeError) as e:
        raise MegatronTokenizerError(f"--tokenizer-model {path}: not a tiktoken rank list ({e})") from None
    if not ok:
        raise MegatronTokenizerError(
            f"--tokenizer-model {path}: {len(vocab)} distinct ranks 0..n-1 are needed for --vocab-size minus "
            f"--tiktoken-num-special-tokens = {max_vocab}; set --vocab-size to match the file"
        )
    return ranks


class _NullTexts(_Texts):
    """megatron.core's NullTokenizer (HEAD, core_v0.19.0, core_v0.18.2): the text is its ids, space-separated."""

    backend = "null"

    def __init__(self, spec: MegatronTokenizerSpec) -> None:
        if spec.vocab_size is None:
            raise MegatronTokenizerError("--vocab-size is required with NullTokenizer")
        self.vocab_size = spec.vocab_size
        self.eod_id = spec.null_eod_id if spec.null_eod_id is not None else spec.vocab_size - 1

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if texts == ["warm up"]:  # preprocess's warm-up call, made before any document: not integers, not data
            return np.empty(0, np.int64), np.zeros(1, np.int64)
        try:
            return _flatten([[int(x) for x in t.split(" ")] for t in texts])
        except ValueError as e:
            raise MegatronTokenizerError(f"NullTokenizer reads space-separated integers: {e}") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

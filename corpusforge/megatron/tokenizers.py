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
    BertWordPieceLowerCase,       AutoTokenizer("bert-large-(un)cased", vocab_file)  "[SEP]" (its     len(tokenizer)
    BertWordPieceCase             (text).input_ids: [CLS] ... [SEP]; Case adds      eos: BERT has
                                  <extra_id_0..99> as special tokens                none)
    TikTokenizer                  tiktoken, ranks shifted by --tiktoken-num-special-  "</s>" (id 2)    --vocab-size
                                  tokens, allowed_special="all"                                     (131072)
    NullTokenizer                 [int(x) for x in text.split(" ")]                 vocab_size - 1   --vocab-size
    NullMultimodalTokenizer       the same                                          --vocab-size     --vocab-size + 1

BERT: Megatron names the Hub repository bert-large-uncased or bert-large-cased (which only sets do_lower_case)
and passes --vocab-file; here a directory laid out as that repository holds the given vocab.txt. (With the Hub
online, transformers 5 prefers that repository's tokenizer.json to --vocab-file: the same ids for BERT's own
vocab.txt; corpusforge always reads the file you name.)

Every file is checked before a library reads it (corpusforge.megatron.files): a damaged one is one line naming the
flag, the file and the fix. A NullTokenizer text that is not integers is reported as `file:line` (the first such
record of the input, found again by `locate_null_fault` once a worker met one).

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
import io
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from corpusforge import indexed
from corpusforge.errors import first_line
from corpusforge.megatron import files
from corpusforge.megatron.files import MegatronTokenizerError
from corpusforge.sources import text_list

# Megatron-LM's tokenizer types (--tokenizer-type choices, HEAD): the ones this mode writes, and why not the rest.
SUPPORTED_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
)
# Megatron-LM's preprocess_data.py (HEAD) cannot build these either: build_tokenizer reads args that its parser
# never defines (tokenizer_prompt_format, image_tag_type, sft_tokenizer_prompt_format) and stops with AttributeError.
UNSUPPORTED_TYPES = {
    "MultimodalTokenizer": "Megatron-LM's preprocess_data.py cannot build it either (it has no "
    "--tokenizer-prompt-format flag: AttributeError); preprocess the text with the language model's own "
    "--tokenizer-type (HuggingFaceTokenizer or a sentencepiece type)",
    "SFTTokenizer": "Megatron-LM's preprocess_data.py cannot build it either (no --sft-tokenizer-prompt-format flag: "
    "AttributeError); preprocess the text with the model's own --tokenizer-type (HuggingFaceTokenizer)",
}
_BERT_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
_NULL_TYPES = ("NullTokenizer", "NullMultimodalTokenizer")
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


# The megatron.core library each type reads (build_tokenizer), which a --tokenizer-metadata file must name.
LIBRARY = {
    **dict.fromkeys(("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"), "megatron"),
    **dict.fromkeys(("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"), "sentencepiece"),
    "HuggingFaceTokenizer": "huggingface",
    "TikTokenizer": "tiktoken",
    "NullTokenizer": "null-text",
    "NullMultimodalTokenizer": "null-multimodal",
}


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
    sp_legacy: bool = False
    """--tokenizer-sentencepiece-legacy: --tokenizer-special-tokens are split out of the text (megatron.core's
    legacy SentencePieceTokenizer); without special tokens the ids are the plain ones."""
    engine: str = "auto"
    """corpusforge's engine for the types it tokenizes natively (sentencepiece)."""
    split_language: str | None = None
    """--lang when --split-sentences is on; None: one sequence per document."""
    keep_newlines: bool = False

    def __call__(self, threads: bool = False) -> MegatronTokenizer:
        if self.tokenizer_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer", *_BERT_TYPES):
            inner: _Texts = _HFTexts(self)
        elif self.tokenizer_type in _SP_TYPES:
            inner = _SentencePieceTexts(self, threads)
        elif self.tokenizer_type == "TikTokenizer":
            inner = _TikTokenTexts(self)
        elif self.tokenizer_type in _NULL_TYPES:
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


def _additional_special_tokens(spec: MegatronTokenizerSpec) -> list[str]:
    """build_tokenizer's additional_special_tokens: BertWordPieceCase replaces the kwargs with T5's 100 sentinels
    (dropping --tokenizer-special-tokens), the other types pass --tokenizer-special-tokens."""
    if spec.tokenizer_type == "BertWordPieceCase":
        return [f"<extra_id_{i}>" for i in range(100)]
    return list(spec.special_tokens or ())


def _from_repo(transformers, spec: MegatronTokenizerSpec, repo: dict[str, dict], copies: dict[str, str], named: str):
    """AutoTokenizer.from_pretrained of a directory laid out as the Hub repository Megatron names (its JSON files
    `repo`, the user's files `copies` under the repository's names): the repository without a download."""
    with tempfile.TemporaryDirectory(prefix="corpusforge-megatron-repo-") as d:
        for name, content in repo.items():
            (Path(d) / name).write_text(json.dumps(content))
        for name, source in copies.items():
            shutil.copyfile(source, Path(d) / name)
        try:
            return transformers.AutoTokenizer.from_pretrained(d, use_fast=spec.hf_use_fast, local_files_only=True)
        except Exception as e:  # a file the checks passed that transformers still refuses: name it all the same
            raise MegatronTokenizerError(
                f"{named}: transformers cannot build {spec.tokenizer_type} from it ({first_line(e)[:200]}); "
                "pass the files the tokenizer was saved as"
            ) from None


class _HFTexts(_Texts):
    """GPT2BPETokenizer, the BERT types and HuggingFaceTokenizer: megatron.core's HuggingFaceTokenizer (the first
    three through MegatronHFTokenizer's Hub names), through transformers."""

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
        self._add_megatron_special_tokens(_additional_special_tokens(spec))
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
            vocab = files.gpt2_vocab(spec.vocab_file)
            files.bpe_merges(spec.merge_file, vocab, spec.vocab_file)
            repo = {"config.json": {"model_type": "gpt2"}, "tokenizer_config.json": {"model_max_length": 1024}}
            named = f"--vocab-file {spec.vocab_file} with --merge-file {spec.merge_file}"
            return _from_repo(transformers, spec, repo, {"vocab.json": spec.vocab_file, "merges.txt": spec.merge_file},
                              named)  # fmt: skip
        if spec.tokenizer_type in _BERT_TYPES:
            # Megatron: AutoTokenizer.from_pretrained("bert-large-uncased" / "bert-large-cased", vocab_file=...):
            # the repository gives the class and do_lower_case, the file the vocabulary.
            files.wordpiece_vocab(spec.vocab_file)
            lower = spec.tokenizer_type == "BertWordPieceLowerCase"
            config = {"do_lower_case": lower, "model_max_length": 512}
            repo = {"config.json": {"model_type": "bert"}, "tokenizer_config.json": config}
            return _from_repo(
                transformers, spec, repo, {"vocab.txt": spec.vocab_file}, f"--vocab-file {spec.vocab_file}"
            )
        model = spec.tokenizer_model
        if not model:
            raise MegatronTokenizerError(
                "--tokenizer-model is required with HuggingFaceTokenizer: a tokenizer directory"
            )
        files.hf_directory(model)
        kwargs = {"use_fast": spec.hf_use_fast, "trust_remote_code": spec.trust_remote_code}
        if spec.vocab_file is not None:
            files.read("--vocab-file", spec.vocab_file, "vocabulary file")
            kwargs["vocab_file"] = spec.vocab_file
            if spec.merge_file is not None:
                files.read("--merge-file", spec.merge_file, "merges file")
                kwargs["merges_file"] = spec.merge_file
        try:  # local_files_only: a directory, or a Hub id already in the local cache; never a download
            return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True, **kwargs)
        except Exception as e:  # transformers and tokenizers raise anything from OSError to their own Exception
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
    """The three sentencepiece types are one class in megatron.core: plain encode, eod = eos; in legacy mode the
    special tokens are split out of the text first (`_LegacySpecials`)."""

    reads_columns = True  # corpusforge's own tokenizer, as native preprocess calls it

    def __init__(self, spec: MegatronTokenizerSpec, threads: bool) -> None:
        from corpusforge.tokenizers import TokenizerError, load_tokenizer

        model = spec.tokenizer_model
        data = files.read("--tokenizer-model", model, "sentencepiece .model file")
        if spec.special_tokens and not spec.sp_legacy:  # megatron.core's SentencePieceTokenizer raises the same
            raise MegatronTokenizerError(
                "--tokenizer-special-tokens with a sentencepiece model: Megatron refuses them outside legacy mode "
                '("Special tokens must be None when legacy is set to False"); add --tokenizer-sentencepiece-legacy '
                "or train the model with those tokens"
            )
        try:
            self._tok = load_tokenizer(model, engine=spec.engine, threads=threads)
            self._tok.encode_batch(["probe"])  # a ModelProto that parses yet holds no model fails only here
        except (TokenizerError, RuntimeError) as e:
            why = "sentencepiece cannot parse it" if isinstance(e, TokenizerError) else "it parses but holds no model"
            raise MegatronTokenizerError(
                f"--tokenizer-model {model}: not a sentencepiece model ({why}); pass the tokenizer's .model file "
                "(a sentencepiece ModelProto)"
            ) from None
        if self._tok.backend not in ("sentencepiece", "gigatoken"):
            raise MegatronTokenizerError(
                f"--tokenizer-model {model}: a {self._tok.backend} tokenizer, not a sentencepiece model; pass the "
                "tokenizer's .model file, or use --tokenizer-type HuggingFaceTokenizer for a tokenizer directory"
            )
        # megatron.core keeps repeated spaces that the model drops by encoding them around a placeholder
        self._keep_spaces = not spec.sp_ignore_extra_whitespaces and self._drops_extra_spaces()
        self._legacy = _LegacySpecials(data, spec.special_tokens) if spec.sp_legacy and spec.special_tokens else None
        self.backend = self._tok.backend
        self.vocab_size = self._legacy.vocab_size if self._legacy else self._tok.vocab_size
        # megatron.core's legacy eos_id reads an eos_token that only a dict of special tokens sets: Megatron has no
        # EOD in legacy mode (AttributeError with --append-eod); args.py refuses that pair in one line.
        self.eod_id = None if spec.sp_legacy else self._tok.eod_id
        if self._legacy or self._keep_spaces:
            self.reads_columns = False

    def _drops_extra_spaces(self) -> bool:  # megatron.core: removed_extra_spaces (on the pieces; ids are the same)
        a, b = self._tok.encode_batch(["x  y"])[0], self._tok.encode_batch(["x y"])[0]
        return np.array_equal(a, b)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        plain = self._tok.encode_batch
        if self._keep_spaces:
            texts = [_SPACE_RUN.sub(f" {_PLACEHOLDER} ", t).rstrip() for t in texts]
        last = self._encode_keeping_spaces if self._keep_spaces else plain
        if self._legacy is not None:
            return self._legacy.encode(texts, plain, last)
        return last(texts)

    def _encode_keeping_spaces(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """megatron.core's _text_to_ids_extra_space, on texts already rewritten: each run between placeholders
        encoded with a placeholder after it, of which one id is dropped."""
        runs = [[r + _PLACEHOLDER for r in t.split(_PLACEHOLDER) if r] for t in texts]
        flat, lengths = self._tok.encode_batch([r for rs in runs for r in rs])
        lengths = np.asarray(lengths, np.int64)
        keep = np.ones(len(flat), bool)
        keep[np.cumsum(lengths)[lengths > 0] - 1] = False  # each run's last id: (part of) the placeholder
        text_of = np.repeat(np.arange(len(texts)), [len(rs) for rs in runs])
        per_text = np.bincount(text_of, weights=lengths - (lengths > 0), minlength=len(texts))
        return flat[keep], per_text.astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


_PLACEHOLDER = "☯"  # megatron.core's extra_space_token
_SPACE_RUN = re.compile(r"(?<= )(?= )|^ | $")  # megatron.core: where a placeholder goes


class _LegacySpecials:
    """megatron.core's legacy SentencePieceTokenizer with a list of special tokens (add_special_tokens and
    _text_to_ids, HEAD): a token that is a piece keeps the piece's id, any other gets the next id past the pieces;
    the text is cut at the leftmost special token (the first given wins a tie), each run of text encoded plainly,
    and a "▁" that begins a run right after a special token's id is dropped (not before the last run)."""

    def __init__(self, model: bytes, tokens: tuple[str, ...]) -> None:
        import sentencepiece

        if "" in tokens:
            raise MegatronTokenizerError(
                "--tokenizer-special-tokens: an empty token (Megatron's legacy split never ends on it); remove it"
            )
        sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        self.to_id: dict[str, int] = {}
        self.of_id: dict[int, str] = {}
        size, unk = sp.get_piece_size(), sp.unk_id()
        for token in tokens:
            piece = sp.piece_to_id(token)
            if piece == unk and token not in self.to_id:
                self.to_id[token], self.of_id[size] = size, token
                size += 1
            elif piece != unk:
                self.to_id[token], self.of_id[piece] = piece, token
        self.vocab_size, self.separator = size, sp.piece_to_id("▁")

    def split(self, text: str) -> tuple[list[str], list[int]]:
        """(the runs of text, n + 1 of them; the n special ids between them)."""
        runs, specials, idx = [], [], 0
        while True:
            found = {t: j - idx for t in self.to_id if (j := text.find(t, idx)) >= 0}
            if not found:
                break
            token = min(found, key=found.get)
            runs.append(text[idx : idx + found[token]])
            specials.append(self.to_id[token])
            idx += found[token] + len(token)
        runs.append(text[idx:])
        return runs, specials

    def encode(self, texts: list[str], encode_batch, encode_last) -> tuple[np.ndarray, np.ndarray]:
        """`encode_batch` for the runs before a special token, `encode_last` for the last run of each text (as
        megatron.core, whose last run alone goes through its extra-whitespace path)."""
        cut = [self.split(t) for t in texts]
        flat, lengths = encode_batch([run for runs, _ in cut for run in runs[:-1]])
        last_flat, last_lengths = encode_last([runs[-1] for runs, _ in cut])
        ends, last_ends = np.cumsum(lengths).tolist(), np.cumsum(last_lengths).tolist()
        k, out = 0, []
        for t, (_, specials) in enumerate(cut):
            ids: list[int] = []
            for j in range(len(specials)):
                run = flat[(ends[k - 1] if k else 0) : ends[k]].tolist()
                k += 1
                if ids and ids[-1] in self.of_id and run and run[0] == self.separator:
                    run = run[1:]
                ids += run
                ids.append(specials[j])
            ids += last_flat[(last_ends[t - 1] if t else 0) : last_ends[t]].tolist()
            out.append(ids)
        return _flatten(out)


class _TikTokenTexts(_Texts):
    """megatron.core's TikTokenTokenizer: a JSON rank list, ids shifted past its special tokens."""

    backend = "tiktoken"

    def __init__(self, spec: MegatronTokenizerSpec) -> None:
        import tiktoken

        path = spec.tokenizer_model
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
        ranks = files.tiktoken_ranks(path, vocab_size - n_special, n_special)
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


class _NullTexts(_Texts):
    """megatron.core's NullTokenizer (HEAD, core_v0.19.0, core_v0.18.2): the text is its ids, space-separated;
    NullMultimodalTokenizer reads them alike, with its EOD at --vocab-size and one more id in its vocabulary."""

    backend = "null"

    def __init__(self, spec: MegatronTokenizerSpec) -> None:
        if spec.vocab_size is None:
            raise MegatronTokenizerError(f"--tokenizer-type {spec.tokenizer_type} needs --vocab-size; give it")
        if spec.tokenizer_type == "NullMultimodalTokenizer":
            self.vocab_size, self.eod_id = spec.vocab_size + 1, spec.vocab_size
        else:
            self.vocab_size = spec.vocab_size
            self.eod_id = spec.null_eod_id if spec.null_eod_id is not None else spec.vocab_size - 1
        info = np.iinfo(indexed.best_dtype(self.vocab_size))
        self.low, self.high = int(info.min), int(info.max)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if texts == ["warm up"]:  # preprocess's warm-up call, made before any document: not integers, not data
            return np.empty(0, np.int64), np.zeros(1, np.int64)
        try:
            flat, lengths = _flatten([[int(x) for x in t.split(" ")] for t in texts])
        except ValueError:
            flat = None
        if flat is None or (len(flat) and (flat.min() < self.low or flat.max() > self.high)):
            problem = next(p for t in texts if (p := null_text_problem(t, self.low, self.high)) is not None)
            raise NullTextError(problem)
        return flat, lengths

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


class NullTextError(MegatronTokenizerError):
    """A NullTokenizer text that is not ids (raised in a worker, without its place; see `locate_null_fault`)."""


NULL_FIX = (
    'NullTokenizer reads token ids, as Megatron\'s: write them as "12 7 99" (single spaces), or pick a '
    "--tokenizer-type that reads text"
)


def null_text_problem(text: str, low: int, high: int) -> str | None:
    """What makes `text` no NullTokenizer input (Megatron's `[int(x) for x in text.split(" ")]`, written as
    `low`..`high`), or None."""
    for word in text.split(" "):
        try:
            value = int(word)
        except ValueError:
            why = "an empty text or a double space" if word == "" else "not an integer"
            return f"{word[:20]!r} is {why}"
        if not low <= value <= high:
            return f"id {value} does not fit the dataset's token type ({low}..{high}; Megatron fails on it too)"
    return None


def locate_null_fault(inputs: tuple[str, ...], keys: tuple[str, ...], spec: MegatronTokenizerSpec) -> str | None:
    """`file:line: 'key' ...; fix` for the first record of `inputs` (JSON lines, plain, .gz or .zst) whose text is
    no NullTokenizer input; None if there is none (or the inputs are not JSON lines). Read again only after a
    worker met such a text, so the run pays nothing for it."""
    from corpusforge import sources

    vocab_size = spec.vocab_size + (spec.tokenizer_type == "NullMultimodalTokenizer")
    info = np.iinfo(indexed.best_dtype(vocab_size))
    for path in sources.find_inputs(inputs).files:
        name = os.fspath(path)
        if path.is_dir() or name.endswith(".parquet"):
            continue
        with open_json_lines(name) as lines:
            for number, line in enumerate(lines, 1):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a bad record: preprocess reports those itself
                for key in keys:
                    text = record.get(key) if isinstance(record, dict) else None
                    if isinstance(text, str) and (problem := null_text_problem(text, info.min, info.max)):
                        return f"{name}:{number}: {key!r} is not NullTokenizer input ({problem}); {NULL_FIX}"
    return None


def open_json_lines(name: str):
    """The lines of a JSON-lines file, plain, .gz or .zst, as bytes."""
    if name.endswith(".gz"):
        import gzip

        return gzip.open(name, "rb")
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(name, "rb"), closefd=True))  # noqa: SIM115
    return open(name, "rb")  # noqa: SIM115 - the caller's with closes it

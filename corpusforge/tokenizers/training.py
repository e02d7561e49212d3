"""Train a tokenizer on an iterable of documents; the result loads with `load_tokenizer` on either engine.

kind="bpe": Hugging Face `tokenizers` byte-level BPE, GPT-2 style: the GPT-2 split regex (ByteLevel
pre-tokenizer, no prefix space), all 256 bytes in the initial alphabet (so no text is ever unknown),
ByteLevel decoder. `special_tokens` take the first ids (0, 1, ...) and are marked special, so that
`load_tokenizer` picks "<|endoftext|>" (or the only special token) as `eod_id`. Writes a tokenizer.json.

kind="sentencepiece": sentencepiece BPE with byte_fallback (the class of model gigatoken reads), Llama-style
settings that keep text lossless: identity normalization, no whitespace collapsing, digits split, pieces of
whitespace allowed. The first special token becomes the eos piece (so `eod_id` is "<|endoftext|>" by
default, next to <unk>=0 and <s>=1), the others control symbols: never matched in text. Documents are cut
into lines for training, as sentencepiece trains on sentences (newlines are then byte-fallback pieces).
Writes a .model.

Both trainers keep their counts in memory: feed them a sample (a few GB of text is plenty), not a corpus.
The file appears atomically: written under a temporary name in the same directory, fsynced, renamed.
"""

from __future__ import annotations

import io
import itertools
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from corpusforge.fsutil import check_writable, write_bytes_atomic
from corpusforge.tokenizers.base import TokenizerError

__all__ = ["KINDS", "TrainStats", "TrainTokenizerConfig", "train_tokenizer", "train_tokenizer_on"]

KINDS = {"bpe": ".json", "sentencepiece": ".model"}  # kind -> the suffix load_tokenizer recognises
_SP_CHUNK_CHARS = 8192  # sentencepiece skips sentences over max_sentence_length bytes: cut long lines
_SP_MAX_SENTENCE_BYTES = 4 * _SP_CHUNK_CHARS


@dataclass(frozen=True)
class TrainStats:
    """What train_tokenizer did."""

    kind: str
    documents: int  # documents read (empty ones included)
    bytes: int  # UTF-8 bytes of text read
    seconds: float
    vocab_size: int  # of the written tokenizer, special tokens included (may be below the request on tiny data)
    output: Path

    def to_dict(self) -> dict:
        return asdict(self) | {"output": str(self.output)}


class _Counter:
    """Passes documents through, counting them and their bytes."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = iter(texts)
        self.documents = 0
        self.bytes = 0

    def first_nonempty(self) -> Iterator[str]:
        """All documents, after checking that at least one holds text (the trainers fail obscurely otherwise)."""
        head = []
        for text in self:
            head.append(text)
            if text:
                return itertools.chain(head, self)
        raise TokenizerError("no text to train the tokenizer on: every input document was empty (or there were none)")

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            if not isinstance(text, str):
                raise TokenizerError(f"document {self.documents} is {type(text).__name__}, not str: pass text only")
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # lone surrogates: U+FFFD, as load_tokenizer does when encoding
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                size = len(text.encode("utf-8"))
            self.documents += 1
            self.bytes += size
            yield text


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    output: str | os.PathLike,
    *,
    kind: str = "bpe",
    special_tokens: Iterable[str] = ("<|endoftext|>",),
) -> TrainStats:
    """Train a `kind` tokenizer of `vocab_size` ids (special tokens included) on `texts`; write it to `output`.

    `output` must end in .json for kind="bpe" and .model for kind="sentencepiece" (how load_tokenizer tells
    formats apart); a directory gets tokenizer.json / tokenizer.model inside it.

    Example:
        >>> train_tokenizer(texts, 32000, "tok/tokenizer.json").vocab_size  # doctest: +SKIP
        32000
    """
    if kind not in KINDS:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}: use one of {', '.join(KINDS)}")
    output = _output_path(Path(output), kind)
    check_writable(output)  # a read-only place fails now, naming the output, not after the training
    specials = list(dict.fromkeys(special_tokens))  # keep order, drop repeats
    counter = _Counter(texts)
    start = time.perf_counter()
    if kind == "bpe":
        data, actual = _train_bpe(counter, vocab_size, specials)
    else:
        data, actual = _train_sentencepiece(counter, vocab_size, specials)
    write_bytes_atomic(output, data)  # created 0o666 minus the umask: other users and jobs read the tokenizer
    return TrainStats(kind, counter.documents, counter.bytes, time.perf_counter() - start, actual, output)


@dataclass(frozen=True)
class TrainTokenizerConfig:
    """What `corpusforge train-tokenizer` trains on and writes; its CLI options are bound to these fields."""

    inputs: tuple[str, ...]
    """Input files, directories or globs, read as preprocess reads them (.jsonl/.json, .gz/.zst, .parquet)."""

    vocab_size: int
    """Ids of the trained tokenizer, special tokens included (fewer on tiny data)."""

    output: Path
    """tokenizer.json (kind bpe) or .model (kind sentencepiece); --tokenizer then accepts it."""

    kind: str = "bpe"
    """"bpe": byte-level BPE (HF tokenizers, tokenizer.json); "sentencepiece": sentencepiece BPE (.model)."""

    json_keys: tuple[str, ...] = ("text",)
    """Fields of each record whose text is trained on."""

    max_mb: int | None = None
    """Train on the first N MB of text only; default: all of it."""


def train_tokenizer_on(config: TrainTokenizerConfig) -> TrainStats:
    """train_tokenizer on the documents of `config.inputs`, read as preprocess reads them.

    Example:
        >>> train_tokenizer_on(TrainTokenizerConfig(("c.jsonl",), 1000, Path("t.json"))).kind  # doctest: +SKIP
        'bpe'
    """
    from corpusforge.sources import expand_inputs, iter_texts

    max_bytes = config.max_mb << 20 if config.max_mb else None
    texts = iter_texts(expand_inputs(config.inputs), config.json_keys, max_bytes=max_bytes)
    return train_tokenizer(texts, config.vocab_size, config.output, kind=config.kind)


def _output_path(output: Path, kind: str) -> Path:
    suffix = KINDS[kind]
    if output.is_dir():
        return output / f"tokenizer{suffix}"
    if output.suffix != suffix:
        raise TokenizerError(
            f"output {output} of a {kind} tokenizer must end in {suffix}, which is how load_tokenizer knows its format"
        )
    return output


def _train_bpe(counter: _Counter, vocab_size: int, specials: list[str]) -> tuple[bytes, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, as GPT-2's printable characters
    smallest = len(alphabet) + len(specials)
    if vocab_size < smallest:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small for byte-level BPE: it needs at least {smallest} "
            f"(256 byte tokens + {len(specials)} special); pass --vocab-size {smallest} or more"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    documents = counter.first_nonempty()
    # Batches of documents: one Python->Rust crossing per 1000 documents instead of one per document.
    batches = iter(lambda: list(itertools.islice(documents, 1000)), [])
    tokenizer.train_from_iterator(batches, trainer)
    return tokenizer.to_str().encode("utf-8"), tokenizer.get_vocab_size(with_added_tokens=True)


def _sentences(documents: Iterator[str]) -> Iterator[str]:
    for text in documents:
        for line in text.splitlines():
            for i in range(0, len(line), _SP_CHUNK_CHARS):
                yield line[i : i + _SP_CHUNK_CHARS]


class _Capture:
    """Holds an error raised by the input while sentencepiece reads it (it would turn it into a RuntimeError)."""

    def __init__(self, sentences: Iterator[str]) -> None:
        self._sentences = sentences
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._sentences
        except Exception as e:  # ends the input early; reraise() after the trainer returns
            self._error = e

    def reraise(self) -> None:
        if self._error is not None:
            raise self._error


def _train_sentencepiece(counter: _Counter, vocab_size: int, specials: list[str]) -> tuple[bytes, int]:
    import sentencepiece

    eos, *control = specials or ["</s>"]
    control = [s for s in control if s not in ("<unk>", "<s>", eos)]
    smallest = 256 + 3 + len(control)  # byte pieces + <unk>, <s>, eos + control symbols (+ the characters seen)
    if vocab_size < smallest:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small for a sentencepiece BPE with byte fallback: it needs at least "
            f"{smallest} (256 bytes + <unk>, <s>, {eos} + {len(control)} control) plus the characters of the text"
        )
    model = io.BytesIO()
    sentences = _Capture(_sentences(counter.first_nonempty()))
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,  # rarer characters are left to byte fallback
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=_SP_MAX_SENTENCE_BYTES,
            eos_piece=eos,
            control_symbols=control,
            minloglevel=2,
        )
    except RuntimeError as e:
        sentences.reraise()
        raise TokenizerError(f"sentencepiece could not train: {str(e).strip().splitlines()[-1]}") from None
    sentences.reraise()
    data = model.getvalue()
    processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    return data, processor.get_piece_size()

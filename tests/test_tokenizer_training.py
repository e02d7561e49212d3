"""corpusforge.tokenizers.training: trained tokenizers load on both engines with identical tokens; clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from corpusforge.tokenizers import TokenizerError, load_tokenizer
from corpusforge.tokenizers.training import TrainStats, train_tokenizer

SAMPLES = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n\tprint('hi')\r\n",
    "日本語 😀 مرحبا e\u0301",
    "  spaced   out  ",
    "<|endoftext|> inside a document",
    "1234567890" * 5,
]


def _corpus(n_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "ro", "mi", "te", "su", "na", "lo", "pe", "th", "e", "in", "on"]
    extras = ["日本語", "😀", "é", "مرحبا", "def f(x):\n    return x\n", "\t", "\r\n", "2024"]
    docs = []
    for _ in range(n_docs):
        words = [
            rng.choice(extras) if rng.random() < 0.1 else "".join(rng.choices(syllables, k=rng.randint(1, 4)))
            for _ in range(rng.randint(10, 100))
        ]
        docs.append(" ".join(words))
    return docs


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _corpus(600)


def _tokens(tok, texts):
    ids, lengths = tok.encode_batch(texts)
    return [a.tolist() for a in np.split(ids.astype(np.int64), np.cumsum(lengths)[:-1])]


@pytest.mark.parametrize("kind, name", [("bpe", "tok.json"), ("sentencepiece", "tok.model")])
def test_trained_tokenizer_loads_on_both_engines(kind, name, corpus, tmp_path):
    out = tmp_path / name
    stats = train_tokenizer(iter(corpus), 600, out, kind=kind)  # a one-shot iterator is enough
    assert isinstance(stats, TrainStats) and stats.output == out and stats.kind == kind
    assert stats.documents == len(corpus) and stats.bytes == sum(len(t.encode()) for t in corpus)
    assert stats.seconds > 0 and stats.vocab_size == 600
    assert stats.to_dict()["output"] == str(out)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind

    giga = load_tokenizer(str(out), engine="gigatoken")
    ref = load_tokenizer(str(out), engine="reference")
    texts = SAMPLES + corpus[:30]
    assert _tokens(giga, texts) == _tokens(ref, texts)
    assert giga.vocab_size == ref.vocab_size == 600
    assert giga.eod_id == ref.eod_id is not None
    assert giga.decode([giga.eod_id]) in ("<|endoftext|>", "")  # sentencepiece decodes control pieces to ""
    for text, ids in zip(texts, _tokens(giga, texts), strict=True):
        assert giga.decode(ids) == text  # lossless: byte-level BPE, and identity-normalized sentencepiece


def test_bpe_specials_take_the_first_ids(corpus, tmp_path):
    out = tmp_path / "tokenizer.json"
    train_tokenizer(corpus, 400, out, special_tokens=("<eod>", "<pad>", "<eod>"))
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode([0]) == "<eod>" and tok.decode([1]) == "<pad>" and tok.vocab_size == 400
    assert tok.eod_id is None  # two special tokens and none named like an end of text: no guess
    train_tokenizer(corpus, 400, out, special_tokens=("<eod>",))
    assert load_tokenizer(str(out)).eod_id == 0  # the only special token is the separator


def test_sentencepiece_first_special_is_eos(corpus, tmp_path):
    import sentencepiece

    out = tmp_path / "sp.model"
    train_tokenizer(corpus, 500, out, kind="sentencepiece", special_tokens=("<|endoftext|>", "<|pad|>"))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(out))
    assert processor.id_to_piece(processor.eos_id()) == "<|endoftext|>"
    assert processor.is_control(processor.piece_to_id("<|pad|>"))
    tok = load_tokenizer(str(out))
    assert tok.eod_id == processor.eos_id() and tok.backend == "gigatoken"


def test_directory_output_and_overwrite(corpus, tmp_path):
    stats = train_tokenizer(corpus[:200], 300, tmp_path)
    assert stats.output == tmp_path / "tokenizer.json" and stats.output.is_file()
    first = stats.output.read_bytes()
    train_tokenizer(corpus[200:], 350, tmp_path)
    assert stats.output.read_bytes() != first and [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
    stats = train_tokenizer(corpus[:200], 400, tmp_path / "new" / "dir" / "t.model", kind="sentencepiece")
    assert stats.output.is_file()


@pytest.mark.parametrize("kind, name", [("bpe", "tokenizer.json"), ("sentencepiece", "tokenizer.model")])
def test_failed_training_keeps_the_old_file(kind, name, corpus, tmp_path):
    out = tmp_path / name
    train_tokenizer(corpus[:100], 300, out, kind=kind)
    before = out.read_bytes()

    def broken():
        yield from corpus[:50]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        train_tokenizer(broken(), 300, out, kind=kind)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.parametrize("kind, name", [("bpe", "t.json"), ("sentencepiece", "t.model")])
def test_errors(kind, name, corpus, tmp_path):
    out = tmp_path / name
    with pytest.raises(TokenizerError, match="too small"):
        train_tokenizer(corpus, 100, out, kind=kind)
    for empty in ([], ["", "", ""], iter(())):
        with pytest.raises(TokenizerError, match="no text"):
            train_tokenizer(empty, 1000, out, kind=kind)
    with pytest.raises(TokenizerError, match="not str"):
        train_tokenizer(["ok", b"bytes"], 1000, out, kind=kind)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_sentencepiece_vocab_below_required_chars(tmp_path):
    # 300 distinct characters need 300 pieces of their own (character_coverage): sentencepiece refuses.
    texts = ["".join(chr(0x4E00 + i) for i in range(j, j + 300)) for j in range(0, 600, 3)]
    with pytest.raises(TokenizerError, match="sentencepiece could not train") as err:
        train_tokenizer(texts, 300, tmp_path / "t.model", kind="sentencepiece")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind, name", [("bpe", "t.json"), ("sentencepiece", "t.model")])
def test_lone_surrogates_are_replaced(kind, name, corpus, tmp_path):
    stats = train_tokenizer(corpus[:100] + ["bad \ud800 text"], 400, tmp_path / name, kind=kind)
    assert stats.documents == 101
    tok = load_tokenizer(str(stats.output))
    assert tok.decode(tok.encode_batch(["a\ud800"])[0]) == "a\ufffd"


def test_argument_errors(corpus, tmp_path):
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        train_tokenizer(corpus, 500, tmp_path / "t.json", kind="unigram")
    with pytest.raises(TokenizerError, match=r"must end in \.json"):
        train_tokenizer(corpus, 500, tmp_path / "t.model", kind="bpe")
    with pytest.raises(TokenizerError, match=r"must end in \.model"):
        train_tokenizer(corpus, 500, tmp_path / "t.json", kind="sentencepiece")

"""corpusforge.tokenizers: gigatoken == reference token for token, offline default, clear errors."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import pickle
import random
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from corpusforge import tokenizers as tk
from corpusforge.jsonl_field import SEPARATOR, JoinedTexts
from corpusforge.tokenizers import TokenizerError, load_tokenizer, tiktoken_format
from corpusforge.tokenizers.training import train_tokenizer

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

# Every kind of text the brief names, plus the ones that broke tokenizers before.
VARIED = [
    "",
    "Hello, world!",
    "def encode(self, text: str) -> list[int]:\n    return [ord(c) for c in text]  # noqa\n",
    "for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }\r\n",
    "日本語のテキストと中文文本，한국어도 있습니다。",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇩🇪 keycap 1️⃣",
    "combining: e\u0301 a\u0308 o\u0302\u0323 Z\u0335\u0321\u0330a\u0334l\u0337g\u0336o\u0338",
    "RTL: مرحبا بالعالم — שלום עולם — mixed ltr عربي text",
    "spaces:  two   three    four     five      done",
    "\t\ttabs\tand\ttabs\t\t\n\n\n\nnewlines\r\n\r\nCRLF\r\rCR",
    "   leading and trailing   ",
    "\n",
    " ",
    "x" * 5000,
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 40,
    "digits 0 12 345 6789 1234567890123456789 3.14159 1e-9 0x1F 1,000,000",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|><|endoftext|>",
    "<s> </s> <s>hello</s> <unk> <pad>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>return 1<|endofprompt|>",
    "Ünïcödé ñ ß ﬁ ﬂ Ａ Ｂ ℌ ① ™ \u00a0nbsp \u2003em \u200bzwsp \ufeffbom",
    "I'm you're he'll we've they'd IT'S DON'T",
    "https://example.com/path?q=a+b&c=%20#frag user@example.org",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Strings drawn from a pool of awkward characters and fragments: catches regex and byte-fallback drift."""
    pool = list("abcXYZ019 \t\n\r.,'!-_<>|/\\") + ["日", "本", "😀", "é", "e\u0301", "ا", "ש", "\u00a0", "ﬁ", "  "]
    pool += ["<|endoftext|>", "</s>", "<s>", "'s", "'LL", "123", "\r\n"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def _corpus(n_docs: int, seed: int = 0) -> list[str]:
    """A few hundred KB of generated documents: prose-like words, code, numbers, unicode."""
    rng = random.Random(seed)
    syllables = ["ka", "ro", "mi", "te", "su", "na", "lo", "pe", "qu", "zi", "da", "ve", "th", "e", "in", "on"]
    extras = ["日本語", "中文", "😀", "é", "naïve", "مرحبا", "שלום", "def f(x):\n    return x\n", "\t", "\r\n", "1999"]
    docs = []
    for _ in range(n_docs):
        words = []
        for _ in range(rng.randint(10, 120)):
            r = rng.random()
            if r < 0.06:
                words.append(str(rng.randint(0, 10**6)))
            elif r < 0.12:
                words.append(rng.choice(extras))
            else:
                words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))).capitalize())
        docs.append(" ".join(words) + rng.choice([".", "!\n", "\n\n", ""]))
    return docs


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = _corpus(1000)
    assert 200_000 < sum(map(len, docs)) < 1_000_000
    return docs


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    train_tokenizer(corpus, 1000, out, kind="bpe")
    return str(out)


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("sp") / "tok.model"
    train_tokenizer(corpus, 1000, out, kind="sentencepiece", special_tokens=("<|endoftext|>", "<|fim_prefix|>"))
    return str(out)


@pytest.fixture(params=["cl100k_base", "hf", "sentencepiece"])
def spec(request, hf_path, sp_path) -> str:
    return {"cl100k_base": "cl100k_base", "hf": hf_path, "sentencepiece": sp_path}[request.param]


def _split(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    assert lengths.dtype == np.int64 and ids.ndim == 1 and int(lengths.sum()) == ids.size
    return [a.tolist() for a in np.split(ids.astype(np.int64), np.cumsum(lengths)[:-1])] if lengths.size else []


# ---------------------------------------------------------------------------------------------------------------
# gigatoken and the reference agree


@pytest.mark.parametrize("engine", ["gigatoken", "reference"])
def test_joined_texts_encode_as_the_list(spec, corpus, engine):
    """The JSON-lines extractor's one-buffer column (corpusforge/jsonl_field.py) gives the list's tokens."""
    texts = [t for t in VARIED + _random_texts(100) + corpus[:20] if t.strip() and "\ud800" not in t]
    joined = JoinedTexts(b"".join(t.encode() + SEPARATOR for t in texts), len(texts))
    tok = load_tokenizer(spec, engine=engine)
    assert _split(*tok.encode_batch(joined)) == _split(*tok.encode_batch(texts))


@pytest.mark.parametrize("threads", [False, True])
def test_gigatoken_matches_reference(spec, corpus, threads):
    giga = load_tokenizer(spec, engine="gigatoken", threads=threads)
    ref = load_tokenizer(spec, engine="reference", threads=threads)
    assert giga.backend == "gigatoken" and ref.backend in ("tiktoken", "tokenizers", "sentencepiece")
    texts = VARIED + _random_texts(300) + corpus[:50]
    got, want = _split(*giga.encode_batch(texts)), _split(*ref.encode_batch(texts))
    for text, a, b in zip(texts, got, want, strict=True):
        assert a == b, f"{spec}: {text[:60]!r}"
    # one document at a time gives the same as the batch
    assert [_split(*giga.encode_batch([t]))[0] for t in VARIED] == want[: len(VARIED)]
    assert (giga.vocab_size, giga.eod_id, giga.fingerprint) == (ref.vocab_size, ref.eod_id, ref.fingerprint)


def test_auto_picks_gigatoken(spec):
    tok = load_tokenizer(spec)
    assert tok.backend == "gigatoken" and tok.fallback_reason is None
    assert isinstance(tok, tk.Tokenizer)


@pytest.mark.parametrize("engine", ["gigatoken", "reference"])
def test_round_trip(spec, engine, corpus):
    tok = load_tokenizer(spec, engine=engine)
    texts = VARIED + corpus[:20]
    ids, lengths = tok.encode_batch(texts)
    for text, doc in zip(texts, _split(ids, lengths), strict=True):
        assert tok.decode(doc) == text
        assert tok.decode(np.array(doc, dtype=np.uint32)) == text


def test_decode_is_the_same_on_both_engines(spec, corpus):
    giga, ref = load_tokenizer(spec, engine="gigatoken"), load_tokenizer(spec, engine="reference")
    docs = _split(*giga.encode_batch(corpus[:3] + [" spaced ", "<|endoftext|>"]))
    stream = [i for doc in docs for i in doc + [giga.eod_id]]  # documents with their separator, as in a .bin
    assert giga.decode(stream) == ref.decode(stream)
    assert giga.decode([giga.eod_id, *docs[0]]) == ref.decode([giga.eod_id, *docs[0]])


@pytest.mark.parametrize("engine", ["gigatoken", "reference"])
def test_special_token_text_is_ordinary(spec, engine):
    tok = load_tokenizer(spec, engine=engine)
    texts = ["a <|endoftext|> b", "<s></s>", "<|fim_prefix|>"]
    ids, lengths = tok.encode_batch(texts)
    assert tok.eod_id is not None and tok.eod_id not in ids.tolist()
    assert [tok.decode(doc) for doc in _split(ids, lengths)] == texts


def test_cl100k_equals_tiktoken_encode_ordinary():
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = tiktoken_format._packaged_file("cl100k_base")
    enc = tiktoken.Encoding(
        "cl100k",
        pat_str=tiktoken_format._CL100K_PAT,
        mergeable_ranks=load_tiktoken_bpe(str(path), CL100K_SHA256),
        special_tokens=tiktoken_format.ENCODINGS["cl100k_base"].special_tokens,
    )
    tok = load_tokenizer("cl100k_base", engine="gigatoken")
    assert _split(*tok.encode_batch(VARIED)) == [enc.encode_ordinary(t) for t in VARIED]
    assert tok.vocab_size == enc.n_vocab == 100277 and tok.eod_id == enc.eot_token == 100257


def test_lone_surrogates_become_replacement_char(spec):
    texts = ["a\ud800b", "ok", "\udfff", "\ud83d\ude00"]  # the last is a valid pair written as two code points
    want = ["a\ufffdb", "ok", "\ufffd", "😀"]
    for engine in ("gigatoken", "reference"):
        tok = load_tokenizer(spec, engine=engine)
        assert _split(*tok.encode_batch(texts)) == _split(*tok.encode_batch(want))


# The engine in a worker process hands back its buffers without importing awkward (corpusforge/tokenizers/flat_rows.py).
# Run in a fresh interpreter: this one has long imported awkward, which switches the stand-in off.
_FRESH_ENCODE = """
import json, sys
import numpy as np
from corpusforge.tokenizers import flat_rows
from corpusforge.tokenizers import load_tokenizer
spec, texts_file, out_file, mode = sys.argv[1:]
texts = json.load(open(texts_file))
tok = load_tokenizer(spec, engine="gigatoken", threads=False)
if mode == "newer-gigatoken":  # a call that asks the stand-in for more than unflatten
    assert flat_rows.flat_rows(lambda: __import__("awkward").from_iter([[1]])) is None
    assert not flat_rows.usable() and "awkward" not in sys.modules
ids, lengths = tok.encode_batch(texts)
ids2, lengths2 = tok.encode_batch(texts[:3])  # again: gigatoken imports "awkward" afresh on every call
np.savez(out_file, ids=ids, lengths=lengths, ids2=ids2, lengths2=lengths2)
print(json.dumps({"awkward_imported": "awkward" in sys.modules, "usable": flat_rows.usable()}))
"""


@pytest.mark.parametrize("mode", ["stand-in", "newer-gigatoken"])
def test_worker_encode_without_awkward(spec, corpus, tmp_path, mode):
    texts = VARIED + _random_texts(200) + corpus[:30] + ["a\ud800b", "", "x" * 100_000]
    texts_file, out_file = tmp_path / "texts.json", tmp_path / "out.npz"
    texts_file.write_text(json.dumps(texts))
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_ENCODE, spec, str(texts_file), str(out_file), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # the stand-in never stays behind; after a failed call the real awkward does the work
    assert report == {"awkward_imported": mode == "newer-gigatoken", "usable": mode == "stand-in"}
    got = np.load(out_file)
    assert got["ids"].dtype == np.uint32 and got["lengths"].dtype == np.int64
    want = load_tokenizer(spec, engine="reference").encode_batch(texts)
    assert _split(got["ids"], got["lengths"]) == _split(*want)
    assert _split(got["ids2"], got["lengths2"]) == _split(*want)[:3]


def test_encode_batch_shapes(spec):
    tok = load_tokenizer(spec)
    ids, lengths = tok.encode_batch([])
    assert ids.size == 0 and lengths.size == 0 and lengths.dtype == np.int64
    ids, lengths = tok.encode_batch(["", "", "a"])
    assert lengths.tolist()[:2] == [0, 0] and lengths[2] >= 1 and ids.size == lengths.sum()
    assert ids.dtype.kind in "iu" and int(ids.max()) < tok.vocab_size


def test_decode_rejects_bad_ids(spec):
    tok = load_tokenizer(spec)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match="not str"):
        tok.encode_batch(["a", None])
    assert tok.decode([]) == ""


@pytest.mark.parametrize("engine", ["gigatoken", "reference"])
def test_cl100k_gap_ids_are_refused(engine):
    tok = load_tokenizer("cl100k_base", engine=engine)
    with pytest.raises(TokenizerError, match="100262"):  # cl100k_base has no token 100261..100275
        tok.decode([100262])
    assert tok.decode([100257, 15339]) == "<|endoftext|>hello"


def test_fingerprint_keys_the_tokenizer_not_the_engine(hf_path, sp_path):
    prints = {spec: load_tokenizer(spec).fingerprint for spec in ("cl100k_base", hf_path, sp_path)}
    assert len(set(prints.values())) == 3
    assert all(len(p) == 64 and int(p, 16) >= 0 for p in prints.values())
    assert load_tokenizer(None, engine="reference").fingerprint == prints["cl100k_base"]


def test_gigatoken_in_forked_worker_with_threads(spec):
    """A rayon pool used before fork has no threads in the child: threads=True there must not hang."""
    tok = load_tokenizer(spec, threads=True)
    want = _split(*tok.encode_batch(VARIED * 20))  # the pool now exists in this process
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_encode_in_child, args=(tok, VARIED * 20, results))  # inherited, not pickled
    child.start()
    try:
        got = results.get(timeout=60)
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    assert got == want


def _encode_in_child(tok, texts, results):
    results.put(_split(*tok.encode_batch(texts)))


def test_pickles_by_reloading(spec):
    tok = load_tokenizer(spec)
    copy = pickle.loads(pickle.dumps(tok))
    assert (copy.name, copy.backend, copy.fingerprint) == (tok.name, tok.backend, tok.fingerprint)
    assert _split(*copy.encode_batch(VARIED)) == _split(*tok.encode_batch(VARIED))


# ---------------------------------------------------------------------------------------------------------------
# the default, offline, hash-checked


def test_default_is_cl100k_offline(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("load_tokenizer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    tok = load_tokenizer()
    assert (tok.name, tok.backend, tok.vocab_size, tok.eod_id) == ("cl100k_base", "gigatoken", 100277, 100257)
    assert hashlib.sha256(tiktoken_format._packaged_file("cl100k_base").read_bytes()).hexdigest() == CL100K_SHA256
    assert _split(*tok.encode_batch(["hello world"])) == [[15339, 1917]]
    assert not (tmp_path / "empty-cache").exists()  # nothing written to tiktoken's cache either


def test_rank_file_by_path(tmp_path):
    copy = tmp_path / "cl100k_base.tiktoken"
    shutil.copy(tiktoken_format._packaged_file("cl100k_base"), copy)
    tok = load_tokenizer(str(copy))
    assert tok.name == str(copy) and tok.vocab_size == 100277
    assert tok.fingerprint == load_tokenizer("cl100k_base").fingerprint  # same bytes, same scheme


def test_tampered_rank_file_is_refused(tmp_path):
    data = bytearray(tiktoken_format._packaged_file("cl100k_base").read_bytes())
    data[100] ^= 1
    copy = tmp_path / "cl100k_base.tiktoken"
    copy.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match="sha256") as err:
        load_tokenizer(str(copy))
    _assert_one_line(err.value)


def test_tampered_packaged_file_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "cl100k_base.tiktoken"
    bad.write_bytes(tiktoken_format._packaged_file("cl100k_base").read_bytes()[:-10])
    monkeypatch.setattr(tiktoken_format, "_packaged_file", lambda name: bad)
    with pytest.raises(TokenizerError, match="reinstall") as err:
        load_tokenizer()
    _assert_one_line(err.value)


def test_tiktoken_cache_is_used_when_present(tmp_path, monkeypatch):
    encoding = tiktoken_format.ENCODINGS["cl100k_base"]
    monkeypatch.setattr(tiktoken_format, "_packaged_file", lambda name: None)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match=encoding.cache_name):
        load_tokenizer("cl100k_base")
    shutil.copy(_real_packaged(), tmp_path / encoding.cache_name)
    assert load_tokenizer("cl100k_base").vocab_size == 100277
    (tmp_path / encoding.cache_name).write_bytes(b"corrupt")
    with pytest.raises(TokenizerError, match="corrupt"):
        load_tokenizer("cl100k_base")


def _real_packaged():
    import importlib.util
    from pathlib import Path

    (location,) = importlib.util.find_spec("tiktoken_ext").submodule_search_locations
    return Path(location) / "data" / "cl100k_base.tiktoken"


def test_cache_dir_follows_tiktoken(monkeypatch, tmp_path):
    import tiktoken.load  # noqa: F401 - the rule mirrored here lives in tiktoken.load.read_file_cached

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "b"))
    assert tiktoken_format._tiktoken_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    assert tiktoken_format._tiktoken_cache_dir() == tmp_path / "b"
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", "")
    assert tiktoken_format._tiktoken_cache_dir() is None
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    assert tiktoken_format.ENCODINGS["o200k_base"].cache_name == hashlib.sha1(url.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# errors: one line, says what to do


def _assert_one_line(err: Exception) -> None:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text and 'File "' not in text
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)  # no chained traceback


@pytest.mark.parametrize("name", ["o200k_base", "r50k_base", "gpt2"])
def test_encoding_not_available_offline(name, monkeypatch, tmp_path):
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("network"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    encoding = tiktoken_format.ENCODINGS[tiktoken_format._ALIASES.get(name, name)]
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(name)
    message = str(err.value)
    assert f"encoding {name!r} is not available offline" in message
    assert encoding.url in message and f"--tokenizer /path/to/{encoding.name}.tiktoken" in message
    assert str(tmp_path / encoding.cache_name) in message
    _assert_one_line(err.value)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("gpt2-large", "Hub ids are never fetched"),
        ("meta-llama/Llama-2-7b-hf", "neither a known encoding name nor an existing path"),
        ("/does/not/exist/tokenizer.json", "does not exist"),
        ("/does/not/exist.model", "does not exist"),
    ],
)
def test_unknown_specs(spec, match):
    with pytest.raises(TokenizerError, match=match) as err:
        load_tokenizer(spec)
    assert "tokenizer.json" in str(err.value) and ".model" in str(err.value)
    _assert_one_line(err.value)


def test_bad_files(tmp_path):
    (tmp_path / "mine.tiktoken").write_bytes(b"YQ== 0\n")
    with pytest.raises(TokenizerError, match="name it r50k_base.tiktoken, cl100k_base.tiktoken"):
        load_tokenizer(str(tmp_path / "mine.tiktoken"))
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(TokenizerError, match="cannot tell the format"):
        load_tokenizer(str(tmp_path / "vocab.txt"))
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "junk.model").write_bytes(b"\x00\x01garbage")
    with pytest.raises(TokenizerError, match="sentencepiece") as err:
        load_tokenizer(str(tmp_path / "junk.model"))
    _assert_one_line(err.value)
    with pytest.raises(TokenizerError, match="unknown tokenizer engine"):
        load_tokenizer(engine="fast")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer.json and sentencepiece specifics


def test_hf_directory_and_eod(hf_path, tmp_path):
    shutil.copy(hf_path, tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path))
    assert tok.name == str(tmp_path / "tokenizer.json")
    assert tok.eod_id == 0 and tok.decode([0]) == "<|endoftext|>" and tok.vocab_size == 1000


def test_hf_file_settings_do_not_change_documents(hf_path, tmp_path):
    """Truncation stored in the file, and a post-processor adding BOS/EOS, must not touch documents."""
    config = json.loads(open(hf_path).read())
    config["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    config["added_tokens"].append(
        {"id": 1000, "content": "<bos>", "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
    )
    config["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1000], "tokens": ["<bos>"]}},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    plain = load_tokenizer(hf_path)
    for engine in ("gigatoken", "reference"):
        tok = load_tokenizer(str(path), engine=engine)
        assert tok.vocab_size == 1001 and tok.eod_id == 0
        assert _split(*tok.encode_batch(VARIED)) == _split(*plain.encode_batch(VARIED))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<bos>"}))
    config["added_tokens"] = config["added_tokens"][1:]  # no "<|endoftext|>" entry: the config's eos decides
    path.write_text(json.dumps(config))
    assert load_tokenizer(str(path)).eod_id == 1000


def test_hf_added_tokens(hf_path, tmp_path):
    """Non-special added tokens are vocabulary: matched in text by both engines. Where gigatoken would
    differ (single_word), the load-time probe catches it and auto falls back to the reference."""
    from tokenizers import AddedToken, Tokenizer

    for flags, backend in [({}, "gigatoken"), ({"lstrip": True}, "gigatoken"), ({"single_word": True}, "tokenizers")]:
        hf = Tokenizer.from_file(hf_path)
        hf.add_tokens([AddedToken("<tool>", **flags)])
        path = tmp_path / "tokenizer.json"
        hf.save(str(path))
        tok = load_tokenizer(str(path))
        assert tok.backend == backend, flags
        ref = load_tokenizer(str(path), engine="reference")
        texts = ["a <tool> b", "a  <tool>b", "x<tool>y", "<tool>"] + VARIED
        assert _split(*tok.encode_batch(texts)) == _split(*ref.encode_batch(texts))
        assert tok.encode_batch(["<tool>"])[0].tolist() == [1000]


def test_hf_non_bpe_falls_back_to_reference(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    path.write_text(word_level.to_str())
    tok = load_tokenizer(str(path))
    assert tok.backend == "tokenizers" and "BPE" in tok.fallback_reason
    assert _split(*tok.encode_batch(["hello world", "hello there"])) == [[1, 2], [1, 0]]
    with pytest.raises(TokenizerError, match="engine='reference'") as err:
        load_tokenizer(str(path), engine="gigatoken")
    _assert_one_line(err.value)


def test_sentencepiece_unigram_falls_back_to_reference(tmp_path, corpus):
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus[:300]), model_writer=model, model_type="unigram", vocab_size=300, minloglevel=2
    )
    path = tmp_path / "unigram.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(str(path))
    assert tok.backend == "sentencepiece" and "BPE" in tok.fallback_reason
    assert tok.eod_id == 2 and tok.vocab_size == 300
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    assert _split(*tok.encode_batch(corpus[:5])) == processor.encode(corpus[:5])
    with pytest.raises(TokenizerError, match="gigatoken cannot be used"):
        load_tokenizer(str(path), engine="gigatoken")


def test_sentencepiece_ids(sp_path):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=sp_path)
    tok = load_tokenizer(sp_path)
    assert tok.vocab_size == processor.get_piece_size() == 1000
    assert tok.eod_id == processor.eos_id() == processor.piece_to_id("<|endoftext|>")
    assert tok.decode([tok.eod_id]) == processor.decode([tok.eod_id]) == ""  # control pieces decode to nothing


def test_arrow_strings_encode_like_str_lists():
    import pyarrow as pa

    from corpusforge.tokenizers import load_tokenizer

    texts = ["héllo wörld", "def f(x):\n\treturn x", "日本語 🤖 <|endoftext|>", " "]
    for engine in ("gigatoken", "reference"):
        tok = load_tokenizer(None, engine=engine)
        want = tok.encode_batch(texts)
        for array in (pa.array(texts), pa.array(texts, pa.large_string()), pa.array(["x", *texts]).slice(1)):
            got = tok.encode_batch(array)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (engine, array.type)

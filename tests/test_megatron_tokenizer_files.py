"""megatron-preprocess on tokenizer files that are not what their flag says, and on NullTokenizer text that is not
ids: one line naming the flag, the file (or file:line) and the fix, never a library's traceback.

Every type that reads a file, every file it reads, each damaged the ways files get damaged: binary junk, text of
another kind, JSON of the wrong shape, empty, a directory, missing. The good files are real ones made here (a
byte-level BPE saved as GPT-2's vocab.json/merges.txt, a WordPiece vocab.txt, a sentencepiece model, a Megatron
tiktoken rank list, a Hugging Face tokenizer directory).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corpusforge import megatron

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(50)]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    import sentencepiece as spm
    import tokenizers
    import transformers

    d = tmp_path_factory.mktemp("good")
    out: dict[str, Path] = {}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False))  # fmt: skip
    (d / "gpt2").mkdir()
    bpe.model.save(str(d / "gpt2"))
    out["vocab.json"], out["merges.txt"] = d / "gpt2" / "vocab.json", d / "gpt2" / "merges.txt"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    fast.save_pretrained(d / "hf")
    out["hf"] = d / "hf"
    wp = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wp.train_from_iterator(TEXTS, tokenizers.trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))  # fmt: skip
    (d / "bert").mkdir()
    wp.model.save(str(d / "bert"))
    out["vocab.txt"] = d / "bert" / "vocab.txt"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_prefix=str(d / "sp"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)  # fmt: skip
    out["sp.model"] = d / "sp.model"
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the"]
    rows = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""} for i, t in enumerate(ranks)]
    (d / "tik.json").write_text(json.dumps(rows))
    out["tik.json"] = d / "tik.json"
    (d / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out["input"] = d / "in.jsonl"
    return out


# (type, flag, the good file's key, the other flags the type needs)
FILES = [
    ("GPT2BPETokenizer", "--vocab-file", "vocab.json", ["--merge-file", "merges.txt"]),
    ("GPT2BPETokenizer", "--merge-file", "merges.txt", ["--vocab-file", "vocab.json"]),
    ("BertWordPieceLowerCase", "--vocab-file", "vocab.txt", []),
    ("BertWordPieceCase", "--vocab-file", "vocab.txt", []),
    ("SentencePieceTokenizer", "--tokenizer-model", "sp.model", []),
    ("GPTSentencePieceTokenizer", "--tokenizer-model", "sp.model", []),
    ("Llama2Tokenizer", "--tokenizer-model", "sp.model", []),
    ("TikTokenizer", "--tokenizer-model", "tik.json", ["--vocab-size", "1259"]),
]
DAMAGES = {
    "binary junk": lambda p: p.write_bytes(os.urandom(2000) + b"\xff\xfe"),
    "plain text": lambda p: p.write_text("this is a README, not a tokenizer file\nsecond line\n"),
    "json of another shape": lambda p: p.write_text(json.dumps([1, 2, 3] if p.suffix != ".json" else {"x": [1]})),
    "a GPT-2 vocab.json": lambda p: p.write_text(json.dumps({"hello": 0, "world": 1})),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": None,  # the good file cut in half
    "a directory": lambda p: p.mkdir(),
    "missing": lambda p: None,
}


def _argv(good: dict[str, Path], kind: str, others: list[str], flag: str, path: Path, out: Path) -> list[str]:
    rest = [good.get(x, x) if not x.startswith("--") else x for x in others]
    return ["--input", str(good["input"]), "--output-prefix", str(out), "--tokenizer-type", kind, flag, str(path),
            *map(str, rest), "--workers", "1"]  # fmt: skip


def _damage(good: dict[str, Path], key: str, damage: str, tmp_path: Path) -> Path:
    path = tmp_path / "bad" / good[key].name
    path.parent.mkdir()
    if damage == "truncated":  # cut in the middle (inside a line: just past a space for merges.txt, "a " ends it)
        data = good[key].read_bytes()
        path.write_bytes(data[: data.index(b" ", len(data) // 2) + 1 if key == "merges.txt" else len(data) // 2])
    else:
        DAMAGES[damage](path)
    return path


def _assert_one_line(message: str, *names: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    for name in names:
        assert name in message, (name, message)
    assert "; " in message, f"no fix given: {message}"


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("kind, flag, key, others", FILES, ids=[f"{k}{f}" for k, f, _, _ in FILES])
def test_damaged_tokenizer_file_is_one_line_naming_flag_and_file(kind, flag, key, others, damage, good, tmp_path):
    path = _damage(good, key, damage, tmp_path)
    if damage == "a GPT-2 vocab.json" and key == "vocab.json":
        pytest.skip("a small GPT-2 vocab is a good vocab.json (its merges then fail, tested with the merges file)")
    if damage == "truncated" and key == "vocab.txt":
        pytest.skip("a vocab.txt cut short is a smaller WordPiece vocab: no cheap check tells (files.py says so)")
    argv = _argv(good, kind, others, flag, path, tmp_path / "out" / "o")
    with pytest.raises(megatron.MegatronTokenizerError) as e:
        megatron.run(argv)
    _assert_one_line(str(e.value), flag, str(path))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


HF_DAMAGES = {
    "tokenizer.json junk": lambda d: (d / "tokenizer.json").write_bytes(os.urandom(500)),
    "tokenizer.json not JSON": lambda d: (d / "tokenizer.json").write_text("{truncated"),
    "tokenizer.json wrong JSON": lambda d: (d / "tokenizer.json").write_text(json.dumps({"model": 3})),
    "tokenizer_config.json not JSON": lambda d: (d / "tokenizer_config.json").write_text("<html>"),
    "merges.txt junk": lambda d: (
        shutil.copyfile(d.parent / "vocab.json", d / "vocab.json"),
        (d / "merges.txt").write_bytes(b"\x00\x01\x02 \xff\n" * 10),
    ),
    "a file, not a directory": lambda d: (shutil.rmtree(d), d.write_text("x")),
    "empty directory": lambda d: [p.unlink() for p in d.iterdir()],
    "missing": lambda d: shutil.rmtree(d),
}


@pytest.mark.parametrize("damage", list(HF_DAMAGES))
def test_damaged_hugging_face_directory_is_one_line(damage, good, tmp_path):
    d = tmp_path / "copy" / "hf"
    shutil.copytree(good["hf"], d)
    shutil.copyfile(good["vocab.json"], tmp_path / "copy" / "vocab.json")
    d = tmp_path / "copy" / "hf"
    HF_DAMAGES[damage](d)
    argv = _argv(good, "HuggingFaceTokenizer", [], "--tokenizer-model", d, tmp_path / "o")
    with pytest.raises(megatron.MegatronTokenizerError) as e:
        megatron.run(argv)
    _assert_one_line(str(e.value), "--tokenizer-model", str(d))


def test_merges_of_another_vocab_name_both_files(good, tmp_path):
    (tmp_path / "merges.txt").write_text("#version: 0.2\nq z\n")
    argv = _argv(good, "GPT2BPETokenizer", ["--vocab-file", "vocab.json"], "--merge-file", tmp_path / "merges.txt",
                 tmp_path / "o")  # fmt: skip
    with pytest.raises(megatron.MegatronTokenizerError) as e:
        megatron.run(argv)
    _assert_one_line(str(e.value), "--merge-file", "line 2", str(good["vocab.json"]))


def test_tiktoken_rank_list_that_is_not_base64_or_not_bytes_first(good, tmp_path):
    rows = json.loads(good["tik.json"].read_text())
    for name, change, words in (
        ("notb64.json", lambda r: r[258].update(token_bytes="not base64!"), "not base64"),
        ("order.json", lambda r: r[5].update(rank=6), "entry 5 has rank 6"),
        ("bytes.json", lambda r: r[7].update(token_bytes=base64.b64encode(b"ab").decode()), "single bytes"),
        ("keys.json", lambda r: r[3].pop("token_str"), "entry 3 is not"),
    ):
        bad = json.loads(json.dumps(rows))
        change(bad)
        (tmp_path / name).write_text(json.dumps(bad))
        argv = _argv(good, "TikTokenizer", ["--vocab-size", "1259"], "--tokenizer-model", tmp_path / name,
                     tmp_path / "o")  # fmt: skip
        with pytest.raises(megatron.MegatronTokenizerError, match=words) as e:
            megatron.run(argv)
        _assert_one_line(str(e.value), "--tokenizer-model", str(tmp_path / name))


def test_cli_prints_one_line_and_exits_1(good, tmp_path):
    """Through the command: `corpusforge: error: --merge-file PATH: ...; fix`, exit 1, and the output directory
    holds nothing Megatron would not write."""
    bad = tmp_path / "merges.txt"
    bad.write_bytes(os.urandom(3000))
    argv = _argv(good, "GPT2BPETokenizer", ["--vocab-file", "vocab.json"], "--merge-file", bad, tmp_path / "o")
    r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", *argv], capture_output=True,
                       text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("corpusforge: error: --merge-file ") and str(bad) in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merges.txt"]


# ---------------------------------------------------------------------------------------------------------------
# NullTokenizer: the text is the ids; a text that is not is reported where it is


NULL_FAULTS = {
    "a word": ("1 2 three 4", "'three' is not an integer"),
    "a float": ("1 2.5", "'2.5' is not an integer"),
    "a double space": ("1  2", "'' is an empty text or a double space"),
    "an empty text": ("", "'' is an empty text"),
    "a tab": ("1\t2", "not an integer"),
    "an id past uint16": ("1 70000", "id 70000 does not fit"),
    "a negative id": ("-1 2", "id -1 does not fit"),
}


@pytest.mark.parametrize("compress", ["", ".gz"])
@pytest.mark.parametrize("fault", list(NULL_FAULTS))
def test_null_tokenizer_text_that_is_not_ids_names_file_line_and_fix(fault, compress, tmp_path):
    """The faulty record sits on line 57 (after a bad JSON line that --on-bad-line skip passes over) of the second
    of two inputs, in the second key: the error names that file and line, the key, the word and the fix."""
    text, words = NULL_FAULTS[fault]
    ok = [json.dumps({"text": f"{i} {i + 1}", "title": str(i)}) for i in range(60)]
    second = ok[:55] + ["{not json"] + [json.dumps({"text": "5 6", "title": text})] + ok[55:]
    (tmp_path / "a.jsonl").write_text("\n".join(ok) + "\n")
    path = tmp_path / f"b.jsonl{compress}"
    data = ("\n".join(second) + "\n").encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    argv = ["--input", str(tmp_path / "*.jsonl*"), "--partitions", "2", "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--json-keys", "text", "title",
            "--on-bad-line", "skip", "--workers", "1"]  # fmt: skip
    with pytest.raises(megatron.MegatronTokenizerError) as e:
        megatron.run(argv)
    message = str(e.value)
    _assert_one_line(message, f"{path}:57: 'title'", words, "NullTokenizer reads token ids")
    assert not list(tmp_path.glob("o_*"))


def test_null_tokenizer_fault_through_the_cli(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2"}\n{"text": "3 x"}\n')
    r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", "--input", str(tmp_path / "ids.jsonl"),
                        "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        "100"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"corpusforge: error: {tmp_path}/ids.jsonl:2: 'text' is not NullTokenizer input ('x' is not an integer); "
        'NullTokenizer reads token ids, as Megatron\'s: write them as "12 7 99" (single spaces), or pick a '
        "--tokenizer-type that reads text"
    ]

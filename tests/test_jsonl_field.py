"""The compiled JSON-lines field extractor: the texts orjson gives for every line it accepts, and a refusal (the
exact path) for every line orjson rejects or the exact path reports."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from corpusforge import jsonl_field, sources
from corpusforge.jsonl_field import JoinedTexts, extract_field
from corpusforge.sources import Task, _split_lines, read_task, text_list

GOOD = [
    '{"text": "plain ascii"}',
    '{"id": 7, "text": "after another key", "meta": {"a": [1, 2.5, -3e10, true, false, null, {"b": []}]}}',
    '{"text":"no spaces","n":0}',
    ' \t{ "text" : "spaces everywhere" , "x" : [ ] } \t',
    '{"text": "escapes \\" \\\\ \\/ \\b \\f \\n \\r \\t end"}',
    '{"text": "caf\\u00e9 \\u4e2d\\u6587 \\ud83d\\ude00 \\u0000 nul"}',
    '{"text": "raw utf-8: café 中文 😀 Ωμέγα"}',
    '{"text": "def f(x):\\n    return {\\"a\\": x}\\n"}',
    '{"text": " leading and trailing spaces  "}',
    '{"text": "\\u00a0nbsp then text"}',
    '{"text": "x", "n": 18446744073709551616, "f": 1.5e-30, "g": -0.0, "h": 1E+99}',
    '{"a": {"text": "nested is not the field"}, "text": "top"}',
    '{"texts": "a longer key", "text": "the field", "tex": "a shorter one"}',
    '{"text": "del \x7f is allowed"}',
    '{"text": "' + "long " * 4000 + '"}',
    '{"text": "crlf line"}\r',
]

BAD = [
    '{"text": "a",}',  # trailing comma
    '{"text": "a"} x',  # something after the object
    '{"text": NaN}',
    '{"text": "a", "n": 01}',
    '{"text": "a", "n": 1.}',
    '{"text": "a", "n": .5}',
    '{"text": "a", "n": +1}',
    '{"text": "a", "n": 1e999}',
    "{'text': 'single quotes'}",
    '{"text": "unterminated}',
    '{"text": "tab\there"}',  # a raw control character in a string
    '{"text": "\\ud800 lone high"}',
    '{"text": "\\udc00 lone low"}',
    '{"text": "\\ud800\\u0041 bad pair"}',
    '{"text": "\\x41 unknown escape"}',
    '{"text": "\\u12 short"}',
    '{"txt": "missing key"}',
    '{"text": 3}',
    '{"text": null}',
    '{"text": ["a"]}',
    '{"text": {"a": 1}}',
    '{"text": ""}',
    '{"text": " \\n\\t "}',
    '{"text": "\\u00a0\\u3000\\u2028"}',
    '{"text": "\\u001c\\u001f"}',
    '{"text": "first", "text": "second"}',  # orjson keeps the last
    '{"te\\u0078t": "escaped key", "text": "plain"}',
    '["text", "an array"]',
    '"text"',
    "{}",
    "\ufeff" + '{"text": "byte order mark"}',
    '{"text": "a", "deep": ' + "[" * 65 + "]" * 65 + "}",
    '{"text": "a" "b"}',
    '{"text" "a"}',
    '{"text": "a", "x": tru}',
]

BAD_BYTES = [
    b'{"text": "overlong \xc0\xaf"}',
    b'{"text": "encoded surrogate \xed\xa0\x80"}',
    b'{"text": "truncated \xe4\xb8"}',
    b'{"text": "stray continuation \x80"}',
    b'{"text": "ff byte \xff"}',
    b'{"text": "above U+10FFFF \xf4\x90\x80\x80"}',
]


def block(lines: list[str | bytes]) -> bytes:
    return b"".join((ln.encode() if isinstance(ln, str) else ln) + b"\n" for ln in lines)


def test_the_extension_is_built():
    assert jsonl_field.available(), "pip install builds corpusforge/_jsonl_field.c; the exact path would serve all"


def test_good_lines_give_orjsons_texts_and_line_count():
    lines = GOOD + ["", "   ", *GOOD]  # blank lines hold no record
    data = block(lines)
    docs, count, texts = extract_field(data, "text")
    expected = [orjson.loads(ln)["text"] for ln in lines if ln.strip()]
    assert docs == len(expected) and texts.to_pylist() == expected
    assert count == len(_split_lines(data)) == len(lines)
    assert extract_field(data[:-1], "text")[1] == len(lines)  # no final newline: the last line still counts


@pytest.mark.parametrize("line", BAD + BAD_BYTES, ids=range(len(BAD + BAD_BYTES)))
def test_each_bad_line_sends_its_block_to_the_exact_path(line):
    assert extract_field(block([GOOD[0], line, GOOD[1]]), "text") is None


def test_field_names_with_a_quote_or_backslash_take_the_exact_path():
    data = block(['{"a b": "x", "c": "y"}'])
    assert extract_field(data, "a b")[2].to_pylist() == ["x"]
    assert extract_field(data, 'q"') is None and extract_field(data, "q\\") is None


def _random_string(rng: random.Random) -> str:
    alphabet = 'ab \n\t"\\/é中😀\u00a0\u2028\x00\x1f\x7f{}[],:'
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return _random_string(rng)
    if kind == 1:
        return rng.choice([0, -1, 3.25, 1e300, -2.5e-8, 2**64, 10**30])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.randrange(-(10**6), 10**6)
    if kind == 4:
        return ""
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _mutate(rng: random.Random, line: bytes) -> bytes:
    """Damage a line the way broken producers do: drop, repeat or replace a byte, or cut it short."""
    i = rng.randrange(len(line))
    match rng.randrange(4):
        case 0:
            return line[:i] + line[i + 1 :]
        case 1:
            return line[:i] + line[i : i + 1] * 2 + line[i + 1 :]
        case 2:
            return line[:i] + bytes([rng.choice(b'"\\{}[],:0eE.-+ \t\x00\x80\xc3\xed\xff')]) + line[i + 1 :]
        case _:
            return line[:i]


def test_random_and_damaged_lines_are_accepted_only_as_orjson_reads_them():
    """Whatever the extractor accepts, orjson parses to an object whose "text" is the same non-blank string."""
    rng = random.Random(1234)
    accepted = declined = 0
    for _ in range(10000):
        record = {_random_string(rng): _random_value(rng) for _ in range(rng.randrange(3))}
        if rng.random() < 0.8:
            record["text"] = _random_string(rng) or "x"
        line = json.dumps(record, ensure_ascii=rng.random() < 0.5).encode()
        if rng.random() < 0.5:
            line = _mutate(rng, line)
        if b"\n" in line:
            continue
        found = extract_field(line + b"\n", "text")
        if found is None:
            declined += 1
            continue
        if found[0] == 0:  # a blank line: no record, as the exact path reads it
            assert not line.strip(b" \t\r"), line
            continue
        accepted += 1
        parsed = orjson.loads(line)
        assert type(parsed) is dict and type(parsed["text"]) is str and not parsed["text"].isspace(), line
        assert found[2].to_pylist() == [parsed["text"]], line
    assert accepted > 1500 and declined > 1500  # both sides exercised


def test_read_task_gives_the_same_texts_with_and_without_the_extractor(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl"
    path.write_bytes(block(GOOD * 50))
    task = Task(0, str(path), "jsonl", 0, path.stat().st_size)
    fast = [(text_list(b.texts[0]), b.records) for b in read_task(task, ("text",))]
    assert isinstance(next(read_task(task, ("text",))).texts[0], JoinedTexts)
    monkeypatch.setattr(sources, "extract_field", lambda block, key: None)
    exact = [(text_list(b.texts[0]), b.records) for b in read_task(task, ("text",))]
    assert fast == exact

"""corpusforge.sources: every input format yields the same documents; tasks cover inputs exactly; bad records are
reported as file:line, or skipped and counted."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from corpusforge import sources
from corpusforge.sources import BadRecordError, InputError, expand_inputs, plan_tasks, read_task, text_list

DOCS = [f"document {i}: " + "héllo wörld 日本 " * (i % 7) + "\n\tend" for i in range(300)]


def write_jsonl(path, docs=DOCS, key="text"):
    path.write_bytes(b"".join(json.dumps({key: d, "id": i}).encode() + b"\n" for i, d in enumerate(docs)))
    return path


def read_all(paths, keys=("text",), on_bad="fail", task_bytes=64 << 20):
    texts, bad = [], {}
    for task in plan_tasks(expand_inputs(paths), task_bytes):
        for batch in read_task(task, keys, on_bad):
            texts += text_list(batch.texts[0])
            for k, n in batch.bad.items():
                bad[k] = bad.get(k, 0) + n
    return texts, bad


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny read blocks, so lines straddle block boundaries."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 97)


def test_every_format_reads_the_same_documents(tmp_path, small_blocks):
    raw = write_jsonl(tmp_path / "a.jsonl").read_bytes()
    (tmp_path / "b.json").write_bytes(raw)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "e.parquet", row_group_size=50)
    for name in ("a.jsonl", "b.json", "c.jsonl.gz", "d.jsonl.zst", "e.parquet"):
        assert read_all([tmp_path / name]) == (DOCS, {}), name


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(tmp_path / "hf")
    tasks = plan_tasks(expand_inputs([tmp_path / "hf"]), task_bytes=2000)
    assert len(tasks) > 1
    texts = [t for task in tasks for b in read_task(task, ("text",)) for t in text_list(b.texts[0])]
    assert texts == DOCS


def test_directory_and_glob_expand_sorted(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "z.parquet").write_bytes(b"")
    assert [p.name for p in expand_inputs([tmp_path])] == ["a.jsonl", "b.jsonl", "z.parquet"]
    assert [p.name for p in expand_inputs([str(tmp_path / "*.jsonl")])] == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize(
    "item, message",
    [("missing.jsonl", "no such file or directory"), ("notes.txt", "unsupported input"), ("*.xyz", "matches no")],
)
def test_unusable_inputs_are_refused(tmp_path, item, message):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match=message):
        expand_inputs([str(tmp_path / item)])


def test_byte_range_tasks_cover_the_file_exactly_and_align_to_lines(tmp_path, small_blocks):
    path = write_jsonl(tmp_path / "a.jsonl")
    tasks = plan_tasks([path], task_bytes=1000)
    assert len(tasks) > 5
    assert tasks[0].start == 0 and tasks[-1].stop == path.stat().st_size
    data = path.read_bytes()
    for a, b in zip(tasks, tasks[1:]):
        assert a.stop == b.start and data[b.start - 1 : b.start] == b"\n"
    assert read_all([path], task_bytes=1000) == (DOCS, {})


@pytest.mark.parametrize("taper", [1, 3, 50])
def test_tapered_tasks_get_smaller_at_the_end_and_cover_the_file(tmp_path, monkeypatch, taper):
    monkeypatch.setattr(sources, "TAPER_MIN_BYTES", 0)
    path = write_jsonl(tmp_path / "a.jsonl")
    plain, tapered = plan_tasks([path], task_bytes=2000), plan_tasks([path], task_bytes=2000, taper=taper)
    assert len(tapered) > len(plain) and [t.index for t in tapered] == list(range(len(tapered)))
    assert tapered[-1].size < plain[-1].size / 2
    assert (tapered[0] == plain[0]) == (taper < len(plain))  # only the last `taper` tasks are cut
    data = path.read_bytes()
    assert tapered[0].start == 0 and tapered[-1].stop == len(data)
    for a, b in zip(tapered, tapered[1:]):
        assert a.stop == b.start and data[b.start - 1 : b.start] == b"\n" and a.size == a.stop - a.start
    texts = [t for task in tapered for batch in read_task(task, ("text",)) for t in text_list(batch.texts[0])]
    assert texts == DOCS


BAD_LINES = [
    (b'{"text": "ok"', "malformed_json", "malformed JSON"),
    (b'{"text": "caf\xe9"}', "invalid_utf8", "invalid UTF-8"),
    (b'{"body": "no text key"}', "missing_key", "no key 'text'"),
    (b'{"text": 42}', "not_string", "'text' is int, not a string"),
    (b'{"text": null}', "not_string", "is null"),
    (b'{"text": "   "}', "empty", "empty document"),
    (b"[1, 2]", "malformed_json", "expected a JSON object"),
]


@pytest.mark.parametrize("line, kind, message", BAD_LINES)
def test_bad_line_fails_with_file_and_line(tmp_path, line, kind, message):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": f"doc {i}"}).encode() for i in range(200)]
    path.write_bytes(b"\n".join(good[:150] + [line] + good[150:]) + b"\n")
    # Small tasks: the bad line sits in a later task, so its line number must count from the file's start.
    with pytest.raises(BadRecordError) as err:
        read_all([path], task_bytes=500)
    assert str(err.value).startswith(f"{path}:151: ")
    assert message in str(err.value) and "--on-bad-line skip" in str(err.value)
    texts, bad = read_all([path], on_bad="skip", task_bytes=500)
    assert bad == {kind: 1} and len(texts) == 200


def test_blank_lines_are_not_records(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a"}\r\n\n   \n{"text": "b"}')  # CRLF, blank lines, no final newline
    assert read_all([path]) == (["a", "b"], {})


def test_multiple_keys_stay_aligned_when_a_record_is_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"text": "t0", "title": "h0"}, {"text": "t1"}, {"text": "t2", "title": "h2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task,) = plan_tasks([path])
    (batch,) = list(read_task(task, ("text", "title"), "skip"))
    assert [text_list(c) for c in batch.texts] == [["t0", "t2"], ["h0", "h2"]] and batch.bad == {"missing_key": 1}


def test_parquet_nulls_empties_and_wrong_types(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["a", None, "", "d"], "n": [1, 2, 3, 4]}), path)
    with pytest.raises(BadRecordError, match=r"a.parquet:row 2: 'text' is null"):
        read_all([path])
    assert read_all([path], on_bad="skip") == (["a", "d"], {"not_string": 1, "empty": 1})
    with pytest.raises(BadRecordError, match=r"row 1: 'n' is int64, not a string"):
        read_all([path], keys=("n",))
    (task,) = plan_tasks([path])
    with pytest.raises(InputError, match="no column 'body'"):
        list(read_task(task, ("body",)))


def test_corrupt_compressed_file_is_one_clear_error(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "x"}\n' * 1000)[:-30])
    with pytest.raises(InputError, match="cannot decompress"):
        read_all([path])

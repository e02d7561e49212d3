"""corpusforge.sources: every input format yields the same documents; tasks cover inputs exactly; bad records are
reported as file:line, or skipped and counted."""

import gzip
import json
import os

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


@pytest.mark.parametrize("files", [1, 3])
@pytest.mark.parametrize("taper", [1, 2, 4])
def test_tapered_tail_shrinks_geometrically_to_the_floor(tmp_path, monkeypatch, taper, files):
    """The work left when the other workers run out is at most one floor-sized piece, whatever the task size: a
    worker sharing its core with another job then holds the run up by a crumb, not by half a big task."""
    floor = 600
    monkeypatch.setattr(sources, "TAPER_MIN_BYTES", floor)
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", DOCS[i::files]) for i in range(files)]
    tasks = plan_tasks(paths, task_bytes=8000, taper=taper)
    plain = plan_tasks(paths, task_bytes=8000)
    tail = [t for t in tasks if (t.path, t.start) >= (plain[-taper].path, plain[-taper].start)]
    assert tasks[: len(tasks) - len(tail)] == plain[: len(plain) - taper]  # only the tail is cut
    sizes = [t.size for t in tail if t.path == tail[-1].path]  # the last file's pieces
    assert all(b <= a + 200 for a, b in zip(sizes, sizes[1:]))  # shrinking (a line is ~60-200 bytes)
    assert sizes[-1] < 2 * floor + 200 and len(tail) > taper
    for path in paths:  # still whole lines, covering every file exactly
        mine = [t for t in tasks if t.path == str(path)]
        assert mine[0].start == 0 and mine[-1].stop == path.stat().st_size
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
    texts = [t for task in tasks for batch in read_task(task, ("text",)) for t in text_list(batch.texts[0])]
    assert texts == [d for i in range(files) for d in DOCS[i::files]]


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


LINES = [json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(DOCS)]
HALF = len(LINES) // 2


def _skippable_frame(payload: bytes) -> bytes:
    """A zstd skippable frame (RFC 8878 3.1.2), as pzstd writes before each frame: readers must pass over it."""
    return (0x184D2A50).to_bytes(4, "little") + len(payload).to_bytes(4, "little") + payload


def _zst(lines) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=True).compress(b"".join(lines))


def _compressed(kind: str) -> tuple[bytes, int]:
    """(a file of every LINE, the byte offset where its second frame or member begins; 0 if it has one)."""
    if kind == "gz":
        return gzip.compress(b"".join(LINES)), 0
    if kind == "gz-2-members":
        first = gzip.compress(b"".join(LINES[:HALF]))
        return first + gzip.compress(b"".join(LINES[HALF:])), len(first)
    if kind == "zst":
        return _zst(LINES), 0
    first = _zst(LINES[:HALF]) + _skippable_frame(b"pzstd index")
    return first + _zst(LINES[HALF:]), len(first)


def _read_file(path, on_bad="fail"):
    return read_all([path], on_bad=on_bad)


@pytest.mark.parametrize("kind", ["gz", "gz-2-members", "zst", "zst-2-frames"])
def test_multi_member_and_multi_frame_files_read_whole(tmp_path, small_blocks, kind):
    data, _ = _compressed(kind)
    path = tmp_path / f"a.jsonl.{kind[:3].rstrip('-')}"
    path.write_bytes(data)
    assert _read_file(path) == (DOCS, {})


# Where a file can be cut: inside the first header, inside the data, in the last bytes (gzip's CRC and size,
# zstd's checksum), and, for two-frame files, inside the second frame's header or data.
CUTS = {
    "header": lambda size, second: 3,
    "data": lambda size, second: size // 3,
    "last-byte": lambda size, second: size - 1,
    "second-header": lambda size, second: second + 3,
    "second-data": lambda size, second: second + (size - second) // 2,
}


@pytest.mark.parametrize("on_bad", ["fail", "skip"])
@pytest.mark.parametrize(
    "kind, cut",
    [(k, c) for k in ("gz", "zst") for c in ("header", "data", "last-byte")]
    + [(k, c) for k in ("gz-2-members", "zst-2-frames") for c in CUTS],
)
def test_a_truncated_compressed_file_is_an_error_whatever_on_bad_line(tmp_path, small_blocks, kind, cut, on_bad):
    # Skipping is for bad records; the records a truncated file lost are not there to count, so it always fails.
    data, second = _compressed(kind)
    path = tmp_path / f"a.jsonl.{kind[:3].rstrip('-')}"
    path.write_bytes(data[: CUTS[cut](len(data), second)])
    with pytest.raises(InputError) as err:
        _read_file(path, on_bad)
    message = str(err.value)
    assert message.startswith(f"{path}: truncated ") and "re-download or re-compress" in message
    assert "\n" not in message


@pytest.mark.parametrize("kind", ["gz-2-members", "zst-2-frames"])
def test_a_file_cut_between_frames_is_a_valid_shorter_file(tmp_path, kind):
    # A cut exactly at a frame (or gzip member) boundary leaves a complete file of the first frames: nothing in
    # it says more was meant to follow (zstd -t and gzip -t accept it too), so it reads as that shorter file.
    data, second = _compressed(kind)
    path = tmp_path / f"a.jsonl.{kind[:3].rstrip('-')}"
    path.write_bytes(data[:second])
    assert _read_file(path) == (DOCS[:HALF], {})


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_a_corrupt_compressed_file_is_one_clear_error(tmp_path, kind):
    data = bytearray(_compressed(kind)[0])
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    path = tmp_path / f"a.jsonl.{kind}"
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"^{path}: corrupt (gzip|zstd) stream .*; re-download or re-compress"):
        _read_file(path, "skip")


def test_an_input_named_twice_is_read_once_and_reported(tmp_path):
    (tmp_path / "d").mkdir()
    a = write_jsonl(tmp_path / "d" / "a.jsonl")
    b = write_jsonl(tmp_path / "d" / "b.jsonl")
    (tmp_path / "link.jsonl").symlink_to(a)
    os.link(b, tmp_path / "hard.jsonl")
    found = sources.find_inputs(
        [a, str(a), tmp_path / "d", tmp_path / "link.jsonl", str(tmp_path / "d" / "*.jsonl"), tmp_path / "hard.jsonl"]
    )
    assert found.files == [a, b]
    assert [(str(again), str(first)) for again, first in found.repeated] == [
        (str(a), str(a)),  # the same path
        (str(a), str(a)),  # the directory holds it
        (str(tmp_path / "link.jsonl"), str(a)),  # a symlink
        (str(a), str(a)),  # the glob matches both
        (str(b), str(b)),
        (str(tmp_path / "hard.jsonl"), str(b)),  # a hard link
    ]
    assert expand_inputs([a, a]) == [a]


def test_a_damaged_parquet_page_is_one_clear_error(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"doc {i} " * 50 for i in range(3000)]}), path, row_group_size=1000)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 200] = b"\0" * 200  # inside a data page; the footer is intact
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"^{path}: a damaged parquet file \(pyarrow: .*\); re-download"):
        _read_file(path, "skip")


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from /proc")
def test_reading_a_task_keeps_only_the_current_block_mapped(tmp_path, monkeypatch):
    """A worker's RSS must not grow with its task: each consumed block's pages are unmapped (they stay cached)."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 1 << 20)
    doc = "x" * 2000
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": f"{i} {doc}"}).encode() + b"\n" for i in range(12_000)))  # 24 MB
    path.read_bytes()  # in the page cache, so mapping it costs no I/O
    (task,) = plan_tasks([path], task_bytes=64 << 20)
    before, peak, count = _rss_file_kb(), 0, 0
    for batch in read_task(task, ("text",)):
        count += len(batch.texts[0])
        peak = max(peak, _rss_file_kb() - before)
    assert count == 12_000
    assert peak < 12 << 10, f"RssFile grew by {peak} KB reading a 24 MB task in 1 MB blocks"  # 23 MB before


HF_DAMAGE = {
    "shard cut in half": lambda d, shard: os.truncate(shard, os.path.getsize(shard) // 2),
    "shard cut in its schema": lambda d, shard: os.truncate(shard, 100),
    "shard of junk": lambda d, shard: shard.write_bytes(os.urandom(shard.stat().st_size)),
    "shard missing": lambda d, shard: shard.unlink(),
    "state.json garbled": lambda d, shard: (d / "state.json").write_text("{not json"),
    "dataset_info.json missing": lambda d, shard: (d / "dataset_info.json").unlink(),
}


@pytest.mark.parametrize("damage", sorted(HF_DAMAGE))
def test_a_damaged_hf_dataset_is_one_line_naming_the_directory(tmp_path, damage):
    """Every way a save_to_disk directory can be cut or garbled gives preprocess one line naming it and the fix, exit
    1, no traceback. (Bytes changed inside a record's text cannot be seen: Arrow keeps no checksum.)"""
    import subprocess
    import sys

    datasets = pytest.importorskip("datasets")
    hf = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": [d * 20 for d in DOCS] * 4}).save_to_disk(hf)
    HF_DAMAGE[damage](hf, next(hf.glob("*.arrow")))
    proc = subprocess.run(
        [sys.executable, "-m", "corpusforge.cli", "preprocess", str(hf), "--output-prefix", str(tmp_path / "o" / "p")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"corpusforge: error: {hf}: "), proc.stderr
    assert "save_to_disk" in lines[0]
    assert not (tmp_path / "o" / "p_text_document.idx").exists()

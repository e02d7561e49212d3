"""Texts extracted ahead (sources.prefetch_blocks, while preprocess loads the tokenizer) are read exactly as if they
were extracted by the worker: the same batches and counts, bad records reported the same way, only whole tasks
taken, nothing kept once the run ends; and a run that used them writes the same bytes as one that did not."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from corpusforge import jsonl_field, sources
from corpusforge import preprocess as pp
from corpusforge.sources import BadRecordError, plan_tasks, prefetch_blocks, read_task

pytestmark = pytest.mark.skipif(
    not hasattr(jsonl_field._jsonl_field, "extract_blocks"), reason="the compiled extractor is not built (pip install)"
)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 2 KiB, so that a task of a few KiB has several; nothing extracted ahead is left for other tests."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 2048)
    sources.drop_prefetched()
    yield
    sources.drop_prefetched()


def write_jsonl(path: Path, n: int, bad_at: int | None = None) -> Path:
    lines = [json.dumps({"id": i, "text": f"document {i} " + "words and more words " * (i % 17)}) for i in range(n)]
    if bad_at is not None:
        lines[bad_at] = '{"id": 1, "text": "no end'
    path.write_text("".join(line + "\n" for line in lines))
    return path


def batches(task, on_bad="fail") -> list[tuple]:
    out = []
    for b in read_task(task, ("text",), on_bad):
        texts = b.texts[0]
        data = texts.data if isinstance(texts, jsonl_field.JoinedTexts) else "\n".join(texts).encode()
        out.append((data, len(texts), b.input_bytes, b.records, b.file_bytes, dict(b.bad), b.first_bad))
    return out


def test_tasks_read_from_what_was_extracted_ahead_give_the_same_batches(tmp_path):
    tasks = plan_tasks([write_jsonl(tmp_path / "c.jsonl", 400)], task_bytes=8 << 10)
    assert len(tasks) > 3
    expected = [batches(t) for t in tasks]
    assert prefetch_blocks(tasks, "text", bytearray(1)) == sum(t.stop - t.start for t in tasks)
    assert sorted(sources._prefetched) == [t.index for t in tasks]
    for task, want in zip(tasks, expected):
        assert batches(task) == want
        assert task.index not in sources._prefetched  # taken: its memory goes with the batches
    assert not sources._prefetched


def test_a_bad_record_in_a_task_extracted_ahead_is_reported_as_before(tmp_path):
    tasks = plan_tasks([write_jsonl(tmp_path / "c.jsonl", 300, bad_at=123)], task_bytes=8 << 10)
    with pytest.raises(BadRecordError) as direct:
        [batches(t) for t in tasks]
    skipped = [batches(t, "skip") for t in tasks]
    prefetch_blocks(tasks, "text", bytearray(1))
    with pytest.raises(BadRecordError) as ahead:
        [batches(t) for t in tasks]
    assert str(ahead.value) == str(direct.value) and ":124:" in str(ahead.value)
    prefetch_blocks(tasks, "text", bytearray(1))
    assert [batches(t, "skip") for t in tasks] == skipped


def test_only_whole_tasks_are_extracted_ahead_and_a_set_stop_extracts_nothing(tmp_path):
    tasks = plan_tasks([write_jsonl(tmp_path / "c.jsonl", 400)], task_bytes=8 << 10)
    first = tasks[0].stop - tasks[0].start
    assert prefetch_blocks(tasks, "text", bytearray(1), budget=first + 1) == first  # the second task would not fit
    assert sorted(sources._prefetched) == [0]
    sources.drop_prefetched()
    assert prefetch_blocks(tasks, "text", bytearray(b"\x01")) == 0 and not sources._prefetched


def test_a_worker_taking_a_task_forgets_the_earlier_tasks_another_worker_took(tmp_path):
    tasks = plan_tasks([write_jsonl(tmp_path / "c.jsonl", 400)], task_bytes=8 << 10)
    prefetch_blocks(tasks, "text", bytearray(1))
    batches(tasks[2])
    assert sorted(sources._prefetched) == [t.index for t in tasks[3:]]


def test_a_key_other_than_the_one_extracted_ahead_is_read_from_the_file(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"t{i}", "title": f"title {i}"}) + "\n" for i in range(50)))
    task = plan_tasks([src], task_bytes=1 << 20)[0]
    prefetch_blocks([task], "text", bytearray(1))
    titles = [b.texts[0] for b in read_task(task, ("title",))]
    assert b"".join(t.data for t in titles).split(b"\xff")[:2] == [b"title 0", b"title 1"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_that_extracted_ahead_writes_what_a_run_that_did_not_writes(tmp_path, monkeypatch, workers):
    src = write_jsonl(tmp_path / "c.jsonl", 3000)
    used = []
    real = sources.prefetch_blocks

    def counted(*args, **kwargs):
        used.append(real(*args, **kwargs))
        return used[-1]

    extracted_again = []
    real_extract = sources.extract_field

    def extract_field(*args):
        extracted_again.append(1)
        return real_extract(*args)

    monkeypatch.setattr(sources, "prefetch_blocks", counted)
    monkeypatch.setattr(sources, "extract_field", extract_field)  # counted in this process only
    monkeypatch.setattr(pp, "_tokenizer_cache", {})  # extraction ahead stops when the load ends: make it load
    cfg = pp.PreprocessConfig(inputs=(str(src),), output_prefix=str(tmp_path / "ahead"), workers=workers,
                              task_bytes=64 << 10)  # fmt: skip
    ahead = pp.preprocess(cfg)
    assert ahead.tasks > 4
    assert used and used[0] == src.stat().st_size and not sources._prefetched
    if workers == 1:  # the tasks ran in this process: every block was taken, none extracted again
        assert not extracted_again
    monkeypatch.setattr(sources, "prefetch_blocks", lambda *a, **k: 0)
    plain = pp.preprocess(replace(cfg, output_prefix=str(tmp_path / "plain")))
    assert (ahead.documents, ahead.tokens, ahead.records) == (plain.documents, plain.tokens, plain.records)
    for suffix in ("bin", "idx"):
        assert (
            Path(f"{tmp_path}/ahead_text_document.{suffix}").read_bytes()
            == Path(f"{tmp_path}/plain_text_document.{suffix}").read_bytes()
        )

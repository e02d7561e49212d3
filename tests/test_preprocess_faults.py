"""corpusforge.preprocess under faults: a kill at every point of the commit (the renames that give the outputs their
final names) resumes to byte-identical output and never shows a reader a torn pair; a failed run leaves only what
a rerun can use; truncated, empty and repeated inputs are said, not silently read; output paths are created or
refused in one line.

Most tests call the library in this process (a CLI run costs ~3 s here, mostly imports); the kill points run in a
forked child, which inherits the loaded tokenizer and dies with os._exit, as SIGKILL would leave it."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from corpusforge import preprocess as pp
from corpusforge.indexed import IndexedDataset, bin_path, idx_path
from corpusforge.preprocess import PreprocessConfig, PreprocessError, preprocess
from corpusforge.sources import BadRecordError, InputError

CLI = [sys.executable, "-m", "corpusforge.cli"]
KILLED = 137


def write_jsonl(path: Path, n: int, start: int = 0, **extra) -> Path:
    lines = [json.dumps({"text": f"document {i} " + "words " * (i % 13), "title": f"title {i}"}) for i in range(n)]
    path.write_text("".join(line + "\n" for line in lines[start:]))
    return path


def config(src, prefix, keys=("text",), task_bytes=0, **kw) -> PreprocessConfig:
    inputs = tuple(map(str, src)) if isinstance(src, (list, tuple)) else (str(src),)
    return PreprocessConfig(
        inputs=inputs, output_prefix=str(prefix), json_keys=keys, workers=1, task_bytes=task_bytes, **kw
    )


def pair(prefix) -> tuple[bytes | None, bytes | None]:
    return tuple(p.read_bytes() if p.is_file() else None for p in (bin_path(prefix), idx_path(prefix)))


def leftovers(directory: Path) -> list[str]:
    """What a finished run must not leave: parts, temporaries."""
    return sorted(p.name for p in directory.iterdir() if ".parts" in p.name or p.name.endswith(".tmp"))


# ---------------------------------------------------------------------------------------------------------------
# class 3: a kill at every point of the commit


def run_killed_at(cfg: PreprocessConfig, n: int) -> int:
    """Run `cfg` in a forked child that dies just before its nth file-system change from the moment the parts are
    all written (renames and unlinks of files, the removal of the parts directory). Returns the child's exit
    status: KILLED, or, when it was not killed, the number of changes it made."""
    pid = os.fork()
    if pid == 0:  # the child: nothing here returns
        try:
            changes, armed = [0], [False]

            def hook(module, name):
                real = getattr(module, name)

                def counted(*args, **kwargs):
                    if not armed[0]:
                        return real(*args, **kwargs)
                    changes[0] += 1
                    if changes[0] == n:
                        os._exit(KILLED)
                    armed[0] = name != "rmtree"  # one change: not each file rmtree unlinks on its way
                    try:
                        return real(*args, **kwargs)
                    finally:
                        armed[0] = True

                setattr(module, name, counted)

            for module, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (shutil, "rmtree")):
                hook(module, name)
            finish = pp._PartMerger.finish

            def armed_finish(self):
                armed[0] = True
                return finish(self)

            pp._PartMerger.finish = armed_finish
            preprocess(cfg)
            os._exit(changes[0])
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture(scope="module")
def commit_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("commit")
    return write_jsonl(root / "old.jsonl", 40), write_jsonl(root / "new.jsonl", 300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys, task_bytes",
    [(("text",), 0), (("text", "title"), 0), (("text", "title"), 4000)],
    ids=["one-task-one-key", "one-task-two-keys", "several-tasks-two-keys"],
)
def test_a_kill_at_every_point_of_the_commit_resumes_to_identical_output(tmp_path, commit_inputs, keys, task_bytes):
    old_src, new_src = commit_inputs
    finals = [f"o_{key}_document" for key in keys]
    reference = tmp_path / "reference"
    reference.mkdir()
    preprocess(config(new_src, reference / "o", keys, task_bytes))
    new = {name: pair(reference / name) for name in finals}
    before = tmp_path / "before"  # the outputs of an earlier run over another input, under the same names
    before.mkdir()
    preprocess(config(old_src, before / "o", keys, task_bytes))
    old = {name: pair(before / name) for name in finals}
    assert all(old[name] != new[name] for name in finals)

    probe = tmp_path / "probe"
    shutil.copytree(before, probe)
    changes = run_killed_at(config(new_src, probe / "o", keys, task_bytes), 10**6)
    # per key: unlink .idx, .bin, .idx; + commit record, old summary unlinked, new one written, parts renamed away
    # and removed (+ the concatenation's own publish_pair per key, in the parts directory, with several tasks: an
    # unlink of an old .idx and two renames)
    assert changes == 3 * len(keys) + 5 + (3 * len(keys) if task_bytes else 0)
    assert leftovers(probe) == [] and {name: pair(probe / name) for name in finals} == new

    for n in range(1, changes + 1):
        work = tmp_path / f"kill-{n}"
        shutil.copytree(before, work)
        cfg = config(new_src, work / "o", keys, task_bytes)
        assert run_killed_at(cfg, n) == KILLED, n
        for name in finals:  # what a reader can see at this point: the old pair, the new pair, or no .idx
            bin_bytes, idx_bytes = pair(work / name)
            assert idx_bytes is None or (bin_bytes, idx_bytes) in (old[name], new[name]), (n, name)
        stats = preprocess(replace(cfg, resume=True))
        assert stats.documents == 300, n
        assert {name: pair(work / name) for name in finals} == new, n
        assert leftovers(work) == [], n
        summary = json.loads((work / "o.preprocess.json").read_text())
        assert summary["stats"]["documents"] == 300 and summary["config"]["inputs"] == [str(new_src)]
        for name in finals:
            IndexedDataset(work / name).validate()


def test_a_rerun_of_a_complete_run_removes_its_stale_parts_but_not_another_runs(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", 50)
    cfg = config(src, tmp_path / "o")
    preprocess(cfg)
    # A run killed after its outputs were final and before its parts went: the parts are a full copy of the tokens.
    stale = tmp_path / "o.parts"
    stale.mkdir()
    fingerprint = json.loads((tmp_path / "o.preprocess.json").read_text())["fingerprint"]
    (stale / "manifest.json").write_text(json.dumps({"fingerprint": fingerprint, "tasks": []}))
    (stale / "part-00000_text_document.bin").write_bytes(b"\0" * 4096)
    (tmp_path / "o.parts.removing-12345").mkdir()  # one killed while removing them
    assert preprocess(replace(cfg, resume=True)).already_complete
    assert leftovers(tmp_path) == []
    # The unfinished parts of a run with other settings are that run's to resume: kept.
    stale.mkdir()
    (stale / "manifest.json").write_text(json.dumps({"fingerprint": {"json_keys": ["title"]}, "tasks": []}))
    assert preprocess(replace(cfg, resume=True)).already_complete
    assert leftovers(tmp_path) == ["o.parts"]


# ---------------------------------------------------------------------------------------------------------------
# class 5: what a failed run leaves


def _bad_record_first(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a"\n' + write_jsonl(tmp_path / "good.jsonl", 50).read_text())
    return [src], BadRecordError


def _truncated_zst(tmp_path):
    src = tmp_path / "c.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(write_jsonl(tmp_path / "good.jsonl", 500).read_bytes())[:-9])
    return [write_jsonl(tmp_path / "first.jsonl", 20), src], InputError


def _missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "c.parquet")
    return [write_jsonl(tmp_path / "first.jsonl", 20), tmp_path / "c.parquet"], InputError


def _all_empty(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("\n\n")
    return [tmp_path / "a.jsonl", tmp_path / "b.jsonl"], PreprocessError


@pytest.mark.parametrize("make", [_bad_record_first, _truncated_zst, _missing_column, _all_empty])
def test_a_run_failed_by_its_input_leaves_nothing_it_cannot_reuse(tmp_path, make):
    # Fixing the input changes its fingerprint, so no part of the failed run could be resumed: nothing is kept
    # (a bad record after finished parts is the exception: the next test).
    inputs, error = make(tmp_path)
    with pytest.raises(error) as err:
        preprocess(config(inputs, tmp_path / "out" / "o", task_bytes=1 << 20))
    assert "\n" not in str(err.value) and "kept" not in str(err.value)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_a_bad_record_after_finished_parts_keeps_them_for_skip_and_resume(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", 400)
    with open(src, "a") as f:
        f.write('{"text": 5}\n')
    cfg = config(src, tmp_path / "o", task_bytes=2000)
    with pytest.raises(BadRecordError) as err:
        preprocess(cfg)
    finished = len(list((tmp_path / "o.parts").glob("*.done.json")))
    assert finished > 1 and str(err.value).endswith(
        f"; the {finished} finished parts are kept in {tmp_path / 'o.parts'} for a rerun with "
        "--on-bad-line skip --resume (a fixed input starts over)"
    )
    stats = preprocess(replace(cfg, on_bad_line="skip", resume=True))
    assert stats.tasks_resumed == finished and stats.bad == {"not_string": 1}
    fresh = preprocess(replace(cfg, output_prefix=str(tmp_path / "fresh"), on_bad_line="skip"))
    assert pair(tmp_path / "o_text_document") == pair(tmp_path / "fresh_text_document")
    assert fresh.documents == stats.documents == 400 and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# class 1: truncated, empty and repeated inputs


@pytest.mark.parametrize("on_bad", ["fail", "skip"])
@pytest.mark.parametrize("kind", ["zst-second-frame", "gz"])
def test_a_truncated_compressed_input_fails_the_run_whatever_on_bad_line(tmp_path, kind, on_bad):
    good = write_jsonl(tmp_path / "good.jsonl", 400).read_bytes()
    if kind == "gz":
        src = tmp_path / "c.jsonl.gz"
        src.write_bytes(gzip.compress(good)[:-100])
    else:
        half = good.index(b"\n", len(good) // 2) + 1
        zstd = zstandard.ZstdCompressor()
        src = tmp_path / "c.jsonl.zst"
        src.write_bytes(zstd.compress(good[:half]) + zstd.compress(good[half:])[:-50])
    with pytest.raises(InputError, match=rf"^{src}: truncated .* re-download or re-compress the file$"):
        preprocess(config(src, tmp_path / "o", on_bad_line=on_bad))
    assert leftovers(tmp_path) == [] and not list(tmp_path.glob("o_*"))


@pytest.mark.slow  # a CLI process: ~3 s of imports each
def test_the_cli_exits_1_on_a_truncated_input_even_when_skipping_bad_lines(tmp_path):
    src = tmp_path / "c.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(write_jsonl(tmp_path / "g.jsonl", 300).read_bytes())[:-40])
    cmd = [*CLI, "preprocess", src, "--output-prefix", tmp_path / "x", "--on-bad-line", "skip"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"corpusforge: error: {src}: truncated zstd stream (the file ends inside frame 1), so the rest of its "
        "records are missing; re-download or re-compress the file"
    ]
    assert not list(tmp_path.glob("x*"))


def test_empty_and_repeated_inputs_are_warned_about_and_read_once(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", 30)
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl.gz"
    empty.write_text("")
    blank.write_bytes(gzip.compress(b"\n\n"))
    (tmp_path / "link.jsonl").symlink_to(good)
    stats = preprocess(config([good, empty, blank, tmp_path / "link.jsonl", good], tmp_path / "o"))
    assert stats.documents == 30
    assert stats.warnings == [
        f"{tmp_path / 'link.jsonl'}: given more than once (as {good}); read once",
        f"{good}: given more than once (as {good}); read once",
        f"{empty}: no records (an empty input); it adds nothing to the dataset",
        f"{blank}: no records (an empty input); it adds nothing to the dataset",
    ]
    assert pair(tmp_path / "o_text_document") == pair(Path(preprocess(config(good, tmp_path / "alone")).outputs[0]))


@pytest.mark.slow  # a CLI process: ~3 s of imports each
def test_the_cli_prints_warnings_and_refuses_all_empty_inputs_in_one_line(tmp_path):
    good, empty = write_jsonl(tmp_path / "good.jsonl", 5), tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run(
        [*CLI, "preprocess", good, empty, good, "--output-prefix", tmp_path / "new/dir/o", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"corpusforge: warning: {good}: given more than once (as {good}); read once",
        f"corpusforge: warning: {empty}: no records (an empty input); it adds nothing to the dataset",
    ]
    assert len(json.loads(proc.stdout)["warnings"]) == 2 and (tmp_path / "new/dir/o_text_document.idx").is_file()
    proc = subprocess.run(
        [*CLI, "preprocess", empty, "--output-prefix", tmp_path / "x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"corpusforge: error: no documents: no input holds a record ({empty}: empty); check the input paths"
    ]
    assert not list(tmp_path.glob("x*"))


# ---------------------------------------------------------------------------------------------------------------
# class 5c: output paths


def test_missing_output_directories_are_created(tmp_path):
    stats = preprocess(config(write_jsonl(tmp_path / "c.jsonl", 5), tmp_path / "a" / "b" / "o"))
    assert IndexedDataset(stats.outputs[0]).num_documents == 5


@pytest.mark.parametrize(
    "taken, message",
    [
        ("o.parts", "o.parts exists and is not a directory"),
        ("o_text_document.bin/", "o_text_document.bin exists and is not a file"),
        ("o_text_document.idx/", "o_text_document.idx exists and is not a file"),
        ("o.preprocess.json/", "o.preprocess.json exists and is not a file"),
        ("sub", "a part of that path is a file"),  # the prefix is sub/o: its directory is a file
    ],
)
def test_an_output_path_taken_by_the_wrong_kind_of_thing_is_one_line_before_any_work(tmp_path, taken, message):
    src = write_jsonl(tmp_path / "c.jsonl", 5)
    out = tmp_path / "out"
    out.mkdir()
    if taken.endswith("/"):
        (out / taken).mkdir()
    else:
        (out / taken).write_text("mine")
    prefix = out / "sub" / "o" if taken == "sub" else out / "o"
    with pytest.raises(PreprocessError, match=message) as err:
        preprocess(config(src, prefix))
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == [taken.rstrip("/")]  # nothing written, nothing removed


def test_a_prefix_that_names_a_directory_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", 5)
    with pytest.raises(PreprocessError, match="names a directory; add a file name"):
        preprocess(config(src, f"{tmp_path}/out/"))

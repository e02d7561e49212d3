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
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import zstandard

from corpusforge import indexed
from corpusforge import preprocess as pp
from corpusforge.describe import describe
from corpusforge.indexed import DatasetNotFoundError, IndexedDataset, IndexedDatasetWriter, bin_path, idx_path, merge
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
# class 3: a kill at every point of the commit (preprocess and merge share it: indexed.publish_pair)

CHANGES = ((os, "replace"), (os, "rename"), (os, "unlink"), (shutil, "rmtree"))
"""The file-system changes a commit is made of: renames and unlinks of files, the removal of a directory."""


def run_killed_at(work: Callable[[], object], n: int, arm: tuple[object, str], hooks=CHANGES, counts=None) -> int:
    """Run `work()` in a forked child that dies (os._exit, as a SIGKILL leaves it: no cleanup runs) just before its
    nth change of `hooks` from the moment `arm` (an owner and the name of its function) is called, counting only
    the calls whose arguments `counts(args)` accepts (default: all). Returns the child's exit status: KILLED, or,
    when it was not killed, the number of changes it made."""
    pid = os.fork()
    if pid == 0:  # the child: nothing here returns
        try:
            changes, armed = [0], [False]

            def hook(module, name):
                real = getattr(module, name)

                def counted(*args, **kwargs):
                    if not armed[0] or (counts is not None and not counts(args)):
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

            for module, name in hooks:
                hook(module, name)
            owner, name = arm
            start = getattr(owner, name)

            def armed_start(*args, **kwargs):
                armed[0] = True
                return start(*args, **kwargs)

            setattr(owner, name, armed_start)
            work()
            os._exit(changes[0])
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def assert_no_torn_pair(prefix: Path, old: tuple, new: tuple, where) -> None:
    """What a reader can see under a final name after a kill: the old pair, the new pair (either validates), or a
    .bin without its .idx, which no reader opens (inspect neither: it says why, in one line), or nothing."""
    bin_bytes, idx_bytes = pair(prefix)
    if idx_bytes is not None:
        assert (bin_bytes, idx_bytes) in (old, new), where
        IndexedDataset(prefix).validate()
    elif bin_bytes is not None:
        for reader in (IndexedDataset, describe):
            with pytest.raises(
                DatasetNotFoundError, match=rf"^{prefix}\.bin has no \.idx: .* interrupted .*; rerun it"
            ):
                reader(prefix)


@pytest.fixture(scope="module")
def commit_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("commit")
    return write_jsonl(root / "old.jsonl", 40), write_jsonl(root / "new.jsonl", 300)


@pytest.mark.slow
@pytest.mark.parametrize("existing", ["fresh", "overwriting"])
@pytest.mark.parametrize(
    "keys, task_bytes",
    [(("text",), 0), (("text", "title"), 0), (("text", "title"), 4000)],
    ids=["one-task-one-key", "one-task-two-keys", "several-tasks-two-keys"],
)
def test_a_kill_at_every_point_of_the_commit_resumes_to_identical_output(
    tmp_path, commit_inputs, keys, task_bytes, existing
):
    old_src, new_src = commit_inputs
    finals = [f"o_{key}_document" for key in keys]
    reference = tmp_path / "reference"
    reference.mkdir()
    preprocess(config(new_src, reference / "o", keys, task_bytes))
    new = {name: pair(reference / name) for name in finals}
    before = tmp_path / "before"  # empty, or the outputs of an earlier run over another input, under the same names
    before.mkdir()
    if existing == "overwriting":
        preprocess(config(old_src, before / "o", keys, task_bytes))
    old = {name: pair(before / name) for name in finals}
    assert all(old[name] != new[name] for name in finals)

    def killed_at(n: int, work: Path) -> int:
        cfg = config(new_src, work / "o", keys, task_bytes)
        return run_killed_at(partial(preprocess, cfg), n, (pp._PartMerger, "finish"))

    probe = tmp_path / "probe"
    shutil.copytree(before, probe)
    changes = killed_at(10**6, probe)
    # per key: unlink the old .idx (when overwriting), rename .bin, rename .idx; + the commit record, the old summary
    # unlinked, the new one written, the parts renamed away and removed (+ with several tasks, the concatenation's
    # own commit per key, in the parts directory: two renames)
    assert changes == (3 if existing == "overwriting" else 2) * len(keys) + 5 + (2 * len(keys) if task_bytes else 0)
    assert leftovers(probe) == [] and {name: pair(probe / name) for name in finals} == new

    for n in range(1, changes + 1):  # before the first change, between each two, before the last
        work = tmp_path / f"kill-{n}"
        shutil.copytree(before, work)
        assert killed_at(n, work) == KILLED, n
        for name in finals:
            assert_no_torn_pair(work / name, old[name], new[name], (n, name))
        stats = preprocess(replace(config(new_src, work / "o", keys, task_bytes), resume=True))
        assert stats.documents == 300, n
        assert {name: pair(work / name) for name in finals} == new, n
        assert leftovers(work) == [], n
        summary = json.loads((work / "o.preprocess.json").read_text())
        assert summary["stats"]["documents"] == 300 and summary["config"]["inputs"] == [str(new_src)]
        for name in finals:
            IndexedDataset(work / name).validate()


def test_a_plain_rerun_replaces_a_bin_left_without_its_idx(tmp_path, commit_inputs):
    _, src = commit_inputs
    preprocess(config(src, tmp_path / "ref"))
    cfg = config(src, tmp_path / "o")
    # killed between the .bin's rename and the .idx's: the commit record, the old summary's unlink, the .bin's rename
    assert run_killed_at(partial(preprocess, cfg), 4, (pp._PartMerger, "finish")) == KILLED
    assert pair(tmp_path / "o_text_document")[1] is None and pair(tmp_path / "o_text_document")[0] is not None
    assert not preprocess(cfg).already_complete  # without --resume: tokenized again, and replaced
    assert pair(tmp_path / "o_text_document") == pair(tmp_path / "ref_text_document")
    assert leftovers(tmp_path) == []


def _merge_inputs(root: Path, sizes: list[int]) -> list[Path]:
    out = []
    for i, n in enumerate(sizes):
        with IndexedDatasetWriter(root / f"in{n}-{i}", np.uint16) as w:
            w.add_documents(np.arange(n * 7) % 1000, np.full(n, 7))
        out.append(root / f"in{n}-{i}")
    return out


@pytest.mark.parametrize("existing", ["fresh", "overwriting"])
def test_a_kill_at_every_point_of_a_merge_leaves_no_torn_pair_and_a_rerun_gives_identical_output(tmp_path, existing):
    inputs = _merge_inputs(tmp_path, [300, 500])
    reference = tmp_path / "reference"
    merge(inputs, reference)
    new = pair(reference)
    before = tmp_path / "before"
    before.mkdir()
    if existing == "overwriting":
        (tmp_path / "old").mkdir()
        merge(_merge_inputs(tmp_path / "old", [40]), before / "m")
    old = pair(before / "m")

    def killed_at(n: int, work: Path) -> int:
        # the changes to the output (its name starts with "m."): each input's copy into m.bin.tmp, one at a time
        # (one stream), then the commit; anything else (an anonymous temporary file) is not counted
        named = lambda args: any(Path(os.fspath(a)).name.startswith("m.") for a in args if isinstance(a, str | Path))  # noqa: E731
        work_merge = lambda: indexed.merge(inputs, work / "m", streams=1)  # noqa: E731 - looked up when armed
        return run_killed_at(work_merge, n, (indexed, "merge"), (*CHANGES, (indexed, "place")), named)

    probe = tmp_path / "probe"
    shutil.copytree(before, probe)
    changes = killed_at(10**6, probe)
    # two copies; unlink the old .idx (when overwriting), rename .bin, rename .idx
    assert changes == 2 + (3 if existing == "overwriting" else 2)
    assert pair(probe / "m") == new and sorted(p.name for p in probe.iterdir()) == ["m.bin", "m.idx"]

    for n in range(1, changes + 1):  # before the first copy, mid-copy, before each step of the commit
        work = tmp_path / f"kill-{n}"
        shutil.copytree(before, work)
        assert killed_at(n, work) == KILLED, n
        assert_no_torn_pair(work / "m", old, new, n)
        merge(inputs, work / "m")  # the same merge again completes or replaces whatever the kill left
        assert pair(work / "m") == new, n
        assert sorted(p.name for p in work.iterdir()) == ["m.bin", "m.idx"], n


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
# class 3b: a resume over damaged parts: every file of a finished part, every way it can be damaged


def _cut(at):
    return lambda path: path.write_bytes(path.read_bytes()[: at(path.stat().st_size)])


PART_DAMAGES = {
    # the part's .idx: empty, cut inside the header, inside the lengths, one byte short; junk; gone
    "idx-empty": ("_text_document.idx", _cut(lambda n: 0)),
    "idx-cut-in-header": ("_text_document.idx", _cut(lambda n: 20)),
    "idx-cut-in-lengths": ("_text_document.idx", _cut(lambda n: 50)),
    "idx-one-byte-short": ("_text_document.idx", _cut(lambda n: n - 1)),
    "idx-junk": ("_text_document.idx", lambda p: p.write_bytes(b"not an index at all" * 8)),
    "idx-missing": ("_text_document.idx", Path.unlink),
    # the part's .bin: cut, longer, gone
    "bin-cut": ("_text_document.bin", _cut(lambda n: n // 2)),
    "bin-longer": ("_text_document.bin", lambda p: p.write_bytes(p.read_bytes() + b"\0" * 64)),
    "bin-missing": ("_text_document.bin", Path.unlink),
    # its done marker: empty, cut, not JSON, not an object, counts that are not the part's
    "marker-empty": (".done.json", _cut(lambda n: 0)),
    "marker-cut": (".done.json", _cut(lambda n: 3)),
    "marker-junk": (".done.json", lambda p: p.write_text("not json")),
    "marker-a-list": (".done.json", lambda p: p.write_text("[]")),
    "marker-other-counts": (".done.json", lambda p: p.write_text('{"documents": 1, "tokens": 2}')),
}


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """An input whose last record is bad, cut into many tasks: a run stops there with its finished parts kept
    (class 5); and the output of the same input without that run (skipping the bad record)."""
    root = tmp_path_factory.mktemp("damaged")
    src = write_jsonl(root / "c.jsonl", 400)
    with open(src, "a") as f:
        f.write('{"text": 5}\n')
    cfg = config(src, root / "o", task_bytes=2000)
    with pytest.raises(BadRecordError):
        preprocess(cfg)
    preprocess(replace(cfg, output_prefix=str(root / "ref"), on_bad_line="skip"))
    return cfg, root / "o.parts", pair(root / "ref_text_document")


@pytest.mark.parametrize("damage", [*PART_DAMAGES, "manifest-cut", "manifest-junk", "manifest-no-tasks"])
def test_a_resume_tokenizes_a_damaged_part_again_and_says_so(tmp_path, interrupted_run, damage):
    cfg, saved, expected = interrupted_run
    parts = tmp_path / "o.parts"
    shutil.copytree(saved, parts)
    cfg = replace(cfg, output_prefix=str(tmp_path / "o"), on_bad_line="skip", resume=True)
    finished = len(list(parts.glob("*.done.json")))
    if damage.startswith("manifest"):
        manifest = parts / "manifest.json"
        manifest.write_text({"manifest-cut": manifest.read_text()[:30], "manifest-junk": "\0\1junk"}.get(
            damage, '{"fingerprint": {}}'))  # fmt: skip
    else:
        suffix, spoil = PART_DAMAGES[damage]
        spoil(parts / f"part-00001{suffix}")
    stats = preprocess(cfg)
    assert pair(tmp_path / "o_text_document") == expected and leftovers(tmp_path) == []
    assert stats.documents == 400 and stats.bad == {"not_string": 1}
    damaged = [w for w in stats.warnings if "damaged" in w]
    if damage.startswith("manifest"):
        assert stats.tasks_resumed == 0 and damaged == [
            w for w in damaged if w.startswith(f"{parts / 'manifest.json'}: damaged (") and w.endswith("started over")
        ] and len(damaged) == 1  # fmt: skip
    else:
        assert stats.tasks_resumed == finished - 1
        assert len(damaged) == 1 and damaged[0].startswith(f"{parts / 'part-00001'}: a finished part is damaged ("), (
            damaged
        )
        assert damaged[0].endswith("); tokenized again") and "rebuild" not in damaged[0]
    assert all("\n" not in w and "FrameSummary" not in w for w in damaged)


@pytest.mark.slow  # a CLI process: ~3 s of imports
def test_the_cli_says_a_damaged_part_in_one_warning_line(tmp_path, interrupted_run):
    cfg, saved, _ = interrupted_run
    shutil.copytree(saved, tmp_path / "o.parts")
    (tmp_path / "o.parts" / "part-00001_text_document.idx").write_bytes(b"MMIDIDX\0\0")
    args = [*CLI, "preprocess", *cfg.inputs, "--output-prefix", tmp_path / "o", "--task-size", "2000", "--workers", "1"]
    proc = subprocess.run([*args, "--resume", "--on-bad-line", "skip"], capture_output=True, text=True)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        f"corpusforge: warning: {tmp_path / 'o.parts' / 'part-00001'}: a finished part is damaged ("
        f"{tmp_path / 'o.parts' / 'part-00001_text_document.idx'}: truncated header (9 of 34 bytes)); tokenized again"
    ), lines
    assert lines[1].startswith("corpusforge: skipped 1 bad records") and len(lines) == 2


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

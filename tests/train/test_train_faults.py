"""Failures met by a running job end it in one line, each with its fix: a disk without room for the next checkpoint,
a disk that fills while a checkpoint is written (both synchronous and asynchronous saves), an out_dir or index cache
that cannot be written, and under torchrun a check that one rank makes (rank 0 for all, or another rank alone,
before the first step or inside one), which must end every rank quietly with the same line.

Real file systems (tmpfs mounts, read-only mounts, a rank's own mount namespace), real `python -m corpusforge.train`
processes and a real 2-rank torchrun; the suite runs as root (mount, unshare)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trainkit

from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "iobench"))
import iobench_helpers  # noqa: E402

tmpfs = iobench_helpers.tmpfs  # the bench-io tests' fixture: mount(size, options) -> a fresh tmpfs, unmounted after


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def train_cli(overrides: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m corpusforge.train OVERRIDES` (the `corpusforge train` command) in a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "corpusforge.train", *overrides], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def one_line(done: subprocess.CompletedProcess) -> str:
    """The one line on stderr of a run that failed as a user's problem: exit 1, no traceback."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("corpusforge: error: "), done.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# a disk that is or becomes full


@pytest.mark.parametrize("async_write", ["true", "false"], ids=["async", "sync"])
def test_a_disk_without_room_for_the_next_checkpoint_stops_before_writing_it(corpus, tmpfs, async_write):
    """out_dir on a 1 MiB file system that holds two checkpoints of the tiny model: the third is refused before any
    byte of it is written, naming the directory, the step, the room it needs and the way to go on."""
    out = tmpfs("1m") / "run"
    overrides = trainkit.tiny_overrides(corpus, out, max_steps=40, checkpoint_interval=2, eval_interval=0,
                                        keep_checkpoints=10, async_checkpoint=async_write)  # fmt: skip
    line = one_line(train_cli(overrides))
    root = out / "checkpoints"
    saved = sorted(p.name for p in root.iterdir())
    assert saved and saved == [f"step_{2 * (i + 1):08d}" for i in range(len(saved))]  # complete ones, no .tmp-
    refused = 2 * (len(saved) + 1)
    assert line.startswith(f"corpusforge: error: {root}: ") and f"the checkpoint of step {refused} needs" in line
    assert "free space there" in line and f"checkpoint.resume={root / saved[-1]}" in line, line


@pytest.mark.parametrize("async_write", ["true", "false"], ids=["async", "sync"])
def test_a_disk_that_fills_while_a_checkpoint_is_written_stops_the_run_at_that_save(corpus, tmpfs, tmp_path,
                                                                                      async_write):  # fmt: skip
    """The step's .tmp- directory is a 64 KiB file system of its own (the checkpoints directory beside it has room,
    so the check before the save passes): the write itself fills it. One line naming the checkpoints directory and
    the step, raised at that save (asynchronously: at the first step after the write failed, not at the next save),
    the partial directory emptied and no step directory of it."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    partial = root / ".tmp-step_00000010"
    partial.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(tmpfs("64k")), str(partial)], check=True)
    try:
        overrides = trainkit.tiny_overrides(corpus, out, max_steps=60, checkpoint_interval=10, eval_interval=0,
                                            async_checkpoint=async_write)  # fmt: skip
        line = one_line(train_cli(overrides))
        assert line == (
            f"corpusforge: error: {root}: the checkpoint of step 10 could not be written (no space left on the "
            f"device); free space there (or keep fewer: checkpoint.keep), or give an out_dir with room"
        )
        assert not (root / "step_00000010").exists() and list(partial.iterdir()) == []
        last = max(trainkit.run_records(out))
        assert 10 <= last < 20, last  # found before the next save
        assert last == 10 or async_write == "true"
    finally:
        subprocess.run(["umount", "-l", str(partial)], check=False)


# ---------------------------------------------------------------------------------------------------------------
# places that cannot be written


@pytest.mark.parametrize("where", ["out_dir", "under it", "cache_dir"])
def test_a_read_only_place_is_one_line_naming_it_and_the_fix(corpus, tmpfs, tmp_path, where):
    """A read-only mount (chmod does not stop root): as out_dir, as the place out_dir would be made in, or as the
    index caches' directory."""
    ro = tmpfs("1m", ",ro")
    out = {"out_dir": ro, "under it": ro / "run", "cache_dir": tmp_path / "run"}[where]
    extra = {"data.cache_dir": f'"{ro}"'} if where == "cache_dir" else {}
    line = one_line(train_cli(trainkit.tiny_overrides(corpus, out, max_steps=2, **extra)))
    if where == "cache_dir":
        assert line.startswith(f"corpusforge: error: {ro}: cannot write the index caches there (Read-only file"), line
        assert line.endswith("set data.cache_dir to a directory you can write, or build them beforehand with "
                             "corpusforge prepare-cache")  # fmt: skip
    else:
        assert line == (
            f"corpusforge: error: {out}: the run's out_dir is on a read-only file system; give an out_dir you can "
            f"write (out_dir=...)"
        )


# ---------------------------------------------------------------------------------------------------------------
# torchrun: a check one rank makes ends every rank with the same line


def _bad_tokens_copy(corpus: str, where: Path) -> Path:
    """The corpus with every token replaced by 1000 (beyond the tiny vocabulary), same documents and sizes."""
    where.mkdir()
    source = IndexedDataset(corpus)
    with IndexedDatasetWriter(where / Path(corpus).name, np.uint16) as w:
        w.add_documents(np.full(int(source.sequence_lengths.sum()), 1000), source.sequence_lengths)
    return where


def _missing_everywhere(corpus: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    return trainkit.tiny_overrides(str(tmp_path / "nope_text_document"), tmp_path / "run", max_steps=4), []


def _data_missing_on_rank_1(corpus: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """A node that does not see the shared file system: rank 1 finds the corpus's directory empty."""
    return trainkit.tiny_overrides(corpus, tmp_path / "run", max_steps=4), ["1", "empty", str(Path(corpus).parent)]


def _out_dir_read_only_on_rank_1(corpus: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    (tmp_path / "run").mkdir()
    view = ["1", "ro", str(tmp_path / "run")]
    return trainkit.tiny_overrides(corpus, tmp_path / "run", max_steps=4), view


def _bad_tokens_on_rank_1(corpus: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Rank 1 reads other files under the corpus's name, whose tokens are beyond the vocabulary: its first batch
    fails its check inside the first step, after the caches and the model were built on every rank."""
    bad = _bad_tokens_copy(corpus, tmp_path / "bad")
    view = ["1", f"bind:{bad}", str(Path(corpus).parent)]
    return trainkit.tiny_overrides(corpus, tmp_path / "run", max_steps=4), view


CASES = [
    pytest.param(_missing_everywhere, "no such file", None, id="data missing (rank 0 builds the caches)"),
    pytest.param(_data_missing_on_rank_1, "no such file", 1, id="data missing on rank 1 alone", marks=pytest.mark.slow),
    pytest.param(_out_dir_read_only_on_rank_1, "the run's out_dir is on a read-only file system", 1,
                 id="out_dir read-only on rank 1 alone", marks=pytest.mark.slow),
    pytest.param(_bad_tokens_on_rank_1, "token id 1000 is not below vocab_size 64", 1,
                 id="bad batch on rank 1 alone, inside a step", marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize("make, words, alone", CASES)
def test_a_check_one_rank_makes_ends_every_rank_with_its_line(corpus, tmp_path, make, words, alone):
    """2 gloo ranks. Every rank ends at once with exit 1 (or is stopped by torchrun once rank 0 has exited with the
    line), rank 0 prints the one line (naming the rank that met it when it was not every rank), no rank prints a
    traceback or gloo's "Connection reset by peer", and torchrun names rank 0 as the root cause."""
    overrides, view = make(corpus, tmp_path)
    logs = tmp_path / "logs"
    wrapper = [str(Path(__file__).with_name("rank_view.py")), *view] if view else []
    done = trainkit.torchrun(overrides, 2, check=False, options=["--log-dir", str(logs), "--redirects", "3"],
                             wrapper=wrapper)  # fmt: skip
    ranks = trainkit.rank_logs(logs)
    assert done.returncode == 1 and sorted(ranks) == [0, 1], done.stderr[-3000:]
    assert all("Connection reset" not in text for text in [done.stderr, *ranks.values()]), done.stderr[-3000:]
    assert all("Traceback" not in text for text in ranks.values()), ranks
    assert ranks[1] == "", ranks  # the line is rank 0's to print
    lines = ranks[0].splitlines()
    assert len(lines) == 1 and lines[0].startswith("corpusforge: error: ") and words in lines[0], ranks
    assert ("(met by rank" in lines[0]) == (alone is not None) and (f"(met by rank {alone} on " in lines[0]) == (
        alone is not None), lines[0]  # fmt: skip
    report = done.stderr[done.stderr.index("Root Cause") :]
    assert re.search(r"rank\s*: 0 .*\n\s*exitcode\s*: 1 ", report), report
    codes = re.findall(r"rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)", done.stderr)
    assert codes and all(code in ("1", "-15") for _, code in codes), codes  # exit 1, or torchrun's SIGTERM

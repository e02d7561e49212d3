"""A read that is slow, that hangs and is released, or that hangs for good, under a real 2-rank torchrun on gloo:
rank 1 sees the corpus's directory through a FUSE file system (hangfs.py) that delays or blocks its reads on
command, in a mount namespace of its own (rank_view.py); rank 0 reads the same files directly. Real processes, a
real kernel wait, no mocks. The suite runs as root (mount, unshare, FUSE)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trainkit

from corpusforge.train.watchdog import HANG_EXIT_CODE

HERE = Path(__file__).resolve().parent
STALL_S, HANG_S = 1, 4

pytestmark = pytest.mark.skipif(not shutil.which("fusermount") and not os.path.exists("/dev/fuse"), reason="no FUSE")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def drop_cached_pages(path: Path) -> None:
    """Drop the cached pages of `path` on hangfs with --page-cache, those a process has mapped too: FUSE invalidates
    a file's pages at each open (hangfs does not ask to keep them), and the advice drops what may come back meanwhile.
    The next read of the file through a map then faults into hangfs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def mounted_hangfs(source: Path, where: Path, page_cache: bool = False):
    """(mountpoint, control): the directory `source` through hangfs.py, mounted under `where` (with the page cache,
    as a memory map needs, when `page_cache`; else with direct_io)."""
    mnt, control = where / "fuse", where / "control"
    mnt.mkdir()
    control.mkdir()
    command = [sys.executable, str(HERE / "hangfs.py"), str(source), str(mnt), str(control)]
    proc = subprocess.Popen(command + ["--page-cache"] * page_cache, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, "hangfs did not mount"
            time.sleep(0.05)
        yield mnt, control
    finally:
        for name in ("block", "block-writes"):  # whatever still waits in a read or a write returns
            (control / name).unlink(missing_ok=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        proc.kill()
        proc.wait()


@pytest.fixture
def hangfs(corpus, tmp_path):
    """(mountpoint, control): the corpus's directory through hangfs.py."""
    with mounted_hangfs(Path(corpus).parent, tmp_path) as view:
        yield view


def overrides(corpus: str, out: Path, **extra) -> list[str]:
    """The tiny run, its reads through pread (one timed system call per span), the watchdog's clocks short."""
    values = {"max_steps": 24, "eval_interval": 0, "checkpoint_interval": 0, "storage.read_mode": '"pread"',
              "watchdog.stall_s": STALL_S, "watchdog.hang_s": HANG_S, **extra}  # fmt: skip
    return trainkit.tiny_overrides(corpus, out, **values)


def launch(corpus: str, out: Path, mnt: Path, logs: Path, restarts: int = 0, view: Path | None = None,
           **extra) -> subprocess.CompletedProcess:  # fmt: skip
    """2 gloo ranks; rank 1 sees `view` (the corpus's directory) through the FUSE mount. Each rank's output in its
    own file; torchrun starts the ranks again up to `restarts` times when one fails."""
    wrapper = [str(HERE / "rank_view.py"), "1", f"bind:{mnt}", str(view or Path(corpus).parent)]
    options = ["--log-dir", str(logs), "--redirects", "3", f"--max-restarts={restarts}"]
    return trainkit.torchrun(overrides(corpus, out, **extra), 2, timeout=120 * (1 + restarts), check=False,
                             options=options, wrapper=wrapper)  # fmt: skip


def block_until_reported(control: Path, out: Path, blocked: list[float] | None = None, what: str = "block",
                         drop: Path | None = None) -> None:  # fmt: skip
    """Block the storage's reads (`what` "block-writes": its writes) until rank 0 has reported the hang (then a
    second more), then release them; the time the block began goes into `blocked`. `drop`: a file whose cached pages
    are dropped once the reads are blocked (a memory-mapped read then faults into the storage)."""
    (control / what).write_text("")
    if drop is not None:
        drop_cached_pages(drop)
    if blocked is not None:
        blocked.append(time.monotonic())
    deadline = time.monotonic() + 60
    while not (out / "hang-reported.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)
    (control / what).unlink(missing_ok=True)  # the fixture may have released it first, at the end


def delay_next_read(control: Path, seconds: float) -> None:
    """hangfs delays its next read by `seconds`. The file appears whole, by a rename: a read that took it between
    its creation and its write would find it empty, and fusepy answers a handler's error with EINVAL (seen once in a
    loaded suite run)."""
    tmp = control / ".delay-once.tmp"
    tmp.write_text(str(seconds))
    os.replace(tmp, control / "delay-once")


def at_step(out: Path, step: int, then, timeout: float = 90) -> threading.Thread:
    """A thread that calls `then()` once rank 0 has logged `step` (the run is past its start, its files open)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").exists() and step in trainkit.run_records(out):
                then()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def losses(out: Path) -> list[float]:
    return [r["loss"] for _, r in sorted(trainkit.run_records(out).items())]


@pytest.fixture(scope="module")
def undisturbed(corpus, tmp_path_factory) -> list[float]:
    """The losses of the same 2-rank run with both ranks reading the corpus directly."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    trainkit.torchrun(overrides(corpus, out), 2, timeout=120)
    return losses(out)


def no_collective_noise(texts: list[str]) -> None:
    for text in texts:
        for word in ("Traceback", "gloo", "Connection reset", "timed out", "Timeout"):
            assert word not in text, text[-3000:]


def test_a_read_in_another_process_is_seen_with_its_file_offset_and_time(tmp_path):
    """readwatch's shared slots: a forked process (as a DataLoader worker) in a read is seen by its parent with the
    file, the offset it has reached and its time; its finished reads count in the parent's percentiles."""
    from corpusforge.storage import readwatch

    # share() keeps this process's reads timed so far, and earlier tests in this pytest process (one xdist worker
    # runs many files) have read: start from none, so that the counts below are the child's alone.
    readwatch.unshare()
    readwatch.share(str(tmp_path / "slots"))
    try:
        pid = os.fork()
        if pid == 0:  # the child: one finished read of ~20 ms, then one that lasts until it is killed
            t = readwatch.begin("/data/a_text_document.bin", 0, 4096)
            time.sleep(0.02)
            readwatch.end(t)
            readwatch.begin("/data/a_text_document.bin", 8192, 16384)
            readwatch.advance(12288)
            time.sleep(60)
            os._exit(0)
        deadline = time.monotonic() + 10
        while not readwatch.current() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        (read,) = readwatch.current()
        assert read["pid"] == pid and read["path"] == "/data/a_text_document.bin", read
        assert read["offset"] == 12288 and read["nbytes"] == 16384 and 0.1 <= read["seconds"] < 10, read
        stats = readwatch.percentiles_ms()
        assert stats["reads"] == 1 and 20 <= stats["p50_ms"] < 200, stats
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    finally:
        readwatch.unshare()
    assert not (tmp_path / "slots").exists()


def test_a_copy_out_of_a_memory_map_is_a_read_in_progress_with_its_file_and_offset(corpus, tmp_path):
    """A copy out of a memory map whose page fault waits on a hung storage (hangfs with the page cache, its reads
    blocked, the cached pages dropped) is seen in readwatch.current() while it waits, from another thread: GPTDataset's
    compiled gather (get_batch) with the .bin and the byte offset of the document piece it waits in, and
    MMapBinReader.read_spans with the offset of its second span (its first is mapped already). Released, each returns
    the right tokens; after a copy returns or raises, no slot is left in a read."""
    from corpusforge.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from corpusforge.indexed import IndexedDataset
    from corpusforge.storage import StorageConfig, open_dataset, readwatch

    readwatch.unshare()  # this process's own slot: an earlier test may have shared the slots
    source = Path(corpus)
    with mounted_hangfs(source.parent, tmp_path, page_cache=True) as (mnt, control):
        bin_path = mnt / f"{source.name}.bin"
        config = GPTDatasetConfig(seq_length=64, seed=1)

        def samples(prefix: Path | str, read_mode: str) -> GPTDataset:
            ds = open_dataset(str(prefix), StorageConfig(read_mode=read_mode))
            return GPTDataset(ds, "train", (0, len(ds)), 64, config)

        def waits_in(call, before=lambda: None) -> tuple[dict, object]:
            """(the read current() shows while `call` waits in a thread on the blocked storage, its result); `before`
            runs once the pages are dropped, before the reads block."""
            result: list = []
            drop_cached_pages(bin_path)
            before()
            (control / "block").write_text("")
            thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
            thread.start()
            deadline = time.monotonic() + 20
            while not (reads := readwatch.current()) or reads[0]["seconds"] < 0.3:
                assert time.monotonic() < deadline, "no read in progress"
                time.sleep(0.02)
            alive = thread.is_alive()
            (control / "block").unlink()
            thread.join(20)
            assert alive and result and readwatch.current() == [], (alive, result, readwatch.current())
            return reads[0], result[0]

        reference, train = samples(corpus, "pread"), samples(mnt / source.name, "mmap-random")
        train.load_kernels()  # the compiled gather, as the loader loads it before the first batch
        ids = np.array([5, 17, 40])
        read, batch = waits_in(lambda: train.get_batch(ids))
        starts, _, _ = train._pieces(ids)
        assert read["path"] == str(bin_path) and read["pid"] == os.getpid(), read
        assert read["offset"] == starts[0] * 2 and read["nbytes"] == len(ids) * 65 * 2, (read, starts)
        for key, value in reference.get_batch(ids).items():
            np.testing.assert_array_equal(batch[key], value, err_msg=key)

        reader, tokens = train.indexed.reader, IndexedDataset(corpus).tokens
        spans = np.array([10, len(tokens) - 30]), np.array([10, 20])  # 12 pages apart
        read, values = waits_in(
            lambda: reader.read_spans(*spans), before=lambda: int(reader.read(10, 1)[0])
        )  # maps page 0
        assert read["path"] == str(bin_path) and read["offset"] == spans[0][1] * 2 and read["nbytes"] == 60, read
        np.testing.assert_array_equal(values, np.concatenate([tokens[a : a + n] for a, n in zip(*spans)]))

        done = readwatch.percentiles_ms()["reads"]
        with pytest.raises(IndexError):
            train.get_batch([len(train)])
        with pytest.raises(ValueError):
            reader.read_spans(np.array([len(tokens) - 2]), np.array([5]))  # past the end of the .bin
        assert readwatch.current() == [] and readwatch.percentiles_ms()["reads"] == done + 1
        reader.close()


@pytest.mark.slow
def test_a_slow_read_warns_once_and_changes_no_loss(corpus, hangfs, tmp_path, undisturbed):
    """One read of rank 1 takes 2 s (stall_s 1, hang_s 4): rank 1 prints one warning naming the file, the offset,
    the bytes, the wait and its reads' p50/p99; the run finishes with the undisturbed run's losses."""
    mnt, control = hangfs
    out = tmp_path / "run"
    at_step(out, 3, lambda: delay_next_read(control, 2))
    done = launch(corpus, out, mnt, tmp_path / "logs")
    ranks = trainkit.rank_logs(tmp_path / "logs")
    assert done.returncode == 0, (done.stderr[-3000:], ranks)
    warnings = [line for line in ranks[1].splitlines() if "warning" in line]
    assert len(warnings) == 1, ranks[1]
    assert re.fullmatch(
        rf"corpusforge: warning: rank 1: a read of {re.escape(str(Path(corpus)))}\.bin at offset \d+ \(\d+ bytes\) "
        rf"has waited \d+\.\d s \(stall_s {STALL_S}\); this rank's reads so far: p50 [\d.]+ ms, p99 [\d.]+ ms over "
        rf"\d+ reads",
        warnings[0],
    ), warnings[0]
    assert "warning" not in ranks[0], ranks[0]
    no_collective_noise(list(ranks.values()))
    np.testing.assert_array_equal(losses(out), undisturbed)


@pytest.mark.slow
def test_a_hang_released_before_hang_s_lets_training_go_on(corpus, hangfs, tmp_path, undisturbed):
    """Rank 1's reads block for 2 s, then the storage answers again: a warning, no hang, the same losses."""
    mnt, control = hangfs
    out = tmp_path / "run"

    def block_then_release() -> None:
        (control / "block").write_text("")
        time.sleep(2)
        (control / "block").unlink()

    at_step(out, 3, block_then_release)
    done = launch(corpus, out, mnt, tmp_path / "logs")
    ranks = trainkit.rank_logs(tmp_path / "logs")
    assert done.returncode == 0, (done.stderr[-3000:], ranks)
    warnings = [line for line in ranks[1].splitlines() if "warning" in line]
    # the stalled read's one line; on a loaded machine the batch that waited on it may be named once too
    assert 1 <= len(warnings) <= 2 and "a read of " in warnings[0], ranks[1]
    assert all(w.startswith("corpusforge: warning: rank 1: ") for w in warnings), warnings
    assert not list(out.glob("hang-*")), list(out.glob("hang-*"))
    no_collective_noise(list(ranks.values()))
    np.testing.assert_array_equal(losses(out), undisturbed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "read_mode, workers",
    [("pread", 0), ("pread", 1), ("mmap-random", 1)],
    ids=["read in the rank", "read in a loader worker", "page fault of a memory map in a loader worker"],
)
def test_a_hung_read_names_its_rank_and_file_and_every_rank_exits_for_a_restart(corpus, tmp_path, read_mode, workers):
    """Rank 1's reads block for good at step 4. Within hang_s and a few seconds: rank 0 prints one line naming rank 1,
    the .bin and an offset in it, each rank writes its stacks (rank 1's with the reader's frame, in the rank or in its
    worker's read state), every rank exits with HANG_EXIT_CODE, no rank prints a collective's timeout or a traceback.
    The storage is released only after the ranks have given up (a process whose own thread is in the read finishes
    exiting then). Through a memory map, the read is a page fault inside the compiled gather: hangfs keeps the page
    cache (a map needs it), whose pages, rank 1's mapped ones too, are dropped as the reads block."""
    out = tmp_path / "run"
    blocked: list[float] = []
    with mounted_hangfs(Path(corpus).parent, tmp_path, page_cache=read_mode != "pread") as (mnt, control):
        drop = mnt / f"{Path(corpus).name}.bin" if read_mode != "pread" else None
        at_step(out, 3, lambda: block_until_reported(control, out, blocked, drop=drop))
        extra = {"data.num_workers": workers, "storage.read_mode": f'"{read_mode}"'}
        done = launch(corpus, out, mnt, tmp_path / "logs", **extra)
        ended = time.monotonic()
    ranks = trainkit.rank_logs(tmp_path / "logs")
    codes = re.findall(r"rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)", done.stderr)
    assert done.returncode != 0 and blocked, (done.stderr[-3000:], ranks)
    assert sorted(codes) == [("0", str(HANG_EXIT_CODE)), ("1", str(HANG_EXIT_CODE))], done.stderr[-3000:]
    assert ended - blocked[0] < HANG_S + 20, ended - blocked[0]
    lines = ranks[0].splitlines()
    assert len(lines) == 1, ranks[0]
    line = lines[0]
    assert line.startswith("corpusforge: error: storage hung at step "), line
    assert "rank 1 on " in line and f"in a read of {corpus}.bin at offset " in line, line
    offset = int(re.search(r" at offset (\d+) ", line).group(1))
    assert 0 <= offset < Path(f"{corpus}.bin").stat().st_size, line
    assert f"exits with {HANG_EXIT_CODE}" in line and "resumes from its last checkpoint" in line, line
    assert "rank 0 on" not in line, line
    step = int(re.search(r"at step (\d+)", line).group(1))
    dumps = {r: out / f"hang-step{step}-rank{r}.txt" for r in (0, 1)}
    assert all(p.exists() for p in dumps.values()), sorted(p.name for p in out.iterdir())
    stuck, waiting = dumps[1].read_text(), dumps[0].read_text()
    assert "stuck" in stuck.splitlines()[0] and "waiting" in waiting.splitlines()[0], (stuck, waiting)
    assert "in a read: pid " in stuck and f"{corpus}.bin" in stuck, stuck
    assert "Thread 0x" in stuck and "Thread 0x" in waiting, (stuck, waiting)  # faulthandler's dump of each thread
    # the frame of the read that hangs: in the rank's own dump, or in its loader worker's, which the dump holds
    frame = r"storage/readers.py\", line \d+ in _read_into" if read_mode == "pread" else r"data/gpt_dataset.py\", line"
    assert re.search(r'File ".*corpusforge/' + frame, stuck), stuck
    if workers:
        assert re.search(r"loader worker pid \d+:\n", stuck), stuck
    assert "all_reduce" in waiting or "distributed_c10d.py" in waiting, waiting  # rank 0 waits in the collective
    record = json.loads((out / "hang-rank1.json").read_text())
    assert record["rank"] == 1 and record["path"] == f"{corpus}.bin" and record["seconds"] >= HANG_S, record
    assert record["offset"] == offset, (record, line)
    assert not (out / "hang-rank0.json").exists()
    no_collective_noise(list(ranks.values()))


@pytest.mark.slow
def test_a_hung_job_restarted_by_torchrun_resumes_from_its_last_checkpoint_with_the_same_losses(
    corpus, hangfs, tmp_path, undisturbed
):
    """What `torchrun --max-restarts` (or `srun --requeue`, which runs the same command again) does: rank 1's reads
    block for good at step 5 (checkpoints every 2 steps), every rank exits 5; the storage comes back and torchrun
    starts the ranks again: they resume from the last checkpoint, the previous attempt's hang files do not end them,
    and the job finishes with the undisturbed run's losses, step for step, in one launch."""
    mnt, control = hangfs
    out, logs = tmp_path / "run", tmp_path / "logs"

    at_step(out, 5, lambda: block_until_reported(control, out))
    done = launch(corpus, out, mnt, logs, restarts=1, checkpoint_interval=2)
    ranks = {p.parent.parent.name + "/" + p.parent.name: p.read_text() for p in logs.glob("*/attempt_*/*/stderr.log")}
    assert done.returncode == 0, (done.stderr[-3000:], ranks)
    first = sorted(logs.glob("*/attempt_0/0/stderr.log"))
    assert first and "storage hung at step " in first[0].read_text(), ranks  # the first attempt ended on the hang
    resumed = sorted(logs.glob("*/attempt_1/0/stdout.log"))
    assert resumed and "resumed from" in resumed[0].read_text(), ranks
    assert not (out / "hang-reported.json").exists()
    np.testing.assert_array_equal(losses(out), undisturbed)


@pytest.mark.slow
def test_a_hung_checkpoint_write_names_its_rank_and_directory_and_every_rank_exits_for_a_restart(corpus, tmp_path):
    """Rank 1 sees the checkpoints' directory through hangfs, and its writes block from step 3 until the hang is
    reported: a save's shards stay unwritten (step 2's or step 4's, whichever is in flight), and the next save waits
    for them. Within hang_s and a few seconds: rank 0 (its own shards written, waiting in DCP's gather) prints one
    line naming rank 1 and the checkpoint's .tmp- directory, every rank writes its stacks and exits with
    HANG_EXIT_CODE, and the hung save is never published."""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(parents=True)
    with mounted_hangfs(checkpoints, tmp_path) as (mnt, control):
        blocked: list[float] = []
        at_step(out, 3, lambda: block_until_reported(control, out, blocked, "block-writes"))
        done = launch(corpus, out, mnt, tmp_path / "logs", view=checkpoints, checkpoint_interval=2)
        ended = time.monotonic()
        ranks = trainkit.rank_logs(tmp_path / "logs")
    codes = re.findall(r"rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)", done.stderr)
    assert done.returncode != 0 and blocked, (done.stderr[-3000:], ranks)
    assert sorted(codes) == [("0", str(HANG_EXIT_CODE)), ("1", str(HANG_EXIT_CODE))], (done.stderr[-3000:], ranks)
    assert ended - blocked[0] < HANG_S + 30, ended - blocked[0]
    (line,) = ranks[0].splitlines()
    assert line.startswith("corpusforge: error: storage hung at step "), line
    hung = re.search(rf"rank 1 on \S+ writing its shards of the checkpoint of step (\d+) in {checkpoints}/"
                     r"\.tmp-step_(\d{8}) for [\d.]+ s;", line)  # fmt: skip
    assert hung and int(hung.group(1)) == int(hung.group(2)) in (2, 4), line
    assert f"exits with {HANG_EXIT_CODE}" in line and "rank 0 on" not in line, line
    step = int(re.search(r"at step (\d+)", line).group(1))
    stuck, waiting = (out / f"hang-step{step}-rank{r}.txt" for r in (1, 0))
    assert "stuck" in stuck.read_text().splitlines()[0] and "waiting" in waiting.read_text().splitlines()[0]
    assert "filesystem.py" in stuck.read_text(), stuck.read_text()  # the frame of DCP's writer, in its thread
    record = json.loads((out / "hang-rank1.json").read_text())
    assert record["op"] == "write" and record["seconds"] >= HANG_S, record
    assert not (out / "hang-rank0.json").exists()
    published = [int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*")]
    assert all(s < int(hung.group(1)) for s in published), published  # the hung save is never a checkpoint
    no_collective_noise(list(ranks.values()))

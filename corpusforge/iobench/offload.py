"""bench-io's "offload" pattern: the disk traffic of a parallel.offload = "nvme" optimizer step, made by the step's
own code, so that a user sees what their disk gives it before training.

Each process holds the state files of one emulated rank (master weights, exp_avg, exp_avg_sq: corpusforge.train.
offload.state_files, `file_size` bytes in all, O_DIRECT where the file system takes it) and streams them as the
step does (nvme_optimizer.stream_chunks: a reader thread reads ahead into rotating aligned buffers, a writer thread
writes behind), chunks of `block_size` bytes per file, with no update in between: the disk's share of a step.
OFFLOAD_STEPS steps are timed after the files are made; three rows: what was read, written, and both, each over the
steps' wall time (reads and writes overlap, so the "step" row is the one to compare with seq-read and seq-write).

Example:
    corpusforge bench-io /nvme --pattern offload --block-size 8M --file-size 3G
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from corpusforge.iobench.patterns import Beat, Case, Phase, _code

OFFLOAD_STEPS = 2
BUFFER_SETS = 4  # as NvmeAdamW's default


def _files(case: Case, slot: int) -> Path:
    return Path(case.scratch) / f"offload-{slot}"


def prepare_offload(case: Case, slot: int, beat: Beat) -> None:
    """The emulated rank's three state files, reserved and written once (as a run's first step writes master)."""
    from corpusforge.train.offload.state_files import StateFile

    per_file = _per_file(case)
    where = _files(case, slot)
    where.mkdir(parents=True, exist_ok=True)
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        f, _ = StateFile.create(where / f"{kind}.bin", bytes(32), per_file, direct=case.direct)
        block = os.urandom(1 << 20)  # real bytes: reads of fallocated, never written extents do not reach the disk
        for off in range(0, per_file, len(block)):
            os.pwrite(f.fd, block[: per_file - off], 4096 + off)
        os.fsync(f.fd)
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        f.close()


def _per_file(case: Case) -> int:
    """Bytes of values in each of the three files: file_size / 3, whole chunks of block_size."""
    chunk = case.block_size
    return max(chunk, (case.config.file_size // 3) // chunk * chunk)


def measure_offload(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """OFFLOAD_STEPS streamed passes over the files: read ahead, write behind, no compute."""
    from corpusforge.train.offload.nvme_optimizer import KINDS, Chunk, stream_chunks
    from corpusforge.train.offload.state_files import AlignedBuffer, StateFile

    where, per_file, chunk = _files(case, slot), _per_file(case), case.block_size
    files = {k: StateFile(where / f"{k}.bin", *_open(where / f"{k}.bin", case.direct), bytes(32), per_file)
             for k in KINDS}  # fmt: skip
    chunks = [Chunk(off // 4, chunk // 4, ()) for off in range(0, per_file, chunk)]
    sets = [{k: AlignedBuffer(chunk) for k in KINDS} for _ in range(BUFFER_SETS)]
    read, write, both = Phase("read"), Phase("write"), Phase("step")

    def read_chunk(c: Chunk, bufs: dict) -> None:
        for k in KINDS:
            files[k].read_into(bufs[k].view[: c.length * 4], c.offset * 4)

    def write_chunk(c: Chunk, bufs: dict) -> None:
        for k in KINDS:
            files[k].write_from(bufs[k].view[: c.length * 4], c.offset * 4)

    with ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as writer:
        beat.phase(_code("step"))
        start = time.perf_counter()
        for _ in range(OFFLOAD_STEPS):
            t0 = time.perf_counter()
            beat.times[beat.local] = t0
            stream_chunks(chunks, sets, read_chunk, lambda c, bufs: None, write_chunk, reader, writer)
            beat.times[beat.local] = 0.0
            for phase in (read, write, both):
                phase.latencies.append(time.perf_counter() - t0)
        end = time.perf_counter()
    for s in sets:
        for b in s.values():
            b.close()
    note = files["master"].direct_note
    for f in files.values():
        f.close()
    moved = OFFLOAD_STEPS * 3 * per_file
    for phase, nbytes in ((read, moved), (write, moved), (both, 2 * moved)):
        phase.start, phase.end, phase.bytes, phase.ops = start, end, nbytes, OFFLOAD_STEPS
        phase.extra["io"] = note
    return [read, write, both]


def _open(path: Path, direct: bool) -> tuple[int, int, str]:
    """(fd, fd for the chunks' I/O, what it is) of an existing state file, as StateFile.create opens them."""
    from corpusforge.train.offload.state_files import _open_direct

    fd = os.open(path, os.O_RDWR)
    io_fd, note = _open_direct(path, fd) if direct else (fd, "buffered")
    return fd, io_fd, note


# runner.py's tables for this pattern, as patterns.PREPARE and MEASURE for the others
PREPARE = {"offload": prepare_offload}
MEASURE = {"offload": measure_offload}

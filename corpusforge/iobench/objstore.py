"""The read and write patterns against an object store URL (s3://bucket/prefix, any fsspec URL), with range reads.

An object store has no O_DIRECT, no page cache on the client, no mmap: seq-read is a run of ranged GETs of
`block_size` bytes, rand-read ranged GETs of `sample_size` at random offsets, seq-write one streamed (multipart)
upload timed until it completes (an S3 PUT is durable once it returns), metadata PUT / HEAD / GET / DELETE of
small objects, checkpoint one object per rank written and read back; replay and train read a dataset at a URL
through the loader's own ranged block cache (the synthetic one is uploaded first). The operations run in the
same watched worker processes as on a file system.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from corpusforge.iobench import patterns
from corpusforge.iobench.patterns import Beat, Case, Phase, checkpoint_shapes, filesystem


def _fs(case: Case):
    return filesystem(case.root, case.config.storage_options)


def _data(case: Case, slot: int) -> tuple[str, int, int]:
    c = case.config
    if c.layout == "shared":
        return f"{case.root}/data/shared-{case.slots}.bin", slot * c.file_size, c.file_size
    return f"{case.root}/data/file-{slot}.bin", 0, c.file_size


def prepare_read_object(case: Case, slot: int, beat: Beat) -> None:
    """Objects cannot be written in parts: in the shared layout, slot 0 writes the whole object."""
    path, offset, length = _data(case, slot)
    fs = _fs(case)
    if case.config.layout == "shared" and slot != 0:
        while not fs.exists(path + ".done"):
            time.sleep(0.05)
        return
    if fs.exists(path + ".done"):
        return
    size = offset + length if case.config.layout != "shared" else case.config.file_size * case.slots
    beat.times[beat.local] = time.perf_counter()
    fs.pipe_file(path, np.random.default_rng(case.config.seed + slot).bytes(size))
    fs.pipe_file(path + ".done", b"")
    beat.times[beat.local] = 0.0


def _ranged(case: Case, slot: int, beat: Beat, offsets: list[int], size: int) -> list[Phase]:
    fs = _fs(case)
    path = _data(case, slot)[0]
    phase = Phase("read")
    lat, times, me = phase.latencies, beat.times, beat.local
    beat.phase(patterns.PHASE_CODES.index("read"))
    deadline = time.perf_counter() + case.config.duration
    phase.start = time.perf_counter()
    for off in offsets:
        t0 = time.perf_counter()
        times[me] = t0
        phase.bytes += len(fs.cat_file(path, start=off, end=off + size))
        t1 = time.perf_counter()
        times[me] = 0.0
        lat.append(t1 - t0)
        if t1 > deadline:
            break
    phase.end = time.perf_counter()
    phase.ops = len(lat)
    return [phase]


def measure_seq_read(case: Case, slot: int, beat: Beat) -> list[Phase]:
    _, offset, length = _data(case, slot)
    bs = case.block_size
    return _ranged(case, slot, beat, list(range(offset, offset + length - bs + 1, bs)), bs)


def measure_rand_read(case: Case, slot: int, beat: Beat) -> list[Phase]:
    c = case.config
    _, offset, length = _data(case, slot)
    rng = np.random.default_rng(c.seed + 7919 * slot)
    offsets = (offset + rng.integers(0, length - c.sample_size + 1, c.rand_ops)).tolist()
    return _ranged(case, slot, beat, offsets, c.sample_size)


def _timed_upload(fs, path: str, chunks, phase: Phase, beat: Beat) -> None:
    """Stream `chunks` into one object; each write is an op, and so is the close that completes the upload."""
    times, me = beat.times, beat.local
    with fs.open(path, "wb") as f:
        for chunk in chunks:
            t0 = time.perf_counter()
            times[me] = t0
            phase.bytes += f.write(chunk)
            phase.latencies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        times[me] = t0
    phase.latencies.append(time.perf_counter() - t0)  # the close: the last part and the completion
    times[me] = 0.0


def measure_seq_write(case: Case, slot: int, beat: Beat) -> list[Phase]:
    c, bs = case.config, case.block_size
    block = np.random.default_rng(c.seed + slot).bytes(bs)
    phase = Phase("write")
    beat.phase(patterns.PHASE_CODES.index("write"))
    phase.start = time.perf_counter()
    _timed_upload(_fs(case), f"{case.scratch}/write-{slot}.bin", (block for _ in range(c.file_size // bs)), phase, beat)
    phase.end = time.perf_counter()
    phase.ops = len(phase.latencies)
    return [phase]


def measure_metadata(case: Case, slot: int, beat: Beat) -> list[Phase]:
    c, fs = case.config, _fs(case)
    names = [f"{case.scratch}/meta-{slot}/f{i:07d}" for i in range(c.metadata_files)]
    body = b"x" * c.metadata_file_size

    def create(p: str) -> int:
        fs.pipe_file(p, body)
        return len(body)

    def stat(p: str) -> int:
        fs.info(p)
        return 0

    def delete(p: str) -> int:
        fs.rm(p)
        return 0

    ops = (("create", create), ("stat", stat), ("open", lambda p: len(fs.cat_file(p))), ("delete", delete))
    return patterns.timed_phases(beat, ops, names)


def measure_checkpoint(case: Case, slot: int, beat: Beat) -> list[Phase]:
    c, fs = case.config, _fs(case)
    shapes = checkpoint_shapes(c.checkpoint_size, c.checkpoint_hidden)
    rng = np.random.default_rng(c.seed + slot)
    tensors = [rng.bytes(r * k * 4) for r, k in shapes]
    path = f"{case.scratch}/ckpt-rank{slot:05d}.bin"
    write, read = Phase("write"), Phase("read")
    beat.phase(patterns.PHASE_CODES.index("write"))
    write.start = time.perf_counter()
    _timed_upload(fs, path, tensors, write, beat)
    write.end = time.perf_counter()
    write.extra["durable_s"] = write.end - write.start  # an object is durable once its upload completes
    beat.phase(patterns.PHASE_CODES.index("read"))
    back: list[bytes] = []

    def get(span: tuple[int, int]) -> int:  # one tensor, by a ranged GET
        back.append(fs.cat_file(path, start=span[0], end=span[1]))
        return len(back[-1])

    ends = list(itertools.accumulate(len(t) for t in tensors))
    read.start = time.perf_counter()
    patterns.timed_ops(read, beat, get, zip([0, *ends[:-1]], ends))
    read.end = time.perf_counter()
    if back != tensors:
        raise OSError(f"{path}: the checkpoint read back differs from what was written")
    write.ops, read.ops = len(write.latencies), len(read.latencies)
    return [write, read]


# replay and train are the loader's own reads, whatever the storage: the file system's table, with the object
# store's own functions for the rest
PREPARE = patterns.PREPARE | {"seq-read": prepare_read_object, "rand-read": prepare_read_object}
MEASURE = patterns.MEASURE | {
    "seq-read": measure_seq_read,
    "rand-read": measure_rand_read,
    "seq-write": measure_seq_write,
    "metadata": measure_metadata,
    "checkpoint": measure_checkpoint,
}


def remove(url: str, options) -> None:
    """Remove everything under `url` (the run's objects); the runner calls it in a child process."""
    fs = filesystem(url, options)
    if fs.exists(url):
        fs.rm(url, recursive=True)

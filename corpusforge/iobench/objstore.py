"""The read and write patterns against an object store URL (s3://bucket/prefix, any fsspec URL), with range reads.

An object store has no O_DIRECT, no page cache on the client, no mmap: seq-read is a run of ranged GETs of
`block_size` bytes, rand-read ranged GETs of `sample_size` at random offsets, seq-write one streamed (multipart)
upload timed until it completes (an S3 PUT is durable once it returns), metadata PUT / HEAD / GET / DELETE of
small objects, checkpoint one object per rank written and read back; replay and train read a dataset at a URL
through the loader's own ranged block cache (the synthetic one is uploaded first). The operations run in the
same watched worker processes as on a file system.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from corpusforge.errors import MissingExtraError
from corpusforge.iobench import patterns
from corpusforge.iobench.patterns import Beat, Case, Phase, checkpoint_shapes

if TYPE_CHECKING:
    from corpusforge.iobench.runner import Run


def filesystem(url: str, options: tuple[tuple[str, str], ...]):
    """A fresh fsspec file system for `url` (workers are forked: never a cached instance), made the way
    corpusforge.storage makes the loaders' (endpoint_url for S3-compatible stores such as Ceph RGW)."""
    from corpusforge.storage import filesystem as make

    try:
        return make(url, dict(options))
    except ImportError as e:
        raise MissingExtraError(f"{url}: {e}") from None


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
    ops = (("create", lambda p: fs.pipe_file(p, body)), ("stat", fs.info), ("open", fs.cat_file), ("delete", fs.rm))
    phases = []
    for name, op in ops:
        phase = Phase(name)
        beat.phase(patterns.PHASE_CODES.index(name))
        phase.start = time.perf_counter()
        for p in names:
            t0 = time.perf_counter()
            beat.times[beat.local] = t0
            out = op(p)
            phase.latencies.append(time.perf_counter() - t0)
            beat.times[beat.local] = 0.0
            phase.bytes += len(body) if name == "create" else len(out) if name == "open" else 0
        phase.end = time.perf_counter()
        phase.ops = len(phase.latencies)
        phases.append(phase)
    return phases


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
    read.start, offset, back = time.perf_counter(), 0, []
    for t in tensors:
        t0 = time.perf_counter()
        beat.times[beat.local] = t0
        back.append(fs.cat_file(path, start=offset, end=offset + len(t)))
        read.latencies.append(time.perf_counter() - t0)
        beat.times[beat.local] = 0.0
        offset += len(t)
        read.bytes += len(back[-1])
    read.end = time.perf_counter()
    if back != tensors:
        raise OSError(f"{path}: the checkpoint read back differs from what was written")
    write.ops, read.ops = len(write.latencies), len(read.latencies)
    return [write, read]


# replay and train are the loader's own reads, whatever the storage: the same functions as on a file system
PREPARE = {
    "seq-read": prepare_read_object,
    "rand-read": prepare_read_object,
    "replay": patterns.prepare_loader,
    "train": patterns.prepare_loader,
}
MEASURE = {
    "seq-read": measure_seq_read,
    "rand-read": measure_rand_read,
    "seq-write": measure_seq_write,
    "metadata": measure_metadata,
    "checkpoint": measure_checkpoint,
    "replay": patterns.measure_replay,
    "train": patterns.measure_train,
}


def _remove(url: str, options) -> None:
    fs = filesystem(url, options)
    if fs.exists(url):
        fs.rm(url, recursive=True)


def run_object_store(run: Run, url: str) -> None:
    """Every configured pattern on `url`; the run's objects live under URL/.corpusforge-bench-<id>/ and are removed."""
    import multiprocessing as mp
    import shutil
    import uuid

    from corpusforge.iobench.runner import PathInfo

    c = run.config
    root = run.ranks.broadcast(f"{url.rstrip('/')}/.corpusforge-bench-{uuid.uuid4().hex[:12]}")
    info = PathInfo(
        url,
        url.split("://", 1)[0],
        False,
        "not applicable (object store)",
        0,
        ["object store: ranged GETs through fsspec, no client page cache"],
    )
    run.paths.append(info)
    try:
        for pattern in c.patterns:
            if not run.run_pattern(url, root, info, pattern):
                break
    finally:
        run.ranks.barrier()
        if run.ranks.rank == 0:
            proc = mp.get_context("fork").Process(target=_remove, args=(root, c.storage_options), daemon=True)
            proc.start()
            proc.join(c.hang_seconds)
            if proc.is_alive() or proc.exitcode:
                proc.kill()
                run.leftovers.append(root)
        shutil.rmtree(patterns.local_dir(root), ignore_errors=True)  # the loaders' index caches, on every rank

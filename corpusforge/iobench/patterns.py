"""The I/O patterns, as they run inside one worker process: prepare (not timed), then measure (timed per op).

Each pattern is a pair of functions over a Case and the worker's global slot (rank * procs + local index).
`prepare` writes what the pattern reads; `measure` returns Phases: bytes, ops, the span, and one latency per op.
Before every operation the worker stores its start time in `beat[slot]` (CLOCK_MONOTONIC, shared memory) and
clears it after, so the watchdog in the parent process sees an operation that does not return.

Files: `root/data/` holds the files the read patterns read (kept for the run, shared by its cases);
`scratch` is a per-case directory that the runner removes after the case.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.errors import MissingExtraError
from corpusforge.fsutil import is_url
from corpusforge.iobench import mlperf
from corpusforge.iobench.config import BenchConfig
from corpusforge.storage.pagecache import drop_page_cache

ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the logical block size; 4 KiB covers all disks
FILL_CHUNK = 1 << 20  # bytes per write when preparing read files


@dataclass(frozen=True)
class Case:
    """One measured unit: a pattern at one block size and process count, on one path."""

    pattern: str
    root: str  # the run directory on the measured path
    scratch: str  # per-case directory, removed after the case
    procs: int  # processes per rank
    world: int  # ranks
    block_size: int
    direct: bool  # O_DIRECT in effect (the runner checked that the file system takes it)
    config: BenchConfig
    accelerators: int = 0  # train: emulated accelerators (== procs * world)

    @property
    def slots(self) -> int:
        return self.procs * self.world


@dataclass
class Phase:
    """What one process measured in one phase of a pattern."""

    name: str
    bytes: int = 0
    ops: int = 0
    start: float = 0.0
    end: float = 0.0
    latencies: array = field(default_factory=lambda: array("d"))  # seconds, one per op
    extra: dict[str, Any] = field(default_factory=dict)


class Beat:
    """The worker's side of the watchdog: which phase it is in and when its current op started (0: idle); and the
    barrier of the case's processes on this rank, for patterns that start their steps together."""

    def __init__(self, times, phases, slot: int, barrier=None) -> None:
        self.times, self.phases, self.local, self.barrier = times, phases, slot, barrier

    def phase(self, code: int) -> None:
        self.phases[self.local] = code

    def sync(self) -> None:
        """Wait for the case's other processes on this rank (idle for the watchdog: a hung peer is its verdict)."""
        if self.barrier is not None:
            self.barrier.wait()


PHASE_CODES = ["prepare", "read", "write", "fsync", "create", "stat", "open", "delete", "step", "cleanup"]


def _code(name: str) -> int:
    return PHASE_CODES.index(name)


def timed_ops(phase: Phase, beat: Beat, op: Callable[[Any], int], items: Iterable[Any]) -> None:
    """`op(item)` for every item, each one timed op: the beat holds its start while it runs (the watchdog's view),
    the phase gets its bytes (what `op` returns) and its latency. For ops of microseconds, write the loop bare
    instead (see _timed_reads).

    Example:
        >>> timed_ops(phase, beat, lambda t: f.write(memoryview(t).cast("B")), tensors)
    """
    times, me, latencies = beat.times, beat.local, phase.latencies
    for item in items:
        t0 = time.perf_counter()
        times[me] = t0
        phase.bytes += op(item)
        t1 = time.perf_counter()
        times[me] = 0.0
        latencies.append(t1 - t0)


def timed_phases(beat: Beat, ops: Iterable[tuple[str, Callable[[Any], int]]], items: list[Any]) -> list[Phase]:
    """One phase per (name, op): `op` over every item with timed_ops (metadata: create, stat, open, delete)."""
    phases = []
    for name, op in ops:
        phase = Phase(name)
        beat.phase(_code(name))
        phase.start = time.perf_counter()
        timed_ops(phase, beat, op, items)
        phase.end = time.perf_counter()
        phase.ops = len(phase.latencies)
        phases.append(phase)
    return phases


# -- files --------------------------------------------------------------------------------------------------------


def aligned_buffer(size: int, fill_seed: int | None = None) -> mmap.mmap:
    """A page-aligned buffer (anonymous mmap), as O_DIRECT needs; optionally filled with random bytes."""
    buf = mmap.mmap(-1, max(size, 1))
    if fill_seed is not None:
        buf[:size] = np.random.default_rng(fill_seed).bytes(size)
    return buf


def read_region(case: Case, slot: int) -> tuple[str, int, int]:
    """(file, offset, length) that `slot` reads: its own file, or its slice of the shared file."""
    c = case.config
    data = Path(case.root, "data")
    if c.layout == "shared":
        return str(data / f"shared-{case.slots}.bin"), slot * c.file_size, c.file_size
    return str(data / f"file-{slot}.bin"), 0, c.file_size


def _fill(path: str, offset: int, length: int, seed: int, beat: Beat) -> None:
    """Write `length` random bytes at `offset` of `path` (created if missing), durably."""
    chunk = np.random.default_rng(seed).bytes(min(FILL_CHUNK, length))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        done = 0
        while done < length:
            n = min(len(chunk), length - done)
            beat.times[beat.local] = time.perf_counter()
            os.pwrite(fd, chunk[:n], offset + done)
            done += n
        os.fsync(fd)
    finally:
        beat.times[beat.local] = 0.0
        os.close(fd)


def prepare_read_file(case: Case, slot: int, beat: Beat) -> None:
    path, offset, length = read_region(case, slot)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    marker = Path(f"{path}.{slot}.done")  # a region is reused by later cases only once it was written whole
    if not marker.exists():
        _fill(path, offset, length, case.config.seed + slot, beat)
        marker.touch()
    if case.config.drop_cache:
        drop_page_cache(path)


# -- seq-read, rand-read, seq-write --------------------------------------------------------------------------------


def _open_flags(case: Case, flags: int) -> int:
    return flags | (os.O_DIRECT if case.direct else 0)


def _open_read(case: Case, path: str, advice: int) -> int:
    """Open for reading and state the access pattern to the kernel, as fio does by default (fadvise_hint=1):
    SEQUENTIAL doubles the readahead window, RANDOM turns readahead off."""
    fd = os.open(path, _open_flags(case, os.O_RDONLY))
    os.posix_fadvise(fd, 0, 0, advice)
    return fd


def _timed_reads(case: Case, path: str, offsets, size: int, advice: int, beat: Beat) -> list[Phase]:
    """pread `size` bytes at each offset into one aligned buffer, one latency per read; stops at `duration`.
    The loop is kept bare (local names, no allocation): at 4 KiB from the page cache an op takes ~2 us."""
    buf = aligned_buffer(size)
    view = [memoryview(buf)[:size]]
    phase = Phase("read")
    append, times, me = phase.latencies.append, beat.times, beat.local
    clock, preadv, got = time.perf_counter, os.preadv, 0
    fd = _open_read(case, path, advice)
    beat.phase(_code("read"))
    deadline = clock() + case.config.duration
    phase.start = clock()
    try:
        for off in offsets:
            t0 = clock()
            times[me] = t0
            got += preadv(fd, view, off)
            t1 = clock()
            append(t1 - t0)
            if t1 > deadline:
                break
    finally:
        times[me] = 0.0
        os.close(fd)
    phase.end = clock()
    phase.bytes, phase.ops = got, len(phase.latencies)
    return [phase]


def measure_seq_read(case: Case, slot: int, beat: Beat) -> list[Phase]:
    path, offset, length = read_region(case, slot)
    bs = case.block_size
    return _timed_reads(case, path, range(offset, offset + length - bs + 1, bs), bs, os.POSIX_FADV_SEQUENTIAL, beat)


def measure_rand_read(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """Reads of one sample at random 4 KiB-aligned offsets (fio's randread with blockalign=4k, norandommap)."""
    c = case.config
    path, offset, length = read_region(case, slot)
    size = -(-c.sample_size // ALIGN) * ALIGN if case.direct else c.sample_size  # O_DIRECT reads whole blocks
    rng = np.random.default_rng(c.seed + 7919 * slot)
    offsets = (offset + rng.integers(0, (length - size) // ALIGN + 1, c.rand_ops) * ALIGN).tolist()
    return _timed_reads(case, path, offsets, size, os.POSIX_FADV_RANDOM, beat)


def write_target(case: Case, slot: int) -> tuple[str, int, int]:
    c = case.config
    if c.layout == "shared":
        return os.path.join(case.scratch, "shared-write.bin"), slot * c.file_size, c.file_size
    return os.path.join(case.scratch, f"write-{slot}.bin"), 0, c.file_size


def measure_seq_write(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """Sequential writes of `block_size`, then one fsync, timed as the last op: the figure is durable throughput."""
    path, offset, length = write_target(case, slot)
    bs = case.block_size
    buf = aligned_buffer(bs, fill_seed=case.config.seed + slot)
    view = memoryview(buf)[:bs]
    phase = Phase("write")
    lat, times, me = phase.latencies, beat.times, beat.local
    fd = os.open(path, _open_flags(case, os.O_WRONLY | os.O_CREAT), 0o644)
    beat.phase(_code("write"))
    phase.start = time.perf_counter()
    try:
        for off in range(offset, offset + length - bs + 1, bs):
            t0 = time.perf_counter()
            times[me] = t0
            n = os.pwrite(fd, view, off)
            t1 = time.perf_counter()
            times[me] = 0.0
            lat.append(t1 - t0)
            phase.bytes += n
        beat.phase(_code("fsync"))
        t0 = time.perf_counter()
        times[me] = t0
        os.fsync(fd)
        phase.extra["fsync_s"] = time.perf_counter() - t0
        times[me] = 0.0
    finally:
        os.close(fd)
    phase.end = time.perf_counter()
    phase.ops = len(lat)
    return [phase]


# -- metadata --------------------------------------------------------------------------------------------------------


def measure_metadata(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """create (+ write a small body), stat, open (+ read), delete: each of `metadata_files` files, one op each."""
    c = case.config
    folder = os.path.join(case.scratch, f"meta-{slot}")
    os.makedirs(folder, exist_ok=True)
    names = [os.path.join(folder, f"f{i:07d}") for i in range(c.metadata_files)]
    body = b"x" * c.metadata_file_size

    def create(p: str) -> int:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, body)
        os.close(fd)
        return len(body)

    def stat(p: str) -> int:
        os.stat(p)
        return 0

    def read(p: str) -> int:
        fd = os.open(p, os.O_RDONLY)
        n = len(os.read(fd, max(len(body), 1)))
        os.close(fd)
        return n

    def delete(p: str) -> int:
        os.unlink(p)
        return 0

    return timed_phases(beat, (("create", create), ("stat", stat), ("open", read), ("delete", delete)), names)


# -- checkpoint -------------------------------------------------------------------------------------------------------


def checkpoint_shapes(total_bytes: int, hidden: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Shapes of a GPT layer's weights ((h, 3h) qkv, (h, h) proj, (h, 4h) fc1, (4h, h) fc2), repeated up to
    `total_bytes`; the last tensor is cut short so the total is exact to a row."""
    h = hidden
    layer = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
    shapes, left, i = [], total_bytes, 0
    while left >= h * itemsize:
        rows, cols = layer[i % len(layer)]
        rows = min(rows, left // (cols * itemsize)) if left < rows * cols * itemsize else rows
        if rows == 0:
            cols, rows = h, left // (h * itemsize)
        shapes.append((rows, cols))
        left -= rows * cols * itemsize
        i += 1
    return shapes


def own_session() -> None:
    """Make this worker process a session of its own, as fio makes every job process (backend.c, thread_main:
    setsid()). Linux's autogroup scheduler (CONFIG_SCHED_AUTOGROUP, kernel.sched_autogroup_enabled=1, the default
    of most distributions' kernels) shares the CPU fairly between sessions before it shares it between processes:
    on a machine that other sessions keep busy, 8 checkpoint writers in bench-io's one session would share one
    session's slice, while 8 fio jobs get eight, and a buffered write of a checkpoint is mostly the CPU copying it
    into the page cache. Measured (docs/bench-io.md): 8 writers on 2 busy cores spent 45-90% of each checkpoint
    runnable and waiting for a CPU. On an idle node this changes nothing. The worker still ends with bench-io
    (die_with_parent) and ignores SIGINT as before; the parent still kills it by pid.

    Example (runner._worker, first thing in every worker forked for a case, whatever the pattern):
        >>> own_session()
    """
    try:
        os.setsid()
    except PermissionError:  # already a process group leader (a worker started some other way): leave it
        pass


def measure_checkpoint(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """Write the tensors of one rank's shard, fsync (the time until durable), evict, read back and compare.
    With `mlperf`: MLPerf Storage's checkpointing workload instead (measure_mlperf_checkpoints)."""
    c = case.config
    if c.mlperf:
        return measure_mlperf_checkpoints(case, slot, beat)
    shapes = checkpoint_shapes(c.checkpoint_size, c.checkpoint_hidden)
    rng = np.random.default_rng(c.seed + slot)
    tensors = [np.frombuffer(rng.bytes(r * k * 4), dtype=np.float32).reshape(r, k) for r, k in shapes]
    path = os.path.join(case.scratch, f"ckpt-rank{slot:05d}.bin")
    times, me = beat.times, beat.local
    write, sync, read = Phase("write"), Phase("fsync"), Phase("read")
    with open(path, "wb", buffering=0) as f:
        beat.phase(_code("write"))
        write.start = time.perf_counter()
        timed_ops(write, beat, lambda t: f.write(memoryview(t).cast("B")), tensors)
        write.end = sync.start = time.perf_counter()
        beat.phase(_code("fsync"))
        times[me] = sync.start
        os.fsync(f.fileno())
        sync.end = time.perf_counter()
        times[me] = 0.0
        sync.latencies.append(sync.end - sync.start)
        sync.bytes = write.bytes
    write.extra["durable_s"] = sync.end - write.start
    if c.drop_cache:
        drop_page_cache(path)
    out = [np.empty_like(t) for t in tensors]
    with open(path, "rb", buffering=0) as f:
        beat.phase(_code("read"))
        read.start = time.perf_counter()
        timed_ops(read, beat, lambda o: f.readinto(memoryview(o).cast("B")), out)
        read.end = time.perf_counter()
    if not all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(tensors, out)):  # NaN-safe
        raise OSError(f"{path}: the checkpoint read back differs from what was written")
    for p in (write, sync, read):
        p.ops = len(p.latencies)
    return [write, sync, read]


def _write_file(path: str, size: int, view: memoryview, phase: Phase, beat: Beat) -> None:
    """`size` bytes of `view` over and over in requests of len(view), then fsync (timed as one more op)."""
    lat, times, me, bs = phase.latencies, beat.times, beat.local, len(view)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, bs):
            t0 = time.perf_counter()
            times[me] = t0
            phase.bytes += os.pwrite(fd, view[: min(bs, size - off)], off)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        times[me] = t0
        os.fsync(fd)
        lat.append(time.perf_counter() - t0)
    finally:
        times[me] = 0.0
        os.close(fd)


def _read_file(path: str, size: int, buf: mmap.mmap, expect: memoryview, phase: Phase, beat: Beat) -> None:
    """Read `path` whole in requests of len(buf) (buffered, readahead doubled, as fio's fadvise_hint); its last
    request must hold what was written there."""
    lat, times, me, bs = phase.latencies, beat.times, beat.local, len(expect)
    view = memoryview(buf)[:bs]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        n = 0
        for off in range(0, size, bs):
            t0 = time.perf_counter()
            times[me] = t0
            n = os.preadv(fd, [view[: min(bs, size - off)]], off)
            lat.append(time.perf_counter() - t0)
            phase.bytes += n
    finally:
        times[me] = 0.0
        os.close(fd)
    # numpy's compare is a memcmp-like loop; memoryview's != unpacks byte by byte (2.5 ms per MiB), CPU that 8
    # readers on a busy machine would take from the timed window
    if phase.bytes and not np.array_equal(np.frombuffer(view, np.uint8, n), np.frombuffer(expect, np.uint8, n)):
        raise OSError(f"{path}: the checkpoint read back differs from what was written")


def mlperf_folder(case: Case, index: int) -> str:
    """Checkpoint `index` (0-based), named as DLIO names it."""
    return os.path.join(case.scratch, f"global_epoch1_step{index + 1}")


def _checkpoint_phase(
    name: str, index: int, beat: Beat, files, each: Callable[[str, int, Phase], None], pause: float
) -> Phase:
    """One checkpoint of one rank: after `pause` seconds of emulated compute every process starts it together
    (DLIO's compute, then its barrier); the span is this rank's."""
    phase = Phase(name, extra={"checkpoint": index})
    time.sleep(pause)
    beat.sync()
    beat.phase(_code(name))
    phase.start = time.perf_counter()
    for path, size in files:
        each(path, size, phase)
    phase.end = time.perf_counter()
    phase.ops = len(phase.latencies)
    return phase


def measure_mlperf_checkpoints(case: Case, slot: int, beat: Beat) -> list[Phase]:
    """MLPerf Storage v2.0's checkpointing (iobench/mlperf.py): this slot is rank `slot` of the model's layout and
    writes its files of `mlperf_checkpoints` checkpoints, each file fsynced; then the page cache is dropped and
    the checkpoints are read back in the same order. One phase per checkpoint, write and read."""
    c = case.config
    bs, pause = case.block_size, c.mlperf_pause
    files = mlperf.MODELS[c.mlperf].rank_files(slot, c.scale)
    buf = aligned_buffer(bs, fill_seed=c.seed + slot)
    data = memoryview(buf)[:bs]
    per_ckpt = []
    for i in range(c.mlperf_checkpoints):
        folder = mlperf_folder(case, i)
        os.makedirs(folder, exist_ok=True)
        per_ckpt.append([(os.path.join(folder, f"{name}.pt"), size) for name, size in files])
    phases = [
        _checkpoint_phase("write", i, beat, per_ckpt[i], lambda p, n, ph: _write_file(p, n, data, ph, beat), pause)
        for i in range(c.mlperf_checkpoints)
    ]
    beat.sync()  # the rules: every write done, then the cache cleared, then the reads
    if c.drop_cache:
        for path, _ in (f for ckpt in per_ckpt for f in ckpt):
            drop_page_cache(path)
    into = aligned_buffer(bs)
    phases += [
        _checkpoint_phase("read", i, beat, per_ckpt[i], lambda p, n, ph: _read_file(p, n, into, data, ph, beat), pause)
        for i in range(c.mlperf_checkpoints)
    ]
    return phases


# -- replay and train: the real loader ---------------------------------------------------------------------------------


def filesystem(url: str, options: tuple[tuple[str, str], ...]):
    """A fresh fsspec file system for `url` (workers are forked: never a cached instance), made the way
    corpusforge.storage makes the loaders' (endpoint_url for S3-compatible stores such as Ceph RGW)."""
    from corpusforge.storage import filesystem as make

    try:
        return make(url, dict(options))
    except ImportError as e:
        raise MissingExtraError(f"{url}: {e}") from None


def dataset_prefix(case: Case) -> str:
    return case.config.dataset or os.path.join(case.root, "data", "synthetic_text_document")


def local_dir(root: str) -> str:
    """Where a run keeps files that must be local (the loader's index caches): its run directory, or for an
    object-store run a directory of the same name under the system's temporary directory."""
    if not is_url(root):
        return os.path.join(root, "data")
    return os.path.join(tempfile.gettempdir(), os.path.basename(root.rstrip("/")))


def _write_synthetic(prefix: str, tokens: int, seed: int) -> None:
    from corpusforge.indexed import IndexedDatasetWriter

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 4000, max(1, tokens // 2000) + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(rng.integers(0, 50000, int(lengths.sum()), dtype=np.uint16), lengths)


def make_synthetic_dataset(prefix: str, tokens: int, seed: int, storage_options: tuple = ()) -> None:
    """A uint16 token dataset of documents 100..4000 tokens long, for replay when the user names none; a URL
    prefix gets it written locally, then uploaded (.bin first: a reader finds the .idx only once both are there).

    >>> make_synthetic_dataset("/tmp/x/synthetic_text_document", 200_000, seed=1)
    """
    from corpusforge.indexed import exists

    if not is_url(prefix):
        if not exists(prefix):
            _write_synthetic(prefix, tokens, seed)
        return
    fs = filesystem(prefix, storage_options)
    if fs.exists(f"{prefix}.idx"):
        return
    with tempfile.TemporaryDirectory(prefix="corpusforge-bench-") as tmp:
        local = os.path.join(tmp, os.path.basename(prefix))
        _write_synthetic(local, tokens, seed)
        for ext in (".bin", ".idx"):
            fs.put_file(local + ext, prefix + ext)


def _loader(case: Case, slot: int, consumers: int):
    """Rank `slot` of `consumers` over the dataset, as a training job would build it (an fsspec URL is read
    through the loader's ranged block cache, with the run's storage options)."""
    from corpusforge.data import StorageConfig, build_gpt_datasets, make_loader

    c = case.config
    needed = c.steps * c.micro_batch * consumers
    storage = StorageConfig(block_size=c.remote_block_size, storage_options=dict(c.storage_options))
    train, _, _ = build_gpt_datasets(
        dataset_prefix(case),
        seq_length=c.seq_length,
        split="1,0,0",
        seed=c.seed,
        num_samples=(needed, None, None),
        cache_dir=os.path.join(local_dir(case.root), "index-cache"),
        storage=storage,
    )
    return make_loader(train, c.micro_batch, dp_rank=slot, dp_world_size=consumers, num_workers=c.loader_workers)


def measure_replay(case: Case, slot: int, beat: Beat, compute: float = 0.0) -> list[Phase]:
    """The loader's own reads, batch by batch; with `compute` > 0 each step also sleeps (train emulation)."""
    c = case.config
    loader = _loader(case, slot, case.slots)
    itemsize = loader.dataset.indexed.dtype.itemsize if hasattr(loader.dataset, "indexed") else 2
    batches = iter(loader)
    if c.drop_cache and not is_url(dataset_prefix(case)):  # a remote dataset starts with an empty block cache
        drop_page_cache(f"{dataset_prefix(case)}.bin")
    phase = Phase("step")
    lat, times, me = phase.latencies, beat.times, beat.local
    beat.phase(_code("read"))
    phase.start = time.perf_counter()
    first_end = phase.start
    for step in range(c.steps):
        t0 = time.perf_counter()
        times[me] = t0
        batch = next(batches)
        t1 = time.perf_counter()
        times[me] = 0.0
        lat.append(t1 - t0)
        phase.bytes += int(batch["tokens"].shape[0]) * (c.seq_length + 1) * itemsize  # what the gather read
        phase.extra["samples"] = phase.extra.get("samples", 0) + int(batch["tokens"].shape[0])
        if compute:
            time.sleep(compute)
        if step == 0:
            first_end = time.perf_counter()
    phase.end = time.perf_counter()
    phase.ops = len(lat)
    phase.extra["tokens"] = phase.extra["samples"] * c.seq_length
    reader = getattr(getattr(loader.dataset, "indexed", None), "reader", None)
    blocks = getattr(reader, "blocks", None)  # a remote .bin's block cache (storage.RemoteBinReader)
    if blocks is not None and c.loader_workers == 0:  # with workers, each counts in its own process
        phase.extra["fetched_bytes"], phase.extra["requests"] = blocks.bytes_fetched, blocks.requests
    if compute:
        # MLPerf Storage / DLIO accelerator utilisation: compute time over wall time, the first step left out.
        phase.extra["utilization"] = compute * (c.steps - 1) / max(phase.end - first_end, 1e-9)
    return [phase]


def measure_train(case: Case, slot: int, beat: Beat) -> list[Phase]:
    return measure_replay(case, slot, beat, compute=case.config.compute_time)


def prepare_loader(case: Case, slot: int, beat: Beat) -> None:
    import torch.utils.data  # noqa: F401 - imported now, not inside the first timed step

    _loader(case, slot, case.slots)  # builds (or waits for) the index cache before the timed part


PREPARE = {
    "seq-read": prepare_read_file,
    "rand-read": prepare_read_file,
    "replay": prepare_loader,
    "train": prepare_loader,
}
MEASURE = {
    "seq-read": measure_seq_read,
    "rand-read": measure_rand_read,
    "seq-write": measure_seq_write,
    "metadata": measure_metadata,
    "checkpoint": measure_checkpoint,
    "replay": measure_replay,
    "train": measure_train,
}

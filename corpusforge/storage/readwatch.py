"""Which read of a .bin each process is in right now, and how long this process's reads have taken: what a
watchdog (corpusforge.train.watchdog) needs to name a read that hangs (file, offset, bytes, since when) and to
compare it with the storage's p50/p99 so far.

The readers of the seam (pread, O_DIRECT, remote blocks) call `begin`/`advance`/`end` around their reads. A copy out
of a memory map (a page fault that a hung storage never answers, inside compiled code) is marked from inside its
kernel: `slot_for(path)` is the process's slot naming that file, which the kernel passes to the compiled
`mark_begin`/`mark_end` (readwatch_kernels.py) and into whose OFFSET word it stores each piece's byte offset before
copying it. Each process writes only its own slot: a few int64 stores and two clock reads per read, no lock, no
system call. A slot
lives in process memory until a watchdog calls `share(path)`: then the slots are a small file in /dev/shm (path in
the environment, CORPUSFORGE_READ_SLOTS) that DataLoader workers, forked or spawned after it, map and claim one
slot each of, so the rank's main process sees where its workers are stuck.

Slot layout (int64 words): pid, start_ns (CLOCK_MONOTONIC, system-wide; 0: in no read), offset (bytes, where the
read is now), nbytes (of the whole read_spans call), reads (completed), then HIST buckets of read durations at a
quarter octave each (bucket b holds durations in [2**(b/4), 2**((b+1)/4)) microseconds), then PATH_BYTES of the
file's path, NUL-terminated.

Example:
    >>> t = begin("/data/a_text_document.bin", 4096, 8192)
    >>> current()[0]["path"], current()[0]["offset"]
    ('/data/a_text_document.bin', 4096)
    >>> end(t); percentiles_ms()["reads"]
    1
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import sys
import time
from typing import Any

import numpy as np

from corpusforge import indexed

ENV = "CORPUSFORGE_READ_SLOTS"
PID, START, OFFSET, NBYTES, READS = range(5)
HIST = 160  # quarter octaves from 1 us: up to 2**40 us (12 days)
HEAD = 5
PATH_BYTES = 512
WORDS = HEAD + HIST + PATH_BYTES // 8
SLOTS = 64  # the rank's main process and up to 63 loader workers; more workers share the last slot's fate: none


class _Slots:
    """This process's view of the slots (one array of SLOTS x WORDS int64) and the slot it writes."""

    def __init__(self, path: str | None) -> None:
        self.pid, self.path, self.last_location = os.getpid(), path, None
        if path is None:
            self.words = np.zeros((1, WORDS), np.int64)
            self.mine = self.words[0]
            self.mine[PID] = self.pid
            self.name_view = memoryview(self.mine[HEAD + HIST :]).cast("B")
            return
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, SLOTS * WORDS * 8)
            self.words = np.frombuffer(self.map, np.int64).reshape(SLOTS, WORDS)
            fcntl.flock(fd, fcntl.LOCK_EX)  # workers start together: one claim at a time
            free = [i for i in range(SLOTS) if self.words[i, PID] in (0, self.pid)]
            self.mine = self.words[free[0]] if free else np.zeros(WORDS, np.int64)  # no slot left: unwatched
            self.mine[:] = 0
            self.mine[PID] = self.pid
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the map's own copy of the descriptor would keep it held
            os.close(fd)
        self.name_view = memoryview(self.mine[HEAD + HIST :]).cast("B")  # the slot's path bytes (_name)


_state: _Slots | None = None


def _forget() -> None:
    """In a forked child (a DataLoader worker): its first read claims a slot of its own (slot_for checks no pid)."""
    global _state
    _state = None


os.register_at_fork(after_in_child=_forget)


def _slots() -> _Slots:
    global _state
    if _state is None or _state.pid != os.getpid():  # first read of this process, or a forked worker's
        _state = _Slots(os.environ.get(ENV))
    return _state


# The NUL-terminated bytes of each location named so far (a blend names thousands; a few MB at most).
_ENCODED: dict[Any, bytes] = {}


def _name(s: _Slots, location: Any) -> None:
    """Write `location` into the slot's path bytes: once per file switch, not per read, but a blend's batch switches
    files up to once a sample (~0.2 us so, from bytes encoded once, through a memoryview; ~2.7 us as numpy stores)."""
    raw = _ENCODED.get(location)
    if raw is None:
        raw = _ENCODED[location] = os.fsencode(os.fspath(location))[: PATH_BYTES - 1] + b"\0"
    s.name_view[: len(raw)] = raw
    s.last_location = location


def slot_for(location: Any) -> np.ndarray:
    """This process's slot (WORDS int64), naming `location` as the file of the reads marked in it next: what a
    compiled copy out of a memory map marks with mark_begin/mark_end and stores its offsets into. ~0.1 us when the
    file is the last one named (a copy per sample calls it).

    Example:
        >>> slot = slot_for("/data/a_text_document.bin")
        >>> t = mark_begin(slot, 4096, 8192, time.monotonic_ns()); current()[0]["offset"]
        4096
    """
    s = _state or _slots()  # a forked child's is None (_forget): no os.getpid() per call
    if s.last_location is not location:
        _name(s, location)
    return s.mine


def mark_begin(slot: np.ndarray, offset: int, nbytes: int, now: int) -> int:
    """`slot` is in a read of `nbytes` bytes from byte `offset` since `now` (CLOCK_MONOTONIC ns); returns `now`.
    Plain numpy stores, so that numba compiles the same code for kernels (readwatch_kernels.mark_begin)."""
    slot[OFFSET] = offset
    slot[NBYTES] = nbytes
    slot[START] = now  # last: a watchdog takes a slot with a start for one in a read
    return now


def mark_end(slot: np.ndarray, start_ns: int, now: int) -> None:
    """The read of `slot` begun at `start_ns` has returned (or raised) at `now`: its duration goes into the
    histogram. Compiled for kernels as readwatch_kernels.mark_end."""
    us = max((now - start_ns) // 1000, 1)
    slot[START] = 0
    slot[READS] += 1
    slot[HEAD + min(int(math.log2(us) * 4), HIST - 1)] += 1


def share(path: str) -> None:
    """Make the slots a shared file at `path` (created here, slot 0 this process's), named in the environment so
    that processes started from now on (loader workers) write theirs there too. The file is removed by `unshare`."""
    global _state
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SLOTS * WORDS * 8)
    finally:
        os.close(fd)
    before = _slots().mine[HEAD : HEAD + HIST].copy()  # reads already timed (validation) still count
    os.environ[ENV] = path
    _state = _Slots(path)
    _state.mine[HEAD : HEAD + HIST] = before


def unshare() -> None:
    global _state
    path = os.environ.pop(ENV, None)
    _state = None
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def begin(location: Any, offset: int, nbytes: int) -> int:
    """Mark this process as in a read of `nbytes` bytes of `location` from byte `offset`; returns its start (ns)."""
    return mark_begin(slot_for(location), offset, nbytes, time.monotonic_ns())


def advance(offset: int) -> None:
    """The read has moved on to byte `offset` (the next span of a read_spans call)."""
    _slots().mine[OFFSET] = offset


def end(start_ns: int) -> None:
    """The read begun at `start_ns` has returned (or raised)."""
    mark_end(_slots().mine, start_ns, time.monotonic_ns())


def current() -> list[dict[str, Any]]:
    """The reads in progress now in every process that shares the slots (this process alone before `share`):
    [{"pid", "path", "offset", "nbytes", "seconds"}], longest first."""
    words = _slots().words
    now = time.monotonic_ns()
    out = []
    for row in words:
        start = int(row[START])
        if row[PID] and start:
            path = row[HEAD + HIST :].view(np.uint8).tobytes().partition(b"\0")[0]
            seconds = max(now - start, 0) / 1e9
            out.append({"pid": int(row[PID]), "path": os.fsdecode(path), "offset": int(row[OFFSET]),
                        "nbytes": int(row[NBYTES]), "seconds": seconds, "start_ns": start})  # fmt: skip
    return sorted(out, key=lambda r: -r["seconds"])


def percentiles_ms() -> dict[str, Any]:
    """{"reads": n, "p50_ms", "p99_ms"} of every completed read in the shared slots (each bucket's upper edge, so
    within 19% above the true value); None for the percentiles before any read."""
    hist = _slots().words[:, HEAD : HEAD + HIST].sum(axis=0)
    n = int(hist.sum())
    if not n:
        return {"reads": 0, "p50_ms": None, "p99_ms": None}
    cum = np.cumsum(hist)

    def at(q: float) -> float:
        b = int(np.searchsorted(cum, q * n))
        return round(2 ** ((b + 1) / 4) / 1000, 3)

    return {"reads": n, "p50_ms": at(0.5), "p99_ms": at(0.99)}


indexed.watch_mapped_reads(sys.modules[__name__])  # MMapBinReader.read_spans marks its copies here

"""A rank's watchdog: a data read slower than `stall_s` gets one warning line; a rank without progress for `hang_s`
dumps every thread's Python stack, the job says in one line which rank is stuck in which read, and every rank exits
with HANG_EXIT_CODE, so that `srun --requeue` or torchrun's restarts resume from the last checkpoint.

Why a thread and files: a rank stuck in a read of a hung mount sits in a system call (FUSE, Lustre, CephFS), or in a
page fault of a memory map inside a compiled copy, that no signal ends, and the other ranks sit in the next collective
waiting for it, where gloo and NCCL would, after their own timeout (30 min), each blame a peer. So each rank's
watchdog thread (the stuck main thread holds no GIL) looks at where its own process and loader workers are
(corpusforge.storage.readwatch: file, offset, since when; the copies out of a map mark theirs too), and:

- a rank in a data read (or waiting for a batch) for hang_s is *stuck*: it writes out_dir/hang-rank<R>.json
  (file, offset, bytes, seconds; the out_dir is on the file system every rank shares, as its checkpoints are);
- a rank waiting for a checkpoint's write (`saving()`) whose own shards got no byte written for hang_s is *stuck*
  in that write (the checkpoint's .tmp- directory named; no bytes: /proc/self/io, which a thread in a hung write
  system call does not move, so a single write or fsync longer than hang_s counts as hung);
- a rank with no progress for hang_s and in no read is *waiting* on others;
- rank 0 waits a moment for the stuck ranks' files, prints the one line naming them, and writes
  out_dir/hang-reported.json; every rank writes out_dir/hang-step<N>-rank<R>.txt (its read state and
  faulthandler's dump of every thread, which works from this thread while the main one is in a system call) and
  leaves with os._exit(HANG_EXIT_CODE) once rank 0 has reported (threads stuck in a system call cannot be joined).

A process whose own thread is in an uninterruptible read finishes exiting only when the read returns (the kernel
holds it), but its exit status is already HANG_EXIT_CODE; with data.num_workers > 0 the read is in a worker and the
rank's process exits at once.

For a loop of your own: readers of corpusforge.storage record their reads already; call `beat(step)` after each
step, wrap waits for a batch in `waiting_for_data()`, a checkpoint save in `saving(checkpointer.in_flight)` (anything
else that is not progress, as an evaluation's start, in `paused()`):

    >>> dog = Watchdog(out_dir, rank, world_size, stall_s=30, hang_s=600).start()
    >>> for step, batch in enumerate(loader, 1):
    ...     train_step(batch); dog.beat(step)
    >>> dog.stop()
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpusforge import worker_stacks
from corpusforge.fsutil import write_bytes_atomic
from corpusforge.storage import readwatch

HANG_EXIT_CODE = 5  # as bench-io's "hung storage" (README, Errors and exit status)


def _now() -> float:
    return time.monotonic()


def _written_bytes() -> int | None:
    """The bytes this process's write system calls have returned so far (procfs: never waits on a storage), None
    where /proc/self/io cannot be read."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class _SaveClock:
    """A wait for a checkpoint's write (Watchdog.saving): the bytes the process had written when they last grew,
    when that was, and what is being written."""

    written: int
    grew_at: float
    in_flight: Callable[[], dict[str, Any] | None]


def _publish(path: Path, record: dict[str, Any]) -> None:
    """A record the other ranks read, whole or not at all (no fsync: they read it within seconds, and it must not
    wait on a disk)."""
    write_bytes_atomic(path, json.dumps(record).encode(), durable=False)


class Watchdog:
    """One rank's watchdog thread (see the module's docstring). `warn(line)` prints a stall warning of this rank;
    `report(line)` prints the hang line (rank 0); both default to stderr."""

    def __init__(self, out_dir: str | os.PathLike, rank: int = 0, world_size: int = 1, stall_s: float = 30.0,
                 hang_s: float = 600.0, warn: Callable[[str], None] | None = None,
                 report: Callable[[str], None] | None = None, what: str = "") -> None:  # fmt: skip
        self.out, self.rank, self.world = Path(out_dir), rank, world_size
        self.stall_s, self.hang_s, self.what = stall_s, hang_s, what
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self.report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.tick = min(1.0, max(0.05, min(x for x in (stall_s, hang_s) if x > 0) / 8)) if stall_s or hang_s else 1
        self.step, self.last_beat, self.armed = 0, _now(), False
        self.waiting_since: float | None = None  # in waiting_for_data()
        self.pause_depth = 0
        self.save_clock: _SaveClock | None = None  # in saving()
        self.warned: set[tuple[int, int]] = set()
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.exit: Callable[[int], None] = os._exit
        self.worker_stacks: Path | None = None  # where this rank's loader workers answer with their stacks

    # -- the training loop's side ---------------------------------------------------------------------------------

    def start(self) -> Watchdog:
        if not (self.stall_s or self.hang_s):
            return self
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        readwatch.share(os.path.join(shm, f"corpusforge-reads-{os.getpid()}"))
        self.worker_stacks = worker_stacks.prepare(os.path.join(shm, f"corpusforge-stacks-{os.getpid()}"))
        if self.rank == 0:  # a previous attempt's files would name a rank that is not stuck now
            for p in [*self.out.glob("hang-rank*.json"), self.out / "hang-reported.json"]:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        self.last_beat = _now()
        self.thread = threading.Thread(target=self._run, name="corpusforge-watchdog", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            readwatch.unshare()
            if self.worker_stacks:
                worker_stacks.forget(self.worker_stacks)

    def beat(self, step: int | None = None) -> None:
        """Progress: a step finished (`step`: its number), or a batch arrived. The first step's beat arms the
        no-progress clock (the first step compiles, for minutes on a large model)."""
        if step is not None:
            self.step, self.armed = step, True
        self.last_beat = _now()

    @contextlib.contextmanager
    def waiting_for_data(self):
        """This rank waits for a batch (its own reads, a loader worker's): as a read, for the clocks, so that a wait
        with no marked read in progress (a read outside the seam) still ends in hang_s."""
        self.waiting_since = _now()
        try:
            yield
        finally:
            self.waiting_since = None
            self.last_beat = _now()

    @contextlib.contextmanager
    def saving(self, in_flight: Callable[[], dict[str, Any] | None]):
        """This rank waits for a checkpoint's write (a save, which first waits for the previous one; the end of a
        run). Its clock runs on the bytes this process writes (/proc/self/io: a thread in a hung write returns none),
        and `in_flight()` says what is written: {"step", "path", "shards_since"} (Checkpointer.in_flight). No byte
        written for hang_s while this rank writes its own shards: *stuck* in that write; a rank whose shards are
        written waits for the others' for as long as they take, unless one of them has said it is stuck. Where
        /proc/self/io cannot be read, as `paused()`."""
        written = _written_bytes()
        if written is None:
            with self.paused():
                yield
            return
        self.save_clock = _SaveClock(written, _now(), in_flight)
        try:
            yield
        finally:
            self.save_clock = None
            self.last_beat = _now()

    @contextlib.contextmanager
    def paused(self):
        """Not data: the clocks stop (a checkpoint save, an evaluation's start)."""
        self.pause_depth += 1
        try:
            yield
        finally:
            self.pause_depth -= 1
            self.last_beat = _now()

    # -- the thread ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.wait(self.tick):
            reads = readwatch.current()
            if self.stall_s:
                self._warn_stalls(reads)
            if self.hang_s and self.save_clock is not None:
                verdict, write = self._write_hung()
                if verdict is not None:
                    self._end(verdict, [], write)
                    return
            elif self.hang_s and not self.pause_depth:
                verdict = self._hung(reads)
                if verdict is not None:
                    self._end(verdict, reads)
                    return

    def _warn_stalls(self, reads: list[dict[str, Any]]) -> None:
        for r in reads:
            key = (r["pid"], r["start_ns"])
            if r["seconds"] >= self.stall_s and key not in self.warned:
                self.warned.add(key)
                p = readwatch.percentiles_ms()
                so_far = (f"p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms over {p['reads']} reads"
                          if p["reads"] else "no read finished yet")  # fmt: skip
                self.warn(
                    f"corpusforge: warning: rank {self.rank}: a read of {r['path']} at offset {r['offset']} "
                    f"({r['nbytes']} bytes) has waited {r['seconds']:.1f} s (stall_s {self.stall_s:g}); this "
                    f"rank's reads so far: {so_far}"
                )
        since = self.waiting_since
        if not reads and since is not None and _now() - since >= self.stall_s and (0, id(since)) not in self.warned:
            # no read of the seam in progress (its reads, memory-mapped copies too, are marked): the wait is elsewhere,
            # a loader worker's CPU, or a dataset that reads tokens outside the seam (a consumer of a map's views)
            self.warned.add((0, id(since)))
            self.warn(
                f"corpusforge: warning: rank {self.rank}: has waited {_now() - since:.1f} s for a batch of "
                f"{self.what or 'its data'} (stall_s {self.stall_s:g}); no timed read is in progress"
            )
        if len(self.warned) > 4096:
            self.warned = {k for k in self.warned if any((r["pid"], r["start_ns"]) == k for r in reads)}

    def _hung(self, reads: list[dict[str, Any]]) -> str | None:
        """ "stuck" (in a read or a wait for data for hang_s), "waiting" (no progress for hang_s), or None."""
        now = _now()
        if reads and reads[0]["seconds"] >= self.hang_s:
            return "stuck"
        if self.waiting_since is not None and now - self.waiting_since >= self.hang_s:
            return "stuck"
        # A rank waiting for data is judged by the clocks above, which start with the wait, not by the last beat:
        # else whatever ran between the beat and the wait (logging, another thread holding the GIL) decided, in one
        # tick of it, whether a rank whose read hangs says "waiting" instead of naming the read.
        in_data = self.waiting_since is not None
        if now - self.last_beat >= self.hang_s and not in_data and (self.armed or self._stuck_elsewhere()):
            return "waiting"  # unarmed (the first step compiles): only once a stuck rank has said so
        return None

    def _write_hung(self) -> tuple[str | None, dict[str, Any] | None]:
        """In saving(): ("stuck", the write) when this rank's own shards got no byte written for hang_s, ("waiting",
        None) when its shards are written and another rank has said it is stuck, else (None, None)."""
        clock = self.save_clock
        if clock is None:  # saving() has just ended
            return None, None
        written, now = _written_bytes(), _now()
        if written != clock.written:
            clock.written, clock.grew_at = written, now
            return None, None
        if now - clock.grew_at < self.hang_s:
            return None, None
        write = clock.in_flight()
        if write is not None and write.get("shards_since") is not None:
            return "stuck", {**write, "seconds": now - max(clock.grew_at, write["shards_since"])}
        return ("waiting", None) if self._stuck_elsewhere() else (None, None)

    def _stuck_elsewhere(self) -> bool:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        for p in self.out.glob("hang-rank*.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(p.read_text()).get("attempt") == attempt:
                    return True
        return False

    def _end(self, verdict: str, reads: list[dict[str, Any]], write: dict[str, Any] | None = None) -> None:
        step = self.step + 1  # the step in progress (after a save, the next): the same on every rank
        mine = self._stuck_record(reads, step, write) if verdict == "stuck" else None
        try:
            if mine is not None:
                _publish(self.out / f"hang-rank{self.rank}.json", mine)
            dump = self._dump(step, verdict, reads)
            if self.rank == 0:
                stuck = self._gather_stuck(mine)
                self.report(self._line(stuck, step, dump))
                _publish(self.out / "hang-reported.json", {"step": step, "stuck": stuck})
            else:
                self._await_report()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            readwatch.unshare()  # the slots' file in /dev/shm: a stuck worker keeps its mapping, not the name
            self.exit(HANG_EXIT_CODE)

    def _stuck_record(self, reads: list[dict[str, Any]], step: int, write: dict[str, Any] | None = None
                      ) -> dict[str, Any]:  # fmt: skip
        r = write or (reads[0] if reads else {})
        seconds = r.get("seconds") or (_now() - (self.waiting_since or self.last_beat))
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": step,
                "op": "write" if write else "read", "checkpoint_step": write["step"] if write else None,
                "path": r.get("path") or self.what, "offset": r.get("offset"), "nbytes": r.get("nbytes"),
                "seconds": round(seconds, 1),
                "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}  # fmt: skip

    def _dump(self, step: int, verdict: str, reads: list[dict[str, Any]]) -> Path:
        path = self.out / f"hang-step{step}-rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"rank {self.rank} on {socket.gethostname()}, pid {os.getpid()}, step {step}: {verdict} "
                    f"(no progress for {_now() - self.last_beat:.1f} s; hang_s {self.hang_s:g})\n")  # fmt: skip
            for r in reads:
                f.write(f"in a read: pid {r['pid']} {r['path']} offset {r['offset']} ({r['nbytes']} bytes) for "
                        f"{r['seconds']:.1f} s\n")  # fmt: skip
            f.write(f"reads so far: {json.dumps(readwatch.percentiles_ms())}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            workers = worker_stacks.collect(self.worker_stacks) if self.worker_stacks else {}
            for pid, stacks in sorted(workers.items()):
                f.write(f"\nloader worker pid {pid}:\n{stacks}")
        return path

    def _gather_stuck(self, mine: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The stuck ranks' records: rank 0's own, and those the others write within a few ticks (they stopped when
        rank 0 did, or before)."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        deadline = _now() + max(3.0, 4 * self.tick)
        found: dict[int, dict[str, Any]] = {0: mine} if mine else {}
        while True:
            for p in self.out.glob("hang-rank*.json"):
                with contextlib.suppress(OSError, ValueError):
                    rec = json.loads(p.read_text())
                    if rec.get("attempt") == attempt:
                        found[int(rec["rank"])] = rec
            if found or _now() >= deadline or self.world == 1:
                return [found[r] for r in sorted(found)]
            time.sleep(self.tick / 2)

    def _await_report(self) -> None:
        """Leave once rank 0 has printed the line (torchrun stops the others as soon as one rank exits), or after a
        while without it (rank 0 itself gone)."""
        deadline = _now() + max(10.0, 8 * self.tick)
        while _now() < deadline and not (self.out / "hang-reported.json").exists():
            time.sleep(0.02)

    def _line(self, stuck: list[dict[str, Any]], step: int, dump: Path) -> str:
        stacks = self.out / f"hang-step{step}-rank*.txt"
        if not stuck:
            return (
                f"corpusforge: error: no progress for {self.hang_s:g} s (hang_s) at step {step}, and no rank is in a "
                f"data read; every rank's stacks are in {stacks}; every rank exits with {HANG_EXIT_CODE}: restart "
                f"the job (it resumes from its last checkpoint)"
            )
        where = "; ".join(
            f"rank {r['rank']} on {r['host']} "
            + (
                f"in a read of {r['path']}"
                if r.get("op", "read") == "read"
                else f"writing its shards of the checkpoint of step {r['checkpoint_step']} in {r['path']}"
            )
            + (f" at offset {r['offset']} ({r['nbytes']} bytes)" if r.get("offset") is not None else "")
            + f" for {r['seconds']:g} s"
            for r in stuck
        )
        return (
            f"corpusforge: error: storage hung at step {step}: {where}; every rank's stacks are in {stacks}; every "
            f"rank exits with {HANG_EXIT_CODE}: check that node's mount of that path, then restart the job (it "
            f"resumes from its last checkpoint)"
        )

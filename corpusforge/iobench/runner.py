"""Runs the patterns: checks before any work, worker processes per case, the stall watchdog, cleanup.

Every case runs its I/O in worker processes (fork) so that an operation that never returns (a hung mount, a
stopped FUSE daemon) cannot hang the run: the parent watches each worker's current op through shared memory,
flags ops slower than `stall_seconds`, and kills the workers of an op still running after `hang_seconds`.
Everything the run writes lives in one directory, `PATH/.corpusforge-bench-<id>/`, removed at the end, after an
error, and on Ctrl-C (workers ignore SIGINT; the parent stops them and removes the directory).
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from corpusforge.errors import CorpusforgeError
from corpusforge.executors import die_with_parent
from corpusforge.fsutil import fs_type, is_url
from corpusforge.iobench import guard, patterns
from corpusforge.iobench.config import BenchConfig
from corpusforge.iobench.ranks import Ranks
from corpusforge.iobench.results import PathInfo, RunResults
from corpusforge.iobench.search import search_accelerators
from corpusforge.iobench.stats import CaseResult, aggregate
from corpusforge.sizes import human_bytes

Events = Callable[[str], None] | None


class BenchError(CorpusforgeError, RuntimeError):
    """The run cannot start or cannot go on; the message is one line naming the path and the fix."""


@dataclass
class CaseOutcome:
    """What the workers of one case (on this rank) gave back."""

    phases: list[list[patterns.Phase]] = field(default_factory=list)  # per worker
    verdict: str = "ok"  # ok | hung | error
    message: str = ""
    errno: int | None = None
    in_flight: list[tuple[str, float]] = field(default_factory=list)  # (phase, seconds) of ops still running


# -- checks before any work --------------------------------------------------------------------------------------


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cephfs_quota_free(path: str) -> int | None:
    """Bytes left under the nearest CephFS quota above `path` (ceph.quota.max_bytes - ceph.dir.rbytes), or None.
    statfs on ceph-fuse shows the quota only with client_quota_df and only at the quota root, so ask directly."""
    p = os.path.realpath(path)
    while True:
        try:
            limit = int(os.getxattr(p, "ceph.quota.max_bytes") or 0)
        except (OSError, ValueError):
            return None  # not CephFS (no such attribute), or nothing readable
        if limit:
            return max(0, limit - int(os.getxattr(p, "ceph.dir.rbytes")))
        if os.path.ismount(p) or p == "/":
            return None
        p = os.path.dirname(p)


def check_dataset(prefix: str, storage_options: tuple[tuple[str, str], ...]) -> None:
    """Raise BenchError unless PREFIX.bin and PREFIX.idx exist (a local prefix or an fsspec URL)."""
    names = [f"{prefix}.bin", f"{prefix}.idx"]
    if is_url(prefix):
        fs = patterns.filesystem(prefix, storage_options)
        missing = [n for n in names if not fs.exists(n)]
    else:
        missing = [n for n in names if not os.path.isfile(n)]
    if missing:
        raise BenchError(f"dataset {prefix}: missing {' and '.join(missing)}; give a PREFIX of .bin/.idx")


def check_path(path: str, config: BenchConfig, world: int) -> None:
    """Raise BenchError for a path the run cannot use, before anything is written there."""
    if config.dataset and {"replay", "train"} & set(config.patterns):
        check_dataset(config.dataset, config.storage_options)
    if is_url(path) and config.mlperf and "checkpoint" in config.patterns:
        raise BenchError(f"{path}: --mlperf writes and fsyncs files; give a directory on a mount, not a URL")
    if is_url(path):
        return
    try:
        os.stat(path)
    except FileNotFoundError:
        raise BenchError(f"{path}: no such directory; give an existing directory on the storage to measure") from None
    except PermissionError:
        raise BenchError(f"{path}: permission denied on the way there; give a directory you can write") from None
    if not os.path.isdir(path):
        raise BenchError(f"{path}: not a directory; give a directory on the storage to measure")
    if not os.access(path, os.W_OK | os.X_OK):
        raise BenchError(f"{path}: no write permission; give a directory you can write")
    if config.check_space:
        st = os.statvfs(path)
        free, need = st.f_bavail * st.f_frsize, config.bytes_needed(world)
        if st.f_blocks and need > free:  # f_blocks 0: size unknown (a fresh Ceph cluster reports 0 until stats come)
            raise BenchError(
                f"{path}: the run needs {human_bytes(need)} but only {human_bytes(free)} is free; "
                "lower --file-size, --procs or --checkpoint-size (--scale with --mlperf), or free space"
            )
        quota = cephfs_quota_free(path)
        if quota is not None and need > quota:
            raise BenchError(
                f"{path}: the run needs {human_bytes(need)} but the CephFS quota leaves {human_bytes(quota)}; "
                "lower --file-size, --procs or --checkpoint-size, or raise ceph.quota.max_bytes"
            )


def make_run_dir(path: str) -> str:
    run = os.path.join(path, f".corpusforge-bench-{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(run)
    except OSError as e:
        reason = {errno.EACCES: "no write permission", errno.EPERM: "no write permission", errno.EROFS: "read-only"}
        raise BenchError(f"{path}: {reason.get(e.errno, e.strerror)}; give a directory you can write") from None
    return run


def direct_supported(run_dir: str) -> bool:
    """Whether the file system takes O_DIRECT (tmpfs and some FUSE mounts refuse it with EINVAL)."""
    probe = os.path.join(run_dir, "direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, patterns.aligned_buffer(patterns.ALIGN))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def _rmtree(path: str) -> bool:
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def remove_tree(path: str, timeout: float) -> bool:
    """rmtree from a child process, so that a hung mount cannot hang the run; False if it did not finish."""
    try:
        return guard.call(_rmtree, path, timeout=timeout, what=f"removing {path}")
    except guard.StorageTimeout:
        return False


def open_path(path: str) -> tuple[str, bool, str, bool]:
    """(run directory, O_DIRECT accepted, file system type, size known): what the run learns from the path."""
    run_dir = make_run_dir(path)
    try:
        return run_dir, direct_supported(run_dir), fs_type(path), os.statvfs(path).f_blocks > 0
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


# -- one case ------------------------------------------------------------------------------------------------------


def _worker(case: patterns.Case, local: int, slot: int, times, phase_codes, barrier, out) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    die_with_parent()  # a SIGKILLed bench-io leaves no worker hammering the storage
    patterns.own_session()  # the CPU a busy machine gives it is a session's, as each fio job's (own_session says why)
    guard.detach_output()
    beat = patterns.Beat(times, phase_codes, local, barrier)
    if is_url(case.root):
        from corpusforge.iobench import objstore as table
    elif case.pattern == "offload":  # the nvme optimizer step's pattern: its own module, over patterns' Case and Beat
        from corpusforge.iobench import offload as table
    else:
        table = patterns
    try:
        if not is_url(case.root):
            os.makedirs(case.scratch, exist_ok=True)
        prepare = table.PREPARE.get(case.pattern)
        if prepare:
            prepare(case, slot, beat)
        barrier.wait()  # every process starts measuring together
        out.put((local, "ok", table.MEASURE[case.pattern](case, slot, beat)))
    except threading.BrokenBarrierError:
        out.put((local, "aborted", None))
    except OSError as e:
        out.put(
            (local, "error", (e.errno, f"{e.strerror or e} ({errno.errorcode.get(e.errno or 0, '?')})", e.filename))
        )
    except Exception as e:  # reported to the parent, which ends the run with it
        out.put((local, "error", (None, f"{type(e).__name__}: {e}", None)))


def run_case(case: patterns.Case, rank: int, on_event: Events = None) -> CaseOutcome:
    """Run `case` in case.procs worker processes under the watchdog; never blocks longer than hang_seconds per op."""
    ctx = mp.get_context("fork")
    n, c = case.procs, case.config
    times, codes = ctx.RawArray("d", n), ctx.RawArray("i", n)
    barrier, out = ctx.Barrier(n), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(case, i, rank * n + i, times, codes, barrier, out), daemon=True)
        for i in range(n)
    ]
    for w in workers:
        w.start()
    outcome, got, flagged = CaseOutcome(), {}, set()
    try:
        while len(got) < n and outcome.verdict == "ok":
            try:
                local, kind, payload = out.get(timeout=0.05)
                if kind == "ok":
                    got[local] = payload
                elif kind == "error":
                    outcome.errno, message, filename = payload
                    outcome.verdict, outcome.message = "error", f"{filename}: {message}" if filename else message
            except queue_mod.Empty:
                pass
            now = time.perf_counter()
            for i in range(n):
                started = times[i]
                if started and now - started > c.stall_seconds and (i, started) not in flagged:
                    flagged.add((i, started))
                    if on_event:
                        on_event(
                            f"stall: {case.pattern} worker {i} in {patterns.PHASE_CODES[codes[i]]} "
                            f"for more than {c.stall_seconds:g} s"
                        )
                if started and now - started > c.hang_seconds:
                    outcome.verdict = "hung"
                    outcome.in_flight = [(patterns.PHASE_CODES[codes[k]], now - times[k]) for k in range(n) if times[k]]
                    outcome.message = (
                        f"an operation ({patterns.PHASE_CODES[codes[i]]}) did not return within {c.hang_seconds:g} s; "
                        "the storage is not responding, its workers were killed"
                    )
                    break
            if outcome.verdict == "ok" and len(got) < n:
                _check_dead(workers, got, out, outcome)
    finally:
        barrier.abort()
        for w in workers:
            if w.is_alive():
                guard.abandon(w)
        out.close()
        out.cancel_join_thread()  # a killed worker may leave the queue half-written
    outcome.phases = [got[i] for i in sorted(got)]
    return outcome


def _check_dead(workers, got, out, outcome: CaseOutcome) -> None:
    for i, w in enumerate(workers):
        if i not in got and w.exitcode is not None:
            time.sleep(0.2)  # its last message may still be in the pipe
            if not out.empty():
                return
            outcome.verdict = "error"
            outcome.message = f"worker {i} (pid {w.pid}) died with exit code {w.exitcode} before reporting"
            return


# -- a whole run ------------------------------------------------------------------------------------------------------


def cache_note(info: PathInfo, case: patterns.Case) -> str:
    c = case.config
    if case.pattern in ("metadata",):
        return "-"
    if case.pattern in ("replay", "train") and is_url(patterns.dataset_prefix(case)):
        what = f"ranged GETs of {human_bytes(c.remote_block_size)} blocks, cold block cache per process"
    elif case.pattern in ("replay", "train"):
        what = "fadvise DONTNEED on .bin" if c.drop_cache else "warm page cache"
    elif case.pattern == "seq-write":
        what = "O_DIRECT" if case.direct else "buffered + fsync (timed)"
    elif case.pattern == "checkpoint" and c.mlperf:
        what = "buffered, fsync per file" + (", fadvise DONTNEED before the reads" if c.drop_cache else ", warm reads")
    elif case.direct:
        what = "O_DIRECT"
    else:
        what = "fadvise DONTNEED" if c.drop_cache else "warm page cache"
    if info.fs in ("tmpfs", "ramfs"):  # O_DIRECT or not (tmpfs takes it since Linux 6.6), these are memory
        what += f" ({info.fs}: memory is the storage)"
    if case.pattern in ("seq-read", "rand-read") and c.file_size * case.slots > info.memory:
        what += ", files larger than RAM"
    return what


class Run(RunResults):
    """One bench-io run over the configured paths: runs the cases into its results, owns the run directories and
    removes them."""

    def __init__(self, config: BenchConfig, ranks: Ranks | None = None, on_event: Events = None) -> None:
        super().__init__(config, ranks or Ranks.detect())
        self.on_event = on_event

    def event(self, text: str) -> None:
        if self.on_event and self.ranks.rank == 0:
            self.on_event(text)

    def run(self) -> list[CaseResult]:
        limit = self.config.hang_seconds
        for path in self.config.paths:  # every path is checked before any work starts
            try:
                guard.call(check_path, path, self.config, self.ranks.world, timeout=limit, what=path)
            except guard.StorageTimeout as e:
                raise BenchError(f"{e}; is the mount alive?") from None
        for path in self.config.paths:
            if is_url(path):
                self._run_url(path)
            else:
                self._run_path(path)
        return self.results

    def _run_path(self, path: str) -> None:
        c = self.config
        opened = None
        if self.ranks.rank == 0:
            try:
                opened = guard.call(open_path, path, timeout=c.hang_seconds, what=path)
            except guard.StorageTimeout as e:
                raise BenchError(f"{e}; is the mount alive?") from None
        run_dir, direct_ok, fs, size_known = self.ranks.broadcast(opened)
        self.ranks.barrier()
        try:
            if c.direct == "on" and not direct_ok:
                raise BenchError(f"{path}: this file system ({fs}) refuses O_DIRECT; use --direct auto or off")
            use_direct = direct_ok and c.direct != "off"
            note = (
                "in effect" if use_direct else ("refused by the file system" if not direct_ok else "off (--direct off)")
            )
            info = PathInfo(path, fs, use_direct, note, memory_bytes())
            if not direct_ok and c.direct == "auto":
                info.notes.append(
                    f"O_DIRECT is not supported on {info.fs}: reads are buffered, cache dropped with "
                    "posix_fadvise(DONTNEED)"
                )
            if not size_known:
                info.notes.append("the file system reports no size: free space was not checked")
            if fs == "fuse.ceph-fuse":
                info.notes.append(
                    "ceph-fuse caches file data in its own process (client_oc), out of posix_fadvise's reach: "
                    "buffered re-reads (checkpoint read) may come from client memory"
                )
            self.paths.append(info)
            for pattern in c.patterns:
                if not self.run_pattern(path, run_dir, info, pattern):
                    break
        finally:
            self.ranks.barrier()
            if self.ranks.rank == 0 and not remove_tree(run_dir, c.hang_seconds):
                self.leftovers.append(run_dir)
                self.event(f"could not remove {run_dir}: the storage did not answer within {c.hang_seconds:g} s")

    def _run_url(self, url: str) -> None:
        """Every configured pattern on an object store `url`; the run's objects live under
        URL/.corpusforge-bench-<id>/ and are removed (from a child process: a store that stops answering leaves
        them, listed in leftovers)."""
        from corpusforge.iobench.objstore import remove

        c = self.config
        root = self.ranks.broadcast(f"{url.rstrip('/')}/.corpusforge-bench-{uuid.uuid4().hex[:12]}")
        info = PathInfo(
            url,
            url.split("://", 1)[0],
            False,
            "not applicable (object store)",
            0,
            ["object store: ranged GETs through fsspec, no client page cache"],
        )
        self.paths.append(info)
        try:
            for pattern in c.patterns:
                if not self.run_pattern(url, root, info, pattern):
                    break
        finally:
            self.ranks.barrier()
            if self.ranks.rank == 0:
                proc = mp.get_context("fork").Process(target=remove, args=(root, c.storage_options), daemon=True)
                proc.start()
                proc.join(c.hang_seconds)
                if proc.is_alive() or proc.exitcode:
                    proc.kill()
                    self.leftovers.append(root)
            shutil.rmtree(patterns.local_dir(root), ignore_errors=True)  # the loaders' index caches, on every rank

    def _cases(self, path: str, run_dir: str, info: PathInfo, pattern: str) -> list[patterns.Case]:
        c = self.config
        if pattern == "checkpoint" and c.mlperf:
            return [self._mlperf_case(run_dir)]
        sized = ("seq-read", "seq-write", "offload")  # offload: block_size is the chunk of each state file
        sizes = c.block_sizes if pattern in sized else (c.sample_size,)
        cases = []
        for procs in c.procs:
            for bs in sizes:
                direct = info.direct and pattern in (*sized, "rand-read") and bs % patterns.ALIGN == 0
                scratch = os.path.join(run_dir, f"case-{len(self.results)}-{len(cases)}")
                cases.append(patterns.Case(pattern, run_dir, scratch, procs, self.ranks.world, bs, direct, c))
        return cases

    def _mlperf_case(self, run_dir: str) -> patterns.Case:
        """One case: the model's ranks (or the subset asked for) spread over bench-io's ranks, the first block size
        as the request size."""
        c, world = self.config, self.ranks.world
        slots = c.mlperf_slots()
        if slots % world:
            raise BenchError(
                f"--mlperf {c.mlperf}: {slots} processes do not divide over {world} ranks; "
                f"give --mlperf-processes a multiple of {world}"
            )
        scratch = os.path.join(run_dir, f"case-{len(self.results)}-0")
        return patterns.Case("checkpoint", run_dir, scratch, slots // world, world, c.block_sizes[0], False, c)

    def run_pattern(self, path: str, run_dir: str, info: PathInfo, pattern: str) -> bool:
        """Run every case of `pattern`; False when the path failed and its remaining patterns are skipped."""
        if pattern in ("replay", "train") and not self.config.dataset:
            self._synthetic(run_dir, info)
        if pattern == "train":
            return self._search_accelerators(path, run_dir, info)
        for case in self._cases(path, run_dir, info, pattern):
            result = self.run_one(case, path, info)
            if result.verdict in ("hung", "error"):
                return False
        return True

    def run_one(self, case: patterns.Case, path: str, info: PathInfo) -> CaseResult:
        self.event(f"{path}: {case.pattern} procs={case.procs} bs={human_bytes(case.block_size)}")
        self.ranks.barrier()
        outcome = run_case(case, self.ranks.rank, self.on_event if self.ranks.rank == 0 else None)
        outcomes = self.ranks.gather(outcome)
        self.ranks.barrier()
        if self.ranks.rank == 0 and not is_url(case.scratch):  # objects go with the run's root, at the end
            remove_tree(case.scratch, case.config.hang_seconds)
        results = aggregate(case, path, outcomes, cache_note(info, case)) if self.ranks.rank == 0 else []
        results = self.ranks.broadcast(results)
        self.results += results
        return results[-1] if results else CaseResult.failed(case, path, "error", "no result")

    def _search_accelerators(self, path: str, run_dir: str, info: PathInfo) -> bool:
        """Train emulation (search.py): one row per tried count, the count fed on each; False if the path hung or
        failed."""
        c, world = self.config, self.ranks.world

        def trial(per_rank: int) -> float | None:
            scratch = os.path.join(run_dir, f"train-{per_rank}")
            case = patterns.Case("train", run_dir, scratch, per_rank, world, c.sample_size, False, c)
            row = self.run_one(case, path, info)
            return None if row.verdict in ("hung", "error") else row.extra.get("utilization", 0.0)

        found = search_accelerators(trial, world, c.target_utilization, c.max_accelerators)
        if found is None:
            return False
        fed, summary = found
        for row in self.results:
            if row.pattern == "train" and row.path == path:
                row.extra["fed_accelerators"] = fed
        self.event(summary)
        self.summaries.append((path, summary))
        return True

    def _synthetic(self, run_dir: str, info: PathInfo) -> None:
        prefix = os.path.join(run_dir, "data", "synthetic_text_document")
        if self.ranks.rank == 0:
            self.event(f"writing a synthetic dataset of {self.config.synthetic_tokens:,} tokens to {prefix}")
            limit = max(600.0, self.config.hang_seconds)
            args = (prefix, self.config.synthetic_tokens, self.config.seed, self.config.storage_options)
            guard.call(patterns.make_synthetic_dataset, *args, timeout=limit, what=f"writing {prefix}")
        self.ranks.barrier()


def run_bench(config: BenchConfig, on_event: Events = None, ranks: Ranks | None = None) -> Run:
    """Run `config`; the returned Run holds results, path notes and leftovers (rank 0 holds the aggregate)."""
    run = Run(config, ranks, on_event)
    run.run()
    return run


def with_patterns(config: BenchConfig, *names: str) -> BenchConfig:
    return replace(config, patterns=tuple(names))

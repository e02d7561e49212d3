"""Every thread's Python stack of a rank's DataLoader workers, on demand, also while a worker's main thread is stuck
in a read of a hung mount.

A signal handler cannot help there: a read of a hung FUSE, Lustre or CephFS mount waits in the kernel until the
server answers, and a handler runs only when the system call returns. So each worker keeps one thread asleep in
`sigwait` (the signal is blocked in every other thread, so it is this thread that takes it); woken, it writes
faulthandler's dump of every thread, which needs no GIL from the stuck thread (a read releases it). The watchdog of
the rank (corpusforge.train.watchdog) names the directory before the workers start, asks each worker with a signal
and reads the dumps into its own hang file.

Example:
    >>> where = worker_stacks.prepare("/dev/shm/corpusforge-stacks-1234")  # in the rank, before the loader starts
    >>> worker_stacks.collect(where)  # later, in the rank: {worker pid: its threads' stacks}
    {5678: 'Thread 0x... (most recent call first):\\n  File ...'}
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import threading
import time
from pathlib import Path

ENV = "CORPUSFORGE_WORKER_STACKS"  # the directory, inherited by the workers (fork, spawn and forkserver alike)
ASK = signal.SIGUSR2


def prepare(directory: str | os.PathLike) -> Path:
    """Make `directory` the place where this process's loader workers (started after this) answer."""
    where = Path(directory)
    where.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(where)
    return where


def forget(directory: str | os.PathLike) -> None:
    """Workers started from now on do not answer; the directory and its dumps go."""
    if os.environ.get(ENV) == str(directory):
        del os.environ[ENV]
    shutil.rmtree(directory, ignore_errors=True)


def serve_in_worker() -> None:
    """In a loader worker (its worker_init_fn): answer the rank's requests for stacks, when the rank asked for it."""
    where = os.environ.get(ENV)
    if not where or not os.path.isdir(where):
        return
    pid = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {ASK})  # every thread but the one below, which takes it in sigwait
    dump, tmp = Path(where) / f"{pid}.txt", Path(where) / f".{pid}.txt.tmp"

    def answer() -> None:
        while True:
            signal.sigwait({ASK})
            with contextlib.suppress(OSError), open(tmp, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.close()
                os.replace(tmp, dump)

    threading.Thread(target=answer, name="corpusforge-stacks", daemon=True).start()
    (Path(where) / f"{pid}.worker").touch()


def collect(directory: str | os.PathLike, wait_s: float = 1.0) -> dict[int, str]:
    """{pid: every thread's stack} of the live workers that serve in `directory`, each asked once; a worker that does
    not answer within `wait_s` is left out."""
    where = Path(directory)
    asked: list[int] = []
    for marker in where.glob("*.worker"):
        pid = int(marker.stem)
        if _parent(pid) != os.getpid():  # ended, and its pid perhaps another process's now: never signal that
            marker.unlink(missing_ok=True)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (where / f"{pid}.txt").unlink(missing_ok=True)
            os.kill(pid, ASK)
            asked.append(pid)
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        for pid in list(asked):
            with contextlib.suppress(FileNotFoundError):
                stacks[pid] = (where / f"{pid}.txt").read_text()
                asked.remove(pid)
        time.sleep(0.02)
    return stacks


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (Linux /proc), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces: state, ppid

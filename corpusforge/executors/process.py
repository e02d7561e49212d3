"""Child processes that end with their parent: `die_with_parent`, for every pool of worker processes here.

A killed run must leave no orphan writing parts or holding memory (seen: a build-knn worker alive 16 minutes after
its parent was killed). The local executor's workers, the loaders' workers and bench-io's workers call it first.

Example (as a pool's initializer):
    >>> ProcessPoolExecutor(2, initializer=die_with_parent, initargs=(os.getpid(),))
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None) -> None:
    """Call first thing in a child process: it ends (SIGKILL) when its parent dies, whichever way (SIGKILL and the
    OOM killer included), so a killed run leaves no orphan writing parts or holding memory (seen: a build-knn worker
    alive 16 minutes after its parent was killed). `parent`: the parent's pid, read before the fork; default the
    multiprocessing parent's (multiprocessing reads it before the fork too).

    Linux: prctl(PR_SET_PDEATHSIG), then a check that the parent did not die between the fork and the prctl (the
    child is already reparented then, and no signal would ever come). The kernel sends the signal when the *thread*
    that forked the child exits: pools are started from the thread that uses them. Elsewhere: a daemon thread that
    polls the parent's pid once a second.

    Example (as a pool's initializer):
        >>> ProcessPoolExecutor(2, initializer=die_with_parent, initargs=(os.getpid(),))
    """
    if parent is None:
        parent = mp.parent_process().pid
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            _watch_parent(parent)  # a seccomp filter forbids prctl: fall back on polling
    else:
        _watch_parent(parent)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="corpusforge-parent-watch", daemon=True).start()

"""Touch the storage only from a child process with a time limit, so that a hung mount cannot hang bench-io.

A process blocked on a FUSE or network file system whose server stopped answering sits in an uninterruptible
wait: once the request has reached the server, not even SIGKILL ends it (fs/fuse/dev.c, request_wait_answer).
So the parent never calls the file system itself; it forks a child, waits at most `timeout` seconds, and on
expiry kills the child and, if the kernel cannot reap it, disowns it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

from corpusforge.executors import die_with_parent


class StorageTimeout(RuntimeError):
    """The storage did not answer within the time limit."""


def detach_output() -> None:
    """Point stdout and stderr of a child at /dev/null: a child stuck on a hung mount would otherwise hold the
    terminal's or the pipe's write end open, and `bench-io ... | tee log` would wait for it forever. Children
    report through their pipe or queue instead."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)


def _child(conn, fn, args) -> None:
    die_with_parent()  # ends with bench-io, once the mount answers (no signal ends a wait inside FUSE)
    detach_output()
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # sent back and re-raised in the parent
        conn.send(("error", e))
    finally:
        conn.close()


def abandon(proc) -> None:
    """Kill `proc`; if it cannot be reaped (stuck in the kernel), forget it so that interpreter exit does not
    wait for it forever (multiprocessing joins its children at exit, and offers no public way to disown one)."""
    proc.kill()
    proc.join(2.0)
    if proc.exitcode is None:
        mp.process._children.discard(proc)  # type: ignore[attr-defined]


def call(fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
    """fn(*args) in a forked child; its result or its exception; StorageTimeout after `timeout` seconds."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise StorageTimeout(f"{what}: the storage did not answer within {timeout:g} s")
        status, value = parent.recv()
    except EOFError:
        raise StorageTimeout(f"{what}: the checking process died (exit code {proc.exitcode})") from None
    finally:
        parent.close()
        if proc.is_alive():
            abandon(proc)
        else:
            proc.join()
    if status == "error":
        raise value
    return value

"""The local executor: a fork-based process pool on this machine (the default).

Workers inherit what the parent loaded before the fork (the tokenizer), and stream progress events back through a
queue. One worker, or one task, runs in the calling process instead. A worker process that dies (OOM killer,
SIGKILL) breaks the pool: the pool is rebuilt and every unfinished task resubmitted, at most `retries` times. An
exception raised by the task itself is raised to the caller as it is, not retried: it would fail again.

Example:
    >>> with LocalExecutor(workers=2) as ex:
    ...     sorted(r for _, r in ex.run(square, [1, 2, 3]))     # square(item, ctx) -> item * item
    [1, 4, 9]
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from corpusforge.executors.base import Executor, ExecutorError, R, T, TaskContext, TaskFn, available_cores
from corpusforge.executors.process import die_with_parent


class LocalExecutor(Executor):
    """A fork-based process pool on this machine; see the module docstring."""

    name = "local"

    def __init__(self, workers: int = 0, retries: int = 2) -> None:
        self._workers = workers or available_cores()
        self.retries = retries
        self._io: ThreadPoolExecutor | None = None

    @property
    def workers(self) -> int:
        return self._workers

    def submit(self, fn: Callable[[T], R], item: T) -> Future:
        # A thread of this process: on one machine it is as near the disk as any worker, and it needs no fork.
        if self._io is None:
            self._io = ThreadPoolExecutor(self._workers, thread_name_prefix="corpusforge-io")
        return self._io.submit(fn, item)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True, cancel_futures=True)
            self._io = None

    def run(
        self, fn: TaskFn, items: Sequence[T], on_progress: Callable[[Any], None] | None = None
    ) -> Iterator[tuple[T, R]]:
        if self._workers == 1 or len(items) <= 1:
            # In this process: the task may use as many threads as workers were asked for.
            ctx = TaskContext(on_progress, threads=self._workers)
            for item in items:
                yield item, fn(item, ctx)
            return
        left = dict(enumerate(items))  # position -> item, until it has a result
        for attempt in range(self.retries + 1):
            results = self._run_pool(fn, left, on_progress)
            try:
                for pos, result in results:
                    yield left.pop(pos), result
                return
            except BrokenProcessPool:
                if attempt == self.retries:
                    raise ExecutorError(
                        f"a worker process died {attempt + 1} times, {len(left)} tasks unfinished (killed for "
                        "memory?); finished parts are kept: rerun with --resume"
                    ) from None
            finally:
                results.close()  # a caller that stops early shuts the pool down now, not at garbage collection

    def _run_pool(self, fn: TaskFn, left: dict[int, T], on_progress) -> Iterator[tuple[int, R]]:
        # fork, not spawn: workers inherit what the caller loaded (the tokenizer) instead of each loading it
        # again, which on a few hundred MB of input costs as much as the tokenizing. Safe while the caller has
        # started no thread and never encoded in parallel (gigatoken's thread pool would not survive a fork):
        # preprocess starts its progress bar on the first event, after this fork. A pool rebuilt after a worker
        # died forks after that thread started; the workers never touch its locks.
        ctx = mp.get_context("fork")
        # SimpleQueue: put() writes to the pipe at once (no feeder thread), so a task's events are all there
        # before its result is, and the drain after each result misses none.
        events = ctx.SimpleQueue()
        pool = ProcessPoolExecutor(min(self._workers, len(left)), ctx, _init_worker, (events, os.getpid()))
        # gc frozen while the pool lives: its workers fork at the first submit, and this process's collections skip
        # the objects they share with them (see _frozen_heap).
        with _frozen_heap():
            try:
                pending = {pool.submit(_call_in_worker, fn, item): pos for pos, item in left.items()}
                while pending:
                    finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(events, on_progress)
                    for fut in finished:
                        pos = pending.pop(fut)
                        yield pos, fut.result()  # raises the task's exception, or BrokenProcessPool
                _drain(events, on_progress)
            finally:
                # Waits for the workers to exit: none of a broken pool may still write a part when the next one
                # starts the same task, and a finished one's background fsyncs complete.
                pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the objects that exist now out of garbage collections while inside (gc.freeze), unless someone else
    froze some. Workers forked inside then never visit what they inherited: a collection writes to every object it
    visits, and each write to an inherited page copies that page into the worker (copy-on-write). Inside, this
    process's own collections skip them too (a full one walks every module loaded: 10-20 ms); gc.unfreeze at the
    end hands them back to the collector.

    Example:
        >>> with _frozen_heap():
        ...     gc.get_freeze_count() > 0
        True
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _drain(events, on_progress) -> None:
    while not events.empty():
        item = events.get()
        if on_progress:
            on_progress(item)


_worker_events = None


def _init_worker(events, parent: int) -> None:
    global _worker_events
    _worker_events = events
    die_with_parent(parent)


def _call_in_worker(fn: TaskFn, item: T) -> R:
    return fn(item, TaskContext(_worker_events.put, threads=1))

"""How a resumable stage runs its tasks: one helper for preprocess and every build-knn stage.

A stage (tokenizing the inputs; chunking, embedding, filling the index, finding neighbours) is cut into tasks
that are fixed by its inputs alone, never by the number of workers, so its bytes do not depend on where or how
many ran it. Each task writes its own output atomically; that output (or a small done marker beside it) is what
says the task is finished. A stage, in order:

    1. plans its tasks                      the stage's own code (document ranges, shards, blocks of queries)
    2. skips the finished ones              `run_tasks(finished=...)`: a done marker read back, or None
    3. runs the rest on an executor         `run_tasks`: local processes, Ray, or here in the driver
    4. merges the results in the driver     `TaskRun.results` in task order; typed stats add up with `+`
    5. records the stage as done            a manifest entry (build-knn) or a commit (preprocess)

`run_tasks` does steps 2-3 and the bookkeeping that every stage repeated: progress for what was already done,
progress from results where the executor cannot stream it, timing, and which executor ran how many workers.

Example:
    >>> run = run_tasks(partial(embed_shard, job), list(range(8)), executor,
    ...                 finished=lambda s: rows(s) if shard_path(d, s).exists() else None, progress=bar, count=int)
    >>> run.resumed, sum(run.ran), run.executor  # doctest: +SKIP
    (3, 5242880, 'local')
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from corpusforge.executors import Executor, LocalExecutor, TaskContext

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class TaskRun(Generic[R]):
    """What `run_tasks` did: every task's result, and how it ran."""

    results: list[R]
    """Every task's result, in task order; a finished task's is what `finished` read back."""
    ran: list[R] = field(default_factory=list)
    """The results of the tasks run now, in the order they completed."""
    resumed: int = 0
    """Tasks found finished, not run again."""
    seconds: float = 0.0
    """Running the tasks that were left (0 when none was)."""
    executor: str = ""
    workers: int = 1

    @property
    def tasks(self) -> int:
        return len(self.results)


class DriverExecutor(Executor):
    """Tasks one after another in this process, with all of its threads (`ctx.threads == 0`: leave them as they
    are): for what must stay in the driver, such as a model on the GPU, or faiss GPU resources a forked worker
    could not use, or an HNSW graph that cannot be built in parts.

    Example: sum(r for _, r in DriverExecutor().run(lambda x, ctx: x * x, [1, 2, 3])) -> 14"""

    name = "driver"

    @property
    def workers(self) -> int:
        return 1

    def run(
        self, fn: Callable[[T, TaskContext], R], items: Sequence[T], on_progress: Callable[[Any], None] | None = None
    ) -> Iterator[tuple[T, R]]:
        ctx = TaskContext(on_progress, threads=0)
        for item in items:
            yield item, fn(item, ctx)

    def submit(self, fn: Callable[[T], R], item: T) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(item))
        except Exception as e:  # noqa: BLE001 - the step's own exception, raised by future.result()
            future.set_exception(e)
        return future


def run_tasks(
    fn: Callable[[T, TaskContext], R],
    tasks: Sequence[T],
    executor: Executor | None = None,
    *,
    finished: Callable[[T], R | None] | None = None,
    progress: Callable[[Any], None] | None = None,
    count: Callable[[R], int] | None = None,
    on_result: Callable[[T, R], None] | None = None,
) -> TaskRun[R]:
    """Run `fn(task, ctx)` for every task that `finished(task)` does not find done, on `executor` (default: one
    task at a time in this process), and return every task's result in task order.

    `progress` gets the events tasks send with `ctx.report`; with `count` (a result's progress units, e.g. `int`
    for tasks that return rows) it also gets the units of the finished tasks at once, and each result's units
    where the executor cannot stream events (Ray). `on_result(task, result)` is called in this process as each
    task completes (preprocess places each finished part while the others run).

    Example:
        >>> run_tasks(lambda x, ctx: x * x, [1, 2, 3], finished=lambda x: 1 if x == 1 else None).results
        [1, 4, 9]
    """
    executor = executor or LocalExecutor(1)
    tasks = list(tasks)  # the very objects the executor yields back (see below): a range would make new ones
    results: list = [finished(task) if finished else None for task in tasks]
    todo = [pos for pos, result in enumerate(results) if result is None]
    resumed = len(tasks) - len(todo)
    if progress and count and resumed:  # the finished tasks' units count as done
        progress(sum(count(r) for r in results if r is not None))
    ran: list = []
    t0 = time.perf_counter()
    if todo:
        position = {id(tasks[pos]): pos for pos in todo}  # an executor yields back the very item it was given
        for task, result in executor.run(fn, [tasks[pos] for pos in todo], progress):
            results[position[id(task)]] = result
            ran.append(result)
            if on_result:
                on_result(task, result)
            if progress and count and not executor.streams_progress:
                progress(count(result))
    seconds = time.perf_counter() - t0 if todo else 0.0
    return TaskRun(results, ran, resumed, seconds, executor.name, executor.workers)

"""What every executor is: the `Executor` interface, the `TaskContext` a task gets, and `ExecutorError`.

An executor calls `fn(item, ctx)` once for every item and yields `(item, result)` as each finishes, in completion
order. The variants (local.py, ray.py) are chosen in one place, `corpusforge.executors.make_executor`.

Example:
    >>> from corpusforge.executors import LocalExecutor
    >>> def square(item: int, ctx: TaskContext) -> int:
    ...     return item * item
    >>> with LocalExecutor(workers=2) as ex:  # any Executor: a context manager with run() and submit()
    ...     sorted(r for _, r in ex.run(square, [1, 2, 3]))
    [1, 4, 9]
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from corpusforge.errors import CorpusforgeError

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TaskContext:
    """What a task gets besides its item."""

    report: Callable[[Any], None] | None
    """Sends a progress event to the caller's `on_progress`; None where events do not stream (Ray)."""
    threads: int = 1
    """Cores the task may use: all the run's workers when it runs alone in the calling process, else 1."""


TaskFn = Callable[[T, TaskContext], R]


class ExecutorError(CorpusforgeError, RuntimeError):
    """Tasks that cannot be run (a missing extra, workers that keep dying); the message is one line with the fix."""


class Executor(ABC, Generic[T, R]):
    """Runs independent tasks; a context manager, because a cluster is connected to on entry and left on exit."""

    name: str = ""
    remote: bool = False
    """Tasks may run on other machines: paths they get must be absolute, on a file system every node sees."""
    streams_progress: bool = True
    """Events sent with `ctx.report` reach `on_progress` while tasks run; else the caller reports from results."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release what `__enter__` acquired (a Ray connection this executor opened)."""

    @property
    @abstractmethod
    def workers(self) -> int:
        """How many tasks run at once."""

    @abstractmethod
    def run(
        self, fn: TaskFn, items: Sequence[T], on_progress: Callable[[Any], None] | None = None
    ) -> Iterator[tuple[T, R]]:
        """Call `fn(item, ctx)` for every item; yield `(item, result)` in completion order."""

    @property
    def nodes(self) -> int:
        """Machines the tasks run on."""
        return 1

    def warm_result(self, timeout: float = 0.0) -> object | None:
        """What `warm_up` returned on a worker that is already warm (within `timeout` s), else None: a warm worker
        tells the caller what it would otherwise load itself (preprocess: the tokenizer's facts)."""
        return None

    @abstractmethod
    def submit(self, fn: Callable[[T], R], item: T) -> Future:
        """Start `fn(item)`, a short I/O step (copying a finished part into place), beside the running tasks
        and without taking a task's core; a Future of its result, whose exception is the step's own."""


def available_cores() -> int:
    """Cores this process may run on (its affinity set on Linux).

    Example: LocalExecutor(workers=0) runs available_cores() workers.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1

"""Executors: run independent tasks on local worker processes (the default) or on a Ray cluster.

Inside: base.py (the Executor interface, TaskContext, ExecutorError), local.py (the process pool), ray.py (the
Ray executor), pool.py (the warm Ray actor pool it runs on), process.py (die_with_parent, for every child process).
`make_executor` below is the one place a variant is chosen.

An executor calls `fn(item, ctx)` once for every item and yields `(item, result)` as each finishes, in
completion order; whoever iterates (preprocess's merger) does the one final step. Tasks must be idempotent:
they write their own output atomically, so running one twice is harmless. That is what makes retrying safe.

    local   a fork-based process pool. Workers inherit what the parent loaded before the fork (the
            tokenizer), and stream progress events back through a queue. One worker, or one task, runs in
            the calling process instead. A worker process that dies (OOM killer, SIGKILL) breaks the pool:
            the pool is rebuilt and every unfinished task resubmitted, at most `retries` times.
    ray     every item a call on a pool of Ray actors, one per CPU of the cluster, which outlive the job for
            `keep_workers` seconds (pool.py): Ray would start new worker processes for every job
            (1-1.5 s each, a quarter of a 1 GB preprocess); the next job finds these started, the tokenizer
            loaded. Until new ones are up, the driver runs tasks itself (a share). Ray reruns the task of an
            actor whose process died. Tasks may run on other machines, so every path must be absolute and on a
            file system all nodes share. Progress arrives per finished task (from the results).

Besides tasks, `submit(fn, item)` starts a short I/O step (preprocess copies finished parts into place with
it): on a thread of the calling process (local), or on the pool's actors beside their task, one node after
another (ray).

An exception raised by `fn` itself (bad input, disk full) is not retried by either: it would fail again. It
is raised to the caller as the original exception, with the unfinished tasks cancelled.

Example:
    >>> with make_executor("local", workers=2) as ex:
    ...     sorted(r for _, r in ex.run(square, [1, 2, 3]))     # square(item, ctx) -> item * item
    [1, 4, 9]
"""

from __future__ import annotations

from collections.abc import Callable

from corpusforge.executors.base import Executor, ExecutorError, TaskContext, TaskFn, available_cores
from corpusforge.executors.local import LocalExecutor
from corpusforge.executors.pool import DEFAULT_KEEP_S
from corpusforge.executors.process import die_with_parent
from corpusforge.executors.ray import RAY_EXTRA, RayExecutor, import_ray

EXECUTORS = ("local", "ray")

__all__ = [
    "DEFAULT_KEEP_S",
    "EXECUTORS",
    "RAY_EXTRA",
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "RayExecutor",
    "TaskContext",
    "TaskFn",
    "available_cores",
    "die_with_parent",
    "import_ray",
    "make_executor",
]


def make_executor(
    name: str = "local",
    workers: int = 0,
    address: str | None = None,
    retries: int = 2,
    warm_up: Callable[[], object] | None = None,
    keep_workers: float = DEFAULT_KEEP_S,
) -> Executor:
    """The executor called `name`; `workers=0` means every core (local) or every CPU of the cluster (Ray).
    `warm_up` is what every Ray worker should load before its first task (local workers inherit it by fork);
    `keep_workers` how many idle seconds Ray's workers wait for the next job.

    Example: make_executor("ray", address="auto") connects, on entry, to the cluster `ray start` made.
    """
    if name == "local":
        return LocalExecutor(workers, retries)
    if name == "ray":
        return RayExecutor(address, workers, retries, warm_up, keep_workers)
    raise ExecutorError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")

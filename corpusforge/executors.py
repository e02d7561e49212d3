"""Executors: run independent tasks on local worker processes (the default) or on a Ray cluster.

An executor calls `fn(item, ctx)` once for every item and yields `(item, result)` as each finishes, in
completion order; whoever iterates (preprocess's merger) does the one final step. Tasks must be idempotent:
they write their own output atomically, so running one twice is harmless. That is what makes retrying safe.

    local   a fork-based process pool. Workers inherit what the parent loaded before the fork (the
            tokenizer), and stream progress events back through a queue. One worker, or one task, runs in
            the calling process instead. A worker process that dies (OOM killer, SIGKILL) breaks the pool:
            the pool is rebuilt and every unfinished task resubmitted, at most `retries` times.
    ray     every item a call on a pool of Ray actors, one per CPU of the cluster, which outlive the job for
            `keep_workers` seconds (corpusforge._ray_pool): Ray would start new worker processes for every job
            (1-1.5 s each, a quarter of a 1 GB preprocess); the next job finds these started, the tokenizer
            loaded. Until new ones are up, the driver runs tasks itself (a share). Ray reruns the task of an
            actor whose process died. Tasks may run on other machines, so every path must be absolute and on a
            file system all nodes share. Progress arrives per finished task (from the results).

Besides tasks, `submit(fn, item)` starts a short I/O step (preprocess copies finished parts into place with
it): on a thread of the calling process (local), or as a zero-CPU Ray task spread over the nodes (ray).

An exception raised by `fn` itself (bad input, disk full) is not retried by either: it would fail again. It
is raised to the caller as the original exception, with the unfinished tasks cancelled.

Example:
    >>> with make_executor("local", workers=2) as ex:
    ...     sorted(r for _, r in ex.run(square, [1, 2, 3]))     # square(item, ctx) -> item * item
    [1, 4, 9]
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from corpusforge import _ray_pool
from corpusforge.errors import CorpusforgeError

T = TypeVar("T")
R = TypeVar("R")
EXECUTORS = ("local", "ray")
RAY_EXTRA = "pip install 'corpusforge[ray]'"


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


def make_executor(
    name: str = "local",
    workers: int = 0,
    address: str | None = None,
    retries: int = 2,
    warm_up: Callable[[], object] | None = None,
    keep_workers: float = _ray_pool.DEFAULT_KEEP_S,
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


def available_cores() -> int:
    """Cores this process may run on (its affinity set on Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------------
# local processes


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


def _call_in_worker(fn: TaskFn, item: T) -> R:
    return fn(item, TaskContext(_worker_events.put, threads=1))


# ---------------------------------------------------------------------------------------------------------------
# Ray


def import_ray():
    """`ray`, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ExecutorError(f"--executor ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


class RayExecutor(Executor):
    """Tasks on the cluster at `address` ('auto': the one `ray start` made on this node; None: a running
    `ray.init()` in this process, else a new local instance with `workers` CPUs), run by a pool of Ray worker
    processes that outlives the job by `keep_workers` seconds (corpusforge._ray_pool), so the next job finds
    them started, with the tokenizer loaded."""

    name = "ray"
    remote = True
    streams_progress = False

    def __init__(
        self,
        address: str | None = None,
        workers: int = 0,
        retries: int = 2,
        warm_up: Callable[[], object] | None = None,
        keep_workers: float = _ray_pool.DEFAULT_KEEP_S,
    ) -> None:
        self.address, self._workers, self.retries, self.warm_up = address, workers, retries, warm_up
        self.keep_workers = keep_workers
        self._started = False
        self._own_cpus = False  # a local instance started here with `workers` CPUs
        self._names: list[tuple[str, str]] = []  # the pool's actors: (name, node id)
        self._actors: list = []
        self._claims: dict = {}  # claim ref -> actor position, until the actor has warmed up
        self._step_turn = -1
        self._stdout = contextlib.ExitStack()

    def __enter__(self) -> RayExecutor:
        ray = import_ray()
        # Ray's driver prints the errors it hears of ("A worker died...") on stdout, whatever log_to_driver
        # says; stdout is where --json goes, and they are diagnostics: send them to stderr while connected.
        self._stdout.enter_context(contextlib.redirect_stdout(sys.stderr))
        try:
            if not ray.is_initialized():
                self._connect(ray)
            self._names = _ray_pool.pool_names(ray, self.workers)
            self._actors = [_ray_pool.actor(ray, name, node, self.retries) for name, node in self._names]
            # A new actor takes a second or more to start and import: claim them now, so that this overlaps
            # with what the caller does before run(); a warm one answers at once.
            self._claims = {a.claim.remote(self._keep(), self.warm_up): i for i, a in enumerate(self._actors)}
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self, ray) -> None:
        if self.address:
            where = {"address": self.address}
        else:  # address=None would join a cluster that `ray start` left on this machine, if any: be explicit
            where = {"address": "local", "num_cpus": self._workers or None}
            self._own_cpus = True
        try:
            # Ray's INFO lines (and its token-auth notice) would mix with the summary on a terminal, and the
            # workers' and raylet's lines that log_to_driver forwards go to stdout, where --json writes.
            ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, **where)
        except (ConnectionError, RuntimeError, ValueError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ExecutorError(
                f"cannot start or join Ray at {where['address']!r} ({reason}); start the cluster first "
                "(`ray start --head` on one node, `ray start --address HEAD:6379` on the others)"
            ) from None
        self._started = True

    def close(self) -> None:
        self._claims = {}  # a failed warm-up is not an error: the first task meets the same cause and says it
        if self._actors and self.keep_workers <= 0 and not self._started:
            ray = import_ray()
            for a in self._actors:  # not kept: end them now (a local instance ends with its shutdown anyway)
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
        self._actors = []
        if self._started:
            import_ray().shutdown()
            self._started = False
        self._stdout.close()

    @property
    def workers(self) -> int:
        if self._workers:
            return self._workers
        return max(1, int(import_ray().cluster_resources().get("CPU", 1)))

    @property
    def nodes(self) -> int:
        return max(1, sum(1 for node in import_ray().nodes() if node.get("Alive")))

    def warm_result(self, timeout: float = 0.0) -> object | None:
        if not self._claims:
            return None
        ray = import_ray()
        ready, _ = ray.wait(list(self._claims), num_returns=1, timeout=timeout)
        try:
            return ray.get(ready[0]) if ready else None
        except ray.exceptions.RayError:
            return None

    def submit(self, fn: Callable[[T], R], item: T) -> Future:
        ray = import_ray()
        # On the pool's actors, in their own concurrency group: it moves bytes, so it runs at once beside the
        # tokenizing task instead of queueing behind it, in a process that is already up; steps go to every node
        # in turn, so the copying bandwidth grows with the cluster.
        self._step_turn += 1
        actor = self._actors[self._step_actors()[self._step_turn % len(self._step_actors())]]
        out: Future = Future()
        what = f"step {getattr(fn, '__name__', fn)}"

        def settle(done: Future) -> None:  # on a Ray thread: no ray.get here, only the finished future
            e = done.exception()
            if e is None:
                out.set_result(done.result())
            else:
                out.set_exception(_ray_error(ray, e, what, self.retries))

        actor.step.options(concurrency_group="io").remote(fn, item).future().add_done_callback(settle)
        return out

    def _step_actors(self) -> list[int]:
        """One actor per node (its first), the positions `submit` takes in turn."""
        first: dict[str, int] = {}
        for at, (_, node) in enumerate(self._names):
            first.setdefault(node, at)
        return list(first.values())

    def run(
        self, fn: TaskFn, items: Sequence[T], on_progress: Callable[[Any], None] | None = None
    ) -> Iterator[tuple[T, R]]:
        ray = import_ray()
        fn_ref = ray.put(fn)  # shipped once, not with every task
        # One task in flight per actor: an actor that finishes gets the next in order, which is the order the
        # caller merges in, and none holds a queue while another idles at the end. Tasks sent to an actor that
        # is still starting wait in its queue; meanwhile the driver runs a worker's share itself (below).
        queued = list(range(len(items)))[::-1]
        free = list(range(len(self._actors)))[::-1]
        pending: dict = {}  # run ref -> (item position, actor position)
        lost: dict[int, int] = {}  # item position -> times its actor was lost
        share = len(items) // (len(self._actors) + 1)  # tasks the driver may run while the workers start
        self._workers_starting(ray, wait=0.1)  # a warm pool's claims are answered in milliseconds: none is starting
        try:
            while queued or pending:
                while queued and free:
                    pos, at = queued.pop(), free.pop()
                    pending[self._actors[at].run.remote(fn_ref, items[pos])] = (pos, at)
                if queued and share > 0 and self._workers_starting(ray):
                    # A Ray worker process takes 1-2 s to start and import; rather than wait for it idle, the
                    # driver runs tasks itself meanwhile, as one more worker: never more than a worker's share.
                    share -= 1
                    pos = queued.pop()
                    yield items[pos], fn(items[pos], TaskContext(None, threads=1))
                    continue
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    pos, at = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        # Its actor ended (idle just as this job called it) or is lost for good: a new one, and the
                        # task again, a bounded number of times.
                        lost[pos] = lost.get(pos, 0) + 1
                        if lost[pos] > self.retries:
                            raise _ray_error(ray, e, f"task {pos}", self.retries) from None
                        name, node = self._names[at]
                        self._actors[at] = _ray_pool.replacement(ray, name, node, self.retries)
                        self._actors[at].claim.remote(self._keep(), None)
                        queued.append(pos)
                        free.append(at)
                        continue
                    except ray.exceptions.RayError as e:
                        raise _ray_error(ray, e, f"task {pos}", self.retries) from (
                            e if isinstance(e, ray.exceptions.RayTaskError) else None
                        )
                    free.append(at)
                    yield items[pos], result
        finally:
            for ref in pending:  # after an error: stop the rest (a task already running on an actor finishes)
                with contextlib.suppress(Exception):
                    ray.cancel(ref)

    def _keep(self) -> float:
        """Idle seconds a claimed actor waits: `keep_workers`, but not less than it takes a job's first task to
        reach it."""
        return max(self.keep_workers, 5.0)

    def _workers_starting(self, ray, wait: float = 0.0) -> bool:
        """Whether some actor is still starting: its claim (see __enter__) has not finished within `wait` s."""
        if self._claims:
            _, left = ray.wait(list(self._claims), num_returns=len(self._claims), timeout=wait)
            self._claims = {ref: self._claims[ref] for ref in left}
        return bool(self._claims)


def _ray_error(ray, e: BaseException, what: str, retries: int) -> BaseException:
    """What a Ray failure means here: the task's own exception, or a lost worker (one line with the fix)."""
    if not isinstance(e, ray.exceptions.RayError):
        return e
    if isinstance(e, ray.exceptions.RayTaskError):
        return e.cause if isinstance(e.cause, Exception) else e
    return ExecutorError(
        f"{what} failed {retries + 1} times on Ray ({type(e).__name__}: its worker or node died); "
        "finished parts are kept: rerun with --resume"
    )


def _warm_up(fn: Callable[[], object]) -> None:
    fn()


def _run_on_ray(fn: TaskFn, item: T) -> R:
    try:
        return fn(item, TaskContext(None, threads=1))
    except FileNotFoundError as e:
        raise ExecutorError(
            f"{e.filename}: not found on node {socket.gethostname()}; every node must see the inputs and the output "
            "directory at the same path (a shared file system)"
        ) from None

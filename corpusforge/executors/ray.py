"""The Ray executor: every task a call on the warm pool of Ray actors (pool.py), on one machine or a cluster.

The actors, one per CPU of the cluster, outlive the job for `keep_workers` seconds: Ray would start new worker
processes for every job (1-1.5 s each, a quarter of a 1 GB preprocess); the next job finds these started, the
tokenizer loaded. Until new ones are up, the driver runs tasks itself (a share). Ray reruns the task of an actor
whose process died. Tasks may run on other machines, so every path must be absolute and on a file system all nodes
share. Progress arrives per finished task (from the results). `submit` runs a short I/O step on the pool's actors,
in their own concurrency group, one node after another.

Example:
    >>> with RayExecutor(address="auto") as ex:     # the cluster `ray start` made on this node
    ...     sorted(r for _, r in ex.run(square, [1, 2, 3]))
    [1, 4, 9]
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from corpusforge.executors import pool
from corpusforge.executors.base import Executor, ExecutorError, R, T, TaskContext, TaskFn

RAY_EXTRA = "pip install 'corpusforge[ray]'"


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
    processes that outlives the job by `keep_workers` seconds (corpusforge.executors.pool), so the next job finds
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
        keep_workers: float = pool.DEFAULT_KEEP_S,
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
            self._names = pool.pool_names(ray, self.workers)
            self._actors = [pool.actor(ray, name, node, self.retries) for name, node in self._names]
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
                        self._actors[at] = pool.replacement(ray, name, node, self.retries)
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

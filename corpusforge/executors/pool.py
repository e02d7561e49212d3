"""The warm Ray actor pool: worker processes that outlive a job, so that the next job on the cluster does not start
them again. RayExecutor (ray.py) runs its tasks on them.

Ray starts new worker processes for every job and ends them with it. Each one is a Python interpreter that imports
Ray, then corpusforge and the tokenizer: 0.9 core-seconds and 1-1.5 s before its first task (measured on 2 cores),
a quarter of a 1 GB preprocess. A detached actor outlives its job. So every CPU slot of the cluster gets one
named, detached actor (namespace `corpusforge`) that the next job finds again by its name. The name carries a
fingerprint of corpusforge's code, so a job never runs on workers that imported other code, and an actor ends
itself after `keep_s` seconds without work.

The actors reserve no Ray CPUs (num_cpus=0): a pool kept warm never blocks another job's tasks. They use the
CPUs all the same, one task at a time each, one actor per CPU of its node. An actor killed by the OOM killer or a
SIGKILL is restarted by Ray on its node, and the task it was running runs again; one whose node is gone is
replaced by a new one elsewhere.

Example:
    >>> name, node = pool_names(ray, count=4)[0]
    >>> worker = actor(ray, name, node, retries=2)           # found, or created where missing
    >>> ray.get(worker.claim.remote(60.0, None))             # the warm-up's result; keeps the actor 60 s more
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from corpusforge.executors.base import ExecutorError, R, T, TaskContext, TaskFn

NAMESPACE = "corpusforge"
DEFAULT_KEEP_S = 60.0


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A short hash of corpusforge's source files (path, size, mtime): a new install or an edit gives a new pool."""
    root = Path(__file__).resolve().parents[1]  # corpusforge/, of which this is executors/pool.py
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def slots(nodes: list[dict], count: int) -> list[tuple[str, int]]:
    """`count` (node id, slot number) pairs, one per CPU, taken round-robin over the alive nodes in id order, so
    that a job asking for fewer workers than the cluster has CPUs still spreads over the nodes.

    Example: slots([{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.0}}], 2) -> [("a", 0), ("a", 1)]
    """
    cpus = {n["NodeID"]: int(n.get("Resources", {}).get("CPU", 0)) for n in nodes if n.get("Alive")}
    order = sorted(node for node, c in cpus.items() if c > 0)
    out = [(node, j) for j in range(max(cpus.values(), default=0)) for node in order if j < cpus[node]]
    if len(out) < count:  # asked for more workers than CPUs: more actors on the nodes, as tasks would queue
        extra = [(order[i % len(order)], len(out) + i) for i in range(count - len(out))] if order else []
        out += extra
    return out[:count]


def pool_names(ray, count: int) -> list[tuple[str, str]]:
    """The (name, node id) of `count` pool actors; `actor(ray, name, node, retries)` finds or creates each."""
    fp = code_fingerprint()
    return [(f"worker-{fp}-{node[:16]}-{j}", node) for node, j in slots(ray.nodes(), count)]


def actor(ray, name: str, node: str | None, retries: int):
    """The live actor called `name`, created on `node` (None: where Ray likes) where none lives."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Hard affinity: with soft=True Ray placed both actors of a two-node cluster on one node now and then (seen in
    # tests). A node that is gone makes the actor fail to schedule; `replacement` then places it anywhere.
    where = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"

    return (
        # an "io" group: steps (copying parts into place) run beside the one running task
        ray.remote(concurrency_groups={"io": 2})(PoolWorker)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,  # a long-lived actor meets many kills over its life; each task has its own bound
            max_task_retries=retries,
            scheduling_strategy=where,
        )
        .remote()
    )


def replacement(ray, name: str, node: str, retries: int, timeout: float = 60.0):
    """A live actor in the place of one that ended itself (idle too long) just as a job called it."""
    deadline = time.monotonic() + timeout
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    while True:
        handle = actor(ray, name, node if node in alive else None, retries)
        try:
            ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return handle
        except ray.exceptions.RayActorError:  # still the dying one: its name is freed in a moment
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class PoolWorker:
    """One pool actor: runs tasks one at a time and ends itself after `keep_s` idle seconds (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._last = time.monotonic()
        self._keep = DEFAULT_KEEP_S
        threading.Thread(target=self._end_when_idle, name="corpusforge-pool-idle", daemon=True).start()

    def ping(self) -> int:
        return os.getpid()

    def claim(self, keep_s: float, warm_up: Callable[[], Any] | None) -> Any:
        """Keep this actor for `keep_s` idle seconds from now; run `warm_up` (cached by the caller's code, so a
        warm actor answers at once) and return its result."""
        with self._lock:
            self._keep, self._last = keep_s, time.monotonic()
        return warm_up() if warm_up is not None else None

    def run(self, fn: Callable, item: Any) -> Any:
        with self._working():
            return run_task(fn, item)

    def step(self, fn: Callable, item: Any) -> Any:
        """A short I/O step (Executor.submit), called in the "io" concurrency group beside `run`."""
        with self._working():
            return fn(item)

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """Busy while inside: the idle clock restarts when the last piece of work ends."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()

    def _end_when_idle(self) -> None:
        import ray

        while True:
            time.sleep(0.5)
            with self._lock:
                if not self._busy and time.monotonic() - self._last > self._keep:
                    break
        # no_restart: an idle end is not a failure. A job that calls this actor meanwhile gets ActorDiedError and
        # asks for a replacement.
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def run_task(fn: TaskFn, item: T) -> R:
    """`fn(item, ctx)` on a pool actor: a missing path names the node, because on a cluster that means the inputs
    or the output directory are not on a file system every node shares."""
    try:
        return fn(item, TaskContext(None, threads=1))
    except FileNotFoundError as e:
        raise ExecutorError(
            f"{e.filename}: not found on node {socket.gethostname()}; every node must see the inputs and the output "
            "directory at the same path (a shared file system)"
        ) from None

"""`python killed_build.py STAGE:STEP ARGS...`: `corpusforge ARGS` (build-knn) with a real SIGKILL at STAGE:STEP.

The build is the real one, in this process and the workers it forks; only this process's copy of two seams is
wrapped before it starts, so the package holds no test hook:

- the tasks an executor runs (`LocalExecutor.run`, `DriverExecutor.run`): at chunks:i, embeddings:i, index:i (add
  task i - 1) and neighbours:i the process that ran task i (this one, or a forked worker) dies right after the task
  has written its output, as a crash there would leave it;
- the index's writes (`fill.write_index_atomic`): at index:0 this process dies right after trained.faiss is
  written, before any add task.

Example: python tests/retro/killed_build.py embeddings:1 build-knn out/c_text_document --output db --workers 1
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# the task function an executor is handed -> the stage it belongs to
STAGE_OF_TASK = {
    "chunk_range": "chunks",
    "embed_shard": "embeddings",
    "add_range": "index",
    "neighbours_range": "neighbours",
}


def step_of(stage: str, task) -> int:
    """The kill step of `task`: its number (a shard for embeddings); index steps start at 1 (0 is the training)."""
    if stage == "embeddings":
        return task
    return task[0] + 1 if stage == "index" else task[0]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no atexit: what the OOM killer leaves


class KillAfter:
    """A task function that dies after running the task at `step` (picklable: a forked pool sends it to workers)."""

    def __init__(self, fn, stage: str, step: int) -> None:
        self.fn, self.stage, self.step = fn, stage, step

    def __call__(self, task, ctx):
        result = self.fn(task, ctx)
        if step_of(self.stage, task) == self.step:
            die()
        return result


def arm(stage: str, step: int) -> None:
    from corpusforge.executors import LocalExecutor
    from corpusforge.retro import fill
    from corpusforge.stages import DriverExecutor

    for cls in (LocalExecutor, DriverExecutor):
        real_run = cls.run

        def run(self, fn, items, on_progress=None, real_run=real_run):
            name = getattr(getattr(fn, "func", fn), "__name__", "")
            if STAGE_OF_TASK.get(name) == stage:
                fn = KillAfter(fn, stage, step)
            return real_run(self, fn, items, on_progress)

        cls.run = run

    real_write = fill.write_index_atomic

    def write_index_atomic(faiss, index, path: Path) -> None:
        real_write(faiss, index, path)
        if (stage, step) == ("index", 0) and Path(path).name == "trained.faiss":
            die()

    fill.write_index_atomic = write_index_atomic


if __name__ == "__main__":
    from retrokit import cli_group

    where, *args = sys.argv[1:]
    stage, step = where.split(":")
    arm(stage, int(step))
    cli_group()(args, prog_name="corpusforge")

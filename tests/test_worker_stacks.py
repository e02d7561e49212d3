"""corpusforge.worker_stacks with real processes: a worker whose main thread is blocked in a system call (a read of
a pipe nobody writes, as a read of a hung mount) answers with every thread's stack; a pid that is not a worker of
this process is never signalled."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

from corpusforge import worker_stacks


def _stuck_worker(fd: int) -> None:
    worker_stacks.serve_in_worker()
    os.read(fd, 1)  # blocks: nothing is ever written


def test_a_worker_blocked_in_a_read_answers_with_its_stacks(tmp_path):
    where = worker_stacks.prepare(tmp_path / "stacks")
    r, w = os.pipe()
    worker = multiprocessing.get_context("fork").Process(target=_stuck_worker, args=(r,), daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while not (where / f"{worker.pid}.worker").exists():
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.02)
        time.sleep(0.2)  # into the read
        stacks = worker_stacks.collect(where, wait_s=5)
        assert list(stacks) == [worker.pid]
        assert "in _stuck_worker" in stacks[worker.pid] and "Thread 0x" in stacks[worker.pid], stacks
        assert worker.is_alive()  # asked, not killed
    finally:
        worker.kill()
        worker.join()
        os.close(w)
        os.close(r)
        worker_stacks.forget(where)
    assert not where.exists() and worker_stacks.ENV not in os.environ


def test_a_pid_that_is_not_a_worker_is_never_signalled(tmp_path):
    where = worker_stacks.prepare(tmp_path / "stacks")
    # a process that is not this one's child (its parent is the shell), and would die of SIGUSR2
    other = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' & echo $!"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid = int(other.stdout.readline())
    try:
        (where / f"{pid}.worker").touch()
        assert worker_stacks.collect(where, wait_s=0.2) == {}
        time.sleep(0.2)
        os.kill(pid, 0)  # still alive
        assert not (where / f"{pid}.worker").exists()
    finally:
        os.kill(pid, 9)
        other.wait()
        worker_stacks.forget(where)

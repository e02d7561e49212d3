"""Worker processes end with the process that started them, however it dies: a real command (preprocess's local
executor, build-knn's neighbours stage, the trainer's DataLoader workers) is SIGKILLed while its workers are busy
inside a task, and every descendant must be gone within seconds (issue 21: a build-knn worker outlived its killed
parent by 16 minutes, a DataLoader worker outlived a killed training run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS / "retro"))
sys.path.insert(0, str(TESTS / "train"))

from retrokit import topical_documents, write_dataset  # noqa: E402
from trainkit import tiny_overrides, write_markov_corpus  # noqa: E402

WORKERS = 2


def _preprocess_args(tmp: Path) -> list[str]:
    with open(tmp / "in.jsonl", "w") as f:
        for i in range(2000):
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    return [
        "preprocess",
        str(tmp / "in.jsonl"),
        "--output-prefix",
        str(tmp / "out"),
        "--workers",
        str(WORKERS),
        "--task-size",
        "20k",
    ]


def _neighbours_args(tmp: Path) -> list[str]:
    data = write_dataset(tmp / "corpus", topical_documents(150, max_len=300))  # ~400 chunks: 2 blocks of 256
    opts = ["--shard-size", "256", "--index-key", "IVF8,Flat", "--recall-queries", "100", "--workers", str(WORKERS)]
    return ["build-knn", data, "--output", str(tmp / "db"), *opts]


def _loader_args(tmp: Path) -> list[str]:
    data = write_markov_corpus(tmp / "corpus")
    return tiny_overrides(data, tmp / "run", num_workers=WORKERS, eval_interval=0)


ARGS = {"preprocess": _preprocess_args, "neighbours": _neighbours_args, "loader": _loader_args}


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ARGS))
def test_workers_die_with_their_sigkilled_parent(tmp_path, kind):
    markers = tmp_path / "markers"
    markers.mkdir()
    cmd = [sys.executable, str(TESTS / "orphan_job.py"), str(markers), kind, *ARGS[kind](tmp_path)]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.time() + 120
        while len(list(markers.iterdir())) < WORKERS:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.time() < deadline, "the workers never started their tasks"
            time.sleep(0.1)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        busy = {int(p.name) for p in markers.iterdir()}
        assert busy <= {p.pid for p in descendants}  # the busy workers are the command's own processes
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 5
        while not all(_gone(p) for p in descendants) and time.time() < deadline:
            time.sleep(0.05)
        left = [f"{p.pid} {p.cmdline()[:4]}" for p in descendants if not _gone(p)]
        assert not left, f"alive 5 s after their parent was SIGKILLed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in descendants:  # the test cleans up after a failure; it is not what passes it
            if not _gone(p):
                p.kill()


def test_a_child_whose_parent_died_before_it_could_ask_ends_at_once():
    """The race the prctl alone leaves: the parent dies between the fork and the child's prctl, the child is already
    reparented and no signal will come. die_with_parent sees the parent's pid is no longer its parent's, and ends."""
    import multiprocessing as mp

    from corpusforge.executors import die_with_parent

    ctx = mp.get_context("fork")
    gone = ctx.Process(target=die_with_parent, args=(os.getpid() + 1,))  # "the parent" is not ours any more
    alive = ctx.Process(target=die_with_parent, args=(os.getpid(),))
    for p in (gone, alive):
        p.start()
        p.join(10)
    assert gone.exitcode == -signal.SIGKILL and alive.exitcode == 0

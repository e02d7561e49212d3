"""bench-io's offload pattern: the nvme optimizer step's own streaming code over three state files per process,
reads ahead and writes behind; its rows count every byte the steps moved, with O_DIRECT where the file system takes
it (a disk) and buffered where it does not (a real ramfs), and nothing is left behind."""

from __future__ import annotations

import os

import pytest
from iobench_helpers import tiny

from corpusforge.iobench.config import KiB, MiB
from corpusforge.iobench.offload import OFFLOAD_STEPS
from corpusforge.iobench.runner import run_bench


@pytest.mark.slow
@pytest.mark.parametrize("where", ["disk", "ramfs"])
def test_offload_rows_count_what_the_steps_read_and_wrote(tmp_path, where, request):
    root = request.getfixturevalue("ramfs") if where == "ramfs" else tmp_path / "disk"
    root.mkdir(exist_ok=True)
    config = tiny(root, patterns=("offload",), file_size=3 * MiB, block_sizes=(256 * KiB,), procs=(2,))
    run = run_bench(config)
    assert all(r.verdict == "ok" for r in run.results), [r.message for r in run.results]
    read, write, step = run.results
    assert (read.phase, write.phase, step.phase) == ("read", "write", "step")
    per_process = OFFLOAD_STEPS * 3 * (MiB // (256 * KiB)) * 256 * KiB  # three 1 MiB files, each step reads them
    assert read.bytes == write.bytes == 2 * per_process and step.bytes == 4 * per_process  # two processes
    assert step.mb_s == pytest.approx(step.bytes / step.seconds / 1e6)
    assert step.cache == ("O_DIRECT" if where == "disk" else "fadvise DONTNEED (ramfs: memory is the storage)")
    assert os.listdir(root) == []

"""bench-io under torchrun: every rank runs the same cases, rank 0 gathers and reports the aggregate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from iobench_helpers import HERE


@pytest.mark.slow
def test_two_ranks_aggregate_on_rank_0(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "bench_io_main.py"),
        str(out),
        "--pattern",
        "seq-read",
        "--pattern",
        "seq-write",
        "--pattern",
        "rand-read",
        "--layout",
        "shared",
        "--file-size",
        "2M",
        "--block-size",
        "256k",
        "--rand-ops",
        "100",
        "--json",
        str(tmp_path / "r.json"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = {r["pattern"]: r for r in doc["results"]}
    assert all(r["ranks"] == 2 for r in rows.values())
    assert rows["seq-read"]["bytes"] == 2 * 2 * 2**20  # both ranks' regions of the shared file
    assert rows["seq-write"]["bytes"] == 2 * 2 * 2**20
    assert rows["rand-read"]["ops"] == 2 * 100
    assert proc.stdout.count("corpusforge bench-io") == 1  # one report, from rank 0
    assert os.listdir(out) == []


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ("single", 0, 1)),
        ({"RANK": "3", "WORLD_SIZE": "4"}, ("torchrun", 3, 4)),
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, ("srun", 1, 2)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, ("single", 0, 1)),  # a batch script's own process
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, ("torchrun", 1, 2)),
    ],
)
def test_launch_env(env, expected):
    from corpusforge.iobench.ranks import launch_env

    assert launch_env(env) == expected

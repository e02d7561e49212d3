"""bench-io under a real Slurm (munged + slurmctld + slurmd on loopback): `srun -n 2` runs two ranks and rank 0
reports both; a batch script that runs bench-io without srun is one rank, not rank 0 of N waiting for the rest."""

from __future__ import annotations

import json
import os
import socket

import pytest
from iobench_helpers import HERE

SMALL = ["--layout", "shared", "--file-size", "2M", "--block-size", "256k", "--rand-ops", "100"]
PATTERNS = ["--pattern", "seq-read", "--pattern", "seq-write", "--pattern", "rand-read"]


def bench_io(*args: str) -> list[str]:
    import sys

    return [sys.executable, str(HERE / "bench_io_main.py"), *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_srun_two_tasks_aggregate_on_rank_0(slurm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    report = tmp_path / "r.json"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = ["srun", "-n", "2", "--label", *bench_io(str(out), *PATTERNS, *SMALL, "--json", str(report))]
    proc = slurm.run(*cmd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + slurm.log("slurmd")
    doc = json.loads(report.read_text())
    assert doc["ranks"] == {"world": 2, "launcher": "srun"}
    rows = {r["pattern"]: r for r in doc["results"]}
    assert all(r["ranks"] == 2 and r["procs"] == 1 for r in rows.values())
    assert rows["seq-read"]["bytes"] == 2 * 2 * 2**20  # both tasks' regions of the shared file
    assert rows["seq-write"]["bytes"] == 2 * 2 * 2**20
    assert rows["rand-read"]["ops"] == 2 * 100
    # --label prefixes each line with the task that printed it: the table comes from task 0 alone
    titles = [ln for ln in proc.stdout.splitlines() if "corpusforge bench-io" in ln]
    assert len(titles) == 1 and titles[0].lstrip().startswith("0:"), proc.stdout
    assert os.listdir(out) == []


@pytest.mark.slow
def test_batch_script_without_srun_is_one_rank(slurm, tmp_path):
    """sbatch -n 2 sets SLURM_NTASKS=2 and SLURM_PROCID=0 in the script's one process; bench-io must not wait
    there for a second rank (nor ask for MASTER_ADDR)."""
    out = tmp_path / "out"
    out.mkdir()
    report = tmp_path / "r.json"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nenv | grep '^SLURM_NTASKS=' > " + str(tmp_path / "env.txt") + "\n"
        + " ".join(bench_io(str(out), "--pattern", "seq-read", *SMALL, "--json", str(report))) + "\n"
    )  # fmt: skip
    log = tmp_path / "job.out"
    proc = slurm.run("sbatch", "--wait", "-n", "2", "-o", str(log), str(script))
    assert proc.returncode == 0, proc.stderr + (log.read_text() if log.exists() else "")
    assert (tmp_path / "env.txt").read_text().strip() == "SLURM_NTASKS=2"  # the trap was really there
    doc = json.loads(report.read_text())
    assert doc["ranks"] == {"world": 1, "launcher": "single"}
    assert doc["results"][0]["ranks"] == 1 and doc["results"][0]["bytes"] == 2 * 2**20
    assert os.listdir(out) == []

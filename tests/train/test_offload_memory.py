"""parallel.offload = "nvme" under a real memory limit: in a cgroup whose limit is below the optimizer state's size
(fp32 master weights and AdamW's two moments: 12 bytes per parameter), the nvme run finishes with the in-memory run's
losses, while the in-memory run (16 bytes per parameter: weights, gradients, moments) is killed by the limit.

The model is a one-layer Llama with an untied 100k vocabulary at width 768 (160.8M parameters, nearly all in the
embedding and the head, so that a step is one small matmul and the state is large): its state is 1.93 GB, the limit
1.8 GB; the nvme run holds weights and gradients (1.29 GB), the process (~0.25 GB) and 96 MiB of buffers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainkit import run_records, tiny_overrides, write_markov_corpus

LIMIT = 1800 << 20
STEPS = 2
PARAMS = 160_827_648  # the model below (printed in its plan); 12 bytes each are the optimizer state


def memory_cgroup_kind() -> str | None:
    """ "v2" (memory.max) where cgroup v2 has the memory controller, "v1" (memory.limit_in_bytes), or None."""
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2"
    return "v1" if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() else None


@pytest.fixture
def memory_limited():
    """limit(bytes) -> wrap: a function that turns a command into one running in a fresh memory cgroup of that limit
    (no swap on top: memory.swap.max 0 in v2; v1 without swap accounting has none to give). Removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root (makes a cgroup); CI runs as root")
    kind = memory_cgroup_kind()
    if kind is None:  # not a skip: a memory-limit test that silently skips proves nothing
        pytest.fail("no memory cgroup: neither cgroup v2 with the memory controller nor v1 memory is mounted")
    root = Path("/sys/fs/cgroup" if kind == "v2" else "/sys/fs/cgroup/memory")
    made: list[Path] = []

    def limit(nbytes: int):
        group = root / f"corpusforge-offload-{os.getpid()}-{len(made)}"
        try:
            if kind == "v2":
                (root / "cgroup.subtree_control").write_text("+memory")
            group.mkdir()
            made.append(group)
            if kind == "v2":
                (group / "memory.max").write_text(str(nbytes))
                (group / "memory.swap.max").write_text("0")
            else:
                (group / "memory.limit_in_bytes").write_text(str(nbytes))
        except OSError as e:
            pytest.fail(f"cannot make a {kind} memory cgroup under {root}: {e}")
        return lambda cmd: ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]

    yield limit
    for group in made:
        for _ in range(50):  # the command has exited; the kernel lets go of the group shortly after
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def big_overrides(corpus: str, out: Path, offload: str) -> list[str]:
    return tiny_overrides(corpus, out, **{
        "model.family": '"llama"', "model.n_embd": 768, "model.n_head": 2, "model.vocab_size": 100000,
        "schedule.micro_batch_size": 1, "schedule.global_batch_tokens": 32, "schedule.max_steps": STEPS,
        "checkpoint.interval": 0, "checkpoint.async_write": "false", "metrics.eval_interval": 0,
        "parallel.offload": f'"{offload}"'})  # fmt: skip


def run(args: list[str], wrap=lambda cmd: cmd) -> subprocess.CompletedProcess:
    code = "import sys; from corpusforge.train import load_config, train; train(load_config(None, sys.argv[1:]))"
    return subprocess.run(wrap([sys.executable, "-c", code, *args]), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_nvme_trains_under_a_memory_limit_below_its_state_that_kills_the_in_memory_run(tmp_path, memory_limited):
    assert LIMIT < 12 * PARAMS  # below the optimizer state's size
    corpus = write_markov_corpus(tmp_path / "markov", num_docs=40)
    reference = run(big_overrides(corpus, tmp_path / "reference", "none"))  # no limit
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert f'"params": {PARAMS}' in reference.stdout
    killed = run(big_overrides(corpus, tmp_path / "memory", "none"), memory_limited(LIMIT))
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])  # SIGKILL: the kernel's OOM killer
    offloaded = run(big_overrides(corpus, tmp_path / "nvme", "nvme"), memory_limited(LIMIT))
    assert offloaded.returncode == 0, offloaded.stderr[-2000:]
    expected = [r["loss"] for _, r in sorted(run_records(tmp_path / "reference").items())]
    assert len(expected) == STEPS
    assert [r["loss"] for _, r in sorted(run_records(tmp_path / "nvme").items())] == expected

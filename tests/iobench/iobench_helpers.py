"""Helpers for the bench-io tests (a plain module the tests import): the CLI as a subprocess, tiny configurations,
tmpfs and FUSE mounts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corpusforge.iobench.config import BenchConfig, KiB, MiB

# The command as a module call, so that it runs before it is registered in corpusforge.cli.
CLI = [sys.executable, "-c", "from corpusforge.cli.bench_io import bench_io_cmd; bench_io_cmd()"]
HERE = Path(__file__).parent


def tiny(path, **over) -> BenchConfig:
    """A configuration that runs every pattern in about a second."""
    base = dict(
        paths=(str(path),),
        file_size=2 * MiB,
        block_sizes=(256 * KiB,),
        rand_ops=200,
        metadata_files=20,
        checkpoint_size=1 * MiB,
        checkpoint_hidden=128,
        synthetic_tokens=200_000,
        seq_length=256,
        micro_batch=2,
        steps=3,
        stall_seconds=5.0,
        hang_seconds=30.0,
    )
    base.update(over)
    return BenchConfig(**base)


def cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a tmpfs); CI runs as root")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size, unmounted after the test."""
    needs_root()
    mounted = []

    def mount(size: str, options: str = "") -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse") or not shutil.which("fusermount"):
        return "needs /dev/fuse and fusermount (apt-get install -y fuse3 libfuse2)"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as e:
        return f"needs fusepy and libfuse2 (pip install fusepy; apt-get install -y libfuse2): {e}"
    return None


@pytest.fixture
def slowfs(tmp_path):
    """mount(delay) -> (mountpoint, source dir, daemon Popen): tests/iobench/slowfs.py adding `delay` s per I/O."""
    needs_root()
    missing = fuse_missing()
    if missing:
        pytest.fail(missing)  # not a skip: CI installs these, and a skipped storage test proves nothing
    daemons = []

    def mount(delay: float):
        source, point = tmp_path / "slow-src", tmp_path / "slow-mnt"
        source.mkdir()
        point.mkdir()
        cmd = [sys.executable, str(HERE / "slowfs.py"), str(source), str(point), "--delay", str(delay)]
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        daemons.append((daemon, point))
        for _ in range(100):
            if os.path.ismount(point):
                return point, source, daemon
            time.sleep(0.05)
        raise RuntimeError(f"slowfs did not mount: {daemon.stderr.read() if daemon.poll() is not None else ''}")

    yield mount
    for daemon, point in daemons:
        daemon.send_signal(18)  # SIGCONT, in case a test stopped it
        subprocess.run(["fusermount", "-u", "-z", str(point)], check=False)
        daemon.terminate()
        daemon.wait(10)

"""Helpers for the bench-io tests (a plain module the tests import): the CLI as a subprocess, tiny configurations,
tmpfs and FUSE mounts, a one-node Slurm."""

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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm (tests/iobench/slurm_cluster.py), stopped after the module's tests."""
    from slurm_cluster import APT_PACKAGES, SlurmCluster, missing_programs

    needs_root()  # slurmd runs the tasks as their submitting user and must be root to do so
    missing = missing_programs()
    if missing:
        pytest.fail(f"Slurm programs {missing} missing: apt-get install -y --no-install-recommends {APT_PACKAGES}")
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def io_cgroup() -> str | None:
    """Which block-I/O throttle this machine offers: "v2" (cgroup v2 io.max), "v1" (blkio.throttle), or None."""
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.exists() and "io" in controllers.read_text().split():
        return "v2"
    if Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists():
        return "v1"
    return None


@pytest.fixture
def throttled_disk(tmp_path):
    """throttle(read_bps, write_bps) -> (mountpoint, wrap): an ext4 file system on a fresh loop device, and a
    function that turns a command into one running inside a cgroup whose reads and writes of that device are
    limited to those rates (cgroup v2 io.max, or cgroup v1 blkio.throttle.*_bps_device). Removed after the test."""
    needs_root()
    kind = io_cgroup()
    if kind is None:  # not a skip: a throttle test that silently skips proves nothing
        pytest.fail("no cgroup I/O throttle: neither cgroup v2 with the io controller nor v1 blkio is mounted")
    missing = [p for p in ("losetup", "mkfs.ext4") if not shutil.which(p)]
    if missing:
        pytest.fail(f"{missing} missing: apt-get install -y mount e2fsprogs")
    image, point = tmp_path / "disk.img", tmp_path / "throttled"
    point.mkdir()
    with open(image, "wb") as f:
        f.truncate(160 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    loop = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True)
    device = loop.stdout.strip()
    subprocess.run(["mount", device, str(point)], check=True)
    rdev = os.stat(device).st_rdev
    majmin = f"{os.major(rdev)}:{os.minor(rdev)}"
    v2 = kind == "v2"
    group = Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/blkio") / f"corpusforge-test-{os.getpid()}"

    def throttle(read_bps: int, write_bps: int):
        try:
            if v2:
                # EBUSY here: this cgroup holds processes itself (a container's root), and cgroup v2 enables
                # controllers only for children of a cgroup without processes (the no-internal-process rule)
                Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+io")
                group.mkdir()
                (group / "io.max").write_text(f"{majmin} rbps={read_bps} wbps={write_bps}")
            else:
                group.mkdir()
                (group / "blkio.throttle.read_bps_device").write_text(f"{majmin} {read_bps}")
                (group / "blkio.throttle.write_bps_device").write_text(f"{majmin} {write_bps}")
        except OSError as e:
            pytest.fail(f"cannot set a cgroup {kind} I/O throttle on {device} ({majmin}) under {group.parent}: {e}")

        def wrap(cmd: list[str]) -> list[str]:  # join the cgroup, then become the command (its children follow)
            return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]

        return point, wrap

    yield throttle
    subprocess.run(["umount", str(point)], check=False)
    subprocess.run(["losetup", "-d", device], check=False)
    if group.exists():
        for _ in range(50):  # the command's processes have exited; the kernel lets go of the group shortly after
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)

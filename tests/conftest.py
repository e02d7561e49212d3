"""Fixtures shared by every test folder: a real Ceph cluster on loopback (RGW for S3, CephFS via ceph-fuse), and a
ramfs mount (a file system that refuses O_DIRECT).

    @pytest.mark.slow
    @pytest.mark.ceph
    def test_something(ceph_cluster):
        url = ceph_cluster.bucket("my-bucket") + "/key"          # s3://my-bucket/key, on RGW
        options = ceph_cluster.storage_options                   # fsspec/s3fs options for that URL
        path = ceph_cluster.cephfs_mount / "file"                # a file on CephFS

Or `ceph = request.getfixturevalue("ceph_cluster")` inside a test. One cluster serves the whole session (it
takes ~15 s to start; under `-n 2`, each of the two processes that meets a Ceph test starts its own); tests share
it, so each uses its own bucket and CephFS directory. The attributes are
those of tests/ceph_cluster.py's CephCluster: .s3_endpoint, .access_key, .secret_key, .storage_options,
.filesystem(), .bucket(name), .cephfs_mount, .ceph(*args), .start_seconds, .stop().

Where the Ceph packages are missing the fixture fails with the apt-get line that installs them; set
CORPUSFORGE_SKIP_CEPH=1 to skip these tests instead (CI does not: they must run there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/ceph_cluster.py, importable from every test folder

from ceph_cluster import APT_PACKAGES, CephCluster, missing_binaries  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ceph: needs the loopback Ceph cluster (the ceph_cluster fixture)")


@pytest.fixture(scope="session")
def ceph_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A running one-node Ceph cluster (mon, memstore OSD, radosgw, MDS, ceph-fuse), stopped after the session."""
    missing = missing_binaries()
    if missing:
        message = f"Ceph programs {missing} missing: apt-get install -y --no-install-recommends {APT_PACKAGES}"
        if os.environ.get("CORPUSFORGE_SKIP_CEPH") == "1":
            pytest.skip(message)
        pytest.fail(message + " (or set CORPUSFORGE_SKIP_CEPH=1 to skip the Ceph tests)", pytrace=False)
    # A short root: Ceph's admin sockets live under it and unix socket paths are limited to 107 bytes.
    cluster = CephCluster.start(tmp_path_factory.mktemp("ceph"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: a file system that refuses O_DIRECT (tmpfs takes it since Linux 6.6)."""
    where = tmp_path / "ramfs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)

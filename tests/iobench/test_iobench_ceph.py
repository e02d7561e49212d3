"""bench-io against real Ceph on loopback: CephFS through ceph-fuse, S3 through radosgw, and a CephFS quota."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid

import pytest
from iobench_helpers import cli

# CORPUSFORGE_BENCH_IO_SIZE scales the comparison up for the README's figures (default: small, for CI).
SIZE = os.environ.get("CORPUSFORGE_BENCH_IO_SIZE", "8M")
SMALL = [
    "--file-size",
    SIZE,
    "--block-size",
    "1M",
    "--rand-ops",
    "300",
    "--metadata-files",
    "50",
    "--checkpoint-size",
    SIZE,
    "--stall",
    "5",
    "--hang",
    "60",
]
PATTERNS = [
    "--pattern",
    "seq-write",
    "--pattern",
    "seq-read",
    "--pattern",
    "rand-read",
    "--pattern",
    "metadata",
    "--pattern",
    "checkpoint",
]


def options(ceph) -> list[str]:
    return [a for k, v in ceph.storage_options.items() for a in ("--storage-option", f"{k}={v}")]


@pytest.mark.slow
@pytest.mark.ceph
def test_cephfs_and_rgw_side_by_side_with_local_disk(ceph_cluster, tmp_path):
    cephfs = ceph_cluster.cephfs_mount / f"iobench-{uuid.uuid4().hex[:8]}"
    cephfs.mkdir()
    bucket = ceph_cluster.bucket("iobench")
    local = tmp_path / "local"
    local.mkdir()
    out = tmp_path / "r.json"
    proc = cli(
        str(local),
        "--compare",
        str(cephfs),
        "--compare",
        bucket,
        *PATTERNS,
        *SMALL,
        *options(ceph_cluster),
        "--json",
        str(out),
        timeout=600,
    )
    assert proc.returncode in (0, 4), proc.stderr  # 4: stalls, which a loaded 2-core CI machine may show
    doc = json.loads(out.read_text())
    fs = {p["path"]: p["fs"] for p in doc["paths"]}
    assert fs[str(cephfs)].startswith("fuse") and fs[bucket] == "s3"
    for path in (str(local), str(cephfs), bucket):
        got = {(r["pattern"], r["phase"]) for r in doc["results"] if r["path"] == path}
        assert ("seq-read", "read") in got and ("rand-read", "read") in got and ("metadata", "stat") in got, path
        assert all(r["verdict"] in ("ok", "stalls") for r in doc["results"] if r["path"] == path)
    reads = {r["path"]: r for r in doc["results"] if r["pattern"] == "seq-read"}
    assert reads[bucket]["bytes"] == reads[str(cephfs)]["bytes"] == reads[str(local)]["bytes"]
    assert os.listdir(cephfs) == [] and os.listdir(local) == []
    assert not [k for k in ceph_cluster.filesystem().ls(bucket.removeprefix("s3://")) if ".corpusforge-bench-" in k]
    keep = os.environ.get("CORPUSFORGE_BENCH_IO_RESULTS")  # where the README's Ceph figures come from
    if keep:
        shutil.copyfile(out, keep)
        print(proc.stdout)


@pytest.mark.slow
@pytest.mark.ceph
def test_cephfs_quota_is_reported_as_edquot(ceph_cluster):
    """A directory already near its quota (as a user's project dir is): the benchmark's writes get EDQUOT.
    CephFS enforces quotas in the client from the quota root's recursive byte count, which reaches the client
    after a flush; so the earlier data is fsynced and given a moment, as it would have been long ago."""
    quota = ceph_cluster.cephfs_mount / f"quota-{uuid.uuid4().hex[:8]}"
    quota.mkdir()
    os.setxattr(quota, "ceph.quota.max_bytes", b"4194304")  # 4 MiB
    with open(quota / "existing.bin", "wb") as f:
        f.write(b"\0" * (4 << 20))
        os.fsync(f.fileno())
    deadline = time.monotonic() + 30
    while int(os.getxattr(quota, "ceph.dir.rbytes")) < 4 << 20 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc = cli(
        str(quota),
        "--pattern",
        "seq-write",
        "--file-size",
        "16M",
        "--block-size",
        "1M",
        "--no-space-check",
        "--json",
        "-",
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Disk quota exceeded (EDQUOT)" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["results"][-1]["verdict"] == "error" and doc["results"][-1]["extra"]["errno"] == errno.EDQUOT
    assert os.listdir(quota) == ["existing.bin"]  # the benchmark's files are gone, the user's are not


@pytest.mark.slow
@pytest.mark.ceph
def test_cephfs_quota_smaller_than_the_run_is_refused_before_any_work(ceph_cluster):
    quota = ceph_cluster.cephfs_mount / f"quota-{uuid.uuid4().hex[:8]}"
    quota.mkdir()
    os.setxattr(quota, "ceph.quota.max_bytes", b"4194304")
    proc = cli(str(quota), "--pattern", "seq-write", "--file-size", "32M", "--block-size", "1M", timeout=300)
    assert proc.returncode == 1
    assert "the run needs 32 MiB but the CephFS quota leaves 4 MiB" in proc.stderr
    assert os.listdir(quota) == []


LOADER = ["--seq-length", "256", "--micro-batch", "2", "--steps", "4", "--remote-block-size", "1M"]


@pytest.mark.slow
@pytest.mark.ceph
def test_replay_and_train_from_an_s3_dataset_on_rgw(ceph_cluster, tmp_path):
    """A .bin/.idx uploaded to RGW, replayed and trained on through the loader's ranged reads (1 MiB blocks, so
    that the small dataset still takes several GETs); then a run without --dataset uploads a synthetic one."""
    import numpy as np

    from corpusforge.indexed import IndexedDatasetWriter

    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 2000, 600)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(rng.integers(0, 50000, int(lengths.sum()), dtype=np.uint16), lengths)
    bucket = ceph_cluster.bucket("iobench-loader")
    fs = ceph_cluster.filesystem()
    url = f"{bucket}/datasets/corpus_text_document"
    for ext in (".bin", ".idx"):
        fs.put_file(f"{prefix}{ext}", f"{url.removeprefix('s3://')}{ext}")
    out = tmp_path / "r.json"
    train = ["--compute-time", "0.02", "--max-accelerators", "1"]  # one trial: the search is tested locally
    cmd = [bucket, "--pattern", "replay", "--pattern", "train", "--dataset", url, *LOADER, *train]
    proc = cli(*cmd, *options(ceph_cluster), "--json", str(out), timeout=600)
    assert proc.returncode in (0, 4), proc.stderr  # 4: stalls, which a loaded 2-core CI machine may show
    doc = json.loads(out.read_text())
    rows = [r for r in doc["results"] if r["verdict"] in ("ok", "stalls")]
    assert len(rows) == len(doc["results"]) and {r["pattern"] for r in rows} == {"replay", "train"}
    replay = next(r for r in rows if r["pattern"] == "replay")
    assert replay["ops"] == 4 and replay["bytes"] == 4 * 2 * 257 * 2  # steps x batch x (seq + 1) x uint16
    assert replay["extra"]["samples_s"] > 0 and replay["extra"]["tokens_s"] == pytest.approx(
        replay["extra"]["samples_s"] * 256
    )
    assert replay["cache"].startswith("ranged GETs of 1 MiB blocks")
    # what went over the network: whole 1 MiB blocks (the last one shorter), at least the samples' bytes
    assert replay["extra"]["requests"] >= 1
    assert replay["bytes"] <= replay["extra"]["fetched_bytes"] <= replay["extra"]["requests"] * 2**20
    trains = [r for r in rows if r["pattern"] == "train"]
    assert [r["extra"]["accelerators"] for r in trains][0] == 1
    assert all(0 < r["extra"]["utilization"] <= 1 and r["extra"]["samples_s"] > 0 for r in trains)
    assert "accelerator(s) fed at >= 90% utilisation" in doc["summaries"][0]["summary"]
    fed = max((r["extra"]["accelerators"] for r in trains if r["extra"]["utilization"] >= 0.9), default=0)
    assert all(r["extra"]["fed_accelerators"] == fed for r in trains)
    listing = fs.find(bucket.removeprefix("s3://"))
    assert sorted(listing) == sorted(f"{url.removeprefix('s3://')}{e}" for e in (".bin", ".idx"))  # only the user's

    synthetic = cli(bucket, "--pattern", "replay", "--synthetic-tokens", "200k", *LOADER, *options(ceph_cluster))
    assert synthetic.returncode in (0, 4), synthetic.stderr
    assert "replay" in synthetic.stdout and "smp/s" in synthetic.stdout
    assert sorted(fs.find(bucket.removeprefix("s3://"))) == sorted(listing)

"""corpusforge/storage/: local read modes, ranged block reads of fsspec URLs, the local cache tier, and the same
against a real Ceph cluster on loopback (RGW for s3://, CephFS through ceph-fuse)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from corpusforge.data import build_gpt_datasets, read_modes
from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from corpusforge.storage import READ_MODES, LocalCache, StorageConfig, open_dataset
from corpusforge.storage.datasets import open_datasets
from corpusforge.storage.pagecache import drop_page_cache, resident_fraction

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(prefix: Path, num_docs: int = 300, seed: int = 0, max_len: int = 400) -> str:
    """Random documents of 1..max_len uint16 tokens ending in EOD (0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=num_docs)
    tokens = rng.integers(1, 1000, size=int(lengths.sum()))
    tokens[np.cumsum(lengths) - 1] = 0
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(tokens, lengths)
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("storage") / "c_text_document")


def samples(prefix: str, storage: StorageConfig | None = None, n: int = 64) -> np.ndarray:
    train, _, _ = build_gpt_datasets(
        prefix, seq_length=64, split="1,0,0", seed=7, num_samples=(n, 0, 0), storage=storage
    )
    return train.get_batch(np.arange(len(train)))["tokens"]


# ---------------------------------------------------------------------------------------------------------------
# local reads


@pytest.mark.parametrize("mode", READ_MODES)
def test_read_modes_read_the_same_tokens(corpus, mode):
    ds = open_dataset(corpus, StorageConfig(read_mode=mode))
    tokens = np.asarray(IndexedDataset(corpus).tokens)
    starts = np.array([0, 5, 1000, len(tokens) - 3, 777])
    lengths = np.array([3, 0, 517, 3, 1])
    want = np.concatenate([tokens[s : s + n] for s, n in zip(starts, lengths)])
    np.testing.assert_array_equal(ds.read_spans(starts, lengths), want)


def test_read_modes_give_the_same_samples(corpus):
    reference = samples(corpus, StorageConfig(read_mode="mmap"))
    for mode in ("pread", "direct", "mmap-random"):
        np.testing.assert_array_equal(samples(corpus, StorageConfig(read_mode=mode)), reference)


def test_cold_pread_reads_about_the_sample_bytes(tmp_path):
    """On a file evicted from the page cache, pread/direct read few bytes beyond the samples; mmap reads far more."""
    prefix = write_corpus(tmp_path / "cold_text_document", num_docs=4000, max_len=4000, seed=3)
    rng = np.random.default_rng(0)
    total = IndexedDataset(prefix).num_tokens
    starts = rng.integers(0, total - 2049, size=64)
    lengths = np.full(64, 2049)
    asked = int(lengths.sum()) * 2
    read = {}
    for mode in ("direct", "pread", "mmap"):
        drop_page_cache(prefix + ".bin")
        before = read_bytes()
        open_dataset(prefix, StorageConfig(read_mode=mode)).read_spans(starts, lengths)
        read[mode] = read_bytes() - before
    if read["pread"] == 0:
        pytest.skip("this file system does not account block reads in /proc/self/io")
    assert read["direct"] <= 1.5 * asked, read
    assert read["pread"] <= 2.5 * asked, read  # 4 KiB pages around 4098-byte spans: 2 to 3 pages each
    assert read["mmap"] > 4 * read["pread"], read  # read-ahead around every fault


# ---------------------------------------------------------------------------------------------------------------
# read_mode "auto"


def test_auto_reads_a_file_that_fits_in_memory_through_the_map(corpus):
    ds = open_dataset(corpus)  # the default StorageConfig: read_mode "auto"
    assert StorageConfig().read_mode == "auto"
    assert ds.read_mode == "mmap-random" and ds.read_mode_reason.startswith("auto: the .bin")
    assert "fits the page-cache budget" in ds.read_mode_reason
    assert "MemAvailable" in repr(ds) or "cgroup memory limit" in repr(ds)
    train, _, _ = build_gpt_datasets(corpus, seq_length=64, split="1,0,0", seed=7, num_samples=(8, 0, 0))
    assert "read_mode='mmap-random' (auto: " in repr(train)
    assert read_modes(train)[corpus].startswith("mmap-random (auto: ")


def test_auto_reads_a_file_larger_than_the_budget_with_o_direct(corpus):
    config = StorageConfig(auto_direct_above_bytes=1024)  # this small file counts as larger than the page cache
    ds = open_dataset(corpus, config)
    assert ds.read_mode == "direct", ds.read_mode_reason
    assert "exceeds the page-cache budget" in ds.read_mode_reason and "auto_direct_above_bytes" in repr(ds)
    np.testing.assert_array_equal(samples(corpus, config), samples(corpus, StorageConfig(read_mode="mmap")))
    import pickle

    assert pickle.loads(pickle.dumps(ds)).read_mode == "direct"  # workers read in the mode chosen here
    big = os.path.getsize(f"{corpus}.bin")
    assert open_dataset(corpus, StorageConfig(auto_direct_above_bytes=big)).read_mode == "mmap-random"


def test_auto_reads_a_cold_file_with_o_direct_and_a_cached_one_through_the_map(tmp_path):
    prefix = write_corpus(tmp_path / "cold_text_document", num_docs=2000, max_len=2000, seed=5)
    bin_path = f"{prefix}.bin"
    with open(bin_path, "rb") as f:
        f.read()
    assert resident_fraction(bin_path) == 1.0
    warm = open_dataset(prefix)
    assert warm.read_mode == "mmap-random" and "100% of it is cached" in warm.read_mode_reason
    drop_page_cache(bin_path)
    assert resident_fraction(bin_path) < 0.5
    cold = open_dataset(prefix)
    assert cold.read_mode == "direct", cold.read_mode_reason
    assert "fits the page-cache budget" in cold.read_mode_reason
    assert "but only 0% of it is cached (a cold file)" in cold.read_mode_reason
    np.testing.assert_array_equal(samples(prefix), samples(prefix, StorageConfig(read_mode="mmap")))


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: a file system that refuses O_DIRECT (tmpfs accepts it since Linux 6.6, so /dev/shm no longer
    does)."""
    where = tmp_path / "ramfs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount ramfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_auto_falls_back_to_pread_where_o_direct_is_refused(corpus, ramfs):
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", ramfs / f"c_text_document.{ext}")
    prefix = str(ramfs / "c_text_document")
    with pytest.raises(OSError):
        os.close(os.open(f"{prefix}.bin", os.O_RDONLY | os.O_DIRECT))  # the premise: this mount refuses it
    config = StorageConfig(auto_direct_above_bytes=1024)
    ds = open_dataset(prefix, config)
    assert ds.read_mode == "pread" and "O_DIRECT is refused here (EINVAL" in ds.read_mode_reason
    np.testing.assert_array_equal(samples(prefix, config), samples(corpus))
    assert open_dataset(prefix).read_mode == "mmap-random"  # under the budget the file system does not matter


def test_cold_auto_reads_at_most_twice_the_sample_bytes_of_a_file_larger_than_the_budget(tmp_path):
    prefix = write_corpus(tmp_path / "auto_text_document", num_docs=4000, max_len=2000, seed=4)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, IndexedDataset(prefix).num_tokens - 2049, size=64)
    lengths = np.full(64, 2049)
    drop_page_cache(prefix + ".bin")
    ds = open_dataset(prefix, StorageConfig(auto_direct_above_bytes=1 << 20))
    before = read_bytes()
    ds.read_spans(starts, lengths)
    read = read_bytes() - before
    if read == 0:
        pytest.skip("this file system does not account block reads in /proc/self/io")
    assert ds.read_mode == "direct" and read <= 2 * int(lengths.sum()) * 2, read


def small_blend(where: Path, count: int = 12) -> list[str]:
    return [write_corpus(where / f"s{k:02d}_text_document", num_docs=40, seed=k) for k in range(count)]


def test_a_blend_of_small_files_gets_one_read_mode_for_all_cold_and_warm(tmp_path):
    prefixes = small_blend(tmp_path)
    for p in prefixes:
        drop_page_cache(f"{p}.bin")
    cold = open_datasets(prefixes)
    assert {ds.read_mode for ds in cold} == {"direct"}, cold[0].read_mode_reason
    reason = cold[0].read_mode_reason
    assert reason.startswith("auto: the 12 small .bin files of the blend together") and "0% of it is cached" in reason
    assert {ds.read_mode_reason for ds in cold} == {reason}
    for p in prefixes:
        with open(f"{p}.bin", "rb") as f:
            f.read()
    warm = open_datasets(prefixes)
    assert {ds.read_mode for ds in warm} == {"mmap-random"}, warm[0].read_mode_reason
    assert "100% of it is cached" in warm[0].read_mode_reason
    for a, b in zip(cold, warm):  # the same tokens either way, and as a dataset opened alone reads them
        alone = open_dataset(a.source, StorageConfig(read_mode="mmap"))
        starts, lengths = np.array([0, 7, alone.num_tokens - 5]), np.array([3, 11, 5])
        expect = alone.read_spans(starts, lengths)
        np.testing.assert_array_equal(a.read_spans(starts, lengths), expect)
        np.testing.assert_array_equal(b.read_spans(starts, lengths), expect)
    import pickle

    assert pickle.loads(pickle.dumps(cold[3])).read_mode == "direct"  # workers read in the mode chosen here


def test_a_blend_whose_small_files_together_exceed_the_budget_reads_them_with_o_direct(tmp_path):
    prefixes = small_blend(tmp_path)
    one = os.path.getsize(f"{prefixes[0]}.bin")
    opened = open_datasets(prefixes, StorageConfig(auto_direct_above_bytes=3 * one))  # each fits, all do not
    assert {ds.read_mode for ds in opened} == {"direct"}
    assert "exceeds the page-cache budget" in opened[0].read_mode_reason


def test_a_blend_reports_the_first_missing_file_in_its_order(tmp_path):
    prefixes = small_blend(tmp_path)
    os.remove(f"{prefixes[5]}.bin")
    os.remove(f"{prefixes[9]}.idx")
    with pytest.raises(FileNotFoundError, match=r"s05_text_document\.bin: no such file"):
        open_datasets(prefixes)


def test_a_mapped_bin_that_changed_size_after_the_open_is_refused_before_a_sample_is_read(corpus, tmp_path):
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", tmp_path / f"c_text_document.{ext}")
    prefix = str(tmp_path / "c_text_document")
    ds = open_dataset(prefix, StorageConfig(read_mode="mmap-random"))  # the .bin is mapped at the first read
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(IndexedFormatError, match="bytes now, but .* when its dataset was opened"):
        ds.read_spans(np.array([0]), np.array([3]))
    with open(f"{prefix}.bin", "ab") as f:  # a size that disagrees with the index at the open is refused there
        f.write(b"\0\0")
    with pytest.raises(IndexedFormatError, match="the index covers"):
        open_dataset(prefix, StorageConfig(read_mode="mmap-random"))


def read_bytes() -> int:
    """Bytes this process caused to be read from block devices (the kernel's task I/O accounting)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# ---------------------------------------------------------------------------------------------------------------
# remote reads through fsspec (its in-memory file system here; real S3 below)


def put_memory(prefix: str, name: str) -> str:
    import fsspec

    fs = fsspec.filesystem("memory")
    for ext in ("bin", "idx"):
        fs.pipe(f"/{name}.{ext}", Path(f"{prefix}.{ext}").read_bytes())
    return f"memory://{name}"


def test_remote_dataset_reads_large_blocks(corpus):
    url = put_memory(corpus, "blocks_text_document")
    config = StorageConfig(block_size=16 << 10, cache_blocks=2)
    np.testing.assert_array_equal(samples(url, config), samples(corpus))
    ds = open_dataset(url, config)
    size = ds.reader.nbytes
    spans = np.arange(0, ds.num_tokens - 100, 997)  # a sequential sweep: every block fetched exactly once
    ds.read_spans(spans, np.full(len(spans), 100))
    assert ds.reader.blocks.requests == -(-size // (16 << 10))
    assert ds.reader.blocks.bytes_fetched == size
    assert len(ds.reader.blocks.blocks) == 2  # the LRU keeps cache_blocks blocks


def read_with_steps(url: str, config: StorageConfig, step_s: float = 0.0, workers: int = 0, steps: int = 16):
    """The first `steps` batches of a loader over `url` (micro-batch 2), pausing step_s after each as a training
    step would; returns their tokens, the dataset's block cache, and its counters after the first batch."""
    from corpusforge.data import make_loader

    train, _, _ = build_gpt_datasets(url, seq_length=64, split="1,0,0", seed=7, num_samples=(48, 0, 0), storage=config)
    got, after_first = [], None
    loader = make_loader(train, micro_batch_size=2, dp_rank=0, dp_world_size=1, num_workers=workers)
    for _, batch in zip(range(steps), loader):
        got.append(batch["tokens"].numpy())
        if after_first is None:
            blocks = train.indexed.reader.blocks
            after_first = {"waits": blocks.waits, "read_requests": blocks.read_requests}
        time.sleep(step_s)
    return np.concatenate(got), train.indexed.reader.blocks, after_first


def test_remote_prefetch_keeps_reads_off_the_network_within_bounded_memory(corpus):
    url = put_memory(corpus, "prefetch_text_document")
    config = StorageConfig(block_size=4 << 10, cache_blocks=2, prefetch_blocks=12)
    tokens, blocks, after_first = read_with_steps(url, config, step_s=0.02)
    assert len(tokens) == 32
    np.testing.assert_array_equal(tokens, samples(corpus, n=48)[: len(tokens)])
    assert blocks.prefetch_requests > 0 and blocks.read_requests == after_first["read_requests"] == 0
    assert blocks.waits == after_first["waits"]  # only the first batch waited for its blocks
    assert blocks.peak_blocks <= 2 + 12  # cache_blocks + prefetch_blocks
    _, plain, _ = read_with_steps(url, StorageConfig(block_size=4 << 10, cache_blocks=2, prefetch_blocks=0))
    assert plain.prefetch_requests == 0 and plain.read_requests == plain.waits > blocks.waits


def test_remote_dataset_refuses_a_mismatched_pair(corpus, tmp_path):
    import fsspec

    url = put_memory(corpus, "bad_text_document")
    fs = fsspec.filesystem("memory")
    fs.pipe("/bad_text_document.bin", Path(f"{corpus}.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="the index covers"):
        open_dataset(url)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset("memory://nothing_here")


# ---------------------------------------------------------------------------------------------------------------
# the local cache tier


def test_local_cache_copies_once_and_verifies(corpus, tmp_path):
    cache = tmp_path / "cache"
    config = StorageConfig(local_cache_dir=str(cache))
    first = open_dataset(corpus, config)
    meta = json.loads((Path(first.prefix).parent / "meta.json").read_text())
    second = open_dataset(corpus, StorageConfig(local_cache_dir=str(cache), verify_sha256=True))
    assert first.prefix == second.prefix != corpus
    assert json.loads((Path(second.prefix).parent / "meta.json").read_text())["copied_at"] == meta["copied_at"]
    np.testing.assert_array_equal(samples(corpus, config), samples(corpus))
    # A copy corrupted on the local disk is found by the hash check, removed, and recopied on the next use.
    with open(f"{first.prefix}.bin", "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(OSError, match="sha256 differs"):
        open_dataset(corpus, StorageConfig(local_cache_dir=str(cache), verify_sha256=True))
    np.testing.assert_array_equal(samples(corpus, config), samples(corpus))


def test_local_cache_refuses_a_broken_source(corpus, tmp_path):
    bad = tmp_path / "bad_text_document"
    shutil.copy(f"{corpus}.idx", f"{bad}.idx")
    Path(f"{bad}.bin").write_bytes(Path(f"{corpus}.bin").read_bytes()[:-4])
    with pytest.raises(ValueError, match="do not belong together"):
        open_dataset(str(bad), StorageConfig(local_cache_dir=str(tmp_path / "cache")))
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing left under any name


FETCH = textwrap.dedent("""
    import json, sys, time
    from corpusforge.storage import LocalCache
    copies = []
    original = LocalCache._copy
    def counted(self, *args):
        copies.append(1)
        if {slow}:
            time.sleep(0.5)  # hold the lock long enough that the others really wait
        return original(self, *args)
    LocalCache._copy = counted
    path = LocalCache(sys.argv[1]).fetch(sys.argv[2])
    print(json.dumps({{"path": path, "copies": len(copies)}}))
""")


def run_python(code: str, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, **popen)


def test_concurrent_ranks_share_one_copy(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    ranks = [run_python(FETCH.format(slow=True), cache, corpus) for _ in range(4)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in ranks]
    assert all(p.returncode == 0 for p in ranks)
    assert sum(r["copies"] for r in results) == 1
    assert len({r["path"] for r in results}) == 1
    np.testing.assert_array_equal(IndexedDataset(results[0]["path"]).tokens, IndexedDataset(corpus).tokens)


KILLED_COPY = textwrap.dedent("""
    import sys, time
    from corpusforge.storage import LocalCache
    def stuck(self, source, ext, dest, chunk=0):
        open(dest, "wb").write(b"partial")
        print("copying", flush=True)
        time.sleep(600)
    LocalCache._copy_file = stuck
    LocalCache(sys.argv[1]).fetch(sys.argv[2])
""")


def test_a_killed_copy_is_never_used(corpus, tmp_path):
    cache = tmp_path / "cache"
    proc = run_python(KILLED_COPY, str(cache), corpus)
    assert proc.stdout.readline().strip() == "copying"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    key = LocalCache(cache).key(corpus)
    assert list(cache.glob(f".{key}.partial-*")) and not (cache / key).exists()
    path = LocalCache(cache).fetch(corpus)  # the lock died with its holder: this process copies afresh
    assert not list(cache.glob(f".{key}.partial-*"))
    np.testing.assert_array_equal(IndexedDataset(path).tokens, IndexedDataset(corpus).tokens)


def test_lru_eviction_under_the_cap(tmp_path):
    prefixes = [write_corpus(tmp_path / f"d{i}_text_document", num_docs=50, seed=i) for i in range(3)]
    size = max(os.path.getsize(f"{p}.bin") + os.path.getsize(f"{p}.idx") for p in prefixes)
    cache = LocalCache(tmp_path / "cache", max_bytes=int(2.5 * size))
    a = cache.fetch(prefixes[0])
    cache.fetch(prefixes[1])
    time.sleep(0.01)
    cache.fetch(prefixes[0])  # a used again: b is now the least recently used
    cache.fetch(prefixes[2])
    kept = {key for _, key, _ in cache.entries()}
    assert kept == {cache.key(prefixes[0]), cache.key(prefixes[2])}
    assert sum(size for *_, size in cache.entries()) <= cache.max_bytes
    np.testing.assert_array_equal(IndexedDataset(a).tokens, IndexedDataset(prefixes[0]).tokens)
    with pytest.raises(OSError, match="does not fit"):
        LocalCache(tmp_path / "small", max_bytes=size // 2).fetch(prefixes[0])


READER = textwrap.dedent("""
    import sys
    import numpy as np
    from corpusforge.storage import StorageConfig, open_dataset
    # pread opens the .bin at the first read, by name: a copy evicted in between would be a FileNotFoundError.
    ds = open_dataset(sys.argv[2], StorageConfig(local_cache_dir=sys.argv[1], read_mode="pread"))
    print(ds.prefix, flush=True)
    sys.stdin.readline()  # hold the dataset until the test says read
    print(int(ds.read_spans(np.array([0]), np.array([ds.num_tokens])).astype(np.int64).sum()), flush=True)
""")


def test_eviction_never_removes_a_copy_that_a_process_reads(tmp_path):
    a, b = (write_corpus(tmp_path / f"{n}_text_document", num_docs=60, seed=i) for i, n in enumerate("ab"))
    size = max(os.path.getsize(f"{p}.bin") + os.path.getsize(f"{p}.idx") for p in (a, b))
    cache_dir = tmp_path / "cache"
    reader = run_python(READER, str(cache_dir), a, stdin=subprocess.PIPE)
    copy_of_a = reader.stdout.readline().strip()  # fetched and pinned, the .bin not opened yet
    cache = LocalCache(cache_dir, max_bytes=int(1.5 * size))  # room for one of the two
    with pytest.raises(OSError, match=r"are being read or copied by running processes"):
        cache.fetch(b)
    assert Path(f"{copy_of_a}.bin").is_file() and not list(cache_dir.glob(f"{cache.key(b)}"))
    out, _ = reader.communicate("read\n", timeout=60)
    assert reader.returncode == 0
    assert int(out) == int(np.asarray(IndexedDataset(a).tokens, dtype=np.int64).sum())
    cache.fetch(b)  # the reader is gone: a is evicted now
    assert {key for _, key, _ in cache.entries()} == {cache.key(b)} and not Path(f"{copy_of_a}.bin").exists()


# ---------------------------------------------------------------------------------------------------------------
# real Ceph on loopback: RGW (S3) and CephFS


@pytest.fixture(scope="module")
def s3_corpus(ceph_cluster, corpus) -> str:
    fs = ceph_cluster.filesystem()
    bucket = ceph_cluster.bucket("corpusforge-storage")
    for ext in ("bin", "idx"):
        fs.put(f"{corpus}.{ext}", f"{bucket}/corpora/c_text_document.{ext}")
    return f"{bucket}/corpora/c_text_document"


@pytest.mark.slow
@pytest.mark.ceph
def test_rgw_dataset_gives_the_local_samples_in_large_ranged_reads(ceph_cluster, corpus, s3_corpus):
    config = StorageConfig(storage_options=ceph_cluster.storage_options, block_size=64 << 10)
    np.testing.assert_array_equal(samples(s3_corpus, config), samples(corpus))
    ds = open_dataset(s3_corpus, config)
    train, _, _ = build_gpt_datasets(
        [s3_corpus], seq_length=64, split="1,0,0", seed=7, num_samples=(64, 0, 0), storage=config
    )
    reader = train.indexed.reader
    train.get_batch(np.arange(len(train)))
    blocks = -(-ds.reader.nbytes // (64 << 10))
    assert 0 < reader.blocks.requests <= 3 * blocks  # 64 random samples: a few passes over 3 blocks at most
    assert reader.blocks.bytes_fetched >= reader.blocks.requests * min(64 << 10, ds.reader.nbytes) // 2


@pytest.mark.slow
@pytest.mark.ceph
def test_rgw_dataset_through_dataloader_workers(ceph_cluster, corpus, s3_corpus):
    """Forked DataLoader workers make their own S3 clients (aiohttp sessions must not cross a fork)."""
    from corpusforge.data import make_loader

    config = StorageConfig(storage_options=ceph_cluster.storage_options, block_size=64 << 10)
    build = dict(seq_length=64, split="1,0,0", seed=7, num_samples=(64, 0, 0))
    remote, local = (build_gpt_datasets(p, storage=config, **build)[0] for p in (s3_corpus, corpus))
    got = [b["tokens"] for b in make_loader(remote, micro_batch_size=8, dp_rank=0, dp_world_size=1, num_workers=2)]
    want = [b["tokens"] for b in make_loader(local, micro_batch_size=8, dp_rank=0, dp_world_size=1, num_workers=0)]
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow
@pytest.mark.ceph
def test_rgw_prefetch_fetches_the_next_batches_blocks_during_the_step(ceph_cluster, corpus, s3_corpus):
    """Against radosgw: after the first batch, no read waits on a GET (a 0.3 s pause stands for the step's
    compute); memory stays within cache_blocks + prefetch_blocks blocks."""
    options = ceph_cluster.storage_options
    config = StorageConfig(storage_options=options, block_size=4 << 10, cache_blocks=2, prefetch_blocks=12)
    tokens, blocks, after_first = read_with_steps(s3_corpus, config, step_s=0.3, steps=10)
    np.testing.assert_array_equal(tokens, samples(corpus, n=48)[: len(tokens)])
    assert blocks.prefetch_requests > 0 and blocks.read_requests == after_first["read_requests"]
    assert blocks.waits == after_first["waits"], (blocks.waits, after_first)
    assert blocks.peak_blocks <= 2 + 12
    workers, _, _ = read_with_steps(s3_corpus, config, workers=2, steps=10)  # BatchIds via worker queues, forks
    np.testing.assert_array_equal(workers, tokens)


@pytest.mark.slow
@pytest.mark.ceph
def test_rgw_to_local_cache_shared_by_ranks(ceph_cluster, corpus, s3_corpus, tmp_path):
    cache = tmp_path / "cache"
    code = FETCH.replace("LocalCache(sys.argv[1])", "LocalCache(sys.argv[1], None, json.loads(sys.argv[3]))")
    options = json.dumps(ceph_cluster.storage_options)
    ranks = [run_python(code.format(slow=True), str(cache), s3_corpus, options) for _ in range(3)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in ranks]
    assert sum(r["copies"] for r in results) == 1 and len({r["path"] for r in results}) == 1
    config = StorageConfig(storage_options=ceph_cluster.storage_options, local_cache_dir=str(cache))
    np.testing.assert_array_equal(samples(s3_corpus, config), samples(corpus))


@pytest.mark.slow
@pytest.mark.ceph
@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_cephfs_path_works_like_a_local_path(ceph_cluster, corpus, mode):
    where = Path(ceph_cluster.cephfs_mount) / "storage-test"
    where.mkdir(exist_ok=True)
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", where / f"c_text_document.{ext}")
    prefix = str(where / "c_text_document")
    np.testing.assert_array_equal(samples(prefix, StorageConfig(read_mode=mode)), samples(corpus))


@pytest.mark.parametrize("where", ["local", "memory", "local-cache"])
def test_datasets_pickle_as_reopen_instructions(corpus, tmp_path, where):
    """What spawn/forkserver DataLoader workers receive: the reader reopens by name, no token bytes are copied."""
    import pickle

    prefix = put_memory(corpus, "pickled_text_document") if where == "memory" else corpus
    cache = str(tmp_path / "cache") if where == "local-cache" else None
    train, _, _ = build_gpt_datasets(
        prefix,
        seq_length=64,
        split="1,0,0",
        seed=7,
        num_samples=(64, 0, 0),
        storage=StorageConfig(local_cache_dir=cache),
    )
    blob = pickle.dumps(train)
    assert len(blob) < os.path.getsize(f"{corpus}.bin")
    again = pickle.loads(blob)
    assert type(again.indexed) is type(train.indexed)
    np.testing.assert_array_equal(again.get_batch(np.arange(64))["tokens"], train.get_batch(np.arange(64))["tokens"])


def test_blend_of_a_url_and_a_path_matches_all_local(corpus, tmp_path):
    other = write_corpus(tmp_path / "o_text_document", num_docs=200, seed=5)
    url = put_memory(other, "blend_text_document")
    build = dict(seq_length=32, split="90,10,0", seed=3, num_samples=(100, 10, 0))
    mixed = build_gpt_datasets([corpus, 0.6, url, 0.4], storage=StorageConfig(block_size=8 << 10), **build)
    local = build_gpt_datasets([corpus, 0.6, other, 0.4], **build)
    for m, ref in zip(mixed[:2], local[:2]):
        ids = np.arange(len(ref))
        np.testing.assert_array_equal(m.get_batch(ids)["tokens"], ref.get_batch(ids)["tokens"])


def test_imports_work_for_a_user_who_cannot_write_numba_caches(tmp_path):
    # A read-only install used by another user: numba finds no writable cache directory. `nobody` cannot write
    # this checkout's __pycache__ nor a home directory; the jitted modules must still import and run.
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    code = (
        "import numpy as np, corpusforge.storage as s, corpusforge.data, corpusforge.retro.embed;"
        "t = np.arange(10, dtype=np.int32); out = np.empty(4, np.int32);"
        "print(s.copy_spans(t, np.array([2, 7]), np.array([2, 2]), out).tolist())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | {"HOME": "/nonexistent"}
    proc = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[2,", "3,", "7,", "8]"]

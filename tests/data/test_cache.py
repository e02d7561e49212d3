"""Index caches: named by a hash of their configuration, written atomically, built once while racers wait."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from loader_data import build_blend

from corpusforge.data import CacheMismatchError, IndexCache
from corpusforge.data.cache import MappedArray, picklable, unpickled, wait_for_index_caches

HERE = Path(__file__).parent


def _race(corpora, cache_dir, barrier, results) -> None:
    sys.path.insert(0, str(HERE))
    from loader_data import build_blend

    barrier.wait()  # all processes ask for the same, missing cache entries at once
    datasets = build_blend(corpora, cache_dir)
    built = {}
    for split, ds in zip(("train", "valid", "test"), datasets):
        built[f"blend-{split}"] = ds.built
        for d, part in enumerate(ds.datasets):
            built[f"{d}-{split}"] = part.built
    digest = hashlib.sha256(datasets[0].get_batch(np.arange(len(datasets[0])))["tokens"].tobytes()).hexdigest()
    results.put((built, digest))


@pytest.mark.slow
def test_processes_racing_for_one_cache_build_it_once(corpora, tmp_path):
    ctx = mp.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(corpora, tmp_path, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({digest for _, digest in outcomes}) == 1  # every process reads the same samples
    for key in outcomes[0][0]:
        assert sum(built[key] for built, _ in outcomes) == 1, key  # exactly one builder per entry
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_second_build_loads_the_same_arrays(corpora, tmp_path):
    first = build_blend(corpora, tmp_path)
    second = build_blend(corpora, tmp_path)
    assert first[0].built and not second[0].built and not second[0].datasets[1].built
    np.testing.assert_array_equal(first[0].dataset_index, second[0].dataset_index)
    np.testing.assert_array_equal(first[0].datasets[2].shuffle_index, second[0].datasets[2].shuffle_index)
    for npy in tmp_path.glob("*.npy"):
        np.load(npy, allow_pickle=False)  # plain arrays, never pickles


def test_cache_name_follows_every_input(corpora, tmp_path):
    base = build_blend(corpora, tmp_path)[0]
    wait_for_index_caches()
    names = {p.name for p in tmp_path.glob("*-description.json")}
    assert not build_blend(corpora, tmp_path)[0].built
    for change in ({"seed": 5}, {"add_extra_token_to_sequence": False}):
        ds = build_blend(corpora, tmp_path, **change)[0]
        assert ds.built and ds.datasets[0].built
    wait_for_index_caches()
    assert len({p.name for p in tmp_path.glob("*-description.json")}) > len(names)
    assert base.datasets[0].description["dataset"]["lengths_sha256"]


def test_cache_written_by_another_configuration_is_refused(tmp_path):
    cache = IndexCache(tmp_path)
    arrays, built = cache.get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(3)})
    assert built
    cache.wait()
    (desc,) = tmp_path.glob("*-X-train-description.json")
    record = json.loads(desc.read_text())
    record["description"]["seed"] = 2  # as if another configuration's files had been copied under this name
    desc.write_text(json.dumps(record))
    with pytest.raises(CacheMismatchError, match=r"another configuration \(seed: 1 != 2\).*Delete the files"):
        cache.get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(3)})


def test_no_cache_dir_builds_in_memory(corpora, tmp_path):
    train = build_blend(corpora, None)[0]
    assert train.built and len(train) == 400


# A builder on a slow disk: every fsync waits until the file `go` exists, so the test decides when the cache
# becomes durable and can look at what others see before that.
SLOW_DISK_BUILDER = """
import json, os, sys, time
from pathlib import Path
import numpy as np
from corpusforge.data import IndexCache
go, real_fsync = Path(sys.argv[2]), os.fsync
def slow_fsync(fd):
    while not go.exists():
        time.sleep(0.01)
    real_fsync(fd)
os.fsync = slow_fsync
arrays, built = IndexCache(sys.argv[1]).get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(1000)})
print(json.dumps({"built": built, "sum": int(arrays["a"].sum())}), flush=True)
"""

WAITER = """
import json, sys
import numpy as np
from corpusforge.data import IndexCache
arrays, built = IndexCache(sys.argv[1]).get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(1000)})
print(json.dumps({"built": built, "sum": int(arrays["a"].sum())}), flush=True)
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_the_builder_returns_before_its_cache_is_durable_and_waiters_see_only_the_complete_entry(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    builder = _python(SLOW_DISK_BUILDER, str(cache), str(go))
    assert json.loads(builder.stdout.readline()) == {"built": True, "sum": 499500}  # returned; fsync still blocked
    assert not list(cache.glob("*-description.json"))  # not complete: nobody may load it yet
    waiter = _python(WAITER, str(cache))
    with pytest.raises(subprocess.TimeoutExpired):
        waiter.wait(timeout=3)  # it waits on the lock that the builder's fsync thread still holds
    go.touch()  # the disk catches up
    assert json.loads(waiter.communicate(timeout=60)[0]) == {"built": False, "sum": 499500}  # loaded, not rebuilt
    assert builder.wait(timeout=60) == 0 and waiter.returncode == 0
    assert len(list(cache.glob("*-description.json"))) == 1 and not list(cache.glob(".*.tmp"))


@pytest.mark.slow
def test_a_builder_killed_before_its_cache_is_durable_leaves_an_entry_that_is_rebuilt(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    builder = _python(SLOW_DISK_BUILDER, str(cache), str(go))
    assert json.loads(builder.stdout.readline())["built"]
    deadline = time.monotonic() + 60
    while not list(cache.glob("*-X-train-a.npy")) and time.monotonic() < deadline:
        time.sleep(0.01)  # written by the builder's background thread, which then blocks in fsync
    builder.send_signal(signal.SIGKILL)  # as a crash would, before the arrays reached the disk
    builder.wait()
    (array,) = cache.glob("*-X-train-a.npy")
    assert not list(cache.glob("*-description.json"))
    array.write_bytes(array.read_bytes()[:100])  # what a crash can leave of a file that was never fsync'd
    arrays, built = IndexCache(cache).get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(1000)})
    assert built  # the leftover was not trusted
    np.testing.assert_array_equal(arrays["a"], np.arange(1000))
    wait_for_index_caches()
    again, built = IndexCache(cache).get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(5)})
    assert not built
    np.testing.assert_array_equal(again["a"], np.arange(1000))


def test_a_freshly_built_entry_pickles_as_the_paths_of_its_files(tmp_path):
    """Spawned DataLoader workers get the builder's arrays as .npy paths (once written), not as copies."""
    arrays, built = IndexCache(tmp_path).get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(100_000)})
    assert built and not isinstance(arrays["a"], np.memmap)  # returned before the cache files were written
    sent = picklable(arrays["a"])
    assert isinstance(sent, MappedArray) and Path(sent.path).is_file()
    np.testing.assert_array_equal(unpickled(sent), np.arange(100_000))
    assert picklable(np.arange(3)).tolist() == [0, 1, 2]  # an array of no cache entry goes as it is


def test_a_blends_datasets_share_one_cache_entry_per_split_and_pickle_it_once(corpora, tmp_path):
    """Per split, one entry for the indices of all the blend's datasets and one for the blend: not one per dataset
    (a blend of 2,500 datasets wrote 10,000 files and fsynced each). Loaded again, and sent to a spawned worker,
    every dataset gets its own slice: the same samples; the shared arrays travel once, by path."""
    import pickle

    first = build_blend(corpora, tmp_path)
    wait_for_index_caches()
    kinds = sorted(p.name.split("-", 1)[1] for p in tmp_path.glob("*-description.json"))
    assert kinds == sorted(f"{k}-{s}-description.json" for k in ("GPTDatasets", "BlendedDataset") for s in SPLITS)
    again = build_blend(corpora, tmp_path)
    assert not any(part.built for ds in again for part in ds.datasets)
    sent = pickle.loads(pickle.dumps(again[0]))
    data = pickle.dumps(again[0])
    assert data.count(b"-GPTDatasets-train-") == 4  # three indices and their bounds, once for all the datasets
    for ds in (again[0], sent):
        for d, part in enumerate(ds.datasets):
            expect = first[0].datasets[d]
            for name in ("document_index", "sample_index", "shuffle_index"):
                np.testing.assert_array_equal(getattr(part, name), getattr(expect, name))
        ids = np.arange(len(ds))
        np.testing.assert_array_equal(ds.get_batch(ids)["tokens"], first[0].get_batch(ids)["tokens"])


SPLITS = ("train", "valid", "test")


def test_entries_built_in_a_completing_after_block_complete_when_it_ends(tmp_path):
    from corpusforge.data.cache import completing_after

    cache = IndexCache(tmp_path)
    with completing_after():
        cache.get_or_build("x", {"n": 1}, lambda: {"a": np.arange(3)})
        time.sleep(0.2)  # the syncer would have written the description by now, were it handed the entry
        assert not list(tmp_path.glob("*-description.json"))
        # The same entry again in this thread: its lock is ours until it completes, so it is completed first
        arrays, built = cache.get_or_build("x", {"n": 1}, lambda: {"a": np.arange(4)})
        assert not built and arrays["a"].tolist() == [0, 1, 2]
        cache.get_or_build("y", {"n": 2}, lambda: {"a": np.arange(5)})
    wait_for_index_caches()
    assert len(list(tmp_path.glob("*-description.json"))) == 2


@pytest.mark.parametrize(
    "array",
    [np.arange(7, dtype=np.uint32), np.zeros((5, 2), np.int32), np.zeros((0, 2), np.int64), np.arange(9)[::2]],
    ids=["1d", "2d", "empty", "strided"],
)
def test_cache_files_hold_the_bytes_np_save_writes(tmp_path, array):
    import io

    IndexCache(tmp_path).get_or_build("x", {"n": 1}, lambda: {"a": array})
    wait_for_index_caches()
    expected = io.BytesIO()
    np.save(expected, array, allow_pickle=False)
    (written,) = tmp_path.glob("*-a.npy")
    assert written.read_bytes() == expected.getvalue()

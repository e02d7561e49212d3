"""Index add and neighbours as executor tasks: task ranges, the same bytes for any worker count, on-disk inverted
lists that search like in-RAM ones and move with the database, and a worker killed for good then --resume."""

import json
import shutil

import numpy as np
import pytest
from retrokit import run_cli, topical_documents, write_dataset

from corpusforge.retro import BuildConfig, build_knn
from corpusforge.retro.fill import add_tasks
from corpusforge.retro.index import load_index
from corpusforge.retro.listmajor import list_groups, on_disk_lists, search_batch, search_list_major, wants_list_major

IVF = "IVF16,Flat"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """~1,000 chunks of topical documents: 4 embedding shards of 256, so 4 add tasks and 4 neighbours tasks."""
    return write_dataset(tmp_path_factory.mktemp("fill") / "corpus", topical_documents(300, seed=3, max_len=300))


def _build(dataset, out, **kw):
    return build_knn(BuildConfig(prefix=dataset, output=str(out), **{"shard_size": 256, "recall_queries": 100, **kw}))


def _bytes(db, *names) -> dict[str, bytes]:
    return {name: (db / name).read_bytes() for name in names}


def test_add_tasks_cover_every_row_once_and_never_cross_a_shard():
    tasks = add_tasks(1000, 256, rows=100)
    assert [t[0] for t in tasks] == list(range(len(tasks)))
    assert np.array_equal(np.concatenate([np.arange(lo, hi) for _, lo, hi in tasks]), np.arange(1000))
    assert all(lo // 256 == (hi - 1) // 256 for _, lo, hi in tasks)
    assert add_tasks(5, 256) == [(0, 0, 5)] and add_tasks(0, 256) == []


def test_index_and_neighbours_bytes_do_not_depend_on_workers(dataset, tmp_path):
    """One worker (tasks in this process, one thread), two forked workers, and one task run here with two threads
    (shard size past N): the same index.faiss and neighbours.bin."""
    one = _build(dataset, tmp_path / "one", index_key=IVF, workers=1)
    two = _build(dataset, tmp_path / "two", index_key=IVF, workers=2)
    assert one.stages["index"]["add_tasks"] == 4 and two.stages["neighbours"]["tasks"] == 4
    assert two.stages["index"]["workers"] == 2 and two.stages["neighbours"]["workers"] == 2
    files = ("index/index.faiss", "neighbours.bin")
    assert _bytes(tmp_path / "two", *files) == _bytes(tmp_path / "one", *files)
    assert not (tmp_path / "two" / "neighbours.bin.parts").exists()
    assert not list((tmp_path / "two" / "index").glob("part_*"))
    # one task (the shard size is past N): run here, with two threads when two workers were asked for
    whole = {w: _build(dataset, tmp_path / f"whole{w}", index_key=IVF, workers=w, shard_size=4096) for w in (1, 2)}
    assert whole[2].stages["index"]["add_tasks"] == 1
    assert _bytes(tmp_path / "whole2", *files) == _bytes(tmp_path / "whole1", *files)


def test_on_disk_lists_search_like_in_ram_and_move_with_the_database(dataset, tmp_path):
    ram = _build(dataset, tmp_path / "ram", index_key=IVF, workers=2, index_on_disk=False)
    opts = ["--shard-size", "256", "--recall-queries", "100", "--index-key", IVF, "--index-on-disk", "--json"]
    proc = run_cli("build-knn", dataset, "--output", str(tmp_path / "disk"), *opts)
    assert proc.returncode == 0, proc.stderr
    disk = json.loads(proc.stdout)  # faiss's own lines about the on-disk lists went to stderr, not into the JSON
    assert (tmp_path / "disk" / "index" / "index.ivfdata").stat().st_size > 0
    assert not (tmp_path / "ram" / "index" / "index.ivfdata").exists()
    assert not list((tmp_path / "disk" / "index").glob("*.tmp"))
    files = ("neighbours.bin",)
    assert _bytes(tmp_path / "disk", *files) == _bytes(tmp_path / "ram", *files)
    assert disk["recall"]["recall@10"] == ram.recall["recall@10"]
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "disk", moved)  # the index file recorded the old path of its lists
    params = disk["recall"]["search_params"]
    a = load_index(moved / "index" / "index.faiss", params)
    b = load_index(tmp_path / "ram" / "index" / "index.faiss", params)
    q = np.random.default_rng(0).standard_normal((50, 128)).astype(np.float32)
    assert a.ntotal == b.ntotal and np.array_equal(a.search(q, 10)[1], b.search(q, 10)[1])


@pytest.mark.parametrize("key", [IVF, "OPQ16_64,IVF16,PQ16x4"])
def test_list_major_search_of_on_disk_lists_equals_faiss_in_any_groups(dataset, tmp_path, key):
    """The batch search that reads on-disk lists group by group returns faiss's own distances, and its hits in its
    order, whether the lists form one group or one group each. Only hits tied with the k-th may differ: faiss keeps
    the first it meets, and 4-bit PQ codes tie often."""
    for where, on_disk in (("ram", False), ("disk", True)):
        _build(dataset, tmp_path / where, index_key=key, index_on_disk=on_disk, neighbours=False)
    ram = load_index(tmp_path / "ram" / "index" / "index.faiss", "nprobe=5")
    disk = load_index(tmp_path / "disk" / "index" / "index.faiss", "nprobe=5")
    lists = on_disk_lists(disk)
    assert on_disk_lists(ram) is None and lists is not None
    assert wants_list_major(disk, 4) and not wants_list_major(disk, 3) and not wants_list_major(ram, 1000)
    q = np.random.default_rng(0).standard_normal((300, 128)).astype(np.float32)
    expect_d, expect_i = ram.search(q, 60)
    assert (expect_i[:, -1] >= 0).all()  # long enough lists that the k-th hit comes from a later group
    for group_bytes in (1, 4096, 1 << 30):
        groups = list_groups(lists, group_bytes)
        assert [g[0] for g in groups[1:]] == [g[1] for g in groups[:-1]] and groups[-1][1] == 16
        assert len(groups) == (16 if group_bytes == 1 else 1 if group_bytes == 1 << 30 else len(groups))
        d, i = search_list_major(disk, q, 60, group_bytes=group_bytes)
        assert np.array_equal(d, expect_d)
        untied = expect_d != expect_d[:, -1:]
        assert np.array_equal(i[untied], expect_i[untied]) and (i >= 0).all()
        if group_bytes == 1 << 30 or key == IVF:
            assert np.array_equal(i, expect_i)
    assert np.array_equal(search_batch(disk, q, 60)[0], expect_d)


def test_fast_scan_parts_are_packed_into_the_bytes_of_one_add_and_refused_on_disk(dataset, tmp_path):
    """faiss cannot merge fast-scan lists (PQmx4fs: blocks of codes; merging 39 parts at 10M corrupted the heap), so
    add tasks encode plain PQ parts and the merge packs them: the index is byte for byte what one add_with_ids of
    every row into trained.faiss gives, for any number of workers. --index-on-disk is one clear error."""
    from corpusforge.retro.common import RetroError, import_faiss
    from corpusforge.retro.embed import EmbeddingStore

    faiss = import_faiss()
    key = "OPQ16_64,IVF16,PQ32x4fs"
    one = _build(dataset, tmp_path / "one", index_key=key, workers=1, neighbours=False)
    two = _build(dataset, tmp_path / "two", index_key=key, workers=2, neighbours=False)
    assert two.stages["index"]["add_tasks"] == 4 and two.stages["index"]["workers"] == 2
    assert _bytes(tmp_path / "two", "index/index.faiss") == _bytes(tmp_path / "one", "index/index.faiss")
    assert not list((tmp_path / "two" / "index").glob("part_*")) and not list((tmp_path / "two").rglob("*.tmp"))
    whole = faiss.read_index(str(tmp_path / "one" / "index" / "trained.faiss"))
    store = EmbeddingStore(tmp_path / "one" / "embeddings", one.stages["index"]["ntotal"], whole.d, 256)
    whole.add_with_ids(store.get(np.arange(store.n)), np.arange(store.n, dtype=np.int64))
    assert faiss.serialize_index(whole).tobytes() == _bytes(tmp_path / "one", "index/index.faiss")["index/index.faiss"]
    assert one.recall["recall@10"] >= 0.95
    with pytest.raises(RetroError, match=r"PQ32x4fs: fast-scan lists cannot live on disk.*drop --index-on-disk"):
        _build(dataset, tmp_path / "disk", index_key=key, index_on_disk=True, neighbours=False)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["index:2", "neighbours:1"])
def test_worker_killed_for_good_then_resume_gives_the_same_bytes(dataset, tmp_path, kill_at):
    """A forked worker SIGKILLed at the same task on every retry: the build stops with one line naming --resume,
    keeps the other tasks' parts, and --resume finishes with the bytes of an uninterrupted run."""
    opts = ["--shard-size", "256", "--index-key", IVF, "--recall-queries", "100", "--workers", "2"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    _build(dataset, ref, index_key=IVF, workers=1)
    killed = run_cli("build-knn", dataset, "--output", str(out), *opts, kill_at=kill_at)
    assert killed.returncode == 1, killed.stderr
    assert "rerun with --resume" in killed.stderr and killed.stderr.strip().count("\n") == 0, killed.stderr
    parts = out / "index" if kill_at.startswith("index") else out / "neighbours.bin.parts"
    assert len(list(parts.glob("part_*"))) >= 1 and not (out / "neighbours.bin").exists()
    resumed = run_cli("build-knn", dataset, "--output", str(out), *opts, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    files = ("index/index.faiss", "neighbours.bin")
    assert _bytes(out, *files) == _bytes(ref, *files)
    assert not list(out.rglob("*.tmp"))

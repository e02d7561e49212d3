"""The faiss-gpu path of the index stage (gpu.py), run with faiss's CPU flat index where a GPU clone would be: this
machine has no GPU, and faiss-cpu no GPU clone. What it checks is the code around the clone: the k-means metric
handed over, the exact assignment, the add tasks in the driver; and that `--gpu on` without a GPU is one line."""

import numpy as np
import pytest
from retrokit import run_cli, topical_documents, write_dataset

from corpusforge.retro import BuildConfig, build_knn
from corpusforge.retro.common import RetroError, import_faiss
from corpusforge.retro.gpu import add_assigned, centroid_index, gpus_for, train_with

KEYS = ["IVF32,Flat", "IVF32_HNSW32,Flat", "OPQ8_32,IVF32,PQ8x4"]


def _vectors(n: int = 4000, d: int = 64) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _empty(faiss, key: str, d: int = 64):
    index = faiss.index_factory(d, key, faiss.METRIC_INNER_PRODUCT)
    faiss.extract_index_ivf(index).cp.seed = 1
    return index


@pytest.mark.parametrize("key", KEYS)
def test_kmeans_on_a_handed_flat_index_trains_faiss_centroids(key):
    """A quantizer trained in place (flat, inner product) and one filled after the k-means (HNSW, which faiss
    clusters for with L2): the flat index handed over gets each one's metric, and is the one searched."""
    faiss = import_faiss()
    x = _vectors()
    expect, handed = _empty(faiss, key), _empty(faiss, key)
    expect.train(x)
    train_with(faiss, handed, gpus=0)
    handed.train(x)
    assert faiss.serialize_index(handed).tobytes() == faiss.serialize_index(expect).tobytes()
    assert faiss.extract_index_ivf(handed).clustering_index.ntotal == 32  # it held the centroids: it was used


@pytest.mark.parametrize("key", KEYS)
def test_exact_assignment_adds_what_faiss_adds(key):
    """Each vector into its nearest centroid's list, searched in a flat index of the centroids: what faiss's own add
    writes where its quantizer is exact (flat), and for HNSW over 32 centroids, which it searches exhaustively."""
    faiss = import_faiss()
    x = _vectors()
    index = _empty(faiss, key)
    index.train(x)
    expect = faiss.deserialize_index(faiss.serialize_index(index))
    ids = np.arange(len(x), dtype=np.int64) * 3
    expect.add_with_ids(x, ids)
    add_assigned(faiss, index, x, ids, centroid_index(faiss, index, gpus=0))
    assert index.ntotal == len(x)
    assert faiss.serialize_index(index).tobytes() == faiss.serialize_index(expect).tobytes()


def test_gpu_request_is_checked_before_any_work(tmp_path):
    faiss = import_faiss()
    assert gpus_for(faiss, "auto") == faiss.get_num_gpus() and gpus_for(faiss, "off") == 0
    if faiss.get_num_gpus():
        pytest.skip("this machine has a GPU: --gpu on is not an error here")
    with pytest.raises(RetroError, match=r"--gpu on: faiss sees no GPU.*faiss-gpu-cu12"):
        gpus_for(faiss, "on")
    prefix = write_dataset(tmp_path / "corpus", topical_documents(20, seed=0))
    proc = run_cli("build-knn", prefix, "--output", str(tmp_path / "db"), "--gpu", "on")
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--gpu on: faiss sees no GPU" in proc.stderr and not (tmp_path / "db").exists()


def test_a_gpu_build_runs_its_add_tasks_in_the_driver_with_the_bytes_of_a_cpu_build(tmp_path, monkeypatch):
    """faiss's GPU clone replaced by the CPU index it clones (the only GPU-specific call): a build with one 'GPU'
    trains and assigns through gpu.py, runs the four add tasks in this process, and with a flat quantizer writes the
    CPU build's index."""
    faiss = import_faiss()
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda index, co=None, ngpu=-1: index)
    prefix = write_dataset(tmp_path / "corpus", topical_documents(300, seed=3, max_len=300))
    common = {"prefix": prefix, "index_key": "IVF16,Flat", "shard_size": 256, "recall_queries": 100}
    cpu = build_knn(BuildConfig(output=str(tmp_path / "cpu"), gpu="off", workers=2, **common))
    gpu = build_knn(BuildConfig(output=str(tmp_path / "gpu"), gpu="on", workers=2, **common))
    assert cpu.stages["index"]["gpus"] == 0 and cpu.stages["index"]["workers"] == 2
    assert gpu.stages["index"]["gpus"] == 1 and gpu.stages["index"]["executor"] == "driver"
    assert gpu.stages["index"]["add_tasks"] == 4
    files = ("index/index.faiss", "neighbours.bin")
    assert {f: (tmp_path / "gpu" / f).read_bytes() for f in files} == {
        f: (tmp_path / "cpu" / f).read_bytes() for f in files
    }

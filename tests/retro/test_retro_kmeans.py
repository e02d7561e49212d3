"""Two-level k-means: nlist seeded centroids nearly as good as faiss's one-level k-means, chosen by the planner
from 16,384 lists, and an index trained with it that builds, reaches the recall target and rebuilds byte for byte."""

import json

import numpy as np
import pytest
from retrokit import topical_documents, write_dataset

from corpusforge.retro import BuildConfig, build_knn
from corpusforge.retro.common import RetroError, import_faiss
from corpusforge.retro.index import TWO_LEVEL_FROM, plan_index
from corpusforge.retro.kmeans import two_level_centroids

G = 1 << 30


def _clustered(n: int, d: int, centres: int, seed: int) -> np.ndarray:
    """Unit vectors around `centres` random directions: data with structure for k-means to find."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, d))
    x = c[rng.integers(0, centres, n)] + 0.3 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _mean_best_ip(x: np.ndarray, centroids: np.ndarray) -> float:
    return float((x @ centroids.T).max(1).mean())


def test_two_level_centroids_are_seeded_and_nearly_as_good_as_one_kmeans():
    faiss = import_faiss()
    x = _clustered(30_000, 32, 300, seed=0)
    ivf = faiss.index_factory(32, "IVF256,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = 0
    ivf.train(x)
    one_level = ivf.quantizer.reconstruct_n(0, 256)
    two = two_level_centroids(faiss, x, 256, ivf.cp, seed=0)
    assert two.shape == (256, 32) and two.dtype == np.float32
    assert np.array_equal(two, two_level_centroids(faiss, x, 256, ivf.cp, seed=0))
    assert not np.array_equal(two, two_level_centroids(faiss, x, 256, ivf.cp, seed=1))
    best_one, best_two = _mean_best_ip(x, one_level), _mean_best_ip(x, two)
    assert best_two > 0.97 * best_one, (best_two, best_one)
    assert best_two > _mean_best_ip(x, x[:256]) + 0.1  # far better than centroids picked at random (0.88, 0.73)


def test_planner_trains_two_level_from_16384_lists_and_estimates_it():
    flat = plan_index(10**6, 128, 16 * G, key="IVF8192_HNSW32,Flat")
    two = plan_index(10**7, 128, 16 * G)
    assert TWO_LEVEL_FROM == 16384 and flat.kmeans == "flat" and two.key.startswith("IVF16384") and two.kmeans
    assert two.kmeans == "two-level"
    forced = plan_index(10**7, 128, 16 * G, kmeans="flat")
    assert forced.kmeans == "flat" and forced.est_train_s > 30 * two.est_train_s
    assert 200 < forced.est_train_s < 330  # the 261 s measured at 10M
    assert plan_index(10**5, 128, 16 * G).kmeans == ""  # HNSW: no lists to train
    assert "two-level k-means" in dict(two.describe())["train sample"]
    with pytest.raises(RetroError, match="--kmeans fast: choose one of auto, flat, two-level"):
        plan_index(10**7, 128, 16 * G, kmeans="fast")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_dataset(tmp_path_factory.mktemp("kmeans") / "corpus", topical_documents(300, seed=5, max_len=300))


@pytest.mark.parametrize("key", ["IVF16,Flat", "OPQ16_64,IVF16_HNSW32,PQ16x4"])
def test_index_trained_two_level_reaches_recall_and_rebuilds_byte_for_byte(dataset, tmp_path, key):
    builds = {}
    for name in ("a", "b"):
        config = BuildConfig(prefix=dataset, output=str(tmp_path / name), shard_size=256, index_key=key,
                             kmeans="two-level", recall_queries=100, neighbours=False)  # fmt: skip
        builds[name] = build_knn(config)
    assert builds["a"].plan["kmeans"] == "two-level"
    assert builds["a"].recall["recall@10"] >= 0.95
    for f in ("index/index.faiss",):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    flat = build_knn(BuildConfig(prefix=dataset, output=str(tmp_path / "flat"), shard_size=256, index_key=key,
                                 kmeans="flat", recall_queries=100, neighbours=False))  # fmt: skip
    assert (tmp_path / "flat" / "index" / "index.faiss").read_bytes() != (tmp_path / "a" / f).read_bytes()
    assert flat.plan["kmeans"] == "flat"


def test_database_from_before_kmeans_resumes_as_flat(dataset, tmp_path):
    config = BuildConfig(prefix=dataset, output=str(tmp_path / "db"), shard_size=256, index_key="IVF16,Flat",
                         kmeans="flat", recall_queries=100, neighbours=False)  # fmt: skip
    build_knn(config)
    path = tmp_path / "db" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["identity"]["kmeans"]
    path.write_text(json.dumps(manifest))
    assert build_knn(config, resume=True).plan["kmeans"] == "flat"
    with pytest.raises(RetroError, match="cannot resume: kmeans was 'flat', now 'two-level'"):
        build_knn(BuildConfig(**{**config.__dict__, "kmeans": "two-level"}), resume=True)

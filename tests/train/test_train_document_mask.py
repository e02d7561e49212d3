"""data.document_mask in the trainer: the loaders' document boundaries reach the model (the losses change, and are
finite), positions restart per document; what it does not reach (synthetic tokens, RETRO) is refused in one line.
Every parallel layout is tests/train/test_train_parallel.py's; that each document's logits equal the document run
alone is tests/train/test_document_mask.py's."""

from __future__ import annotations

import json
import math

import pytest
import trainkit

from corpusforge.train import ConfigError, load_config, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def losses(out_dir) -> list[float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def run(corpus, out_dir, **extra) -> list[float]:
    overrides = trainkit.tiny_overrides(
        corpus, out_dir, max_steps=3, seq_length=128, global_batch_tokens=1024, eval_interval=0, **extra
    )
    train(load_config(None, overrides), log=lambda line: None)
    return losses(out_dir)


@pytest.mark.parametrize("name", ["custom", "llama3-tiny"])
def test_the_boundaries_reach_the_model(corpus, tmp_path, name):
    """Samples of 128 tokens pack 40-200-token documents: masking them changes every step's loss, and the same run
    again gives the same losses (seeded, deterministic)."""
    extra = {"model.name": f'"{name}"'} | ({"model.n_head": 4, "model.n_kv_head": 2} if name != "custom" else {})
    plain = run(corpus, tmp_path / "plain", **extra)
    masked = run(corpus, tmp_path / "masked", **{"data.document_mask": "true"}, **extra)
    again = run(corpus, tmp_path / "again", **{"data.document_mask": "true"}, **extra)
    assert len(masked) == 3 and all(math.isfinite(x) for x in masked)
    assert masked == again
    assert all(a != b for a, b in zip(plain, masked)), (plain, masked)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"data.source": '"synthetic"'}, "synthetic tokens have no documents"),
        ({"model.name": '"retro"', "retro.db": '"db"'}, "RETRO does not train with document masks yet"),
    ],
)
def test_what_it_does_not_reach_is_refused_in_one_line(corpus, tmp_path, extra, words):
    with pytest.raises(ConfigError, match=r"^command line: .*: data\.document_mask: ") as info:
        load_config(None, trainkit.tiny_overrides(corpus, tmp_path, **{"data.document_mask": "true"}, **extra))
    assert words in str(info.value) and "\n" not in str(info.value)

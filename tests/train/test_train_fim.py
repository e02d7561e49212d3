"""data.fim in the trainer: the train loader serves Megatron-LM's fill-in-the-middle samples (corpusforge.data.fim,
whose equality to Megatron's GPTFIMDataset is tests/data/test_fim.py's), the run trains on them, and what FIM does not
combine with, or a bad option or tokenizer, is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import trainkit

from corpusforge.data.fim import FIMDataset
from corpusforge.indexed import IndexedDatasetWriter
from corpusforge.train import ConfigError, load_config, train
from corpusforge.train.data import DataError, build_data

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "fim_reference"
TOKENIZER = REFERENCE / "tokenizer"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The FIM reference corpus (code-like documents tokenized with the stored tokenizer) as a token dataset."""
    prefix = tmp_path_factory.mktemp("fim") / "fim_text_document"
    with np.load(REFERENCE / "samples.npz", allow_pickle=False) as z, IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(z["corpus/tokens"], z["corpus/lengths"])
    return str(prefix)


def overrides(corpus: str, out: Path, fim: str | None, **extra) -> list[str]:
    values = {"model.vocab_size": 640, "model.seq_length": 64, "max_steps": 3, "eval_interval": 0,
              "checkpoint_interval": 0, "data.split": '"100,0,0"', **extra}  # fmt: skip
    if fim is not None:
        values["data.fim"] = fim
    return trainkit.tiny_overrides(corpus, out, **values)


FIM = f'{{tokenizer = "{TOKENIZER}", fim_rate = 1.0, fim_spm_rate = 0.5}}'


def test_the_train_loader_serves_fim_samples_and_the_run_trains_on_them(corpus, tmp_path):
    cfg = load_config(None, overrides(corpus, tmp_path / "fim", FIM))
    data = build_data(cfg, 0, 1)
    dataset = data.train.dataset
    assert isinstance(dataset, FIMDataset) and dataset.fim.fim_rate == 1.0 and dataset.seed == cfg.seed
    batch = next(iter(data.train))
    want = dataset.get_batch(np.arange(cfg.schedule.micro_batch_size))  # the sampler's first ids, in order
    np.testing.assert_array_equal(batch["tokens"].numpy(), want["tokens"])
    plain = build_data(load_config(None, overrides(corpus, tmp_path / "plain", None)), 0, 1).train.dataset
    assert not np.array_equal(plain.get_batch(np.arange(8))["tokens"], want["tokens"])  # rewritten, not plain

    train(cfg, log=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "fim" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("kind") == "train"]
    assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.parametrize(
    ("fim", "extra", "words"),
    [
        (FIM, {"data.document_mask": "true"}, "data.fim: fill-in-the-middle rewrites each sample as one document"),
        (FIM, {"data.source": '"synthetic"'}, "drop data.fim or data.source"),
        ("{fim_rate = 0.5}", {}, "data.fim: give the tokenizer the corpus was made with"),
        (f'{{tokenizer = "{TOKENIZER}", fim_rat = 0.5}}', {}, "data.fim: unknown option(s) fim_rat; Megatron-LM's are"),
        (f'{{tokenizer = "{TOKENIZER}", fim_rate = 1.5}}', {}, "data.fim: fim_rate=1.5: a probability must be within"),
    ],
)
def test_what_fim_cannot_do_is_one_line(corpus, tmp_path, fim, extra, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides(corpus, tmp_path, fim, **extra))
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_tokenizer_that_cannot_be_read_is_one_line(corpus, tmp_path):
    cfg = load_config(None, overrides(corpus, tmp_path, f'{{tokenizer = "{tmp_path / "nothing"}", fim_rate = 0.5}}'))
    with pytest.raises(DataError, match=r"^data\.fim: tokenizer .*nothing: ") as info:
        build_data(cfg, 0, 1)
    assert "\n" not in str(info.value)

"""Bad input fails with a clear error before any compute: wrong checkpoint shape, too little data, bad token ids."""

from __future__ import annotations

import numpy as np
import pytest
import trainkit
from click.testing import CliRunner

from corpusforge.cli.train import train_cmd
from corpusforge.indexed import IndexedDatasetWriter
from corpusforge.train import CheckpointError, ConfigError, DataError, load_config, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def cfg(corpus, out_dir, **extra):
    return load_config(None, trainkit.tiny_overrides(corpus, out_dir, **extra))


def test_checkpoint_of_another_shape_is_refused_before_compute(corpus, tmp_path):
    train(cfg(corpus, tmp_path, max_steps=2), log=lambda line: None)
    with pytest.raises(CheckpointError, match=r"another model shape \(n_embd: checkpoint 32 != config 64\)"):
        train(cfg(corpus, tmp_path, max_steps=4, n_embd=64), log=lambda line: None)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        train(cfg(corpus, tmp_path, max_steps=4, resume=f'"{tmp_path}"'), log=lambda line: None)


def test_dataset_shorter_than_one_batch(tmp_path):
    prefix = str(tmp_path / "small_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.arange(300) % trainkit.VOCAB, np.array([100, 100, 100]))
    with pytest.raises(DataError, match=r"holds 300 tokens, fewer than one global batch of 512"):
        train(cfg(prefix, tmp_path / "run", split='"100,0,0"', eval_interval=0), log=lambda line: None)
    with pytest.raises(DataError, match="gives validation no data"):
        train(cfg(prefix, tmp_path / "run", split='"100,0,0"', global_batch_tokens=256), log=lambda line: None)


def test_missing_dataset_and_token_beyond_vocab(corpus, tmp_path):
    with pytest.raises(DataError, match="missing .*nope_text_document.idx"):
        train(cfg(str(tmp_path / "nope_text_document"), tmp_path / "run"), log=lambda line: None)
    with pytest.raises(DataError, match=r"token id \d+ is not below vocab_size 16"):
        train(cfg(corpus, tmp_path / "run2", vocab_size=16), log=lambda line: None)


def test_batch_that_does_not_divide_fails_before_data(tmp_path):
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size"):
        train(cfg(str(tmp_path / "not_there"), tmp_path, global_batch_tokens=500), log=lambda line: None)


def test_cli_errors_are_one_line_and_dry_run_plans(corpus, tmp_path):
    runner = CliRunner()
    bad = runner.invoke(train_cmd, [*trainkit.tiny_overrides(corpus, tmp_path), "learning_rate=1"])
    assert bad.exit_code == 1
    assert "corpusforge: error:" in bad.output and "unknown key 'learning_rate'" in bad.output
    assert "Traceback" not in bad.output
    ok = runner.invoke(train_cmd, [*trainkit.tiny_overrides(corpus, tmp_path), "--dry-run", "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"grad_accum": 2' in ok.output and '"tokens_per_step": 512' in ok.output
    assert not (tmp_path / "checkpoints").exists()  # a plan, not a run
    keys = runner.invoke(train_cmd, ["--list-keys"])
    assert "global_batch_tokens = 524288" in keys.output

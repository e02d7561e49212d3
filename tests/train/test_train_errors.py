"""Bad input fails with a clear error before any compute: wrong checkpoint shape, too little data, bad token ids,
a rerun with another schedule, a checkpoint or index cache that holds a pickle or is damaged."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import trainkit
from click.testing import CliRunner

from corpusforge.cli.train import train_cmd
from corpusforge.data.cache import CacheMismatchError, wait_for_index_caches
from corpusforge.errors import PickleRefusedError
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
    with pytest.raises(DataError, match=r"nope_text_document\.idx: no such file"):
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


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A run of 2 steps with its checkpoint, index cache and config; tests copy it before damaging it."""
    run = tmp_path_factory.mktemp("run")
    train(cfg(corpus, run, max_steps=2, checkpoint_interval=2), log=lambda line: None)
    return run


def rerun(corpus, finished_run, tmp_path, **extra):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    train(cfg(corpus, run, **{"max_steps": 2, "checkpoint_interval": 2, **extra}), log=lambda line: None)


@pytest.mark.parametrize(
    "key, value, shown",
    [
        ("max_steps", 4, "schedule.max_steps=2, now schedule.max_steps=4"),
        ("seed", 7, "seed=1234, now seed=7"),
        ("global_batch_tokens", 1024, "schedule.global_batch_tokens=512, now schedule.global_batch_tokens=1024"),
    ],
)
def test_rerun_with_another_data_order_names_the_keys_and_the_fix(corpus, finished_run, tmp_path, key, value, shown):
    with pytest.raises(CheckpointError, match=f"cannot resume: this run was started with {shown}") as e:
        rerun(corpus, finished_run, tmp_path, **{key: value})
    assert "rerun with the values it was started with, or give a new out_dir" in str(e.value)


def test_rerun_over_changed_data_says_the_data_changed(tmp_path):
    prefix = trainkit.write_markov_corpus(tmp_path / "c_text_document", num_docs=60)
    train(cfg(prefix, tmp_path / "run", max_steps=2, checkpoint_interval=2, eval_interval=0), log=lambda line: None)
    trainkit.write_markov_corpus(prefix, num_docs=60, seed=1)  # other documents under the same name
    # the run's index cache entries are completed (fsynced, described) by a background thread: removed under it,
    # its error would be raised by the next wait in this process, another test's
    wait_for_index_caches()
    shutil.rmtree(tmp_path / "run" / "index-cache")
    with pytest.raises(CheckpointError, match="cannot resume: the training data changed since this run was saved"):
        train(cfg(prefix, tmp_path / "run", max_steps=2, checkpoint_interval=2, eval_interval=0), log=lambda x: None)


class _Payload:
    """Unpickling this runs code: it creates the file named `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mknod, (self.path,))


def _write_damage(path, kind: str, marker) -> None:
    if kind == "torch.save of an object":
        with open(path, "wb") as f:  # a file object: torch.save names the archive after a path's stem, "" here
            torch.save({"w": torch.ones(2), "x": _Payload(str(marker))}, f)
    elif kind == "bare pickle":
        path.write_bytes(pickle.dumps({"x": _Payload(str(marker))}))
    elif kind == "cut archive":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # junk
        path.write_bytes(b"not a checkpoint at all")


@pytest.mark.parametrize("name", [".metadata", "trainer.pt"])  # DCP's index (a pickle), and the loader and RNG state
@pytest.mark.parametrize("kind", ["torch.save of an object", "bare pickle", "cut archive", "junk"])
def test_pickled_or_damaged_checkpoint_file_is_refused_naming_it(corpus, finished_run, tmp_path, name, kind):
    run, marker = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(finished_run, run)
    step = run / "checkpoints" / "step_00000002"
    _write_damage(step / name, kind, marker)
    error = PickleRefusedError if kind in ("torch.save of an object", "bare pickle") else CheckpointError
    with pytest.raises(error, match=f"{step / name}: .*delete {step} to resume from the checkpoint before it"):
        train(cfg(corpus, run, max_steps=2, checkpoint_interval=2), log=lambda line: None)
    assert not marker.exists()  # refused, never unpickled


def test_damaged_checkpoint_meta_is_refused_naming_it(corpus, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / "step_00000002" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json: not valid JSON"):
        train(cfg(corpus, run, max_steps=2, checkpoint_interval=2), log=lambda line: None)


@pytest.mark.parametrize("kind", ["object array", "bare pickle", "cut array"])
def test_pickled_or_damaged_index_cache_is_refused_naming_it(corpus, finished_run, tmp_path, kind):
    run, marker = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")  # a fresh run over the cache
    target = sorted((run / "index-cache").glob("*-GPTDataset-train-shuffle_index.npy"))[0]
    if kind == "object array":
        np.save(target, np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)
    elif kind == "bare pickle":
        target.write_bytes(pickle.dumps([_Payload(str(marker))]))
    else:
        target.write_bytes(target.read_bytes()[:100])
    error = PickleRefusedError if kind != "cut array" else CacheMismatchError
    with pytest.raises(error, match=f"{target}: .*delete it \\(an index cache is rebuilt\\)"):
        train(cfg(corpus, run, max_steps=2, checkpoint_interval=2), log=lambda line: None)
    assert not marker.exists()


@pytest.mark.parametrize(
    "override, words",
    [
        ('data.split="x"', "split 'x': give one to three"),
        ('data.split="0,0,0"', "must sum to a positive number"),
        ('data.path="0.5"', "blend ['0.5']"),
        ('storage.read_mode="bogus"', "read_mode 'bogus'"),
        ('dtype="float8"', "dtype = 'float8'"),
        ('schedule.max_steps="x"', 'command line: schedule.max_steps="x": expected a whole number'),
        ("bogus.key=1", "unknown key 'bogus.key'"),
        ('checkpoint.resume="/nowhere"', "/nowhere: not a complete checkpoint"),
        ("schedule.global_batch_tokens=500", "not a multiple of micro_batch_size"),
    ],
)
def test_cli_bad_config_value_is_one_line(corpus, tmp_path, override, words):
    result = CliRunner().invoke(train_cmd, [*trainkit.tiny_overrides(corpus, tmp_path), override])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("corpusforge: error: "), result.stderr
    assert words in result.stderr, result.stderr

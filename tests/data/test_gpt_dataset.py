"""The GPT dataset's pieces on hand-checkable inputs: pinned seeded indices, splits, reading across documents."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from loader_data import EOD, write_dataset

from corpusforge.data import GPTDataset, GPTDatasetConfig, IndexCache
from corpusforge.data.gpt_dataset import build_indices, build_sample_index, split_ranges
from corpusforge.indexed import IndexedDataset
from corpusforge.storage import StorageConfig


def test_indices_are_pinned_for_a_seed():
    """The same seed gives these indices on every machine (numpy's legacy RandomState stream is frozen)."""
    idx = build_indices(np.arange(1, 21, dtype=np.int32), np.arange(20), 10, 16, seed=1234)
    assert idx["document_index"][:8].tolist() == [3, 13, 2, 16, 14, 5, 4, 0]
    assert idx["sample_index"][:5].tolist() == [[0, 0], [1, 12], [3, 11], [4, 10], [7, 0]]
    assert idx["shuffle_index"][:8].tolist() == [7, 10, 4, 1, 11, 8, 3, 9]


def test_sample_index_by_hand():
    # Two documents of 5 tokens, samples of 4 (+1): starts at stream tokens 0, 4, 8.
    assert build_sample_index(np.array([5, 5], np.int32), np.array([0, 1], np.int32), 4, 2, 1).tolist() == [
        [0, 0],
        [0, 4],
        [1, 3],
    ]


def test_split_ranges():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1,0,1", 10) == [(0, 5), None, (5, 10)]
    assert split_ranges("100", 7) == [(0, 7), None, None]


def test_samples_read_across_documents(tmp_path):
    """Each sample is seq_length + 1 consecutive tokens of the documents in document-index order."""
    prefix = write_dataset(tmp_path / "d_text_document", 50, seed=9, max_len=40, empty_every=7)
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(indexed, "train", (0, 50), 100, GPTDatasetConfig(seq_length=16, seed=3))
    stream = np.concatenate([indexed[int(d)] for d in ds.document_index]).astype(np.int32)
    text = ds.get_text(np.arange(len(ds)))
    for i, row in enumerate(text):
        j = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(row, stream[j * 16 : j * 16 + 17])


def test_partial_validation_sample_is_padded(tmp_path):
    prefix = write_dataset(tmp_path / "e_text_document", 20, seed=2, max_len=30)
    indexed = IndexedDataset(prefix)
    config = GPTDatasetConfig(seq_length=32, drop_last_partial_validation_sequence=False, eod_token_id=EOD)
    ds = GPTDataset(indexed, "valid", (0, 20), None, config)
    batch = ds.get_batch(np.arange(len(ds)))
    padded = batch["loss_mask"] == 0
    assert padded.any() and (batch["labels"][padded] == 0).all()
    assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32


def test_lock_without_flock(tmp_path, monkeypatch):
    """Where the file system has no flock, an O_EXCL lock file serialises the builders and is removed after."""
    import corpusforge.data.cache as cache

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks")

    # Entries earlier tests built may still be finishing in the background: they unlock with the real flock.
    cache.wait_for_index_caches()
    monkeypatch.setattr(cache.fcntl, "flock", no_flock)
    arrays, built = IndexCache(tmp_path).get_or_build("X", {"a": 1}, lambda: {"v": np.arange(4)})
    assert built and arrays["v"].tolist() == [0, 1, 2, 3]
    cache.wait_for_index_caches()  # the lock is released once the entry is durable, by a background thread
    assert not list(tmp_path.glob("*.excl")) and list(tmp_path.glob("*-description.json"))


def test_attention_mask_only_when_asked(tmp_path):
    prefix = write_dataset(tmp_path / "f_text_document", 30, seed=5)
    indexed = IndexedDataset(prefix)
    plain = GPTDataset(indexed, "train", (0, 30), 10, GPTDatasetConfig(seq_length=8))
    assert "attention_mask" not in plain.get_batch([0])
    masked = GPTDataset(indexed, "train", (0, 30), 10, GPTDatasetConfig(seq_length=8, create_attention_mask=True))
    mask = masked.get_batch([0, 1])["attention_mask"]
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == bool
    np.testing.assert_array_equal(mask[0, 0], np.triu(np.ones((8, 8), bool), 1))


def test_out_of_range_sample(tmp_path):
    prefix = write_dataset(tmp_path / "g_text_document", 30, seed=5)
    ds = GPTDataset(IndexedDataset(prefix), "train", (0, 30), 10, GPTDatasetConfig(seq_length=8))
    with pytest.raises(IndexError, match="out of range"):
        ds.get_batch([len(ds)])


def test_empty_split_with_no_samples_asked(corpora):
    """969,30,1 on 400 documents leaves the test split empty: fine when it is asked for 0 samples."""
    from corpusforge.data import build_gpt_datasets

    train, valid, test = build_gpt_datasets(corpora[0], 16, num_samples=(50, 5, 0))
    assert len(test) == 0 and len(train) >= 50 and len(valid) >= 5


@pytest.mark.parametrize("read_mode", ["mmap-random", "pread", "direct"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_extra_token_to_sequence": False, "pad_token_id": 3},
        {"eod_mask_loss": True, "reset_position_ids": True, "pad_token_id": 5},
    ],
)
def test_every_read_path_gives_the_samples_of_the_document_stream(tmp_path, read_mode, options):
    """get_batch, __getitems__ and a loader with workers (raw text assembled in the main process) read, in each
    read mode, sample j as tokens [j * S, j * S + S + extra) of the documents in document-index order, the short
    last sample padded; the fields are make_batch's of that text."""
    import torch

    from corpusforge.data import make_loader
    from corpusforge.data.batch import make_batch
    from corpusforge.storage import open_dataset

    prefix = write_dataset(tmp_path / "h_text_document", 60, seed=8, max_len=50, empty_every=9)
    indexed = open_dataset(prefix, StorageConfig(read_mode=read_mode))
    config = GPTDatasetConfig(seq_length=24, eod_token_id=EOD, drop_last_partial_validation_sequence=False, **options)
    ds = GPTDataset(indexed, "valid", (0, 60), None, config)
    width, pad = 24 + config.extra, config.pad
    stream = np.concatenate([IndexedDataset(prefix)[int(d)] for d in ds.document_index]).astype(np.int32)
    stream = np.r_[stream, np.full(width, pad, np.int32)]  # the short last sample reads pads past the end
    ids = np.r_[np.arange(len(ds)), [len(ds) - 1, 0]]  # every sample (the last one short), repeats
    starts = ds.shuffle_index[ids].astype(np.int64) * 24
    expected = make_batch(np.stack([stream[j : j + width] for j in starts]), config)
    assert (expected["loss_mask"] == 0).any()
    loaded = [b for _, b in zip(range(len(ds) // 2), make_loader(ds, 2, num_workers=2))]
    for batch in (ds.get_batch(ids), ds.__getitems__(list(ids))):
        assert sorted(batch) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(np.asarray(batch[key]), value, err_msg=f"{read_mode} {key}")
    for key in expected:
        got = np.concatenate([np.asarray(b[key]) for b in loaded])
        np.testing.assert_array_equal(got, expected[key][: len(got)], err_msg=f"{read_mode} loader {key}")
    tensors = ds.__getitems__([2, 0, 1])
    assert {t.dtype for t in tensors.values()} == {torch.int32, torch.float32}
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1  # one storage per batch

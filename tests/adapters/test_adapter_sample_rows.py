"""Per-sample rows of one read (corpusforge/adapters/sample_rows.py): torch's default collate and the HF adapter's
collate_rows give back the batch they were cut from, without a copy, and any other list of rows (several reads,
reordered, a part, plain dicts among them) exactly as torch collates the rows' plain dicts."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from adapter_harness import EOD, make_corpora
from torch.utils.data import DataLoader, default_collate

from corpusforge.adapters.hf_trainer import TrainerSamples, collate_rows
from corpusforge.adapters.sample_rows import SampleRow, sample_rows, whole_batch
from corpusforge.data import build_gpt_datasets


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """The HF adapter's samples of a blend (the Megatron-LM adapter's, which add a numpy dataset_id, are compared
    with megatron-core's through torch's DataLoader in test_adapter_megatron_lm.py; it imports megatron.core, ~10 s)."""
    corpora = make_corpora(tmp_path_factory.mktemp("corpora"))
    train, _, _ = build_gpt_datasets([corpora[0], 0.6, corpora[1], 0.4], 32, "1", 3, (40, 0, 0), eod_token_id=EOD,
                                     eod_mask_loss=True)  # fmt: skip
    return TrainerSamples(train)


def stacked(rows: list) -> dict:
    """torch's collate of the rows as the plain dicts they are."""
    return default_collate([dict(row) for row in rows])


def assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key in expected:
        assert (got[key].dtype, got[key].shape) == (expected[key].dtype, expected[key].shape), key
        assert torch.equal(got[key], expected[key]), key


def test_one_reads_rows_collate_to_its_batch_without_a_copy(blend):
    rows = blend.__getitems__([4, 5, 6, 7])
    assert type(rows[0]) is SampleRow and list(rows[0]) == ["input_ids", "labels", "shift_labels", "position_ids"]
    for got in (default_collate(rows), collate_rows(rows)):
        assert type(got) is dict
        assert_same(got, stacked(rows))
        assert got["input_ids"].data_ptr() == rows[0]["input_ids"].data_ptr()  # the batch itself
    alone = blend[5]  # a sample read alone: the same plain dict
    assert type(alone) is dict and list(alone) == list(rows[1])
    assert all(alone[k].dtype == rows[1][k].dtype and bool((alone[k] == rows[1][k]).all()) for k in alone)


@pytest.mark.parametrize("pick", ["two reads", "reordered", "a part", "a plain dict among them"])
def test_any_other_rows_collate_as_plain_dicts(blend, pick):
    rows = blend.__getitems__([4, 5, 6])
    lists = {
        "two reads": rows[:2] + blend.__getitems__([6]),
        "reordered": rows[::-1],
        "a part": rows[:2],
        "a plain dict among them": [rows[0], dict(rows[1]), rows[2]],
    }
    chosen = lists[pick]
    assert whole_batch(chosen) is None
    for got in (default_collate(chosen), collate_rows(chosen)):
        assert_same(got, stacked(chosen))
        assert got["input_ids"].data_ptr() != chosen[0]["input_ids"].data_ptr()


def test_a_dataloader_with_a_batch_sampler_gives_the_batches(blend):
    """What Megatron-LM's build_pretraining_data_loader makes: a batch sampler's ids to __getitems__, one batch
    each, equal to the samples read one by one and stacked."""
    loader = DataLoader(blend, batch_sampler=[[0, 1, 2], [9, 3, 4]], num_workers=0)
    for ids, got in zip([[0, 1, 2], [9, 3, 4]], loader):
        assert_same(got, default_collate([blend[i] for i in ids]))


def test_rows_are_read_only_and_copy_as_plain_dicts(blend):
    row = blend.__getitems__([0, 1])[0]
    with pytest.raises(TypeError):
        row["input_ids"] = torch.zeros(32, dtype=torch.int64)
    for clone in (pickle.loads(pickle.dumps(row)), copy.copy(row)):
        assert type(clone) is dict and list(clone) == list(row)
        assert all(bool((clone[k] == row[k]).all()) for k in row)


def test_numpy_fields_collate_as_torch_collates_their_scalars():
    """As the Megatron-LM adapter's dataset_id: numpy int16 scalars in the rows, an int16 tensor in the batch."""
    rows = sample_rows({"dataset_id": np.array([3, 1], np.int16), "tokens": torch.arange(4).view(2, 2)})
    assert isinstance(rows[0]["dataset_id"], np.int16)
    for chosen in (rows, rows[::-1]):
        assert_same(default_collate(chosen), stacked(chosen))


@pytest.mark.parametrize("compiled", [True, False])
def test_widened_targets_mask_where_the_loss_mask_is_zero(monkeypatch, compiled):
    """The compiled pass and the numpy one (before numba has started in a process) give the same int64 fields."""
    import corpusforge.adapters.sample_rows as rows

    if not compiled:
        monkeypatch.setattr(rows, "started", lambda: False)
        monkeypatch.setattr(rows, "ready", lambda kernel: False)
    rng = np.random.default_rng(0)
    for dtype in (np.int32, np.uint16):
        tokens, labels, positions = (rng.integers(0, 60000, (3, 40)).astype(dtype) for _ in range(3))
        loss_mask = (rng.random((3, 40)) < 0.7).astype(np.float32)
        got = rows.widened_targets(tokens, labels, loss_mask, positions, ignore_index=-100)
        expected = [tokens, np.where(loss_mask > 0, labels.astype(np.int64), -100), positions]
        assert len(got) == 3 and got[0].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()
        for g, e in zip(got, expected):
            assert g.dtype == torch.int64 and np.array_equal(g.numpy(), e)

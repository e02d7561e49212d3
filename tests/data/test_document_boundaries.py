"""Document boundaries per sample (GPTDatasetConfig.document_boundaries): cu_seqlens, max_seqlen and position ids
restarting per document, as Megatron-LM gives them with --dataloader-inter-document-masking.

megatron-core 0.16.1 (the installed one) predates that option (PR #5298, merged 2026-06-28), so the reference here is
Megatron-LM HEAD's code at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (megatron/core/datasets/gpt_dataset.py,
GPTDataset.__getitem__ and _query_document_sample_shuffle_indices), transcribed in megatron_head_sample below and run
over megatron-core 0.16.1's own GPTDataset (same indices, same text, same masks).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from loader_data import EOD, write_dataset

from corpusforge.data import GPTDataset, GPTDatasetConfig
from corpusforge.data.batch import assemble, reset_positions
from corpusforge.indexed import IndexedDataset

MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def megatron_head_sample(mds, idx: int) -> dict[str, torch.Tensor]:
    """Sample idx of megatron-core's GPTDataset `mds` with inter_document_masking, as Megatron-LM HEAD makes it
    (MEGATRON_COMMIT): the 0.16.1 sample, plus cu_seqlens, max_seqlen and position ids from HEAD's code."""
    sample = mds[idx]
    config, seq = mds.config, mds.config.sequence_length
    # _query_document_sample_shuffle_indices: the lengths of the pieces read
    i = mds.shuffle_index[idx]
    beg, beg_off = mds.sample_index[i]
    end, end_off = mds.sample_index[i + 1]
    extra = config.add_extra_token_to_sequence
    if beg == end:
        parts = [mds.dataset.get(mds.document_index[beg], offset=int(beg_off), length=end_off - beg_off + extra)]
    else:
        parts = []
        for j in range(beg, end + 1):
            offset = 0 if j > beg else beg_off
            length = None if j < end else end_off + extra
            parts.append(mds.dataset.get(mds.document_index[j], offset=int(offset), length=length))
    document_lengths = [len(p) for p in parts]
    # __getitem__, inter_document_masking
    if extra:
        document_lengths[-1] -= 1
        if document_lengths[-1] == 0:
            document_lengths.pop()
    shortfall = seq - sum(document_lengths)
    if shortfall > 0:
        if document_lengths:
            document_lengths[-1] += shortfall
        else:
            document_lengths.append(shortfall)
    cu_seqlens = torch.tensor(np.cumsum([0] + document_lengths), dtype=torch.int32)
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    position_ids = sample["position_ids"].clone()
    for k in range(1, cu_seqlens.numel()):
        start, stop = cu_seqlens[k - 1].item(), cu_seqlens[k].item()
        position_ids[start:stop] = torch.arange(stop - start, dtype=torch.long)
    padded = torch.full((seq + 1,), seq, dtype=torch.int32)
    padded[: cu_seqlens.numel()] = cu_seqlens
    return {**sample, "position_ids": position_ids, "cu_seqlens": padded, "max_seqlen": max_seqlen}


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("split", ["train", "valid"])
def test_same_boundaries_as_megatron_head(tmp_path, corpora, monkeypatch, extra, split):
    """Sample for sample, on a dataset with empty documents, with and without the extra token, and with a padded
    last validation sample: the fields equal Megatron-LM HEAD's."""
    mgpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from test_parity import megatron_datasets

    from corpusforge.data import build_gpt_datasets

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    options = dict(add_extra_token_to_sequence=extra, drop_last_partial_validation_sequence=False)
    theirs = megatron_datasets([corpora[0]], 48, "80,15,5", 1234, (300, None, 10), tmp_path / "m", **options)
    ours = build_gpt_datasets(
        [corpora[0]], 48, "80,15,5", 1234, (300, None, 10), tmp_path / "o", eod_token_id=EOD, **options,
        document_boundaries=True,
    )  # fmt: skip
    k = ["train", "valid"].index(split)
    mine, ref = ours[k], theirs[k]
    assert isinstance(ref, mgpt.GPTDataset) and len(mine) == len(ref)
    ids = np.arange(len(mine))
    batch = mine.get_batch(ids)
    for i in ids.tolist():
        expected = megatron_head_sample(ref, i)
        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"):
            np.testing.assert_array_equal(batch[key][i], expected[key].numpy(), err_msg=f"sample {i}, {key}")
    assert batch["cu_seqlens"].dtype == np.int32 and batch["max_seqlen"].dtype == np.int32


@pytest.fixture
def dataset(tmp_path):
    prefix = write_dataset(tmp_path / "d_text_document", 80, seed=4, max_len=40, empty_every=9)
    config = GPTDatasetConfig(seq_length=32, seed=5, eod_token_id=EOD, document_boundaries=True)
    return GPTDataset(IndexedDataset(prefix), "train", (0, 80), 60, config)


def test_every_path_gives_the_same_fields(dataset):
    """get_batch, __getitems__, __getitem__ and a loader worker's raw batch assembled in the main process agree; the
    torch fields of a batch share one storage."""
    ids = np.arange(len(dataset))
    batch = dataset.get_batch(ids)
    items = dataset.__getitems__(ids.tolist())
    assembled = assemble(dataset.read_raw(ids), dataset.config, as_torch=True)
    assert {t.untyped_storage().data_ptr() for t in items.values()} == {items["tokens"].untyped_storage().data_ptr()}
    for key, value in batch.items():
        np.testing.assert_array_equal(items[key].numpy(), value, err_msg=key)
        np.testing.assert_array_equal(assembled[key].numpy(), value, err_msg=key)
    for i in (0, 7, len(dataset) - 1):
        one = dataset[i]
        assert one["max_seqlen"].shape == () and one["cu_seqlens"].shape == (33,)
        for key, value in batch.items():
            np.testing.assert_array_equal(one[key].numpy(), value[i], err_msg=f"{key} of sample {i}")


def test_a_raw_batch_carries_only_the_columns_its_samples_use(dataset):
    """read_raw (what a loader worker sends) cuts cu_seqlens to the columns the batch's samples can use: one more than
    the most document pieces any of them reads. Assembled, it is Megatron's (B, S + 1) layout again, equal to
    get_batch's, for batches of one sample to all of them; so is a raw batch whose boundaries are padded already (as
    a blend puts them in row order), and RawBatch.cu_seqlens gives the padded layout."""
    s = dataset.config.seq_length
    everything = dataset.get_batch(np.arange(len(dataset)))
    rng = np.random.default_rng(0)
    widths = set()
    for size in (1, 2, 5, 8, len(dataset)):
        ids = rng.choice(len(dataset), size, replace=False)
        raw = dataset.read_raw(ids)
        rows = dataset.shuffle_index[ids].astype(np.int64)
        pieces = dataset.sample_index[rows + 1, 0] - dataset.sample_index[rows, 0] + 1
        assert raw.boundaries.shape == (size, min(int(pieces.max()), s) + 1) and (raw.boundaries[:, -1] == s).all()
        widths.add(raw.boundaries.shape[1])
        np.testing.assert_array_equal(raw.cu_seqlens, everything["cu_seqlens"][ids])
        for sent in (raw, dataclasses.replace(raw, boundaries=raw.cu_seqlens)):
            for as_torch in (True, False):
                batch = assemble(sent, dataset.config, as_torch=as_torch)
                assert set(batch) == set(everything)
                for key, value in everything.items():
                    np.testing.assert_array_equal(np.asarray(batch[key]), value[ids], err_msg=key)
    assert len(widths) > 1 and max(widths) < s + 1


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_loader_workers_send_the_boundaries(dataset):
    """Through the loader's worker processes (raw batches pickled, assembled in this process), the same batches as
    without workers: every field, cu_seqlens and max_seqlen in one storage as views of it."""
    from corpusforge.data import make_loader

    alone = list(make_loader(dataset, 4, 0, 1))
    workers = list(make_loader(dataset, 4, 0, 1, num_workers=2))
    assert len(alone) == len(workers) == len(dataset) // 4
    for a, b in zip(alone, workers):
        assert a.keys() == b.keys() == {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"}
        assert len({t.untyped_storage().data_ptr() for t in b.values()}) == 1
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert b["cu_seqlens"].shape == (4, 33) and b["cu_seqlens"].is_contiguous() and b["max_seqlen"].shape == (4,)


def test_boundaries_are_the_documents(dataset):
    """Each span of cu_seqlens holds one document piece: eod tokens only at its end, positions 0.. within it; and
    with documents that end in eod, the positions are reset_position_ids'."""
    batch = dataset.get_batch(np.arange(len(dataset)))
    plain = GPTDataset(
        dataset.indexed, "train", (0, 80), 60, GPTDatasetConfig(32, seed=5, eod_token_id=EOD, reset_position_ids=True)
    ).get_batch(np.arange(len(dataset)))
    for row in range(len(dataset)):
        cu = batch["cu_seqlens"][row]
        n = int(np.argmax(cu == 32))
        assert cu[0] == 0 and (np.diff(cu[: n + 1]) >= 0).all() and (cu[n:] == 32).all()
        assert batch["max_seqlen"][row] == np.diff(cu).max()
        for lo, hi in zip(cu[:n], cu[1 : n + 1]):
            assert (batch["position_ids"][row, lo:hi] == np.arange(hi - lo)).all()
            assert not (batch["tokens"][row, lo : hi - 1] == EOD).any()
    np.testing.assert_array_equal(batch["position_ids"], plain["position_ids"])


def test_by_hand():
    """Two documents of 5 tokens, samples of 4 (+1): sample 1 reads tokens 4..8, sample 2 tokens 8..9 (+ pad)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        from corpusforge.indexed import IndexedDatasetWriter

        with IndexedDatasetWriter(f"{root}/h", np.uint16) as w:
            w.add_documents(np.array([1, 2, 3, 4, 0, 5, 6, 7, 8, 0]), np.array([5, 5]))
        config = GPTDatasetConfig(4, seed=1, eod_token_id=EOD, document_boundaries=True)
        ds = GPTDataset(IndexedDataset(f"{root}/h"), "train", (0, 2), 2, config)
        rows = {int(ds.shuffle_index[i]): i for i in range(len(ds))}
        batch = ds.get_batch([rows[0], rows[1]])
    # sample index rows: stream tokens [0, 5) then [4, 9) (tokens 4 | 5 6 7, label 8)
    assert batch["cu_seqlens"].tolist()[0] == [0, 4, 4, 4, 4]
    assert batch["cu_seqlens"].tolist()[1] == [0, 1, 4, 4, 4]
    assert batch["max_seqlen"].tolist() == [4, 3]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]


def test_off_changes_nothing(tmp_path, corpora):
    """Without the option: the same fields and values as before, and the same description (loader fingerprints)."""
    config = GPTDatasetConfig(seq_length=32, eod_token_id=EOD, reset_position_ids=True)
    assert "document_boundaries" not in config.describe()
    ds = GPTDataset(IndexedDataset(corpora[0]), "train", (0, 300), 50, config)
    assert set(ds.get_batch([0, 1])) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert set(ds[0]) == set(ds.__getitems__([0])) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert ds.read_raw([0]).cu_seqlens is None
    with pytest.raises(ValueError, match="create_attention_mask"):
        GPTDatasetConfig(8, eod_token_id=EOD, document_boundaries=True, create_attention_mask=True)


def test_a_sample_of_more_pieces_than_cu_seqlens_holds_is_refused(tmp_path):
    """A sample of 4 tokens over a run of empty documents: every path (ds[i], get_batch, __getitems__, and read_raw,
    which sizes the worker's boundaries itself) refuses it with one line naming the dataset and the fix, as
    Megatron-LM fails there too."""
    from corpusforge.indexed import IndexedDatasetWriter

    lengths = np.zeros(20, np.int64)
    lengths[[0, 19]] = 3
    with IndexedDatasetWriter(tmp_path / "e", np.uint16) as w:
        w.add_documents(np.array([1, 2, EOD, 3, 4, EOD]), lengths)
    config = GPTDatasetConfig(4, seed=1, eod_token_id=EOD, document_boundaries=True)
    ds = GPTDataset(IndexedDataset(tmp_path / "e"), "train", (0, 20), 1, config)
    row = int(ds.shuffle_index[0])
    assert ds.sample_index[row + 1, 0] - ds.sample_index[row, 0] + 1 > 5  # more pieces than S + 1 entries hold
    ds.load_kernels()
    for read in (ds.get_batch, ds.__getitems__, ds.read_raw, lambda ids: ds[ids[0]]):
        with pytest.raises(ValueError, match=f"{tmp_path / 'e'}: a sample of 4 tokens spans more document pieces"):
            read([0])


def test_reset_positions_stops_at_the_padding():
    positions = np.full((1, 6), -1, np.int32)
    reset_positions(np.array([[0, 2, 2, 5, 6, 6, 6]], np.int32), positions)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]


def test_a_blend_gives_each_sample_the_boundaries_of_its_own_dataset(tmp_path, corpora):
    """A blend's batch, by every path (get_batch, __getitems__, __getitem__, read_raw then assemble), carries for
    each sample the cu_seqlens, max_seqlen and restarted positions of that sample read from its own dataset."""
    from loader_data import build_blend

    train, _, _ = build_blend(corpora, tmp_path, eod_token_id=EOD, document_boundaries=True)
    ids = list(range(0, min(len(train), 400), 7))
    which, inner = train.dataset_index[ids], train.dataset_sample_index[ids]
    assert len(set(which.tolist())) > 1  # the rows come from several datasets
    own = [train.datasets[d].get_batch([j]) for d, j in zip(which, inner)]
    paths = {
        "get_batch": train.get_batch(ids),
        "__getitems__": {k: np.asarray(v) for k, v in train.__getitems__(ids).items()},
        "read_raw+assemble": assemble(train.read_raw(ids), train.config),
    }
    for name, batch in paths.items():
        for key in ("cu_seqlens", "max_seqlen", "position_ids", "tokens"):
            expected = np.stack([np.asarray(o[key])[0] for o in own])
            assert np.array_equal(np.asarray(batch[key]), expected), (name, key)
        assert np.array_equal(np.asarray(batch["dataset_id"]), which), name
    one = train[ids[1]]
    assert np.array_equal(np.asarray(one["cu_seqlens"]), np.asarray(own[1]["cu_seqlens"])[0])

"""RetroDataset's batched path: the vectorised gather equals a per-sample, per-token reference read document by
document; missing neighbours masked; grouping, workers and pickling change nothing; random neighbours; bad input."""

from __future__ import annotations

import json
import os
import pickle
import struct

import numpy as np
import pytest
import torch
from retrokit import write_dataset

from corpusforge.indexed import IndexedDataset
from corpusforge.retro import RetroDataset, RetroError
from corpusforge.retro.chunks import chunk_documents, document_bounds
from corpusforge.retro.neighbours import HEADER, MAGIC

M, SEQ, K_STORED = 8, 32, 3  # L = 4 chunks per sample, R = 16 tokens per neighbour


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """A hand-built database (no index needed): documents of every shape against the chunk length (shorter than a
    chunk, exact multiples, ragged), and neighbours with -1s and continuations cut by their document's end."""
    root = tmp_path_factory.mktemp("retro-ds")
    rng = np.random.default_rng(0)
    lengths = [3, 8, 16, 21, 40, 5, 64, 13, 24, 9, 33, 70, 1, 16, 47]
    docs = [rng.integers(1, 1000, n) for n in lengths]
    prefix = write_dataset(root / "corpus", docs)
    table = chunk_documents(*document_bounds(IndexedDataset(prefix)), M)
    (root / "db" / "chunks").mkdir(parents=True)
    for name in ("doc", "start", "length", "doc_end"):
        np.save(root / "db" / "chunks" / f"{name}.npy", getattr(table, name))
    n = len(table)
    nb = rng.integers(0, n, (n, K_STORED))
    nb[rng.random((n, K_STORED)) < 0.2] = -1  # missing neighbours, as build-knn writes them
    nb[5, :] = -1  # a chunk with none at all
    with open(root / "db" / "neighbours.bin", "wb") as f:
        f.write(MAGIC + struct.pack("<QQQ", 1, n, K_STORED) + bytes(HEADER - len(MAGIC) - 24))
        f.write(nb.astype("<i8").tobytes())
    manifest = {"stages": {"neighbours": {}}, "config": {"chunk_length": M, "prefix": prefix}}
    (root / "db" / "manifest.json").write_text(json.dumps(manifest))
    return root / "db"


def _reference(ds: RetroDataset, sample: int, docs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """One sample's fields, token by token, from the documents (IndexedDataset[d]) and the chunk table: an
    independent reading of the contract in corpusforge/retro/dataset.py."""
    q, L, R, K = ds.query_chunks, ds.chunks_per_sample, ds.retrieved_length, ds.num_neighbours
    doc_start = {int(d): int(q.start[np.flatnonzero(q.doc == d)[0]]) for d in np.unique(q.doc)}
    first = int(ds.order[sample]) * L
    # (doc, offset) of each of the T + 1 positions, None for padding
    where = []
    for c in range(first, first + L):
        d, off = int(q.doc[c]), int(q.start[c]) - doc_start[int(q.doc[c])]
        where += [(d, off + i) if i < int(q.length[c]) else None for i in range(M)]
    d, off = where[-1] if where[-1] else (None, None)
    nxt = first + L
    where.append((d, off + 1) if d is not None and nxt < len(q) and int(q.doc[nxt]) == d else None)
    tokens = np.array([docs[w[0]][w[1]] if w else 0 for w in where[:-1]], np.int32)
    has_label = np.array([a is not None and b is not None and a[0] == b[0] for a, b in zip(where[:-1], where[1:])])
    labels = np.array([docs[b[0]][b[1]] if ok else 0 for ok, b in zip(has_label, where[1:])], np.int32)
    nbs, masks = np.zeros((L, K, R), np.int32), np.zeros((L, K, R), bool)
    for j in range(L):
        for k in range(K):
            nid = int(ds.neighbours[first + j, k])
            if nid < 0:
                continue
            d = int(ds.db_chunks.doc[nid])
            text = docs[d][int(ds.db_chunks.start[nid]) - doc_start[d] :][:R]
            nbs[j, k, : len(text)], masks[j, k, : len(text)] = text, True
    return {"tokens": tokens, "labels": labels, "loss_mask": has_label.astype(np.float32),
            "position_ids": np.arange(L * M, dtype=np.int32), "neighbours": nbs, "neighbour_mask": masks}  # fmt: skip


@pytest.fixture(scope="module")
def docs(db):
    corpus = IndexedDataset(json.loads((db / "manifest.json").read_text())["config"]["prefix"])
    return [np.asarray(corpus[i]) for i in range(len(corpus))]


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_batched_gather_equals_a_per_sample_reference(db, docs, seed, k):
    ds = RetroDataset(db, seq_length=SEQ, num_neighbours=k, seed=seed, chunk_length=M)
    ids = np.arange(len(ds))[::-1]  # every sample, in an order that is not the file's
    batch = ds.assemble(ds.read_raw(ids))
    assert batch["neighbours"].shape == (len(ds), SEQ // M, k, 2 * M)
    for row, i in enumerate(ids):
        ref = _reference(ds, int(i), docs)
        for name, expect in ref.items():
            np.testing.assert_array_equal(batch[name][row], expect, err_msg=f"sample {i}, {name}")
    # the file holds every kind of case this test claims to cover
    assert (batch["loss_mask"] == 0).any() and (batch["loss_mask"][:, M - 1 :: M] == 1).any()
    assert (~batch["neighbour_mask"].any(-1)).any() and (batch["neighbour_mask"].sum(-1) % (2 * M) != 0).any()


def test_batches_do_not_depend_on_grouping_and_torch_matches_numpy(db):
    ds = RetroDataset(db, seq_length=SEQ, seed=3)
    ids = [4, 0, 5, 2]
    whole = ds.assemble(ds.read_raw(ids))
    alone = [ds.assemble(ds.read_raw([i])) for i in ids]
    tensors = ds.__getitems__(ids)
    for name, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([a[name] for a in alone]))
        np.testing.assert_array_equal(tensors[name].numpy(), value)
    assert tensors["tokens"].dtype == torch.int32 and tensors["neighbour_mask"].dtype == torch.bool
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1  # one shared-memory segment per batch from a worker, not six


def test_sample_ranges_split_the_samples_without_sharing_a_chunk(db):
    whole = RetroDataset(db, seq_length=SEQ)
    cut = len(whole) * 2 // 3
    train = RetroDataset(db, seq_length=SEQ, seed=4, sample_range=(0, cut))
    valid = RetroDataset(db, seq_length=SEQ, seed=4, sample_range=(cut, len(whole)))
    a = train.get_batch(np.arange(len(train)))["chunk_ids"]
    b = valid.get_batch(np.arange(len(valid)))["chunk_ids"]
    assert sorted(np.concatenate([a, b]).ravel().tolist()) == sorted(
        whole.get_batch(np.arange(len(whole)))["chunk_ids"].ravel().tolist()
    )
    assert not set(a.ravel().tolist()) & set(b.ravel().tolist())
    with pytest.raises(RetroError, match="sample_range"):
        RetroDataset(db, seq_length=SEQ, sample_range=(cut, len(whole) + 1))


def test_old_fields_pad_with_pad_id(db, docs):
    ds = RetroDataset(db, seq_length=SEQ, pad_id=-7)
    old = ds.get_batch([1, 2])
    new = ds.assemble(ds.read_raw([1, 2]))
    assert (old["tokens"] == np.where(new["loss_mask"] + (new["tokens"] != 0) > 0, new["tokens"], -7)).all()
    assert (old["neighbours"][~new["neighbour_mask"]] == -7).all()
    assert (old["neighbour_ids"] < 0).any() and (old["neighbours"][old["neighbour_ids"] < 0] == -7).all()


class _Raw(torch.utils.data.Dataset):
    """What the loader's workers read (corpusforge.data.loader.RawBatches): raw batches, assembled in this process."""

    def __init__(self, ds: RetroDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitems__(self, ids):
        return self.ds.read_raw(ids)


def _keep(batch):
    return batch


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers_send_raw_batches_that_assemble_to_the_same_tensors(db, context):
    ds = RetroDataset(db, seq_length=SEQ, seed=11, neighbours="random")
    batches = [[0, 1], [2, 3], [4, 5], [1, 6]]
    loader = torch.utils.data.DataLoader(
        _Raw(ds), batch_sampler=batches, num_workers=2, collate_fn=_keep, multiprocessing_context=context
    )
    for ids, raw in zip(batches, loader):
        got, expect = ds.assemble(raw, as_torch=True), ds.__getitems__(ids)
        assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in got)


def test_pickles_as_paths_not_as_data(db):
    ds = RetroDataset(db, seq_length=SEQ, seed=5)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    again = pickle.loads(blob)
    for name, value in ds.get_batch([0, 3]).items():
        np.testing.assert_array_equal(again.get_batch([0, 3])[name], value)


def _by_chunk(ds: RetroDataset) -> np.ndarray:
    """(chunks, K) neighbour ids of every sample's chunks, rows in chunk order whatever the sample order."""
    batch = ds.get_batch(np.arange(len(ds)))
    return batch["neighbour_ids"].reshape(-1, ds.num_neighbours)[np.argsort(batch["chunk_ids"].ravel())]


def test_random_neighbours_are_deterministic_keep_the_mask_and_differ_from_the_real_ones(db):
    """neighbours="random" (the validation baseline): the same samples as the real run with the same seed, every
    real neighbour replaced by a DB chunk that depends on (seed, chunk, slot) only, missing ones kept missing."""
    real = RetroDataset(db, seq_length=SEQ, seed=1)
    rand = RetroDataset(db, seq_length=SEQ, neighbours="random", seed=1)
    ids = np.arange(len(real))
    np.testing.assert_array_equal(real.get_batch(ids)["tokens"], rand.get_batch(ids)["tokens"])
    a, b = _by_chunk(real), _by_chunk(rand)
    assert ((a < 0) == (b < 0)).all()
    assert (b < len(rand.db_chunks)).all() and (a != b)[a >= 0].mean() > 0.8
    np.testing.assert_array_equal(
        rand.get_batch(ids[::-1])["neighbour_ids"], rand.get_batch(ids)["neighbour_ids"][::-1]
    )
    other_seed = _by_chunk(RetroDataset(db, seq_length=SEQ, neighbours="random", seed=2))
    assert (other_seed != b)[b >= 0].mean() > 0.8


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_neighbours=4), ["neighbours.bin", "holds 3", "-k 4"]),
        (dict(num_neighbours=0), ["neighbours.bin", "holds 3"]),
        (dict(chunk_length=64), ["chunk length 8", "--chunk-length 64"]),
        (dict(seq_length=36), ["seq_length 36", "multiple"]),
        (dict(neighbours="nearest"), ["real, random"]),
    ],
)
def test_bad_requests_are_one_line_naming_the_fix(db, kwargs, words):
    with pytest.raises(RetroError) as e:
        RetroDataset(db, **{"seq_length": SEQ, **kwargs})
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_batch_feeds_the_retro_model_as_it_comes(db):
    """The assembled tensors (int32 ids, bool mask) go into RetroModel unchanged; a loss comes out, and the masked
    neighbour tokens (here: -1 neighbours and cut continuations) do not change it."""
    from corpusforge.train.model import loss_fn
    from corpusforge.train.retro_model import RetroConfig, RetroModel

    ds = RetroDataset(db, seq_length=SEQ, seed=2)
    batch = ds.__getitems__(list(range(len(ds))))
    torch.manual_seed(0)
    cfg = RetroConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=1000, block_size=SEQ, chunk_length=M,
                      num_neighbours=K_STORED, cca_layers=(1,))  # fmt: skip
    model = RetroModel(cfg).eval()
    with torch.no_grad():
        loss = loss_fn(model(batch["tokens"], batch["neighbours"], batch["neighbour_mask"]), batch["labels"].long(),
                       batch["loss_mask"])  # fmt: skip
        scrambled = torch.where(
            batch["neighbour_mask"], batch["neighbours"], torch.randint_like(batch["neighbours"], 1000)
        )
        again = loss_fn(model(batch["tokens"], scrambled, batch["neighbour_mask"]), batch["labels"].long(),
                        batch["loss_mask"])  # fmt: skip
    assert torch.isfinite(loss) and abs(loss.item() - again.item()) < 1e-6
    assert (~batch["neighbour_mask"]).any()


@pytest.fixture(scope="module")
def built_db(tmp_path_factory):
    """A database built by build-knn (in this process) over the kit's topical documents."""
    from retrokit import topical_documents

    from corpusforge.retro import BuildConfig, build_knn

    root = tmp_path_factory.mktemp("retro-built")
    prefix = write_dataset(root / "corpus", topical_documents(20))
    build_knn(BuildConfig(prefix=prefix, output=str(root / "db"), chunk_length=M, shard_size=512, recall_queries=20))
    return root / "db"


@pytest.mark.parametrize("value", ["n_chunks", "n_chunks + 1000", "-2", "-(2**62)"])
def test_neighbour_ids_out_of_range_are_refused_at_open_naming_the_first_bad_row(built_db, tmp_path, value):
    """Size and header intact, one id edited in place: beyond the database's chunks, or negative other than -1 (the
    'no neighbour' mark). Refused when the dataset opens, in one line with the file, the row and the fix; -1 and the
    largest real id are accepted."""
    import shutil

    from corpusforge.retro.chunks import ChunkTable

    db = tmp_path / "db"
    shutil.copytree(built_db, db)
    n_chunks = len(ChunkTable.load(db / "chunks"))
    path = db / "neighbours.bin"
    with open(path, "r+b") as f:
        _, _, rows, k = struct.unpack_from("<8sQQQ", f.read(HEADER))
        ids = np.frombuffer(f.read(), dtype="<i8").reshape(rows, k).copy()
        ids[3, 1], ids[4, 0] = -1, n_chunks - 1  # both fine
        ids[rows - 2, k - 1] = eval(value, {"n_chunks": n_chunks})  # the one bad id, near the end
        f.seek(HEADER)
        f.write(ids.tobytes())
    with pytest.raises(RetroError) as e:
        RetroDataset(db, seq_length=2 * M)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: row {rows - 2} holds neighbour id "), message
    assert f"the database has {n_chunks} chunks" in message and "build-knn" in message, message
    ids[rows - 2, k - 1] = 0
    with open(path, "r+b") as f:
        f.seek(HEADER)
        f.write(ids.tobytes())
    assert len(RetroDataset(db, seq_length=2 * M)) > 0  # repaired: opens


def test_reads_of_the_maps_are_marked_for_a_watchdog(db):
    """Each batch's two gathers out of the memory maps (the samples' chunks, their neighbours) are marked as reads in
    readwatch, naming the .bin they map: a read that hangs in a page fault is named as GPT samples' are; none is left
    in progress after the batch."""
    from corpusforge.storage import readwatch

    ds = RetroDataset(db, seq_length=SEQ, seed=5)
    slot = readwatch.slot_for(ds.db_bin)  # this process's own slot (other tests of a worker may share theirs)
    before = int(slot[readwatch.READS])
    ds.get_batch([0, 3])
    assert slot[readwatch.READS] == before + 2 and slot[readwatch.START] == 0
    assert slot[readwatch.NBYTES] > 0 and ds.db_bin.endswith(".bin")
    assert not [r for r in readwatch.current() if r["pid"] == os.getpid()]

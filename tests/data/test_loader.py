"""Sharding, determinism across workers, resumption (same and other world size, in a new process), loader state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from loader_data import build_blend

from corpusforge.data import LoaderStateError, PretrainingBatchSampler, make_loader

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def train(corpora, tmp_path_factory):
    return build_blend(corpora, tmp_path_factory.mktemp("cache"))[0]


def take(loader, steps: int) -> list[dict]:
    return [batch for _, batch in zip(range(steps), loader)]


def global_tokens(train, start: int, stop: int) -> np.ndarray:
    """Tokens of samples [start, stop) of the global order, read directly from the dataset."""
    return train.get_batch(np.arange(start, stop))["tokens"]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_ranks_partition_the_global_order(world):
    """Over the ranks, every full global batch is covered once, in order, with no duplicate and no gap."""
    total, mbs = 103, 4
    per_rank = [list(PretrainingBatchSampler(total, 0, mbs, r, world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    seen = [i for step in zip(*per_rank) for batch in step for i in batch]
    gb = mbs * world
    assert seen == list(range(total // gb * gb))


def test_loader_batches_are_the_rank_slices_of_global_batches(train):
    world, mbs, steps = 4, 2, 5
    per_rank = [take(make_loader(train, mbs, r, world), steps) for r in range(world)]
    got = np.concatenate([per_rank[r][s]["tokens"].numpy() for s in range(steps) for r in range(world)])
    np.testing.assert_array_equal(got, global_tokens(train, 0, steps * mbs * world))
    batch = per_rank[0][0]
    assert batch["tokens"].dtype == torch.int32 and batch["tokens"].shape == (mbs, 32)
    assert batch["loss_mask"].dtype == torch.float32 and "attention_mask" not in batch


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_same_bytes_with_0_1_4_workers(train):
    runs = [take(make_loader(train, 3, 1, 2, num_workers=w), 12) for w in (0, 1, 4)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), key


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_pin_memory_with_workers_gives_the_same_batches(train):
    """Workers send raw text; the main process assembles it straight into page-locked memory where there is an
    accelerator to pin for (and into ordinary memory where there is none, as torch's DataLoader would)."""
    plain = take(make_loader(train, 3, 0, 1), 4)
    pinned = take(make_loader(train, 3, 0, 1, num_workers=2, pin_memory=True), 4)
    for a, b in zip(plain, pinned, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert all(t.is_pinned() == torch.cuda.is_available() for t in b.values())


@pytest.mark.slow
def test_spawned_workers_read_the_same_bytes_without_copying_the_data(train):
    """With spawn, the dataset is pickled to the workers: by prefix and index paths, not as copies of the memmaps."""
    import pickle

    assert len(pickle.dumps(train)) < 64 * 1024
    direct = take(make_loader(train, 4, 0, 1), 3)
    spawned = take(make_loader(train, 4, 0, 1, num_workers=1, multiprocessing_context="spawn"), 3)
    for a, b in zip(direct, spawned, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_in_place_equals_uninterrupted(train):
    whole = take(make_loader(train, 2, 1, 3), 9)
    first = make_loader(train, 2, 1, 3)
    take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == 4 * 2 * 3
    assert len(json.dumps(state)) < 4096  # no replay log: counters and a fingerprint
    second = make_loader(train, 2, 1, 3)
    second.load_state_dict(state)
    for a, b in zip(whole[4:], take(second, 5), strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def _job(corpora, cache, tmp: Path, name: str, **kw) -> np.ndarray:
    args = [sys.executable, str(HERE / "resume_job.py"), "--corpora", ",".join(corpora), "--cache", str(cache)]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    args += ["--save", str(tmp / f"{name}.json"), "--out", str(tmp / f"{name}.npy")]
    subprocess.run(args, check=True, timeout=120)
    return np.load(tmp / f"{name}.npy")


@pytest.mark.slow
def test_resume_in_a_new_process_equals_uninterrupted(corpora, tmp_path):
    """Stop after 3 steps, save the state, rebuild everything in a fresh process, continue 4 steps."""
    cache = tmp_path / "cache"
    whole = _job(corpora, cache, tmp_path, "whole", world=2, rank=1, steps=7, workers=2)
    first = _job(corpora, cache, tmp_path, "first", world=2, rank=1, steps=3)
    second = _job(corpora, cache, tmp_path, "second", world=2, rank=1, steps=4, load=tmp_path / "first.json")
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)


def test_resume_with_fewer_ranks_continues_the_global_order(train):
    """4 ranks take 3 steps; 2 ranks load rank 0's state and go on: together they read samples 0..N in order."""
    mbs = 2
    four = [make_loader(train, mbs, r, 4) for r in range(4)]
    before = [take(loader, 3) for loader in four]
    state = four[0].state_dict()
    assert all(loader.state_dict() == state for loader in four)
    two = [make_loader(train, mbs, r, 2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    after = [take(loader, 5) for loader in two]
    got = [before[r][s]["tokens"].numpy() for s in range(3) for r in range(4)]
    got += [after[r][s]["tokens"].numpy() for s in range(5) for r in range(2)]
    n = 3 * mbs * 4 + 5 * mbs * 2
    np.testing.assert_array_equal(np.concatenate(got), global_tokens(train, 0, n))
    assert two[0].state_dict()["consumed_samples"] == n


def test_state_from_other_configuration_is_refused(corpora, tmp_path, train):
    state = make_loader(train, 2).state_dict()
    other_seed = build_blend(corpora, tmp_path, seed=99)[0]
    with pytest.raises(LoaderStateError, match=r"seed: 99 != 1234"):
        make_loader(other_seed, 2).load_state_dict(state)
    other_options = build_blend(corpora, tmp_path, eod_token_id=0, eod_mask_loss=True)[0]
    with pytest.raises(LoaderStateError, match=r"options.eod_mask_loss: True != False"):
        make_loader(other_options, 2).load_state_dict(state)


def test_state_from_other_data_is_refused(corpora, tmp_path, train):
    state = make_loader(train, 2).state_dict()
    swapped = build_blend([corpora[1], corpora[0], corpora[2]], tmp_path)[0]
    with pytest.raises(LoaderStateError, match=r"datasets\[0\]\.dataset\.lengths_sha256"):
        make_loader(swapped, 2).load_state_dict(state)

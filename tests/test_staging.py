"""storage.local_cache_staging="background": a blend read from its source while one process stages it to the local
cache tier, in the order the blend first reads it, each dataset then read from its verified copy; real files, and
the session's real CephFS."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "data"))
from loader_data import write_dataset  # noqa: E402

from corpusforge.data import build_gpt_datasets  # noqa: E402
from corpusforge.storage import StorageConfig, stage  # noqa: E402
from corpusforge.storage.stage import StagedBinReader, first_use_order, wait_for_staging  # noqa: E402

COUNT = 6


def make_blend(root: Path) -> list:
    root.mkdir(parents=True)
    prefixes = [write_dataset(root / f"s{k}_text_document", 40 + 9 * k, seed=k, max_len=120) for k in range(COUNT)]
    return [x for k, p in enumerate(prefixes) for x in (p, 1.0 + k)]


def tokens(train) -> np.ndarray:
    return train.read_raw(range(len(train))).text


def build(blend: list, cache: Path, storage: StorageConfig | None = None):
    train, _, _ = build_gpt_datasets(blend, 32, split="1", seed=3, num_samples=(200, 0, 0), cache_dir=cache,
                                     storage=storage)  # fmt: skip
    return train


@pytest.fixture
def fast_retry(monkeypatch):
    monkeypatch.setattr(stage, "RETRY_STAGER_S", 0.05)
    monkeypatch.setattr(stage, "CHECK_EVERY_S", 0.0)


@pytest.mark.slow
def test_reads_the_source_until_staged_then_the_verified_copy_in_first_use_order(tmp_path, fast_retry):
    blend = make_blend(tmp_path / "shared")
    expected = tokens(build(blend, tmp_path / "c0"))
    local = tmp_path / "local"
    local.mkdir()
    # Another process of the node is the stager (it holds the stage lock) and has copied nothing yet.
    stage_lock = local / f"stage-{stage_key(blend)}.lock"
    held = os.open(stage_lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        storage = StorageConfig(local_cache_dir=str(local), local_cache_staging="background")
        train = build(blend, tmp_path / "c1", storage)
        readers = [part.indexed.reader for part in train.datasets]
        assert all(isinstance(r, StagedBinReader) for r in readers)
        assert np.array_equal(tokens(train), expected)
        assert not any(r.local for r in readers)  # nothing staged: every read went to the source
        assert not list(local.glob("*/meta.json"))
        # A DataLoader worker's copy (pickled) reads the same way.
        copy = pickle.loads(pickle.dumps(train.datasets[0].indexed))
        assert isinstance(copy.reader, StagedBinReader)
    finally:
        os.close(held)  # that stager is gone: this process's stager takes over
    assert wait_for_staging(timeout=60)
    assert np.array_equal(tokens(train), expected)
    assert all(r.local for r in readers)  # every read after staging went to the local copies
    assert all(r.memory is not None for r in readers)  # samples gathered straight from the copies' maps
    assert all(part._direct_args() is not None for part in train.datasets)  # and the datasets take that path
    assert np.array_equal(tokens(train), expected)
    metas = [json.loads(p.read_text()) for p in local.glob("*/meta.json")]
    assert len(metas) == COUNT and all(set(m["sha256"]) == {"bin", "idx"} for m in metas)
    staged_order = [m["source"] for m in sorted(metas, key=lambda m: m["copied_at"])]
    assert staged_order == [blend[2 * d] for d in first_use_order(train.dataset_index, COUNT)]
    progress = json.loads(next(local.glob("stage-*.json")).read_text())
    assert progress["datasets_done"] == progress["datasets"] == COUNT
    assert progress["bytes_done"] == progress["bytes"] > 0
    # The copies are what is read now: the sources can go.
    shutil.rmtree(tmp_path / "shared")
    assert np.array_equal(tokens(train), expected)


def stage_key(blend: list) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(list(blend[0::2])).encode()).hexdigest()[:16]


def test_first_use_order_from_a_position():
    assert first_use_order(np.array([2, 2, 0, 1, 0]), 4) == [2, 0, 1, 3]
    assert first_use_order(np.array([2, 2, 0, 1, 0]), 4, position=3) == [1, 0, 2, 3]


def test_bad_staging_mode_is_refused_in_one_line():
    with pytest.raises(ValueError, match="local_cache_staging 'later': choose one of"):
        StorageConfig(local_cache_staging="later")


@pytest.mark.slow
@pytest.mark.ceph
def test_stages_a_blend_from_cephfs(ceph_cluster, tmp_path, fast_retry):
    shared = ceph_cluster.cephfs_mount / f"staging-{uuid.uuid4().hex[:8]}"
    blend = make_blend(shared)
    expected = tokens(build(blend, tmp_path / "c0"))
    storage = StorageConfig(local_cache_dir=str(tmp_path / "local"), local_cache_staging="background")
    train = build(blend, tmp_path / "c1", storage)
    assert np.array_equal(tokens(train), expected)
    assert wait_for_staging(timeout=60)
    assert np.array_equal(tokens(train), expected)
    assert all(part.indexed.reader.local for part in train.datasets)
    shutil.rmtree(shared)

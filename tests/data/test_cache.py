"""Index caches: named by a hash of their configuration, written atomically, built once while racers wait."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest
from loader_data import build_blend

from corpusforge.data import CacheMismatchError, IndexCache

HERE = Path(__file__).parent


def _race(corpora, cache_dir, barrier, results) -> None:
    sys.path.insert(0, str(HERE))
    from loader_data import build_blend

    barrier.wait()  # all processes ask for the same, missing cache entries at once
    datasets = build_blend(corpora, cache_dir)
    built = {}
    for split, ds in zip(("train", "valid", "test"), datasets):
        built[f"blend-{split}"] = ds.built
        for d, part in enumerate(ds.datasets):
            built[f"{d}-{split}"] = part.built
    digest = hashlib.sha256(datasets[0].get_batch(np.arange(len(datasets[0])))["tokens"].tobytes()).hexdigest()
    results.put((built, digest))


@pytest.mark.slow
def test_processes_racing_for_one_cache_build_it_once(corpora, tmp_path):
    ctx = mp.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(corpora, tmp_path, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({digest for _, digest in outcomes}) == 1  # every process reads the same samples
    for key in outcomes[0][0]:
        assert sum(built[key] for built, _ in outcomes) == 1, key  # exactly one builder per entry
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_second_build_loads_the_same_arrays(corpora, tmp_path):
    first = build_blend(corpora, tmp_path)
    second = build_blend(corpora, tmp_path)
    assert first[0].built and not second[0].built and not second[0].datasets[1].built
    np.testing.assert_array_equal(first[0].dataset_index, second[0].dataset_index)
    np.testing.assert_array_equal(first[0].datasets[2].shuffle_index, second[0].datasets[2].shuffle_index)
    for npy in tmp_path.glob("*.npy"):
        np.load(npy, allow_pickle=False)  # plain arrays, never pickles


def test_cache_name_follows_every_input(corpora, tmp_path):
    base = build_blend(corpora, tmp_path)[0]
    names = {p.name for p in tmp_path.glob("*-description.json")}
    assert not build_blend(corpora, tmp_path)[0].built
    for change in ({"seed": 5}, {"add_extra_token_to_sequence": False}):
        ds = build_blend(corpora, tmp_path, **change)[0]
        assert ds.built and ds.datasets[0].built
    assert len({p.name for p in tmp_path.glob("*-description.json")}) > len(names)
    assert base.datasets[0].description["dataset"]["lengths_sha256"]


def test_cache_written_by_another_configuration_is_refused(tmp_path):
    cache = IndexCache(tmp_path)
    arrays, built = cache.get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(3)})
    assert built
    (desc,) = tmp_path.glob("*-X-train-description.json")
    record = json.loads(desc.read_text())
    record["description"]["seed"] = 2  # as if another configuration's files had been copied under this name
    desc.write_text(json.dumps(record))
    with pytest.raises(CacheMismatchError, match=r"another configuration \(seed: 1 != 2\).*Delete the files"):
        cache.get_or_build("X-train", {"seed": 1}, lambda: {"a": np.arange(3)})


def test_no_cache_dir_builds_in_memory(corpora, tmp_path):
    train = build_blend(corpora, None)[0]
    assert train.built and len(train) == 400

"""The Grain adapter with the real grain package: its DataLoader and MapDataset over corpusforge datasets and blends
give each rank corpusforge's own loader's batches; a process killed after saving Grain's iterator state and a new
one restoring it give exactly the next batches; a state saved over other data or another layout is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_grain_data import blend, build_train, write_corpora  # noqa: E402

from corpusforge.adapters.grain import GrainSource, grain_dataset, grain_loader  # noqa: E402
from corpusforge.data import build_gpt_datasets, make_loader  # noqa: E402

JOB = Path(__file__).resolve().parent / "grain_resume_job.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return write_corpora(tmp_path_factory.mktemp("grain") / "data")


def corpusforge_batches(dataset, mbs: int, rank: int, world: int) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in batch.items()} for batch in make_loader(dataset, mbs, rank, world)]


def assert_same(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_random_transforms_get_a_generator_per_record(data):
    """grain_loader gives its records no random generator (a Philox generator a record was the sampler's main cost),
    except where the operations it is given hold a random transform, which takes one; the batches are the same."""
    import grain.python as grain

    class Seen(grain.RandomMapTransform):
        def random_map(self, element, rng):
            assert isinstance(rng, np.random.Generator)
            return {**element, "draw": np.array(rng.integers(1 << 30))}

    source = GrainSource(build_train(data), micro_batch_size=3)
    plain, drawn = list(grain_loader(source)), list(grain_loader(source, operations=[Seen()]))
    assert_same(plain, [{k: v for k, v in b.items() if k != "draw"} for b in drawn])
    assert len({int(b["draw"]) for b in drawn}) > 1  # a generator of its own for each record


@pytest.mark.parametrize("kind", ["blend", "single", "boundaries"])
def test_grain_batches_are_corpusforge_loaders(data, kind):
    """Each rank of 2, through Grain's DataLoader, its MapDataset of micro-batches and its `.batch` over sample
    records, gets exactly its corpusforge micro-batches (every field, dtype included): a weighted blend, one
    dataset, and samples with their document boundaries."""
    if kind == "single":
        dataset, _, _ = build_gpt_datasets(blend(data)[0], seq_length=32, split="90,8,2", num_samples=(150, 0, 0),
                                           cache_dir=Path(data) / "cache")  # fmt: skip
    else:
        dataset = build_train(data, **({"document_boundaries": True} if kind == "boundaries" else {}))
    for rank in range(2):
        theirs = corpusforge_batches(dataset, 3, rank, 2)
        source = GrainSource(dataset, micro_batch_size=3, dp_rank=rank, dp_world_size=2)
        assert_same(list(grain_loader(source)), theirs)
        assert_same(list(grain_dataset(source)), theirs)
        assert_same(list(grain_dataset(source, per_sample=True)), theirs)


def test_state_restored_in_process_continues_and_other_layouts_are_refused(data):
    """A DataLoader state, and a state of the iterator of a MapDataset batching sample records, restored into new
    iterators continue with the next batch; Grain itself refuses the DataLoader state for a source over other data
    (another seed) or another rank layout, since the source's repr names both."""
    train = build_train(data)
    theirs = corpusforge_batches(train, 2, 1, 2)
    source = GrainSource(train, 2, 1, 2)
    it = iter(grain_loader(source))
    for _ in range(4):
        next(it)
    state = it.get_state()
    again = iter(grain_loader(GrainSource(train, 2, 1, 2)))
    again.set_state(state)
    assert_same([next(again)], theirs[4:5])
    samples = iter(grain_dataset(source, per_sample=True).to_iter_dataset())
    for _ in range(5):
        next(samples)
    restored = iter(grain_dataset(GrainSource(train, 2, 1, 2), per_sample=True).to_iter_dataset())
    restored.set_state(samples.get_state())
    assert_same([next(restored)], theirs[5:6])
    other_data = [GrainSource(build_train(data, seed=7), 2, 1, 2), GrainSource(train, 2, 0, 2), GrainSource(train, 4)]
    others = {"DataSource in checkpoint does not match": other_data,
              "Sampler in checkpoint does not match": [GrainSource(train, 2)]}  # 200 batches, not 100  # fmt: skip
    for message, sources in others.items():
        for other in sources:
            refused = iter(grain_loader(other))
            with pytest.raises(ValueError, match=message):
                refused.set_state(state)


def test_record_out_of_range_names_the_source(data):
    source = GrainSource(build_train(data), 2, 0, 2)
    with pytest.raises(IndexError, match=r"record 200 is not in \[0, 200\) of corpusforge.GrainSource"):
        source[len(source)]


def run_job(args: list[str]) -> subprocess.Popen:
    # its own session: the kill below reaches Grain's worker processes too
    return subprocess.Popen([sys.executable, str(JOB), *args], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def kill_after_state(job: subprocess.Popen, state: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not state.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            raise AssertionError(f"no state saved: {job.communicate()[0][-3000:]}")
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    assert job.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.slow
def test_killed_process_resumed_from_grain_state_gives_the_next_batches(data, tmp_path):
    """Rank 1 of 2 through Grain's DataLoader with 2 worker processes: SIGKILLed (with its workers) after saving the
    iterator state at batch 3, while it reads on, a new process restores the state and takes batches 3..6 of
    corpusforge's own loader for that rank."""
    theirs = corpusforge_batches(build_train(data), 2, 1, 2)
    common = ["--data", data, "--rank", "1", "--world", "2", "--mbs", "2", "--kind", "loader", "--workers", "2"]
    state, out = tmp_path / "state", tmp_path / "batches.npz"
    kill_after_state(run_job([*common, "--save-at", "3", "--state-out", str(state)]), state)
    job = run_job([*common, "--state-in", str(state), "--steps", "4", "--out", str(out)])
    assert job.wait(timeout=120) == 0, job.communicate()[0][-3000:]
    got = dict(np.load(out))
    assert_same([{k: v[i] for k, v in got.items()} for i in range(4)], theirs[3:7])

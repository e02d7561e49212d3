"""Curricula (corpusforge/data/curriculum.py): the phases as configured, the samples each phase serves, and a loader
stopped before, at and after each change point and resumed (on the same or another world size) serving the samples
of the uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from corpusforge.data import GPTDataset, GPTDatasetConfig, IndexCache, make_loader
from corpusforge.data.curriculum import Curriculum, build_curriculum_dataset
from corpusforge.data.gpt_dataset import split_ranges
from corpusforge.indexed import IndexedDataset
from corpusforge.train import load_config
from corpusforge.train.config import ConfigError

L, STEP_TOKENS, STEPS = 32, 512, 8  # 16 units of 32 tokens a step
# weights change at step 3, the length at step 6; the last phase leaves source a out
PHASES = [
    {"until_step": 3, "seq_length": 16, "weights": [3, 1]},
    {"until_tokens": 6 * STEP_TOKENS, "seq_length": 16, "weights": [1, 3]},
    {"weights": [0, 1]},
]


@pytest.fixture(scope="module")
def curriculum_data(corpora, tmp_path_factory):
    cache = tmp_path_factory.mktemp("curriculum-cache")
    path = [corpora[0], 0.5, corpora[1], 0.5]
    c = Curriculum.from_table(PHASES, STEPS, STEP_TOKENS, L, path)
    return c, build_curriculum_dataset(c, corpora[:2], "90,10,0", seed=7, cache_dir=cache), cache


def test_phases_as_configured(curriculum_data):
    c, train, _ = curriculum_data
    got = [(p.start_step, p.end_step, p.seq_length, p.repeat, p.weights) for p in c.phases]
    assert got == [(0, 3, 16, 2, (0.75, 0.25)), (3, 6, 16, 2, (0.25, 0.75)), (6, 8, 32, 1, (0.0, 1.0))]
    assert len(train) == STEPS * STEP_TOKENS // L  # as many loader units as samples without a curriculum
    assert [c.locate(u) for u in (0, 47, 48, 95, 96, 127)] == [(0, 0), (0, 47), (1, 0), (1, 47), (2, 0), (2, 31)]
    with pytest.raises(IndexError):
        c.locate(128)


def test_each_phase_serves_its_blend_from_its_sources_without_repeats(curriculum_data, corpora):
    c, train, cache = curriculum_data
    for k, p in enumerate(c.phases):
        which = train.indices[k]["dataset_index"]
        n = c.units(k) * p.repeat
        counts = np.bincount(which, minlength=2)
        assert counts.sum() == n and all(abs(counts[d] - w * n) <= 1 for d, w in enumerate(p.weights))
    # within a source and a length, the phases take consecutive, distinct samples of one dataset
    for d in range(2):
        taken = np.concatenate([train.indices[k]["dataset_sample_index"][train.indices[k]["dataset_index"] == d]
                                for k in range(2)])  # fmt: skip
        assert sorted(taken.tolist()) == list(range(len(taken)))
    # and the text of a phase's row is that sample of the source's own GPTDataset (Megatron's samples)
    ds = IndexedDataset(corpora[1])
    reference = GPTDataset(ds, "train", split_ranges("90,10,0", len(ds))[0], len(train.sources[(1, 16)]),
                           GPTDatasetConfig(16, seed=7, split="90,10,0"), IndexCache(cache))  # fmt: skip
    raw = train.read_raw([50, 51])  # phase 2, units 2-3: four samples of 16 tokens
    rows = train.indices[1]["dataset_sample_index"][4:8]
    mine = raw.dataset_id == 1
    assert raw.text.shape == (4, 17) and mine.any()
    np.testing.assert_array_equal(raw.text[mine], reference.read_raw(rows[mine]).text)


def run_loader(train, world: int, steps: range, state=None, workers: int = 0) -> tuple[list, dict]:
    """The rows served in `steps` by `world` ranks of 4 units a micro-batch, in the global order; the final state."""
    loaders = [make_loader(train, 4, r, world, workers) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    rows = []
    for _ in steps:
        for _ in range(16 // (4 * world)):
            for it in its:
                batch = next(it)
                rows.append((batch["tokens"].numpy().copy(), batch.get("dataset_id")))
    return rows, loaders[0].state_dict()


def same(a: list, b: list) -> bool:
    """The same micro-batches (shapes and tokens) in the same order."""
    if len(a) != len(b) or any(x.shape != y.shape for (x, _), (y, _) in zip(a, b)):
        return False
    return all((x == y).all() for (x, _), (y, _) in zip(a, b))


def test_resume_before_at_and_after_each_change_point_on_any_world_size(curriculum_data):
    _, train, _ = curriculum_data
    whole, _ = run_loader(train, 1, range(STEPS))
    shapes = [t.shape for t, _ in whole[::4]]  # one micro-batch a step (4 of 4 units)
    assert shapes == [(8, 16)] * 6 + [(4, 32)] * 2  # 4 units: 8 samples of 16 tokens, then 4 of 32
    assert all(int(d.min()) == 1 for _, d in whole[24:])  # the last phase reads source b only
    for stop in (2, 3, 4, 5, 6, 7):  # before, at and after step 3 (weights) and step 6 (length)
        for first, then in ((1, 1), (1, 2), (2, 1)):
            head, state = run_loader(train, first, range(stop))
            assert state["consumed_samples"] == stop * 16
            tail, _ = run_loader(train, then, range(stop, STEPS), state)
            assert same(head + tail, whole), (stop, first, then)


def test_workers_assemble_every_phase_as_the_main_process(curriculum_data):
    _, train, _ = curriculum_data
    state = {**make_loader(train, 2).state_dict(), "consumed_samples": 5 * 16}  # across the length change
    direct, _ = run_loader(train, 1, range(5, 7), state)
    worked, _ = run_loader(train, 1, range(5, 7), state, workers=1)
    assert same(direct, worked)


def test_a_loader_state_of_another_curriculum_is_refused(curriculum_data, corpora, tmp_path):
    from corpusforge.data import LoaderStateError

    _, train, cache = curriculum_data
    other = Curriculum.from_table([{"until_step": 4, "seq_length": 16}, {}], STEPS, STEP_TOKENS, L, corpora[0])
    loader = make_loader(build_curriculum_dataset(other, corpora[:1], "90,10,0", seed=7, cache_dir=cache), 2)
    with pytest.raises(LoaderStateError, match="phases"):
        loader.load_state_dict(make_loader(train, 2).state_dict())


BASE = ["model.seq_length=32", "schedule.global_batch_tokens=512", "schedule.max_steps=8",
        "schedule.micro_batch_size=4", 'data.path=["a", 0.5, "b", 0.5]']  # fmt: skip


@pytest.mark.parametrize(
    "phases, words",
    [
        ("[{until_step=3}, {until_step=2}, {}]", "not after the previous phase"),
        ("[{until_step=3}, {weights=[1]}]", "gives 1 weight(s) for the 2 datasets"),
        ("[{until_step=3, seq_length=24}, {}]", "does not divide model.seq_length 32"),
        ("[{until_tokens=1000}, {}]", "use e.g. until_tokens = 1024"),
        ("[{until_step=3, until_tokens=1024}, {}]", "not both"),
        ("[{seq_length=16}, {}]", "give until_step or until_tokens"),
        ("[{until_step=3}, {until_step=5}]", "drop the last phase's until_step"),
        ("[{until_step=9}, {}]", "after schedule.max_steps 8"),
        ("[{until_stp=3}, {}]", "did you mean until_step"),
        ("[{until_step=3, weights=[0, 0]}, {}]", "not all 0"),
        ("[{until_step=3, weights=[-1, 2]}, {}]", "numbers >= 0"),
        ("[{until_step=0}, {}]", "at least 1"),
        ("[3, {}]", "expected a table"),
        ("[]", ""),  # empty: no curriculum
    ],
)
def test_each_mistake_is_one_line_naming_the_phase(phases, words):
    if not words:
        assert load_config(None, [*BASE, f"data.curriculum={phases}"]).data.curriculum == []
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, f"data.curriculum={phases}"])
    assert words in str(e.value) and "\n" not in str(e.value) and "command line: data.curriculum=" in str(e.value)


@pytest.mark.parametrize(
    "extra, words",
    [
        (['data.path="a"', "data.curriculum=[{until_step=3, weights=[1, 2]}, {}]"], "data.path is one dataset"),
        (['data.path=["a", "b"]', "data.curriculum=[{until_step=3}, {}]"], "without weights"),
        (['data.source="synthetic"', "data.curriculum=[{until_step=3}, {}]"], "not synthetic tokens"),
        (["data.curriculum=5"], "expected a list"),
        (
            ["parallel.tp=4", "data.curriculum=[{until_step=3, seq_length=2}, {}]"],
            "does not divide a phase's seq_length 2",
        ),
    ],
)
def test_what_a_curriculum_does_not_fit_is_refused(extra, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(None, [*BASE, *extra])


def test_prepare_cache_builds_what_the_run_maps(corpora, tmp_path):
    from corpusforge.data.prepare_cache import prepare_train_cache
    from corpusforge.train.data import build_data

    blend = f'data.path=["{corpora[0]}", 0.5, "{corpora[1]}", 0.5]'
    phases = "data.curriculum=[{until_step=3, seq_length=16}, {}]"
    cfg = load_config(None, [*BASE[:-1], blend, 'data.split="90,10,0"', f'out_dir="{tmp_path}"', phases])
    assert prepare_train_cache(cfg).written_files > 0
    before = sorted(p.name for p in (tmp_path / "index-cache").iterdir())
    data = build_data(cfg, 0, 1)
    assert sorted(p.name for p in (tmp_path / "index-cache").iterdir()) == before
    assert not any(ds.built for ds in data.train.dataset.sources.values()) and not data.valid.dataset.built

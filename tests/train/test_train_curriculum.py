"""Training with data.curriculum: a run stopped around the change points (blend weights at step 3, the sequence
length at step 6) and resumed, on one rank or on two, reads the samples of the uninterrupted run, and on one rank gives
its losses bit for bit; the dry run says what each source and each length gives, as the run reads it.

One 1-rank run is resumed three times in a row (before the weight change, after it, at the length change); its
checkpoint at the length change is resumed by a 2-rank torchrun, which then trains the whole run on two pipeline
stages. Each run's ranks write the tokens of each micro-batch under its first loader unit (curriculum_record.py), and
the files are compared unit by unit. The loader alone is
resumed before, at and after every change point on 1 and 2 ranks by tests/data/test_curriculum.py (a training run
costs seconds here, a loader milliseconds).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import trainkit
from curriculum_record import load, record_samples, save

from corpusforge.train import CheckpointError, load_config, train
from corpusforge.train.metrics import read_metrics

pytestmark = pytest.mark.slow  # the module's runs: 42 s on 2 shared cores at load 6-8 (2026-11-28)

STEPS = 8
PHASES = "[{until_step=3, seq_length=16, weights=[3, 1]}, {until_tokens=3072, seq_length=16, weights=[1, 3]}, {}]"
STOPS = (2, 4, 6)  # before and after the weights' change point, at the length's


def overrides(corpora: list[str], out_dir: Path, cache: Path, *extra: str) -> list[str]:
    base = trainkit.tiny_overrides(corpora[0], out_dir, max_steps=STEPS, eval_interval=0, checkpoint_interval=0)
    base.append("model.n_layer=2")  # two pipeline stages can cut it
    blend = f'data.path=["{corpora[0]}", 0.5, "{corpora[1]}", 0.5]'
    return [*base, blend, f"data.curriculum={PHASES}", f'data.cache_dir="{cache}"', *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The work directory: whole/ (8 steps), chain/ (stopped and resumed at each of STOPS), at-6/ (the chain's
    checkpoint of step 6 resumed by 2 ranks), pp2/ (the whole run on two pipeline stages) and the dry run's report."""
    work = tmp_path_factory.mktemp("curriculum")
    corpora = [trainkit.write_markov_corpus(work / "a_text_document"),
               trainkit.write_markov_corpus(work / "b_text_document", seed=1)]  # fmt: skip
    cache = work / "cache"
    store = record_samples()
    quiet = lambda line: None  # noqa: E731
    report = train(load_config(None, overrides(corpora, work / "dry", cache)), dry_run=True, log=quiet)
    train(load_config(None, overrides(corpora, work / "whole", cache)), log=quiet)
    save(store, work / "whole", "whole")
    chain = work / "chain"
    for stop in (*STOPS, STEPS):
        train(load_config(None, overrides(corpora, chain, cache, f"schedule.stop_at_step={stop}")), log=quiet)
        save(store, chain, f"to{stop}")
        if stop == 6:  # the length's change point: resumed by 2 ranks too
            step = chain / "checkpoints" / f"step_{stop:08d}"
            shutil.copytree(step, work / f"at-{stop}" / "checkpoints" / step.name)
    pp2 = [*overrides(corpora, work / "pp2", cache), "parallel.pp=2", "parallel.dp_replicate=1"]
    launch = [overrides(corpora, work / "at-6", cache), pp2]
    spec = work / "runs.json"
    spec.write_text(__import__("json").dumps(launch))
    script = Path(__file__).resolve().parent / "curriculum_record.py"
    trainkit._launch([str(script), str(spec)], 2, 240, True, "torchrun 2 (curriculum resumes)")
    return work, report, corpora, cache


def series(out_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out_dir / "metrics.jsonl", "train")}


def same_units(a: dict, b: dict, units: range) -> None:
    keys = sorted(k for k in a if k in units)
    assert keys and keys == sorted(k for k in b if k in units)
    for k in keys:
        assert a[k][0].shape == b[k][0].shape and (a[k][0] == b[k][0]).all(), f"unit {k}"


def test_one_rank_resumed_around_the_change_points_reads_and_learns_as_the_whole_run(runs):
    work = runs[0]
    whole, chain = load(work / "whole"), load(work / "chain")
    assert sorted(whole) == list(range(0, STEPS * 16, 8))  # 8 units a micro-batch, 2 a step
    assert [whole[u][0].shape for u in range(0, STEPS * 16, 16)] == [(16, 16)] * 6 + [(8, 32)] * 2
    same_units(whole, chain, range(STEPS * 16))
    assert series(work / "whole") == series(work / "chain")  # exact floats
    assert series(work / "whole", "grad_norm") == series(work / "chain", "grad_norm")


def test_two_ranks_resumed_at_the_length_change_read_the_whole_runs_samples(runs):
    work = runs[0]
    whole = load(work / "whole")
    for stop in (6,):
        resumed = load(work / f"at-{stop}")
        assert min(resumed) == stop * 16  # a 2-rank run from the 1-rank checkpoint of step `stop`
        same_units(whole, resumed, range(stop * 16, STEPS * 16))
        a, b = series(work / "whole"), series(work / f"at-{stop}")
        assert sorted(b) == list(range(stop + 1, STEPS + 1))
        assert all(abs(a[s] - b[s]) < 1e-4 * abs(a[s]) for s in b)  # DDP's mean of two ranks: not bit for bit


def test_two_pipeline_stages_train_through_the_length_change_as_one_process(runs):
    """The stages' schedule infers the activations' shape at its first step; the length phase changes it (16 x 16,
    then 8 x 32), and the run goes on with the whole run's samples and losses (fp32 on CPU: the same up to the
    order of the gradient sums)."""
    work = runs[0]
    same_units(load(work / "whole"), load(work / "pp2"), range(STEPS * 16))
    a, b = series(work / "whole"), series(work / "pp2")
    assert sorted(b) == list(range(1, STEPS + 1)) and b == pytest.approx(a, rel=1e-5)


def test_the_dry_run_says_what_each_source_and_length_gives(runs):
    work, report = runs[:2]
    whole = load(work / "whole")
    per_source, per_length = [0, 0], {}
    for tokens, source in whole.values():
        s = tokens.shape[1]
        per_length[str(s)] = per_length.get(str(s), 0) + tokens.size
        for d in (0, 1):
            per_source[d] += int((source == d).sum()) * s
    got = report["curriculum"]
    assert list(got["tokens_per_source"].values()) == per_source
    assert got["tokens_per_seq_length"] == per_length == {"16": 6 * 512, "32": 2 * 512}
    assert [p["steps"] for p in got["phases"]] == [[1, 3], [4, 6], [7, 8]]
    assert got["phases"][2]["tokens_per_source"] == [512, 512]  # data.path's weights
    assert np.isclose(got["phases"][0]["tokens_per_source"][0], 0.75 * 3 * 512, atol=16)


def test_a_checkpoint_of_another_curriculum_is_refused_in_one_line(runs):
    work, _, corpora, cache = runs
    other = PHASES.replace("until_step=3", "until_step=2")
    with pytest.raises(CheckpointError) as e:
        train(load_config(None, [*overrides(corpora, work / "chain", cache), f"data.curriculum={other}"]))
    assert "cannot resume" in str(e.value) and "data.curriculum=" in str(e.value) and "\n" not in str(e.value)

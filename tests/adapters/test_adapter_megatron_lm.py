"""corpusforge's datasets in Megatron-LM's data path (corpusforge.adapters.megatron_lm), against megatron-core's
own GPTDataset / BlendedDataset built by its BlendedMegatronDatasetBuilder on the same files and arguments.

The consumers run here are those of Megatron-LM's train path that the megatron-core package holds, with what
Megatron-LM's own code does around them: a torch DataLoader with the default collate and Megatron's pretraining
sampler (megatron/training/datasets/data_samplers.py is not in the package; corpusforge's PretrainingBatchSampler
is its equivalent, tested against its semantics in tests/data/test_loader.py), megatron.core.rerun_state_machine's
RerunDataIterator and megatron.core.utils.get_batch_on_this_cp_rank (context-parallel size 1 here; size 2 with 2
data-parallel ranks under a 4-rank torchrun, megatron-core's parallel_state groups made on gloo). Not run:
megatron/training (pretrain(), get_batch_on_this_tp_rank's broadcast), which needs GPUs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from adapter_harness import (
    KILL_AFTER,
    MBS,
    SEQ,
    STEPS,
    assert_resumed_exactly,
    finish_job,
    killed_and_resumed,
    make_corpora,
    start_job,
    torchrun_job,
)

from corpusforge.adapters.megatron_lm import build_datasets, build_datasets_from_args
from corpusforge.errors import ArgumentError

mgpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
mbuilder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
import megatron_lm_job as job  # noqa: E402  (after importorskip: it imports megatron-core)


@pytest.fixture(autouse=True)
def _single_process_rank(monkeypatch):
    """megatron-core's BlendedDataset asks torch.distributed for the rank even without a process group."""
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    return make_corpora(tmp_path_factory.mktemp("corpora"))


def split_of(dataset):
    """The split build_pretraining_data_loader (data_samplers.py) reads of a dataset to pick its batch sizes."""
    if hasattr(dataset, "split"):
        return dataset.split
    return getattr(dataset, "index_split", None)


def assert_same_batches(ours, theirs, **loader) -> int:
    """Every batch of Megatron-LM's iterator equal in keys, dtypes, shapes and values; returns how many."""
    mine, reference = list(job.batches(ours, **loader)), list(job.batches(theirs, **loader))
    assert len(mine) == len(reference)
    for step, (a, b) in enumerate(zip(mine, reference)):
        assert list(a) == list(b), f"batch {step}: keys"
        for key in b:
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), f"batch {step}, {key}"
            assert bool((a[key] == b[key]).all()), f"batch {step}, {key}: values differ"
    return len(mine)


CASES = {
    "blend": ({}, (60, 12, 6), None),
    "one dataset, masks, pad": (
        {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True},
        (50, 10, 4),
        7,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_batches_as_megatron_core(tmp_path, corpora, case):
    """Each split: same len and index_split; for 2 data-parallel ranks, from the start and from a resume point, the
    same batches out of Megatron-LM's iterator and get_batch_on_this_cp_rank."""
    changes, sizes, pad = CASES[case]
    if case != "blend":
        changes = {**changes, "data_path": [corpora[0]]}
    args = job.megatron_args(corpora, str(tmp_path / "ours"), **{"split": "80,15,5", **changes})
    ours = build_datasets_from_args(args, sizes, job.Tokenizer(pad))
    theirs = job.megatron_core_datasets(args, sizes, job.Tokenizer(pad), tmp_path / "megatron")
    compared = 0
    for mine, reference in zip(ours, theirs):
        assert (mine is None) == (reference is None)
        if mine is None:
            continue
        assert (len(mine), split_of(mine)) == (len(reference), split_of(reference))
        for rank in (0, 1):
            for consumed in (0, 2 * MBS * 2):
                compared += assert_same_batches(mine, reference, consumed=consumed, rank=rank, world=2)
    assert compared >= 6


def test_workers_give_the_same_batches(tmp_path, corpora):
    """Sent to DataLoader worker processes (pickled), the datasets give the batches they give in this process."""
    train = build_datasets_from_args(job.megatron_args(corpora, str(tmp_path)), [24, 0, 0], job.TOKENIZER)[0]
    with_workers, here = list(job.batches(train, 0, workers=2)), list(job.batches(train, 0))
    assert len(with_workers) == len(here) == 12
    for a, b in zip(with_workers, here):
        assert list(a) == list(b) and all(bool((a[k] == b[k]).all()) and a[k].dtype == b[k].dtype for k in a)


def test_not_built_on_rank_builds_nothing(tmp_path, corpora):
    cache = tmp_path / "cache"
    built = build_datasets([10, 0, 0], corpora[0], 16, cache_dir=cache, is_built_on_rank=lambda: False)
    assert built == (None, None, None)
    assert not cache.exists()


@pytest.mark.parametrize(
    "flag", ["mock_data", "sft", "fim_data", "train_data_path", "per_split_data_args_path", "hybrid_context_parallel"]
)
def test_options_it_does_not_build_are_refused(tmp_path, corpora, flag):
    args = job.megatron_args(corpora, str(tmp_path / "cache"), **{flag: True if flag != "train_data_path" else ["x"]})
    with pytest.raises(ArgumentError, match=f"--{flag.replace('_', '-')}"):
        build_datasets_from_args(args, [10, 0, 0], job.TOKENIZER)
    assert not (tmp_path / "cache").exists()


def test_no_data_path_is_refused(tmp_path, corpora):
    with pytest.raises(ArgumentError, match="--data-path"):
        build_datasets_from_args(job.megatron_args(corpora, str(tmp_path), data_path=None), [10, 0, 0], job.TOKENIZER)


@pytest.mark.slow
def test_resume_after_kill_continues_with_the_next_batch(tmp_path, corpora):
    """Megatron-LM's loop killed with SIGKILL after its checkpoint at step KILL_AFTER, restarted from that
    checkpoint's consumed samples: exactly the uninterrupted run's next batches, which are corpusforge's own
    loader's."""
    from corpusforge.data import make_loader

    cache = tmp_path / "cache"
    uninterrupted, before, after = killed_and_resumed("megatron_lm_job.py", job.main, corpora, cache, tmp_path)
    assert_resumed_exactly(uninterrupted, before, after, KILL_AFTER)
    train = build_datasets_from_args(job.megatron_args(corpora, str(cache)), [len(uninterrupted) * MBS, 0, 0],
                                     job.TOKENIZER)[0]  # fmt: skip
    own = [batch["tokens"].numpy() for _, batch in zip(range(len(uninterrupted)), make_loader(train.dataset, MBS))]
    np.testing.assert_array_equal(np.stack([uninterrupted[s] for s in sorted(uninterrupted)]), np.stack(own))


@pytest.mark.slow
def test_context_parallel_2_slices_the_same_batches(tmp_path, corpora):
    """Under a 4-rank torchrun (gloo), megatron-core's initialize_model_parallel(context_parallel_size=2) (2
    data-parallel ranks of 4 ranks), and the batches Megatron-LM's get_batch takes (get_batch_on_this_tp_rank's
    keys) of each data-parallel rank's micro-batches, sliced by get_batch_on_this_cp_rank: on each rank
    corpusforge's slices equal megatron-core's own dataset's (keys, dtypes, shapes, values), and are chunks r and
    3 - r of 4 along the sequence (the attention mask's rows) of corpusforge's 2-rank loader's batch for its
    data-parallel rank, r its context-parallel rank; resumed from the consumed samples of a checkpoint after step
    KILL_AFTER, each rank's slices are those of steps KILL_AFTER + 1.., the global order continued."""
    world, out = 4, tmp_path / "out"
    dp = world // 2
    resume_at = KILL_AFTER * MBS * dp  # consumed_train_samples after step KILL_AFTER
    command = torchrun_job("megatron_lm_job.py", world, "--context-parallel", "2", "--corpora", ",".join(corpora),
                           "--cache", str(tmp_path / "cache"), "--out", str(out),
                           "--resume-at", str(resume_at))  # fmt: skip
    finish_job(start_job(command, tmp_path / "cp.log"), tmp_path / "cp.log", timeout=300)
    args = job.megatron_args(corpora, str(tmp_path / "cache"), reset_position_ids=True, eod_mask_loss=True)
    train = build_datasets_from_args(args, [STEPS * MBS * dp, 0, 0], job.TOKENIZER)[0]
    chunk, layout = SEQ // 4, set()
    for rank in range(world):
        mine = out / f"rank-{rank}"
        ranks = json.loads((mine / "ranks.json").read_text())
        assert (ranks["cp_size"], ranks["dp_size"]) == (2, dp), ranks
        layout.add((ranks["dp_rank"], ranks["cp_rank"]))
        # context-parallel size 1 here: the whole sequence of the rank's data-parallel micro-batches
        whole = list(job.batches(train, 0, rank=ranks["dp_rank"], world=dp, keys=job.TP_KEYS))
        assert len(whole) == STEPS
        r = ranks["cp_rank"]
        chunks = slice(r * chunk, (r + 1) * chunk), slice((3 - r) * chunk, (4 - r) * chunk)
        resumed = sorted({int(p.name.split("-")[1]) for p in mine.glob("resumed-*.npy")})
        assert resumed == list(range(KILL_AFTER + 1, STEPS + 1)), f"rank {rank}: resumed steps"
        for step, batch in enumerate(whole, start=1):
            for key in job.TP_KEYS:
                ours, theirs = (np.load(mine / f"{side}-{step:04d}-{key}.npy") for side in ("ours", "theirs"))
                where = f"rank {rank} (dp {ranks['dp_rank']}, cp {r}) step {step} {key}"
                assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
                np.testing.assert_array_equal(ours, theirs, err_msg=where)
                full = batch[key].numpy()
                axis = 2 if key == "attention_mask" else 1  # (B, 1, S, S): its query rows
                expected = np.concatenate([np.take(full, range(c.start, c.stop), axis=axis) for c in chunks], axis)
                np.testing.assert_array_equal(ours, expected, err_msg=f"{where}: not its chunks")
                if step > KILL_AFTER:
                    np.testing.assert_array_equal(np.load(mine / f"resumed-{step:04d}-{key}.npy"), ours, where)
    assert layout == {(d, c) for d in range(dp) for c in range(2)}, "each (dp, cp) rank once"

"""corpusforge's samples in the real transformers.Trainer (corpusforge.adapters.hf_trainer): the batches the model
receives are corpusforge's own loader's, and a run killed with SIGKILL after a checkpoint and resumed from it
trains exactly the uninterrupted run's next batches."""

from __future__ import annotations

import numpy as np
import pytest
from adapter_harness import KILL_AFTER, MBS, assert_resumed_exactly, killed_and_resumed, make_corpora

from corpusforge.adapters.hf_trainer import (
    IGNORE_INDEX,
    TRAINING_ARGUMENTS,
    TrainerSamples,
    check_training_arguments,
    collate_rows,
)
from corpusforge.data import build_gpt_datasets, make_loader
from corpusforge.errors import ArgumentError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hf_trainer_job as job  # noqa: E402


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    return make_corpora(tmp_path_factory.mktemp("corpora"))


def own_batches(train, steps: int) -> list[dict]:
    """corpusforge's own loader's first `steps` micro-batches, as numpy."""
    return [{k: v.numpy() for k, v in b.items()} for _, b in zip(range(steps), make_loader(train, MBS))]


def test_samples_are_the_loaders_in_the_trainers_collate(tmp_path, corpora):
    """Through a DataLoader with transformers' default_data_collator (what the Trainer uses without a tokenizer):
    input_ids the loader's tokens, labels and shift_labels its labels with IGNORE_INDEX where its loss mask is 0."""
    import torch

    train, _, _ = build_gpt_datasets(corpora[0], 32, "1", 3, (40, 0, 0), tmp_path, eod_token_id=0,
                                     eod_mask_loss=True, reset_position_ids=True)  # fmt: skip
    loader = torch.utils.data.DataLoader(
        TrainerSamples(train), batch_size=MBS, collate_fn=transformers.default_data_collator
    )
    steps = len(train) // MBS
    theirs = list(loader)[:steps]
    for step, (got, own) in enumerate(zip(theirs, own_batches(train, steps))):
        assert sorted(got) == ["input_ids", "labels", "position_ids", "shift_labels"]
        assert all(v.dtype == torch.int64 and tuple(v.shape) == (MBS, 32) for v in got.values())
        expected = np.where(own["loss_mask"] > 0, own["labels"], IGNORE_INDEX)
        np.testing.assert_array_equal(got["input_ids"].numpy(), own["tokens"], err_msg=f"step {step}")
        np.testing.assert_array_equal(got["labels"].numpy(), expected, err_msg=f"step {step}")
        np.testing.assert_array_equal(got["shift_labels"].numpy(), expected, err_msg=f"step {step}")
        np.testing.assert_array_equal(got["position_ids"].numpy(), own["position_ids"], err_msg=f"step {step}")
    assert (np.concatenate([b["labels"].numpy() for b in theirs]) == IGNORE_INDEX).any()  # masked targets seen
    with pytest.raises(IndexError):
        TrainerSamples(train)[len(train)]


def test_collate_rows_gives_the_default_collators_batches(tmp_path, corpora):
    """The rows of one read handed back without a copy; rows of several reads, or reordered, stacked as
    transformers' default_data_collator stacks them (the same values either way)."""
    train, _, _ = build_gpt_datasets(corpora[1], 32, "1", 3, (40, 0, 0), tmp_path, eod_token_id=0, eod_mask_loss=True)
    samples = TrainerSamples(train)
    one_read = samples.__getitems__([4, 5, 6])
    mixed = samples.__getitems__([4, 5]) + samples.__getitems__([6])
    for rows in (one_read, mixed, one_read[::-1]):
        got, expected = collate_rows(rows), transformers.default_data_collator(rows)
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert got[key].dtype == expected[key].dtype and bool((got[key] == expected[key]).all()), key
    shared = collate_rows(one_read)["input_ids"]
    assert shared.data_ptr() == one_read[0]["input_ids"].data_ptr()  # no copy
    assert collate_rows(mixed)["input_ids"].data_ptr() != mixed[0]["input_ids"].data_ptr()


@pytest.mark.parametrize("change", list(TRAINING_ARGUMENTS))
def test_arguments_that_would_reorder_or_drop_are_refused(tmp_path, change):
    wrong = {"train_sampling_strategy": "random", "remove_unused_columns": True, "dataloader_drop_last": False}
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[],
                                          **{**TRAINING_ARGUMENTS, change: wrong[change]})  # fmt: skip
    with pytest.raises(ArgumentError, match=change):
        check_training_arguments(args)


@pytest.mark.slow
def test_killed_after_checkpoint_resumes_with_the_next_batch(tmp_path, corpora):
    """A tiny Llama trained by the real Trainer; the model's inputs at each step equal corpusforge's own loader's
    batches (tokens and next-token targets); killed with SIGKILL after the checkpoint at step KILL_AFTER and
    resumed with resume_from_checkpoint, it trains the uninterrupted run's steps after it and no other."""
    uninterrupted, before, after = killed_and_resumed("hf_trainer_job.py", job.main, corpora, tmp_path / "cache",
                                                      tmp_path)  # fmt: skip
    assert_resumed_exactly(uninterrupted, before, after, KILL_AFTER)
    own = own_batches(job.train_dataset(corpora, str(tmp_path / "cache")), len(uninterrupted))
    for step, batch in enumerate(own, start=1):
        np.testing.assert_array_equal(uninterrupted[step][0], batch["tokens"], err_msg=f"step {step} tokens")
        np.testing.assert_array_equal(uninterrupted[step][1], batch["labels"], err_msg=f"step {step} targets")

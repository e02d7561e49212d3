"""corpusforge's samples in the real transformers.Trainer (corpusforge.adapters.hf_trainer): the batches the model
receives are corpusforge's own loader's, and a run killed with SIGKILL after a checkpoint and resumed from it
trains exactly the uninterrupted run's next batches. Under torchrun, 2 DDP ranks on gloo read exactly corpusforge's
2-rank loader's samples (each its slice of every global batch, none twice, none skipped), and ranks SIGKILLed after
a checkpoint resume with the next global batch and the uninterrupted run's losses; a resume at another number of
ranks continues the global order where a step keeps its number of samples, and is refused where it does not."""

from __future__ import annotations

import json

import numpy as np
import pytest
from adapter_harness import (
    KILL_AFTER,
    MBS,
    STEPS,
    assert_resumed_exactly,
    killed_and_resumed,
    make_corpora,
    marked_workers,
    rank_records,
    reads_of,
    recorded,
    two_ranks_killed_and_resumed,
)

from corpusforge.adapters.hf_trainer import (
    IGNORE_INDEX,
    TRAINING_ARGUMENTS,
    TrainerSamples,
    check_training_arguments,
    collate_rows,
)
from corpusforge.data import LoaderStateError, PretrainingBatchSampler, build_gpt_datasets, make_loader
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


def test_accelerates_shards_are_the_loaders_ranks_to_the_last_global_batch():
    """What the Trainer's DataLoader becomes on each of 2 ranks (its sequential sampler batched with drop_last, in
    accelerate's BatchSamplerShard): corpusforge's sampler's micro-batches for that rank, the last incomplete global
    batch dropped (not filled from the first samples), for sizes that leave 0, 1 and 3 samples over."""
    import torch
    from accelerate.data_loader import BatchSamplerShard

    for total in (8, 9, 11):
        for rank in range(2):
            batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(total)), MBS, True)
            theirs = list(BatchSamplerShard(batches, num_processes=2, process_index=rank))
            assert theirs == list(PretrainingBatchSampler(total, 0, MBS, rank, 2)), f"{total} samples, rank {rank}"


def test_the_loader_state_callback_needs_trainer_samples(tmp_path, corpora):
    """LoaderStateCallback over a train_dataset that is not TrainerSamples (it could keep no loader state): refused
    in one line before a step."""
    from corpusforge.adapters.hf_trainer import LoaderStateCallback

    train, _, _ = build_gpt_datasets(corpora[0], 32, "1", 3, (8, 0, 0), tmp_path, eod_token_id=0)
    rows = [TrainerSamples(train)[i] for i in range(len(train))]  # the same samples, as a plain list
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32)  # fmt: skip
    args = transformers.TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=MBS, max_steps=1,
                                          use_cpu=True, report_to=[], **TRAINING_ARGUMENTS)  # fmt: skip
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=rows,
                                   callbacks=[LoaderStateCallback()])  # fmt: skip
    with pytest.raises(ArgumentError, match="train_dataset is a list: pass TrainerSamples"):
        trainer.train()


@pytest.mark.parametrize("change", list(TRAINING_ARGUMENTS))
def test_arguments_that_would_reorder_or_drop_are_refused(tmp_path, change):
    wrong = {
        "train_sampling_strategy": "random",
        "remove_unused_columns": True,
        "dataloader_drop_last": False,
        "ignore_data_skip": True,
    }
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


# 2 ranks under torchrun: one launch of 2 ranks (2 DataLoader workers each) is SIGKILLed after its checkpoint at
# KILL_AFTER; a second runs, in turn, the uninterrupted 2-rank run (no workers) and the killed run resumed by 2 ranks
# (2 workers each, once the first launch is killed). The
# 2-rank checkpoint is resumed by 1 rank here. (Each launch costs ~7 s of CPU a rank to import transformers' Trainer:
# the resume at another number of ranks is tested 2 -> 1 only, in this process.)


ACCELERATE_OPTIONS = ["split_batches", "split_batches,dispatch_batches"]
"""accelerator_config options under which the Trainer gives corpusforge's samples and resumes exactly."""


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_two_ranks")
    base = ["--corpora", ",".join(corpora), "--cache", str(root / "cache")]
    job.train_dataset(corpora, str(root / "cache"))  # the index caches, built once before the ranks read them
    one_rank = root / "one_rank"  # 1 rank of twice the micro-batch: the same samples a step as 2 ranks
    one_at_two = ["--out", str(root / "one_at_two"), "--resume-from", str(one_rank / "run/checkpoint-4")]
    killed_checkpoint = str(root / "killed" / "run" / f"checkpoint-{KILL_AFTER}")
    accelerate = [  # a global batch of 4 cut in 2 a rank, from the start and from the SIGKILLed run's checkpoint
        [*run, "--batch", "4", "--accelerate", options]
        for options in ACCELERATE_OPTIONS
        for run in (["--out", str(root / options)], ["--out", str(root / f"{options}-resumed"),
                                                     "--resume-from", killed_checkpoint])
    ]  # fmt: skip
    refused = ["--accelerate", "dispatch_batches", "--out", str(root / "dispatch_alone"), "--expect-refusal"]
    before = two_ranks_killed_and_resumed(
        "hf_trainer_job.py",
        base,
        root,
        then=[one_at_two, *accelerate, refused],
        meanwhile=lambda: job.main([*base, "--out", str(one_rank), "--batch", "4"]),
        killed_args=["--workers", "2"],  # the killed run and its resume read with 2 DataLoader workers a rank
    )
    return root, base, before


def own_rank_batches(train, rank: int) -> list[dict]:
    """corpusforge's own 2-rank loader's batches for `rank`, as numpy."""
    loader = make_loader(train, MBS, rank, 2)
    return [{k: v.numpy() for k, v in b.items()} for _, b in zip(range(STEPS), loader)]


def own_rank_ids(train, rank: int, consumed: int = 0, steps: int = STEPS) -> list[int]:
    sampler = PretrainingBatchSampler(len(train), consumed, MBS, rank, 2)
    return [i for _, ids in zip(range(steps), sampler) for i in ids]


@pytest.mark.slow
def test_two_ranks_read_the_loaders_global_order(runs, corpora):
    """Each DDP rank trains on corpusforge's 2-rank loader's batches for that rank (tokens and targets) and reads
    only those samples; together the ranks read the global order once, none twice, none skipped."""
    root, _, _ = runs
    train = job.train_dataset(corpora, str(root / "cache"))
    steps = rank_records(root / "uninterrupted")
    for rank in range(2):
        assert sorted(steps[rank]) == list(range(1, STEPS + 1))
        for step, own in enumerate(own_rank_batches(train, rank), start=1):
            np.testing.assert_array_equal(steps[rank][step][0], own["tokens"], err_msg=f"rank {rank} step {step}")
            np.testing.assert_array_equal(steps[rank][step][1], own["labels"], err_msg=f"rank {rank} step {step}")
        reads = reads_of(root / "uninterrupted" / f"rank-{rank}")
        assert [i for _, ids in reads for i in ids] == own_rank_ids(train, rank), f"rank {rank}'s reads"
        assert len({pid for pid, _ in reads}) == 1, "read by the rank itself, without workers"
    both = [i for r in range(2) for _, ids in reads_of(root / "uninterrupted" / f"rank-{r}") for i in ids]
    assert sorted(both) == list(range(STEPS * MBS * 2))


@pytest.mark.slow
def test_two_ranks_killed_resume_with_the_next_global_batch(runs, corpora):
    """Both ranks, reading with dataloader_num_workers=2, SIGKILLed after the checkpoint at KILL_AFTER (their ranks
    blocked there, their 2 workers each fetching ahead; the workers end too); resumed by 2 ranks of 2 workers with
    resume_from_checkpoint, each trains exactly the uninterrupted run's (no workers) next batches with its losses,
    bit for bit, and its workers read only those samples (the trained ones are skipped without a read). The
    checkpoint counts the samples trained, not those fetched."""
    root, _, before = runs
    train = job.train_dataset(corpora, str(root / "cache"))
    uninterrupted, after = rank_records(root / "uninterrupted"), rank_records(root / "killed")
    losses, resumed_losses = rank_records(root / "uninterrupted", "loss"), rank_records(root / "killed", "loss")
    for rank in range(2):
        assert_resumed_exactly(uninterrupted[rank], before[rank], after[rank], KILL_AFTER)
        assert sorted(resumed_losses[rank]) == list(range(KILL_AFTER + 1, STEPS + 1))
        for step, loss in resumed_losses[rank].items():
            assert loss == losses[rank][step], f"rank {rank} step {step}: loss {loss} != {losses[rank][step]}"
        # read by the rank's 2 DataLoader workers, a micro-batch each in turn (their lines in any order)
        reads = reads_of(root / "killed" / f"rank-{rank}")
        expected = own_rank_ids(train, rank, KILL_AFTER * MBS * 2, STEPS - KILL_AFTER)
        assert sorted(ids for _, ids in reads) == [expected[k : k + MBS] for k in range(0, len(expected), MBS)]
        assert len({pid for pid, _ in reads}) == 2, f"rank {rank}: read by {len({p for p, _ in reads})} processes"
        saved = json.loads((root / "killed" / "run" / f"checkpoint-{KILL_AFTER}" / "trainer_state.json").read_text())
        loader_state = saved["stateful_callbacks"]["LoaderStateCallback"]["args"]["loader_state"]
        assert loader_state["consumed_samples"] == KILL_AFTER * MBS * 2, "the checkpoint counts the samples trained"
        assert len(marked_workers(root / "killed" / f"rank-{rank}" / "checkpointed")) == 2, "workers at the kill"


def global_steps(per_rank: list[dict]) -> dict[int, np.ndarray]:
    """{step: the global batch's tokens}: the ranks' micro-batches in rank order."""
    return {s: np.concatenate([r[s][0] for r in per_rank]) for s in per_rank[0]}


def global_losses(per_rank: list[dict]) -> dict[int, float]:
    """{step: the global batch's mean loss}: the ranks' losses added, since a rank's model divides its loss by the
    global batch's target count (transformers' average_tokens_across_devices)."""
    return {s: float(np.sum([r[s] for r in per_rank])) for s in per_rank[0]}


@pytest.mark.slow
def test_a_resume_at_another_number_of_ranks_continues_the_global_order(runs, tmp_path):
    """The 2-rank checkpoint resumed by 1 rank of twice their micro-batch (the same samples a step) trains the
    global batches the uninterrupted 2-rank run trains next, with its losses (to float rounding: one batch's
    gradient instead of the ranks' averaged)."""
    root, base, _ = runs
    job.main([*base, "--out", str(tmp_path), "--resume-from", str(root / "killed/run/checkpoint-4"), "--batch", "4"])
    uninterrupted = global_steps(rank_records(root / "uninterrupted"))
    resumed = recorded(tmp_path)
    assert sorted(resumed) == list(range(KILL_AFTER + 1, STEPS + 1))
    for step, tokens in resumed.items():
        np.testing.assert_array_equal(tokens[0], uninterrupted[step], err_msg=f"2 -> 1 rank, step {step}")
    losses = global_losses(rank_records(root / "uninterrupted", "loss"))
    for step, loss in recorded(tmp_path, "loss").items():
        assert float(loss[0]) == pytest.approx(losses[step], rel=1e-5), f"2 -> 1 rank, step {step}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, refusal",
    [
        (["--batch", "2"], "checkpoint-4 consumed 16 samples in 4 steps, 4 a step; a step here takes 2"),
        (["--batch", "4", "--seed", "6"], "checkpoint-4: the loader state was saved for other data"),
    ],
)
def test_a_resume_that_would_not_continue_the_global_order_is_refused(runs, tmp_path, change, refusal):
    """The 2-rank checkpoint resumed by 1 rank of the same micro-batch (the Trainer would skip 8 samples, not the
    16 trained), or over data of another seed: refused in one line naming the checkpoint, before a step."""
    root, base, _ = runs
    with pytest.raises(LoaderStateError, match=refusal):
        job.main([*base, "--out", str(tmp_path), "--resume-from", str(root / "killed/run/checkpoint-4"), *change])
    assert not recorded(tmp_path)


@pytest.mark.slow
def test_a_1_rank_checkpoint_resumed_by_2_ranks_continues_the_global_order(runs):
    """A 1-rank run of micro-batch 4, resumed from its checkpoint at step 4 by 2 ranks of micro-batch 2 (the same
    samples a step): each rank trains what the uninterrupted 2-rank run trains at steps 5.., with its losses."""
    root, _, _ = runs
    uninterrupted, resumed = rank_records(root / "uninterrupted"), rank_records(root / "one_at_two")
    losses, resumed_losses = rank_records(root / "uninterrupted", "loss"), rank_records(root / "one_at_two", "loss")
    for rank in range(2):
        assert sorted(resumed[rank]) == list(range(KILL_AFTER + 1, STEPS + 1))
        for step, tokens in resumed[rank].items():
            np.testing.assert_array_equal(tokens, uninterrupted[rank][step], err_msg=f"1 -> 2, rank {rank} step {step}")
    one_rank = global_losses(resumed_losses)
    for step, loss in global_losses(losses).items():
        if step > KILL_AFTER:
            assert one_rank[step] == pytest.approx(loss, rel=1e-5), f"1 -> 2 ranks, step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("options", ACCELERATE_OPTIONS)
def test_split_and_dispatch_batches_train_the_loaders_batches_and_resume(runs, corpora, options):
    """accelerator_config split_batches (each rank reads its half of a global batch of per_device_train_batch_size
    4), and split_batches with dispatch_batches (rank 0 reads the global batch and broadcasts it; each rank trains
    its half), under 2 ranks: each rank trains exactly corpusforge's 2-rank loader's batches with the uninterrupted
    default run's losses, bit for bit; the default run's SIGKILLed checkpoint resumed so trains steps 5 and 6 as
    the uninterrupted run does, reading only their samples."""
    root, _, _ = runs
    train = job.train_dataset(corpora, str(root / "cache"))
    uninterrupted, losses = rank_records(root / "uninterrupted"), rank_records(root / "uninterrupted", "loss")
    dispatched = "dispatch_batches" in options
    for run, first in ((options, 1), (f"{options}-resumed", KILL_AFTER + 1)):
        steps, run_losses = rank_records(root / run), rank_records(root / run, "loss")
        for rank in range(2):
            assert sorted(steps[rank]) == list(range(first, STEPS + 1)), f"{run}: rank {rank}'s steps"
            for step, batch in steps[rank].items():
                np.testing.assert_array_equal(batch, uninterrupted[rank][step], err_msg=f"{run}: rank {rank} {step}")
                assert run_losses[rank][step] == losses[rank][step], f"{run}: rank {rank} step {step}'s loss"
        consumed, left = (first - 1) * MBS * 2, STEPS - first + 1
        if dispatched:  # rank 0 reads each global batch whole, rank 1 nothing
            expected = [list(range(k, k + MBS * 2)) for k in range(consumed, consumed + left * MBS * 2, MBS * 2)]
            assert [ids for _, ids in reads_of(root / run / "rank-0")] == expected, f"{run}: rank 0's reads"
            assert not (root / run / "rank-1" / "reads.txt").exists(), f"{run}: rank 1 read samples"
        else:
            for rank in range(2):
                reads = [i for _, ids in reads_of(root / run / f"rank-{rank}") for i in ids]
                assert reads == own_rank_ids(train, rank, consumed, left), f"{run}: rank {rank}'s reads"


@pytest.mark.slow
def test_dispatch_batches_without_split_batches_is_refused(runs):
    """dispatch_batches alone under 2 ranks gives the loader's samples, but a resume skips 1 of the 2 batches a step
    rank 0 reads (accelerate 1.15: samples 8-15 trained again after step 4): check_training_arguments refuses it in
    one line naming the option and the fix, and so does LoaderStateCallback where the check was not called, before
    a step."""
    root, _, _ = runs
    for rank in range(2):
        refusals = (root / "dispatch_alone" / f"rank-{rank}" / "refusals.txt").read_text().splitlines()
        assert len(refusals) == 2, refusals  # check_training_arguments, then the Trainer's callback
        for refusal in refusals:
            assert "dispatch_batches=True without split_batches under 2 ranks" in refusal, refusal
            assert "set split_batches=True too, with per_device_train_batch_size 4" in refusal, refusal
    assert not any(rank_records(root / "dispatch_alone")), "steps trained before the refusal"

"""corpusforge's loaders in the real Lightning Trainer (corpusforge.adapters.lightning): training_step receives
corpusforge's own loader's batches, and a run killed with SIGKILL after a checkpoint (its DataLoader workers
already fetching ahead) resumes from Lightning's checkpoint with exactly the uninterrupted run's next batch. Under
torchrun, 2 ranks of Lightning's DDP strategy on gloo train exactly corpusforge's 2-rank loader's batches, and ranks
SIGKILLed after a checkpoint resume with the next global batch and the uninterrupted run's losses; a checkpoint
resumed at another number of ranks continues the global order (corpusforge's elastic resume)."""

from __future__ import annotations

import numpy as np
import pytest
from adapter_harness import (
    KILL_AFTER,
    MBS,
    STEPS,
    assert_resumed_exactly,
    killed_and_resumed,
    lightning_launched_job,
    make_corpora,
    marked_workers,
    rank_records,
    recorded,
    two_ranks_killed_and_resumed,
)

from corpusforge.data import LoaderStateError, make_loader
from corpusforge.errors import ArgumentError

pl = pytest.importorskip("lightning.pytorch")
import lightning_job as job  # noqa: E402


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    return make_corpora(tmp_path_factory.mktemp("corpora"))


@pytest.mark.slow
def test_killed_after_checkpoint_resumes_with_the_next_batch(tmp_path, corpora):
    """The killed run reads with 2 DataLoader workers (batches prefetched past the checkpoint), the others in
    process; the state in Lightning's checkpoint counts only the batches trained."""
    import torch

    cache = tmp_path / "cache"
    uninterrupted, before, after = killed_and_resumed("lightning_job.py", job.main, corpora, cache, tmp_path,
                                                      "--workers", "2")  # fmt: skip
    assert_resumed_exactly(uninterrupted, before, after, KILL_AFTER)
    data = job.data_module(corpora, str(cache))
    data.setup("fit")
    own = [b["tokens"].numpy() for _, b in zip(range(STEPS), make_loader(data.datasets[0], MBS))]
    np.testing.assert_array_equal(np.stack([uninterrupted[s] for s in sorted(uninterrupted)]), np.stack(own))
    saved = torch.load(tmp_path / "killed" / "ckpt" / f"epoch=0-step={KILL_AFTER}.ckpt", weights_only=True)
    assert saved["CorpusforgeDataModule"]["consumed_samples"] == KILL_AFTER * MBS


def test_a_state_of_other_data_is_refused(tmp_path, corpora):
    """A checkpoint's loader state loaded into a data module of another seed: refused when the loader is made,
    naming what differs, instead of silently continuing in another order."""
    data = job.data_module(corpora, str(tmp_path))
    data.consumed_samples = 4
    state = data.state_dict()
    other = job.data_module(corpora, str(tmp_path))
    other.build["seed"] = 6
    other.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="seed"):
        iter(other.train_dataloader())
    same = job.data_module(corpora, str(tmp_path))
    same.load_state_dict(state)
    first = next(iter(same.train_dataloader()))["tokens"].numpy()
    np.testing.assert_array_equal(first, data.datasets[0].get_batch(np.arange(4, 4 + MBS))["tokens"])


def test_a_module_overriding_the_counting_hook_is_refused(tmp_path, corpora):
    import torch

    class Overrides(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return self.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(ArgumentError, match="on_before_batch_transfer"):
        trainer.fit(Overrides(), datamodule=job.data_module(corpora, str(tmp_path)))


# 2 ranks under torchrun: one launch of 2 ranks (2 DataLoader workers each) is SIGKILLed after its checkpoint at
# KILL_AFTER; a second runs, in turn, the uninterrupted 2-rank run (no workers) and the killed run resumed by 2 ranks
# (2 workers each, once the first launch is killed). The
# 2-rank checkpoint is resumed by 1 rank here. (Each launch costs ~7 s of CPU a rank to import Lightning: the resume
# at another number of ranks is tested 2 -> 1 only, in this process.)


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_two_ranks")
    base = ["--corpora", ",".join(corpora), "--cache", str(root / "cache")]
    job.data_module(corpora, str(root / "cache")).setup("fit")  # the index caches, built once before the ranks
    step_4 = f"ckpt/epoch=0-step={KILL_AFTER}.ckpt"
    one_rank = root / "one_rank"
    one_at_two = ["--out", str(root / "one_at_two"), "--resume-from", str(one_rank / step_4)]
    before = two_ranks_killed_and_resumed(
        "lightning_job.py",
        base,
        root,
        then=[one_at_two],
        meanwhile=lambda: job.main([*base, "--out", str(one_rank)]),
        killed_args=["--workers", "2"],  # the killed run and its resume read with 2 DataLoader workers a rank
    )
    job.main([*base, "--out", str(root / "two_at_one"), "--resume-from", str(root / "killed" / step_4)])
    return root, before


def own_batches(corpora, root, rank: int, world: int, consumed: int = 0, steps: int = STEPS) -> list:
    """corpusforge's own loader's tokens for `rank` of `world` after `consumed` samples."""
    data = job.data_module(corpora, str(root / "cache"))
    data.setup("fit")
    loader = make_loader(data.datasets[0], MBS, rank, world, consumed_samples=consumed)
    return [b["tokens"].numpy() for _, b in zip(range(steps), loader)]


@pytest.mark.slow
def test_two_ranks_train_the_loaders_batches(runs, corpora):
    """Each DDP rank's training_step receives corpusforge's 2-rank loader's batches for that rank: the ranks
    together train the global order once, none twice, none skipped."""
    root, _ = runs
    steps = rank_records(root / "uninterrupted")
    for rank in range(2):
        assert sorted(steps[rank]) == list(range(1, STEPS + 1))
        own = own_batches(corpora, root, rank, 2)
        np.testing.assert_array_equal(np.stack([steps[rank][s] for s in sorted(steps[rank])]), np.stack(own))
    everything = own_batches(corpora, root, 0, 1, steps=STEPS * 2)  # the global order, one rank's micro-batches
    both = np.concatenate([np.concatenate([steps[0][s], steps[1][s]]) for s in range(1, STEPS + 1)])
    np.testing.assert_array_equal(both, np.concatenate(everything))


@pytest.mark.slow
def test_two_ranks_killed_resume_with_the_next_global_batch(runs):
    """Both ranks, reading with num_workers=2, SIGKILLed after the checkpoint at KILL_AFTER (the next batch fetched,
    their 2 workers each fetching more; the workers end too); resumed with ckpt_path by 2 ranks of 2 workers, each
    trains exactly the uninterrupted run's (no workers) next batches with its losses, bit for bit. The checkpoint
    (written by rank 0) counts the samples both ranks trained, not those fetched."""
    import torch

    root, before = runs
    uninterrupted, after = rank_records(root / "uninterrupted"), rank_records(root / "killed")
    losses, resumed_losses = rank_records(root / "uninterrupted", "loss"), rank_records(root / "killed", "loss")
    for rank in range(2):
        assert_resumed_exactly(uninterrupted[rank], before[rank], after[rank], KILL_AFTER)
        assert sorted(resumed_losses[rank]) == list(range(KILL_AFTER + 1, STEPS + 1))
        for step, loss in resumed_losses[rank].items():
            assert loss == losses[rank][step], f"rank {rank} step {step}: loss {loss} != {losses[rank][step]}"
    saved = torch.load(root / "killed" / "ckpt" / f"epoch=0-step={KILL_AFTER}.ckpt", weights_only=True)
    assert saved["CorpusforgeDataModule"]["consumed_samples"] == KILL_AFTER * MBS * 2
    for rank in range(2):
        assert len(marked_workers(root / "killed" / f"rank-{rank}" / "checkpointed")) == 2, "workers at the kill"


@pytest.mark.slow
def test_a_resume_at_another_number_of_ranks_continues_the_global_order(runs, corpora):
    """The 2-rank run's checkpoint resumed by 1 rank trains the global order on from the samples both ranks
    consumed (not from its own count of steps)."""
    root, _ = runs
    two_at_one = recorded(root / "two_at_one")
    assert sorted(two_at_one) == list(range(KILL_AFTER + 1, STEPS + 1))
    own = own_batches(corpora, root, 0, 1, KILL_AFTER * MBS * 2, STEPS - KILL_AFTER)
    np.testing.assert_array_equal(np.stack([two_at_one[s] for s in sorted(two_at_one)]), np.stack(own))


@pytest.mark.slow
def test_a_1_rank_checkpoint_resumed_by_2_ranks_continues_the_global_order(runs, corpora):
    """A 1-rank run's checkpoint at step 4 (8 samples) resumed by 2 ranks: each rank trains corpusforge's 2-rank
    loader's batches from the 8th sample on, the global order continued, nothing trained twice or skipped."""
    root, _ = runs
    resumed = rank_records(root / "one_at_two")
    for rank in range(2):
        steps = sorted(resumed[rank])
        assert steps == list(range(KILL_AFTER + 1, STEPS + 1)), f"rank {rank}'s steps"
        own = own_batches(corpora, root, rank, 2, consumed=KILL_AFTER * MBS, steps=len(steps))
        np.testing.assert_array_equal(np.stack([resumed[rank][s] for s in steps]), np.stack(own))


# Lightning's own process launcher: `python lightning_job.py ... --devices 2` with strategy="ddp", Lightning starting
# rank 1 itself (no torchrun). One launch SIGKILLed after its checkpoint at KILL_AFTER; a second whose first run, the
# uninterrupted one, has Lightning start its rank 1 (while the first launch runs), then resumes the killed run in
# those processes (a later fit: Lightning finds the LOCAL_RANK its launcher set and joins them).


@pytest.fixture(scope="module")
def launched_runs(corpora, tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_launched")
    base = ["--corpora", ",".join(corpora), "--cache", str(root / "cache")]
    job.data_module(corpora, str(root / "cache")).setup("fit")  # the index caches, built once before the ranks
    before = two_ranks_killed_and_resumed("lightning_job.py", base, root, launch=lightning_launched_job)
    return root, before


@pytest.mark.slow
def test_lightnings_own_launcher_trains_the_loaders_batches_and_resumes(launched_runs, corpora):
    """Under Lightning's own launcher (rank 1 a child of rank 0, started by Lightning), each rank trains
    corpusforge's 2-rank loader's batches; both processes SIGKILLed after the checkpoint at KILL_AFTER and resumed
    with ckpt_path in another launch's processes that Lightning started train exactly the uninterrupted run's next
    batches with its losses, bit for bit; the checkpoint counts the samples both ranks trained."""
    import torch

    root, before = launched_runs
    killed = root / "killed"
    rank_0, rank_1 = ((killed / f"rank-{r}" / "checkpointed").read_text().split() for r in range(2))
    assert rank_1[0] in rank_0[1:], "rank 1 is not a process rank 0 started"
    uninterrupted, after = rank_records(root / "uninterrupted"), rank_records(killed)
    losses, resumed_losses = rank_records(root / "uninterrupted", "loss"), rank_records(killed, "loss")
    for rank in range(2):
        own = own_batches(corpora, root, rank, 2)
        np.testing.assert_array_equal(np.stack([uninterrupted[rank][s] for s in sorted(uninterrupted[rank])]),
                                      np.stack(own), err_msg=f"rank {rank}")  # fmt: skip
        assert_resumed_exactly(uninterrupted[rank], before[rank], after[rank], KILL_AFTER)
        assert sorted(resumed_losses[rank]) == list(range(KILL_AFTER + 1, STEPS + 1))
        for step, loss in resumed_losses[rank].items():
            assert loss == losses[rank][step], f"rank {rank} step {step}: loss {loss} != {losses[rank][step]}"
    saved = torch.load(killed / "ckpt" / f"epoch=0-step={KILL_AFTER}.ckpt", weights_only=True)
    assert saved["CorpusforgeDataModule"]["consumed_samples"] == KILL_AFTER * MBS * 2

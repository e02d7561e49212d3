"""corpusforge's loaders in the real Lightning Trainer (corpusforge.adapters.lightning): training_step receives
corpusforge's own loader's batches, and a run killed with SIGKILL after a checkpoint (its DataLoader workers
already fetching ahead) resumes from Lightning's checkpoint with exactly the uninterrupted run's next batch."""

from __future__ import annotations

import numpy as np
import pytest
from adapter_harness import KILL_AFTER, MBS, STEPS, assert_resumed_exactly, killed_and_resumed, make_corpora

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

"""corpusforge's loaders as a Lightning `LightningDataModule` whose loader state goes into Lightning's checkpoint.

Lightning keeps a batch or more fetched ahead of the one it trains on (its prefetching data fetcher), so a loader
that counts what it has handed over is ahead of training when a checkpoint is written, and a resume from that
count would skip batches never trained on. The data module therefore counts a training batch in
`on_before_batch_transfer`, which Lightning calls for the batch it is about to train on, not when fetching; its
`state_dict()` (saved in every checkpoint) is corpusforge's loader state at that count, and `load_state_dict()`
checks the data and configuration before the next loader continues from it. The train loader handed to Lightning
gives and takes that same state (Lightning then knows the loader resumes mid-epoch), never a prefetch-ahead one.

Data-parallel ranks are Lightning's processes (trainer.global_rank of trainer.world_size), each taking its slice of
every global batch as Megatron's sampler does; a resume at another world size continues the same global order.

Example:
    >>> data = CorpusforgeDataModule(["out/a_text_document", 0.7, "out/b_text_document", 0.3], seq_length=2048,
    ...     micro_batch_size=8, num_samples=(80_000, 800, 0), cache_dir="cache/", num_workers=2)
    >>> lightning.Trainer(max_steps=10_000).fit(model, datamodule=data, ckpt_path="last")
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from corpusforge.data import build_gpt_datasets, make_loader
from corpusforge.errors import ArgumentError, MissingExtraError

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError:
    raise MissingExtraError(
        "corpusforge.adapters.lightning needs Lightning: pip install 'corpusforge[adapters]'"
    ) from None


class _TrainBatches:
    """What train_dataloader() returns: an iterable of the loader's batches from the data module's count, with the
    length of the whole split (Lightning counts a resumed epoch's batches from where it stopped), and the data
    module's state as its own (Lightning's fit loop saves and restores it with the checkpoint too)."""

    def __init__(self, data: CorpusforgeDataModule) -> None:
        self.data = data

    def __len__(self) -> int:
        loader = self.data._loader(0)
        loader.consumed_samples = 0
        return len(loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.data._loader(self.data.consumed_samples))

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)


class CorpusforgeDataModule(pl.LightningDataModule):
    """Train (and validation) batches of corpusforge's datasets, resumable from Lightning's checkpoints.

    `blend`, `seq_length`, `split`, `seed`, `num_samples`, `cache_dir` and `options` are build_gpt_datasets';
    `micro_batch_size`, `num_workers` and `loader_options` make_loader's. Batches are dicts of (B, S) tensors:
    tokens, labels, position_ids int32, loss_mask float32 (see corpusforge.data.loader).

    Example:
        >>> data = CorpusforgeDataModule("out/a_text_document", seq_length=1024, micro_batch_size=4,
        ...     num_samples=(4000, 40, 0), cache_dir="cache/", eod_token_id=50256)
    """

    def __init__(
        self,
        blend: str | Sequence[Any],
        seq_length: int,
        micro_batch_size: int,
        split: str = "969,30,1",
        seed: int = 1234,
        num_samples: Sequence[int | None] = (None, None, None),
        cache_dir: str | os.PathLike | None = None,
        num_workers: int = 0,
        loader_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.build = {"blend": blend, "seq_length": seq_length, "split": split, "seed": seed,
                      "num_samples": tuple(num_samples), "cache_dir": cache_dir, **options}  # fmt: skip
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers
        self.loader_options = loader_options or {}
        self.datasets: tuple[Any, Any, Any] | None = None
        self.consumed_samples = 0
        self._restored: dict[str, Any] | None = None

    def setup(self, stage: str) -> None:
        if self.trainer is not None and is_overridden("on_before_batch_transfer", self.trainer.lightning_module):
            # Lightning would call the module's hook instead of ours, and the count behind resuming would stop
            raise ArgumentError(f"{type(self.trainer.lightning_module).__name__} overrides on_before_batch_transfer, "
                                "which replaces CorpusforgeDataModule's (it counts the batches trained for resuming); "
                                "move that code into training_step or transfer_batch_to_device")  # fmt: skip
        if self.datasets is None:
            self.datasets = build_gpt_datasets(**self.build)

    @property
    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def _loader(self, consumed: int, split: int = 0) -> Any:
        if self.datasets is None:
            self.setup("fit")
        rank, world = self._rank
        loader = make_loader(self.datasets[split], self.micro_batch_size, rank, world, self.num_workers,
                             **self.loader_options)  # fmt: skip
        if split == 0 and self._restored is not None:
            loader.load_state_dict(self._restored)  # refuses a state of other data or another configuration
            self.consumed_samples, self._restored = loader.consumed_samples, None
        loader.consumed_samples = self.consumed_samples if split == 0 else consumed
        return loader

    def train_dataloader(self) -> _TrainBatches:
        return _TrainBatches(self)

    def val_dataloader(self) -> Any:
        if self.datasets is None:
            self.setup("validate")
        return [] if self.datasets[1] is None else self._loader(0, split=1)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:
            self.consumed_samples += self.micro_batch_size * self._rank[1]
        return batch

    def state_dict(self) -> dict[str, Any]:
        """corpusforge's loader state at the batches trained so far (not those Lightning fetched ahead)."""
        if self._restored is not None:  # restored but not yet trained on: keep it as it came
            return dict(self._restored)
        loader = self._loader(0)
        loader.consumed_samples = self.consumed_samples
        return loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after `state` (checked against the data when the train loader is made)."""
        self._restored = dict(state)

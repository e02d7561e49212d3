"""corpusforge's loader as torchtitan's dataloader (torchtitan 0.3.0: `Trainer.Config.dataloader`), stateful in
torchtitan's checkpoint, resuming exactly, also at another data-parallel size.

torchtitan builds its dataloader from the config: `config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=,
seq_len=, local_batch_size=, snapshot_every_n_steps=)` (torchtitan/trainer.py), and its CheckpointManager saves
the dataloader as the `dataloader` Stateful of every rank's DCP checkpoint. `CorpusforgeDataLoader.Config` is such
a config: set it as `config.dataloader` in a config-registry function (examples/adapters/torchtitan_dataloader.py),
or override its fields on the command line (`--dataloader.blend out/a_text_document,0.7,out/b_text_document,0.3`:
a list is comma-separated on torchtitan's command line). Each micro-batch is
corpusforge's (Megatron's samples and sampler, corpusforge/data/loader.py) in torchtitan's form:
`({"input": tokens}, labels)` as int64, labels IGNORE_INDEX (-100) where corpusforge's loss_mask is 0, and
`"positions"` (restarting at each document) when reset_position_ids is on, from which torchtitan's flex/varlen
attention builds its document masks.

The state. torchtitan's own dataloader keeps one pickled state per dp rank under `dp_rank_{r}`: at another dp size
DCP either fails on the missing key (more ranks) or drops the states of the ranks that are gone (fewer ranks,
torchtitan PR #816). corpusforge's loader state is the number of samples consumed by all ranks together, so a
resume at another dp size continues the same global order, exactly, as `corpusforge train` resumes. The state here
is therefore rank-independent keys, identical on every rank (DCP keeps one copy): `world_size` (the dp size) and
`corpusforge` (JSON: the loader's state, with the position of every dp rank, gathered when the checkpoint is
taken). At the same dp size each rank continues from its own position; at another, the resume is exact when every
rank stood at the same position (a training step ends with all of them there) and is refused in one line when they
did not (a rank healed one batch behind, torchft #309), since no split of the remaining samples would then be exact.

Example:
    >>> from corpusforge.adapters.torchtitan import CorpusforgeDataLoader
    >>> config.dataloader = CorpusforgeDataLoader.Config(blend=["out/tiny_text_document"], num_samples=8000,
    ...     cache_dir="cache/")                      # in a torchtitan config-registry function
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from corpusforge.data.batch import assemble
from corpusforge.data.gpt_dataset import prefetch_upcoming
from corpusforge.data.loader import LoaderStateError
from corpusforge.errors import CorpusforgeError

try:
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX
except ImportError as e:  # a missing extra is one line, not a traceback from deep inside an import
    raise CorpusforgeError(
        f"the torchtitan adapter needs torchtitan 0.3.0 ({e.name} is missing): pip install "
        '"corpusforge[adapters]" and pip install --no-deps torchtitan==0.3.0'
    ) from None

STATE_KEY = "corpusforge"
STATE_VERSION = 1


class CorpusforgeDataLoader(BaseDataLoader):
    """One dp rank's micro-batches of a corpusforge dataset or blend, as torchtitan's trainer takes them.

    Example:
        >>> loader = CorpusforgeDataLoader.Config(blend=["out/tiny_text_document"], num_samples=64).build(
        ...     dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=128, local_batch_size=4)
        >>> inputs, labels = next(iter(loader))          # inputs["input"]: (4, 128) int64
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "corpusforge"
        """A name for logs; the data is `blend` (or `dataset_path`)."""

        blend: list[str] = field(default_factory=list)
        """Token dataset prefixes, optionally weighted as Megatron's --data-path: [prefix, weight, ...] or
        [weight, prefix, ...]. Empty: `dataset_path`, one prefix."""

        split: str = "969,30,1"
        """Train, valid, test proportions over each dataset's documents; the loader reads the train split."""

        seed: int = 1234
        """Seed of the document and sample shuffles (Megatron's --seed)."""

        num_samples: int | None = None
        """Train samples to build (steps * global batch size); None: one epoch (not with weights)."""

        cache_dir: str | None = None
        """Where the index caches go (built once by one rank while the others wait); None: built in memory by every
        rank, nothing written."""

        eod_token_id: int | None = None
        """The end-of-document token, needed by reset_position_ids and eod_mask_loss."""

        eod_mask_loss: bool = False
        """No loss on end-of-document tokens (their labels become IGNORE_INDEX)."""

        reset_position_ids: bool = False
        """Positions restart after each end-of-document token and are passed as `positions` (document masks)."""

        num_workers: int = 0
        """DataLoader worker processes (corpusforge's loader: they read, this process assembles the batch)."""

        def __post_init__(self) -> None:
            if not self.blend and not self.dataset_path:
                raise ValueError("CorpusforgeDataLoader.Config needs blend (token dataset prefixes) or dataset_path")

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        **unused: Any,  # tokenizer (the data is tokenized), snapshot_every_n_steps (the state is exact at any batch)
    ) -> None:
        from corpusforge.data import build_gpt_datasets, make_loader

        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        options = {"eod_token_id": config.eod_token_id, "eod_mask_loss": config.eod_mask_loss}
        options["reset_position_ids"] = config.reset_position_ids
        train, _, _ = build_gpt_datasets(
            list(config.blend) or [config.dataset_path],
            seq_length=seq_len,
            split=config.split,
            seed=config.seed,
            num_samples=(config.num_samples, 0, 0),
            cache_dir=config.cache_dir,
            **options,
        )
        if train is None:
            raise ValueError(f"split {config.split!r} gives the train split no data")
        samples = TorchtitanSamples(train, positions=config.reset_position_ids)
        self.loader = make_loader(samples, local_batch_size, dp_rank, dp_world_size, config.num_workers)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """Rank-independent keys (see the module docstring); a collective when torch.distributed is initialized:
        torchtitan calls it on every rank when it saves or loads a checkpoint."""
        state = self.loader.state_dict()
        state["micro_batch_size"] = self.loader.micro_batch_size
        state["positions"] = dp_positions(self.dp_rank, self.dp_world_size, self.loader.consumed_samples)
        return {"world_size": self.dp_world_size, STATE_KEY: json.dumps(state, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan: an empty state is a fresh start
            return
        state = json.loads(state_dict[STATE_KEY])
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"dataloader state version {state.get('version')!r}; this loader reads 1")
        positions = state.pop("positions")
        saved = int(state_dict["world_size"])
        if saved == self.dp_world_size:
            state["consumed_samples"] = positions[self.dp_rank]
        elif len(set(positions)) != 1:
            raise LoaderStateError(
                f"the checkpoint's dataloader state was saved by {saved} data-parallel ranks standing at different "
                f"samples ({positions}), so no split over {self.dp_world_size} ranks continues it exactly; resume "
                f"with {saved} data-parallel ranks"
            )
        self.loader.load_state_dict(state)  # refuses a state of other data or options, saying what differs


class TorchtitanSamples:
    """A GPTDataset or BlendedDataset whose micro-batches are torchtitan's (inputs, labels), for corpusforge's Loader
    (its sampler, state and workers): read as numpy fields (get_batch) and made into torchtitan's int64 fields in
    one pass, not made into the loader's int32 torch batch first (a tenth of the loader's time a sample here).
    With DataLoader workers they read the raw text and this process assembles it, as the Loader does for any dataset
    with its own `assemble`. Same length, fingerprint and config as the dataset: a loader state of either fits both.

    Example:
        >>> inputs, labels = TorchtitanSamples(train).__getitems__([0, 1])      # inputs["input"]: (2, S) int64
    """

    def __init__(self, dataset: Any, positions: bool = False) -> None:
        self.dataset, self.positions = dataset, positions
        self.config = dataset.config  # the Loader's state keeps its seed

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.dataset.fingerprint

    @property
    def remote(self) -> bool:
        return self.dataset.remote

    def prefetch(self, ids: Any) -> None:
        self.dataset.prefetch(ids)

    def load_kernels(self) -> None:
        self.dataset.load_kernels()

    def read_raw(self, ids: Any) -> Any:
        return self.dataset.read_raw(ids)

    def assemble(self, raw: Any, as_torch: bool = True, pin_memory: bool = False) -> tuple[dict[str, Any], Any]:
        """What the Loader calls on the raw text a DataLoader worker read."""
        return numpy_to_torchtitan(assemble(raw, self.config), self.positions)

    def __getitems__(self, ids: list[int]) -> tuple[dict[str, Any], Any]:
        prefetch_upcoming(self.dataset, ids)
        return numpy_to_torchtitan(self.dataset.get_batch(np.asarray(ids, dtype=np.int64)), self.positions)


def to_torchtitan(batch: dict[str, torch.Tensor], positions: bool = False) -> tuple[dict[str, torch.Tensor], Any]:
    """A corpusforge micro-batch (torch, as its loader gives it) as torchtitan's (inputs, labels): int64, no loss
    where loss_mask is 0.

    Example:
        >>> inputs, labels = to_torchtitan(next(iter(make_loader(train, 8))))
    """
    return numpy_to_torchtitan({k: v.numpy() for k, v in batch.items()}, positions)


def numpy_to_torchtitan(batch: dict[str, np.ndarray], positions: bool = False) -> tuple[dict[str, torch.Tensor], Any]:
    """to_torchtitan of a batch of numpy fields (GPTDataset.get_batch): tokens and targets in one compiled pass.

    Example:
        >>> inputs, labels = numpy_to_torchtitan(train.get_batch([0, 1]))
    """
    from corpusforge.adapters.sample_rows import widened_targets

    more = (batch["position_ids"],) if positions else ()
    fields = (batch[k] for k in ("tokens", "labels", "loss_mask"))
    tokens, labels, *position_ids = widened_targets(*fields, *more, ignore_index=IGNORE_INDEX)  # one int64 storage
    inputs = {"input": tokens}
    if positions:
        inputs["positions"] = position_ids[0]
    return inputs, labels


def dp_positions(dp_rank: int, dp_world_size: int, consumed: int) -> list[int]:
    """Samples consumed as each dp rank counts them ([consumed] * dp_world_size in step): gathered from every rank
    when torch.distributed is initialized, else this rank's for all.

    Example:
        >>> dp_positions(0, 2, 16)          # without a process group
        [16, 16]
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [consumed] * dp_world_size
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, consumed))
    out = [consumed] * dp_world_size
    for rank, count in gathered:  # ranks of one dp rank (tensor/pipeline/context parallel) step together
        out[rank] = count
    return out

"""Megatron-LM's datasets, built by corpusforge: what `train_valid_test_datasets_provider` in `pretrain_gpt.py`
returns, so that a Megatron-LM user changes that one function and gets the same samples, the faster index build
and the validated token files.

Megatron-LM hands each returned dataset to `build_pretraining_data_loader` (megatron/training/datasets/
data_samplers.py): a torch DataLoader with its MegatronPretrainingSampler and the default collate, which reads
`len(dataset)`, `dataset.split` or `dataset.index_split` (a megatron.core Split: valid and test take the eval
batch sizes) and `dataset[i]`. `get_batch_on_this_tp_rank` then broadcasts the batch to the other tensor-parallel
ranks into buffers it allocates as megatron-core's GPTDataset types them, so every sample here is typed as
megatron-core's: tokens, labels, position_ids int64 (S,); loss_mask float32 (S,); attention_mask bool (1, S, S)
when asked; dataset_id an int16 scalar for a blend (BlendedDataset's index dtype). A micro-batch is read with one gather
(`__getitems__`, which torch's DataLoader calls with a batch sampler's ids), its int64 fields widened once for the
batch, then cut into per-sample dicts that Megatron-LM's default collate hands back as that batch instead of
stacking them again (corpusforge/adapters/sample_rows.py).

In pretrain_gpt.py (Megatron-LM's own `is_dataset_built_on_rank`, tokenizer and arguments):

    from corpusforge.adapters.megatron_lm import build_datasets_from_args

    def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
        return build_datasets_from_args(get_args(), train_val_test_num_samples, tokenizer=get_tokenizer(),
            is_built_on_rank=partial(is_dataset_built_on_rank, vp_stage=vp_stage))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from corpusforge.data import build_gpt_datasets
from corpusforge.data.gpt_dataset import SPLIT_NAMES
from corpusforge.data.prepare_cache import megatron_blend
from corpusforge.errors import ArgumentError

# megatron-core's BlendedDataset stores which dataset each sample comes from as int16 (blended_dataset.py)
DATASET_ID_DTYPE = np.int16


def _split_enum(name: str) -> Any:
    """megatron.core's Split member for a split name (what data_samplers.py compares with), or the name itself
    where megatron-core is not installed (the datasets still work with any sampler)."""
    try:
        from megatron.core.datasets.utils import Split
    except ImportError:
        return name
    return Split[name]


class MegatronSamples:
    """One split of corpusforge's datasets as megatron-core's GPTDataset / BlendedDataset give it: the same `len`,
    the same samples with the same keys, dtypes and shapes, and the split attribute Megatron-LM's loader reads.

    Example:
        >>> train = MegatronSamples(build_gpt_datasets("out/a_text_document", 1024, num_samples=(800, 8, 8))[0],
        ...     "train")
        >>> {k: (v.dtype, tuple(v.shape)) for k, v in train[0].items()}
        {'tokens': (torch.int64, (1024,)), 'labels': (torch.int64, (1024,)), 'loss_mask': (torch.float32, (1024,)),
         'position_ids': (torch.int64, (1024,))}
    """

    def __init__(self, dataset: Any, split: str) -> None:
        self.dataset = dataset
        self.split_name = split
        self.blended = hasattr(dataset, "datasets")
        # data_samplers.py reads `split`, else `index_split`: megatron-core's BlendedDataset has the first, its
        # GPTDataset the second; either way a Split member, compared with Split.valid and Split.test
        if self.blended:
            self.split = _split_enum(split)
        else:
            self.index_split = _split_enum(split)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.dataset.fingerprint

    def __getitems__(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        """Samples `ids` read with one gather, as one dict per sample (views of the batch's tensors), which
        Megatron-LM's default collate gives back as that batch (sample_rows) instead of stacking them again."""
        from corpusforge.adapters.sample_rows import sample_rows, torch_view, widened

        batch = self.dataset.get_batch(np.asarray(ids, dtype=np.int64))
        tokens, labels, positions = widened(batch["tokens"], batch["labels"], batch["position_ids"])
        fields: dict[str, Any] = {}
        if self.blended:  # first, as BlendedDataset puts it: {"dataset_id": ..., **sample}; numpy scalars as there
            fields["dataset_id"] = batch["dataset_id"].astype(DATASET_ID_DTYPE)
        fields["tokens"], fields["labels"] = tokens, labels
        if "attention_mask" in batch:
            fields["attention_mask"] = torch_view(batch["attention_mask"])
        fields["loss_mask"] = torch_view(batch["loss_mask"])
        fields["position_ids"] = positions
        return sample_rows(fields)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples ({self.split_name})")
        return dict(self.__getitems__([i % len(self)])[0])

    def __repr__(self) -> str:
        return f"MegatronSamples({self.dataset!r})"


def build_datasets(
    train_val_test_num_samples: Sequence[int | None],
    blend: str | Sequence[Any],
    seq_length: int,
    split: str = "969,30,1",
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
    **options: Any,
) -> tuple[MegatronSamples | None, MegatronSamples | None, MegatronSamples | None]:
    """(train, valid, test) for Megatron-LM, as BlendedMegatronDatasetBuilder(GPTDataset, num_samples,
    is_built_on_rank, config).build() returns them: None for a split of weight 0, and all None on a rank where
    `is_built_on_rank()` is false. `options`: build_gpt_datasets' (eod_token_id, pad_token_id, eod_mask_loss, ...).

    Example:
        >>> train, valid, test = build_datasets([8000, 80, 8], ["30", "out/a", "70", "out/b"], seq_length=2048,
        ...     cache_dir="cache/", eod_token_id=50256)
    """
    if is_built_on_rank is not None and not is_built_on_rank():
        return None, None, None
    built = build_gpt_datasets(blend, seq_length, split, seed, tuple(train_val_test_num_samples), cache_dir, **options)
    return tuple(None if d is None else MegatronSamples(d, name) for d, name in zip(built, SPLIT_NAMES))  # type: ignore[return-value]


# Megatron-LM options this adapter does not build; each refused with its name rather than silently ignored.
_UNSUPPORTED = {
    "mock_data": "--mock-data (use Megatron's MockGPTDataset)",
    "sft": "--sft (Megatron's SFTDataset)",
    "fim_data": "--fim-data (Megatron's GPTFIMDataset)",
    "per_split_data_args_path": "--per-split-data-args-path (give one --data-path)",
    "train_data_path": "--train-data-path (give one --data-path and --split)",
    "valid_data_path": "--valid-data-path (give one --data-path and --split)",
    "test_data_path": "--test-data-path (give one --data-path and --split)",
    "data_args_path": "--data-args-path (give --data-path)",
    "per_dataset_sequences_path": "--per-dataset-sequences-path",
    "multiple_validation_sets": "--multiple-validation-sets",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking",
}


def options_from_args(args: Any, tokenizer: Any) -> dict[str, Any]:
    """build_datasets' arguments from Megatron-LM's parsed arguments, read as pretrain_gpt.py's
    core_gpt_dataset_config_from_args reads them; `tokenizer` gives eod (and pad, where it has one, as
    megatron-core's GPTDataset takes it).

    Example:
        >>> options_from_args(get_args(), get_tokenizer())["blend"]
        ['30', 'out/a', '70', 'out/b']
    """
    refused = [flag for name, flag in _UNSUPPORTED.items() if getattr(args, name, None)]
    if refused:
        raise ArgumentError(f"corpusforge's Megatron-LM provider does not build {', '.join(refused)}; "
                            "drop the option or keep Megatron's own provider for this run")  # fmt: skip
    if not getattr(args, "data_path", None):
        raise ArgumentError("--data-path: give the token datasets (PREFIX ... or WEIGHT PREFIX ...)")
    prefixes, weights = megatron_blend(args.data_path)
    blend: list[Any] = prefixes if weights is None else [x for p, w in zip(prefixes, weights) for x in (p, w)]
    return {
        "blend": blend,
        "seq_length": args.seq_length,
        "split": args.split,
        "seed": args.seed,
        "cache_dir": getattr(args, "data_cache_path", None),
        "eod_token_id": tokenizer.eod,
        "pad_token_id": getattr(tokenizer, "pad", None),
        "reset_position_ids": args.reset_position_ids,
        "reset_attention_mask": args.reset_attention_mask,
        "eod_mask_loss": args.eod_mask_loss,
        "create_attention_mask": args.create_attention_mask_in_dataloader,
        "mid_level_dataset_surplus": getattr(args, "mid_level_dataset_surplus", 0.005),
    }


def build_datasets_from_args(
    args: Any,
    train_val_test_num_samples: Sequence[int | None],
    tokenizer: Any,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple[MegatronSamples | None, MegatronSamples | None, MegatronSamples | None]:
    """The body of pretrain_gpt.py's train_valid_test_datasets_provider, built by corpusforge (see the module
    docstring). Every rank that `is_built_on_rank` names builds (or loads) the cached indices itself: corpusforge's
    cache entries are written atomically, so no rank waits on a barrier for another's build.

    Example:
        >>> train, valid, test = build_datasets_from_args(get_args(), [8000, 80, 8], get_tokenizer())
    """
    return build_datasets(train_val_test_num_samples, is_built_on_rank=is_built_on_rank,
                          **options_from_args(args, tokenizer))  # fmt: skip

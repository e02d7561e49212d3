"""Loaders over token datasets: Megatron-Core GPTDataset/BlendedDataset samples, sharded and resumable.

Example:
    >>> from corpusforge.data import build_gpt_datasets, make_loader
    >>> train, valid, test = build_gpt_datasets(["out/a_text_document", 0.7, "out/b_text_document", 0.3],
    ...     seq_length=2048, split="969,30,1", seed=1234, num_samples=(8000, 80, 8), cache_dir="cache/")
    >>> loader = make_loader(train, micro_batch_size=8, dp_rank=0, dp_world_size=1, num_workers=2)
    >>> state = loader.state_dict()
"""

from corpusforge.data.blended import BlendedDataset, parse_blend
from corpusforge.data.builder import build_gpt_datasets, read_modes
from corpusforge.data.cache import CacheMismatchError, IndexCache
from corpusforge.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from corpusforge.data.loader import Loader, LoaderStateError, PretrainingBatchSampler, make_loader
from corpusforge.data.prepare_cache import MegatronCacheConfig, prepare_megatron_cache, prepare_train_cache
from corpusforge.storage import StorageConfig

__all__ = [
    "BlendedDataset",
    "CacheMismatchError",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexCache",
    "Loader",
    "LoaderStateError",
    "MegatronCacheConfig",
    "PretrainingBatchSampler",
    "StorageConfig",
    "build_gpt_datasets",
    "make_loader",
    "parse_blend",
    "prepare_megatron_cache",
    "prepare_train_cache",
    "read_modes",
]

"""Loaders over token datasets: Megatron-Core GPTDataset/BlendedDataset samples, sharded and resumable.

Example:
    >>> from corpusforge.data import build_gpt_datasets, make_loader
    >>> train, valid, test = build_gpt_datasets(["out/a_text_document", 0.7, "out/b_text_document", 0.3],
    ...     seq_length=2048, split="969,30,1", seed=1234, num_samples=(8000, 80, 8), cache_dir="cache/")
    >>> loader = make_loader(train, micro_batch_size=8, dp_rank=0, dp_world_size=1, num_workers=2)
    >>> state = loader.state_dict()
"""

from corpusforge.lazy_exports import lazy_exports

# Imported on first use: the CLI reads MegatronCacheConfig to make prepare-cache's options, and `corpusforge --help`
# must not start numba (the index kernels' modules load it).
_EXPORTS = {
    "BlendedDataset": "blended",
    "CacheMismatchError": "cache",
    "GPTDataset": "gpt_dataset",
    "GPTDatasetConfig": "gpt_dataset",
    "IndexCache": "cache",
    "Loader": "loader",
    "LoaderStateError": "loader",
    "MegatronCacheConfig": "prepare_cache",
    "PretrainingBatchSampler": "loader",
    "StorageConfig": "builder",
    "build_gpt_datasets": "builder",
    "make_loader": "loader",
    "parse_blend": "blended",
    "prepare_megatron_cache": "prepare_cache",
    "prepare_train_cache": "prepare_cache",
    "read_modes": "builder",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

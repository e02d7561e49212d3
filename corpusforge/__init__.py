"""corpusforge: the data side of LLM pretraining (Megatron-format token datasets, loaders, storage truth)."""

__version__ = "0.1.0"

"""The bundled trainer: GPT-2- and Llama-3-family models trained on corpusforge datasets through corpusforge loaders,
on one process or many (data, tensor, sequence and pipeline parallel on one DeviceMesh).

    torchrun --nproc-per-node 8 -m corpusforge.train --config configs/llama3-8b.toml parallel.tp=2 parallel.pp=2
    corpusforge train --config configs/llama3-8b.toml parallel.tp=2 parallel.pp=2 --dry-run --world-size 8

Modules: config (TrainConfig, the documentation of every key), model (GPT), llama (Llama), parallel (the layout
and the TP/SP, activation-checkpointing and FSDP2 plan), pipeline (stages and schedules), optim (AdamW, LR
schedule), data (loaders sized from the config), checkpoint (atomic, asynchronous, exact resume, layout-free),
metrics (log lines, JSONL, TensorBoard, MFU), export_hf (Hugging Face checkpoints), trainer (the loop).
"""

from __future__ import annotations

from corpusforge.lazy_exports import lazy_exports

# Resolved on first use (PEP 562): `corpusforge.train.config` is what the CLI reads to build `corpusforge train`'s and
# `export-hf`'s options, and importing it must not import torch (2 s; `corpusforge --help` lists every command).
_EXPORTS = {
    "CheckpointError": "checkpoint",
    "ConfigError": "config",
    "DataError": "data",
    "GPT": "model",
    "GPTConfig": "model",
    "Llama": "llama",
    "LlamaConfig": "llama",
    "TrainConfig": "config",
    "load_config": "config",
    "train": "trainer",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

"""The bundled trainer: GPT-2- and Llama-3-family models trained on corpusforge datasets through corpusforge loaders,
on one process or many (data, tensor, sequence and pipeline parallel on one DeviceMesh).

    torchrun --nproc-per-node 8 -m corpusforge.train --config configs/llama3-8b.toml parallel.tp=2 parallel.pp=2
    corpusforge train --config configs/llama3-8b.toml parallel.tp=2 parallel.pp=2 --dry-run --world-size 8

Modules: config (TrainConfig, the documentation of every key), model (GPT), llama (Llama), parallel (the layout
and the TP/SP, activation-checkpointing and FSDP2 plan), pipeline (stages and schedules), optim (AdamW, LR
schedule), data (loaders sized from the config), checkpoint (atomic, asynchronous, exact resume, layout-free),
metrics (log lines, JSONL, TensorBoard, MFU), export_hf (Hugging Face checkpoints), trainer (the loop).
"""

from corpusforge.train.checkpoint import CheckpointError
from corpusforge.train.config import ConfigError, TrainConfig, load_config
from corpusforge.train.data import DataError
from corpusforge.train.llama import Llama, LlamaConfig
from corpusforge.train.model import GPT, GPTConfig
from corpusforge.train.trainer import train

__all__ = [
    "GPT",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "TrainConfig",
    "load_config",
    "train",
]

"""The bundled GPT trainer: GPT-2-family models trained on corpusforge datasets through corpusforge loaders.

    torchrun --nproc-per-node 8 -m corpusforge.train --config configs/gpt2-124m.toml [key=value ...]
    corpusforge train --config configs/tiny-cpu.toml --dry-run

Modules: config (TrainConfig, the documentation of every key), model (GPT), optim (AdamW, LR schedule), data
(loaders sized from the config), checkpoint (atomic, asynchronous, exact resume), metrics (log lines, JSONL,
TensorBoard, MFU), trainer (the loop).
"""

from corpusforge.train.checkpoint import CheckpointError
from corpusforge.train.config import ConfigError, TrainConfig, load_config
from corpusforge.train.data import DataError
from corpusforge.train.model import GPT, GPTConfig
from corpusforge.train.trainer import train

__all__ = ["GPT", "CheckpointError", "ConfigError", "DataError", "GPTConfig", "TrainConfig", "load_config", "train"]

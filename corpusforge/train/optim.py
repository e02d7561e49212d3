"""AdamW with decay on matrices only, and the cosine learning-rate schedule with linear warmup."""

from __future__ import annotations

import math

import torch

from corpusforge.train.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D parameters (matmul weights, embeddings) and none on biases and LayerNorm
    gains (nanoGPT configure_optimizers; decaying them only hurts). Fused kernel on GPU: one launch per step."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied matrix appears once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr over warmup_steps, then cosine decay
    to min_lr at max_steps (Loshchilov & Hutter 2017, as in nanoGPT and llm.c).

    Example:
        >>> cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
        >>> lr_at(0, cfg), lr_at(9, cfg), lr_at(60, cfg), lr_at(110, cfg)
        (0.1, 1.0, 0.55, 0.1)
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)

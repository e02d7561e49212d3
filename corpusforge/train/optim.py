"""AdamW with decay on matrices only, and the cosine learning-rate schedule with linear warmup."""

from __future__ import annotations

import math

import torch

from corpusforge.train.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                   rank: int = 0) -> torch.optim.Optimizer:  # fmt: skip
    """AdamW with weight decay on 2-D parameters (matmul weights, embeddings) and none on biases and LayerNorm
    gains (nanoGPT configure_optimizers; decaying them only hurts). torch's fused kernel on GPU and on CPU alike: one
    launch per step there, and on CPU the same math as parallel.offload = "nvme" streams through its files
    (NvmeAdamW, under {offload_dir}/rank_{rank}), so the placements' losses are bit-identical."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the tied matrix appears once
    o = cfg.optimizer
    # A model may train parts at a fraction of the rate (RetroModel.lr_scales: {"encoder.": 0.1}); each group
    # carries its "lr_scale", which the schedule multiplies (trainer.train_step).
    scales = model.lr_scales() if hasattr(model, "lr_scales") else {}

    def scale(name: str) -> float:
        return next((s for prefix, s in scales.items() if name.startswith(prefix)), 1.0)

    groups = []
    for s in sorted({scale(n) for n, _ in named} | {1.0}, reverse=True):
        part = [p for n, p in named if scale(n) == s]
        if s != 1.0 and not part:
            continue
        extra = {"lr_scale": s} if scales else {}
        groups += [
            {"params": [p for p in part if p.dim() >= 2], "weight_decay": o.weight_decay, **extra},
            {"params": [p for p in part if p.dim() < 2], "weight_decay": 0.0, **extra},
        ]
    if cfg.parallel.offload == "nvme":
        from corpusforge.train.offload import NvmeAdamW, offload_directory

        directory = offload_directory(cfg.parallel.offload_dir, cfg.out_dir, rank)
        return NvmeAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                         directory=directory)  # fmt: skip
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to optimizer.lr over schedule.warmup_steps,
    then cosine decay to schedule.min_lr at schedule.max_steps (Loshchilov & Hutter 2017, as in nanoGPT and llm.c).

    Example:
        >>> from corpusforge.train.config import OptimizerSection, ScheduleSection
        >>> cfg = TrainConfig(optimizer=OptimizerSection(lr=1.0),
        ...                   schedule=ScheduleSection(min_lr=0.1, warmup_steps=10, max_steps=110))
        >>> lr_at(0, cfg), lr_at(9, cfg), lr_at(60, cfg), lr_at(110, cfg)
        (0.1, 1.0, 0.55, 0.1)
    """
    s, peak = cfg.schedule, cfg.optimizer.lr
    if step < s.warmup_steps:
        return peak * (step + 1) / s.warmup_steps
    if step >= s.max_steps:
        return s.min_lr
    ratio = (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps)
    return s.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - s.min_lr)

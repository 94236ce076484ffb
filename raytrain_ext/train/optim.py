"""Optimizer and learning-rate schedule: AdamW, linear warmup, cosine decay to ``min_lr``."""

from __future__ import annotations

import math
from typing import List

import torch
import torch.nn as nn


def build_optimizer(model: nn.Module, optim_cfg, foreach: bool = True) -> torch.optim.Optimizer:
    """AdamW; weight decay applies to matrices only (not norms, biases).

    ``foreach``: the strategy's ``optimizer_foreach`` (the per-tensor step over DTensor
    parameters, and where DTensor and plain parameters share a group, experts left out of
    FSDP, which the multi-tensor step refuses).
    """
    decay: List[torch.nn.Parameter] = []
    no_decay: List[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": optim_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps, foreach=foreach
    )


def lr_factor(step: int, optim_cfg) -> float:
    """Multiplier of ``optim.lr`` for 0-based ``step``: warmup, then cosine to min_lr/lr."""
    warmup, decay = optim_cfg.warmup_steps, optim_cfg.decay_steps
    if step < warmup:
        return (step + 1) / warmup
    floor = optim_cfg.min_lr / optim_cfg.lr
    progress = min(1.0, (step - warmup) / max(1, decay - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg):
    """A ``LambdaLR`` (stateful: its ``state_dict`` holds the step count)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim_cfg))

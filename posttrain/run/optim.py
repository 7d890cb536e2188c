"""Optimizer and learning-rate schedule (linear warm-up, then constant, cosine or linear decay)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def make_optimizer(
    model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over trainable parameters; no weight decay on norms and biases (1-D tensors).

    The fused implementation (one kernel over all parameters) where torch has it for the parameters'
    device and dtype: on SmolLM2-135M's 134.5M parameters (2 CPU cores) it takes 0.08-0.10 s a step
    against 0.35-0.38 s for the multi-tensor ``foreach`` one, which is the fallback.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def make_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, kind: str) -> LambdaLR:
    """Multiplier on the base lr: ramps 1/warmup .. 1, then constant / cosine / linear to 0 at ``total``."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        if kind == "linear":
            return 1.0 - frac
        raise ValueError(f"unknown schedule {kind!r}; choices: constant, cosine, linear")

    return LambdaLR(optimizer, factor)

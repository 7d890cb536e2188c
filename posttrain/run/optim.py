"""Optimizer and learning-rate schedule (linear warm-up, then constant, cosine or linear decay)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from posttrain.errors import ConfigError

OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit")  # train.optimizer: fp32 moments, or torchao's low-bit ones


def make_optimizer(
    model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float, kind: str = "adamw"
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on norms and biases (1-D tensors).

    ``kind = "adamw"``: torch's, fp32 moments (8 bytes a parameter), the fused implementation (one kernel over all
    parameters) where torch has it for the parameters' device and dtype: on SmolLM2-135M's 134.5M parameters
    (2 CPU cores) it takes 0.08-0.10 s a step against 0.35-0.38 s for the multi-tensor ``foreach`` one, which is
    the fallback. ``"adamw_8bit"`` / ``"adamw_4bit"``: torchao's low-bit AdamW (``torchao.optim.AdamW8bit`` /
    ``AdamW4bit``, the ``lowbit_optim`` extra): both moments block-wise quantized (blocks of 256 values with one
    fp32 scale: about 2 or 1 bytes a parameter), tensors under 4,096 values kept in fp32 as bitsandbytes does; its
    step is ``torch.compile``d once per parameter shape (seconds to a minute at the first step, on a CPU too).
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if kind != "adamw":
        return _low_bit(kind)(groups, lr=lr, betas=betas)
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def _low_bit(kind: str) -> type[torch.optim.Optimizer]:
    """The torchao optimizer class of ``train.optimizer = kind``."""
    if kind not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer: unknown optimizer {kind!r}; choices: {', '.join(OPTIMIZERS)}")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ConfigError(f"train.optimizer = {kind!r} needs torchao: pip install 'posttrain[lowbit_optim]' "
                          f"({e})") from None
    return {"adamw_8bit": AdamW8bit, "adamw_4bit": AdamW4bit}[kind]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state holds (quantized moments at their packed size, scales included)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                flatten = getattr(value, "__tensor_flatten__", None)  # a torchao subclass: its codes and scales
                parts = [getattr(value, n) for n in flatten()[0]] if flatten is not None else [value]
                total += sum(t.numel() * t.element_size() for t in parts)
    return total


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

"""Masked reductions shared by the diagnostics (NaN, not 0, over an empty mask)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero, in float32; NaN if the mask is empty."""
    m = mask.to(torch.bool)
    count = m.sum()
    total = torch.where(m, x.float(), torch.zeros((), dtype=torch.float32, device=x.device)).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def to_floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """One host sync for a dict of 0-dim tensors."""
    values = torch.stack([v.detach().float().reshape(()) for v in stats.values()]).tolist()
    return dict(zip(stats, values, strict=True))

"""Shared pieces of the advantage estimators: the registry, the std modes, the correctness
threshold, per-group std, batch whitening and the token-reward helpers.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("advantage estimator")
register = REGISTRY.register
names = REGISTRY.names

StdMode = Literal["unbiased", "population", "none"]

CORRECT_THRESHOLD = 0.5
"""A response counts as correct when its reward is above this (binary {0,1} or {-1,1} rewards)."""


def _group_std(r_PG: Tensor, std: StdMode) -> Tensor:
    """Per-group std ``[P, 1]``; unbiased is ddof=1 (``torch.std`` default), population ddof=0."""
    if std == "none":
        return torch.ones_like(r_PG[:, :1])
    g = r_PG.shape[1]
    if std == "unbiased":
        if g < 2:
            return torch.ones_like(r_PG[:, :1])
        return r_PG.std(dim=1, keepdim=True, unbiased=True)
    if std == "population":
        return r_PG.std(dim=1, keepdim=True, unbiased=False)
    raise ValueError(f"std must be 'unbiased', 'population' or 'none'; got {std!r}")


def _correct(r_PG: Tensor) -> Tensor:
    """1.0 where a response is correct (reward > ``CORRECT_THRESHOLD``), else 0.0; ``[P, G]``."""
    return (r_PG > CORRECT_THRESHOLD).to(r_PG.dtype)


def _whiten(x: Tensor, weight: Tensor) -> Tensor:
    """Batch whitening (x - mean) / sqrt(var + 1e-8) with weights (verl ``masked_whiten``).

    ``weight`` is a 0/1 token mask or a per-sequence token count; the mean and the *unbiased*
    variance (divide by sum(weight) - 1, as verl's Bessel correction) are taken over the whole
    batch. The result is not re-masked: callers multiply by their mask.
    """
    w = weight.to(x.dtype)
    n = w.sum()
    mean = (x * w).sum() / n.clamp(min=1.0)
    var = ((x - mean) ** 2 * w).sum() / (n - 1.0).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _token_rewards(rewards_PG: Tensor, mask_PGT: Tensor, token_rewards_PGT: Tensor | None) -> Tensor:
    """Dense rewards ``[P, G, T]``: the outcome on the last response token, plus ``token_rewards``."""
    m = mask_PGT.to(rewards_PG.dtype)
    pos_T = torch.arange(1, m.shape[-1] + 1, device=m.device, dtype=m.dtype)
    last_PG1 = (m * pos_T).argmax(dim=-1, keepdim=True)  # index of the last 1 in each row
    has_PG1 = (m.sum(dim=-1, keepdim=True) > 0).to(m.dtype)  # an empty row gets no outcome
    out = torch.zeros_like(m).scatter(-1, last_PG1, rewards_PG.unsqueeze(-1) * has_PG1)
    if token_rewards_PGT is not None:
        out = out + token_rewards_PGT.to(m.dtype) * m
    return out


def _to_tokens(adv_PG: Tensor, mask_PGT: Tensor) -> Tensor:
    """Broadcast a sequence advantage ``[P, G]`` to the response tokens ``[P, G, T]``."""
    return adv_PG.unsqueeze(-1) * mask_PGT.to(adv_PG.dtype)

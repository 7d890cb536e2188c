"""Shared pieces of the selection functions: the group-filter registry and the reward checks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

GroupFilter = Callable[..., Tensor]
REGISTRY: Registry[GroupFilter] = Registry("group filter")
register = REGISTRY.register
names = REGISTRY.names


def _check_rewards(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G]; got shape {tuple(rewards.shape)}")
    return rewards.detach().float()


def _spread_PG(r_PG: Tensor) -> Tensor:
    """Return max - min per group ``[P]``; 0 for an empty group (G = 0)."""
    if r_PG.shape[1] == 0:
        return torch.zeros(r_PG.shape[0], dtype=r_PG.dtype)
    return r_PG.amax(dim=1) - r_PG.amin(dim=1)

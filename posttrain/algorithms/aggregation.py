"""Loss aggregation: per-token loss ``[N, T]`` and mask -> scalar.

Contract (``DESIGN.md``): ``reduce(mode, loss, mask, **params)``. Kept separate from the policy
surrogate (verl's ``agg_loss``), so that e.g. Dr.GRPO is ``ppo_clip`` x ``seq_mean_token_sum_norm``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("loss aggregation")
register = REGISTRY.register
names = REGISTRY.names


def reduce(mode: str, loss: Tensor, mask: Tensor, **params: object) -> Tensor:
    """Look up aggregation ``mode`` and reduce ``loss [N, T]`` over ``mask [N, T]`` to a scalar."""
    fn = REGISTRY.get(mode)
    accepted = REGISTRY.params(mode)
    bad = [k for k in params if k not in accepted]
    if bad:
        raise TypeError(f"aggregation {mode!r} got unknown parameter(s) {bad}; it accepts {accepted}")
    return fn(loss, mask.to(loss.dtype), **params)


@register("token_mean")
def token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """Token-level mean over the whole batch: sum_{i,t} m l / sum_{i,t} m.

    DAPO's "token-level policy gradient loss" (arXiv:2503.14476; catalog B6): every token weighs
    the same, so long responses are not down-weighted. Nearest neighbour: ``seq_mean_token_mean``
    (original GRPO) averages within each sequence first.
    """
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)

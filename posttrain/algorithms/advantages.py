"""Advantage estimators: rewards ``[P, G]`` (+ named extra inputs) -> advantages.

Contract (``DESIGN.md``): ``compute(name, rewards, **kwargs)``. ``rewards`` is float ``[P, G]``
(P prompts, G completions per prompt). Extra inputs arrive by documented names (``lengths``,
``mask``, ``logprobs``, ``entropies``, ``values``, ``token_rewards``, ``state``); each estimator
accepts the ones it needs and ignores the rest, so the loop can pass what it has without knowing
which estimator it runs. Sequence-level estimators return ``[P, G]``; token-level ones
``[P, G, T]``. Outputs never carry gradient.
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


def compute(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Look up estimator ``name`` and apply it to ``rewards [P, G]``.

    Keyword arguments the estimator does not declare are ignored, so callers may pass every
    extra input they have (``lengths``, ``mask``, ...). Parameters it does declare are checked.
    """
    fn = REGISTRY.get(name)
    if rewards.dim() < 2:
        raise ValueError(f"rewards must be [P, G] (or [P, G, K]); got shape {tuple(rewards.shape)}")
    accepted = set(REGISTRY.params(name))
    with torch.no_grad():
        return fn(rewards.float(), **{k: v for k, v in kwargs.items() if k in accepted})


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


@register("grpo")
def grpo(rewards: Tensor, *, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantage: A_i = (r_i - mean_g r) / (std_g r + eps).

    Shapes: rewards ``[P, G]`` -> advantages ``[P, G]`` (broadcast to tokens by the loss).
    Paper: DeepSeekMath, Shao et al. 2024, arXiv:2402.03300 (catalog B1).
    Std convention: ``std="unbiased"`` (ddof=1, verl's default) by default; ``"population"``
    (ddof=0) or ``"none"`` (mean-centering only, which is Dr.GRPO) on request.
    A group of one has no baseline: its advantage is 0.
    Nearest neighbour: ``dr_grpo`` drops the std division; ``rloo`` uses a leave-one-out mean.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (_group_std(rewards, std) + eps)


@register("dr_grpo")
def dr_grpo(rewards: Tensor) -> Tensor:
    """Dr.GRPO advantage: A_i = r_i - mean_g r (no std division).

    Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: "Understanding R1-Zero-Like Training: A
    Critical Perspective", Liu et al. 2025, arXiv:2503.20783 (catalog B2). No std is used.
    Nearest neighbour: ``grpo`` divides by the group std, which up-weights near-uniform groups.
    Pair with ``seq_mean_token_sum_norm`` aggregation to remove the length bias as the paper does.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


@register("rloo")
def rloo(rewards: Tensor) -> Tensor:
    """RLOO leave-one-out advantage: A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r).

    Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback", Ahmadian et al. 2024, arXiv:2402.14740
    (catalog B3). No std is used. Nearest neighbour: ``dr_grpo`` (same direction, scaled by
    G/(G-1) because the baseline excludes the sample itself). A group of one gets 0.
    """
    g = rewards.shape[1]
    if g < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * g / (g - 1)

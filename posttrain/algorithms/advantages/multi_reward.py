"""Multi-reward estimators: rewards ``[P, G, K]`` (GDPO, GD2PO)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _whiten, register
from posttrain.algorithms.advantages.group import grpo

REWARD_COMPONENTS = ("gdpo", "gd2po")
"""Estimators that take every reward component, ``rewards [P, G, K]``, rather than their weighted sum."""


def _per_reward_grpo(rewards: Tensor, std: StdMode, eps: float) -> Tensor:
    """GRPO-normalise every reward component separately: ``[P, G(, K)]`` -> ``[P, G, K]``."""
    r_PGK = rewards if rewards.dim() == 3 else rewards.unsqueeze(-1)
    return torch.stack([grpo(r_PGK[..., k], std=std, eps=eps) for k in range(r_PGK.shape[-1])], dim=-1)


def _sequence_weights(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """Per-sequence whitening weight ``[P, G]``: its token count (verl whitens over tokens), or 1."""
    if mask is None:
        return torch.ones_like(rewards[:, :, 0] if rewards.dim() == 3 else rewards)
    return mask.to(rewards.dtype).sum(dim=-1)


@register("gdpo")
def gdpo(
    rewards: Tensor,
    *,
    mask: Tensor | None = None,
    whiten: bool = True,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """GDPO: normalise each reward component within the group, sum them, whiten over the batch.

    A^k = (r^k - mean_g r^k) / (std_g r^k + eps); A = sum_k A^k; then batch whitening
    (mean, unbiased var + 1e-8) with each sequence weighted by its token count from ``mask``
    (which equals verl's token-level ``masked_whiten`` of a broadcast advantage), or equally when
    no mask is given. Shapes: rewards ``[P, G, K]`` (``[P, G]`` is K = 1), mask ``[P, G, T]`` ->
    ``[P, G]``. Paper: GDPO as the baseline of "GD2PO: Mitigating Multi-Reward Conflicts via
    Group-Dynamic reward-Decoupled Policy Optimization", Liu et al. 2026, arXiv:2606.16771, seed
    ``papers/004_f298e9ec572f7f27.txt:117`` (catalog 3.37, authors' code). Std convention:
    **unbiased** per component; unbiased batch variance. Nearest neighbour: ``grpo`` on the summed
    reward, where a large-scale component would drown the others.
    """
    adv_PG = _per_reward_grpo(rewards, std, eps).sum(dim=-1)
    if not whiten:
        return adv_PG
    w_PG = _sequence_weights(rewards, mask)
    return _whiten(adv_PG, w_PG) * (w_PG > 0).to(adv_PG.dtype)


@register("gd2po")
def gd2po(
    rewards: Tensor,
    *,
    mask: Tensor | None = None,
    mode: Literal["hard", "snr"] = "hard",
    tau: float = 0.2,
    whiten: bool = True,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """GD2PO: GDPO with conflicting rollouts masked out and groups reweighted by consensus.

    A^k as in ``gdpo``. A rollout *conflicts* when its per-reward advantages have mixed signs
    (|A^k| > 1e-8); with ``mode="snr"`` only when also |sum_k A^k| / (sum_k |A^k| + 1e-6) < tau.
    keep = not conflict; kappa_g = #kept / G; A = (sum_k A^k) kappa_g keep, then whitened over kept
    rollouts only (token-count weights from ``mask``, as ``gdpo``); dropped rollouts get 0.
    Shapes: rewards ``[P, G, K]``, mask ``[P, G, T]`` -> ``[P, G]``. Paper: "GD2PO: Mitigating
    Multi-Reward Conflicts via Group-Dynamic reward-Decoupled Policy Optimization", Liu et al.
    2026, arXiv:2606.16771, seed ``papers/004_f298e9ec572f7f27.txt:117`` (catalog 3.37, authors'
    ``gdpo_filter_*`` branches). Std convention: **unbiased** per component and in the whitening.
    Nearest neighbour: ``gdpo`` (no filter, kappa = 1).
    """
    adv_PGK = _per_reward_grpo(rewards, std, eps)
    significant = adv_PGK.abs() > 1e-8
    conflict_PG = ((adv_PGK > 0) & significant).any(dim=-1) & ((adv_PGK < 0) & significant).any(dim=-1)
    if mode == "snr":
        snr_PG = adv_PGK.sum(dim=-1).abs() / (adv_PGK.abs().sum(dim=-1) + 1e-6)
        conflict_PG = conflict_PG & (snr_PG < tau)
    elif mode != "hard":
        raise ValueError(f"mode must be 'hard' or 'snr'; got {mode!r}")
    keep_PG = (~conflict_PG).to(adv_PGK.dtype)
    kappa_P1 = keep_PG.mean(dim=1, keepdim=True)
    adv_PG = adv_PGK.sum(dim=-1) * kappa_P1 * keep_PG
    if not whiten:
        return adv_PG
    w_PG = _sequence_weights(rewards, mask) * keep_PG
    return _whiten(adv_PG, w_PG) * (w_PG > 0).to(adv_PG.dtype)

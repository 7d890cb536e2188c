"""PPO's value-function terms: the clipped value loss and explained variance (pure tensor functions).

The critic that uses them lives in ``posttrain/learn/critic.py``; the estimator that reads its
values is ``advantages.gae`` (catalog B10), whose ``gae_advantages_and_returns`` gives the targets.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_value_loss(
    values_NT: Tensor, old_values_NT: Tensor, returns_NT: Tensor, mask_NT: Tensor, *, cliprange: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token and where the clipped branch is the larger one.

    V_clip = V_old + clamp(V - V_old, -c, c);  l_t = max((V_t - R_t)^2, (V_clip_t - R_t)^2).
    The max makes the loss pessimistic: a prediction may not move more than ``c`` from the value
    the rollout was scored with and get credit for it. Shapes: all ``[N, T]`` -> (loss ``[N, T]``
    masked, clipped ``[N, T]`` float 0/1 masked: 1 where (V_clip - R)^2 > (V - R)^2 strictly).
    Source: verl ``core_algos.compute_value_loss`` (``cliprange_value`` 0.5 by default; verl then
    takes 0.5 x the token mean, which is ``critic.loss_coef``); OpenRLHF ``ValueLoss``. Gradient
    flows through ``values_NT`` only.
    """
    m = mask_NT.to(values_NT.dtype)
    old = old_values_NT.detach()
    ret = returns_NT.detach()
    clipped_values = old + (values_NT - old).clamp(-cliprange, cliprange)
    loss_unclipped = (values_NT - ret) ** 2
    loss_clipped = (clipped_values - ret) ** 2
    loss = torch.maximum(loss_unclipped, loss_clipped) * m
    return loss, (loss_clipped > loss_unclipped).to(m.dtype) * m


def explained_variance(values_NT: Tensor, returns_NT: Tensor, mask_NT: Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the masked tokens: 1 is a perfect critic, 0 predicts no better
    than the mean return, < 0 is worse than it. NaN when the returns are constant (nothing to
    explain) or no token is masked in. Variances are population (ddof=0); the ratio does not depend
    on the convention. verl logs the same as ``critic/vf_explained_var`` (with +1e-5 in the
    denominator instead of NaN).
    """
    keep = mask_NT.bool()
    ret = returns_NT[keep].double()
    if ret.numel() == 0:
        return float("nan")
    var_r = ret.var(unbiased=False)
    if var_r <= 1e-12:
        return float("nan")
    return float(1.0 - (ret - values_NT[keep].double()).var(unbiased=False) / var_r)

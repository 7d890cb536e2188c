"""PPO's value-function terms: the clipped value loss, explained variance and the value heads (``critic.head``:
``scalar``, ``hl_gauss``), pure tensor functions.

The critic that uses them lives in ``posttrain/learn/critic.py``; the estimator that reads its
values is ``advantages.gae`` (catalog B10), whose ``gae_advantages_and_returns`` gives the targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry


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


# --- value heads: what the critic's outputs are, how V is read off them, and the loss that fits them -----------

REGISTRY: Registry = Registry("value head")
register = REGISTRY.register
names = REGISTRY.names


@dataclass(frozen=True)
class ValueHead:
    """A critic's head: ``outputs`` per position; ``value(out [..., outputs]) -> V [...]``; ``loss(out, old_values,
    returns, mask, cliprange=) -> (loss [N, T] masked, clipped [N, T] 0/1)``, the per-token loss the critic's step
    takes the token mean of.
    """

    outputs: int
    value: Callable[[Tensor], Tensor]
    loss: Callable[..., tuple[Tensor, Tensor]]


def head(name: str, **params: float) -> ValueHead:
    """Value head ``name`` (``critic.head``) bound to ``params`` (``critic.head_params``)."""
    return REGISTRY.get(name)(**params)


def _scalar_value(out_NTK: Tensor) -> Tensor:
    return out_NTK[..., 0].float()


def _scalar_loss(out_NTK: Tensor, old_values_NT: Tensor, returns_NT: Tensor, mask_NT: Tensor, *,
                 cliprange: float) -> tuple[Tensor, Tensor]:
    return clipped_value_loss(_scalar_value(out_NTK), old_values_NT, returns_NT, mask_NT, cliprange=cliprange)


@register("scalar")
def scalar() -> ValueHead:
    """One output per position, V = the output, fit by PPO's clipped squared error (:func:`clipped_value_loss`):
    verl's and OpenRLHF's critic. Hand example: see :func:`clipped_value_loss`.
    """
    return ValueHead(1, _scalar_value, _scalar_loss)


def hl_gauss_target(y: Tensor, edges: Tensor, sigma: float) -> Tensor:
    """The HL-Gauss target distribution over the bins of ``edges`` (``[m + 1]``) for scalars ``y`` (``[...]``):
    p_i = Phi((z_{i+1} - y) / sigma) - Phi((z_i - y) / sigma), renormalized over the support; ``[..., m]``.
    A target outside the support is first clamped onto it (its mass goes to the nearest bins: far out, the
    Gaussian's mass inside the support would underflow to nothing, leaving no signal).
    """
    y = y.clamp(float(edges[0]), float(edges[-1]))
    cdf = torch.special.ndtr((edges.to(y.dtype) - y.unsqueeze(-1)) / sigma)  # [..., m + 1]
    mass = cdf[..., 1:] - cdf[..., :-1]
    return mass / mass.sum(-1, keepdim=True).clamp(min=1e-12)


def _bins(low: float, high: float, bins: int) -> tuple[Tensor, Tensor]:
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float32)
    return edges, (edges[1:] + edges[:-1]) / 2


def _hl_value(out_NTK: Tensor, *, low: float, high: float) -> Tensor:
    _, centres = _bins(low, high, out_NTK.shape[-1])
    return (out_NTK.float().softmax(-1) * centres.to(out_NTK.device)).sum(-1)


def _hl_loss(out_NTK: Tensor, old_values_NT: Tensor, returns_NT: Tensor, mask_NT: Tensor, *, cliprange: float,
             low: float, high: float, sigma_ratio: float) -> tuple[Tensor, Tensor]:
    del old_values_NT, cliprange  # a classification loss is bounded: the paper clips nothing
    edges, _ = _bins(low, high, out_NTK.shape[-1])
    edges = edges.to(out_NTK.device)
    target = hl_gauss_target(returns_NT.detach().float(), edges, sigma_ratio * float(edges[1] - edges[0]))
    m = mask_NT.to(torch.float32)
    loss = -(target * out_NTK.float().log_softmax(-1)).sum(-1) * m
    return loss, torch.zeros_like(m)


@register("hl_gauss")
def hl_gauss(*, bins: int = 51, low: float = -1.5, high: float = 1.5, sigma_ratio: float = 0.75) -> ValueHead:
    """HL-Gauss value classification: ``bins`` logits per position over the support [low, high], V = sum_i softmax_i
    centre_i, fit by the cross-entropy to the return's Gaussian histogram (:func:`hl_gauss_target`, sigma =
    ``sigma_ratio`` x the bin width) instead of a squared error.

    Paper: "Stop Regressing: Training Value Functions via Classification for Scalable Deep RL", Farebrother et al.
    2024, arXiv:2403.03950, seed ``papers/004_f298e9ec572f7f27.txt:187`` (catalog L187; sigma = 0.75 bin widths,
    the paper's recommendation). Hand example (catalog): edges [0, 0.2, ..., 1.0], y = 0.3, sigma = 0.15 ->
    p = [0.2351, 0.5065, 0.2351, 0.0228, 0.0004], whose mean over the centres is 0.3094. The support must cover
    the returns (rewards in [0, 1] with gamma = 1: [-1.5, 1.5] leaves room); a head starting at zero predicts
    the support's centre. Nearest neighbour: ``scalar`` regresses V directly (squared error, clipped).
    """
    if bins < 2 or not high > low or sigma_ratio <= 0:
        raise ValueError(f"hl_gauss: needs bins >= 2, high > low and sigma_ratio > 0 (got bins={bins}, low={low}, "
                         f"high={high}, sigma_ratio={sigma_ratio})")
    return ValueHead(bins, partial(_hl_value, low=low, high=high),
                     partial(_hl_loss, low=low, high=high, sigma_ratio=sigma_ratio))

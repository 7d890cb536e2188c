"""Policy losses (surrogates): per-token loss ``[N, T]`` to be minimized.

Contract (``DESIGN.md``): ``compute(name, logprobs, old_logprobs, advantages, mask, **params)``.
``logprobs [N, T]`` carry gradient; ``old_logprobs [N, T]`` and ``advantages`` (``[N]``,
``[N, 1]`` or ``[N, T]``) do not. The result is masked (zero where ``mask`` is 0) and not yet
reduced: aggregation is a separate axis (``aggregation.reduce``). A positive advantage gives a
negative loss. ``weights [N, T]`` (optional, no gradient) multiplies the per-token loss, e.g.
importance weights for off-policy data.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("policy loss")
register = REGISTRY.register
names = REGISTRY.names


def compute(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    **params: object,
) -> Tensor:
    """Look up loss ``name`` and return its masked per-token loss ``[N, T]``.

    Unknown parameters raise ``TypeError`` naming the accepted ones.
    """
    fn = REGISTRY.get(name)
    accepted = REGISTRY.params(name)
    bad = [k for k in params if k not in accepted]
    if bad:
        raise TypeError(f"policy loss {name!r} got unknown parameter(s) {bad}; it accepts {accepted}")
    adv_NT = _broadcast_advantages(advantages, logprobs).detach()
    loss_NT = fn(logprobs, old_logprobs.detach(), adv_NT, mask, **params)
    if weights is not None:
        loss_NT = loss_NT * weights.detach()
    return loss_NT * mask


def _broadcast_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    return advantages.to(logprobs.dtype).expand_as(logprobs)


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    # clamp as verl does so a stale or corrupted old log-prob cannot overflow exp()
    return torch.clamp(logprobs - old_logprobs, -20.0, 20.0)


@register("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> Tensor:
    """PPO clipped surrogate with separate low/high clip and optional dual clip.

    rho_t = exp(logpi_t - logpi_old_t);
    l_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high));
    with ``dual_clip = c`` (c > 1) and A < 0: l_t = min(l_t, -A c).
    Shapes: all ``[N, T]`` -> ``[N, T]``. Papers: PPO, Schulman et al. 2017, arXiv:1707.06347;
    clip-higher (eps_high > eps_low) from DAPO, arXiv:2503.14476; dual clip from Ye et al. 2020,
    arXiv:1912.09729 (catalog B5). At rho = 1 the gradient is the policy gradient -A grad logpi.
    Nearest neighbour: ``cispo`` clips only the importance weight and never drops a token.
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss

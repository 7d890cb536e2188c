"""KL estimators between the policy and a frozen reference, per token.

Contract (``DESIGN.md``): ``estimate(name, logprobs, ref_logprobs) -> [N, T]``. ``logprobs``
carry gradient, ``ref_logprobs`` do not. Schulman's estimators ("Approximating KL Divergence",
2020; catalog B11), evaluated on tokens sampled from the policy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("KL estimator")
register = REGISTRY.register
names = REGISTRY.names


def estimate(name: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Look up estimator ``name`` and return the per-token KL estimate ``[N, T]`` (unmasked)."""
    return REGISTRY.get(name)(logprobs, ref_logprobs.detach())


@register("k1")
def k1(logp_NT: Tensor, ref_logp_NT: Tensor) -> Tensor:
    """k1: logpi - logpi_ref, the plain log-ratio.

    Unbiased for KL(pi || pi_ref) under samples from pi but can be negative per token; PPO-RLHF
    puts -beta k1 in the reward. Catalog B11: pi = 0.5, pi_ref = 0.4 -> 0.223144. Shapes
    ``[N, T]`` -> ``[N, T]``. Nearest neighbour: ``abs`` (|k1|, biased, >= 0); ``k3``.
    """
    return logp_NT - ref_logp_NT


@register("abs")
def abs_kl(logp_NT: Tensor, ref_logp_NT: Tensor) -> Tensor:
    """abs: |logpi - logpi_ref| (verl's ``abs``), >= 0 but biased.

    Shapes ``[N, T]`` -> ``[N, T]``. Nearest neighbour: ``k1`` without the absolute value.
    """
    return (logp_NT - ref_logp_NT).abs()


@register("k2")
def k2(logp_NT: Tensor, ref_logp_NT: Tensor) -> Tensor:
    """k2: (logpi - logpi_ref)^2 / 2 (verl's ``mse``).

    Biased for the KL value (low bias near pi_ref), but as a loss its gradient
    (logpi - logpi_ref) grad logpi is the unbiased gradient of KL(pi || pi_ref) on samples from
    pi. Catalog B11: 0.024897. Shapes ``[N, T]`` -> ``[N, T]``. Nearest neighbour: ``k3_plus``
    reports the k3 value with this gradient.
    """
    return 0.5 * (logp_NT - ref_logp_NT) ** 2


@register("k3")
def k3(logp_NT: Tensor, ref_logp_NT: Tensor) -> Tensor:
    """k3 ("low-variance KL"): exp(d) - d - 1 with d = logpi_ref - logpi, d clamped to +-20.

    Unbiased for KL(pi || pi_ref) under samples from pi and always >= 0. The result is clamped to
    [-10, 10] as in verl. Catalog B11: pi = 0.5, pi_ref = 0.4 -> 0.023144. Shapes ``[N, T]``.
    Used in the loss by GRPO (arXiv:2402.03300). Nearest neighbour: ``k1``
    (logpi - logpi_ref) is unbiased too but can be negative and has higher variance.
    """
    d = torch.clamp(ref_logp_NT - logp_NT, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


@register("k3_plus")
def k3_plus(logp_NT: Tensor, ref_logp_NT: Tensor) -> Tensor:
    """k3+: the value of ``k3`` with the gradient of ``k2`` (straight-through).

    k3_plus = k2 - sg(k2) + sg(k3). k3's expected value is the KL but its expected gradient is
    not the KL gradient; k2's gradient is (Schulman 2020; verl's ``k3+``, catalog B11). Use it
    as a loss term: the logged value is the low-variance KL estimate, the update the right one.
    Shapes ``[N, T]`` -> ``[N, T]``. Nearest neighbour: ``k3`` (value and gradient of k3).
    """
    backward = k2(logp_NT, ref_logp_NT)
    return backward - backward.detach() + k3(logp_NT, ref_logp_NT).detach()


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, *, target: float, horizon: int = 10000) -> float:
    """The adaptive KL controller's next coefficient beta, for the KL penalty in the reward.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593;
    verl ``AdaptiveKLController``:

        e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta (1 + e n_steps / horizon)

    ``current_kl`` is the batch's KL (verl: the mean over responses of each one's token-mean KL),
    ``n_steps`` the responses in the batch. The coefficient grows while the KL is above the target
    and shrinks below it, by at most 0.2 n_steps / horizon per update. A non-finite KL leaves it
    unchanged. Worked numbers: beta 0.1, KL 0.3, target 0.1 -> e = 0.2 (clipped from 2), 256
    responses, horizon 10000 -> 0.1 (1 + 0.2 * 0.0256) = 0.1005120.
    """
    if not math.isfinite(current_kl):
        return coef
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)

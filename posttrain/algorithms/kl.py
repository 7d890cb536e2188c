"""KL estimators between the policy and a frozen reference, per token.

Contract (``DESIGN.md``): ``estimate(name, logprobs, ref_logprobs) -> [N, T]``. ``logprobs``
carry gradient, ``ref_logprobs`` do not. Schulman's estimators ("Approximating KL Divergence",
2020; catalog B11), evaluated on tokens sampled from the policy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("KL estimator")
register = REGISTRY.register
names = REGISTRY.names


def estimate(name: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Look up estimator ``name`` and return the per-token KL estimate ``[N, T]`` (unmasked)."""
    return REGISTRY.get(name)(logprobs, ref_logprobs.detach())


@register("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 ("low-variance KL"): exp(d) - d - 1 with d = logpi_ref - logpi, d clamped to +-20.

    Unbiased for KL(pi || pi_ref) under samples from pi and always >= 0. The result is clamped to
    [-10, 10] as in verl. Used in the loss by GRPO (arXiv:2402.03300). Nearest neighbour: ``k1``
    (logpi - logpi_ref) is unbiased too but can be negative and has higher variance.
    """
    d = torch.clamp(ref_logprobs - logprobs, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)

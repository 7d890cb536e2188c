"""Training on the high-entropy minority of tokens ("forking tokens").

Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement
Learning for LLM Reasoning", arXiv:2506.01939: the policy gradient is kept only at the top-rho
quantile of the batch's response tokens by the entropy of the policy's next-token distribution
(rho = 0.2: 80 % of the tokens carry no gradient), and that matches or beats training on every
token. TRL's ``top_entropy_quantile`` does the same (``get_high_entropy_mask``: the threshold is the
(1 - rho) quantile of the non-padding entropies, linear interpolation, and a token is kept when its
entropy is at least the threshold); as in TRL, the dropped tokens stay in the aggregation's
normalizer (the mask multiplies the per-token policy loss; the KL and entropy terms are not masked).
The loss weight ``top_entropy`` (``algorithms/loss_weights.py``, ``algorithm.loss_weights``) applies it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropies: Tensor, mask: Tensor, rho: float) -> Tensor:
    """1.0 where a response token's entropy is in the top-``rho`` quantile of the masked tokens, else 0.

    ``entropies``, ``mask``: ``[..., T]``; ``rho`` in (0, 1] (1: every masked token). Threshold
    tau = quantile(H[mask], 1 - rho) (linear interpolation); kept = (H >= tau) and mask.
    Example: H = [0.1, 0.5, 0.9, 0.3], mask = [1, 1, 1, 0], rho = 0.5: the masked entropies sorted are
    [0.1, 0.5, 0.9], their 0.5 quantile is 0.5, so the mask is [0, 1, 1, 0].
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"top_entropy: rho must be in (0, 1]; got {rho}")
    sel = mask.bool()
    if rho == 1.0 or not sel.any():
        return sel.float()
    tau = torch.quantile(entropies[sel].float(), 1.0 - rho)
    return ((entropies.float() >= tau) & sel).float()

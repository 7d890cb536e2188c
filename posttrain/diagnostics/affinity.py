"""HINT's Affinity: how compatible the rollouts are with the policy being trained."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.diagnostics._masked import to_floats


@torch.no_grad()
def affinity(
    logprobs_NT: Tensor,
    rollout_logprobs_NT: Tensor,
    mask_NT: Tensor,
    advantages: Tensor | None = None,
    *,
    eps: float = 0.2,
) -> dict[str, float]:
    """Affinity = EUR exp(-UC / tau) between the rollout policy and the current policy.

    With rho_t = exp(logpi_t - logpi_rollout_t), token weights w_t = |A_t| (1 when ``advantages``
    is None) on masked tokens, and the in-band set B = {t : 1 - eps <= rho_t <= 1 + eps}:

      EUR (effective update ratio) = sum_{t in B} w_t / sum_t w_t
      UC (update consistency)      = sqrt(sum_{t in B} w_t (log rho_t - mu)^2 / sum_{t in B} w_t),
                                     mu = the w-weighted mean of log rho_t over B
      tau = log(1 + eps) / 2;   Affinity = EUR exp(-UC / tau)   in [0, 1].

    An on-policy batch (rho = 1 everywhere) has Affinity 1. Returns ``eur``, ``uc``,
    ``affinity``; all three are 0 when the weights sum to 0 (e.g. all advantages zero), and UC is
    0 when no token is in band, as in the reference code. Shapes: logprobs ``[N, T]``,
    advantages ``[N]`` or ``[N, T]``. Computed in float64.

    Paper: HINT (seed papers/000_99b2b1db2eead048.txt:3); formula from ViviqwerAsd/HINT @2e917e5
    ``lsrl_hint.py`` ``GRPO_step`` (catalog 3.1; the repository's first commit used the
    unweighted EUR exp(-Var(rho)) instead). HINT measures it against vLLM's generation
    log-probs with eps = 0.2, the PPO clip. Catalog test: eps = 0.2, rho = [1.0, 1.1, 1.3],
    |A| = 1 -> EUR 0.666667, UC 0.047655, tau 0.091161, Affinity 0.395255.
    """
    n = logprobs_NT.shape[0]
    g = torch.zeros(n, dtype=torch.long, device=logprobs_NT.device)  # every row in one group
    eur, uc, aff = _group_stats(logprobs_NT, rollout_logprobs_NT, mask_NT, g, 1, advantages, eps)
    return to_floats({"eur": eur[0], "uc": uc[0], "affinity": aff[0]})


@torch.no_grad()
def group_affinity(
    logprobs_NT: Tensor,
    rollout_logprobs_NT: Tensor,
    mask_NT: Tensor,
    group_ids_N: Tensor,
    advantages: Tensor | None = None,
    *,
    eps: float = 0.2,
) -> Tensor:
    """:func:`affinity` of each group's rows, one value per row ``[N]`` (float64): row i gets the
    Affinity of all rows sharing ``group_ids_N[i]``, computed as :func:`affinity` over just those rows.

    What HINT's AAPO scales a re-rolled group's loss by (``lsrl_hint.py`` ``GRPO_step`` computes
    Affinity per micro-batch, and a micro-batch there is a slice of one group). Vectorised with
    per-group sums; a group whose weights sum to 0 gets 0.
    """
    _, g = torch.unique(group_ids_N, return_inverse=True)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    return _group_stats(logprobs_NT, rollout_logprobs_NT, mask_NT, g, n_groups, advantages, eps)[2][g]


def _group_stats(
    logprobs_NT: Tensor,
    rollout_logprobs_NT: Tensor,
    mask_NT: Tensor,
    g: Tensor,
    n_groups: int,
    advantages: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """EUR, UC and Affinity of each group ``[n_groups]`` (float64); row i belongs to group ``g[i]``.

    Weights w_t = |A| (1 without advantages) on masked tokens; a group whose weights sum to 0 gets
    EUR 0, one with no weight in band UC 0 (the reference code's conventions).
    """
    rho = torch.exp(logprobs_NT.double() - rollout_logprobs_NT.double())
    m = mask_NT.to(torch.bool)
    if advantages is None:
        w = torch.ones_like(rho)
    else:
        a = advantages.double().abs()
        w = a[:, None].expand_as(rho) if a.dim() == 1 else a
    w = torch.where(m, w, torch.zeros_like(w))
    in_band = m & (rho >= 1.0 - eps) & (rho <= 1.0 + eps)
    w_in = torch.where(in_band, w, torch.zeros_like(w))
    log_rho = torch.log(rho.clamp(min=1e-12))

    def per_group(x_NT: Tensor) -> Tensor:  # sum over each group's tokens -> [n_groups]
        return torch.zeros(n_groups, dtype=x_NT.dtype, device=x_NT.device).index_add_(0, g, x_NT.sum(-1))

    w_sum, w_in_sum = per_group(w), per_group(w_in)
    mu = per_group(w_in * log_rho) / w_in_sum.clamp(min=1e-300)
    var = per_group(w_in * (log_rho - mu[g][:, None]) ** 2) / w_in_sum.clamp(min=1e-300)
    uc = torch.where(w_in_sum > 1e-8, var.clamp(min=0).sqrt(), torch.zeros_like(var))
    eur = torch.where(w_sum > 1e-8, w_in_sum / w_sum.clamp(min=1e-300), torch.zeros_like(w_sum))
    tau = max(math.log1p(eps) / 2.0, 1e-8)
    return eur, uc, eur * torch.exp(-uc / tau)

"""Importance ratios against the rollout policy, clip fractions, and KL to the reference."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms import kl
from posttrain.diagnostics._masked import masked_mean, to_floats


@torch.no_grad()
def ratio_stats(
    logprobs_NT: Tensor,
    old_logprobs_NT: Tensor,
    advantages: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> dict[str, float]:
    """Statistics of rho_t = exp(logpi_t - logpi_old_t) over response tokens.

    - ``ratio_mean`` / ``ratio_max`` / ``ratio_min`` over masked tokens.
    - ``clip_frac_low`` = mean_t 1[rho_t < 1 - eps_low and A_t < 0],
      ``clip_frac_high`` = mean_t 1[rho_t > 1 + eps_high and A_t > 0], ``clip_frac`` their sum:
      the tokens where PPO's clip is active, i.e. whose gradient the clipped surrogate zeroes.
      TRL's GRPOTrainer logs the same two (``clip_ratio/low_mean``, ``clip_ratio/high_mean``);
      verl's ``pg_clipfrac`` (clipped loss > unclipped loss) equals ``clip_frac``. A token
      with ratio out of the band but an advantage of the other sign is not clipped: not counted.
    - ``approx_kl`` = mean_t k3(old -> new) = mean_t (rho_t - 1) - log rho_t, the low-variance
      estimate of KL(pi_old || pi) on tokens sampled from pi_old (cleanrl's ``approx_kl``).

    Shapes: logprobs, old_logprobs, mask ``[N, T]``; advantages ``[N]`` (per sequence) or
    ``[N, T]``. Means are token-level; NaN for an empty mask.
    """
    adv_NT = advantages[:, None].expand_as(logprobs_NT) if advantages.dim() == 1 else advantages
    ratio_NT = torch.exp(logprobs_NT.float() - old_logprobs_NT.float())
    m = mask_NT.to(torch.bool)
    low = (ratio_NT < 1.0 - eps_low) & (adv_NT < 0)
    high = (ratio_NT > 1.0 + eps_high) & (adv_NT > 0)
    nan = torch.tensor(float("nan"), device=ratio_NT.device)
    return to_floats(
        {
            "ratio_mean": masked_mean(ratio_NT, m),
            "ratio_max": ratio_NT[m].max() if m.any() else nan,
            "ratio_min": ratio_NT[m].min() if m.any() else nan,
            "clip_frac_low": masked_mean(low.float(), m),
            "clip_frac_high": masked_mean(high.float(), m),
            "clip_frac": masked_mean((low | high).float(), m),
            # k3 with the roles of kl.k3 swapped: samples come from pi_old, so pi_old is "the policy"
            "approx_kl": masked_mean(kl.k3(old_logprobs_NT.float(), logprobs_NT.float()), m),
        }
    )


@torch.no_grad()
def kl_to_reference(logprobs_NT: Tensor, ref_logprobs_NT: Tensor, mask_NT: Tensor) -> dict[str, float]:
    """Token-mean KL(pi || pi_ref) estimates on tokens sampled from pi: ``kl_k1`` and ``kl_k3``.

    k1_t = logpi_t - logpi_ref_t (unbiased, can be negative); k3_t = exp(d) - d - 1 with
    d = logpi_ref_t - logpi_t (unbiased, >= 0). Same functions as ``posttrain.algorithms.kl``
    (Schulman, "Approximating KL Divergence", 2020). Shapes ``[N, T]``; NaN for an empty mask.
    """
    return to_floats(
        {
            "kl_k1": masked_mean(kl.k1(logprobs_NT.float(), ref_logprobs_NT.float()), mask_NT),
            "kl_k3": masked_mean(kl.k3(logprobs_NT.float(), ref_logprobs_NT.float()), mask_NT),
        }
    )

"""Soft sequence-level surrogates: a smooth weight on the sequence importance ratio in place of a hard clip.

Entries register in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract:
``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> loss [N, T]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.losses_common import register

# VESPO clamps every log-weight to [log 1e-8, 20] (TRL and the authors' code): 1e-8 is the smallest weight
LOG_W_MIN = math.log(1e-8)
LOG_W_MAX = 20.0


def _check_gamma(k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float) -> None:
    """Reject Gamma-kernel parameters outside the kernel's domain (k >= 0, lambda > 0, finite)."""
    for key, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{key} (VESPO's power exponent) must be a finite number >= 0; got {value!r}")
    for key, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{key} (VESPO's decay rate) must be a finite number > 0; got {value!r}")


@torch.no_grad()
def gamma_weights(
    log_ratio_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    behaviour_weights_NT: Tensor | None = None,
) -> Tensor:
    """VESPO's kernel phi(w_i) = e^lam w_i^k e^(-lam w_i) on the sequence weight, per token ``[N, T]`` (no grad).

    log w_i = sum_t m_t clamp(log_ratio_t, -20, 20) (+ sum_t m_t clamp(log c_t, log 1e-8, 20) with behaviour
    weights c_t), clamped to [log 1e-8, 20]; (k, lam) = (k_pos, lambda_pos) where A >= 0, else the _neg pair.
    Computed in log space: log phi = lam + k log w - lam w; phi(1) = 1.
    """
    seq_log_w_N1 = (torch.clamp(log_ratio_NT, -20.0, 20.0) * mask_NT).sum(-1, keepdim=True)
    if behaviour_weights_NT is not None:  # pi_old / mu per token: log w becomes log pi_theta / mu (TRL's fold)
        log_c_NT = torch.clamp(torch.log(behaviour_weights_NT.to(log_ratio_NT.dtype)), LOG_W_MIN, LOG_W_MAX)
        seq_log_w_N1 = seq_log_w_N1 + (log_c_NT * mask_NT).sum(-1, keepdim=True)
    log_w_N1 = torch.clamp(seq_log_w_N1, LOG_W_MIN, LOG_W_MAX)
    nonneg_NT = adv_NT >= 0
    k_NT = torch.where(nonneg_NT, k_pos, k_neg).to(log_ratio_NT.dtype)
    lam_NT = torch.where(nonneg_NT, lambda_pos, lambda_neg).to(log_ratio_NT.dtype)
    log_phi_NT = lam_NT + k_NT * log_w_N1 - lam_NT * torch.exp(log_w_N1)
    return torch.exp(log_phi_NT).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register("vespo")
def vespo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    behaviour_weights: Tensor | None = None,
) -> Tensor:
    """VESPO: REINFORCE weighted by a smooth Gamma kernel of the sequence ratio, l_it = -sg(phi(w_i)) A_it logpi_it.

    w_i = prod_t pi_theta(y_t) / pi_old(y_t) over the response's tokens (a product: no 1/|y| length
    normalization, unlike ``gspo``), log w clamped to [log 1e-8, 20]; phi(w) = e^lam w^k e^(-lam w), a Gamma
    density scaled so that phi(1) = 1, peaking at w = k / lam and decaying to 0 for w -> 0 and w -> inf:
    (k, lam) = (k_pos, lambda_pos) = (2, 3) for A >= 0 (peak at 2/3: trust responses the policy now finds
    less likely, damp those it already favours), (k_neg, lambda_neg) = (3, 2) for A < 0 (peak at 1.5).
    phi is detached, so d l_it / d logpi_it = -phi(w_i) A_it; at w = 1 that is the policy gradient -A.
    Behaviour correction: an off-policy correction's weights c_t = pi_old / mu (``algorithm.behaviour_correction``
    tis, icepop or seq_mask) arrive as ``behaviour_weights [N, T]`` and are folded into the sequence weight,
    log w_i += sum_t log c_t (each clamped to [log 1e-8, 20]), so w_i becomes pi_theta / mu as in the paper and
    TRL; they do not multiply the loss. A sequence correction that repeats one ratio on every token (mis)
    would count it |y| times, so the config refuses it. Shapes: all ``[N, T]`` -> ``[N, T]``.
    Aggregation: TRL sums the masked per-token loss and divides by the batch's token count
    (``loss_type="vespo"`` shares the normalizer of "dapo"/"cispo"): that is ``token_mean`` here (the default;
    exact when one minibatch is TRL's generation batch; TRL's later accumulation windows divide by the
    batch's mean window count instead of the window's own).
    Hand example: token log-ratios [0.1, 0.2] -> log w = 0.3, w = 1.349859; A = +1: log phi = 3 + 2 * 0.3
    - 3 * 1.349859 = -0.449576, phi = 0.637898, l_t = -0.637898 logpi_t; A = -1: log phi = 2 + 3 * 0.3
    - 2 * 1.349859 = 0.200282, phi = 1.221748.
    Paper: "VESPO: Variational Sequence-Level Soft Policy Optimization for Stable Off-Policy LLM Training",
    arXiv:2602.10693 (code FloyedShen/VESPO); form, defaults and clamps read in TRL 1.16
    ``GRPOTrainer.get_gamma_weights``. Nearest neighbour: ``gspo`` hard-clips a length-normalized sequence
    ratio (a gradient of 0 or full weight); ``sapo`` soft-gates each token's own ratio; ``cispo`` has the same
    REINFORCE form with a clipped token weight.
    """
    _check_gamma(k_pos, lambda_pos, k_neg, lambda_neg)
    phi_NT = gamma_weights(
        logp_NT.detach() - old_logp_NT, adv_NT, mask_NT, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
        lambda_neg=lambda_neg, behaviour_weights_NT=behaviour_weights,
    )
    return -phi_NT * adv_NT * logp_NT

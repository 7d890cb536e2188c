"""f-GRPO: a policy loss from the variational form of an f-divergence (provisional, a third-party rendering).

The entry registers in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract:
``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> loss [N, T]``.

The paper's text was not reachable; the formula is a third-party rendering (issue 37 item 2, catalog L179), so
the entry is provisional: its form, its defaults and its normalizer are not confirmed against the authors' code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.losses_common import _log_ratio, register

# divergence -> (g, f* o g): the positive rows' term is -g(r), the others' f*(g(r)), both written as functions of r
DIVERGENCES = ("pearson", "hellinger")

_TOKEN_MEAN = ("the rendering normalizes the summed per-token terms by the batch's token count; another "
               "aggregation would weigh the rows differently")


def _terms(r_NT: Tensor, divergence: str) -> tuple[Tensor, Tensor]:
    """(-g(r), f*(g(r))) per token for ``divergence``.

    Pearson chi^2: g(r) = r, f*(s) = s + s^2 / 4 -> (-r, r + r^2 / 4).
    Squared Hellinger: g(r) = 1 - e^(-r), f*(s) = s / (1 - s) -> (e^(-r) - 1, e^r - 1): with s = 1 - e^(-r),
    1 - s = e^(-r) and s / (1 - s) = (1 - e^(-r)) e^r = e^r - 1, written with ``expm1`` (no 0 / 0 at r = 0).
    """
    if divergence == "pearson":
        return -r_NT, r_NT + r_NT.pow(2) / 4.0
    return torch.expm1(-r_NT), torch.expm1(r_NT)


@register("fdiv_grpo", aggregation="token_mean", note=_TOKEN_MEAN)
def fdiv_grpo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    ref_logprobs: Tensor,
    divergence: str = "pearson",
    beta: float = 0.1,
    gamma: float = 0.0,
) -> Tensor:
    """f-GRPO, provisional (third-party rendering): l_t = |A| (-g(r_t)) where A > 0, |A| f*(g(r_t)) elsewhere.

    r_t = beta (log pi_theta_t - log pi_ref_t) + gamma (log pi_theta_t - log pi_old_t) is the per-token implicit
    reward (each log-ratio clamped to [-20, 20]); g and the convex conjugate f* come from the variational
    representation D_f(P || Q) >= E_P[g] - E_Q[f*(g)] with P the above-average responses and Q the others, so
    minimising the loss maximises the divergence estimate between them. ``divergence = "pearson"`` (chi^2):
    g = identity, positive term -r, negative term r + r^2 / 4; ``"hellinger"``: g(r) = 1 - e^(-r),
    f*(s) = s / (1 - s), terms e^(-r) - 1 and e^r - 1. No ratio clip; the declared ``token_mean`` aggregation
    normalizes by the token count. ``gamma`` is the gamma (log pi_theta - log pi_old) a review reports in the
    released trainer; where it enters is not said, here it is added to r (default 0: the rendering's formula).
    Unconfirmed: the default beta = 0.1 (a DPO-like scale, ours), the normalizer (the catalog's reconstruction
    divides by sum |A_i| instead), and whether rows with A = 0 count as negative (here they do, with weight 0).
    At pi_theta = pi_ref (r = 0) both divergences give the gradient beta x the policy gradient, -beta A on
    log pi_t; away from it they differ: chi^2's negative rows push down with beta |A| (1 + r / 2), harder the
    more pi_theta over-weights the token, and Hellinger's positive term is bounded below by -|A| (its pull up
    decays as e^(-r)).
    Shapes: ``logp_NT``, ``old_logp_NT``, ``ref_logprobs``, ``mask_NT`` ``[N, T]``; ``adv_NT`` ``[N, T]`` (a
    row's advantage repeated) -> ``[N, T]``. Example (chi^2, beta = 0.5, log pi_theta - log pi_ref = 1): r = 0.5;
    A = 2 -> -2 x 0.5 = -1; A = -1 -> 0.5 + 0.0625 = 0.5625.
    Paper: f-Group Relative Policy Optimization (f-GRPO) and f-HAL, arXiv:2602.05946 (the id as catalog L179 gives
    it), seed papers/004_f298e9ec572f7f27.txt:179; f-HAL (the hybrid on/off-policy objective) is not built.
    Nearest neighbour: ``reinforce`` (l_t = -A log pi_t): the same gradient at pi_theta = pi_ref up to beta, but
    a constant weight where this one's depends on r.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence (f-GRPO's f) must be one of {DIVERGENCES}; got {divergence!r}")
    if not beta > 0:
        raise ValueError(f"beta (f-GRPO's implicit-reward scale) must be > 0; got {beta!r}")
    r_NT = beta * _log_ratio(logp_NT, ref_logprobs)
    if gamma != 0.0:
        r_NT = r_NT + gamma * _log_ratio(logp_NT, old_logp_NT)
    pos_NT, neg_NT = _terms(r_NT, divergence)
    return adv_NT.abs() * torch.where(adv_NT > 0, pos_NT, neg_NT)

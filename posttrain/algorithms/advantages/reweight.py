"""Seed methods that change the group baseline or rescale GRPO: QAE, NGRPO, MAPO, F-GRPO, Pass@k."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _correct, _group_std, register
from posttrain.algorithms.advantages.group import grpo


@register("qae")
def qae(rewards: Tensor, *, quantile: float = 0.4, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """QAE: A_i = (r_i - Q_K(r)) / (std_g r + eps), the group mean replaced by the K-quantile.

    Q_K is ``torch.quantile`` with linear interpolation, so small groups interpolate between
    rewards ([1,0,0,1], K=0.4 gives Q=0.2) and the clean two-regime gate of the paper only holds
    when the quantile lands inside a block of equal rewards. Shapes: ``[P, G]`` -> ``[P, G]``.
    Paper: "Quantile Advantage Estimation for Entropy-Safe Reasoning", Wu et al. 2025,
    arXiv:2509.22611, seed ``papers/004_f298e9ec572f7f27.txt:67`` (catalog 3.24; formula from a
    third-party copy of the authors' README line, provisional). Std convention: **unbiased**
    (GRPO/DAPO's). The authors' code falls back to the mean outside 0 < K < 1; here K must lie in
    [0, 1] (0 = min, 1 = max). A group of one gets 0. Nearest neighbour: ``grpo`` (K = median-ish
    mean baseline); QAE's baseline makes ~80% of advantages zero on binary rewards.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1]; got {quantile}")
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    q_P1 = torch.quantile(rewards, quantile, dim=1, keepdim=True)
    return (rewards - q_P1) / (_group_std(rewards, std) + eps)


@register("ngrpo")
def ngrpo(
    rewards: Tensor,
    *,
    num_virtual: int = 1,
    virtual_reward: float = 1.0,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """NGRPO advantage calibration: GRPO statistics over the group plus virtual max-reward samples.

    A_i = (r_i - mean(r U {r_max}^K)) / (std(r U {r_max}^K) + eps), K = ``num_virtual``, r_max =
    ``virtual_reward``; the virtual samples enter the statistics only. An all-wrong group then
    gets negative advantages instead of 0. Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "NGRPO:
    Negative-enhanced Group Relative Policy Optimization", Nan et al. 2025, arXiv:2509.18851, seed
    ``papers/004_f298e9ec572f7f27.txt:57`` (catalog 3.22; authors' ``add_max_reward_num=1``).
    Std convention: **unbiased** over the augmented group. The paper pairs it with asymmetric
    clipping (eps_low 0.16, eps_high 0.24: a loss setting) and drops all-correct groups (a
    selection setting). A group of one still gets a signal (the virtual sample is its baseline).
    Nearest neighbour: ``grpo`` (K = 0).
    """
    if num_virtual < 0:
        raise ValueError(f"num_virtual must be >= 0; got {num_virtual}")
    virtual_PK = rewards.new_full((rewards.shape[0], num_virtual), virtual_reward)
    aug_PGK = torch.cat([rewards, virtual_PK], dim=1)
    if aug_PGK.shape[1] < 2:
        return torch.zeros_like(rewards)
    mean_P1 = aug_PGK.mean(dim=1, keepdim=True)
    return (rewards - mean_P1) / (_group_std(aug_PGK, std) + eps)


@register("mapo")
def mapo(rewards: Tensor, *, eps: float = 1e-6) -> Tensor:
    """MAPO: mix the GRPO advantage and the "advantage percent deviation" by trajectory certainty.

    p = fraction correct, lambda = 1 - 4 p (1 - p) (0 for a 50/50 group, 1 for a uniform one);
    A_i = (1 - lambda) (r_i - mu) / (sigma_u + eps) + lambda (r_i - mu) / (mu + eps).
    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "MAPO: Mixed Advantage Policy Optimization", Huang et
    al. 2025, arXiv:2509.18849, seed ``papers/004_f298e9ec572f7f27.txt:25`` (catalog 3.13, from
    the authors' code). Std convention: **unbiased**. The percent deviation divides by the group
    mean, so it assumes {0, 1} rewards (mu = pass rate >= 0); the authors count ``r == 1`` where
    this counts reward > 0.5 (the same on binary rewards). Computed per group, so it does not
    share the authors' code's assumption of contiguous, ordered groups. A group of one gets 0.
    Nearest neighbour: ``grpo`` (lambda = 0).
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    p_P1 = _correct(rewards).mean(dim=1, keepdim=True)
    lam_P1 = 1.0 - 4.0 * p_P1 * (1.0 - p_P1)
    mean_P1 = rewards.mean(dim=1, keepdim=True)
    percent_PG = (rewards - mean_P1) / (mean_P1 + eps)
    return (1.0 - lam_P1) * grpo(rewards, std="unbiased", eps=eps) + lam_P1 * percent_PG


@register("f_grpo")
def f_grpo(rewards: Tensor, *, gamma: float = 1.0, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """F-GRPO focal scaling: A'_i = (1 - p)^gamma * A_i, p = fraction correct in the group.

    Down-weights easy (high-success) prompts so that rare correct modes are not forgotten.
    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "F-GRPO: Don't Let Your Policy Learn the Obvious and
    Forget the Rare", Plyusov et al. 2026, arXiv:2602.06717, seed
    ``papers/004_f298e9ec572f7f27.txt:165`` (catalog L165, from summaries). **gamma = 1.0 is our
    value, not the paper's**: no authors' code was found (code, issue and page searches for the
    arXiv id and the method name) and the paper's gamma was not recovered; 1.0 is the catalog's
    worked example (L165), the plain linear weight 1 - p. Tune it. Base advantage: GRPO with
    ``std`` (**unbiased** by default); the paper also applies the
    factor to DAPO and CISPO. A group of one gets 0. Nearest neighbour: ``grpo`` (gamma = 0).
    """
    focal_P1 = (1.0 - _correct(rewards).mean(dim=1, keepdim=True)) ** gamma
    return focal_P1 * grpo(rewards, std=std, eps=eps)


def _comb_ratio(a: Tensor, b: int, n: int, k: int) -> Tensor:
    """C(a, b) / C(n, k) elementwise over ``a`` in float64; 0 where a < b."""
    a64 = a.double()
    valid = a64 >= b
    a_safe = torch.where(valid, a64, torch.full_like(a64, float(b)))
    log_num = torch.lgamma(a_safe + 1) - math.lgamma(b + 1) - torch.lgamma(a_safe - b + 1)
    log_den = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return torch.where(valid, torch.exp(log_num - log_den), torch.zeros_like(a64))


@register("passk")
def passk(rewards: Tensor, *, k: int = 4, eps: float = 1e-6) -> Tensor:
    """Pass@k Training analytic advantage (rewards are pass/fail).

    n = G, c = #correct; rho = 1 - C(n-c, k) / C(n, k) (the group's pass@k), sigma =
    sqrt(rho (1 - rho)); correct: A_pos = (1 - rho) / (sigma + eps); wrong: A_neg = (1 - rho -
    C(n-c-1, k-1) / C(n-1, k-1)) / (sigma + eps). Shapes: ``[P, G]`` -> ``[P, G]``.
    Paper: "Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large
    Reasoning Models", Chen et al. 2025, arXiv:2508.10751, seed
    ``papers/004_f298e9ec572f7f27.txt:35`` (catalog 3.18, from the authors' ``calc_adv``).
    Std convention: sigma is the Bernoulli std of the group pass@k; k = 1 gives GRPO with the
    **population** std. The default k = 4 is not pinned in the catalog. A uniform group
    (rho in {0, 1}) gets 0. Nearest neighbour: ``grpo_passk`` (verl) credits only the best
    sample; this credits every sample analytically.
    """
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, G={n}]; got {k}")
    c_PG = _correct(rewards)
    c_P1 = c_PG.sum(dim=1, keepdim=True)
    rho = 1.0 - _comb_ratio(n - c_P1, k, n, k)
    sigma = torch.sqrt((rho * (1.0 - rho)).clamp(min=0.0))
    a_pos = (1.0 - rho) / (sigma + eps)
    a_neg = (1.0 - rho - _comb_ratio(n - c_P1 - 1, k - 1, n - 1, k - 1)) / (sigma + eps)
    adv = torch.where(c_PG > 0, a_pos, a_neg)
    adv = torch.where(sigma > 1e-12, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)

"""Hybrid-policy surrogates: one loss over groups that mix on-policy samples with external ones.

Entries register in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract:
``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> loss [N, T]``.
The rows that are external (a demonstration the ``external_mix`` rollout driver put in the group,
``posttrain/produce/drivers/external_mix.py``) arrive as the row input ``external [N]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.losses_common import _log_ratio, register


def _row_flags(flags: Tensor, like_NT: Tensor) -> Tensor:
    """A per-row flag ``[N]`` (or already per token, ``[N, T]``) as a 0/1 tensor shaped like ``like_NT``."""
    f = flags.to(like_NT.dtype)
    return (f if f.dim() == 2 else f[:, None]).expand_as(like_NT)


@register("rl_plus")
def rl_plus(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    external: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_upper_bound: float = 1.0,
    clip: bool = True,
    off_max_clip: float | None = None,
    off_min_clip: float | None = None,
) -> Tensor:
    """RL-PLUS: PPO clip on on-policy tokens; importance mixture and exploration advantage on external ones.

    On-policy rows (``external`` 0): rho_t = pi_theta / pi_old, l_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, U)),
    U = max(clip_upper_bound, 1 + eps_high) (``clip = False``: l_t = -A rho_t, the released script's
    ``loss_remove_clip``).
    External rows (``external`` 1), with probabilities p = exp(logp), not log-probs:
    omega_t = (pi_old_t + 1) / 2, r_t = 2 pi_theta_t / (pi_old_t + omega_t) (unclipped unless ``off_max_clip`` /
    ``off_min_clip`` are set), A^expl_t = A (1 - sg(pi_theta_t))^(1/2), l_t = -r_t A^expl_t.
    pi_old is the learner's policy before the update (recomputed, or the current one detached on an on-policy
    update), as the authors' trainer recomputes ``old_log_prob`` over the whole batch, external rows included:
    the demonstration's own generator is unknown, so the mixture (pi_old + 1) / 2 stands in for it
    (the "1" being a behaviour policy that puts all its mass on the demonstration's token).
    Shapes: ``[N, T]`` -> ``[N, T]``; ``external [N]`` (or ``[N, T]``), bool or 0/1. Aggregate with ``token_mean``
    (the authors' ``masked_mean`` over every token of the minibatch).
    Paper: RL-PLUS, arXiv:2508.00222 (seed ``papers/004_f298e9ec572f7f27.txt: 7``, catalog 3.10); pinned from
    YihongDong/RL-PLUS @ eb4aa4d4e2, ``rlplus_core_alg.py`` ``compute_token_on_off_policy_loss`` with
    ``off_policy_strategy = "RL-PLUS"``. The authors' single ``cliprange`` is ``eps_low = eps_high``.
    At pi_theta = pi_old the external gradient on log pi_theta is -A^expl_t 2p / (p + omega): 0.8 of the plain
    policy gradient's at p = 0.5, damped as p -> 1 (the demonstration's token is already likely).
    Nearest neighbour: ``ppo_clip`` (the on-policy half, the same with ``clip_upper_bound <= 1 + eps_high``);
    LUFFY's off-policy term uses r_t = pi_theta_t without the mixture or the exploration weight.
    """
    for key, value in (("off_max_clip", off_max_clip), ("off_min_clip", off_min_clip)):
        if value is not None and not value > 0:
            raise ValueError(f"{key} must be > 0 (a bound on the external ratio); got {value!r}")
    ext_NT = _row_flags(external, logp_NT)
    ratio = torch.exp(_log_ratio(logp_NT, old_logp_NT))
    on = -adv_NT * ratio
    if clip:
        upper = max(clip_upper_bound, 1.0 + eps_high)
        on = torch.maximum(on, -adv_NT * torch.clamp(ratio, 1.0 - eps_low, upper))
    p_NT = torch.exp(logp_NT)
    p_old_NT = torch.exp(old_logp_NT)
    omega_NT = 0.5 * (p_old_NT + 1.0)
    r_off = 2.0 * p_NT / (p_old_NT + omega_NT)
    if off_max_clip is not None:
        r_off = torch.clamp(r_off, max=off_max_clip)
    if off_min_clip is not None:
        r_off = torch.clamp(r_off, min=off_min_clip)
    explore = adv_NT * torch.sqrt((1.0 - p_NT.detach()).clamp(min=0.0))
    off = -r_off * explore
    return torch.where(ext_NT > 0, off, on)

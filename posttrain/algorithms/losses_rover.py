"""ROVER: the log-ratio regressed onto the advantage plus the next state's change of mean log-softmax.

The entry registers in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract:
``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> loss [N, T]``.
Beyond the log-probs it reads two per-token inputs that the update provides (``config.LOSS_INPUTS``):
``mean_logsoftmax`` (m_theta(s_t) = mean_a log softmax(z_t)_a of the current policy's temperature-scaled
logits z_t) and ``old_mean_logsoftmax`` (the same under pi_old).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.losses_common import register


def _check(rover_t: float, eps_low: float, eps_high: float) -> None:
    """Reject parameters outside ROVER's domain (rover_t > 0; 0 < eps_low < 1; eps_high > 0)."""
    if not (isinstance(rover_t, int | float) and math.isfinite(rover_t) and rover_t > 0):
        raise ValueError(f"rover_t (ROVER's scale of Q) must be a finite number > 0; got {rover_t!r}")
    if not (isinstance(eps_low, int | float) and 0 < eps_low < 1):
        raise ValueError(f"eps_low (the clip's log(1 - eps_low) bound) must be in (0, 1); got {eps_low!r}")
    if not (isinstance(eps_high, int | float) and math.isfinite(eps_high) and eps_high > 0):
        raise ValueError(f"eps_high (the clip's log(1 + eps_high) bound) must be a finite number > 0; got {eps_high!r}")


def next_state_term(mean_logsoftmax_NT: Tensor, old_mean_logsoftmax_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """ROVER's next-state value change at every token, ``[N, T]``: m_theta(s_{t+1}) - m_old(s_{t+1}).

    Position t reads position t + 1 (the state after token t), masked by the loss mask there, so it is 0 at
    each response's last token (and wherever the next position is masked out), as in the authors'
    ``torch.cat([(current_q[:, 1:] - old_logits[:, 1:]) * response_mask[:, 1:], 0])``.
    """
    dm_NT = (mean_logsoftmax_NT - old_mean_logsoftmax_NT) * mask_NT
    return torch.cat([dm_NT[:, 1:], torch.zeros_like(dm_NT[:, :1])], dim=1)


@register("rover")
def rover(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    mean_logsoftmax: Tensor,
    old_mean_logsoftmax: Tensor,
    rover_t: float = 1.0,
    use_rover_clip: bool = False,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """ROVER: l_t = (Q_t - sg(target_t))^2, a regression of the scaled log-ratio onto advantage + next-state term.

    Q_t = rho (log pi_theta(a_t|s_t) - log pi_old(a_t|s_t)), rho = ``rover_t`` = 1 (the Q-function of the
    uniformly random policy, parameterized by the log-ratio to pi_old);
    next_t = rho (m_theta(s_{t+1}) - m_old(s_{t+1})), m(s) = mean over the vocabulary of log softmax(logits)
    (the code's ``sum_log_softmax``, despite its name a mean), 0 at the last token (:func:`next_state_term`);
    target_t = A_hat + next_t with A_hat the GRPO std-normalized advantage broadcast to tokens.
    m_theta is detached, as the code's ``target.detach()`` makes it: the gradient is 2 (Q_t - target_t) rho
    d logpi_t. On-policy (one minibatch, one epoch) Q = 0 and next = 0, so the gradient is -2 rho A_hat
    d logpi_t: twice the policy gradient. Later minibatches regress the log-ratio onto the target, pulling it
    back down once it passes A_hat + next_t (a squared loss, no clip needed).
    ``use_rover_clip`` (off in the authors' script): where Q_t > log(1 + eps_high) and the target lies above
    Q, or Q_t < log(1 - eps_low) and the target lies below, Q is replaced by that bound, a constant, so the
    token has no gradient (the code's one ``clip_ratio`` is eps_low = eps_high).
    Temperature: the code divides the logits by the sampling temperature before both log pi and m (so does
    the update here: ``mean_logsoftmax`` is computed from the temperature-scaled logits); the mean runs over
    the whole output head (padded vocabulary included), as there.
    Aggregation: the code's ``compute_rover_loss`` is a masked mean over the micro-batch's tokens: that is
    ``token_mean`` (exact for one micro-batch a minibatch; verl's dynamic batches scale each micro-batch's
    token mean by its share of the rows). Shapes: all ``[N, T]`` -> ``[N, T]``.
    Hand example (catalog L227): dlogpi_t = 0.1, A_hat = 1.0, next-state dm = 0.02: Q = 0.1,
    target = 1.02, l_t = (0.1 - 1.02)^2 = 0.8464.
    Paper: "Random Policy Valuation is Enough for LLM Reasoning with Verifiable Rewards", arXiv:2509.24981
    seed papers/004_f298e9ec572f7f27.txt:227 (code tinnerhrhe/ROVER @b0fa587, ``DataParallelROVERActor.update_policy``,
    ``compute_rover_loss``). Nearest neighbour: ``apa`` also regresses the log-ratio to pi_old, onto coef x A
    (coef = 10) with no next-state term; ``ppo_clip`` maximizes ratio x A instead of regressing the log-ratio.
    """
    _check(rover_t, eps_low, eps_high)
    q_NT = rover_t * (logp_NT - old_logp_NT)
    next_NT = rover_t * next_state_term(mean_logsoftmax, old_mean_logsoftmax, mask_NT)
    target_NT = (adv_NT + next_NT).detach()
    if use_rover_clip:
        hi, lo = math.log1p(eps_high), math.log1p(-eps_low)
        high = (target_NT > q_NT) & (q_NT > hi)
        low = (target_NT < q_NT) & (q_NT < lo)
        q_NT = torch.where(high, hi, torch.where(low, lo, q_NT))
    return (q_NT - target_NT) ** 2

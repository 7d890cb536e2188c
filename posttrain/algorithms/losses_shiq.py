"""ShiQ (Shifted-Q): an off-policy, token-level Q-learning loss in which the policy's logits are the Q-values.

The entry registers in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract ``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> [N, T]``.
Beyond the log-probs it reads what the update provides by name (``config.LOSS_INPUTS``): the reference's log-probs
``ref_logprobs``, the log-partition of the current policy's logits ``logsumexp`` (it carries gradient, like the
log-probs: ``losses_common.GRAD_INPUTS``), the reference's ``ref_logsumexp`` and each row's reward ``rewards``.
"""

from __future__ import annotations

import math

from torch import Tensor

from posttrain.algorithms.losses_common import register


def returns_to_go(x_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """sum_{k >= t} m_k x_k at every position t, ``[N, T]`` (a reverse cumulative sum over the trained tokens)."""
    x_NT = x_NT * mask_NT
    return x_NT.flip(-1).cumsum(-1).flip(-1)


@register("shiq")
def shiq(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    ref_logprobs: Tensor,
    logsumexp: Tensor,
    ref_logsumexp: Tensor,
    rewards: Tensor,
    beta: float = 0.1,
) -> Tensor:
    """ShiQ: l_t = (beta (sum_{k>=t} log pi/pi_ref (a_k|s_k) + V(s_t) - V_ref(s_t)) - R_t)^2, V = logsumexp(logits).

    The KL-regularized token MDP (deterministic transitions s' = s + a, reward r, strength beta) has the soft
    Bellman equation q(s,a) = r(s,a) + beta log sum_a' pi_ref(a'|s') exp(q(s',a')/beta) and the optimal policy
    pi* ~ pi_ref exp(q/beta). ShiQ's three steps, each a change of the loss's variable:
    (1) easing sampling: logits g = q/beta + log pi_ref, so pi* = softmax(g), with no reference at inference;
    (2) improving initialization ("shifted"): g = q/beta + l_ref(s,a), l_ref the reference's raw logits (a
    potential-based shift by V_ref(s) = logsumexp_a l_ref(s,a), which leaves pi* unchanged), so at r = 0 the
    solution is the reference's own logits and training starts at a fixed point; with log pi = l - V(s) the
    Bellman equation becomes log pi/pi_ref (a_t|s_t) = r_t/beta + D(s_{t+1}) - D(s_t), D = V - V_ref;
    (3) multi-step: summed from t to the end (D = 0 after the last token), it telescopes to
    sum_{k>=t} log pi/pi_ref (a_k|s_k) + D(s_t) = sum_{k>=t} r_k / beta, so a sparse reward reaches every token
    in one update. The loss is the squared residual of (3) at every token, scaled by beta (reward units).
    Here R_t = sum_{k>=t} r_k = ``rewards`` (the outcome reward sits on the last token; gamma = 1);
    V(s_t) = ``logsumexp`` [N, T] of the policy's (temperature-scaled) logits at position t, with gradient:
    the logits' level is the value, which no log-prob loss sees; ``ref_logsumexp`` the reference's; the
    sums run over the trained tokens (``mask``). ``advantages`` and ``old_logprobs`` are unused (off-policy:
    the rows may come from any sampler). Fixed points: the reference itself when r = 0 (loss and gradient 0
    at the start of training on a reward-free batch), and logits l_ref + q/beta for every trajectory.
    Gradient: d/dlog pi_k of sum_t l_t = 2 beta sum_{t<=k} e_t, d/dV(s_t) = 2 beta e_t, e_t the residual.
    Aggregation: the paper's objective sums over tokens and averages over sequences (``seq_mean_token_sum``).
    Hand example (beta = 0.5, r = 1): log-ratios [0.2, 0.0] -> S = [0.2, 0.0]; D = [0.1, -0.2];
    beta (S + D) = [0.15, -0.1]; l = (0.15 - 1)^2, (-0.1 - 1)^2 = [0.7225, 1.21].
    A response cut at max_new_tokens is treated as ended (D = 0 after its last token).
    Paper: "ShiQ: Bringing back Bellman to LLMs", Clavier et al., arXiv:2505.11081, seed
    papers/004_f298e9ec572f7f27.txt:239. No code was released; the loss is rebuilt from the paper's three
    steps (catalog L239 recovered no formula); beta = 0.1 is not the paper's value (not recovered).
    Nearest neighbours: ``a_star_po`` regresses beta log pi/pi_ref of the whole sequence onto r - V*(x) with
    V* estimated from reference samples (one residual a sequence, no value in the logits); ``rover`` regresses
    the log-ratio to pi_old with a detached next-state term (on-policy valuation, not Q-learning).
    """
    if not (isinstance(beta, int | float) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta (ShiQ's KL strength) must be a finite number > 0; got {beta!r}")
    sum_log_ratio_NT = returns_to_go(logp_NT - ref_logprobs, mask_NT)
    shift_NT = logsumexp - ref_logsumexp  # D(s_t) = V(s_t) - V_ref(s_t)
    reward_NT = rewards.to(logp_NT.dtype)[:, None].expand_as(logp_NT)
    return (beta * (sum_log_ratio_NT + shift_NT) - reward_NT) ** 2

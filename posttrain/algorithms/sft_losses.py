"""Losses of supervised fine-tuning on demonstrations (``posttrain sft``, chosen by ``sft.loss``).

Contract: ``compute(name, logprobs, mask, **inputs_and_params) -> [N, T]``, the per-token loss on the
demonstration tokens (zero where ``mask`` is 0), which the trainer averages over the trained tokens
(``sum(loss) / sum(mask)``). ``logprobs [N, T]`` are log pi(y_t | x, y_<t) of the demonstration's tokens, with
gradient. An entry declares what else it needs as keyword-only parameters without a default, from
:data:`INPUTS` (the trainer computes those and only those, in the same forward pass); keyword-only parameters
with a default are hyper-parameters.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("sft loss")
register = REGISTRY.register
names = REGISTRY.names
inputs = REGISTRY.required  # the inputs an entry requires (keyword-only, no default)

# The inputs the SFT trainer provides, by name: per-token functions of the policy's logits, with gradient.
INPUTS = {
    "logsumexp": "[N, T] log sum_a exp(z_t(a)) of the policy's logits z_t at each demonstration position: "
    "the soft value V(s_t) when the logits are read as Q-values",
}


def compute(name: str, logprobs: Tensor, mask: Tensor, **params: object) -> Tensor:
    """Look up SFT loss ``name`` and return its masked per-token loss ``[N, T]``; unknown parameters or a
    missing input raise ``TypeError`` naming them.
    """
    fn = REGISTRY.get(name)
    REGISTRY.check_params(name, params)
    mask_NT = mask.to(logprobs.dtype)
    return fn(logprobs, mask_NT, **params) * mask_NT


def next_value(v_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """V at the next trained position of each row, ``[N, T]``; 0 after a row's last trained token (the end).

    Position t reads the first k > t with mask 1: in a multi-turn demonstration the state after the environment's
    reply (its tokens are attended to, not trained), so the next state of a turn's last token is the next turn's
    first. Rows ``[v0, v1, v2]`` with mask ``[1, 1, 1]`` give ``[v1, v2, 0]``.
    """
    n, t = mask_NT.shape
    pos = torch.arange(t, device=mask_NT.device).expand(n, t)
    idx = torch.where(mask_NT > 0, pos, torch.full_like(pos, t))  # t: no trained position (the end)
    after = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], t)], 1)  # candidates k > t
    first = after.flip(-1).cummin(-1).values.flip(-1)  # the smallest trained index after t
    padded = torch.cat([v_NT, torch.zeros_like(v_NT[:, :1])], 1)  # V = 0 past the end
    return padded.gather(1, first)


@register("mle")
def mle(logp_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Maximum likelihood (next-token prediction): l_t = -log pi(y_t | x, y_<t); the token mean is SFT's loss.

    The default of ``sft.loss``. Shapes ``[N, T]`` -> ``[N, T]``. Nearest neighbour: ``iq_learn`` adds a
    temporal-difference regularizer on the logits read as Q-values (its coef = 0 is this loss).
    """
    return -logp_NT


@register("iq_learn")
def iq_learn(
    logp_NT: Tensor,
    mask_NT: Tensor,
    *,
    logsumexp: Tensor,
    coef: float = 0.1,
    gamma: float = 1.0,
) -> Tensor:
    """IRL imitation: inverse soft-Q learning as TD-regularized MLE, l_t = -log pi_t + coef (Q_t - gamma V_{t+1})^2.

    The logits z are soft Q-values, Q(s_t, a) = z_t(a), V(s) = logsumexp_a Q(s, a), pi = softmax(Q), so
    log pi(a_t|s_t) = Q(s_t, a_t) - V(s_t). IQ-Learn's offline objective on the expert's (s, a, s') with the
    chi^2 regularizer, max_Q E[phi(Q(s,a) - gamma V(s'))] - E[V(s) - gamma V(s')], phi(x) = x - x^2 / (4 alpha),
    telescopes to E[log pi(a|s)] - coef E[r(s,a)^2] with the implied reward r_t = Q(s_t,a_t) - gamma V(s_{t+1})
    and coef = 1 / (4 alpha): MLE plus a temporal-difference term that ties each position's logits to the next
    state's value, so that the demonstration's later tokens shape the earlier ones (the sequence, not each
    token alone). coef = 0 is ``mle``. Identity (catalog L147, gamma = 1): r_t + gamma V(s_{t+1}) - V(s_t) =
    log pi_t. V(s_{t+1}) is the next trained position's (:func:`next_value`), 0 after the last token (the
    episode ends). ``logsumexp [N, T]`` = V(s_t), with gradient (the logits' level, which MLE leaves free).
    Hand example (catalog L147): logits [2, 1, 0] at s_t, a_t = 0: V(s_t) = 2.407606, log pi = -0.407606;
    with V(s_{t+1}) = 1.5, gamma = 1: r_t = 2 - 1.5 = 0.5, l_t = 0.407606 + coef 0.25.
    Paper: "Imitating Language via Scalable Inverse Reinforcement Learning", Wulfmeier et al., arXiv:2409.01369,
    seed papers/004_f298e9ec572f7f27.txt:147 (IQ-Learn: Garg et al., arXiv:2106.12142). The regularizer's exact
    form and the paper's coef and gamma were not recovered (catalog L147): the chi^2 form above is IQ-Learn's;
    coef = 0.1 and gamma = 1 are this library's. Offline only (no online samples).
    Nearest neighbour: ``mle`` (each token's likelihood alone).
    """
    if not (isinstance(coef, int | float) and math.isfinite(coef) and coef >= 0):
        raise ValueError(f"coef (the TD regularizer's weight) must be a finite number >= 0; got {coef!r}")
    if not (isinstance(gamma, int | float) and 0 <= gamma <= 1):
        raise ValueError(f"gamma (the discount) must be in [0, 1]; got {gamma!r}")
    q_NT = logp_NT + logsumexp  # Q(s_t, a_t) = log pi_t + V(s_t): the chosen token's logit
    reward_NT = q_NT - gamma * next_value(logsumexp, mask_NT)
    return -logp_NT + coef * reward_NT**2

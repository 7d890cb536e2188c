"""Token-level estimators: REINFORCE++ (with and without a group baseline), GAE, and REINFORCE++ on the
teacher-forcing-induced step reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import _to_tokens, _token_rewards, _whiten, register
from posttrain.algorithms.advantages.group import dr_grpo


def discounted_returns(token_rewards_PGT: Tensor, mask_PGT: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} per response, reset at masked positions.

    Shapes: ``[P, G, T]`` -> ``[P, G, T]`` (not masked). The chain restarts after every position
    with mask 0, as verl's REINFORCE++ does (its "reset after EOS"); in multi-turn data this also
    cuts the return at observation tokens.
    """
    m = mask_PGT.to(token_rewards_PGT.dtype)
    returns = torch.zeros_like(token_rewards_PGT)
    running = torch.zeros_like(token_rewards_PGT[..., 0])
    for t in reversed(range(token_rewards_PGT.shape[-1])):
        # G_t = r_t + gamma * G_{t+1}
        running = token_rewards_PGT[..., t] + gamma * running
        returns[..., t] = running
        # a masked position (padding after EOS) cuts the chain for the tokens before it
        running = running * m[..., t]
    return returns


@register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    *,
    mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++: discounted token returns, whitened over every response token of the batch.

    r_t = outcome on the last response token + token_rewards_t; G_t = sum_{t' >= t} gamma^{t'-t}
    r_{t'} (see ``discounted_returns``); A_t = (G_t - mean) / sqrt(var + 1e-8), with the mean and
    the variance over all masked tokens of the batch. Shapes: rewards ``[P, G]``, mask and
    token_rewards ``[P, G, T]`` -> ``[P, G, T]`` (masked).
    Paper: "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", Hu
    2025, arXiv:2501.03262 (catalog B4; verl ``compute_reinforce_plus_plus_outcome_advantage``).
    Std convention: **unbiased** batch variance (verl ``masked_whiten``), eps 1e-8 inside the root.
    The KL penalty of the paper goes in ``token_rewards`` (-beta * k1 per token).
    Nearest neighbour: ``reinforce_pp_baseline`` first subtracts the group mean of the score.
    """
    tok_PGT = _token_rewards(rewards, mask, token_rewards)
    returns_PGT = discounted_returns(tok_PGT, mask, gamma=gamma)
    m = mask.to(rewards.dtype)
    return _whiten(returns_PGT, m) * m


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Tensor, *, mask: Tensor) -> Tensor:
    """REINFORCE++ with a group baseline: A = whiten(r_i - mean_g r) broadcast to tokens.

    Subtract the group mean of the sequence score, broadcast to every response token, then whiten
    over all masked tokens of the batch. Shapes: rewards ``[P, G]``, mask ``[P, G, T]`` ->
    ``[P, G, T]`` (masked). Paper: REINFORCE++, Hu 2025, arXiv:2501.03262 (catalog B4; verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``). Std convention: no group std;
    **unbiased** batch variance in the whitening. A group of one centres to 0 (verl: mean 0).
    Nearest neighbour: ``grpo`` normalises per group; this normalises once over the batch, so
    low-variance groups are not up-weighted.
    """
    centered_PG = dr_grpo(rewards)
    m = mask.to(rewards.dtype)
    return _whiten(_to_tokens(centered_PG, m), m) * m


def induced_token_rewards(ref_logprobs: Tensor, ref_log_partition: Tensor, mask: Tensor) -> Tensor:
    """The teacher-forcing-induced step reward: r_t = f(a_t | s_t) - V(s_{t+1}), V(s) = log sum_a exp f(a | s).

    f are the logits of a model trained with teacher forcing (MLE), read as soft Q-values (the inverse soft
    Bellman equation Q(s_t, a_t) = r_t + V(s_{t+1})); V after the last response token (or before a masked
    position, where the chain is cut as in ``discounted_returns``) is 0. From the Learner's log-probs
    ``ref_logprobs`` = f(a_t | s_t) - V(s_t) and log-partitions ``ref_log_partition`` = V(s_t) of the frozen
    reference: f(a_t | s_t) = logp_t + V_t. Shapes: all ``[P, G, T]`` (or any ``[..., T]``) -> same, 0 where
    ``mask`` is. So r_t = log p(a_t | s_t) + V(s_t) - V(s_{t+1}), the log-likelihood reward shaped by the potential
    V: a response's return is its log-likelihood plus V(s_1), a constant of its prompt. Example: logp
    [-0.5, -1.0, -0.2], V [2, 3, 1] -> f [1.5, 2.0, 0.8], V_next [3, 1, 0], r [-1.5, 1.0, 0.8] (sum 0.3 = -1.7 + 2).
    Paper: Hao, Liu, Mou, "Teacher Forcing Recovers Reward Functions for Text Generation", NeurIPS 2022,
    arXiv:2210.08708, seed ``papers/004_f298e9ec572f7f27.txt:27`` (catalog 3.14; from the paper's abstract and
    the soft-Q reading of its title: **provisional**, the text was not available).
    """
    m = mask.to(ref_logprobs.dtype)
    v = ref_log_partition.to(ref_logprobs.dtype)
    q = ref_logprobs + v  # f(a_t | s_t): the taken token's logit
    v_next = torch.zeros_like(v)
    v_next[..., :-1] = v[..., 1:] * m[..., 1:]  # V(s_{t+1}); 0 after the last token and before a masked slot
    return (q - v_next) * m


@register("tf_reward")
def tf_reward(
    rewards: Tensor,
    *,
    mask: Tensor,
    induced_rewards: Tensor,
    token_rewards: Tensor | None = None,
    coef: float = 1.0,
    outcome_coef: float = 1.0,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ on the teacher-forcing-induced step reward: r_t = coef * r^TF_t (+ outcome_coef * outcome on the
    last token, + token_rewards_t), A_t = whiten(G_t), G_t = sum_{t' >= t} gamma^{t'-t} r_{t'}.

    ``induced_rewards [P, G, T]`` = ``induced_token_rewards`` of the frozen reference, the teacher-forced (MLE)
    model (the loop provides them: ``prepare/providers.py``, from its logits at the sampling temperature, as every
    Learner log-prob: the paper's are at 1; set ``model.path`` to the SFT model, as the paper starts RL from it).
    The paper's reward is task-agnostic: ``outcome_coef = 0`` drops the verifier and trains on
    the induced reward alone; the default 1 keeps it. Shapes: rewards ``[P, G]``, mask, induced_rewards,
    token_rewards ``[P, G, T]`` -> ``[P, G, T]`` (masked). Std: **unbiased** batch whitening, as ``reinforce_pp``.
    Paper: Hao, Liu, Mou, NeurIPS 2022, arXiv:2210.08708, seed ``papers/004_f298e9ec572f7f27.txt:27`` (catalog
    3.14; **provisional**: the reward's form is the soft-Q reading, and the paper's stabiliser for non-parallel
    data is not built). Example: one response, mask [1, 1, 1], r^TF [-1.5, 1.0, 0.8], outcome 0 -> G [0.3, 1.8,
    0.8]. Nearest neighbour: ``reinforce_pp`` with ``kl_reward_coef``, whose token reward -beta (log pi_old -
    log pi_ref) pulls toward the reference without its V terms.
    """
    tok = coef * induced_rewards.to(rewards.dtype)
    if token_rewards is not None:
        tok = tok + token_rewards.to(rewards.dtype)
    return reinforce_pp(outcome_coef * rewards, mask=mask, token_rewards=tok, gamma=gamma)


def gae_advantages_and_returns(
    token_rewards_PGT: Tensor,
    values_PGT: Tensor,
    mask_PGT: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation, un-whitened; returns (advantages, value targets).

    Shapes: all ``[P, G, T]``; both outputs ``[P, G, T]`` (not masked). The returns
    (advantages + values) are the critic's regression targets. Positions with mask 0 are
    skipped: they pass the next response token's value and advantage through unchanged (verl's
    handling of observation tokens).
    """
    m = mask_PGT.to(token_rewards_PGT.dtype)
    v = values_PGT.to(token_rewards_PGT.dtype)
    adv = torch.zeros_like(token_rewards_PGT)
    next_value = torch.zeros_like(token_rewards_PGT[..., 0])  # V(s_{t+1}); 0 after the last token
    next_adv = torch.zeros_like(next_value)  # A_{t+1}
    for t in reversed(range(token_rewards_PGT.shape[-1])):
        # TD error:   delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        delta = token_rewards_PGT[..., t] + gamma * next_value - v[..., t]
        # recursion:  A_t = delta_t + gamma * lam * A_{t+1}
        adv_t = delta + gamma * lam * next_adv
        # a masked position keeps the carried V(s_{t+1}) and A_{t+1} for the token before it
        next_value = m[..., t] * v[..., t] + (1.0 - m[..., t]) * next_value
        next_adv = m[..., t] * adv_t + (1.0 - m[..., t]) * next_adv
        adv[..., t] = next_adv
    # value target:   R_t = A_t + V(s_t)
    return adv, adv + v


@register("gae", needs_critic=True, note="it reads a value model's V(s_t)")
def gae(
    rewards: Tensor,
    *,
    values: Tensor,
    mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Tensor:
    """PPO's GAE: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.

    r_t = outcome on the last response token + token_rewards_t (put the -beta * k1 KL penalty
    there). The recursion is written out in ``gae_advantages_and_returns``, which also gives the
    critic's targets. Shapes: rewards ``[P, G]``; values, mask, token_rewards ``[P, G, T]`` ->
    ``[P, G, T]`` (masked). Paper: "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", Schulman et al. 2015, arXiv:1506.02438 (catalog B10; verl
    ``compute_gae_advantage_return``). Defaults gamma = lam = 1.0 are verl's; the catalog's worked
    example uses lam = 0.95. Std convention: with ``whiten=True`` (verl) the advantages are
    whitened over all masked tokens with the **unbiased** variance. Nearest neighbour:
    ``reinforce_pp`` is the critic-free case (V = 0, lam = 1).
    """
    tok_PGT = _token_rewards(rewards, mask, token_rewards)
    adv_PGT, _ = gae_advantages_and_returns(tok_PGT, values, mask, gamma=gamma, lam=lam)
    m = mask.to(rewards.dtype)
    if whiten:
        adv_PGT = _whiten(adv_PGT, m)
    return adv_PGT * m
